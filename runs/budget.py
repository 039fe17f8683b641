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

Measured without walking every run's directory each time: a finished run's directory does not
change (its files are committed by renames; nothing here rewrites them in place), so its bytes
and newest mtime are kept, keyed by the directory's own (st_dev, st_ino, st_mtime_ns,
st_ctime_ns). A scan is one scandir of the runs directory and one lstat per run's directory; it
walks only the directories that are new or whose key changed (a file added, removed or renamed
into place there, by any process or by hand), those of runs in progress or killed, and
REWALK_PER_SCAN of the longest-unwalked ones (a file rewritten in place leaves its directory's key
as it was: it is counted when its turn comes). A directory changed within RACY_NS of a walk is not
kept (timestamps have a tick: a change in the same tick could leave the key as it was). The kept
measurements are saved beside the lock (LEDGER_NAME, written under it, checked by the same keys),
so a new process walks only what changed since.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ds4f.errors import Ds4fError
from ds4f.units import format_bytes
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
LEDGER_NAME = ".runs.budget.ledger"     # beside the lock: the finished runs' directories measured, by key
LEDGER_FORMAT, LEDGER_VERSION = "ds4f.runs-budget-ledger", 1
LEDGER_EVERY = 64            # directories measured anew before the ledger is written again
LEDGER_MAX_BYTES = 64 << 20  # about 500,000 run directories; a larger ledger is neither written nor read
REWALK_PER_SCAN = 8          # kept measurements walked again each scan, the longest-unwalked first
RACY_NS = 2_000_000_000      # a directory changed this close to a walk is walked again (timestamps' granularity)
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


def _walk(path: str, st: os.stat_result) -> tuple[int, dict, float, list[str], bool]:
    """A run directory's measurement, `st` its lstat: (bytes of the inodes with one link, the
    directory included; {(st_dev, st_ino): bytes} of the files with more, to be counted once across
    the runs directory; the newest mtime of the directory and what is directly in it; the names
    directly in it; whether it holds a directory of its own, walked whole)."""
    own, shared, newest, names, below = st.st_blocks * 512, {}, st.st_mtime, [], []
    stack, top = [path], True
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                children = list(it)
        except OSError:
            children = []
        for c in children:
            try:
                cst = c.stat(follow_symlinks=False)
            except OSError:
                continue
            if top:
                names.append(c.name)
                newest = max(newest, cst.st_mtime)
            if stat.S_ISDIR(cst.st_mode):       # not a run's layout: counted whole, never kept
                own += cst.st_blocks * 512
                stack.append(c.path)
                below.append(c.path)
            elif cst.st_nlink > 1:
                shared[(cst.st_dev, cst.st_ino)] = cst.st_blocks * 512
            else:
                own += cst.st_blocks * 512
        top = False
    return own, shared, newest, names, bool(below)


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


@dataclass(slots=True)
class _Entry:
    parent: Path             # the runs directory (one object for all)
    name: str
    nbytes: int              # on disk now
    charge: int              # what it counts for: an in-progress run's reservation, if more
    removable: bool
    mtime: float
    in_progress: bool = False

    @property
    def path(self) -> Path:
        return self.parent / self.name


@dataclass(slots=True)
class _Known:
    """A finished run directory's measurement, valid while `key` is the directory's."""
    key: tuple               # (st_dev, st_ino, st_mtime_ns, st_ctime_ns) of the directory
    entry: _Entry            # nbytes: `own` and every shared file's bytes; removable, not in progress
    own: int
    shared: dict             # {(st_dev, st_ino): bytes} of files with other links
    seen: int = 0            # the scan that last listed it


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
        # the finished runs' directories measured, by name, the longest-unwalked first (_Known)
        self._scan_lock = threading.Lock()
        self._known: dict[str, _Known] = {}
        self._shared_keys: set = set()          # (st_dev, st_ino) of every file with other links walked since
        self._ledger_read = False
        self._unsaved = 0                       # directories measured anew since the ledger was read or written
        self._runs_dir_id: list | None = None   # (st_dev, st_ino) of the runs directory at the last scan
        self._leftovers: list[Path] | None = None
        self.scans = self.walked = 0            # scans made, run directories walked (measured) in them

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
        """(bytes not in a run's directory, the runs' directories); under the lock, or a read. Walks
        only the directories whose key changed (see the module's docstring)."""
        with self._scan_lock:
            if not self._ledger_read:
                self._ledger_read = True
                self._read_ledger()
            result = self._scan_once(keep, everything=False)
            if result is None:     # a file newly linked from elsewhere: a kept directory may count it as its own
                self._known.clear()
                self._shared_keys = set()
                result = self._scan_once(keep, everything=True)
            return result

    def _scan_once(self, keep: Path | None, everything: bool) -> tuple[int, list[_Entry]] | None:
        self.scans += 1
        scan, known = self.scans, self._known
        loose, entries, counted = 0, [], set()      # counted: the (st_dev, st_ino) of shared files counted
        self._leftovers = []
        try:
            rst = os.lstat(self.runs_dir)
            listing = os.scandir(self.runs_dir)
        except OSError:
            known.clear()
            return 0, entries
        loose += rst.st_blocks * 512
        self._runs_dir_id = [rst.st_dev, rst.st_ino]
        try:
            loose += os.lstat(self.runs_dir.parent / LEDGER_NAME).st_blocks * 512
        except OSError:
            pass
        started = time.time_ns()
        now = started / 1e9
        again = set() if everything else set(itertools.islice(known, REWALK_PER_SCAN))
        keep_name = keep.name if keep is not None and os.path.dirname(os.path.abspath(keep)) == \
            os.path.abspath(self.runs_dir) else None
        new_shared, listed, hits = False, 0, 0
        with listing as it:
            for e in it:
                name = e.name
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                    st = os.lstat(e.path)
                except OSError:
                    continue
                if not is_dir or not stat.S_ISDIR(st.st_mode):
                    if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                        f = (st.st_dev, st.st_ino)
                        new_shared |= f not in self._shared_keys
                        self._shared_keys.add(f)
                        loose += _claim(0, {f: st.st_blocks * 512}, counted)
                    else:
                        loose += st.st_blocks * 512
                    continue
                key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
                k = known.get(name)
                if k is not None and k.key == key and name not in again:
                    k.seen = scan
                    listed += 1
                    hits += 1
                    ent = k.entry
                    if k.shared:
                        n = _claim(k.own, k.shared, counted)
                        if n != ent.nbytes:
                            ent = replace(ent, nbytes=n, charge=n)
                    if name == keep_name:
                        ent = replace(ent, removable=False)
                    entries.append(ent)
                    continue
                # new, changed, or its turn to be walked again
                own, shared, newest, names, nested = _walk(e.path, st)
                self.walked += 1
                if shared and not self._shared_keys.issuperset(shared):
                    new_shared = True
                    self._shared_keys.update(shared)
                p = Path(e.path)
                partial = any(n.endswith(PARTIAL) for n in names)
                if not partial and not nested and max(st.st_mtime_ns, st.st_ctime_ns) < started - RACY_NS:
                    old = known.pop(name, None)
                    total = own + sum(shared.values())
                    k = known[name] = _Known(key, _Entry(self.runs_dir, name, total, total, True, newest), own, shared, scan)
                    listed += 1
                    if old is None or (old.key, old.own, old.shared, old.entry.mtime) != (key, own, shared, newest):
                        self._unsaved += 1
                    n = _claim(own, shared, counted)
                    ent = k.entry if n == total else replace(k.entry, nbytes=n, charge=n)
                    entries.append(replace(ent, removable=False) if name == keep_name else ent)
                    continue
                known.pop(name, None)      # (a kept one that changed: not kept while it changes)
                nbytes = _claim(own, shared, counted)
                reserved_file = p / RESERVATION
                held = _held(reserved_file) if RESERVATION in names else None
                charge, removable, live = nbytes, True, False
                if held:
                    charge, removable, live = max(nbytes, _reserved(reserved_file)), False, True
                elif held is None and RUN_STATE + PARTIAL in names:
                    # a writer without a reservation: running, or just starting (its lock not yet
                    # taken: never touched then), or killed (unlocked and old: sweep_run_dirs's rule)
                    if now - newest < LEFTOVER_AGE_S or _held(p / (RUN_STATE + PARTIAL)):
                        removable, live = False, True
                if not held and RUN_STATE + PARTIAL in names:     # sweep_run_dirs decides (age, its lock)
                    self._leftovers.append(p)
                if name == keep_name:
                    removable = False
                entries.append(_Entry(self.runs_dir, name, nbytes, charge, removable, newest, live))
        if new_shared and hits and not everything:     # what was kept before counted a file now shared?
            return None
        if listed < len(known):         # removed (by another process, by hand) since: forgotten
            for name in [n for n, k in known.items() if k.seen != scan]:
                del known[name]
        return loose, entries

    def leftover_dirs(self) -> list[Path] | None:
        """The run directories the last scan found holding a state.bin.partial without a run's
        reservation held (what a killed run may have left: statedump.sweep_run_dirs's candidates,
        which it checks for their age and lock); None before the first scan."""
        with self._scan_lock:
            return None if self._leftovers is None else list(self._leftovers)

    def _forget(self, name: str) -> None:
        with self._scan_lock:
            self._known.pop(name, None)

    # -- the ledger: the kept measurements, for the next process -----------------------------------
    @property
    def ledger_path(self) -> Path:
        return self.runs_dir.parent / LEDGER_NAME

    def _read_ledger(self) -> None:
        """The measurements another process (or this one, earlier) kept; anything unreadable, of
        another runs directory or not what the writer writes is ignored whole (every directory is
        then walked once). Each is used only while its directory's key is the one it names."""
        try:
            fd = os.open(self.ledger_path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > LEDGER_MAX_BYTES:
                return
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(LEDGER_MAX_BYTES + 1)
            rst = os.lstat(self.runs_dir)
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != LEDGER_FORMAT or \
                    doc.get("version") != LEDGER_VERSION or doc.get("runs_dir") != [rst.st_dev, rst.st_ino]:
                return
            known = {}
            for row in doc["dirs"]:
                name, dev, ino, mtime_ns, ctime_ns, own, newest, shared = row
                if not (type(name) is str and name not in ("", ".", "..") and "/" not in name and "\0" not in name
                        and all(type(v) is int for v in (dev, ino, mtime_ns, ctime_ns, own)) and own >= 0
                        and type(newest) in (int, float) and isinstance(shared, list)):
                    return
                sh = {}
                for d, i, b in shared:
                    if not (type(d) is int and type(i) is int and type(b) is int and b >= 0):
                        return
                    sh[(d, i)] = b
                total = own + sum(sh.values())
                known[name] = _Known((dev, ino, mtime_ns, ctime_ns),
                                     _Entry(self.runs_dir, name, total, total, True, float(newest)), own, sh)
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return
        finally:
            os.close(fd)
        self._known = known
        self._shared_keys = {f for k in known.values() if k.shared for f in k.shared}

    def _write_ledger(self) -> None:
        """The kept measurements beside the lock (written whole, then renamed: a reader sees the
        old one or the new one), once LEDGER_EVERY directories were measured anew; under the lock.
        Not written is no error: a process without it walks the directories once."""
        with self._scan_lock:
            if self._unsaved < LEDGER_EVERY or self._runs_dir_id is None:
                return
            rows = [[n, *k.key, k.own, k.entry.mtime, [[d, i, b] for (d, i), b in k.shared.items()]]
                    for n, k in self._known.items()]
            text = json.dumps({"format": LEDGER_FORMAT, "version": LEDGER_VERSION, "runs_dir": self._runs_dir_id,
                               "dirs": rows}, separators=(",", ":"))
            self._unsaved = 0
        if len(text) > LEDGER_MAX_BYTES:
            return
        tmp = self.ledger_path.with_name(LEDGER_NAME + PARTIAL)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.ledger_path)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass

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
        doomed = sorted((e for e in entries if e.removable), key=lambda e: (e.mtime, e.name)) \
            if runs + hist + need > self.budget else ()
        for e in doomed:
            if runs + hist + need <= self.budget:
                break
            shutil.rmtree(e.path, ignore_errors=True)
            self._forget(e.name)
            left = disk_usage(e.path) if e.path.exists() else 0
            freed = e.charge - left
            runs -= freed
            gone.append(e.name)
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
        self._write_ledger()
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


def _claim(own: int, shared: dict, counted: set) -> int:
    """`own` and the bytes of the `shared` files not `counted` yet (then counted)."""
    for key, nbytes in shared.items():
        if key not in counted:
            counted.add(key)
            own += nbytes
    return own


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
