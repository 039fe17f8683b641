"""Expert-cache eviction policies behind one small interface.

A policy only orders keys; the cache owns the slots and the byte budget. Keys are
(layer, expert) pairs. `touch` is called on every hit, `insert` after a miss fills a slot,
`victim` names the key to evict, `remove` forgets an evicted key.
"""
from __future__ import annotations

from collections import OrderedDict


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()

    def touch(self, key) -> None:
        self._order.move_to_end(key)

    def insert(self, key) -> None:
        self._order[key] = None

    def victim(self, protected=frozenset()):
        for key in self._order:
            if key not in protected:
                return key
        return None

    def remove(self, key) -> None:
        self._order.pop(key, None)


ONLINE_POLICIES = {"lru": LRU}


def make_policy(name: str):
    return ONLINE_POLICIES[name]()
