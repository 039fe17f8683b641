"""Belady's clairvoyant eviction (evict the resident key whose next request is farthest away),
and belady@N, which sees only N tokens ahead. They need the whole request sequence, so they
exist only in the lab, as bounds for the online policies.
"""
from __future__ import annotations

import numpy as np


class Belady:
    """Clairvoyant eviction over a known request sequence (one key per request, in order)."""

    name = "belady"

    def __init__(self, sequence) -> None:
        """sequence: the keys in request order, as integer codes (an int array) or any hashables."""
        codes = np.asarray(sequence) if isinstance(sequence, np.ndarray) else _codes(sequence)
        self._next = next_uses(codes)
        self._pos = 0
        self._resident_next: dict = {}

    def at(self, token: int, layer: int) -> None:
        pass

    def _seen(self, key) -> None:
        self._resident_next[key] = int(self._next[self._pos])
        self._pos += 1

    touch = _seen
    insert = _seen

    def remove(self, key) -> None:
        self._resident_next.pop(key, None)

    def victim(self, protected=frozenset()):
        best, best_next = None, -1
        for key, nxt in self._resident_next.items():
            if key not in protected and nxt > best_next:
                best, best_next = key, nxt
        return best


class HorizonBelady(Belady):
    """Belady that sees only the next `horizon_tokens` tokens of requests: among the keys whose
    next request lies beyond that, it evicts as `fallback` (an online policy) would; only if
    every candidate is needed within the horizon does it evict the farthest. belady@N in the
    lab: how far ahead the optimum must see to earn its hit rate."""

    def __init__(self, sequence: list, horizon_requests: int, fallback) -> None:
        super().__init__(sequence)
        self.horizon = horizon_requests
        self.fallback = fallback
        self.name = "belady@horizon"

    def at(self, token: int, layer: int) -> None:
        self.fallback.at(token, layer)

    def touch(self, key) -> None:
        self.fallback.touch(key)
        self._seen(key)

    def insert(self, key) -> None:
        self.fallback.insert(key)
        self._seen(key)

    def remove(self, key) -> None:
        super().remove(key)
        self.fallback.remove(key)

    def victim(self, protected=frozenset()):
        near = {k for k, nxt in self._resident_next.items() if nxt - self._pos <= self.horizon}
        if len(near) < len(self._resident_next):
            victim = self.fallback.victim(set(protected) | near)
            if victim is not None:
                return victim
        return super().victim(protected)




def _codes(sequence) -> np.ndarray:
    """Integer codes for a sequence of hashable keys (equal keys, equal codes)."""
    index: dict = {}
    return np.fromiter((index.setdefault(k, len(index)) for k in sequence), dtype=np.int64, count=len(sequence))


def next_uses(codes: np.ndarray) -> np.ndarray:
    """For each request, the position of the next request for the same key (len + 1: never):
    one backward pass, 4 bytes per request plus one slot per distinct key."""
    n = len(codes)
    never = n + 1
    nxt = np.empty(n, dtype=np.int64 if never >= 2**31 else np.int32)
    last = np.full(int(codes.max()) + 1 if n else 0, never, dtype=nxt.dtype)
    for i in range(n - 1, -1, -1):
        c = codes[i]
        nxt[i] = last[c]
        last[c] = i
    return nxt
