"""The expert cache's bookkeeping: which (layer, expert) key is in which slot, a free list, the
eviction policy's view, per-layer counters. No memory of its own: ExpertCache adds the slot pool;
the cache lab's replay and the dueling policy's shadow caches use the bookkeeping alone.

Keys are (layer, expert). A slot is `ready` once its read has completed (at once, without reads).
Slots the current token still needs are protected from eviction.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ds4f.errors import Ds4fError

PAGE = 4096


@dataclass
class LayerCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class Slot:
    index: int
    key: tuple[int, int] | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def slots_for_budget(budget_bytes: int, slot_nbytes: int, min_slots: int = 1) -> int:
    """How many slots of slot_nbytes a budget holds; a clear error if fewer than a token needs."""
    n_slots = budget_bytes // slot_nbytes
    if n_slots < min_slots:
        raise Ds4fError(
            f"expert cache budget {budget_bytes / 2**20:.1f} MiB holds {n_slots} experts of "
            f"{slot_nbytes / 2**20:.2f} MiB; a token needs at least {min_slots} resident at once")
    return n_slots


class CacheBook:
    def __init__(self, n_slots: int, n_layers: int, policy, tracks_reads: bool = False) -> None:
        """policy: an object with at/touch/insert/remove/victim (runtime.policies).
        tracks_reads: a slot is ready only once its read lands (else at once)."""
        self.n_slots = n_slots
        self.tracks_reads = tracks_reads
        self.slots = [Slot(i) for i in range(n_slots)]
        self.policy = policy
        self.layers = [LayerCounters() for _ in range(n_layers)]
        self._clear()

    def _clear(self) -> None:
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._where: dict[tuple[int, int], Slot] = {}
        self._in_flight: set = set()  # keys whose read may not have landed yet
        self.evictions = 0

    def reset(self, policy) -> None:
        """Empty (every slot free, the given fresh policy, zero counters)."""
        for slot in self.slots:
            if slot.key is not None and not slot.ready.is_set():
                slot.ready.wait()  # a read still landing in this slot finishes first
            slot.key, slot.error = None, None
        self._clear()
        self.policy = policy
        self.layers = [LayerCounters() for _ in self.layers]

    def reset_counters(self) -> None:
        """Zero the counters; the slots and the policy keep what they hold."""
        self.layers = [LayerCounters() for _ in self.layers]

    @property
    def resident(self) -> int:
        return len(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where

    def peek(self, key) -> Slot | None:
        """The slot holding key, without counting or telling the policy."""
        return self._where.get(key)

    def lookup(self, key, count: bool = True) -> Slot | None:
        """The slot holding key (a hit, counted and touched), or None."""
        slot = self._where.get(key)
        if slot is not None:
            self.policy.touch(key)
            if count:
                self.layers[key[0]].hits += 1
        return slot

    def allocate(self, key, protected, count: bool = True, wait: bool = True) -> Slot:
        """A slot for key after a miss: a free one, else the policy's victim. Counted as a miss."""
        if self._free:
            slot = self.slots[self._free.pop()]
        else:
            # a slot whose read is still in flight cannot be reused (the read would land in it)
            while True:
                self._in_flight = {k for k in self._in_flight
                                   if k in self._where and not self._where[k].ready.is_set()}
                victim = self.policy.victim(protected | self._in_flight if self._in_flight else protected)
                if victim is not None or not wait or not (self._in_flight - protected):
                    break
                # every candidate is a prefetch still being read: wait for one to land
                self._where[next(iter(self._in_flight - protected))].ready.wait(0.05)
            if victim is None:
                raise Ds4fError(f"expert cache: all {self.n_slots} slots are in use by the current token")
            slot = self._where.pop(victim)
            self.policy.remove(victim)
            self.layers[victim[0]].evictions += 1
            self.evictions += 1
        slot.key = key
        slot.error = None
        if self.tracks_reads:
            slot.ready.clear()  # until its read lands
            self._in_flight.add(key)
        else:
            slot.ready.set()
        self._where[key] = slot
        self.policy.insert(key)
        if count:
            self.layers[key[0]].misses += 1
        return slot

    def request(self, keys, protected: set) -> list[tuple[Slot, bool]]:
        """One layer's requests in routing-rank order: (slot, hit) for each key. The keys join
        `protected` first, so none of them can evict another. Misses get a slot (not ready)."""
        protected.update(keys)
        out = []
        for key in keys:
            slot = self.lookup(key)
            out.append((slot, True) if slot is not None else (self.allocate(key, protected), False))
        return out

    def lend(self, n: int) -> list[Slot]:
        """Up to n slots taken out of the cache for a caller's own use (scratch for reads that are
        not the model's): free slots first, then the policy's victims, never a slot whose read has
        not landed. Their experts are forgotten, so nothing written into them is ever served as
        an expert; take_back returns them, empty. Only while no forward pass uses the cache."""
        out = []
        while len(out) < n and self._free:
            out.append(self.slots[self._free.pop()])
        busy = {key for key, slot in self._where.items() if not slot.ready.is_set()}
        while len(out) < n:
            victim = self.policy.victim(busy)
            if victim is None:
                break
            slot = self._where.pop(victim)
            self.policy.remove(victim)
            out.append(slot)
        for slot in out:
            slot.key, slot.error = None, None
        return out

    def take_back(self, slots: list[Slot]) -> None:
        """Lent slots back into the free list (what they hold is not an expert until a read fills them)."""
        for slot in slots:
            slot.key, slot.error = None, None
            self._free.append(slot.index)

    def discard(self, key) -> None:
        """Forget a key whose read failed, returning its slot to the free list."""
        slot = self._where.pop(key, None)
        if slot is not None:
            self.policy.remove(key)
            slot.key = None
            self._free.append(slot.index)

    def at(self, token: int, layer: int) -> None:
        """Tell the policy where the forward pass is (layer -1: the token-start requests)."""
        self.policy.at(token, layer)
