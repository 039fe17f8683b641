"""The expert cache: a pool of slots allocated once, an eviction policy, per-layer counters.

The pool is one anonymous mmap (page-aligned, so slots are 4 KiB-aligned for O_DIRECT),
touched page by page at creation so no page faults land on the hot path (the prototype's
1.06 -> 0.19 s/token lesson). Its size is slots x slot_nbytes <= the preset's budget, and
it never grows: the budget is enforced by construction.

Keys are (layer, expert). A slot is `ready` once its read has completed. Slots the current
token still needs are protected from eviction.
"""
from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field

import numpy as np

from ds4f.engine.runtime.policies import make_policy
from ds4f.engine.errors import Ds4fError

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


class ExpertCache:
    def __init__(self, budget_bytes: int, slot_nbytes: int, n_layers: int, policy: str = "lru",
                 min_slots: int = 1, with_pool: bool = True, n_experts: int = 256) -> None:
        """with_pool=False keeps only the bookkeeping (the cache lab replays traces with it)."""
        if slot_nbytes % PAGE:
            raise ValueError(f"slot_nbytes must be a multiple of {PAGE}")
        self.slot_nbytes = slot_nbytes
        self.budget_bytes = budget_bytes
        n_slots = budget_bytes // slot_nbytes
        if n_slots < min_slots:
            raise Ds4fError(
                f"expert cache budget {budget_bytes / 2**20:.1f} MiB holds {n_slots} experts of "
                f"{slot_nbytes / 2**20:.2f} MiB; a token needs at least {min_slots} resident at once")
        self.n_slots = n_slots
        self._map = None
        self.pool = None
        if with_pool:
            self._map = mmap.mmap(-1, n_slots * slot_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.pool = np.frombuffer(self._map, dtype=np.uint8).reshape(n_slots, slot_nbytes)
            self.pool[:, ::PAGE] = 0  # fault every page in now, not during a token
        self.slots = [Slot(i) for i in range(n_slots)]
        self._free = list(range(n_slots - 1, -1, -1))
        self._where: dict[tuple[int, int], Slot] = {}
        self._in_flight: set = set()  # keys whose read may not have landed yet
        self.policy_name = policy
        self._n_experts = n_experts
        self.policy = make_policy(policy, n_layers, n_experts, n_slots)
        self.layers = [LayerCounters() for _ in range(n_layers)]
        self.evictions = 0

    def reset(self) -> None:
        """Empty the cache (every slot free, a fresh policy, zero counters); the pool stays."""
        for slot in self.slots:
            if slot.key is not None and not slot.ready.is_set():
                slot.ready.wait()  # a read still landing in this slot finishes first
            slot.key, slot.error = None, None
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._where.clear()
        self._in_flight = set()
        self.policy = make_policy(self.policy_name, len(self.layers), self._n_experts, self.n_slots)
        self.layers = [LayerCounters() for _ in self.layers]
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return len(self._where) * self.slot_nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.slot_nbytes

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
        if self.pool is not None:
            slot.ready.clear()  # until its read lands (the bookkeeping-only cache has no reads)
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

    def close(self) -> None:
        self.pool = None  # type: ignore[assignment]
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view still exists; the mapping goes with it
