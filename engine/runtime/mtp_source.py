"""The MTP layer at run time: its routed experts read from the checkpoint (as layer n_layers)
into a few slots of its own, its rows timed and counted (model.mtp has the math)."""
from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.engine.checkpoint.base import aligned_buffer
from ds4f.engine.model.attention import new_layer_cache
from ds4f.engine.model.forward import SHARED
from ds4f.engine.model.mtp import MAX_DRAFTS, MtpState, MtpWeights, block_rows, mtp_geometry, push_keys
from ds4f.engine.model.forward import ChunkBuffers
from ds4f.engine.model.weights import GlobalWeights, LayerAttention, RouterWeights, expert_weights


@dataclass
class MtpCosts:
    """What drafting read and spent so far (counters: a step's are differences)."""

    rows: int = 0                   # MTP rows through the whole block (each gives a draft)
    pushed: int = 0                 # rows whose keys alone went into its window (catching up)
    bytes_read: int = 0             # routed experts read for it
    reads: int = 0
    hits: int = 0                   # experts found in its slots
    seconds: float = 0.0            # wall time in the MTP layer
    push_seconds: float = 0.0       # of it, pushing rows' keys (catching up)


def round_slots(top_k: int) -> int:
    """The expert slots an MTP layer keeps: a round's drafts' experts ((MAX_DRAFTS + 1) x top-k)."""
    return (MAX_DRAFTS + 1) * top_k


class MtpSource:
    """The MTP block as a one-layer WeightSource (model.forward.WeightSource) for model.forward:
    layer 0 is the MTP layer; its routed experts are read from the checkpoint as layer n_layers
    into a few slots of its own (least recently used first out), checked where the form has
    checksums."""

    def __init__(self, checkpoint, weights: MtpWeights, main: GlobalWeights, slots: int) -> None:
        g = checkpoint.geometry
        self.checkpoint = checkpoint
        self.geometry = mtp_geometry(g)
        self.layer = g.n_layers                       # the checkpoint's index of the MTP layer
        self.weights = weights
        self.globals = GlobalWeights(main.embed, weights.norm, main.head, weights.hc_head)
        self.layout = checkpoint.expert_layout
        self.slot_nbytes = checkpoint.slot_nbytes
        self.capacity = max(1, slots)
        self._slots: dict[int, np.ndarray] = {}       # expert -> its slot, oldest use first
        self._free: list[np.ndarray] = []
        self.costs = MtpCosts()

    @property
    def nbytes(self) -> int:
        return self.capacity * self.slot_nbytes

    # -- how errors name the MTP layer (not the main model's layer 0, nor its record index n_layers)
    def layer_label(self, layer: int) -> str:
        return "the MTP layer"

    def expert_label(self, layer: int, expert: int) -> str:
        """"the MTP layer's expert 3 (record 67 of /m/pool-mxfp4.bin)", or the release's shards."""
        ck = self.checkpoint
        pool = getattr(ck, "pool_path", None)
        if pool is not None:
            where = f"record {self.layer * ck.geometry.n_experts + expert} of {pool}"
        else:
            try:
                files = dict.fromkeys(f for f, _off, _n in ck.expert_extents(self.layer, expert))
                where = f"mtp.0.ffn.experts.{expert}.* in {', '.join(files)}"
            except (Ds4fError, AttributeError, IndexError, KeyError):
                where = f"in {ck.path}"
        return f"the MTP layer's expert {expert} ({where})"

    # -- WeightSource
    def router(self, layer: int) -> RouterWeights:
        return self.weights.moe.router

    def attention(self, layer: int) -> LayerAttention:
        return self.weights.block

    def start_chunk(self, token_ids) -> None:
        pass

    def guess_rows(self, layer: int, H) -> None:
        pass

    def finish_chunk_layer(self, layer: int) -> None:
        pass

    def chunk_arrivals(self, layer: int, ids: np.ndarray, on_error=None, ahead=None):
        """Each distinct expert of the rows' routing once, then the shared expert."""
        want = list(dict.fromkeys(int(e) for e in np.asarray(ids).reshape(-1)))
        if len(want) > self.capacity:
            raise Ds4fError(f"the MTP layer's rows chose {len(want)} experts; its slots hold {self.capacity}",
                            kind="internal")
        batch = []
        for e in want:
            slot = self._slots.pop(e, None)
            if slot is None:
                slot = self._read(e, set(want))
            else:
                self.costs.hits += 1
            self._slots[e] = slot                     # now the most recent
            batch.append((e, expert_weights(slot, self.layout)))
        yield batch
        yield [(SHARED, self.weights.moe.shared)]

    def _read(self, e: int, keep: set) -> np.ndarray:
        if len(self._slots) < self.capacity:
            slot = aligned_buffer(self.slot_nbytes)
        else:
            old = next(x for x in self._slots if x not in keep)
            slot = self._slots.pop(old)
        try:
            n = self.checkpoint.read_expert(self.layer, e, slot, check=True)
        except Ds4fError as exc:        # the checkpoint's message names the file and the MTP layer
            raise Ds4fError(exc.message if "MTP layer" in exc.message else f"the MTP layer's expert {e}: {exc}",
                            path=exc.path, kind="data") from None
        self.costs.bytes_read += n
        self.costs.reads += 1
        return slot


class MtpLayer:
    """The MTP layer of one engine, shared by its sessions (each has its MtpState)."""

    def __init__(self, source: MtpSource, rows: int) -> None:
        self.source = source
        self.geometry = source.geometry
        self.buffers = ChunkBuffers(self.geometry, rows)

    def new_state(self, context: int) -> MtpState:
        return MtpState(new_layer_cache(self.source.weights.block.shape, context))

    def push(self, state: MtpState, X: np.ndarray, tokens: list[int], pos0: int) -> None:
        """model.mtp.push_keys, timed: rows whose keys alone the window needs."""
        if not len(tokens):
            return
        t0 = perf_counter()
        push_keys(self.source.weights, self.source.globals, self.geometry, state, X, tokens, pos0)
        dt = perf_counter() - t0
        self.source.costs.pushed += len(tokens)
        self.source.costs.seconds += dt
        self.source.costs.push_seconds += dt

    def rows(self, state: MtpState, X: np.ndarray, tokens: list[int], pos0: int) -> tuple[np.ndarray, np.ndarray]:
        """model.mtp.block_rows on this layer's source and buffers, timed and counted."""
        t0 = perf_counter()
        out = block_rows(self.source, self.buffers, state, X, tokens, pos0)
        self.source.costs.rows += len(tokens)
        self.source.costs.seconds += perf_counter() - t0
        return out
