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


def parse_json(data: str | bytes, where: str, max_depth: int | None = None, param: str | None = None):
    """json.loads with every way it can fail as a Ds4fError that names `where` (a file, "body"):
    malformed, not UTF-8, or nested too deeply for the parser (a RecursionError otherwise), or
    deeper than `max_depth` arrays and objects (what reads it later may recurse once a level).
    param: the Ds4fError's (an invalid request's parameter; None: a file's data error)."""
    import json

    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text)
    except UnicodeDecodeError as exc:
        raise Ds4fError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})", param=param) from None
    except RecursionError:
        raise Ds4fError(f"{where}: JSON nested too deeply to read" + (f" (at most {max_depth} levels of arrays and"
                        f" objects)" if max_depth else ""), param=param) from None
    except ValueError as exc:
        raise Ds4fError(f"{where}: malformed JSON: {exc}", param=param) from None
    if max_depth is not None and isinstance(value, (dict, list)):
        depth = json_depth(text)
        if depth > max_depth:
            raise Ds4fError(f"{where}: JSON nested {depth} levels deep, more than the {max_depth} levels of arrays and"
                            f" objects taken", param=param)
    return value


_STRING = None


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a well-formed JSON text nest (0: a scalar), counted on
    the text without recursion, at C speed: the escapes of its strings taken out (an escaped
    backslash, then an escaped quote), then the strings, then the brackets left counted."""
    global _STRING
    import re

    import numpy as np

    if _STRING is None:
        _STRING = re.compile(r'"[^"]*"')
    bare = _STRING.sub("", text.replace("\\\\", "").replace('\\"', ""))
    code = np.frombuffer(bare.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    opens = (code == ord("[")) | (code == ord("{"))
    steps = np.where(opens[opens | (code == ord("]")) | (code == ord("}"))], 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max()) if steps.size else 0
