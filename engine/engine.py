"""The long-lived engine: a checkpoint, the resident trunk, the routers, the expert cache, the
reader and the kernel settings. A run works on it through a Session (engine.session), which holds
what belongs to one sequence; the engine outlives its sessions (see runs.EngineHost).
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ds4f.native import kernels
from ds4f.engine.config import Preset
from ds4f.errors import Ds4fError
from ds4f.units import format_bytes
from ds4f.engine.model.ops import pin_numpy_blas
from ds4f.engine.model.weights import GlobalWeights, MoeWeights, RouterWeights
from ds4f.engine.resident import load_attention
from ds4f.engine.runtime.expert_cache import ExpertCache
from ds4f.engine.runtime.memory import BOOKKEEPING_BYTES, keep_freed_memory, warm_buffer
from ds4f.engine.runtime.reader import Reader
from ds4f.engine.runtime.streamer import Streamer
from ds4f.engine.checkpoint.fingerprint import checkpoint_fingerprint
from ds4f.engine.checkpoint.formats import check_finite
from ds4f.engine.checkpoint.verify import tid2eid_problems
from ds4f.engine.batch import StepBatcher
from ds4f.engine.session import Session
from ds4f.engine.kv_blocks import BLOCK_TARGET, block_tokens
from ds4f.engine.prefix_cache import PrefixCache
from ds4f.engine.session_state import SessionState


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
    checks: int = 0               # expert records and streamed trunk layers checked against their crc32
    check_s: float = 0.0          # I/O-thread time those checks took


@dataclass(frozen=True)
class KernelSettings:
    """The native kernels' backend and thread count. The native library holds one setting per
    process; the engine applies its own when a session starts and when a switch lands, so it
    holds while the engine computes (one engine computes at a time). Sessions stepping together
    each keep theirs (Session.kernels): a batched step holds rows of one setting and applies it."""

    backend: str        # avx512 | avx2 | neon | scalar (resolved, never "auto")
    threads: int        # native pool size, the calling thread included

    def apply(self) -> None:
        kernels.set_backend(self.backend)
        kernels.set_threads(self.threads)
        pin_numpy_blas()


class Engine:
    def __init__(self, checkpoint, preset: Preset, io_threads: int, kernel_threads: int, backend: str) -> None:
        keep_freed_memory()          # a prefill's numpy temporaries reuse freed memory, not fresh pages
        # held while a forward pass computes and while the kernel or I/O settings change, so that a
        # switch lands between steps whichever thread asks for it (several sessions step together)
        self.compute_lock = threading.RLock()
        self.batcher: StepBatcher | None = None   # use_batcher makes it
        self.ckpt = checkpoint
        g = self.geometry = checkpoint.geometry
        self.preset = preset
        self.set_kernels(backend, kernel_threads)

        # trunk: globals and pinned layers stay resident; the others are read per token
        # attention and hyper-connections (the whole model) stay resident: every token reads them
        self.attention, hc_head = load_attention(checkpoint, g) if g.attention is not None else ([], None)
        self.globals = GlobalWeights(embed=checkpoint.global_tensor("embed.weight"),
                                     final_norm=np.asarray(checkpoint.global_tensor("norm.weight"), dtype=np.float32),
                                     head=checkpoint.global_tensor("head.weight"), hc_head=hc_head)
        self.n_pinned = preset.pinned_count(g.n_layers)
        self.pinned: dict[int, MoeWeights] = {
            layer: MoeWeights.from_tensors(
                checkpoint.layer_tensors(layer, warm_buffer(checkpoint.trunk_layer_buf_nbytes, huge=True)))
            for layer in range(self.n_pinned)}  # each in a buffer of its own (on huge pages where the OS has them)
        # Routing stays resident whatever is pinned (a few MB): the hash tables drive the
        # token-start fetch, the learned routers the lookahead prefetch.
        self.routers: dict[int, RouterWeights] = {
            layer: self.pinned[layer].router if layer in self.pinned
            else RouterWeights.from_tensors(checkpoint.layer_tensors(layer), copy=True)
            for layer in range(g.n_layers)}
        _check_routers(checkpoint, self.routers, g)

        self.pool_bytes = g.n_layers * g.n_experts * checkpoint.slot_nbytes
        self.notes: list[str] = []   # settings the engine had to adjust, for the run's event log
        if preset.cache.exceeds(self.pool_bytes):
            self.notes.append(f"cache {preset.cache} is more than the whole expert pool"
                              f" ({format_bytes(self.pool_bytes)}): the cache holds the pool, no more")
        self.cache = ExpertCache(preset.cache_bytes(self.pool_bytes), checkpoint.slot_nbytes, g.n_layers,
                                 preset.policy, min_slots=(g.n_hash_layers + 1) * g.top_k, n_experts=g.n_experts)
        self.reader = Reader(checkpoint, io_threads)
        self.prefix_cache: PrefixCache | None = None   # use_prefix_cache makes it
        self._prefix_lock = threading.Lock()
        self.streamer = Streamer(checkpoint, self.pinned, self.routers, self.globals, self.cache, self.reader,
                                 prefetch=bool(preset.prefetch), attention=self.attention)
        self.mtp = None              # the MTP layer, loaded when a run first drafts (mtp_layer)
        self.spec_learned = None     # the last speculating run's SpecController: where the next auto run starts
        # what never changes once loaded, counted once (figures() is asked for at every snapshot): the
        # globals, the resident attention and hyper-connection weights (none for a MoE-only model)
        self._fixed_nbytes = self.globals.nbytes + sum(la.nbytes for la in self.attention)
        self._mtp_nbytes = 0

    def mtp_layer(self):
        """The checkpoint's MTP layer (model.mtp.MtpLayer), loaded on first use and kept; a
        Ds4fError saying why when there is none to draft with."""
        if self.mtp is None:
            from ds4f.engine.runtime.mtp_source import MtpLayer, MtpSource, round_slots
            from ds4f.engine.resident import load_mtp
            ck, g = self.ckpt, self.geometry
            if not ck.mtp_layers:
                raise Ds4fError(ck.mtp_problem or f"{ck.path}: no MTP layer (mtp.0.*) to draft with",
                                param="spec")
            with self.compute_lock:
                weights = load_mtp(ck, g)
                # one row at a time through the block; slots for a round's drafts' experts
                self.mtp = MtpLayer(MtpSource(ck, weights, self.globals, slots=round_slots(g.top_k)), 1)
                m = self.mtp
                self._mtp_nbytes = m.source.weights.nbytes + m.source.nbytes + m.buffers.nbytes
        return self.mtp

    @property
    def mtp_nbytes(self) -> int:
        """The MTP layer's weights, its expert slots and buffers, once loaded (0 before)."""
        return self._mtp_nbytes

    # -- figures --------------------------------------------------------------------------------
    def figures(self, session_nbytes: int = 0, session=None) -> EngineFigures:
        """The cache, reader and memory figures a snapshot or report needs (a cheap copy).
        session_nbytes: the buffers of the session computing on the engine (`session`), counted as
        resident; with a batch, the other sessions stepping in it and the step's buffers too."""
        if self.batcher is not None:
            session_nbytes += self.batcher.nbytes_beside(session)
        ck, cache = self.ckpt, self.cache
        reads, _nbytes, latency = self.reader.expert_stats.totals()
        checks, _checked, check_s = self.reader.check_stats.totals()
        routers = sum(r.nbytes for layer, r in self.routers.items() if layer not in self.pinned)
        resident = (sum(ck.trunk_layer_nbytes(layer) for layer in self.pinned) + self._fixed_nbytes + self._mtp_nbytes
                    + cache.capacity_bytes + self.streamer.buffer_nbytes + routers + session_nbytes
                    + self.reader.trace_nbytes + BOOKKEEPING_BYTES
                    + (self.prefix_cache.ram_bytes + self.prefix_cache.index_nbytes if self.prefix_cache is not None else 0))
        return EngineFigures(
            layer_hits=tuple(c.hits for c in cache.layers), layer_misses=tuple(c.misses for c in cache.layers),
            layer_evictions=tuple(c.evictions for c in cache.layers), cache_used_bytes=cache.used_bytes,
            cache_capacity_bytes=cache.capacity_bytes, cache_budget_bytes=cache.budget_bytes, slots=cache.n_slots,
            slot_nbytes=cache.slot_nbytes, expert_reads=reads, read_latency_s=latency,
            checks=checks, check_s=check_s,
            prefetch=dict(self.streamer.prefetch_counts) if self.streamer.prefetch else {},
            pinned_layers=tuple(sorted(self.pinned)), resident_bytes=resident)

    # -- settings that change at token boundaries ------------------------------------------------
    def set_kernels(self, backend: str, threads: int) -> None:
        """Backend ("auto" = the best here) and thread count, in force from the next kernel call."""
        with self.compute_lock:
            try:
                resolved = kernels.best_backend() if backend == "auto" else backend
                settings = KernelSettings(resolved, threads)
                settings.apply()
            except ValueError as exc:
                raise Ds4fError(str(exc)) from None
            self.kernels = settings

    @staticmethod
    def kernel_settings(backend: str, threads: int) -> KernelSettings:
        """The settings a session of a batch computes with (engine.batch applies them to its
        steps): the backend resolved ("auto" = the best here) and checked to run here."""
        resolved = kernels.best_backend() if backend == "auto" else backend
        if resolved not in kernels.available_backends():
            raise Ds4fError(f"backend: {resolved!r} is not supported on this machine (available: "
                            f"{', '.join(kernels.available_backends())})", param="backend")
        return KernelSettings(resolved, threads)

    def use_kernels(self, settings: KernelSettings) -> None:
        """`settings` in force for the next kernel calls (the compute lock held: between steps)."""
        if settings != self.kernels:
            try:
                settings.apply()
            except ValueError as exc:
                raise Ds4fError(str(exc)) from None
            self.kernels = settings

    @property
    def backend(self) -> str:
        return self.kernels.backend

    @property
    def kernel_threads(self) -> int:
        return self.kernels.threads

    def set_io_threads(self, threads: int) -> None:
        with self.compute_lock:
            self.reader.resize(threads)

    @property
    def io_threads(self) -> int:
        return self.reader.threads

    # -- sessions ---------------------------------------------------------------------------------
    def use_prefix_cache(self, ram_bytes: int, disk_dir: str | None, disk_bytes: int, log=None, block: int = 0,
                         write_budget: int = 0) -> PrefixCache:
        """The engine's prefix cache, made on first use with these bounds (kept as long as the
        engine: the states of one run serve the next); its RAM bound counts as resident. block:
        positions a block of kept rows spans (engine.kv_blocks; 0: the default)."""
        g = self.geometry
        span = block_tokens(g.to_config().get("compress_ratios", ())[:g.n_layers], block or BLOCK_TARGET)
        asked = (ram_bytes, str(disk_dir), disk_bytes, span, write_budget)
        with self._prefix_lock:      # the first runs of a batch ask at once: one cache for all of them
            if "fingerprint" not in self.__dict__:     # the first ask: a long first hash is said in its log
                self.__dict__["fingerprint"] = checkpoint_fingerprint(self.ckpt.path, log=log)
            pc = self.prefix_cache
            if pc is None or (pc.ram_bytes, str(pc.dir_asked), pc.disk_bytes, pc.span, pc.stats.write_budget) != asked:
                self.prefix_cache = PrefixCache(self.fingerprint, g.to_config(), ram_bytes, disk_dir, disk_bytes, log,
                                                span=span, write_budget=write_budget)
            elif log is not None:
                pc.log = log
            return self.prefix_cache

    @functools.cached_property
    def fingerprint(self) -> str:
        """The checkpoint's fingerprint (engine.checkpoint.fingerprint): what a session state names."""
        return checkpoint_fingerprint(self.ckpt.path)

    def fork(self, state: SessionState, prefill_chunk: int = 0, records: str = "full") -> Session:
        """A new session continuing from `state` (a snapshot of this engine's sessions, or one
        loaded from a file), on the expert cache as it is; the state itself is not changed, so
        several forks of one state go their own ways."""
        self.kernels.apply()
        session = Session(self, prefill_chunk, records)
        session.restore(state)
        return session

    def new_session(self, prefill_chunk: int = 0, cold: bool = True, records: str = "full") -> Session:
        """A session starting at position 0 with this engine's kernel settings and zeroed counters,
        on an emptied expert cache (cold) or on the experts the cache holds (warm);
        prefill_chunk: prompt tokens per layer-major chunk (0: token by token only); records: what
        its prompt chunks keep per layer (model.records: full, compact, none). While other
        sessions step in the engine's batch, the cache and the counters are theirs too: the
        session starts on them as they are (see `sharing`)."""
        if self.sharing:          # the batch's cache, counters and kernels: nothing to wait for
            return Session(self, prefill_chunk, records)
        with self.compute_lock:
            if not self.sharing:
                self.streamer.reset(cold)
                self.kernels.apply()
        return Session(self, prefill_chunk, records)

    @property
    def sharing(self) -> bool:
        """Sessions step in this engine's batch now."""
        return self.batcher is not None and self.batcher.members > 0

    def use_batcher(self, parallel: int, rows: int) -> StepBatcher:
        """The engine's StepBatcher for `parallel` sequences in steps of `rows` rows, made on first
        use (or when those change while no session is in it)."""
        b = self.batcher
        if b is None or ((b.parallel, b.rows) != (parallel, rows) and b.members == 0):
            if b is not None:
                b.close()
            self.batcher = StepBatcher(self, parallel, rows)
        return self.batcher

    def reset_for_run(self, io_threads: int, kernel_threads: int, backend: str) -> None:
        """The settings of the next run on a loaded engine (new_session says whether the cache is
        emptied); while sessions step in its batch, theirs stay (a run joining takes them)."""
        if self.sharing:          # checked before the lock: a joining run does not wait for a step
            return
        with self.compute_lock:
            if self.sharing:
                return
            self.set_kernels(backend, kernel_threads)
            self.set_io_threads(io_threads)

    @contextmanager
    def read_scratch(self, n: int, session=None):
        """Buffers for reads that are not the model's (a disk replay), lent while no forward pass
        runs (the compute lock held): up to n of the expert cache's slots, taken out of the cache
        (their experts forgotten, so what is read into them is never served as an expert) and
        given back empty, and the streamer's trunk read-ahead buffers (a pass reads its trunk
        layers into them afresh). Yields (expert buffers, trunk buffers); None while sessions
        other than `session` step in the engine's batch (the lock would hold up their steps)."""
        with self.compute_lock:
            own = 1 if session is not None and self.batcher is not None and session.batcher is self.batcher else 0
            if self.batcher is not None and self.batcher.members > own:
                yield None
                return
            slots = self.cache.lend(n)
            try:
                yield [self.cache.pool[s.index] for s in slots], self.streamer.trunk_buffers
            finally:
                self.cache.take_back(slots)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self.reader.close()
        self.cache.close()


def _check_routers(checkpoint, routers: dict[int, "RouterWeights"], g) -> None:
    """What routing reads, refused when no later check would catch it: a NaN or infinity in a
    layer's norm, gate or selection bias (it reroutes tokens silently), a hash table whose expert
    ids are out of range or repeated within a token's row (an IndexError, or one expert twice)."""
    for layer, r in routers.items():
        for name, arr in (("ffn_norm.weight", r.ffn_norm), ("ffn.gate.weight", r.gate), ("ffn.gate.bias", r.bias)):
            if arr is not None:
                check_finite(arr, f"layers.{layer}.{name}", checkpoint.path)
        problems = tid2eid_problems(r.tid2eid, g, f"{checkpoint.path}: layers.{layer}.ffn.gate.tid2eid")
        if problems:
            raise Ds4fError(problems[0], path=checkpoint.path)
