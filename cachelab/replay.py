"""The cache lab: replay a run's routing trace through a cache of any budget and policy.

The replay issues the requests in exactly the engine's order (runtime.schedule, which the
streamer uses too) through the engine's own ExpertCache bookkeeping, so for the same policy and
budget it reproduces the hit rate of a run made without prefetch, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ds4f.engine.config import Budget, parse_budget
from ds4f.errors import Ds4fError
from ds4f.cachelab.belady import Belady, HorizonBelady
from ds4f.cachelab.trace import Trace
from ds4f.engine.runtime.cache_book import CacheBook, slots_for_budget
from ds4f.engine.runtime.policies import DEFAULT_POLICY, make_policy
from ds4f.engine.runtime.schedule import TokenRequests, chunk_layer_keys, chunk_layer_requests

def parse_policy(policy: str) -> tuple[str, int | None]:
    """('belady', N) for 'belady@N' (N tokens of foresight), else (policy, None)."""
    if policy.startswith("belady@"):
        n = policy[len("belady@"):]
        if not n.isdigit() or int(n) < 1:
            raise Ds4fError(f"policy {policy!r}: belady@N takes a whole number of tokens >= 1, like belady@4")
        return "belady", int(n)
    return policy, None


@dataclass
class ReplayResult:
    policy: str
    budget_bytes: int
    slots: int
    hits: int
    misses: int
    bytes_read: int
    layer_hits: list[int] = field(default_factory=list)
    layer_misses: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def replay(trace: Trace, budget: Budget | str | int, policy: str) -> ReplayResult:
    """Replay the trace through a cache of `budget` (bytes, '4 GiB' or '25%' of the pool)."""
    if not isinstance(budget, Budget):
        budget = parse_budget(budget, "--cache")
    budget_bytes = budget.resolve(trace.pool_bytes)
    g = trace.geometry
    n_slots = slots_for_budget(budget_bytes, trace.slot_nbytes, min_slots=(g.n_hash_layers + 1) * g.top_k)

    name, horizon = parse_policy(policy)
    if horizon is not None:
        chosen = HorizonBelady(trace.request_sequence(), horizon * g.n_layers * g.top_k,
                               make_policy(DEFAULT_POLICY, g.n_layers, g.n_experts, n_slots))
    elif name == "belady":
        chosen = Belady(trace.request_sequence())
    else:
        try:
            chosen = make_policy(policy, g.n_layers, g.n_experts, n_slots)
        except ValueError as exc:
            raise Ds4fError(str(exc)) from None
    cache = CacheBook(n_slots, g.n_layers, chosen)
    req = TokenRequests(cache, g.n_layers, g.n_hash_layers)
    chunks = trace.chunks()
    for a, b in chunks:                 # the prefill's chunks, layer by layer, each expert once
        for layer in range(g.n_layers):
            for _ in chunk_layer_requests(cache, set(), a, layer, chunk_layer_keys(layer, trace.ids[a:b, layer])):
                pass
    for t in range(chunks[-1][1] if chunks else 0, len(trace.ids)):
        req.start(t, {layer: trace.ids[t, layer] for layer in range(g.n_hash_layers)})
        for layer in range(g.n_layers):
            req.enter(layer)
            req.request(layer, trace.ids[t, layer])
            req.leave(layer, trace.ids[t, layer])
    hits = sum(c.hits for c in cache.layers)
    misses = sum(c.misses for c in cache.layers)
    return ReplayResult(policy, budget_bytes, cache.n_slots, hits, misses, misses * trace.slot_nbytes,
                        [c.hits for c in cache.layers], [c.misses for c in cache.layers])
