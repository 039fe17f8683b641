"""The streamer: the weight source the forward pass reads, backed by RAM, the expert cache and disk.

The forward pass (model.forward) computes a step's rows layer by layer and asks for each layer's
experts once its rows are routed. A step of one row (a decode token) is streamed as a token
(runtime.schedule's token order, which the cache lab's replay follows):
  1. token start: the hash layers' experts are known from the token id, so they are all requested
     at once; the first unpinned trunk layer's read starts;
  2. each layer: routing uses the resident router; the layer's misses go to the reader; with
     prefetch on, the next layer's likely experts are guessed by routing it on the current
     residual (router lookahead) and read by the reader's prefetch lane while the disk is idle;
     the next unpinned trunk layer is read ahead, queued behind the demand misses;
  3. arrivals: the experts already resident are handed out at once, the misses as they land, and
     the shared expert's weights in the first wait once its trunk is there (pinned, or read ahead);
     the time spent waiting is the token's stall.
A step of several rows (a prompt chunk, several sequences' tokens) reads each layer's distinct
experts once, in batches the cache holds (runtime.schedule's chunk order), the next batch's reads
under way while one computes; a few rows guess ahead as one token does.
Every buffer is allocated here, once; a step allocates only small Python objects.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Iterator

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.native import kernels
from ds4f.engine.model.forward import SHARED
from ds4f.engine.model.ops import rms_norm
from ds4f.engine.model.router import route, router_scores, row_scores
from ds4f.engine.model.weights import GlobalWeights, LayerAttention, MoeWeights, RouterWeights, SharedExpertWeights
from ds4f.engine.runtime.expert_cache import ExpertCache
from ds4f.engine.runtime.memory import warm_buffer
from ds4f.engine.runtime.reader import DEMAND, PREFETCH, Reader, TrunkJob
from ds4f.engine.runtime.schedule import TokenRequests, chunk_layer_keys, chunk_layer_requests


class Streamer:
    # Router lookahead guesses only its top PREFETCH_RANKS experts: the precision of a guess
    # falls with its rank, and the last ranks' guesses cost about as many wasted reads as they save
    # (`ds4f bench cache` measures it).
    PREFETCH_RANKS = 4
    # A step of at most PREFETCH_ROWS rows (several sequences' decode tokens) guesses ahead too;
    # a longer one is a prompt chunk, whose union is most of each layer anyway.
    PREFETCH_ROWS = 16

    def __init__(self, checkpoint, pinned: dict[int, MoeWeights], routers: dict[int, RouterWeights],
                 globals_: GlobalWeights, cache: ExpertCache, reader: Reader, prefetch: bool,
                 attention: list[LayerAttention] | None = None) -> None:
        g = self.geometry = checkpoint.geometry
        self.ckpt = checkpoint
        self.globals = globals_
        self.pinned = pinned                       # layer -> MoeWeights kept in RAM
        self.routers = routers                     # layer -> RouterWeights, every layer
        self._attention = attention or []          # layer -> LayerAttention, resident (the whole model)
        self.unpinned = [layer for layer in range(g.n_layers) if layer not in pinned]
        self.cache = cache
        self.reader = reader
        self.requests = TokenRequests(cache, g.n_layers, g.n_hash_layers)
        self.prefetch = prefetch
        # issued = useful + wasted + cancelled; late: useful but still being read when needed;
        # cancelled: dropped before its read started, costing nothing
        self.prefetch_counts = {"issued": 0, "useful": 0, "late": 0, "wasted": 0, "cancelled": 0}
        # per layer, the cache hits on an expert a guess brought in (they sum to "useful"): the
        # policy's own hits are the cache's hits less these
        self.prefetch_layer_hits = [0] * g.n_layers
        self._prefetched: dict[tuple[int, int], object] = {}  # key -> ReadJob, issued and not yet used
        self._trunk_bufs = ([warm_buffer(checkpoint.trunk_layer_buf_nbytes, huge=True) for _ in range(2)]
                            if self.unpinned else [])
        self._trunk_jobs: list = [None] * len(self._trunk_bufs)   # the last read into each of them
        self._landed = threading.Event()  # set by an I/O thread whenever a read completes
        # lookahead routing works in buffers of its own
        self._h64 = np.empty(g.hidden, np.float64)
        self._x_ahead = np.empty(g.hidden, np.float32)
        self._logits_ahead = np.empty(g.n_experts, np.float32)
        # and a step of several rows routes them in one call (PREFETCH_ROWS x (hidden + n_experts)
        # floats and the kernel's scratch: 0.5 MB on flash)
        self._xs_ahead = np.empty((self.PREFETCH_ROWS, g.hidden), np.float32)
        self._rows_ahead = np.empty((self.PREFETCH_ROWS, g.n_experts), np.float32)
        self._scratch_ahead = kernels.matmul_scratch(self.PREFETCH_ROWS, g.hidden)
        # the current token
        self.tokens = 0                 # tokens started so far: the cache policy's clock, which a warm
                                        # run continues (restarted, a policy's ages would run backwards
                                        # and its decayed counts overflow past ~4k tokens)
        self.stall_s = 0.0              # time arrivals waited for reads, summed over tokens
        self._one_row = False           # the current step is one row (a token: see the module)
        self._chunk_tokens: list[int] = []
        self._slots: dict[int, list] = {}
        self._trunk: dict[int, "MoeWeights | TrunkJob"] = {}
        self._trunk_next: TrunkJob | None = None

    @property
    def trunk_buffers(self) -> list:
        """The two read-ahead buffers of the unpinned trunk layers (empty if all are pinned), with
        no read left writing them (between passes, a caller may read into them itself)."""
        for b in range(len(self._trunk_bufs)):
            self._quiet_trunk(b)
        return list(self._trunk_bufs)

    @property
    def buffer_nbytes(self) -> int:
        return sum(b.nbytes for b in self._trunk_bufs)

    def reset(self, cold: bool = True) -> None:
        """A new run: zero counters and, cold, an empty cache; warm, the cache keeps the experts it
        holds (and its policy what it learnt), so a run on a loaded engine starts where the last
        one left it."""
        if cold:
            self.cache.reset()
            self.tokens = 0
        else:
            self.cache.reset_counters()
        self.reader.reset_stats()
        self.prefetch_counts = dict.fromkeys(self.prefetch_counts, 0)
        self.prefetch_layer_hits = [0] * self.geometry.n_layers
        self._prefetched.clear()
        self.stall_s = 0.0

    # -- the WeightSource interface (model.forward) --------------------------------------------------
    def router(self, layer: int) -> RouterWeights:
        return self.routers[layer]

    def attention(self, layer: int) -> LayerAttention:
        return self._attention[layer]

    def start_chunk(self, token_ids) -> None:
        """A step's rows start: one row is a token (its hash layers' experts requested now, see
        the module); several are requested layer by layer (chunk_arrivals). Either way the first
        unpinned trunk layer's read starts."""
        self._one_row = len(token_ids) == 1
        self._trunk = {}
        self._trunk_next = self._read_ahead(0) if self.unpinned else None
        self._chunk_tokens = list(token_ids)
        g = self.geometry
        if self._one_row:
            t = self.tokens
            self.tokens += 1
            hash_ids = {layer: self.routers[layer].tid2eid[token_ids[0]] for layer in range(g.n_hash_layers)}
            self._slots = {layer: self._issue(layer, p) for layer, p in self.requests.start(t, hash_ids).items()}
            self._row_ids: dict[int, np.ndarray] = {}
            return
        self._chunk_first = self.tokens
        self.tokens += len(token_ids)
        self._chunk_protected: set = set()
        if self.prefetch and len(token_ids) <= self.PREFETCH_ROWS:   # the hash layers' experts: known now
            self._prefetch_keys([(layer, int(e)) for layer in range(g.n_hash_layers) for t in token_ids
                                 for e in self.routers[layer].tid2eid[t]])

    def chunk_arrivals(self, layer: int, ids: np.ndarray, on_error=None,
                       ahead=None) -> Iterator[list[tuple[int, object]]]:
        """The step's routing at `layer` is known (ids: int32 [rows, top_k]): each distinct
        expert is read once (see the module). Batches of (expert id, weights) as they land;
        [(SHARED, shared expert weights)] once, when the layer's trunk is there. An expert whose
        read failed raises, or with on_error(expert id, error) is reported there and skipped.
        ahead(): called once the layer's first reads are requested, before any computes: where
        the next layer's guesses start (guess_rows)."""
        if self._one_row:
            yield from self._token_arrivals(layer, np.asarray(ids)[0], on_error, ahead)
            return
        shared = _Shared(self, layer, self._layer_trunk(layer))
        keys = chunk_layer_keys(layer, ids)
        for batch, slots in chunk_layer_requests(self.cache, self._chunk_protected, self._chunk_first, layer, keys,
                                                 issue=lambda pairs: self._issue(layer, pairs)):
            if ahead is not None:
                ahead()
                ahead = None
            failed = None if on_error is None else (lambda e, err, batch=batch: on_error(batch[e][1], err))
            for landed in self._land(layer, slots, shared, final=False, on_error=failed):
                yield [(e if e == SHARED else batch[e][1], w) for e, w in landed]
        if not shared.done:
            yield from self._land(layer, [], shared, final=True)

    def _token_arrivals(self, layer: int, row: np.ndarray, on_error, ahead) -> Iterator[list[tuple[int, object]]]:
        """chunk_arrivals for a step of one row (row: int32 [top_k], its experts in rank order)."""
        self.requests.enter(layer)
        # routing used the resident router; only the shared expert needs an unpinned layer's
        # trunk read, so it may still be in flight (_land waits for it when nothing else is left)
        shared = _Shared(self, layer, self._layer_trunk(layer))
        if layer >= self.geometry.n_hash_layers:
            self._slots[layer] = self._issue(layer, self.requests.request(layer, row))
        self._row_ids[layer] = row
        if ahead is not None:
            ahead()
        slots = self._slots.pop(layer)         # rank order; a hash layer's: requested at the token's start
        experts = [slot.key[1] for slot in slots]
        failed = None if on_error is None else (lambda r, err: on_error(experts[r], err))
        for landed in self._land(layer, slots, shared, final=True, on_error=failed):
            yield [(r if r == SHARED else experts[r], w) for r, w in landed]

    def _land(self, layer: int, slots: list, shared: "_Shared", final: bool,
              on_error=None) -> Iterator[list[tuple[int, object]]]:
        """(index into slots, expert weights) for the slots as they are ready, those ready together
        in one batch; [(SHARED, weights)] in the first wait once the trunk is there. With `final`,
        it returns only once the shared expert has been handed out too. The waits are the stall.
        A read that failed raises, or with on_error(index, error) is reported there and skipped."""
        pending = list(range(len(slots)))
        promoted = False
        while pending or (final and not shared.done):
            self._landed.clear()
            ready = [r for r in pending if slots[r].ready.is_set()]
            if not ready:
                if not shared.done and shared.ready():
                    yield [(SHARED, shared.take())]  # the shared expert needs no expert read
                    continue
                if not pending and not promoted:
                    self.reader.promote(shared.trunk)  # the trunk is all this layer still waits for
                    promoted = True
                t0 = time.perf_counter()
                self._landed.wait(0.05)
                self.stall_s += time.perf_counter() - t0
                continue
            failed = []
            for r in ready:
                slot = slots[r]
                pending.remove(r)
                if slot.error is not None:
                    err, key = slot.error, slot.key
                    self.cache.discard(key)
                    if not isinstance(err, Ds4fError):
                        err = Ds4fError(f"reading expert {key[1]} of layer {layer}: {err}")
                    if on_error is None:
                        raise err
                    on_error(r, err)
                    failed.append(r)
            landed = [(r, self.cache.expert(slots[r].index, self.ckpt.expert_layout))
                      for r in ready if r not in failed]
            if landed:
                yield landed

    def finish_chunk_layer(self, layer: int) -> None:
        """The step's rows are done with `layer`: its experts may be evicted."""
        if self._one_row:
            self.requests.leave(layer, self._row_ids.pop(layer))
        else:
            self._chunk_protected.clear()

    def guess_rows(self, layer: int, H) -> None:
        """Router lookahead for a step of a few rows: route `layer` on each row's current MoE input
        H[c] and start reading its likely experts while the layer before computes. Not for a long
        prompt chunk (its union is most of the layer: it reads it batch by batch)."""
        g = self.geometry
        if not self.prefetch or not g.n_hash_layers <= layer < g.n_layers or len(H) > self.PREFETCH_ROWS:
            return
        if self._one_row:
            self._guess(layer, H[0])
            return
        router = self.routers[layer]
        n = len(self._chunk_tokens)
        scores = row_scores(router, H[:n], g.rms_norm_eps, self._xs_ahead, self._rows_ahead, self._scratch_ahead,
                            self._h64)
        keys = []
        for c, t in enumerate(self._chunk_tokens):
            ids, _ = route(scores[c], router, t, g)
            keys += [(layer, int(e)) for e in ids[:self.PREFETCH_RANKS]]
        self._prefetch_keys(keys)

    def _prefetch_keys(self, keys: list) -> None:
        """Start prefetch reads of those of `keys` the cache lacks, while slots free of the
        current needs are there (best effort)."""
        keys = list(dict.fromkeys(keys))
        keep = self._chunk_protected | set(keys)
        for key in keys:
            if key in self.cache or key in self._prefetched:
                continue
            try:
                slot = self.cache.allocate(key, keep, count=False, wait=False)
            except Ds4fError:
                break
            self.prefetch_counts["issued"] += 1
            self._prefetched[key] = self._read(slot, key, PREFETCH)

    def _layer_trunk(self, layer: int):
        """The layer's trunk (pinned, or the read-ahead job) and the next unpinned layer's read started."""
        if layer in self.pinned:
            return self.pinned[layer]
        trunk = self._trunk_next
        i = self.unpinned.index(layer)
        if i + 1 < len(self.unpinned):  # into the buffer the previous unpinned layer used
            self._trunk_next = self._read_ahead(i + 1)
        return trunk

    # -- reads ----------------------------------------------------------------------------------
    def _read_ahead(self, unpinned_index: int) -> TrunkJob:
        layer, b = self.unpinned[unpinned_index], unpinned_index % 2
        self._quiet_trunk(b)
        self._trunk_jobs[b] = self.reader.read_trunk_layer(layer, self._trunk_bufs[b], self._landed)
        return self._trunk_jobs[b]

    def _quiet_trunk(self, b: int) -> None:
        """No earlier read left writing trunk buffer b. A pass that stopped part way (cancelled, or
        an error) leaves its next layer's read-ahead behind; landing late, it would overwrite the
        layer a later pass reads into the same buffer. Cancelled if not started, else waited for."""
        job, self._trunk_jobs[b] = self._trunk_jobs[b], None
        if job is not None and not job.cancel():
            futures.wait([job.future])

    def _issue(self, layer: int, pairs: list) -> list:
        """Slots of a layer's request: misses go to the reader; hits on a guess count the guess."""
        slots = []
        useful = set()
        for slot, hit in pairs:
            key = slot.key
            if not hit:
                self._read(slot, key)
            elif key in self._prefetched:
                useful.add(key)
                self.prefetch_counts["useful"] += 1
                self.prefetch_layer_hits[layer] += 1
                if not slot.ready.is_set():
                    self.prefetch_counts["late"] += 1
                    self.reader.promote(self._prefetched[key])
            slots.append(slot)
        # guesses for this layer the router did not choose (or that were evicted first):
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

    def _guess(self, layer: int, h: np.ndarray) -> None:
        """Router lookahead of a one-row step: route `layer` on the row's MoE input h and start
        reading its likely experts while the layer before computes."""
        g = self.geometry
        router = self.routers[layer]
        x = rms_norm(h, router.ffn_norm, g.rms_norm_eps, self._x_ahead, self._h64)
        ids, _ = route(router_scores(router, x, self._logits_ahead), router, self._chunk_tokens[0], g)
        keep = self.requests.protected | {(layer, int(e)) for e in ids}
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


class _Shared:
    """A layer's shared expert on its way: the trunk (pinned MoeWeights, or the read-ahead job)
    and whether its weights have been handed out."""

    def __init__(self, streamer: Streamer, layer: int, trunk) -> None:
        self.streamer, self.layer, self.trunk = streamer, layer, trunk
        self.done = False

    def ready(self) -> bool:
        return isinstance(self.trunk, MoeWeights) or self.trunk.done()

    def take(self) -> SharedExpertWeights:
        if not isinstance(self.trunk, MoeWeights):
            self.trunk = MoeWeights(self.streamer.routers[self.layer], SharedExpertWeights.from_tensors(self.trunk.result()))
        self.done = True
        return self.trunk.shared
