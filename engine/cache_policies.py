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
  cycle   ours: the forward pass visits layers in a cycle, so recency in wall-clock order
          is misleading. LRU's victim is typically an expert of the layer about to run
          (last used a whole token ago) — the worst choice. `cycle` ranks keys by frequency
          class first, then by how far away their layer's next turn is (the layers just
          passed come round last), then by recency.
The offline optimum (Belady: evict the key whose next request is farthest away) lives in
engine/cache_replay.py, since it needs the whole trace.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict


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


class Cycle(_Classed):
    """Frequency class, then the distance to the key's layer's next turn, then recency."""

    name = "cycle"
    MAX_CLASS = 6

    def klass(self, key) -> int:
        return min((self.uses[key] + 1).bit_length() - 1, self.MAX_CLASS)

    def victim(self, protected=frozenset()):
        n = self.n_layers
        for c in sorted(self._buckets):
            best, best_rank = None, None
            for key in self._buckets[c]:  # LRU order: the first of the farthest layer wins
                if key in protected:
                    continue
                # layers still ahead in this token come round soonest; the one just run comes last
                rank = (key[0] - self.layer - 1) % n
                if best_rank is None or rank > best_rank:
                    best, best_rank = key, rank
                    if rank == n - 1:
                        break
            if best is not None:
                return best
        return None


ONLINE_POLICIES = {"lru": LRU, "lfu": LFU, "fcr": FCR, "cycle": Cycle}
DEFAULT_POLICY = "cycle"


def make_policy(name: str, n_layers: int = 1):
    try:
        return ONLINE_POLICIES[name](n_layers)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r} (known: {', '.join(ONLINE_POLICIES)})") from None
