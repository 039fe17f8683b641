"""A file ds4f keeps written whole or not at all: its bytes go to a `.partial` beside it (named for
the process and thread writing it, flock'd while they are written), are flushed to disk, then the
`.partial` is renamed to the file. A writer killed on the way leaves its `.partial` with nobody
holding the lock: sweep_partials removes those (never a live writer's, whose lock is held).

    with written_whole(path) as f: f.write(...)      # path is whole, or unchanged
    sweep_partials(directory, log=log)               # the .partial files of writers that are gone
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

from ds4f.safe_read import not_regular

SUFFIX = ".partial"


@contextlib.contextmanager
def written_whole(path: str | os.PathLike):
    """A binary file to write `path`'s bytes to: `<name>.<pid>.<thread>.partial`, locked until it
    is closed, flushed and fsynced, then renamed to `path` when the block ends. Anything raised in
    the block or by the write removes the .partial (and leaves `path` as it was) and goes on."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        with open(fd, "wb") as f:
            fcntl.flock(fd, fcntl.LOCK_EX)        # held until closed: this writer is alive
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def sweep_partials(directory: str | os.PathLike, log=None, *, pattern: str = f"*{SUFFIX}",
                   label: str = "prefix cache") -> int:
    """Remove the `.partial` files (those `pattern` matches) of writers that are gone (killed while
    writing): a live writer holds its file's flock, a dead one's is free. Files of any other kind
    are left alone. How many were removed; `log` is told when any were, as '<label>: <dir>: ...'."""
    removed = 0
    for p in Path(directory).glob(pattern):
        try:
            if not_regular(p.lstat().st_mode) is not None:
                continue
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)              # a live writer's
            continue
        try:
            p.unlink()
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    if removed and log is not None:
        log(f"{label}: {directory}: {removed} unfinished files of writers that are gone removed")
    return removed
