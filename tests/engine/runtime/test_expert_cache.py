"""The expert cache on its own: slots from one pool, LRU order, protection, the budget."""
import pytest

from ds4f.errors import Ds4fError
from ds4f.engine.runtime.expert_cache import ExpertCache

SLOT = 8192


def test_pool_fits_the_budget_and_is_aligned():
    cache = ExpertCache(budget_bytes=5 * SLOT + 100, slot_nbytes=SLOT, n_layers=2)
    assert cache.n_slots == 5 and cache.capacity_bytes <= cache.budget_bytes
    assert all(cache.pool[i].ctypes.data % 4096 == 0 for i in range(cache.n_slots))


def _landed(cache, key):
    cache.peek(key).ready.set()  # what the reader does when the read completes


def test_lru_evicts_least_recently_used_and_counts():
    cache = ExpertCache(budget_bytes=3 * SLOT, slot_nbytes=SLOT, n_layers=2)
    for e in (1, 2, 3):
        cache.allocate((0, e), protected=set())
        _landed(cache, (0, e))
    assert cache.lookup((0, 1)) is not None        # 1 becomes most recent; 2 is now the LRU
    cache.allocate((1, 9), protected=set())
    assert (0, 2) not in cache and (0, 1) in cache and (0, 3) in cache
    assert cache.layers[0].evictions == 1 and cache.layers[0].hits == 1 and cache.layers[0].misses == 3
    assert cache.layers[1].misses == 1
    assert cache.used_bytes == 3 * SLOT <= cache.budget_bytes


def test_protected_keys_are_not_evicted():
    cache = ExpertCache(budget_bytes=2 * SLOT, slot_nbytes=SLOT, n_layers=1)
    cache.allocate((0, 1), protected=set())
    cache.allocate((0, 2), protected=set())
    _landed(cache, (0, 1))
    _landed(cache, (0, 2))
    cache.allocate((0, 3), protected={(0, 1)})
    _landed(cache, (0, 3))
    assert (0, 1) in cache and (0, 2) not in cache
    with pytest.raises(Ds4fError, match="in use"):
        cache.allocate((0, 4), protected={(0, 1), (0, 3)})


def test_a_slot_still_being_read_is_never_reused():
    cache = ExpertCache(budget_bytes=2 * SLOT, slot_nbytes=SLOT, n_layers=1)
    cache.allocate((0, 1), protected=set())   # in flight
    cache.allocate((0, 2), protected=set())
    _landed(cache, (0, 2))
    cache.allocate((0, 3), protected=set())   # LRU would pick (0, 1), but its read has not landed
    assert (0, 1) in cache and (0, 2) not in cache


def test_too_small_a_budget_is_refused():
    with pytest.raises(Ds4fError, match="at least 12"):
        ExpertCache(budget_bytes=4 * SLOT, slot_nbytes=SLOT, n_layers=1, min_slots=12)


def test_lent_slots_leave_the_cache_and_come_back_empty():
    cache = ExpertCache(budget_bytes=4 * SLOT, slot_nbytes=SLOT, n_layers=1)
    for e in (1, 2, 3):
        cache.allocate((0, e), protected=set())
    _landed(cache, (0, 1))
    _landed(cache, (0, 2))                      # (0, 3) is still being read
    lent = cache.lend(4)                        # the free slot, then the landed ones; never (0, 3)'s
    assert len(lent) == 3 and cache.peek((0, 3)) not in lent
    assert (0, 1) not in cache and (0, 2) not in cache and cache.lookup((0, 1)) is None
    assert all(slot.key is None for slot in lent) and cache.resident == 1
    assert cache.lend(1) == []                  # only a slot in flight is left
    cache.take_back(lent)
    for e in (4, 5, 6):                         # the slots given back are free: nothing is evicted
        cache.allocate((0, e), protected=set())
    assert cache.evictions == 0 and (0, 3) in cache and cache.resident == 4
