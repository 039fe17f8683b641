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

RAM holds at most `ram_bytes` of heads and blocks: over it, the state of least value goes first,
with the blocks no other RAM state uses: value = (hits + 1) x tokens / bytes, the newest state
last. A state's bytes are its head's and its blocks' shares (a block shared by n states counts 1/n
for each), so the states of several live conversations cost their distinct bytes, not their sum.

The directory (if any; heads `<key>.kv`, the key a hash of the checkpoint's fingerprint, the
backend and the tokens, blocks `blocks/<key>.kvb`, each written whole or not at all) holds at most
`disk_bytes`, counted on disk: every head and block there, whichever process or checkpoint wrote
it, so several servers sharing one directory stay within the budget together. Past it the least
recently used heads go first (a head's mtime: when it was written or last read, by any process),
with the blocks no head left uses; the count and the removals are done under the directory's lock
(flock on its `.lock`). A file that is not a regular one is left alone and never opened; a file
that is truncated, damaged (a header field missing or of the wrong type, an array of the wrong
dtype, shape or offset, a NaN or an infinity in what the model computed) or of another version is
logged and removed, never used, and the prompt is computed (a file of another checkpoint or
geometry is left for its own engine); a `.partial` whose writer is gone (no flock held on it) is
removed when a cache opens the directory; a directory that cannot be written is logged and the RAM
tier goes on alone. A file another process removed is a miss. `write_budget` bounds the bytes
written to the directory per day: past it states are kept in RAM only, said once in the log; a
request never fails for it.
"""
from __future__ import annotations

import contextlib
import hashlib
from array import array
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4f.engine.kv_blocks import (BLOCK_SUFFIX, Block, Head, block_path, block_tokens, check_blocks, join, load_block,
                                   save_block, split)
from ds4f.engine.session_state import (SessionState, canonical, check_state, load_head, non_finite, read_header,
                                       save_state)
from ds4f.errors import Ds4fError
from ds4f.partials import sweep_partials
from ds4f.paths import directory_problem
from ds4f.safe_read import not_regular

SUFFIX = ".kv"
BLOCKS = "blocks"          # the directory's subdirectory of blocks
LOCK_NAME = ".lock"        # flock'd while the directory's usage is counted and files removed
LOCK_WAIT_S = 30.0         # past this the budget is checked at the next write (said in the log)
ORPHAN_AGE_S = 600.0       # a block file no head uses is removed once this old (its head may still be coming)


@dataclass
class Entry:
    """A kept state: its head (in RAM, on disk, or both) and the keys of its blocks. Its token ids
    are kept as 4-byte ints (`ids`): an entry stays for every state on disk, and a 30,000-token
    agent prompt as a tuple of Python ints is ~1.1 MB of RAM, as 4-byte ints 117 KiB."""
    tokens: array
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
    disk_bytes: int = 0          # head and block files in the directory (every process's), at the last count
    states: int = 0              # kept states (RAM or disk)
    blocks_ram: int = 0
    blocks_disk: int = 0
    written_heads: int = 0       # bytes written to the directory: heads, since the engine loaded
    written_blocks: int = 0      # and blocks
    written_today: int = 0       # both, today (the write budget's day)
    heads_saved: int = 0         # files written: heads
    blocks_saved: int = 0        # and blocks
    write_budget: int = 0        # bytes a day; 0: none
    disk_budget: int = 0         # the directory's bound (bytes)


ENTRY_NBYTES = 512      # an Entry's own objects (the dataclass, its dict key, path, frozenset), about
KEY_NBYTES = 120        # a block's key in it: a 64-character str and its tuple slot

def ids(tokens) -> array:
    """Token ids as 4-byte ints (what an Entry keeps)."""
    return array("i", tokens)


def _key(checkpoint: str, backend: str, tokens: tuple[int, ...]) -> str:
    """A state's name: its checkpoint, backend and tokens (two models sharing a directory never collide)."""
    return hashlib.sha256(f"{checkpoint}:{backend}:{','.join(map(str, tokens))}".encode()).hexdigest()


def _regular(path: Path) -> os.stat_result | None:
    """The file's lstat when it is a regular file (not a link, a FIFO, a device), else None."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _headers(directory: Path, others: list | None = None):
    """(path, stat, header) of each state file in the directory; the Ds4fError for an unreadable
    one in the header's place. What is not a regular file is never opened: (path, what it is) goes
    to `others` when given."""
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        st = _regular(path)
        if st is None:
            if others is not None:
                try:
                    others.append((path, not_regular(path.lstat().st_mode) if not path.is_symlink() else "a link"))
                except OSError:
                    pass
            continue
        try:
            yield path, st, read_header(path)
        except Ds4fError as exc:
            yield path, st, exc


def kept_tokens_on_disk(directory: str | os.PathLike, fingerprint: str, geometry: dict) -> list[tuple[int, ...]]:
    """The token ids of the states a directory keeps for this checkpoint and geometry, longest first,
    read from their headers alone (nothing loaded, nothing removed: a PrefixCache on the directory
    checks and sweeps); [] when there is no such directory."""
    directory, geometry = Path(directory), canonical(geometry)
    if not directory.is_dir():
        return []
    tokens = {tuple(head["tokens"]) for _, _, head in _headers(directory)
              if not isinstance(head, Ds4fError) and head["checkpoint"] == fingerprint and head["geometry"] == geometry}
    return sorted(tokens, key=len, reverse=True)


def directory_usage(directory: str | os.PathLike) -> int:
    """The bytes a kv directory's finished head and block files hold (what its budget counts); 0
    when there is none."""
    directory = Path(directory)
    total = 0
    for pattern, where in ((f"*{SUFFIX}", directory), (f"*{BLOCK_SUFFIX}", directory / BLOCKS)):
        try:
            for p in where.glob(pattern):
                st = _regular(p)
                total += st.st_size if st is not None else 0
        except OSError:
            pass
    return total


class PrefixCache:
    def __init__(self, fingerprint: str, geometry: dict, ram_bytes: int, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 0, log=None, span: int | None = None, write_budget: int = 0) -> None:
        self.fingerprint, self.geometry = fingerprint, canonical(geometry)
        self.ram_bytes, self.disk_bytes = max(0, int(ram_bytes)), max(0, int(disk_bytes))
        self.log = log or (lambda _line: None)
        n = self.geometry["num_hidden_layers"]
        self.span = span or block_tokens(self.geometry.get("compress_ratios", [0] * n)[:n])
        self.stats = CacheStats(write_budget=max(0, int(write_budget)), disk_budget=self.disk_bytes)
        self._day = time.strftime("%Y-%m-%d")
        self._budget_said = False
        self._lock = threading.Lock()
        self._ram: dict[str, Entry] = {}           # state key -> entry whose head is in RAM
        self._disk: dict[str, Entry] = {}          # state key -> entry whose head is on disk
        self._ram_blocks: dict[str, Block] = {}    # block key -> block (held by the RAM entries)
        self._disk_blocks: dict[str, int] = {}     # block key -> its file's bytes (this cache's states')
        self._head_blocks: dict[tuple, tuple | None] = {}   # (name, inode, size) -> a head file's block keys
        self._dir_used = 0                         # the directory's bytes at the last count
        self._counted_at = 0.0
        self._lock_said = False
        self.dir_asked = disk_dir            # what it was given (the directory may turn out unwritable)
        self._dir_said = None                # (log, problem): a file where the directory was, said once a run
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
                in_ram = entry.head is not None
                if in_ram:
                    self._hit(entry)
                    head, blocks, path = entry.head, [self._ram_blocks[k] for k in entry.keys], entry.path
            if in_ram:
                _touch(path)
                return join(head, blocks)
            got = self._read(entry)            # outside the lock: file reads
            if got is None:
                continue                       # refused and forgotten: the next longest
            head, blocks, state = got
            with self._lock:
                self._hit(entry)
                self._to_ram(entry, head, blocks)
            _touch(entry.path)
            return state

    def keep(self, state: SessionState, disk: bool = True) -> None:
        """Keep `state` (a copy the caller no longer changes) in RAM and, with a directory and
        `disk`, on disk (its blocks the directory lacks, and its head); evicting what the bounds
        need. A state of another checkpoint or model, or one that is not whole and finite
        (session_state.check_state), is refused."""
        if state.checkpoint != self.fingerprint or state.geometry != self.geometry:
            raise Ds4fError("the session state belongs to another checkpoint or model", param="state")
        if not state.tokens:
            return
        key = _key(self.fingerprint, state.backend, state.tokens)
        head, blocks = split(state, self.span)
        try:      # finite: the head and the blocks RAM does not hold (those it holds were checked)
            check_state(state, finite=False)
            with self._lock:
                new = [b for b in blocks if b.key not in self._ram_blocks]
            bad = non_finite(head.state) or next((f"block {b.start // self.span + 1} {name}" for b in new
                                                  for name, a in b.arrays.items() if not name.startswith("attached.")
                                                  and not np.isfinite(a).all()), None)
            if bad is not None:
                raise Ds4fError(f"{bad} holds NaN or infinite values")
        except Ds4fError as exc:
            raise Ds4fError(f"a state of {state.position} tokens is not kept: {exc}") from None
        with self._lock:
            entry = self._ram.get(key) or self._disk.get(key)
            if entry is not None and not entry.attached <= set(state.attached):
                entry.used = time.monotonic()    # the kept one holds more (records) for the same tokens
                return
            if entry is None:
                entry = Entry(ids(state.tokens), state.backend, head.keys, head.nbytes)
            entry.used, entry.attached = time.monotonic(), frozenset(state.attached)
            entry.head_nbytes = head.nbytes
            self._to_ram(entry, head, blocks, key)
            on_disk = key in self._disk
        if self.dir is not None and disk and not on_disk:
            self._write(key, entry, head, blocks)

    def discard(self, tokens, backend: str, why: str) -> None:
        """A kept state found unusable after it was given out (the session refused it): forgotten in
        RAM, its head file removed, logged naming the file; the next lookup computes its prompt."""
        key = _key(self.fingerprint, backend, tuple(int(t) for t in tokens))
        with self._lock:
            entry = self._ram.pop(key, None)
            disk = self._disk.pop(key, None)
            entry = entry or disk
            if entry is not None:
                left = self._block_users(self._ram)
                for k in entry.keys:
                    if k not in left:
                        self._ram_blocks.pop(k, None)
            self._count()
        path = entry.path if entry is not None else None
        if path is not None:
            self._reject(path, f"{path}: a kept state that cannot be used ({why})")
            self._enforce(drop_blocks=set(entry.keys))
        else:
            self.log(f"prefix cache: a kept state of {len(tokens)} tokens cannot be used ({why}); dropped")

    @property
    def index_nbytes(self) -> int:
        """RAM the cache's index takes beside the states' arrays: every kept state's entry (its
        token ids, 4 bytes each, and the keys of its blocks), in RAM or on disk alone. Bounded by
        the directory's budget: on DeepSeek-V4-Flash a head is 32.5 MiB, so 20 GB of states are
        at most ~590 entries, 69 MB if each held 30,000 tokens."""
        with self._lock:
            return sum(ENTRY_NBYTES + e.tokens.itemsize * len(e.tokens) + KEY_NBYTES * len(e.keys)
                       for e in (*self._ram.values(), *self._disk.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(set(self._ram) | set(self._disk))

    def kept_tokens(self) -> list[tuple[int, ...]]:
        """The token ids of every kept state (RAM and disk, any backend), longest first."""
        with self._lock:
            tokens = {tuple(e.tokens) for e in (*self._ram.values(), *self._disk.values())}
        return sorted(tokens, key=len, reverse=True)

    def figures(self) -> CacheStats:
        """The stats with today's write count (a new day starts the budget afresh) and the
        directory's bytes counted again when the last count is older than a few seconds (other
        processes write there too)."""
        if self.dir is not None and time.monotonic() - self._counted_at > 5.0:
            used = directory_usage(self.dir)
            with self._lock:
                self._dir_used, self._counted_at = used, time.monotonic()
                self._count()
        with self._lock:
            self._new_day()
            return CacheStats(**vars(self.stats))

    # -- inside ------------------------------------------------------------------------------
    def _longest(self, tokens: tuple[int, ...], backend: str, limit: int, need: str | None = None) -> Entry | None:
        best, asked = None, memoryview(ids(tokens))
        for entry in (*self._ram.values(), *self._disk.values()):
            n = len(entry.tokens)
            if need is not None and need not in entry.attached:
                continue
            if entry.backend == backend and n <= limit and asked[:n] == memoryview(entry.tokens) and \
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
        s.disk_bytes = self._dir_used if self.dir is not None else 0
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
        except (OSError, ValueError) as exc:    # a file put where the directory was since the config was read
            why = directory_problem(self.dir) or getattr(exc, "strerror", None) or exc
            self.log(f"prefix cache: {self.dir}: cannot write there ({why}); states kept in RAM only")
            self.dir = None
            return
        sweep_partials(self.dir, self.log)
        sweep_partials(self._blocks_dir, self.log)
        heads, strange = [], []          # this cache's readable heads; what is not a regular file
        for path, st, head in _headers(self.dir, strange):
            if isinstance(head, Ds4fError):
                self._reject(path, str(head))
                continue
            self._head_blocks[path.name, st.st_ino, st.st_size] = tuple(head.get("blocks", ()))
            if head["checkpoint"] == self.fingerprint and head["geometry"] == self.geometry:
                heads.append((path, st, head))         # another checkpoint's: left for its own engine
        for path, what in strange:
            self.log(f"prefix cache: {path}: {what}, not a kept state; left alone and never opened")
        on_disk, refused = {}, set()
        for path in self._blocks_dir.glob(f"*{BLOCK_SUFFIX}"):
            st = _regular(path)
            if st is not None:
                on_disk[path.name[:-len(BLOCK_SUFFIX)]] = st.st_size
        for path, st, head in heads:
            tokens = tuple(head["tokens"])
            keys = tuple(head.get("blocks", ()))
            attached = frozenset(a["name"].split(".", 1)[1] for a in head["arrays"] if a["name"].startswith("attached."))
            missing = [k for k in keys if k not in on_disk]
            if head.get("block_tokens", self.span) != self.span or missing:
                why = f"{len(missing)} of its blocks are missing" if missing else \
                    f"blocks of {head.get('block_tokens')} positions, this cache's are {self.span}"
                self._reject(path, f"{path}: a kept state whose {why}")
                refused.update(keys)
                continue
            for k in keys:
                self._disk_blocks[k] = on_disk[k]
            self._disk[_key(self.fingerprint, head["backend"], tokens)] = Entry(
                ids(tokens), head["backend"], keys, st.st_size, path=path, file_nbytes=st.st_size, attached=attached)
        self._enforce(drop_blocks=refused, sweep=True)   # within the budget; the blocks no head uses

    @contextlib.contextmanager
    def _dir_lock(self):
        """The directory's lock (flock on its .lock, held by one process at a time while it counts
        and removes): yields True when held, False when it could not be had within LOCK_WAIT_S or
        the lock file is not a regular file (then nothing is removed this time; said once)."""
        import fcntl

        path = self.dir / LOCK_NAME
        fd, held = None, False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o644)
            if stat.S_ISREG(os.fstat(fd).st_mode):
                deadline = time.monotonic() + LOCK_WAIT_S
                while not held:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        held = True
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.01)
        except OSError:
            held = False
        if not held and not self._lock_said and directory_problem(self.dir) is None:   # else a write says that
            self._lock_said = True
            self.log(f"prefix cache: {path}: the directory's lock could not be had; its budget is checked at the"
                     f" next write")
        try:
            yield held
        finally:
            if fd is not None:
                os.close(fd)

    def _blocks_of(self, path: Path, st: os.stat_result) -> tuple | None:
        """A head file's block keys from its header (kept by name, inode and size: a head file never
        changes once written); None when its header is unreadable."""
        ident = (path.name, st.st_ino, st.st_size)
        if ident not in self._head_blocks:
            try:
                self._head_blocks[ident] = tuple(read_header(path).get("blocks", ()))
            except Ds4fError:
                self._head_blocks[ident] = None
        return self._head_blocks[ident]

    def _enforce(self, keep: Path | None = None, drop_blocks: set | frozenset = frozenset(),
                 sweep: bool = False) -> None:
        """The directory within `disk_bytes`, counted on disk under its lock, every process's and
        checkpoint's files included: past the budget, heads whose header cannot be read, then block
        files no head uses (older than ORPHAN_AGE_S), then the least recently used heads (mtime)
        with the blocks no head left uses; `keep` (the head just written) last, so it goes only when
        it alone is over the budget. drop_blocks: blocks to remove now if no head uses them (a
        write that failed, a refused head's); sweep: the old blocks no head uses in any case."""
        with self._dir_lock() as held:
            if held:
                self._enforce_locked(keep, drop_blocks, sweep)

    def _enforce_locked(self, keep: Path | None = None, drop_blocks: set | frozenset = frozenset(),
                        sweep: bool = False) -> None:
        """(the directory's lock held) _enforce's count and removals."""
        removed_heads, removed_blocks = set(), set()
        heads, blocks, used = [], {}, 0
        seen = set()
        for path in self.dir.glob(f"*{SUFFIX}"):
            st = _regular(path)
            if st is None:
                continue
            seen.add((path.name, st.st_ino, st.st_size))
            heads.append((st.st_mtime_ns, path.name, path, st.st_size, self._blocks_of(path, st)))
            used += st.st_size
        for ident in [i for i in self._head_blocks if i not in seen]:
            del self._head_blocks[ident]
        for path in self._blocks_dir.glob(f"*{BLOCK_SUFFIX}"):
            st = _regular(path)
            if st is not None:
                blocks[path.name[:-len(BLOCK_SUFFIX)]] = (st.st_size, st.st_mtime)
                used += st.st_size
        users: dict[str, int] = {}
        for *_, keys in heads:
            for k in keys or ():
                users[k] = users.get(k, 0) + 1
        now = time.time()

        def drop_block(k):
            nonlocal used
            try:
                block_path(self._blocks_dir, k).unlink()
            except OSError:
                return
            used -= blocks.pop(k)[0]
            removed_blocks.add(k)

        def drop_head(item):
            nonlocal used
            _, _, path, size, keys = item
            try:
                path.unlink()
            except OSError:
                return
            used -= size
            removed_heads.add(path)
            for k in keys or ():
                users[k] -= 1
                if users[k] == 0 and k in blocks:
                    drop_block(k)

        for k in [k for k in blocks if not users.get(k) and (k in drop_blocks or (
                (sweep or used > self.disk_bytes) and now - blocks[k][1] > ORPHAN_AGE_S))]:
            drop_block(k)
        order = sorted(heads, key=lambda h: (h[4] is not None, h[2] == keep, h[0], h[1]))
        for item in order:
            if used <= self.disk_bytes:
                break
            if item[4] is None:
                self.log(f"prefix cache: {item[2]}: its header cannot be read; the file is removed and not used")
                with self._lock:
                    self.stats.rejected_files += 1
            drop_head(item)
        self._dir_used = max(used, 0)
        self._counted_at = time.monotonic()
        with self._lock:
            for key in [k for k, e in self._disk.items() if e.path in removed_heads]:
                entry = self._disk.pop(key)
                entry.path, entry.file_nbytes = None, 0
                self.stats.evictions += 1
            left = self._block_users(self._disk)
            for k in [k for k in self._disk_blocks if k not in left or k not in blocks]:
                self._disk_blocks.pop(k, None)     # gone, or no state of this cache uses it (another's may)
            self._count()

    def _read(self, entry: Entry) -> tuple[Head, list[Block], SessionState] | None:
        """A disk entry's head, blocks (blocks RAM holds taken from there) and whole state, checked
        whole: each file, the blocks against the head, the joined state against itself and its
        geometry (finite included). None (the entry forgotten, its damaged files removed) when one
        is missing or refused."""
        bad_block = None
        try:
            state, header = load_head(entry.path, self.geometry, self.fingerprint, max_bytes=self.disk_bytes)
            if state.tokens != tuple(entry.tokens) or state.backend != entry.backend:
                raise Ds4fError(f"{entry.path}: its tokens or backend are not those its header named")
            head = Head(state, tuple(header.get("blocks", ())), int(header.get("block_tokens", self.span)),
                        tuple(header.get("per_token", ())))
            if head.keys != entry.keys:
                raise Ds4fError(f"{entry.path}: its blocks are not those its header named")
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
                    blocks.append(load_block(path, k, self.fingerprint, max_bytes=self.disk_bytes))
                except Ds4fError:
                    bad_block = path
                    raise
            try:
                check_blocks(head, blocks)
                whole = join(head, blocks)
                check_state(whole, finite=False)     # (the head and each block were checked finite)
            except Ds4fError as exc:
                raise Ds4fError(f"{entry.path}: a damaged kept state: {exc}", path=str(entry.path)) from None
            return head, blocks, whole
        except Ds4fError as exc:
            missing = not entry.path.exists()
            with self._lock:
                self._disk.pop(_key(self.fingerprint, entry.backend, entry.tokens), None)
                self._count()
            if bad_block is not None:
                self._reject(bad_block, str(exc))
            if missing:
                self.log(f"prefix cache: {entry.path}: gone (another process evicted it)")
            else:
                self._reject(entry.path, str(exc))
            self._enforce(drop_blocks=set(entry.keys))
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
        """The blocks the directory lacks, then, under the directory's lock (no eviction between the
        two), any of them another process removed since and the head; then the directory within its
        bound."""
        with self._lock:
            new = [b for b in blocks if b.key not in self._disk_blocks]
            if not self._within_budget(head.nbytes + sum(b.nbytes for b in new)):
                return
        path = self.dir / f"{key}{SUFFIX}"
        written_blocks, written, sizes = 0, set(), {}

        def lacking(bs):
            nonlocal written_blocks
            for b in bs:
                bpath = block_path(self._blocks_dir, b.key)
                st = _regular(bpath)
                if st is not None:              # there (this process's or another's: the same bytes, same key)
                    sizes[b.key] = st.st_size
                    continue
                sizes[b.key] = size = save_block(b, bpath, self.fingerprint, entry.backend)
                written_blocks += size
                written.add(b.key)

        try:
            lacking(blocks)
            with self._dir_lock() as held:
                lacking(blocks)                  # an eviction since may have removed one no head used
                save_state(head.state, path, extra=head.header())
                _touch(path)
                size = path.stat().st_size
                with self._lock:
                    self.stats.written_blocks += written_blocks
                    self.stats.written_heads += size
                    self.stats.heads_saved += 1
                    self.stats.blocks_saved += len(written)
                    self.stats.written_today += written_blocks + size
                    self._disk_blocks.update(sizes)
                    entry.path, entry.file_nbytes = path, size
                    self._disk[key] = entry
                if held:
                    self._enforce_locked(keep=path)
        except (Ds4fError, OSError) as exc:
            problem = directory_problem(self.dir)     # a file put where the directory was
            if problem is None:
                self.log(f"prefix cache: not saved: {exc}")
            elif self._dir_said != (self.log, problem):
                self._dir_said = (self.log, problem)
                self.log(f"prefix cache: {self.dir}: cannot write there ({problem}); states kept in RAM only")
            with self._lock:
                self.stats.written_blocks += written_blocks
                self.stats.blocks_saved += len(written)
                self.stats.written_today += written_blocks
            self._enforce(drop_blocks=written)        # the blocks of a head that never landed

    def _reject(self, path: Path, why: str) -> None:
        with self._lock:
            self.stats.rejected_files += 1
        self.log(f"prefix cache: {why}; the file is removed and not used")
        try:
            path.unlink()
        except OSError:
            pass


def _touch(path: Path | None) -> None:
    """A head file's mtime set to now: it was used (the directory's budget removes the least
    recently used first, whichever process used it)."""
    if path is None:
        return
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass
