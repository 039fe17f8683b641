"""The runs directory's disk budget ([runs] budget in ds4f.toml).

A run without a dump path of its own writes its state.bin and report.json in its own directory
under <data dir>/runs/, and every run's record goes to the history database. Both are bounded
together by [runs] budget: before a run writes there it makes room for what it plans to write,
removing the oldest finished runs' directories first; after it, what it really wrote is counted
again. When no finished run's files are left to remove and the total is still past the budget,
the oldest rows of the history go (and the database is compacted).

Counted across processes: every figure is the directory's real usage on disk (st_blocks of each
file, each inode once), read while holding an exclusive flock on `.runs.budget.lock` beside the
runs directory, never a per-process counter. A run in progress holds a lock on `reserved.partial` in its directory,
which also says the bytes it plans to write: it is charged that much (or what it holds, if more)
and it is never removed; a directory whose `reserved.partial` nobody holds was left by a killed
run and goes first among the candidates of its age. A history row whose files were removed
stays: the server answers 410 (gone) for its state dump.
"""
from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ds4f.engine.config import format_bytes
from ds4f.errors import Ds4fError
from ds4f.runs.statedump import PARTIAL, RUN_STATE, record_nbytes

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: counted, not locked
    fcntl = None

LOCK_NAME = ".runs.budget.lock"          # beside the runs directory (in the data directory)
RESERVATION = "reserved" + PARTIAL      # a run's planned bytes, locked while it runs (a *.partial: swept)
LEFTOVER_AGE_S = 60.0        # an unlocked state.bin.partial untouched this long is a killed run's (sweep_run_dirs)
FIGURES_MAX_AGE_S = 1.0      # /status and the console read a measurement at most this old
HISTORY_SUFFIXES = ("", "-wal", "-shm", "-journal")
# what a run's report.json takes, bounding it from above: the summary, layers and events, then per
# step a token's record (about 470 bytes of JSON), per prompt token its id twice, and the text
REPORT_BASE = 64 * 1024
REPORT_PER_STEP = 640
REPORT_PER_PROMPT_TOKEN = 32
HEADER_BASE = 8192           # a state dump's header: the geometry and settings, then 8 bytes a prompt token


def planned_bytes(geometry: dict, mode: str, prompt_len: int, steps: int, text_chars: int = 0) -> int:
    """What a run writes in its directory at most: its state dump (exact but for the header) and
    an upper estimate of its report."""
    if mode == "off":
        return 0
    state = HEADER_BASE + 8 * prompt_len + steps * record_nbytes(geometry, mode)
    report = REPORT_BASE + steps * REPORT_PER_STEP + prompt_len * REPORT_PER_PROMPT_TOKEN + 8 * text_chars
    return state + report


def disk_usage(path: str | os.PathLike, seen: set | None = None) -> int:
    """Bytes `path` takes on disk (st_blocks, as du counts them): a directory with everything
    under it, no link followed, each inode once (`seen`: the inodes counted already)."""
    seen = set() if seen is None else seen
    total = 0
    stack = [os.fspath(path)]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            continue
        seen.add(key)
        total += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode):
            try:
                with os.scandir(p) as it:
                    stack.extend(e.path for e in it)
            except OSError:
                pass
    return total


def _newest_mtime(d: Path) -> float:
    newest = 0.0
    try:
        newest = d.lstat().st_mtime
        with os.scandir(d) as it:
            for e in it:
                try:
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    pass
    except OSError:
        pass
    return newest


def _held(path: Path) -> bool | None:
    """Whether a live process holds the flock of `path` (None: no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return True          # cannot tell: taken as held, never removed
    try:
        if fcntl is None:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        return False
    finally:
        os.close(fd)


def _reserved(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return max(0, int(f.read(32).decode("ascii").strip() or 0))
    except (OSError, ValueError, UnicodeDecodeError):
        return 0


@dataclass
class _Entry:
    path: Path
    nbytes: int              # on disk now
    charge: int              # what it counts for: an in-progress run's reservation, if more
    removable: bool
    mtime: float
    in_progress: bool = False


class Reservation:
    """A run's place in the runs directory: its directory, and `reserved.partial` locked while it
    runs. release() (idempotent) unlinks it, and removes the directory if nothing else is in it
    (a cancelled or failed run leaves no empty directory)."""

    def __init__(self, run_dir: Path, nbytes: int, fd: int | None, notes: list[str] | None = None):
        self.run_dir, self.nbytes, self._fd = run_dir, nbytes, fd
        self.notes = notes or []          # what making room for it removed

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            (self.run_dir / RESERVATION).unlink(missing_ok=True)
        except OSError:
            pass
        os.close(fd)
        try:
            self.run_dir.rmdir()
        except OSError:
            pass


class RunsBudget:
    """The budget of one runs directory and one history database, shared by every run of this
    process that writes there (runs_budget_for); the removals it made are counted here."""

    def __init__(self, runs_dir: str | os.PathLike, budget: int, history_path: str | os.PathLike | None = None,
                 source: str = "ds4f.toml"):
        self.runs_dir = Path(runs_dir)
        self.budget = int(budget)
        self.history_path = Path(history_path) if history_path is not None else None
        self.source = source
        self._lock = threading.Lock()
        self.removed_runs = self.removed_bytes = self.removed_rows = 0
        self._figures: dict | None = None
        self._measured_at = 0.0

    @property
    def setting(self) -> str:
        return f"[runs] budget of {format_bytes(self.budget)} in {self.source}"

    # -- the lock and the measurement -------------------------------------------------------------
    def _locked(self):
        return _DirLock(self.runs_dir)

    def history_bytes(self) -> int:
        if self.history_path is None:
            return 0
        seen: set = set()
        return sum(disk_usage(f"{self.history_path}{s}", seen) for s in HISTORY_SUFFIXES)

    def _scan(self, keep: Path | None) -> tuple[int, list[_Entry]]:
        """(bytes not in a run's directory, the runs' directories); under the lock."""
        loose, entries, seen = 0, [], set()
        try:
            loose += disk_usage_self(self.runs_dir, seen)
            it = list(os.scandir(self.runs_dir))
        except OSError:
            return loose, entries
        now = time.time()
        for e in it:
            p = Path(e.path)
            if not e.is_dir(follow_symlinks=False):
                loose += disk_usage(p, seen)
                continue
            nbytes = disk_usage(p, seen)
            mtime = _newest_mtime(p)
            reserved_file = p / RESERVATION
            held = _held(reserved_file)
            charge, removable, live = nbytes, True, False
            if held:
                charge, removable, live = max(nbytes, _reserved(reserved_file)), False, True
            elif held is None and (p / (RUN_STATE + PARTIAL)).exists():
                # a writer without a reservation: running, or just starting (its lock not yet
                # taken: never touched then), or killed (unlocked and old: sweep_run_dirs's rule)
                if now - mtime < LEFTOVER_AGE_S or _held(p / (RUN_STATE + PARTIAL)):
                    removable, live = False, True
            if keep is not None and p == keep:
                removable = False
            entries.append(_Entry(p, nbytes, charge, removable, mtime, live))
        return loose, entries

    def _measure(self, keep: Path | None = None) -> tuple[int, int, list[_Entry]]:
        loose, entries = self._scan(keep)
        return loose + sum(e.charge for e in entries), self.history_bytes(), entries

    # -- making room ---------------------------------------------------------------------------------
    def _make_room(self, need: int, keep: Path | None, history) -> tuple[int, list[str]]:
        """Remove the oldest finished runs' directories, then the oldest history rows, until the
        directory, the history and `need` more fit the budget; (the total after, notes). Under the lock."""
        runs, hist, entries = self._measure(keep)
        notes: list[str] = []
        gone, gone_bytes = [], 0
        for e in sorted((e for e in entries if e.removable), key=lambda e: (e.mtime, e.path.name)):
            if runs + hist + need <= self.budget:
                break
            shutil.rmtree(e.path, ignore_errors=True)
            left = disk_usage(e.path) if e.path.exists() else 0
            freed = e.charge - left
            runs -= freed
            gone.append(e.path.name)
            gone_bytes += freed
        if gone:
            with self._lock:
                self.removed_runs += len(gone)
                self.removed_bytes += gone_bytes
            notes.append(f"runs directory: removed the files of {len(gone)} older run{'s' if len(gone) != 1 else ''}"
                         f" ({format_bytes(gone_bytes)}: {', '.join(gone[:4])}{', …' if len(gone) > 4 else ''})"
                         f" to stay within the {self.setting}")
        if runs + hist + need > self.budget and history is not None and hist:
            rows = self._trim_history(history, runs + hist + need - self.budget)
            if rows:
                hist = self.history_bytes()
                notes.append(f"run history: removed its {rows} oldest record{'s' if rows != 1 else ''} to stay"
                             f" within the {self.setting} ({history.path} is {format_bytes(hist)} now)")
        self._remember(runs, hist, entries)
        return runs + hist, notes

    def _trim_history(self, history, excess: int) -> int:
        """The oldest rows out of the history until `excess` bytes (and a tenth of the budget more,
        so that it is compacted seldom) are gone, then compacted; the rows removed."""
        try:
            rows = history.trim(excess + self.budget // 10)
        except Ds4fError:
            return 0
        with self._lock:
            self.removed_rows += rows
        return rows

    def _remember(self, runs: int, hist: int, entries: list[_Entry]) -> None:
        with self._lock:
            self._figures = {"dir": str(self.runs_dir), "budget_bytes": self.budget, "used_bytes": runs + hist,
                             "runs_bytes": runs, "history": str(self.history_path) if self.history_path else None,
                             "history_bytes": hist, "runs": len(entries),
                             "in_progress": sum(1 for e in entries if e.in_progress),
                             "removed": self.removed_runs, "removed_bytes": self.removed_bytes,
                             "history_rows_removed": self.removed_rows}
            self._measured_at = time.monotonic()

    def reserve(self, run_dir: Path, nbytes: int, history=None) -> Reservation:
        """A new run's place: room made for `nbytes`, its directory made, `reserved.partial` written
        and locked. Refused (kind busy) when runs in progress and what is not a run's leave no room."""
        run_dir = Path(run_dir)
        if nbytes > self.budget:
            raise Ds4fError(f"dump: the run would write {format_bytes(nbytes)} in {self.runs_dir}, past the"
                            f" {self.setting}: ask for a smaller dump (--dump compact or off), or raise it",
                            param="dump")
        with self._locked():
            total, notes = self._make_room(nbytes, None, history)
            if total + nbytes > self.budget:
                raise Ds4fError(f"dump: {self.runs_dir} holds {format_bytes(total)} of runs in progress and files"
                                f" that are not a finished run's; this run needs {format_bytes(nbytes)} more, past the"
                                f" {self.setting}; try again when a run has finished", param="dump", kind="busy")
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(run_dir / RESERVATION, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as exc:
                raise Ds4fError(f"{run_dir}: cannot create the run's directory: {exc.strerror}",
                                path=str(run_dir)) from None
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, str(nbytes).encode())
            except OSError as exc:
                os.close(fd)
                raise Ds4fError(f"{run_dir / RESERVATION}: cannot write: {exc.strerror}", path=str(run_dir)) from None
        return Reservation(run_dir, nbytes, fd, notes)

    def settle(self, reservation: Reservation | None = None, keep: Path | None = None, history=None) -> list[str]:
        """After a run: its reservation given up and what it really wrote counted, older runs (then
        history rows) removed if the total is past the budget; `keep` (its directory) stays."""
        with self._locked():
            if reservation is not None:
                reservation.release()
            total, notes = self._make_room(0, keep, history)
        if total > self.budget:
            notes.append(f"runs directory: {format_bytes(total)} with the history, past the {self.setting}: what is"
                         f" left is runs in progress, this run's and files that are not a run's")
        return notes

    def figures(self, max_age_s: float = FIGURES_MAX_AGE_S) -> dict:
        """The budget and the bytes used (a measurement at most max_age_s old), and what this
        process removed to keep within it."""
        with self._lock:
            fresh = self._figures is not None and time.monotonic() - self._measured_at <= max_age_s
            if fresh:
                return {**self._figures, "budget_bytes": self.budget}
        loose, entries = self._scan(None)       # a read: no lock needed, nothing removed
        runs = loose + sum(e.charge for e in entries)
        self._remember(runs, self.history_bytes(), entries)
        with self._lock:
            return dict(self._figures)


def disk_usage_self(path: Path, seen: set) -> int:
    """The bytes of a directory entry itself (not what is under it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    seen.add((st.st_dev, st.st_ino))
    return st.st_blocks * 512


class _DirLock:
    """An exclusive flock on LOCK_NAME beside the runs directory (the directory made first)."""

    def __init__(self, runs_dir: Path):
        self.path = runs_dir.parent / LOCK_NAME
        self.fd: int | None = None

    def __enter__(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise Ds4fError(f"{self.path}: cannot open the runs directory's lock: {exc.strerror}",
                            path=str(self.path)) from None
        if fcntl is not None:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        return False


_REGISTRY: dict[tuple[str, str], RunsBudget] = {}
_REGISTRY_LOCK = threading.Lock()


def runs_budget_for(runs_dir: str | os.PathLike, budget: int, history_path: str | os.PathLike | None = None,
                    source: str = "ds4f.toml") -> RunsBudget:
    """This process's RunsBudget of a runs directory and history (one each, so its removals are
    counted in one place), with the budget given."""
    key = (os.path.abspath(runs_dir), os.path.abspath(history_path) if history_path is not None else "")
    with _REGISTRY_LOCK:
        b = _REGISTRY.get(key)
        if b is None:
            b = _REGISTRY[key] = RunsBudget(runs_dir, budget, history_path, source)
        b.budget, b.source = int(budget), source
        return b
