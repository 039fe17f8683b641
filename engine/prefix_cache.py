"""The prefix cache: session states kept in RAM and on disk, so that a new prompt starts from the
longest prefix of its tokens a state was kept for, and prefills only the rest.

A state is kept for (the checkpoint, the backend, the tokens): its bits are those of the kernels
that computed it, so a prompt reuses only states of its own backend (at any thread count), and
the continuation is then byte for byte a cold run's.

A state is kept in blocks (engine.kv_blocks): its head (each layer's window and open groups, the
last logits, the rows past its last whole block) and the blocks of its compressed rows and
per-token records, each keyed by the token prefix it ends. States that share a prefix (the turns
of one conversation, conversations with one system prompt, an agent and its subagents) share its
blocks, in RAM and on disk: a new turn writes its new blocks and one head, never the rows before.

RAM holds at most `ram_bytes` of heads and blocks; the directory (if any) at most `disk_bytes`
(heads `<key>.kv`, blocks `blocks/<key>.kvb`, each written whole or not at all). When a tier is
over its bound, the state of least value goes first, with the blocks no other state of that tier
uses: value = (hits + 1) x tokens / bytes, the newest state last. A state's bytes are its head's
and its blocks' shares (a block shared by n states counts 1/n for each), so the states of several
live conversations cost their distinct bytes, not their sum. A file that is truncated, damaged or
of another checkpoint, geometry or version is logged and removed, never used (with the states
whose blocks it held); a directory that cannot be written is logged and the RAM tier goes on
alone. Several processes may share one directory: each writes under a name of its own first, and
a file another removed is a miss. `write_budget` bounds the bytes written to the directory per
day: past it states are kept in RAM only, said once in the log; a request never fails for it.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ds4f.engine.kv_blocks import (BLOCK_SUFFIX, Block, Head, block_path, block_tokens, join, load_block, save_block,
                                   split)
from ds4f.engine.session_state import SessionState, canonical, load_head, read_header, save_state
from ds4f.errors import Ds4fError

SUFFIX = ".kv"
BLOCKS = "blocks"          # the directory's subdirectory of blocks
ORPHAN_AGE_S = 600.0       # a block file no head uses is removed once this old (its head may still be coming)


@dataclass
class Entry:
    """A kept state: its head (in RAM, on disk, or both) and the keys of its blocks."""
    tokens: tuple[int, ...]
    backend: str
    keys: tuple[str, ...]                  # its blocks, in order
    head_nbytes: int                       # its head's bytes in RAM
    head: Head | None = None               # in RAM
    path: Path | None = None               # its head's file on disk
    file_nbytes: int = 0                   # that file's bytes
    hits: int = 0
    used: float = field(default_factory=time.monotonic)
    attached: frozenset = frozenset()      # the names of what its keeper attached (e.g. records)


@dataclass
class CacheStats:
    hits: int = 0                # lookups that found a prefix
    misses: int = 0
    tokens_reused: int = 0       # prompt tokens the hits did not compute
    evictions: int = 0           # states dropped for a tier's bound
    rejected_files: int = 0      # disk files refused (damaged, foreign, missing blocks) and removed
    ram_bytes: int = 0           # heads and blocks in RAM
    disk_bytes: int = 0          # head and block files
    states: int = 0              # kept states (RAM or disk)
    blocks_ram: int = 0
    blocks_disk: int = 0
    written_heads: int = 0       # bytes written to the directory: heads, since the engine loaded
    written_blocks: int = 0      # and blocks
    written_today: int = 0       # both, today (the write budget's day)
    heads_saved: int = 0         # files written: heads
    blocks_saved: int = 0        # and blocks
    write_budget: int = 0        # bytes a day; 0: none


def _key(checkpoint: str, backend: str, tokens: tuple[int, ...]) -> str:
    """A state's name: its checkpoint, backend and tokens (two models sharing a directory never collide)."""
    return hashlib.sha256(f"{checkpoint}:{backend}:{','.join(map(str, tokens))}".encode()).hexdigest()


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
                 disk_bytes: int = 0, log=None, span: int | None = None, write_budget: int = 0) -> None:
        self.fingerprint, self.geometry = fingerprint, canonical(geometry)
        self.ram_bytes, self.disk_bytes = max(0, int(ram_bytes)), max(0, int(disk_bytes))
        self.log = log or (lambda _line: None)
        n = self.geometry["num_hidden_layers"]
        self.span = span or block_tokens(self.geometry.get("compress_ratios", [0] * n)[:n])
        self.stats = CacheStats(write_budget=max(0, int(write_budget)))
        self._day = time.strftime("%Y-%m-%d")
        self._budget_said = False
        self._lock = threading.Lock()
        self._ram: dict[str, Entry] = {}           # state key -> entry whose head is in RAM
        self._disk: dict[str, Entry] = {}          # state key -> entry whose head is on disk
        self._ram_blocks: dict[str, Block] = {}    # block key -> block (held by the RAM entries)
        self._disk_blocks: dict[str, int] = {}     # block key -> its file's bytes
        self.dir_asked = disk_dir            # what it was given (the directory may turn out unwritable)
        self.dir = Path(disk_dir) if disk_dir is not None and self.disk_bytes > 0 else None
        if self.dir is not None:
            self._open_dir()

    # -- lookup and keep -----------------------------------------------------------------------
    def lookup(self, tokens, backend: str, at_most: int | None = None, need: str | None = None
               ) -> SessionState | None:
        """The state of the longest kept prefix of `tokens` (at most `at_most` tokens of it) on
        `backend`, from RAM, else from disk (checked whole before use); None when there is none.
        need: only a state with this attachment (a run's records)."""
        tokens = tuple(int(t) for t in tokens)
        limit = len(tokens) if at_most is None else min(at_most, len(tokens))
        while True:
            with self._lock:
                entry = self._longest(tokens, backend, limit, need)
                if entry is None:
                    self.stats.misses += 1
                    return None
                if entry.head is not None:
                    self._hit(entry)
                    head, blocks = entry.head, [self._ram_blocks[k] for k in entry.keys]
                    return join(head, blocks)
            got = self._read(entry)            # outside the lock: file reads
            if got is None:
                continue                       # refused and forgotten: the next longest
            head, blocks = got
            with self._lock:
                self._hit(entry)
                self._to_ram(entry, head, blocks)
            return join(head, blocks)

    def keep(self, state: SessionState, disk: bool = True) -> None:
        """Keep `state` (a copy the caller no longer changes) in RAM and, with a directory and
        `disk`, on disk (its blocks the directory lacks, and its head); evicting what the bounds
        need. A state of another checkpoint or model is refused."""
        if state.checkpoint != self.fingerprint or state.geometry != self.geometry:
            raise Ds4fError("the session state belongs to another checkpoint or model", param="state")
        if not state.tokens:
            return
        key = _key(self.fingerprint, state.backend, state.tokens)
        head, blocks = split(state, self.span)
        with self._lock:
            entry = self._ram.get(key) or self._disk.get(key)
            if entry is not None and not entry.attached <= set(state.attached):
                entry.used = time.monotonic()    # the kept one holds more (records) for the same tokens
                return
            if entry is None:
                entry = Entry(state.tokens, state.backend, head.keys, head.nbytes)
            entry.used, entry.attached = time.monotonic(), frozenset(state.attached)
            entry.head_nbytes = head.nbytes
            self._to_ram(entry, head, blocks, key)
            on_disk = key in self._disk
        if self.dir is not None and disk and not on_disk:
            self._write(key, entry, head, blocks)

    def __len__(self) -> int:
        with self._lock:
            return len(set(self._ram) | set(self._disk))

    def kept_tokens(self) -> list[tuple[int, ...]]:
        """The token ids of every kept state (RAM and disk, any backend), longest first."""
        with self._lock:
            tokens = {e.tokens for e in (*self._ram.values(), *self._disk.values())}
        return sorted(tokens, key=len, reverse=True)

    def figures(self) -> CacheStats:
        """The stats with today's write count (a new day starts the budget afresh)."""
        with self._lock:
            self._new_day()
            return CacheStats(**vars(self.stats))

    # -- inside ------------------------------------------------------------------------------
    def _longest(self, tokens: tuple[int, ...], backend: str, limit: int, need: str | None = None) -> Entry | None:
        best = None
        for entry in (*self._ram.values(), *self._disk.values()):
            n = len(entry.tokens)
            if need is not None and need not in entry.attached:
                continue
            if entry.backend == backend and n <= limit and tokens[:n] == entry.tokens and \
                    (best is None or n > len(best.tokens) or (n == len(best.tokens) and entry.head is not None)):
                best = entry
        return best

    def _hit(self, entry: Entry) -> None:
        entry.hits += 1
        entry.used = time.monotonic()
        self.stats.hits += 1
        self.stats.tokens_reused += len(entry.tokens)

    def _block_users(self, tier: dict[str, Entry]) -> dict[str, int]:
        """(lock held) How many of a tier's states use each block."""
        users: dict[str, int] = {}
        for e in tier.values():
            for k in e.keys:
                users[k] = users.get(k, 0) + 1
        return users

    def _value(self, entry: Entry, users: dict[str, int], sizes) -> float:
        """(lock held) (hits + 1) x tokens / bytes, its shared blocks' bytes split among their users."""
        nbytes = entry.head_nbytes + sum(sizes(k) / max(users.get(k, 1), 1) for k in entry.keys)
        return (entry.hits + 1) * len(entry.tokens) / max(nbytes, 1)

    def _to_ram(self, entry: Entry, head: Head, blocks: list[Block], key: str | None = None) -> None:
        """(lock held) The entry's head and blocks in RAM if they fit there, then the tier within its
        bound (a block RAM already holds is shared, not copied)."""
        key = key or _key(self.fingerprint, entry.backend, entry.tokens)
        alone = head.nbytes + sum(b.nbytes for b in blocks)
        if alone <= self.ram_bytes:
            entry.head = head
            for b in blocks:
                self._ram_blocks.setdefault(b.key, b)
            self._ram[key] = entry
            self._trim_ram(keep=key)
        self._count()

    def _ram_used(self) -> int:
        return sum(e.head_nbytes for e in self._ram.values()) + sum(b.nbytes for b in self._ram_blocks.values())

    def _trim_ram(self, keep: str) -> None:
        """(lock held) Drop the least valuable RAM states until the tier fits; the newest stays."""
        while self._ram_used() > self.ram_bytes and len(self._ram) > 1:
            users = self._block_users(self._ram)
            sizes = lambda k: self._ram_blocks[k].nbytes     # noqa: E731
            key = min((k for k in self._ram if k != keep),
                      key=lambda k: (self._value(self._ram[k], users, sizes), self._ram[k].used))
            entry = self._ram.pop(key)
            entry.head = None                   # on disk still, if it was written there
            self.stats.evictions += 1
            left = self._block_users(self._ram)
            for k in entry.keys:
                if k not in left:
                    self._ram_blocks.pop(k, None)

    def _count(self) -> None:
        """(lock held) The stats' byte and state counts from the tiers."""
        s = self.stats
        s.ram_bytes = self._ram_used()
        s.disk_bytes = self._disk_used()
        s.states = len(set(self._ram) | set(self._disk))
        s.blocks_ram, s.blocks_disk = len(self._ram_blocks), len(self._disk_blocks)

    # -- the directory ---------------------------------------------------------------------------
    @property
    def _blocks_dir(self) -> Path:
        return self.dir / BLOCKS

    def _open_dir(self) -> None:
        try:
            self._blocks_dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.{threading.get_ident()}"   # a name no other cache uses
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self.log(f"prefix cache: {self.dir}: cannot write there ({exc.strerror or exc}); states kept in RAM only")
            self.dir = None
            return
        heads, others = [], set()         # this cache's readable heads; the blocks of the others'
        for path, head in _headers(self.dir):
            if isinstance(head, Ds4fError):
                self._reject(path, str(head))
            elif head["checkpoint"] != self.fingerprint or head["geometry"] != self.geometry:
                others.update(head.get("blocks", ()))   # another checkpoint's: left for its own engine, blocks too
            else:
                heads.append((path, head))
        mine = {k for _, head in heads for k in head.get("blocks", ())}
        for path in sorted(self._blocks_dir.glob(f"*{BLOCK_SUFFIX}")):
            try:
                key, st = path.name[:-len(BLOCK_SUFFIX)], path.stat()
            except OSError:
                continue
            if key in mine:
                self._disk_blocks[key] = st.st_size
            elif key not in others and time.time() - st.st_mtime > ORPHAN_AGE_S:   # no head uses it (a young
                path.unlink(missing_ok=True)                                      # one's head may follow)
        for path, head in heads:
            tokens = tuple(head["tokens"])
            keys = tuple(head.get("blocks", ()))
            attached = frozenset(a["name"].split(".", 1)[1] for a in head["arrays"] if a["name"].startswith("attached."))
            missing = [k for k in keys if k not in self._disk_blocks]
            if head.get("block_tokens", self.span) != self.span or missing:
                why = f"{len(missing)} of its blocks are missing" if missing else \
                    f"blocks of {head.get('block_tokens')} positions, this cache's are {self.span}"
                self._reject(path, f"{path}: a kept state whose {why}")
                continue
            size = path.stat().st_size
            self._disk[_key(self.fingerprint, head["backend"], tokens)] = Entry(
                tokens, head["backend"], keys, size, path=path, file_nbytes=size, attached=attached)
        self._sweep_blocks(others)             # what rejected heads held
        self._count()

    def _sweep_blocks(self, others: set | None = None) -> None:
        """(lock held or not yet shared) Remove the block files this cache wrote or took up that no
        state uses: none of its own, and none of `others` (the blocks of the heads it does not keep;
        None: every head the directory holds now, read again: another process's, another
        checkpoint's)."""
        used = set(self._block_users(self._disk))
        if others is None:
            others = {k for _, head in _headers(self.dir) if not isinstance(head, Ds4fError)
                      for k in head.get("blocks", ())}
        used |= others
        for k in [k for k in self._disk_blocks if k not in used]:
            block_path(self._blocks_dir, k).unlink(missing_ok=True)
            self._disk_blocks.pop(k, None)

    def _read(self, entry: Entry) -> tuple[Head, list[Block]] | None:
        """A disk entry's head and blocks (blocks RAM holds taken from there), checked whole; None
        (the entry forgotten, its damaged files removed) when one is missing or refused."""
        try:
            state, header = load_head(entry.path, self.geometry, self.fingerprint)
            if state.tokens != entry.tokens or state.backend != entry.backend:
                raise Ds4fError(f"{entry.path}: its tokens or backend are not those its header named")
            head = Head(state, tuple(header.get("blocks", ())), int(header.get("block_tokens", self.span)),
                        tuple(header.get("per_token", ())))
            blocks = []
            for k in head.keys:
                with self._lock:
                    held = self._ram_blocks.get(k)
                if held is not None:
                    blocks.append(held)
                    continue
                path = block_path(self._blocks_dir, k)
                if not path.exists():
                    raise Ds4fError(f"{entry.path}: its block {path.name} is gone", path=str(path))
                try:
                    blocks.append(load_block(path, k, self.fingerprint))
                except Ds4fError:
                    with self._lock:
                        self._disk_blocks.pop(k, None)
                    path.unlink(missing_ok=True)
                    raise
            return head, blocks
        except Ds4fError as exc:
            missing = not entry.path.exists()
            with self._lock:
                self._disk.pop(_key(self.fingerprint, entry.backend, entry.tokens), None)
                self._count()
            if missing:
                self.log(f"prefix cache: {entry.path}: gone (another process evicted it)")
            else:
                self._reject(entry.path, str(exc))
            return None

    def _new_day(self) -> None:
        """(lock held) A new day: the write budget starts afresh."""
        today = time.strftime("%Y-%m-%d")
        if today != self._day:
            self._day, self.stats.written_today, self._budget_said = today, 0, False

    def _within_budget(self, nbytes: int) -> bool:
        """(lock held) May `nbytes` more be written today? Says so once a day when not."""
        self._new_day()
        budget = self.stats.write_budget
        if not budget or self.stats.written_today + nbytes <= budget:
            return True
        if not self._budget_said:
            self._budget_said = True
            self.log(f"prefix cache: today's write budget of {budget / 1e9:.1f} GB to {self.dir} is spent"
                     f" ({self.stats.written_today / 1e9:.2f} GB written); states are kept in RAM only until tomorrow")
        return False

    def _write(self, key: str, entry: Entry, head: Head, blocks: list[Block]) -> None:
        """The blocks the directory lacks, then the head; then the tier within its bound."""
        with self._lock:
            new = [b for b in blocks if b.key not in self._disk_blocks]
            if not self._within_budget(head.nbytes + sum(b.nbytes for b in new)):
                return
        path = self.dir / f"{key}{SUFFIX}"
        written_blocks = 0
        try:
            for b in new:
                size = save_block(b, block_path(self._blocks_dir, b.key), self.fingerprint, entry.backend)
                written_blocks += size
                with self._lock:
                    self._disk_blocks[b.key] = size
                    self.stats.blocks_saved += 1
            save_state(head.state, path, extra=head.header())
        except Ds4fError as exc:
            self.log(f"prefix cache: not saved: {exc}")
            with self._lock:
                self.stats.written_blocks += written_blocks
                self.stats.written_today += written_blocks
                self._sweep_blocks()           # the blocks of a head that never landed
                self._count()
            return
        size = path.stat().st_size
        with self._lock:
            self.stats.written_blocks += written_blocks
            self.stats.written_heads += size
            self.stats.heads_saved += 1
            self.stats.written_today += written_blocks + size
            entry.path, entry.file_nbytes = path, size
            self._disk[key] = entry
            self._trim_disk(keep=key)
            if key in self._disk and self._disk_used() > self.disk_bytes:   # larger than the whole budget
                self._drop_disk(key)
            self._count()

    def _disk_used(self) -> int:
        return sum(e.file_nbytes for e in self._disk.values()) + sum(self._disk_blocks.values())

    def _trim_disk(self, keep: str) -> None:
        """(lock held) Drop the least valuable disk states (and the blocks left unused) until the
        directory fits its bound; the newest stays."""
        while self._disk_used() > self.disk_bytes and len(self._disk) > 1:
            users = self._block_users(self._disk)
            sizes = lambda k: self._disk_blocks.get(k, 0)     # noqa: E731
            key = min((k for k in self._disk if k != keep),
                      key=lambda k: (self._value(self._disk[k], users, sizes), self._disk[k].used))
            self._drop_disk(key)

    def _drop_disk(self, key: str) -> None:
        """(lock held) A state off the disk, with the blocks no other disk state uses."""
        entry = self._disk.pop(key)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
            entry.path, entry.file_nbytes = None, 0
        self.stats.evictions += 1
        self._sweep_blocks()

    def _reject(self, path: Path, why: str) -> None:
        self.stats.rejected_files += 1
        self.log(f"prefix cache: {why}; the file is removed and not used")
        try:
            path.unlink()
        except OSError:
            pass
