"""Reading a file ds4f did not just write itself (a kept state, a state dump, a cache of its own):
only a regular file is opened (a FIFO, a device or a directory under the name would block the open
or never end), and nothing larger than the caller's bound is read.

    with open_regular(path, "state dump") as (f, st): ...   # f a binary file, st its fstat
    data = read_regular(path, "kept state", max_bytes)       # the whole file, at most max_bytes
"""
from __future__ import annotations

import contextlib
import os
import stat

from ds4f.errors import Ds4fError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def not_regular(mode: int) -> str | None:
    """What a file of this st_mode is when it is not a regular file ('a FIFO', ...); None for one."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, what: str):
    """(binary file, its fstat) of `path` when it is a regular file (a symlink to one included).
    Checked before the open (stat) and after it on the descriptor (opened O_NONBLOCK, so a FIFO put
    there between the two never blocks); a Ds4fError naming the file otherwise."""
    path = os.fspath(path)
    try:
        kind = not_regular(os.stat(path).st_mode)
        if kind is not None:
            raise Ds4fError(f"{path}: {kind}, not a regular file, so not a {what}", path=path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise Ds4fError(f"{path}: cannot read the {what}: no such file", path=path, kind="not_found") from None
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read the {what}: {exc.strerror or exc}", path=path) from None
    try:
        st = os.fstat(fd)
        kind = not_regular(st.st_mode)
        if kind is not None:
            raise Ds4fError(f"{path}: {kind}, not a regular file, so not a {what}", path=path)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, st


def read_regular(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The whole of a regular file of at most `max_bytes` bytes; a Ds4fError naming the file when it
    is not one, is larger, or changes size while it is read."""
    with open_regular(path, what) as (f, st):
        if st.st_size > max_bytes:
            raise Ds4fError(f"{path}: {st.st_size} bytes, more than the {max_bytes} a {what} may hold",
                            path=str(path))
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise Ds4fError(f"{path}: cannot read the {what}: {exc.strerror or exc}", path=str(path)) from None
    if len(data) > max_bytes:
        raise Ds4fError(f"{path}: grew past {max_bytes} bytes while it was read, so not a {what}", path=str(path))
    return data
