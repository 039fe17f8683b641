"""The prefix cache: session states kept in RAM and on disk, so that a new prompt starts from the
longest prefix of its tokens a state was kept for, and prefills only the rest.

A state is kept for (the checkpoint, the backend, the tokens): its bits are those of the kernels
that computed it, so a prompt reuses only states of its own backend (at any thread count), and
the continuation is then byte for byte a cold run's. RAM holds at most `ram_bytes` of states;
the directory (if any) at most `disk_bytes`, one file per state (engine.session_state's format,
written whole or not at all). When a tier is over its bound, the entry of least value goes first:
value = (hits + 1) x tokens / bytes, the newest entry last. A file that is truncated, damaged or of
another checkpoint, geometry or version is logged and removed, never used; a directory that
cannot be written is logged and the RAM tier goes on alone. Several processes may share one
directory: each writes under a name of its own first, and a file another removed is a miss.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ds4f.engine.session_state import SessionState, canonical, load_state, read_header, save_state
from ds4f.errors import Ds4fError

SUFFIX = ".kv"


@dataclass
class Entry:
    tokens: tuple[int, ...]
    backend: str
    nbytes: int
    state: SessionState | None = None      # in RAM
    path: Path | None = None               # on disk
    hits: int = 0
    used: float = field(default_factory=time.monotonic)

    @property
    def value(self) -> float:
        return (self.hits + 1) * len(self.tokens) / max(self.nbytes, 1)


@dataclass
class CacheStats:
    hits: int = 0                # lookups that found a prefix
    misses: int = 0
    tokens_reused: int = 0       # prompt tokens the hits did not compute
    evictions: int = 0
    rejected_files: int = 0      # disk files refused (damaged, foreign) and removed
    ram_bytes: int = 0
    disk_bytes: int = 0


def _key(backend: str, tokens: tuple[int, ...]) -> str:
    return hashlib.sha256(f"{backend}:{','.join(map(str, tokens))}".encode()).hexdigest()


def _headers(directory: Path):
    """(path, header) of each state file in the directory; the Ds4fError for an unreadable one."""
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        try:
            yield path, read_header(path)
        except Ds4fError as exc:
            yield path, exc


def kept_tokens_on_disk(directory: str | os.PathLike, fingerprint: str, geometry: dict) -> list[tuple[int, ...]]:
    """The token ids of the states a directory keeps for this checkpoint and geometry, longest first,
    read from their headers alone (nothing loaded, nothing removed: a PrefixCache on the directory
    checks and sweeps); [] when there is no such directory."""
    directory, geometry = Path(directory), canonical(geometry)
    if not directory.is_dir():
        return []
    tokens = {tuple(head["tokens"]) for _, head in _headers(directory)
              if not isinstance(head, Ds4fError) and head["checkpoint"] == fingerprint and head["geometry"] == geometry}
    return sorted(tokens, key=len, reverse=True)


class PrefixCache:
    def __init__(self, fingerprint: str, geometry: dict, ram_bytes: int, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 0, log=None) -> None:
        self.fingerprint, self.geometry = fingerprint, canonical(geometry)
        self.ram_bytes, self.disk_bytes = max(0, int(ram_bytes)), max(0, int(disk_bytes))
        self.log = log or (lambda _line: None)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._ram: dict[str, Entry] = {}
        self._disk: dict[str, Entry] = {}
        self.dir_asked = disk_dir            # what it was given (the directory may turn out unwritable)
        self.dir = Path(disk_dir) if disk_dir is not None and self.disk_bytes > 0 else None
        if self.dir is not None:
            self._open_dir()

    # -- lookup and keep -----------------------------------------------------------------------
    def lookup(self, tokens, backend: str, at_most: int | None = None) -> SessionState | None:
        """The state of the longest kept prefix of `tokens` (at most `at_most` tokens of it) on
        `backend`, from RAM, else from disk (checked whole before use); None when there is none."""
        tokens = tuple(int(t) for t in tokens)
        limit = len(tokens) if at_most is None else min(at_most, len(tokens))
        while True:
            with self._lock:
                entry = self._longest(tokens, backend, limit)
                if entry is None:
                    self.stats.misses += 1
                    return None
                if entry.state is not None:
                    return self._hit(entry)
            state = self._read(entry)          # outside the lock: a file read
            with self._lock:
                if state is None:
                    continue                   # refused and forgotten: the next longest
                entry.state = state
                hit = self._hit(entry)
                self._to_ram(entry)
                if entry.nbytes > self.ram_bytes:
                    entry.state = None         # too large for RAM: read from disk each time
                return hit

    def keep(self, state: SessionState) -> None:
        """Keep `state` (a copy the caller no longer changes) in RAM and, with a directory, on
        disk; evicting what its bounds need. A state of another checkpoint or model is refused."""
        if state.checkpoint != self.fingerprint or state.geometry != self.geometry:
            raise Ds4fError("the session state belongs to another checkpoint or model", param="state")
        if not state.tokens:
            return
        key = _key(state.backend, state.tokens)
        with self._lock:
            entry = self._ram.get(key) or self._disk.get(key) or Entry(state.tokens, state.backend, state.nbytes)
            entry.state, entry.used = state, time.monotonic()
            self._to_ram(entry, key)
            on_disk = key in self._disk
        if self.dir is not None and not on_disk:
            self._write(key, entry)
        with self._lock:
            if key not in self._ram:
                entry.state = None             # on disk only (or not kept at all)

    def __len__(self) -> int:
        with self._lock:
            return len(set(self._ram) | set(self._disk))

    def kept_tokens(self) -> list[tuple[int, ...]]:
        """The token ids of every kept state (RAM and disk, any backend), longest first."""
        with self._lock:
            tokens = {e.tokens for e in (*self._ram.values(), *self._disk.values())}
        return sorted(tokens, key=len, reverse=True)

    # -- inside ------------------------------------------------------------------------------
    def _longest(self, tokens: tuple[int, ...], backend: str, limit: int) -> Entry | None:
        best = None
        for entry in (*self._ram.values(), *self._disk.values()):
            n = len(entry.tokens)
            if entry.backend == backend and n <= limit and tokens[:n] == entry.tokens and \
                    (best is None or n > len(best.tokens) or (n == len(best.tokens) and entry.state is not None)):
                best = entry
        return best

    def _hit(self, entry: Entry) -> SessionState:
        entry.hits += 1
        entry.used = time.monotonic()
        self.stats.hits += 1
        self.stats.tokens_reused += len(entry.tokens)
        return entry.state

    def _to_ram(self, entry: Entry, key: str | None = None) -> None:
        """(lock held) The entry in the RAM tier if it fits there, then the tier within its bound."""
        key = key or _key(entry.backend, entry.tokens)
        if entry.nbytes <= self.ram_bytes:
            self._ram[key] = entry
            self._trim(self._ram, self.ram_bytes, keep=key, ram=True)
        self.stats.ram_bytes = sum(e.nbytes for e in self._ram.values())

    def _trim(self, tier: dict[str, Entry], bound: int, keep: str, ram: bool) -> list[Entry]:
        """(lock held) Remove the least valuable entries until the tier fits; the newest stays."""
        gone = []
        while sum(e.nbytes for e in tier.values()) > bound and len(tier) > 1:
            key = min((k for k in tier if k != keep), key=lambda k: (tier[k].value, tier[k].used))
            entry = tier.pop(key)
            gone.append(entry)
            self.stats.evictions += 1
            if ram and key in self._disk:
                entry.state = None            # still on disk
        return gone

    # -- the directory ---------------------------------------------------------------------------
    def _open_dir(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self.log(f"prefix cache: {self.dir}: cannot write there ({exc.strerror or exc}); states kept in RAM only")
            self.dir = None
            return
        for path, head in _headers(self.dir):
            if isinstance(head, Ds4fError):
                self._reject(path, str(head))
                continue
            if head["checkpoint"] != self.fingerprint or head["geometry"] != self.geometry:
                continue                       # another checkpoint's: left for its own engine
            tokens = tuple(head["tokens"])
            self._disk[_key(head["backend"], tokens)] = Entry(tokens, head["backend"], path.stat().st_size, path=path)
        self.stats.disk_bytes = sum(e.nbytes for e in self._disk.values())

    def _read(self, entry: Entry) -> SessionState | None:
        try:
            state = load_state(entry.path, self.geometry, self.fingerprint)
            if state.tokens != entry.tokens or state.backend != entry.backend:
                raise Ds4fError(f"{entry.path}: its tokens or backend are not those its header named")
            return state
        except Ds4fError as exc:
            missing = not entry.path.exists()
            with self._lock:
                self._disk.pop(_key(entry.backend, entry.tokens), None)
                self.stats.disk_bytes = sum(e.nbytes for e in self._disk.values())
            if missing:
                self.log(f"prefix cache: {entry.path}: gone (another process evicted it)")
            else:
                self._reject(entry.path, str(exc))
            return None

    def _write(self, key: str, entry: Entry) -> None:
        path = self.dir / f"{key}{SUFFIX}"
        try:
            save_state(entry.state, path)
        except Ds4fError as exc:
            self.log(f"prefix cache: not saved: {exc}")
            return
        with self._lock:
            entry.path = path
            entry.nbytes = path.stat().st_size
            self._disk[key] = entry
            for gone in self._trim(self._disk, self.disk_bytes, keep=key, ram=False):
                gone.path.unlink(missing_ok=True)
                gone.path = None
            if self.disk_bytes < entry.nbytes:     # larger than the whole budget
                self._disk.pop(key, None)
                path.unlink(missing_ok=True)
                entry.path = None
                self.stats.evictions += 1
            self.stats.disk_bytes = sum(e.nbytes for e in self._disk.values())

    def _reject(self, path: Path, why: str) -> None:
        self.stats.rejected_files += 1
        self.log(f"prefix cache: {why}; the file is removed and not used")
        try:
            path.unlink()
        except OSError:
            pass
