"""The user's directories for ds4f (platformdirs: XDG on Linux): the config file, the data
(the run history, runs' state dumps and reports) and the cache (the demo and bench checkpoints,
the measured disk floors); and reading a file the user names (read_user_file and its kin), the
same checks everywhere: a regular file only (a FIFO, device or directory is refused without
blocking), a bound on its size that does not trust st_size, JSON nested within a bound."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import platformdirs

from ds4f.errors import Ds4fError, parse_json
from ds4f.safe_read import not_regular


def user_config_path() -> Path:
    return Path(platformdirs.user_config_dir("ds4f")) / "ds4f.toml"


def user_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("ds4f"))


def user_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("ds4f"))


# -- files the user names: read safely ------------------------------------------------------------
MAX_JSON_DEPTH = 64        # arrays and objects inside one another in a JSON file the user names


def _size(n: int) -> str:
    if n >= 1 << 20 and not n % (1 << 20):
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} bytes"


def _open_regular(path, what: str, param: str | None) -> tuple[int, str]:
    """An fd open for reading on the regular file `path`, opened without blocking (a FIFO with no
    writer, a tty) and refused unless fstat says it is a regular file (a FIFO, device, socket or
    directory is never read: st_size says nothing of what they hold)."""
    try:
        shown = os.path.expanduser(os.fspath(path))
    except (TypeError, ValueError):
        shown = str(path)
    if "\x00" in shown:
        raise Ds4fError(f"{what} {shown!r}: a path with a NUL byte names no file", param=param, path=None)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(shown, flags)
    except FileNotFoundError:
        raise Ds4fError(f"{what} {shown}: cannot read: no such file", param=param, path=shown) from None
    except OSError as exc:
        raise Ds4fError(f"{what} {shown}: cannot read: {exc.strerror or exc}", param=param, path=shown) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise Ds4fError(f"{what} {shown}: cannot read: {exc.strerror or exc}", param=param, path=shown) from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise Ds4fError(f"{what} {shown}: cannot read: {not_regular(mode)}, not a regular file", param=param,
                        path=shown)
    return fd, shown


def read_user_file(path, what: str, max_bytes: int, *, param: str | None = None) -> bytes:
    """The bytes of a file the user named (a config, a tools file, a token file), refused with a
    Ds4fError naming `what` and the path when it is not a regular file or holds more than
    `max_bytes`: at most max_bytes + 1 bytes are ever read, whatever st_size says."""
    fd, shown = _open_regular(path, what, param)
    chunks, n = [], 0
    try:
        while n <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
    except OSError as exc:
        raise Ds4fError(f"{what} {shown}: cannot read: {exc.strerror or exc}", param=param, path=shown) from None
    finally:
        os.close(fd)
    if n > max_bytes:
        raise Ds4fError(f"{what} {shown}: larger than {_size(max_bytes)}; not read", param=param, path=shown)
    return b"".join(chunks)


def read_user_text(path, what: str, max_bytes: int, *, param: str | None = None, encoding: str = "utf-8") -> str:
    """read_user_file, decoded; text that is not `encoding` is refused naming the byte."""
    data = read_user_file(path, what, max_bytes, param=param)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise Ds4fError(f"{what} {os.path.expanduser(os.fspath(path))}: not {encoding.upper()} text (byte"
                        f" {exc.start})", param=param, path=os.fspath(path)) from None


def read_user_json(path, what: str, max_bytes: int, *, param: str | None = None,
                   max_depth: int = MAX_JSON_DEPTH):
    """read_user_file as JSON: malformed, not UTF-8, or nested deeper than `max_depth` arrays and
    objects is a Ds4fError naming the file (what reads it next may walk it recursively)."""
    data = read_user_file(path, what, max_bytes, param=param)
    where = f"{what} {os.path.expanduser(os.fspath(path))}"
    try:
        return parse_json(data, where, max_depth=max_depth, param=param)
    except Ds4fError as exc:
        raise Ds4fError(exc.message, param=param, path=os.fspath(path)) from None


def open_user_file(path, what: str, *, param: str | None = None):
    """A binary file object on a regular file the user named, for reading (a state dump, a
    trace): a FIFO, device, socket or directory is refused at once instead of blocking or
    reading without end. The caller bounds what it reads."""
    fd, _shown = _open_regular(path, what, param)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


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
