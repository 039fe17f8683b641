"""Reading a file ds4f did not just write: one the user names (a config, a tools file, a token
file, a trace) or one of its own it finds again (a kept state, a state dump, a checkpoint's JSON,
its tokenizer, the fingerprint store). The same checks everywhere: a regular file only (a FIFO, a
device, a socket or a directory is refused without blocking: opened O_NONBLOCK, checked with
fstat), never more than the caller's bound read whatever st_size says (at most max_bytes + 1),
and a Ds4fError that names what the file is, its path and the option or key that named it.

    with open_regular(path, "state dump") as (f, st): ...      # f a binary file, st its fstat
    data = read_regular(path, "kept state", max_bytes)          # the whole file, at most max_bytes
    text = read_regular_text(path, "config file", max_bytes)    # decoded
    value = read_regular_json(path, "/tools", max_bytes)        # JSON nested within MAX_JSON_DEPTH
"""
from __future__ import annotations

import contextlib
import os
import stat

from ds4f.errors import Ds4fError, parse_json

MAX_JSON_DEPTH = 64        # arrays and objects inside one another in a JSON file read here

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


def not_regular(mode: int) -> str | None:
    """What a file of this st_mode is when it is not a regular file ('a FIFO', ...); None for one."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _size(n: int) -> str:
    if n >= 1 << 20 and not n % (1 << 20):
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n >= 1 << 10 and not n % (1 << 10) else f"{n} bytes"


def _shown(path) -> str:
    try:
        return os.path.expanduser(os.fspath(path))
    except (TypeError, ValueError):
        return str(path)


def _open(path, what: str, param: str | None, missing: str | None) -> tuple[int, os.stat_result, str]:
    """(fd, fstat, the path as shown) of the regular file `path`, the one way every reader here
    opens one: stat'ed first (a device is not even opened), opened without blocking (a FIFO put
    there since, a tty) and fstat'ed (what was opened is what is read). missing: the message when
    there is no such file (kind not_found); else '<what> <path>: cannot read: no such file'."""
    shown = _shown(path)
    if "\x00" in shown:
        raise Ds4fError(f"{what} {shown!r}: a path with a NUL byte names no file", param=param)

    def refused(problem: str, kind: str | None = None) -> Ds4fError:
        return Ds4fError(f"{what} {shown}: cannot read: {problem}", param=param, path=shown, kind=kind)

    try:
        kind = not_regular(os.stat(shown).st_mode)
        if kind is not None:
            raise refused(f"{kind}, not a regular file")
        fd = os.open(shown, _FLAGS)
    except FileNotFoundError:
        if missing is not None:
            raise Ds4fError(missing, param=param, path=shown, kind="not_found") from None
        raise refused("no such file", "not_found") from None
    except OSError as exc:
        raise refused(exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        kind = not_regular(st.st_mode)
        if kind is not None:
            raise refused(f"{kind}, not a regular file")
        os.set_blocking(fd, True)
    except OSError as exc:
        os.close(fd)
        raise refused(exc.strerror or str(exc)) from None
    except BaseException:
        os.close(fd)
        raise
    return fd, st, shown


@contextlib.contextmanager
def open_regular(path, what: str, *, param: str | None = None, missing: str | None = None):
    """(binary file, its fstat) of `path` when it is a regular file (a symlink to one included); a
    Ds4fError naming `what`, the path and `param` otherwise. The caller bounds what it reads."""
    fd, st, _shown_path = _open(path, what, param, missing)
    with os.fdopen(fd, "rb") as f:
        yield f, st


def read_regular(path, what: str, max_bytes: int, *, param: str | None = None, missing: str | None = None) -> bytes:
    """The whole of a regular file of at most `max_bytes` bytes: at most max_bytes + 1 bytes are
    ever read, whatever st_size says (0 for what grows while it is read); a Ds4fError naming
    `what` and the path when it is not such a file or holds more."""
    fd, st, shown = _open(path, what, param, missing)
    too_big = Ds4fError(f"{what} {shown}: larger than {_size(max_bytes)}; not read", param=param, path=shown)
    chunks, n = [], 0
    try:
        if st.st_size > max_bytes:
            raise too_big
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
        raise too_big
    return b"".join(chunks)


def read_regular_text(path, what: str, max_bytes: int, *, param: str | None = None, encoding: str = "utf-8") -> str:
    """read_regular, decoded; text that is not `encoding` is refused naming the byte."""
    data = read_regular(path, what, max_bytes, param=param)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise Ds4fError(f"{what} {_shown(path)}: not {encoding.upper()} text (byte {exc.start})", param=param,
                        path=_shown(path)) from None


def read_regular_json(path, what: str, max_bytes: int, *, param: str | None = None, max_depth: int = MAX_JSON_DEPTH):
    """read_regular as JSON: malformed, not UTF-8, or nested deeper than `max_depth` arrays and
    objects is a Ds4fError naming the file (what reads it next may walk it recursively)."""
    data = read_regular(path, what, max_bytes, param=param)
    try:
        return parse_json(data, f"{what} {_shown(path)}", max_depth=max_depth, param=param)
    except Ds4fError as exc:
        raise Ds4fError(exc.message, param=param, path=_shown(path)) from None
