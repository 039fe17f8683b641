"""The cache lab: replay a run's routing trace through a cache of any budget and policy.

A trace is, for each token and layer, the experts the router chose (rank order). It comes
from a run's state dump or from a compact export (`ds4f trace export`, an .npz). The replay
issues the requests in exactly the engine's order — the hash layers' experts at token start,
then each learned layer's, each layer's keys protected while it runs — through the engine's
own ExpertCache bookkeeping, so for the same policy and budget it reproduces the hit rate
of a run made without prefetch, exactly.

Belady's clairvoyant policy (evict the resident key whose next request is farthest away)
needs the whole request sequence, so it exists only here, as the bound.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4f.engine.config import Budget, parse_budget
from ds4f.engine.errors import Ds4fError
from ds4f.engine.runtime.expert_cache import PAGE, ExpertCache
from ds4f.engine.model.geometry import Geometry

TRACE_FORMAT = "ds4f.trace"
TRACE_VERSION = 1


@dataclass
class Trace:
    geometry: Geometry
    ids: np.ndarray          # int32 [tokens, n_layers, top_k], routing-rank order
    tokens: np.ndarray       # int32 [tokens], the token fed at each step
    source: str = ""

    @property
    def slot_nbytes(self) -> int:
        return -(-self.geometry.expert_nbytes // PAGE) * PAGE

    @property
    def pool_bytes(self) -> int:
        g = self.geometry
        return g.n_layers * g.n_experts * self.slot_nbytes

    def request_sequence(self) -> list[tuple[int, int]]:
        """Every (layer, expert) request in the engine's order: per token, the hash layers'
        experts first (fetched at token start), then each learned layer's, rank order."""
        return [(layer, int(e)) for t in range(len(self.ids)) for layer in range(self.geometry.n_layers)
                for e in self.ids[t, layer]]  # the hash layers are the first ones


def load_trace(path: str | os.PathLike) -> Trace:
    """A trace from a state dump (state.bin) or an exported trace (.npz)."""
    path = Path(path)
    if not path.exists():
        raise Ds4fError(f"{path}: trace not found")
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic == b"DS4FSTAT":
        from ds4f.engine.statedump import read_state

        state = read_state(path)
        geometry = Geometry.from_config(state.header["geometry"], str(path))
        return Trace(geometry, np.array(state.records["ids"], dtype=np.int32),
                     np.array(state.records["token"], dtype=np.int32), str(path))
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != TRACE_FORMAT:
                raise ValueError("not a ds4f trace")
            if meta.get("version") != TRACE_VERSION:
                raise Ds4fError(f"{path}: trace version {meta.get('version')}; this ds4f reads {TRACE_VERSION}")
            geometry = Geometry.from_config(meta["geometry"], str(path))
            ids = z["ids"].astype(np.int32)
            tokens = z["tokens"].astype(np.int32)
    except Ds4fError:
        raise
    except Exception as exc:  # zip/npz/json damage of any kind
        raise Ds4fError(f"{path}: not a ds4f state dump or trace ({exc})") from None
    g = geometry
    if ids.ndim != 3 or ids.shape[1:] != (g.n_layers, g.top_k) or len(tokens) != len(ids):
        raise Ds4fError(f"{path}: trace shape {ids.shape} does not match its geometry "
                        f"({g.n_layers} layers x top-{g.top_k})")
    if len(ids) and (ids.min() < 0 or ids.max() >= g.n_experts):
        raise Ds4fError(f"{path}: expert ids outside 0..{g.n_experts - 1}")
    return Trace(geometry, ids, tokens, str(path))


def export_trace(state_path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the compact trace of a state dump: expert ids as uint16, token ids, geometry."""
    trace = load_trace(state_path)
    out = Path(out)
    meta = json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION,
                       "geometry": trace.geometry.to_config(), "source": str(state_path)})
    tmp = out.with_name(out.name + ".partial.npz")
    np.savez_compressed(tmp, meta=np.array(meta), ids=trace.ids.astype(np.uint16), tokens=trace.tokens)
    os.replace(tmp, out)
    return out


class Belady:
    """Clairvoyant eviction over a known request sequence (one key per request, in order)."""

    name = "belady"

    def __init__(self, sequence: list) -> None:
        inf = len(sequence) + 1
        self._next = [inf] * len(sequence)
        last: dict = {}
        for i in range(len(sequence) - 1, -1, -1):
            self._next[i] = last.get(sequence[i], inf)
            last[sequence[i]] = i
        self._pos = 0
        self._resident_next: dict = {}

    def at(self, token: int, layer: int) -> None:
        pass

    def _seen(self, key) -> None:
        self._resident_next[key] = self._next[self._pos]
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
    cache = ExpertCache(budget_bytes, trace.slot_nbytes, g.n_layers, "lru",
                        min_slots=(g.n_hash_layers + 1) * g.top_k, with_pool=False, n_experts=g.n_experts)
    from ds4f.engine.runtime.policies import DEFAULT_POLICY, make_policy

    name, horizon = parse_policy(policy)
    if horizon is not None:
        cache.policy = HorizonBelady(trace.request_sequence(), horizon * g.n_layers * g.top_k,
                                     make_policy(DEFAULT_POLICY, g.n_layers, g.n_experts, cache.n_slots))
    elif name == "belady":
        cache.policy = Belady(trace.request_sequence())
    else:
        try:
            cache.policy = make_policy(policy, g.n_layers, g.n_experts, cache.n_slots)
        except ValueError as exc:
            raise Ds4fError(str(exc)) from None
    cache.policy_name = policy
    for t in range(len(trace.ids)):  # the engine's Engine.step, without the arithmetic
        keys = [[(layer, int(e)) for e in trace.ids[t, layer]] for layer in range(g.n_layers)]
        protected: set = set()
        cache.at(t, -1)
        for layer in range(g.n_hash_layers):
            cache.request(keys[layer], protected)
        for layer in range(g.n_layers):
            cache.at(t, layer)
            if layer >= g.n_hash_layers:
                cache.request(keys[layer], protected)
            protected.difference_update(keys[layer])
    hits = sum(c.hits for c in cache.layers)
    misses = sum(c.misses for c in cache.layers)
    return ReplayResult(policy, budget_bytes, cache.n_slots, hits, misses, misses * trace.slot_nbytes,
                        [c.hits for c in cache.layers], [c.misses for c in cache.layers])
