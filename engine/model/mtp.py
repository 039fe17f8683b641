"""The MTP layer: DeepSeek-V4's multi-token-prediction block, the draft of speculative decoding
(ds4f-mtp.md).

For the main model's row j (its last layer's N streams X_j, before the head's hyper-connection)
and the token t_{j+1} that follows it:

    e  = enorm(embed[t_{j+1}])                        # [hidden]
    X' = e_proj(e)[None, :] + h_proj(hnorm(X_j))      # [N, hidden]: hnorm and h_proj per stream
    X' = block(X')                                    # a block as a main layer's: hc_pre / attention
                                                      # (a sliding window, its own KV) / hc_post,
                                                      # hc_pre / MoE (a learned gate with bias) / hc_post
    logits(t_{j+2}) = head(norm(hc_head_mtp(X')))     # the main head; the MTP layer's hc_head and norm

Chained drafts feed X' back as the next X with the draft token. The MTP layer's KV row j comes
from (X_j, t_{j+1}) and is kept at position j: attention depends on positions only through
their differences, so the row's place is that of its token less one throughout.

The block runs on model.rows' forward pass as a one-layer model (MtpSource presents it as
layer 0), so each of a step's rows is computed as it would be alone, the experts that several
rows chose read once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.engine.model.attention import LayerCache, new_layer_cache, push_window_rows
from ds4f.engine.model.forward import SHARED
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.hyper import HyperWeights, hc_pre_rows
from ds4f.engine.model.ops import rms_norm
from ds4f.engine.model.rows import ChunkBuffers, Segment, forward_rows
from ds4f.engine.model.weights import (Fp8Matrix, GlobalWeights, LayerAttention, MoeWeights, RouterWeights,
                                       expert_weights, nbytes_of)


@dataclass
class MtpWeights:
    """The MTP layer's resident weights (all but its routed experts)."""

    block: LayerAttention           # its attention (a window only) and both hyper-connections
    moe: MoeWeights                 # its router (a learned gate with bias) and shared expert
    e_proj: Fp8Matrix               # [hidden, hidden]
    h_proj: Fp8Matrix               # [hidden, hidden]
    enorm: np.ndarray               # fp32 [hidden]
    hnorm: np.ndarray               # fp32 [hidden]
    norm: np.ndarray                # fp32 [hidden]  its final norm before the shared head
    hc_head: HyperWeights           # its reduction of the streams before the head

    @property
    def nbytes(self) -> int:
        return nbytes_of(self)


def mtp_geometry(g: Geometry) -> Geometry:
    """The one-layer geometry the MTP block runs under (its router is never a hash table)."""
    return g.replace(n_layers=1, n_hash_layers=0)


@dataclass
class MtpCosts:
    """What drafting read and spent so far (counters: a step's are differences)."""

    rows: int = 0                   # MTP rows through the whole block (each gives a draft)
    pushed: int = 0                 # rows whose keys alone went into its window (catching up)
    bytes_read: int = 0             # routed experts read for it
    reads: int = 0
    hits: int = 0                   # experts found in its slots
    seconds: float = 0.0            # wall time in the MTP layer


class MtpSource:
    """The MTP block as a one-layer WeightSource (model.forward.WeightSource) for model.rows:
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
            slot = _aligned(self.slot_nbytes)
        else:
            old = next(x for x in self._slots if x not in keep)
            slot = self._slots.pop(old)
        try:
            n = self.checkpoint.read_expert(self.layer, e, slot, check=True)
        except Ds4fError as exc:
            raise Ds4fError(f"the MTP layer's expert {e}: {exc}", kind="data") from None
        self.costs.bytes_read += n
        self.costs.reads += 1
        return slot


def _aligned(nbytes: int) -> np.ndarray:
    from ds4f.engine.checkpoint.base import aligned_buffer
    return aligned_buffer(nbytes)


def mtp_input(w: MtpWeights, main: GlobalWeights, X: np.ndarray, tokens: list[int], eps: float) -> np.ndarray:
    """X' = e_proj(enorm(embed[t]))[None] + h_proj(hnorm(X)) for each row (X fp32 [n, N, hidden],
    tokens: each row's next token): fp32 [n, N, hidden]."""
    n, N, D = X.shape
    h64 = np.empty(D, np.float64)
    E = np.empty((n, D), np.float32)
    for c, t in enumerate(tokens):
        rms_norm(np.asarray(main.embed[t], np.float32), w.enorm, eps, E[c], h64)
    Hn = np.empty((n * N, D), np.float32)
    for i, x in enumerate(X.reshape(n * N, D)):
        rms_norm(x, w.hnorm, eps, Hn[i], h64)
    e = w.e_proj.matmul(E, np.empty((n, D), np.float32))
    h = w.h_proj.matmul(Hn, np.empty((n * N, D), np.float32)).reshape(n, N, D)
    return h + e[:, None, :]


@dataclass
class MtpState:
    """One sequence's MTP layer: its KV window and how far its rows are exact (rows 0..exact-1
    from the main model's own streams; a chained draft's rows past them are undone)."""

    cache: LayerCache
    exact: int = 0
    layers: list = field(default_factory=list)     # [cache]: the KVCache shape model.rows takes

    def __post_init__(self) -> None:
        self.layers = [self.cache]


class MtpLayer:
    """The MTP layer of one engine, shared by its sessions (each has its MtpState)."""

    def __init__(self, source: MtpSource, rows: int) -> None:
        self.source = source
        self.geometry = source.geometry
        self.buffers = ChunkBuffers(self.geometry, rows)

    def new_state(self, context: int) -> MtpState:
        return MtpState(new_layer_cache(self.source.weights.block.shape, context))

    def push(self, state: MtpState, X: np.ndarray, tokens: list[int], pos0: int) -> None:
        """Rows pos0, ... of the state's window from the main model's streams X [n, N, hidden] and
        the tokens after them, their keys alone (their drafts are not wanted)."""
        if not len(tokens):
            return
        t0 = perf_counter()
        g, la = self.geometry, self.source.weights.block
        att, eps = g.attention, g.rms_norm_eps
        X1 = mtp_input(self.source.weights, self.source.globals, X, tokens, eps)
        H, _post, _comb = hc_pre_rows(X1, la.hc_attn, eps, att.hc_eps, att.hc_sinkhorn_iters)
        A = _normed(H, la.attn_norm, eps)
        push_window_rows(la.attention, state.cache, A, pos0, la.shape, la.rope)
        state.exact = pos0 + len(tokens)
        self.source.costs.pushed += len(tokens)
        self.source.costs.seconds += perf_counter() - t0

    def rows(self, state: MtpState, X: np.ndarray, tokens: list[int], pos0: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole block for rows pos0, ... (X [n, N, hidden] the streams they come from, tokens
        the tokens after them): (logits fp32 [n, vocab], the rows' output streams [n, N, hidden]),
        views of the layer's buffers; the state's window advanced."""
        t0 = perf_counter()
        g = self.geometry
        X1 = mtp_input(self.source.weights, self.source.globals, X, tokens, g.rms_norm_eps)
        logits = forward_rows(self.source, [Segment(list(tokens), pos0, state)], self.buffers, streams=X1)
        self.source.costs.rows += len(tokens)
        self.source.costs.seconds += perf_counter() - t0
        return logits, self.buffers.streams[:len(tokens)]


def _normed(H: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm of each row, as the attention sublayer norms its inputs."""
    out = np.empty(H.shape, np.float32)
    h64 = np.empty(H.shape[1], np.float64)
    for c in range(len(H)):
        rms_norm(H[c], weight, eps, out[c], h64)
    return out
