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
