"""Expert-cache eviction policies behind one small interface.

A policy only orders keys; the cache owns the slots and the byte budget. Keys are
(layer, expert) pairs.
    touch(key)            a hit
    insert(key)           a miss filled a slot
    remove(key)           the key left the cache
    victim(protected)     the key to evict (never one in `protected`), or None
    at(token, layer)      where the forward pass is: called before each layer's requests
                          (and once per token for the hash layers' token-start requests)

Online policies (usable by the engine, chosen by the preset):
  lru     least recently used.
  lfu     least frequently used, counting every request since the run began (a key keeps
          its count when evicted), ties broken by recency.
  fcr     frequency class then recency, in the spirit of antirez/ds4's expert cache: keys
          fall in classes floor(log2(1 + uses)); evict from the lowest class, LRU within it.
  cycle   ours: the forward pass visits layers in a cycle, so recency in request order is
          misleading: once the cache holds less than a token's experts, LRU's victim is the
          expert of the layer about to run (last used a whole token ago), and its hit rate
          collapses. `cycle` scores keys by use counts decayed over tokens (not requests),
          plus a bonus for use since their layer's last turn, minus a little for layers
          whose next turn is far; see the class.
The offline optimum (Belady: evict the key whose next request is farthest away) lives in
engine/cache_replay.py, since it needs the whole trace.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict

from ds4f.engine.runtime.cache_book import CacheBook

import numpy as np


class LRU:
    name = "lru"

    def __init__(self, n_layers: int = 1) -> None:
        self._order: OrderedDict = OrderedDict()

    def at(self, token: int, layer: int) -> None:
        pass

    def touch(self, key) -> None:
        self._order.move_to_end(key)

    def insert(self, key) -> None:
        self._order[key] = None

    def remove(self, key) -> None:
        self._order.pop(key, None)

    def victim(self, protected=frozenset()):
        for key in self._order:
            if key not in protected:
                return key
        return None


class _Classed:
    """Keys in buckets by class (an OrderedDict per class, LRU order inside); subclasses say
    what a key's class is. Use counts survive eviction (the frequency is the key's history)."""

    def __init__(self, n_layers: int = 1) -> None:
        self.n_layers = n_layers
        self.uses: defaultdict = defaultdict(int)
        self._cls: dict = {}
        self._buckets: dict[int, OrderedDict] = defaultdict(OrderedDict)
        self.token = 0
        self.layer = 0

    def klass(self, key) -> int:
        raise NotImplementedError

    def at(self, token: int, layer: int) -> None:
        self.token, self.layer = token, layer

    def _place(self, key) -> None:
        old = self._cls.get(key)
        if old is not None:
            del self._buckets[old][key]
            if not self._buckets[old]:
                del self._buckets[old]
        c = self.klass(key)
        self._cls[key] = c
        self._buckets[c][key] = None

    def touch(self, key) -> None:
        self.uses[key] += 1
        self._place(key)

    def insert(self, key) -> None:
        self.uses[key] += 1
        self._place(key)

    def remove(self, key) -> None:
        c = self._cls.pop(key, None)
        if c is not None:
            del self._buckets[c][key]
            if not self._buckets[c]:
                del self._buckets[c]

    def victim(self, protected=frozenset()):
        for c in sorted(self._buckets):
            for key in self._buckets[c]:
                if key not in protected:
                    return key
        return None


class LFU(_Classed):
    name = "lfu"

    def klass(self, key) -> int:
        return self.uses[key]


class FCR(_Classed):
    name = "fcr"
    MAX_CLASS = 6

    def klass(self, key) -> int:
        return min((self.uses[key] + 1).bit_length() - 1, self.MAX_CLASS)


class Cycle:
    """Ours: decayed use counts measured in tokens, a bonus for keys used since their layer's
    last turn, and a small preference for evicting the layers whose turn comes last.

    score(key) = uses decayed with a half-life of HALF_LIFE tokens
               + RECENT_BONUS if used in this token, or in the last one at a layer still ahead
               - DISTANCE_WEIGHT * (layers until its next turn) / n_layers
    The victim is the lowest score (ties: the lowest key index). Arrays over every
    (layer, expert) key keep victim() vectorised: O(keys) in numpy, no Python loop.
    """

    name = "cycle"
    HALF_LIFE = 4.0
    RECENT_BONUS = 1.0
    DISTANCE_WEIGHT = 0.3

    def __init__(self, n_layers: int = 1, n_experts: int = 256) -> None:
        self.n_layers, self.n_experts = n_layers, n_experts
        size = n_layers * n_experts
        self.value = np.zeros(size)
        self.last = np.full(size, -(2**40), dtype=np.int64)
        self.resident = np.zeros(size, dtype=bool)
        self.layer_of = np.repeat(np.arange(n_layers), n_experts)
        self.decay = 0.5 ** (1.0 / self.HALF_LIFE)
        self.token, self.layer = 0, -1

    def at(self, token: int, layer: int) -> None:
        self.token, self.layer = token, layer

    def _index(self, key) -> int:
        return key[0] * self.n_experts + key[1]

    def touch(self, key) -> None:
        i = self._index(key)
        self.value[i] = self.value[i] * self.decay ** (self.token - self.last[i]) + 1.0
        self.last[i] = self.token

    def insert(self, key) -> None:
        self.touch(key)
        self.resident[self._index(key)] = True

    def remove(self, key) -> None:
        self.resident[self._index(key)] = False

    def victim(self, protected=frozenset()):
        candidates = self.resident.copy()
        for key in protected:
            candidates[self._index(key)] = False
        idx = np.flatnonzero(candidates)
        if not len(idx):
            return None
        last = self.last[idx]
        layer = self.layer_of[idx]
        score = self.value[idx] * self.decay ** (self.token - last).astype(np.float64)
        score += self.RECENT_BONUS * ((last == self.token) | ((last == self.token - 1) & (layer > self.layer)))
        score -= self.DISTANCE_WEIGHT * ((layer - self.layer - 1) % self.n_layers) / self.n_layers
        i = int(idx[int(np.argmin(score))])
        return (i // self.n_experts, i % self.n_experts)


class Duel:
    """Set dueling between LRU and Cycle (ours): both order the real cache's keys; two shadow
    caches of the same capacity replay the same requests, one per policy; each eviction
    follows the policy whose shadow has hit more lately (hits decayed with a half-life of
    WINDOW requests). LRU wins when the cache holds about one token's experts; Cycle wins
    below and above that; the duel follows whichever is ahead on this run's traffic."""

    name = "duel"
    WINDOW = 256

    def __init__(self, n_layers: int = 1, n_experts: int = 256, capacity: int = 0) -> None:
        self.live = [LRU(n_layers), Cycle(n_layers, n_experts)]
        self.shadows = [CacheBook(max(capacity, 1), n_layers, LRU(n_layers)),
                        CacheBook(max(capacity, 1), n_layers, Cycle(n_layers, n_experts))]
        self.score = [0.0, 0.0]
        self.decay = 0.5 ** (1.0 / self.WINDOW)
        self._batch: set = set()  # keys requested in the current layer (the shadows protect them)

    def at(self, token: int, layer: int) -> None:
        for p in self.live:
            p.at(token, layer)
        for sh in self.shadows:
            sh.at(token, layer)
        self._batch = set()  # a new batch of requests (a layer's, or the token-start hash batch)

    def _request(self, key) -> None:
        self._batch.add(key)
        for i, sh in enumerate(self.shadows):
            hit = sh.lookup(key, count=False) is not None
            if not hit:
                if sh.n_slots == 0:
                    continue
                if len(sh._where) >= sh.n_slots and sh.policy.victim(self._batch) is None:
                    continue  # everything is protected: the shadow just misses
                sh.allocate(key, self._batch, count=False)
            self.score[i] = self.score[i] * self.decay + hit

    def touch(self, key) -> None:
        self._request(key)
        for p in self.live:
            p.touch(key)

    def insert(self, key) -> None:
        self._request(key)
        for p in self.live:
            p.insert(key)

    def remove(self, key) -> None:
        for p in self.live:
            p.remove(key)

    @property
    def leader(self) -> int:
        return 1 if self.score[1] >= self.score[0] else 0

    def victim(self, protected=frozenset()):
        return self.live[self.leader].victim(protected)


ONLINE_POLICIES = {"lru": LRU, "lfu": LFU, "fcr": FCR, "cycle": Cycle, "duel": Duel}
DEFAULT_POLICY = "cycle"


def make_policy(name: str, n_layers: int = 1, n_experts: int = 256, capacity: int = 0):
    """A policy for a cache of `capacity` slots over n_layers x n_experts keys."""
    try:
        cls = ONLINE_POLICIES[name]
        if cls is Duel:
            return Duel(n_layers, n_experts, capacity)
        return cls(n_layers, n_experts) if cls is Cycle else cls(n_layers)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (known: {', '.join(ONLINE_POLICIES)})") from None
