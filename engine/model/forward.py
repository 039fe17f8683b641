"""The forward pass of one token, top to bottom.

The whole model (a geometry with attention), transformers' DeepseekV4Model:

    X = embed[token] in each of N streams                       # [N, hidden] fp32
    for each layer l:
        h, post, C = hc_pre(X)                                  # model.hyper
        X = hc_post(X, attention(attn_norm(h), pos), post, C)   # model.attention, with the KV cache
        h, post, C = hc_pre(X)
        X = hc_post(X, moe(h), post, C)                         # the MoE block below, without its residual
    logits = head . (rmsnorm(hc_head(X)) * norm)

The MoE-only model (a geometry without attention: the cache lab's checkpoints):

    h = embed[token]                                            # [hidden] fp32
    for each layer l:
        x = rmsnorm(h) * ffn_norm                               # [hidden]
        scores = sqrt(softplus(W_gate . x))                     # [n_experts]
        ids = tid2eid[token]            if l < num_hash_layers  # [top_k]
              top_k(scores + bias)      otherwise
        w = scores[ids] / sum(scores[ids]) * routed_scaling_factor
        y = sum_e w2_e . (silu(min(w1_e.x, lim)) * clamp(w3_e.x, ±lim) * w_e)  +  shared(x)
        h = h + y
    logits = head . (rmsnorm(h) * norm)                         # [vocab]

Semantics follow HF transformers' `deepseek_v4` (DeepseekV4SparseMoeBlock, its TopK/Hash
routers, DeepseekV4Experts, DeepseekV4MLP as the shared expert), computed in fp32.

The weights come from a `source` (runtime.streamer.Streamer in the engine): this module has no
threads and reads no files. The source decides where weights live and when they arrive; the
arithmetic here does not depend on it: the routed experts may arrive in any order, their outputs
are summed in routing-rank order, so a token's result does not depend on I/O timing or threads.
"""
from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.engine.model.attention import attention_parts
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.hyper import hc_post_rows, hc_pre_rows
from ds4f.engine.model.ops import rms_norm
from ds4f.engine.model.weights import GlobalWeights, LayerAttention, RouterWeights

SHARED = -1  # the rank an arrival carries when it is the shared expert's weights


class WeightSource(Protocol):
    """Where the forward pass (model.rows) gets its weights (runtime.streamer.Streamer; the MTP
    layer's runtime.mtp_source.MtpSource)."""

    geometry: Geometry
    globals: GlobalWeights

    def router(self, layer: int) -> RouterWeights: ...
    def attention(self, layer: int) -> LayerAttention: ...
    def start_chunk(self, token_ids) -> None: ...
    def chunk_arrivals(self, layer: int, ids: np.ndarray, on_error=None,
                       ahead=None) -> Iterator[list[tuple[int, object]]]: ...
    def finish_chunk_layer(self, layer: int) -> None: ...
    def guess_rows(self, layer: int, H: np.ndarray) -> None: ...


ATTENTION, MOE, HEAD = 0, 1, 2     # ChunkBuffers.times: seconds by part


def layer_label(source, layer: int) -> str:
    """How errors name the source's `layer`: "layer 3", or what the source says (the MTP block,
    a one-layer source, is not the main model's layer 0)."""
    label = getattr(source, "layer_label", None)
    return label(layer) if label is not None else f"layer {layer}"


def expert_label(source, layer: int, expert: int) -> str:
    """How errors name a routed expert: "layer 3: expert 5", or what the source says (with the file)."""
    label = getattr(source, "expert_label", None)
    return label(layer, expert) if label is not None else f"layer {layer}: expert {expert}"


def check_finite(ys: np.ndarray, shared_out: np.ndarray, layer: int, ids: np.ndarray, token_id: int,
                 source=None) -> None:
    """A NaN or Inf in an expert's output poisons everything after it: stop, naming the expert
    (as `source` names it, with its file where the source knows it)."""
    if np.isfinite(ys).all() and np.isfinite(shared_out).all():
        return
    bad = [r for r in range(len(ys)) if not np.isfinite(ys[r]).all()]
    who = expert_label(source, layer, int(ids[bad[0]])) if bad else f"{layer_label(source, layer)}: the shared expert"
    raise Ds4fError(f"{who} gives a non-finite output (NaN or Inf) for token {token_id}:"
                    f" its weights are corrupt (an MXFP4 scale byte of 0xFF is NaN)", kind="data")


def check_logits(logits: np.ndarray, token_id: int) -> np.ndarray:
    if not np.isfinite(logits).all():
        raise Ds4fError(f"the head gives non-finite logits (NaN or Inf) for token {token_id}:"
                        f" the head or final norm weights are corrupt", kind="data")
    return logits


def attention_sublayer(la: LayerAttention, X: np.ndarray, parts: list, g: Geometry, layer: int, token_ids,
                       h64: np.ndarray, beside=None, on_bad=None, name: str | None = None) -> np.ndarray:
    """The attention sublayer with its hyper-connections for a step's n rows: X (their streams,
    [n, N, hidden]) updated in place; parts: (layer cache, pos0, count) of each sequence's run of
    consecutive rows, its cache updated (token after token); returns the attention's outputs Y
    (fp32 [n, hidden]). One token: one part of one row. A row whose output is not finite raises,
    or with on_bad(row, error) is reported there and the others go on."""
    att, eps = g.attention, g.rms_norm_eps
    A = np.empty((len(X), g.hidden), np.float32)       # each row's normed input
    H, post, comb = hc_pre_rows(X, la.hc_attn, eps, att.hc_eps, att.hc_sinkhorn_iters, beside)
    for c in range(len(X)):
        rms_norm(H[c], la.attn_norm, eps, A[c], h64)
    Y = attention_parts(la.attention, parts, A, la.shape, la.rope, beside)
    if not np.isfinite(Y).all():
        positions = [pos0 + i for _, pos0, count in parts for i in range(count)]
        for c in np.flatnonzero(~np.isfinite(Y).all(axis=1)):
            err = Ds4fError(f"{name or f'layer {layer}'}: the attention gives a non-finite output (NaN or Inf) for"
                            f" token"
                            f" {token_ids[c]} at position {positions[c]}: its weights are corrupt", kind="data")
            if on_bad is None:
                raise err
            on_bad(int(c), err)
    hc_post_rows(X, Y, post, comb, beside)
    return Y


