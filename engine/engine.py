"""The streaming engine: one decode step = the MoE forward of one token, experts from the cache.

Per token:
  1. the hash layers' experts are known from the token id: request them all at once;
  2. for each layer: route (the routers are always resident), request the misses, compute
     the experts already resident while the misses load, then the rest as they land; the
     shared expert runs in the first wait once its trunk is there (pinned, or read ahead by
     the reader one layer early, queued behind the demand reads); add the residual;
     with prefetch on, each layer also guesses the next one's experts (router lookahead),
     which the reader's prefetch lane reads only while the disk is otherwise idle;
  3. final norm, head, greedy argmax.
Every buffer is allocated here, once; a step allocates only small Python objects.
"""
from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass

import numpy as np

from ds4f.engine import kernels
from ds4f.engine.checkpoint import aligned_buffer
from ds4f.engine.config import Preset
from ds4f.engine.errors import Ds4fError
from ds4f.engine.runtime.expert_cache import ExpertCache
from ds4f.engine.model.moe import LayerTrunk, SharedExpert, expert_weights, rms_norm, route, sqrt_softplus
from ds4f.engine.runtime.reader import DEMAND, PREFETCH, Reader, TrunkJob


@dataclass
class StepResult:
    next_token: int
    ids: np.ndarray          # int32 [n_layers, top_k]  selected experts, rank order
    weights: np.ndarray      # fp32 [n_layers, top_k]
    hidden: np.ndarray       # fp32 [n_layers, hidden]  residual stream after each layer
    hits: int
    misses: int
    bytes_read: int
    stall_s: float
    disk_busy_s: float       # time in this step with at least one read in flight
    disk_depth_s: float      # time integral of reads in flight (/ step time = mean queue depth)


# What a run's Python side holds beyond its arrays: token records, events, the report,
# numpy temporaries and the I/O threads' stacks (measured at 2-4 MiB on the demo model).
BOOKKEEPING_BYTES = 16 << 20


@dataclass(frozen=True)
class EngineFigures:
    layer_hits: tuple[int, ...]
    layer_misses: tuple[int, ...]
    layer_evictions: tuple[int, ...]
    cache_used_bytes: int
    cache_capacity_bytes: int     # slots x slot bytes, <= the budget
    cache_budget_bytes: int
    slots: int
    slot_nbytes: int
    expert_reads: int
    read_latency_s: float         # summed over expert reads
    prefetch: dict
    pinned_layers: tuple[int, ...]
    resident_bytes: int           # what the engine keeps in RAM: pinned trunk, globals, routers, cache, buffers


def warm_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned buffer for direct reads, every page faulted in now rather than mid-token."""
    buf = aligned_buffer(nbytes)
    buf[::mmap.PAGESIZE] = 0
    return buf


class Engine:
    # Router lookahead guesses only its top PREFETCH_RANKS experts. Precision by the guess's
    # rank, measured on the bench model's traces (1 layer ahead): 0.98 0.93 0.83 0.74 0.60 0.47,
    # so the last two would cost about as many wasted reads as they save.
    PREFETCH_RANKS = 4

    def __init__(self, checkpoint, preset: Preset, io_threads: int, kernel_threads: int, backend: str) -> None:
        self.ckpt = checkpoint
        g = self.geometry = checkpoint.geometry
        self.preset = preset
        self.set_kernels(backend, kernel_threads)

        # trunk: globals and pinned layers stay resident; the others are read per token
        self.embed = checkpoint.global_tensor("embed.weight")
        self.head = checkpoint.global_tensor("head.weight")
        self.final_norm = np.asarray(checkpoint.global_tensor("norm.weight"), dtype=np.float32)
        self.n_pinned = preset.pinned_count(g.n_layers)
        # (layer_tensors reads a layer into a buffer of its own: the views keep just that alive)
        self.pinned: dict[int, LayerTrunk] = {
            layer: LayerTrunk.from_tensors(checkpoint.layer_tensors(layer)) for layer in range(self.n_pinned)}
        self.unpinned = list(range(self.n_pinned, g.n_layers))
        # Routing stays resident whatever is pinned (a few MB): the hash tables drive the
        # token-start fetch, the learned routers the lookahead prefetch.
        self.routers: dict[int, LayerTrunk] = {}
        for layer in range(g.n_layers):
            if layer in self.pinned:
                self.routers[layer] = self.pinned[layer]
            else:
                self.routers[layer] = LayerTrunk.router_only(checkpoint.layer_tensors(layer))
        self.tid2eid = {layer: self.routers[layer].tid2eid for layer in range(g.n_hash_layers)}
        self.prefetch = bool(preset.prefetch)
        # issued = useful + wasted + cancelled; late: useful but still being read when needed;
        # cancelled: dropped before its read started, costing nothing
        self.prefetch_counts = {"issued": 0, "useful": 0, "late": 0, "wasted": 0, "cancelled": 0}
        self._prefetched: dict[tuple[int, int], object] = {}  # key -> ReadJob, issued and not yet used
        self._x_ahead = np.empty(g.hidden, np.float32)
        self._logits_ahead = np.empty(g.n_experts, np.float32)
        self._trunk_bufs = [warm_buffer(checkpoint.trunk_layer_buf_nbytes) for _ in range(2)] if self.unpinned else []

        self.pool_bytes = g.n_layers * g.n_experts * checkpoint.slot_nbytes
        self.cache = ExpertCache(preset.cache.resolve(self.pool_bytes), checkpoint.slot_nbytes, g.n_layers,
                                 preset.policy, min_slots=(g.n_hash_layers + 1) * g.top_k, n_experts=g.n_experts)
        self.reader = Reader(checkpoint, io_threads)
        self.steps = 0  # tokens decoded so far
        self._landed = threading.Event()  # set by an I/O thread whenever a read completes

        # per-step buffers
        self.h = np.empty(g.hidden, np.float32)
        self._h64 = np.empty(g.hidden, np.float64)  # rms_norm's float64 sum of squares
        self.x = np.empty(g.hidden, np.float32)
        self.logits = np.empty(g.n_experts, np.float32)
        self.vocab_logits = np.empty(g.vocab, np.float32)
        self.ys = np.empty((g.top_k, g.hidden), np.float32)
        self.y = np.empty(g.hidden, np.float32)
        self.scratch = kernels.experts_scratch(1, g.hidden, g.inter)
        self.shared = SharedExpert(g.hidden, g.inter * g.n_shared_experts)
        self.out_ids = np.empty((g.n_layers, g.top_k), np.int32)
        self.out_weights = np.empty((g.n_layers, g.top_k), np.float32)
        self.out_hidden = np.empty((g.n_layers, g.hidden), np.float32)

    def figures(self) -> "EngineFigures":
        """The cache, reader and memory figures a snapshot or report needs (a cheap copy)."""
        ck, cache = self.ckpt, self.cache
        reads, _nbytes, latency = self.reader.expert_stats.totals()
        routers = sum(t.gate.nbytes + t.ffn_norm.nbytes + (t.bias.nbytes if t.bias is not None else 0)
                      + (t.tid2eid.nbytes if t.tid2eid is not None else 0)
                      for layer, t in self.routers.items() if layer not in self.pinned)
        resident = (sum(ck.trunk_layer_nbytes(layer) for layer in self.pinned)
                    + sum(a.nbytes for a in (self.embed, self.head, self.final_norm))
                    + cache.capacity_bytes + sum(b.nbytes for b in self._trunk_bufs) + routers
                    + self.scratch.nbytes + BOOKKEEPING_BYTES)
        return EngineFigures(
            layer_hits=tuple(c.hits for c in cache.layers), layer_misses=tuple(c.misses for c in cache.layers),
            layer_evictions=tuple(c.evictions for c in cache.layers), cache_used_bytes=cache.used_bytes,
            cache_capacity_bytes=cache.capacity_bytes, cache_budget_bytes=cache.budget_bytes, slots=cache.n_slots,
            slot_nbytes=cache.slot_nbytes, expert_reads=reads, read_latency_s=latency,
            prefetch=dict(self.prefetch_counts) if self.prefetch else {}, pinned_layers=tuple(sorted(self.pinned)),
            resident_bytes=resident)

    # -- settings that change at token boundaries ------------------------------------------
    def set_kernels(self, backend: str, threads: int) -> None:
        try:
            self.backend = kernels.set_backend(backend)
        except ValueError as exc:
            raise Ds4fError(str(exc)) from None
        kernels.set_threads(threads)
        self.kernel_threads = threads

    def reset_for_run(self, io_threads: int, kernel_threads: int, backend: str) -> None:
        """Make a loaded engine start the next run as a fresh one would: an empty expert cache
        (its slots stay allocated and faulted in), zero counters, the run's kernel and I/O settings."""
        self.cache.reset()
        self.reader.reset_stats()
        self.prefetch_counts = dict.fromkeys(self.prefetch_counts, 0)
        self._prefetched.clear()
        self.steps = 0
        self.set_kernels(backend, kernel_threads)
        self.set_io_threads(io_threads)

    def set_io_threads(self, threads: int) -> None:
        self.reader.resize(threads)

    @property
    def io_threads(self) -> int:
        return self.reader.threads

    # -- one token --------------------------------------------------------------------------
    def step(self, token_id: int) -> StepResult:
        g = self.geometry
        if not 0 <= token_id < g.vocab:
            raise Ds4fError(f"token id {token_id} is outside the vocabulary (0..{g.vocab - 1})")
        kernels.set_backend(self.backend)  # the process-wide setting is this run's, every token
        kernels.set_threads(self.kernel_threads)
        hits0 = sum(c.hits for c in self.cache.layers)
        misses0 = sum(c.misses for c in self.cache.layers)
        bytes0 = self.reader.expert_stats.totals()[1] + self.reader.trunk_stats.totals()[1]
        busy0, depth0 = self.reader.occupancy.totals()
        stall = 0.0

        protected: set = set()
        step_index = self.steps
        self.steps += 1
        self.cache.at(step_index, -1)
        hash_slots = {layer: self._request(layer, self.tid2eid[layer][token_id], protected)
                      for layer in range(g.n_hash_layers)}
        trunk_next = self._read_ahead(self.unpinned[0], 0) if self.unpinned else None

        h = self.h
        np.copyto(h, self.embed[token_id])  # bf16 -> fp32, exact
        for layer in range(g.n_layers):
            if layer in self.pinned:
                trunk = self.pinned[layer]
            else:
                # routing uses the resident router; only the shared expert needs this read,
                # so it may still be in flight (moe_block waits for it when nothing else is left)
                trunk = trunk_next
                i = self.unpinned.index(layer)
                if i + 1 < len(self.unpinned):  # into the buffer the previous unpinned layer used
                    trunk_next = self._read_ahead(self.unpinned[i + 1], (i + 1) % 2)
            self.cache.at(step_index, layer)
            ids, weights, y, layer_stall = self.moe_block(layer, trunk, h, token_id, protected, hash_slots.get(layer),
                                                          lookahead=self.prefetch and layer + 1 < g.n_layers)
            stall += layer_stall
            h += y
            self.out_ids[layer] = ids
            self.out_weights[layer] = weights
            self.out_hidden[layer] = h
            protected.difference_update((layer, int(e)) for e in ids)

        final = rms_norm(h, self.final_norm, g.rms_norm_eps, self.x, self._h64)
        kernels.bf16_matvec(self.head, final, out=self.vocab_logits)
        next_token = int(np.argmax(self.vocab_logits))
        bytes1 = self.reader.expert_stats.totals()[1] + self.reader.trunk_stats.totals()[1]
        busy1, depth1 = self.reader.occupancy.totals()
        return StepResult(next_token, self.out_ids, self.out_weights, self.out_hidden,
                          hits=sum(c.hits for c in self.cache.layers) - hits0,
                          misses=sum(c.misses for c in self.cache.layers) - misses0,
                          bytes_read=bytes1 - bytes0, stall_s=stall,
                          disk_busy_s=busy1 - busy0, disk_depth_s=depth1 - depth0)

    def moe_block(self, layer: int, trunk: "LayerTrunk | TrunkJob", h: np.ndarray, token_id: int, protected: set,
                  slots: list | None = None, lookahead: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """One layer's MoE block on the residual h: (ids, weights, block output y, stall seconds).

        y = routed experts + shared expert of rmsnorm(h); the caller adds it to h. This is
        DeepseekV4SparseMoeBlock (after its post-attention RMSNorm) in transformers' terms.
        trunk: the layer's trunk, or its read still in flight (the router is always resident).
        """
        g = self.geometry
        router = self.routers[layer]
        x = rms_norm(h, router.ffn_norm, g.rms_norm_eps, self.x, self._h64)
        kernels.bf16_matvec(router.gate, x, out=self.logits)
        ids, weights = route(sqrt_softplus(self.logits), router, token_id, g)
        if slots is None:
            slots = self._request(layer, ids, protected)
        if lookahead:
            self._prefetch_next(layer + 1, h, token_id, protected)
        shared, stall = self._compute_experts(layer, ids, weights, slots, x, trunk)
        # sum in routing-rank order, whatever order the experts landed in, then the shared expert
        self.y[:] = self.ys[0]
        for r in range(1, g.top_k):
            self.y += self.ys[r]
        self.y += shared
        return ids, weights, self.y, stall

    def layer_trunk(self, layer: int) -> LayerTrunk:
        """A layer's MoE trunk: the pinned copy, or a fresh read (outside the per-token read-ahead)."""
        if layer in self.pinned:
            return self.pinned[layer]
        return LayerTrunk.from_tensors(self.ckpt.layer_tensors(layer))

    def _read_ahead(self, layer: int, buf_index: int) -> TrunkJob:
        return self.reader.read_trunk_layer(layer, self._trunk_bufs[buf_index], self._landed)

    def _request(self, layer: int, ids, protected: set) -> list:
        """The slots of this layer's experts: hits now, misses handed to the reader."""
        keys = [(layer, int(e)) for e in ids]
        slots = []
        useful = set()
        for key, (slot, hit) in zip(keys, self.cache.request(keys, protected)):
            if not hit:
                self._read(slot, key)
            elif key in self._prefetched:
                useful.add(key)
                self.prefetch_counts["useful"] += 1
                if not slot.ready.is_set():
                    self.prefetch_counts["late"] += 1
                    self.reader.promote(self._prefetched[key])
            slots.append(slot)
        # predictions for this layer the router did not choose (or that were evicted first):
        # cancelled if their read has not started, else wasted reads
        for key in [k for k in self._prefetched if k[0] == layer]:
            job = self._prefetched.pop(key)
            if key in useful:
                continue
            if job.cancel() and self.cache.peek(key) is job.slot:
                self.cache.discard(key)
                self.prefetch_counts["cancelled"] += 1
            else:
                self.prefetch_counts["wasted"] += 1
        return slots

    def _read(self, slot, key, priority: int = DEMAND):
        return self.reader.read_expert(slot, key[0], key[1], self.cache.pool[slot.index], self._landed, priority)

    def _prefetch_next(self, layer: int, h: np.ndarray, token_id: int, protected: set) -> None:
        """Router lookahead: route `layer` on the current residual and start reading its likely
        experts while this layer computes. Hash layers need no guess (fetched at token start)."""
        if layer < self.geometry.n_hash_layers:
            return
        g = self.geometry
        router = self.routers[layer]
        x = rms_norm(h, router.ffn_norm, g.rms_norm_eps, self._x_ahead, self._h64)
        kernels.bf16_matvec(router.gate, x, out=self._logits_ahead)
        ids, _ = route(sqrt_softplus(self._logits_ahead), router, token_id, g)
        keep = protected | {(layer, int(e)) for e in ids}
        for e in ids[:self.PREFETCH_RANKS]:
            key = (layer, int(e))
            if key in self.cache:
                continue
            try:
                slot = self.cache.allocate(key, keep, count=False, wait=False)
            except Ds4fError:
                break  # no slot free of the current token's needs: prefetch is best effort
            self.prefetch_counts["issued"] += 1
            self._prefetched[key] = self._read(slot, key, PREFETCH)

    def _compute_experts(self, layer: int, ids, weights, slots, x, trunk) -> tuple[np.ndarray, float]:
        """Run each routed expert into ys[rank] as soon as its slot is ready, and the shared
        expert in the first wait once its trunk is there; return (shared output, stall time)."""
        g = self.geometry
        layout = self.ckpt.expert_layout
        pending = list(range(len(slots)))
        shared = None
        promoted = False
        stall = 0.0
        while pending or shared is None:
            self._landed.clear()
            ready = [r for r in pending if slots[r].ready.is_set()]
            if not ready:
                if shared is None and (isinstance(trunk, LayerTrunk) or trunk.done()):
                    if not isinstance(trunk, LayerTrunk):
                        trunk = LayerTrunk.from_tensors(trunk.result())
                    shared = self.shared(trunk, x)  # the shared expert needs no expert read
                    continue
                if not pending and not promoted:
                    self.reader.promote(trunk)  # the trunk is all this layer still waits for
                    promoted = True
                t0 = time.perf_counter()
                self._landed.wait(0.05)
                stall += time.perf_counter() - t0
                continue
            for r in ready:
                slot = slots[r]
                if slot.error is not None:
                    err = slot.error
                    self.cache.discard(slot.key)
                    if isinstance(err, Ds4fError):
                        raise err
                    raise Ds4fError(f"reading expert {int(ids[r])} of layer {layer}: {err}") from err
                ew = expert_weights(self.cache.pool[slot.index], layout)
                kernels.experts_forward([ew], weights[r:r + 1], x, g.swiglu_limit, self.ys[r], self.scratch)
                pending.remove(r)
        return shared, stall

    def close(self) -> None:
        self.reader.close()
        self.cache.close()
