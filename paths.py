"""The user's directories for ds4f (platformdirs: XDG on Linux): the config file, the data
(the run history, runs' state dumps and reports) and the cache (the demo and bench checkpoints,
the measured disk floors); and the checks of a path the user gives (a config's path keys, a
directory option). Reading a file the user names is ds4f.safe_read's."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import platformdirs

from ds4f.errors import Ds4fError
from ds4f.safe_read import not_regular


def user_config_path() -> Path:
    return Path(platformdirs.user_config_dir("ds4f")) / "ds4f.toml"


def user_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("ds4f"))


def user_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("ds4f"))


# -- paths the user gives -------------------------------------------------------------------------
def check_path_value(value: str, where: str, *, param: str | None = None) -> str:
    """A path given as a config value or option: refused when no file could have that name (a NUL
    byte, a name longer than the system takes)."""
    if "\x00" in value:
        raise Ds4fError(f"{where}: a path with a NUL byte ({value!r}) names no file", param=param)
    try:
        encoded = os.fsencode(value)
    except UnicodeEncodeError:
        raise Ds4fError(f"{where}: {value!r} is not a path this system can encode", param=param) from None
    if len(encoded) >= 4096 or any(len(part) > 255 for part in encoded.split(b"/")):
        raise Ds4fError(f"{where}: a path longer than the system takes (4096 bytes, 255 a name): {value[:60]!r}...",
                        param=param)
    return value


def directory_problem(path) -> str | None:
    """Why `path` cannot be a directory ds4f makes and writes in: it is a file (a regular one, a
    FIFO, ...), or the nearest part of it that exists is not a directory; None when it is one or
    can be made (whether it may be written is found when it is)."""
    p = Path(os.path.expanduser(os.fspath(path)))
    for part in (p, *p.parents):
        try:
            mode = part.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue               # a parent's turn
        except (OSError, ValueError):
            return None            # a place that cannot be looked at: said when it is written
        if stat.S_ISDIR(mode):
            return None
        what = not_regular(mode) or "a regular file"
        return f"{part} is {what}, not a directory" if part == p else f"{part} is {what}, so {p} cannot be a directory"
    return None
