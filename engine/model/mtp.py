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

The block runs on model.forward' forward pass as a one-layer model (runtime.mtp_source.MtpSource
presents it as layer 0 and reads its experts), so each of a step's rows is computed as it would
be alone, the experts that several rows chose read once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds4f.engine.model.attention import LayerCache, push_window_rows
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.hyper import HyperWeights, hc_pre_rows
from ds4f.engine.model.ops import rms_norm
from ds4f.engine.model.forward import ChunkBuffers, Segment, forward_rows
from ds4f.engine.model.weights import Fp8Matrix, GlobalWeights, LayerAttention, MoeWeights, nbytes_of

MAX_DRAFTS = 3          # the most drafts a round chains (--spec K: 0..MAX_DRAFTS)


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
    """One sequence's MTP layer: its KV window (new_layer_cache of the block's shape) and how far
    its rows are exact (rows 0..exact-1 from the main model's own streams; a chained draft's rows
    past them are undone)."""

    cache: LayerCache
    exact: int = 0
    layers: list = field(default_factory=list)     # [cache]: the KVCache shape model.forward takes

    def __post_init__(self) -> None:
        self.layers = [self.cache]


def push_keys(weights: MtpWeights, main: GlobalWeights, g: Geometry, state: MtpState, X: np.ndarray,
              tokens: list[int], pos0: int) -> None:
    """Rows pos0, ... of the state's window from the main model's streams X [n, N, hidden] and
    the tokens after them, their keys alone (what the block's attention would push; their
    drafts are not wanted, so no attention, MoE or head). g: the one-layer geometry."""
    la, att, eps = weights.block, g.attention, g.rms_norm_eps
    X1 = mtp_input(weights, main, X, tokens, eps)
    H, _post, _comb = hc_pre_rows(X1, la.hc_attn, eps, att.hc_eps, att.hc_sinkhorn_iters)
    A = np.empty(H.shape, np.float32)
    h64 = np.empty(H.shape[1], np.float64)
    for c in range(len(H)):
        rms_norm(H[c], la.attn_norm, eps, A[c], h64)
    push_window_rows(la.attention, state.cache, A, pos0, la.shape, la.rope)
    state.exact = pos0 + len(tokens)


def block_rows(source, buffers: ChunkBuffers, state: MtpState, X: np.ndarray, tokens: list[int],
               pos0: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole MTP block for rows pos0, ... on `source` (a one-layer WeightSource: the MTP
    layer as layer 0, its globals the main embedding and head with its own norm and hc_head),
    X [n, N, hidden] the streams the rows come from, tokens the tokens after them: (logits fp32
    [n, vocab], the rows' output streams [n, N, hidden]), views of `buffers`; the state's window
    advanced."""
    X1 = mtp_input(source.weights, source.globals, X, tokens, source.geometry.rms_norm_eps)
    logits = forward_rows(source, [Segment(list(tokens), pos0, state)], buffers, streams=X1)
    return logits, buffers.streams[:len(tokens)]
