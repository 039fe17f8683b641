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

from time import perf_counter
from typing import Iterator, Protocol

import numpy as np

from ds4f.native import kernels
from ds4f.errors import Ds4fError
from ds4f.engine.model.attention import KVCache, attention_parts
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.hyper import hc_head, hc_post, hc_post_rows, hc_pre, hc_pre_rows
from ds4f.engine.model.moe import MoeBuffers, combine, routed_experts, shared_expert
from ds4f.engine.model.ops import rms_norm
from ds4f.engine.model.router import route, router_scores
from ds4f.engine.model.weights import GlobalWeights, LayerAttention, RouterWeights

SHARED = -1  # the rank an arrival carries when it is the shared expert's weights


class WeightSource(Protocol):
    """Where the forward pass gets its weights (see runtime.streamer.Streamer)."""

    geometry: Geometry
    globals: GlobalWeights

    def start_token(self, token_id: int) -> None: ...
    def router(self, layer: int) -> RouterWeights: ...
    def request_experts(self, layer: int, ids: np.ndarray, h: np.ndarray) -> None: ...
    def arrivals(self, layer: int) -> Iterator[list[tuple[int, object]]]: ...
    def finish_layer(self, layer: int, ids: np.ndarray) -> None: ...
    def attention(self, layer: int) -> LayerAttention: ...
    # a step's rows, layer by layer (model.rows)
    def start_chunk(self, token_ids) -> None: ...
    def chunk_arrivals(self, layer: int, ids: np.ndarray, on_error=None,
                       ahead=None) -> Iterator[list[tuple[int, object]]]: ...
    def finish_chunk_layer(self, layer: int) -> None: ...
    def guess_rows(self, layer: int, H: np.ndarray) -> None: ...


ATTENTION, MOE, HEAD = 0, 1, 2     # ForwardBuffers.times


class ForwardBuffers:
    """The forward pass's working memory and its per-token record, allocated once per session."""

    def __init__(self, g: Geometry) -> None:
        streams = g.attention.hc_mult if g.attention is not None else 1
        self.h = np.empty(g.hidden, np.float32)            # the residual stream (MoE-only model)
        self.streams = np.empty((streams, g.hidden), np.float32)  # the hyper-connection streams X
        self.h64 = np.empty(g.hidden, np.float64)          # rms_norm's float64 sum of squares
        self.x = np.empty(g.hidden, np.float32)            # the normalised input of a sublayer
        self.router_logits = np.empty(g.n_experts, np.float32)
        self.logits = np.empty(g.vocab, np.float32)        # the head's output
        self.moe = MoeBuffers(g.hidden, g.inter, g.shared_inter, g.top_k)
        # the token's record (the state dump's): per layer
        self.ids = np.empty((g.n_layers, g.top_k), np.int32)        # selected experts, rank order
        self.weights = np.empty((g.n_layers, g.top_k), np.float32)  # their routing weights
        self.hidden = np.empty((g.n_layers, streams * g.hidden), np.float32)  # the residual (X) after the layer
        self.attn = np.zeros((g.n_layers, g.hidden if g.attention is not None else 0), np.float32)  # attention output
        # the token's wall time by part (s): attention sublayers (hyper-connection mixing included),
        # MoE sublayers (waiting for expert reads included), the head (hc reduction, norm, vocab matvec)
        self.times = np.zeros(3, np.float64)

    @property
    def nbytes(self) -> int:
        return self.moe.nbytes + sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))


def moe_sublayer(source: WeightSource, layer: int, h: np.ndarray, token_id: int,
                 buf: ForwardBuffers) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's MoE block on the residual h: (ids, weights, y); the caller adds y to h."""
    g = source.geometry
    x, ids, weights = moe_route(source, layer, h, token_id, buf.x, buf.h64, buf.router_logits)
    source.request_experts(layer, ids, h)
    for batch in source.arrivals(layer):        # in the order the weights arrive
        routed = [(rank, w) for rank, w in batch if rank != SHARED]
        if routed:                              # the experts ready together, in one kernel call
            routed_experts(routed, weights, x, g.swiglu_limit, buf.moe)
        for rank, w in batch:
            if rank == SHARED:
                shared_expert(w, x, buf.moe)
    check_finite(buf.moe.ys, buf.moe.shared_out, layer, ids, token_id, source)
    return ids, weights, combine(buf.moe)


def moe_route(source: WeightSource, layer: int, h: np.ndarray, token_id: int, x_buf: np.ndarray,
              h64: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The MoE block's normed input x (in x_buf) and its routing: (x, ids, weights)."""
    g = source.geometry
    router = source.router(layer)
    x = rms_norm(h, router.ffn_norm, g.rms_norm_eps, x_buf, h64)
    ids, weights = route(router_scores(router, x, logits), router, token_id, g)
    return x, ids, weights


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


def forward(source: WeightSource, token_id: int, buf: ForwardBuffers, kv: KVCache | None = None,
            pos: int = 0) -> np.ndarray:
    """The logits (fp32 [vocab]) after `token_id` at position `pos`; buf.ids / weights / hidden hold
    the token's record. kv: the sequence's attention state (the whole model), updated."""
    g = source.geometry
    source.start_token(token_id)
    buf.times[:] = 0.0
    if g.attention is None:
        h = _moe_only_layers(source, token_id, buf)
    else:
        h = _whole_layers(source, token_id, buf, kv, pos)
    t0 = perf_counter()
    logits = head(source, h, token_id, buf.logits, buf.x, buf.h64)
    buf.times[HEAD] += perf_counter() - t0
    return logits


def head(source: WeightSource, h: np.ndarray, token_id: int, out: np.ndarray, x_buf: np.ndarray,
         h64: np.ndarray) -> np.ndarray:
    """The logits (into out, fp32 [vocab]) from the last layer's residual h (after hc_head)."""
    g = source.geometry
    final = rms_norm(h, source.globals.final_norm, g.rms_norm_eps, x_buf, h64)
    return check_logits(kernels.bf16_matvec(source.globals.head, final, out=out), token_id)


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


def _moe_only_layers(source: WeightSource, token_id: int, buf: ForwardBuffers) -> np.ndarray:
    h = buf.h
    np.copyto(h, source.globals.embed[token_id])  # bf16 -> fp32, exact
    for layer in range(source.geometry.n_layers):
        t0 = perf_counter()
        ids, weights, y = moe_sublayer(source, layer, h, token_id, buf)
        h += y
        buf.times[MOE] += perf_counter() - t0
        _record(source, layer, ids, weights, h, buf)
    return h


def _whole_layers(source: WeightSource, token_id: int, buf: ForwardBuffers, kv: KVCache, pos: int) -> np.ndarray:
    g = source.geometry
    att, eps = g.attention, g.rms_norm_eps
    X = buf.streams
    X[:] = source.globals.embed[token_id]          # bf16 -> fp32, exact, in every stream
    times = buf.times
    for layer in range(g.n_layers):
        t0 = perf_counter()
        la = source.attention(layer)
        buf.attn[layer] = attention_sublayer(la, X[None], [(kv.layers[layer], pos, 1)], g, layer, (token_id,),
                                             buf.h64)[0]
        t1 = perf_counter()
        h, post, comb = hc_pre(X, la.hc_ffn, eps, att.hc_eps, att.hc_sinkhorn_iters)
        ids, weights, y = moe_sublayer(source, layer, h, token_id, buf)
        hc_post(X, y, post, comb)
        t2 = perf_counter()
        times[ATTENTION] += t1 - t0
        times[MOE] += t2 - t1
        _record(source, layer, ids, weights, X.reshape(-1), buf)
    t0 = perf_counter()
    out = hc_head(X, source.globals.hc_head, eps, att.hc_eps)
    times[HEAD] += perf_counter() - t0
    return out


def _record(source: WeightSource, layer: int, ids, weights, state: np.ndarray, buf: ForwardBuffers) -> None:
    source.finish_layer(layer, ids)
    buf.ids[layer] = ids
    buf.weights[layer] = weights
    buf.hidden[layer] = state
