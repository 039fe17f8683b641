"""The expert cache: a pool of slots allocated once, the bookkeeping of runtime.cache_book over it.

The pool is one anonymous mapping (page-aligned, so slots are 4 KiB-aligned for O_DIRECT), on
transparent huge pages where the OS offers them (a kernel streaming a slot then walks 2 MiB
pages, not 4 KiB ones: far fewer TLB misses), touched page by page at creation so no page faults land on the hot path (fresh scratch memory
page-faulting mid-token can cost more than the math). Its size is slots x slot_nbytes <= the
preset's budget, and it never grows: the budget is enforced by construction.
"""
from __future__ import annotations

from ds4f.engine.model.weights import expert_weights
from ds4f.native import kernels
from ds4f.engine.runtime.cache_book import PAGE, CacheBook, LayerCounters, Slot, slots_for_budget
from ds4f.engine.runtime.memory import page_buffer
from ds4f.engine.runtime.policies import make_policy

__all__ = ["PAGE", "CacheBook", "ExpertCache", "LayerCounters", "Slot"]


class ExpertCache(CacheBook):
    def __init__(self, budget_bytes: int, slot_nbytes: int, n_layers: int, policy: str = "lru",
                 min_slots: int = 1, n_experts: int = 256) -> None:
        """policy: the name of an online policy (runtime.policies)."""
        if slot_nbytes % PAGE:
            raise ValueError(f"slot_nbytes must be a multiple of {PAGE}")
        n_slots = slots_for_budget(budget_bytes, slot_nbytes, min_slots)
        super().__init__(n_slots, n_layers, make_policy(policy, n_layers, n_experts, n_slots), tracks_reads=True)
        self.slot_nbytes = slot_nbytes
        self.budget_bytes = budget_bytes
        self.policy_name = policy
        self._n_experts = n_experts
        pool, self.huge_pages = page_buffer(n_slots * slot_nbytes, "huge")
        self.pool = pool.reshape(n_slots, slot_nbytes)
        self.pool[:, ::PAGE] = 0  # fault every page in now, not during a token
        self._experts: dict[int, tuple[dict, kernels.PreparedExpert]] = {}   # slot -> (layout, its views)

    def expert(self, index: int, layout: dict) -> kernels.PreparedExpert:
        """The expert weights in slot `index` (views into the pool laid out as `layout`), checked
        once per slot: the views stay valid whichever expert the slot holds."""
        known = self._experts.get(index)
        if known is None or known[0] is not layout:
            known = self._experts[index] = (layout, kernels.prepare_expert(expert_weights(self.pool[index], layout)))
        return known[1]

    def reset(self) -> None:  # type: ignore[override]
        """Empty the cache for a new run; the pool stays allocated and faulted in."""
        super().reset(make_policy(self.policy_name, len(self.layers), self._n_experts, self.n_slots))

    @property
    def used_bytes(self) -> int:
        return self.resident * self.slot_nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.slot_nbytes

    def close(self) -> None:
        self._experts.clear()
        self.pool = None  # type: ignore[assignment]  # the mapping goes with the last view of it
