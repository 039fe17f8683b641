"""Run history: every run's config, report and state-dump hash, kept in SQLite across restarts.

Domain code shared by the console and the HTTP server; nothing here knows about Textual.
One short-lived connection per call plus a process-wide lock per database file, so any thread
may use one History object; WAL journaling lets another process (the server) read while the
console writes.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ds4f.errors import Ds4fError
from ds4f.safe_read import not_regular
from ds4f.native.kernels import SIMD_BACKENDS
from ds4f.runs.statedump import report_path_for

SCHEMA_VERSION = 1

_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS runs (
    run_id       TEXT PRIMARY KEY,
    started_at   REAL NOT NULL,
    finished_at  REAL NOT NULL,
    state        TEXT NOT NULL,
    config       TEXT NOT NULL,
    report       TEXT,
    state_path   TEXT,
    state_sha256 TEXT,
    error        TEXT
);
CREATE INDEX IF NOT EXISTS runs_by_start ON runs (started_at DESC);
CREATE INDEX IF NOT EXISTS runs_by_sha ON runs (state_sha256);
CREATE TABLE IF NOT EXISTS settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()



def _lock_for(path: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(path, threading.Lock())


@dataclass(frozen=True)
class RunRecord:
    """One finished run (done, cancelled or failed) as the history keeps it."""

    run_id: str
    config: dict
    state: str
    report: dict | None
    state_path: str | None
    state_sha256: str | None
    error: str | None
    started_at: float
    finished_at: float
    summary: dict = field(default_factory=dict)  # report["summary"], or {} when there is no report

    # -- conveniences for lists and diffs -------------------------------------------------
    @property
    def short_sha(self) -> str:
        return (self.state_sha256 or "")[:12]

    @property
    def duration_s(self) -> float:
        return max(0.0, self.finished_at - self.started_at)

    @property
    def preset(self) -> str:
        return str(self.config.get("preset", "") or "")

    @property
    def model(self) -> str:
        return str(self.config.get("model", "") or "")

    @property
    def gen(self) -> int | None:
        gen = self.config.get("gen")
        return int(gen) if isinstance(gen, (int, float)) else None

    @property
    def tokens_done(self) -> int:
        if not self.report:   # a cancelled or failed run: the count its record's config carries
            done = self.config.get("tokens_done")
            return int(done) if isinstance(done, int) else 0
        if isinstance(self.report.get("tokens"), list):
            return len(self.report["tokens"])
        summary = self.report.get("summary")
        return int(summary.get("tokens") or 0) if isinstance(summary, dict) else 0

    @property
    def backends(self) -> tuple[str, ...]:
        """The kernel backends the run's tokens used, in order of first use."""
        seen: list[str] = []
        by_token = (self.report or {}).get("backend_by_token") or []
        if not by_token:
            by_token = [t.get("backend") for t in (self.report or {}).get("tokens", []) if isinstance(t, dict)]
        for b in by_token:
            if b and b not in seen:
                seen.append(str(b))
        if not seen:
            b = (self.report or {}).get("backend") or self.summary.get("backend") or self.config.get("backend")
            if b:
                seen.append(str(b))
        return tuple(seen)

    @property
    def backend(self) -> str:
        """One word for the run's kernels: the backend, 'mixed' if it switched, '' if unknown."""
        b = self.backends
        if not b:
            return ""
        return b[0] if len(b) == 1 else "mixed"

    @property
    def kind(self) -> str:
        """'simd', 'scalar', 'mixed' or '' — what the SIMD/scalar comparison pairs on."""
        b = self.backends
        if not b or b == ("auto",):
            return ""
        if all(x == "scalar" for x in b):
            return "scalar"
        if all(x in SIMD_BACKENDS for x in b):
            return "simd"
        return "mixed"

    @property
    def s_per_token(self) -> float | None:
        v = self.summary.get("s_per_token")
        return float(v) if isinstance(v, (int, float)) else None

    def comparable_with(self, other: "RunRecord") -> bool:
        """Same model, prompt, token count and sampling (seed included): their state dumps can be
        compared token by token (two draws with other seeds diverge by design)."""
        keys = ("model", "gen", "prompt", "sampling")
        return all(self.config.get(k) == other.config.get(k) for k in keys)


def hash_groups(records: Iterable[RunRecord]) -> dict[str, int]:
    """sha256 -> how many of the records share it (only hashes held by two or more runs)."""
    counts: dict[str, int] = {}
    for r in records:
        if r.state_sha256:
            counts[r.state_sha256] = counts.get(r.state_sha256, 0) + 1
    return {sha: n for sha, n in counts.items() if n > 1}


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=_json_default)


def _json_default(obj: Any):
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


LOCK_WAIT_S = 10.0      # how long a call waits for another process's lock on the database


class History:
    """The SQLite run history at `path` (created with its parent directory if missing)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Ds4fError(f"{self.path.parent}: cannot create the history directory: {exc.strerror}") from None
        if self.path.is_dir():
            raise Ds4fError(f"{self.path}: is a directory, not a run-history file")
        try:
            kind = not_regular(os.stat(self.path).st_mode)
        except OSError:
            kind = None             # not there yet: SQLite makes it
        if kind is not None:        # SQLite would block on a FIFO or read a device as a disk error
            raise Ds4fError(f"{self.path}: {kind}, not a regular file, so not a run history", path=self.path)
        self._lock = _lock_for(str(self.path.resolve()))
        self._migrate()

    # -- plumbing -------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(str(self.path), timeout=LOCK_WAIT_S, check_same_thread=False)
        except sqlite3.Error as exc:
            raise Ds4fError(f"{self.path}: cannot open the run history: {exc}") from None
        conn.row_factory = sqlite3.Row
        return conn

    def _run(self, fn, write: bool = False):
        with self._lock if write else _NoLock():
            conn = self._connect()
            try:
                with conn:
                    return fn(conn)
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    raise Ds4fError(f"{self.path}: the run history is locked by another process (waited"
                                    f" {LOCK_WAIT_S:g} s)") from None
                raise Ds4fError(f"{self.path}: run history is unreadable ({exc}); move it aside to start afresh") from None
            except sqlite3.DatabaseError as exc:
                raise Ds4fError(f"{self.path}: run history is unreadable ({exc}); move it aside to start afresh") from None
            finally:
                conn.close()

    def _migrate(self) -> None:
        def go(conn: sqlite3.Connection):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise Ds4fError(f"{self.path}: run history has schema version {version}, newer than this "
                                f"ds4f understands ({SCHEMA_VERSION}); upgrade ds4f or use another [history] path")
            if version < 1:
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                except sqlite3.DatabaseError:
                    pass  # e.g. a filesystem without shared memory: the default journal still works
                conn.executescript(_SCHEMA_V1)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

        self._run(go, write=True)

    @staticmethod
    def _record(row: sqlite3.Row) -> RunRecord:
        config = json.loads(row["config"]) if row["config"] else {}
        report = json.loads(row["report"]) if row["report"] else None
        summary = (report or {}).get("summary") or {}
        return RunRecord(run_id=row["run_id"], config=config, state=row["state"], report=report,
                         state_path=row["state_path"], state_sha256=row["state_sha256"], error=row["error"],
                         started_at=row["started_at"], finished_at=row["finished_at"],
                         summary=summary if isinstance(summary, dict) else {})

    # -- runs -----------------------------------------------------------------------------
    def record(self, run_id: str, config: dict, state: str, report: dict | None = None,
               state_path: str | None = None, state_sha256: str | None = None, error: str | None = None,
               started_at: float | None = None, finished_at: float | None = None) -> RunRecord:
        """Store (or replace) one run's record and return it as read back."""
        now = time.time()
        started = float(started_at if started_at is not None else now)
        finished = float(finished_at if finished_at is not None else now)
        row = (str(run_id), started, finished, str(state), _dumps(config or {}),
               _dumps(report) if report is not None else None,
               str(state_path) if state_path else None, state_sha256, error)

        def go(conn: sqlite3.Connection):
            conn.execute("INSERT OR REPLACE INTO runs (run_id, started_at, finished_at, state, config, report,"
                         " state_path, state_sha256, error) VALUES (?,?,?,?,?,?,?,?,?)", row)

        self._run(go, write=True)
        rec = self.get(run_id)
        assert rec is not None
        return rec

    def list_runs(self, limit: int = 200) -> list[RunRecord]:
        """The most recent runs, newest first."""
        rows = self._run(lambda c: c.execute(
            "SELECT * FROM runs ORDER BY started_at DESC, rowid DESC LIMIT ?", (int(limit),)).fetchall())
        return [self._record(r) for r in rows]

    def get(self, run_id: str) -> RunRecord | None:
        row = self._run(lambda c: c.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone())
        return self._record(row) if row else None

    def with_sha(self, sha256: str) -> list[RunRecord]:
        """Every run whose state dump has this hash, newest first."""
        rows = self._run(lambda c: c.execute(
            "SELECT * FROM runs WHERE state_sha256 = ? ORDER BY started_at DESC", (sha256,)).fetchall())
        return [self._record(r) for r in rows]

    def count(self) -> int:
        return int(self._run(lambda c: c.execute("SELECT COUNT(*) FROM runs").fetchone()[0]))

    def delete(self, run_id: str) -> bool:
        """Remove one run's record (not its files: see prune_runs); False if there was none."""
        return bool(self._run(lambda c: c.execute("DELETE FROM runs WHERE run_id = ?", (run_id,)).rowcount,
                              write=True))

    def trim(self, nbytes: int, keep: int = 1) -> int:
        """Remove the oldest records (by start) until they add up to `nbytes` of text, the newest
        `keep` always kept, then compact the file (VACUUM, and the WAL truncated) so that it
        shrinks; the records removed (the runs' files are not touched: see prune_runs)."""
        def go(conn: sqlite3.Connection):
            rows = conn.execute("SELECT run_id, 256 + length(CAST(config AS BLOB)) + coalesce(length(CAST(report AS"
                                " BLOB)), 0) + coalesce(length(CAST(error AS BLOB)), 0) AS n FROM runs"
                                " ORDER BY started_at ASC, rowid ASC").fetchall()
            doomed, total = [], 0
            for r in rows[:max(0, len(rows) - keep)]:
                if total >= nbytes:
                    break
                doomed.append((r["run_id"],))
                total += int(r["n"])
            conn.executemany("DELETE FROM runs WHERE run_id = ?", doomed)
            return len(doomed)

        removed = self._run(go, write=True)
        if removed:
            def compact(conn: sqlite3.Connection):
                conn.execute("VACUUM")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._run(compact, write=True)
        return removed

    def get_setting(self, key: str, default: Any = None) -> Any:
        row = self._run(lambda c: c.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone())
        if row is None:
            return default
        try:
            return json.loads(row["value"])
        except ValueError:
            return default

    def set_setting(self, key: str, value: Any) -> None:
        text = _dumps(value)
        self._run(lambda c: c.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", (key, text)),
                  write=True)


def report_file(record: RunRecord) -> Path | None:
    """Where the run API put a run's report: the path named in its config, else beside its state
    dump (statedump.report_path_for: report.json in the run's own directory when no dump path was
    asked for, else a.bin -> a.report.json). Whether it exists is not checked."""
    if record.config.get("report_path"):
        return Path(record.config["report_path"])
    if record.state_path:
        return report_path_for(record.state_path, own_dir=not record.config.get("dump_path"))
    return None


def run_files(record: RunRecord) -> list[Path]:
    """A run's files: the recorded state dump and its report (report_file). Whether they exist
    is not checked."""
    files = [Path(record.state_path)] if record.state_path else []
    report = report_file(record)
    return files + ([report] if report is not None else [])


def _entry(path: Path) -> Path:
    """The directory entry `path` names: its parent resolved, its own name kept (a symlink stays the link)."""
    path = Path(path).expanduser()
    return path.parent.resolve() / path.name


def is_inside(path: Path, root: Path) -> bool:
    """True if the directory entry `path` lies below `root` (symlinks in its parents resolved)."""
    entry, root = _entry(path), Path(root).expanduser().resolve()
    return entry != root and root in entry.parents


@dataclass
class PrunePlan:
    """What prune_runs removes: `runs` (newest first), the `files` they own inside the data
    directory, and the run directories left empty; `kept` names the files they mention that
    stay, each with the reason."""

    runs: list[RunRecord]
    files: list[Path]
    nbytes: int
    dirs: list[Path]
    kept: list[tuple[Path, str]]
    data_dir: Path


def plan_prune(history: "History", data_dir: str | os.PathLike, keep: int | None = None,
               older_than_s: float | None = None, now: float | None = None) -> PrunePlan:
    """The runs to prune and the files they own.

    A run is pruned when every rule given says so: it is not one of the newest `keep`, and it
    started more than `older_than_s` seconds before `now`. At least one rule is needed. Only
    files inside `data_dir` are owned: a dump the user put elsewhere (--dump-state) stays, as
    does any file a kept run also names, and the history database itself."""
    if keep is None and older_than_s is None:
        raise Ds4fError("prune: give --keep N or --older-than DAYS (or both)")
    if keep is not None and keep < 0:
        raise Ds4fError(f"--keep: must be 0 or more, got {keep}")
    if older_than_s is not None and not older_than_s >= 0:
        raise Ds4fError(f"--older-than: must be 0 or more days, got {older_than_s / 86400:g}")
    now = time.time() if now is None else now
    data_dir = Path(data_dir).expanduser()
    records = history.list_runs(limit=max(history.count(), 1))
    doomed = []
    for i, r in enumerate(records):
        if keep is not None and i < keep:
            continue
        if older_than_s is not None and r.started_at > now - older_than_s:
            continue
        doomed.append(r)
    gone = {r.run_id for r in doomed}
    kept_files = {_entry(f) for r in records if r.run_id not in gone for f in run_files(r)
                  if f.expanduser().is_absolute()}
    protected = {_entry(history.path), *(_entry(Path(f"{history.path}{s}")) for s in ("-wal", "-shm", "-journal"))}
    files, kept, dirs, seen = [], [], [], set()
    nbytes = 0
    for r in doomed:
        for f in run_files(r):
            if not f.expanduser().is_absolute():
                kept.append((f, "a relative path: where the run started is not recorded"))
                continue
            entry = _entry(f)
            if entry in seen or not (entry.is_symlink() or entry.exists()):
                continue
            seen.add(entry)
            if not is_inside(entry, data_dir):
                kept.append((entry, "outside the data directory"))
            elif entry in protected:
                kept.append((entry, "the history database"))
            elif entry in kept_files:
                kept.append((entry, "also a kept run's"))
            elif entry.is_dir() and not entry.is_symlink():
                kept.append((entry, "a directory, not a run's file"))
            else:
                files.append(entry)
                nbytes += entry.lstat().st_size
        run_dir = _entry(data_dir / "runs" / r.run_id)
        if run_dir.is_dir() and not run_dir.is_symlink() and is_inside(run_dir, data_dir):
            dirs.append(run_dir)
    return PrunePlan(runs=doomed, files=files, nbytes=nbytes, dirs=dirs, kept=kept, data_dir=data_dir)


def prune_runs(history: "History", plan: PrunePlan) -> tuple[int, int, list[str]]:
    """Carry out a plan: each run's files, then its record, then its directory if now empty.
    A run whose file cannot be removed keeps its record (a later prune retries).
    Returns (runs removed, files removed, problems)."""
    problems: list[str] = []
    n_runs = n_files = 0
    planned = set(plan.files)
    for r in plan.runs:
        ok = True
        for f in run_files(r):
            if not f.expanduser().is_absolute():
                continue
            entry = _entry(f)
            if entry not in planned:
                continue
            planned.discard(entry)
            try:
                entry.unlink()
                n_files += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                problems.append(f"{entry}: cannot remove: {exc.strerror}")
                ok = False
        if ok and history.delete(r.run_id):
            n_runs += 1
    for d in plan.dirs:
        try:
            d.rmdir()   # only when empty: anything else in it is not the run's to lose
        except OSError:
            pass
    return n_runs, n_files, problems


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
