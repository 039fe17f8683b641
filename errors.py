"""The one exception type a user may see: its message names the file or key and the problem.

Front ends never parse the message: `param` names the request parameter or config key at fault,
`path` the file, and `kind` says what sort of problem it is, so the server can choose an HTTP
status and the CLI an exit code from fields rather than from text.
"""
from __future__ import annotations

# kind -> what it means to a caller
KINDS = {
    "invalid": "a parameter or config value is wrong (fix the request)",
    "busy": "the engine is running something else (retry later)",
    "not_found": "the thing named does not exist",
    "data": "a file is missing, corrupt or unreadable (fix the checkpoint or dump)",
    "internal": "a bug in ds4f",
}


class Ds4fError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""

    def __init__(self, message: str, *, param: str | None = None, path: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.path = str(path) if path is not None else None
        self.kind = kind or ("invalid" if param is not None else "data")
        if self.kind not in KINDS:
            raise ValueError(f"Ds4fError kind {self.kind!r} is not one of {', '.join(KINDS)}")


def parse_json(data: str | bytes, where: str):
    """json.loads with every way it can fail as a Ds4fError that names `where` (a file, "body"):
    malformed, not UTF-8, or nested too deeply for the parser (a RecursionError otherwise)."""
    import json

    try:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except UnicodeDecodeError as exc:
        raise Ds4fError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})", path=None) from None
    except RecursionError:
        raise Ds4fError(f"{where}: JSON nested too deeply to read") from None
    except ValueError as exc:
        raise Ds4fError(f"{where}: malformed JSON: {exc}") from None
