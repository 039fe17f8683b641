"""The forward pass over rows: a step's tokens, layer by layer, whichever sequences they are of.

A row is (sequence, token, position); a step's rows come in segments, each one sequence's tokens
at consecutive positions (a prompt chunk of one session, or one decode token of each of several):

    X[c] = embed[token c] in each stream, for every row c of the step
    for each layer l:
        X = attention sublayer for all c: the projections of every row together, then the
            attention row after row against its own sequence's KV cache (positions in order
            within a sequence), then the output projections together
        h[c], post[c], C[c] = hc_pre(X[c]) for all c at once;  x[c], ids[c], w[c] = route(h[c])
        for each distinct expert e of the step's ids (the union, each read once):
            ys[c, rank] = expert e on x[c], for every (c, rank) that chose e
        X = hc_post(X, sum over ranks of ys + shared(x), post, C) for all c at once
    logits[c] = head(hc_head(X[c])) for every c

Every row's arithmetic is the token-by-token forward's (model.forward) operation for operation:
the same functions on the same inputs, each row of a multi-row product its own single-vector
product's bits, the routed outputs summed in rank order, each sequence's attention run token
after token so its caches advance in order. Only the order in which rows visit the layers
differs, so a row's record and logits are byte-identical to those of its token fed alone,
whatever else is in the step. What changes is the reads: an expert that several rows chose is
read and applied once per layer per step.

A row that fails (a non-finite attention or expert output, an expert whose read failed) fails
its segment; with `isolate` the step goes on for the others (rows never mix), the failed
segment's Segment.error says why, and its rows are not to be used.
"""
from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.native import kernels
from ds4f.engine.model.attention import RMS_BLOCK
from ds4f.engine.model.forward import (ATTENTION, HEAD, MOE, SHARED, WeightSource, attention_sublayer,
                                       check_finite, check_logits, layer_label)
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.hyper import HC_BLOCK, hc_head, hc_post_rows, hc_pre_rows
from ds4f.engine.model.moe import shared_expert, sum_outputs
from ds4f.engine.model.ops import rms_norm
from ds4f.engine.model.router import route, router_scores


class ChunkBuffers:
    """A chunk's working memory and its tokens' records, allocated once per session."""

    def __init__(self, g: Geometry, chunk: int) -> None:
        att = g.attention
        streams = att.hc_mult if att is not None else 1
        self.chunk = chunk
        self.streams = np.empty((chunk, streams, g.hidden), np.float32)  # each token's residual streams X
        self.xs = np.empty((chunk, g.hidden), np.float32)        # each token's normed MoE input
        self.ys = np.empty((chunk, g.top_k, g.hidden), np.float32)  # each token's routed outputs, by rank
        self.shared_out = np.empty((chunk, g.hidden), np.float32)
        self.moe_out = np.empty((chunk, g.hidden), np.float32)    # each token's routed + shared outputs
        self.h64 = np.empty(g.hidden, np.float64)
        self.router_rows = np.empty((chunk, g.n_experts), np.float32)   # each token's router logits
        # the multi-token kernels' inputs, outputs and work space: each weight decoded once per chunk
        pairs = chunk * g.top_k
        self.pair_out = np.empty((pairs, g.hidden), np.float32)       # routed outputs, expert by expert
        self.pair_scratch = kernels.experts_tokens_scratch(pairs, g.hidden, g.inter)
        self.gate = np.empty((chunk, g.shared_inter), np.float32)     # the shared expert's, per token
        self.up = np.empty((chunk, g.shared_inter), np.float32)
        self.act = np.empty((chunk, g.shared_inter), np.float32)
        self.finals = np.empty((chunk, g.hidden), np.float32)         # the head's normed inputs
        self.mm_scratch = kernels.matmul_scratch(chunk, max(g.hidden, g.shared_inter))
        # the tokens' records (the state dump's), as ForwardBuffers keeps one token's
        self.ids = np.empty((chunk, g.n_layers, g.top_k), np.int32)
        self.weights = np.empty((chunk, g.n_layers, g.top_k), np.float32)
        self.hidden = np.empty((chunk, g.n_layers, streams * g.hidden), np.float32)
        self.attn = np.zeros((chunk, g.n_layers, g.hidden if att is not None else 0), np.float32)
        self.logits = np.empty((chunk, g.vocab), np.float32)
        self.times = np.zeros(3, np.float64)       # attention, MoE (reads waited for included), head

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))

    @staticmethod
    def nbytes_for(g: Geometry, chunk: int) -> int:
        """What ChunkBuffers(g, chunk) holds, without allocating it (the memory plan counts it)."""
        att = g.attention
        streams = att.hc_mult if att is not None else 1
        per_token = 4 * (streams * g.hidden + 3 * g.hidden + g.top_k * g.hidden
                         + g.n_layers * (2 * g.top_k + streams * g.hidden + (g.hidden if att else 0)) + g.vocab
                         + g.top_k * g.hidden + 3 * g.shared_inter + g.hidden + g.n_experts)
        fixed = 8 * g.hidden + 3 * 8
        scratch = (kernels.experts_tokens_scratch(chunk * g.top_k, g.hidden, g.inter).nbytes
                   + kernels.matmul_scratch(chunk, max(g.hidden, g.shared_inter)).nbytes)
        return chunk * per_token + fixed + scratch


def transient_nbytes(g: Geometry, chunk: int) -> int:
    """A bound on the numpy temporaries a layer of a `chunk`-token prefill holds at once, beyond
    ChunkBuffers (the memory plan and the session's budget count it). Per token, the attention's:
    the queries before and after their per-head norm and the attention outputs (3 H head_dim),
    the indexer's query (twice), q_lora twice, the compressors' kv and gates, the output groups'
    copies and low-rank products, and five hidden-sized rows (inputs, outputs, hyper-connection
    sums, those of a half chunk before they are joined); fixed, the float64 blocks of rms_rows and
    hc_pre_rows (hc_post_rows' are as large), two halves at once. tests/test_prefill.py holds a traced chunk to it."""
    att = g.attention
    if att is None:
        return 4 * chunk * 4 * g.hidden
    hd, heads = att.head_dim, att.n_heads
    per_token = (3 * heads * hd + 2 * att.index_n_heads * att.index_head_dim + 2 * att.q_lora_rank
                 + 2 * (2 * hd + 2 * att.index_head_dim) + att.o_groups * att.o_lora_rank
                 + heads * hd // att.o_groups + 5 * g.hidden)
    fixed = 2 * (2 * HC_BLOCK * att.hc_mult * g.hidden * 8 + 2 * RMS_BLOCK * max(hd, att.q_lora_rank) * 8)
    return 4 * chunk * per_token + fixed


class Stopped(Exception):
    """A step left part way because `should_stop` said so: its sequences' states are not usable."""


@dataclass
class Segment:
    """One sequence's rows in a step: its tokens at positions pos0, pos0 + 1, ... and its KV cache
    (None: the MoE-only model), which the step advances. error: why its rows failed in this step
    (with isolate: the other segments went on)."""

    token_ids: list[int]
    pos0: int
    kv: object = None
    error: Ds4fError | None = None


def prefill(source: WeightSource, token_ids: list[int], buf: ChunkBuffers, kv, pos0: int,
            should_stop=None, beside=None) -> np.ndarray:
    """A chunk of one sequence's prompt tokens: forward_rows with one segment."""
    return forward_rows(source, [Segment(list(token_ids), pos0, kv)], buf, should_stop, beside)


def forward_rows(source: WeightSource, segments: list[Segment], buf: ChunkBuffers, should_stop=None,
                 beside=None, isolate: bool = False, streams: np.ndarray | None = None) -> np.ndarray:
    """The step's logits (fp32 [rows, vocab], buf.logits' rows, the segments' rows in order);
    buf.ids / weights / hidden / attn hold each row's record. should_stop: asked before each
    layer (a step of the real model takes minutes); True raises Stopped. beside: where the
    attention may run its output projections beside this thread (runtime.helper_thread).
    isolate: a row that fails marks its segment's error and the step goes on (see the module);
    without it the first failure raises. streams: the rows' streams to start from (fp32 [rows,
    N, hidden], the MTP layer's input: model.mtp) instead of their tokens' embeddings."""
    g = source.geometry
    token_ids = [t for s in segments for t in s.token_ids]
    n = len(token_ids)
    if not 0 < n <= buf.chunk:
        raise ValueError(f"a step of {n} rows in buffers for {buf.chunk}")
    att, eps = g.attention, g.rms_norm_eps
    times = buf.times
    times[:] = 0.0
    X = buf.streams[:n]
    if streams is not None:
        X[:] = streams
    else:
        for c, t in enumerate(token_ids):
            X[c] = source.globals.embed[t]         # bf16 -> fp32, exact, in every stream
    owner = np.repeat(np.arange(len(segments)), [len(s.token_ids) for s in segments])   # row -> segment

    def bad(c: int, err: Ds4fError) -> None:
        seg = segments[owner[c]]
        if not isolate:
            raise err
        if seg.error is None:
            seg.error = err

    source.start_chunk(token_ids)
    for layer in range(g.n_layers):
        if should_stop is not None and should_stop():
            raise Stopped(f"stopped before layer {layer}")
        t0 = perf_counter()
        if att is not None:                        # projections together, each cache token after token
            la = source.attention(layer)
            parts = [(s.kv.layers[layer], s.pos0, len(s.token_ids)) for s in segments]
            buf.attn[:n, layer] = attention_sublayer(la, X, parts, g, layer, token_ids, buf.h64, beside,
                                                     lambda c, err: bad(c, err) if _live(segments, owner, c) else None,
                                                     name=layer_label(source, layer))
        t1 = perf_counter()
        if att is not None:
            H, post, comb = hc_pre_rows(X, la.hc_ffn, eps, att.hc_eps, att.hc_sinkhorn_iters, beside)
        H = H if att is not None else X[:, 0]
        Y = _moe(source, layer, H, token_ids, buf, lambda: _check_finite_rows(buf, layer, token_ids, segments,
                                                                             owner, bad, source),
                 bad if isolate else None)
        if att is not None:
            hc_post_rows(X, Y, post, comb, beside)
        else:
            X[:, 0] += Y
        buf.hidden[:n, layer] = X.reshape(n, -1)
        source.finish_chunk_layer(layer)
        t2 = perf_counter()
        times[ATTENTION] += t1 - t0
        times[MOE] += t2 - t1
    t0 = perf_counter()
    for c in range(n):
        h = hc_head(X[c], source.globals.hc_head, eps, att.hc_eps) if att is not None else X[c, 0]
        rms_norm(h, source.globals.final_norm, eps, buf.finals[c], buf.h64)
    logits = kernels.bf16_matmul(source.globals.head, buf.finals[:n], out=buf.logits[:n], scratch=buf.mm_scratch)
    times[HEAD] += perf_counter() - t0
    for c in range(n):
        if _live(segments, owner, c):
            try:
                check_logits(logits[c], token_ids[c])
            except Ds4fError as err:
                bad(c, err)
    return logits


def _moe(source: WeightSource, layer: int, H: np.ndarray, token_ids: list[int], buf: ChunkBuffers, check,
         bad=None) -> np.ndarray:
    """The MoE sublayer of the step's rows (their inputs H [n, hidden]): routed, their experts
    read and run (the next layer's likely experts read while they compute), check() on the
    outputs, summed: each row's output Y [n, hidden] (buf.moe_out), the routing in buf.ids / weights."""
    n = len(token_ids)
    _route_rows(source, layer, H, token_ids, buf)
    _experts(source, layer, buf, n, bad, lambda: source.guess_rows(layer + 1, H))
    check()
    return sum_outputs(buf.ys[:n], buf.shared_out[:n], buf.moe_out[:n])


def moe_rows(source: WeightSource, layer: int, H: np.ndarray, token_ids: list[int],
             buf: ChunkBuffers) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's MoE block alone on the rows' inputs H [n, hidden], as if `token_ids` were at that
    layer: (ids [n, top_k], weights [n, top_k], Y [n, hidden]), views of buf. Tests compare it with
    transformers' block."""
    segments = [Segment(list(token_ids), 0)]
    owner = np.zeros(len(token_ids), np.int64)

    def raise_it(c: int, err: Ds4fError) -> None:
        raise err

    source.start_chunk(token_ids)
    Y = _moe(source, layer, H, token_ids, buf,
             lambda: _check_finite_rows(buf, layer, token_ids, segments, owner, raise_it, source))
    source.finish_chunk_layer(layer)
    n = len(token_ids)
    return buf.ids[:n, layer], buf.weights[:n, layer], Y


def _live(segments: list[Segment], owner: np.ndarray, c: int) -> bool:
    """Row c's segment has not failed (a failed segment's rows are not checked again)."""
    return segments[owner[c]].error is None


def _check_finite_rows(buf: ChunkBuffers, layer: int, token_ids: list[int], segments, owner, bad,
                       source=None) -> None:
    """forward.check_finite for the step's rows: one pass over all outputs, each bad row of a
    live segment reported (the first raises without isolate)."""
    n = len(token_ids)
    if np.isfinite(buf.ys[:n]).all() and np.isfinite(buf.shared_out[:n]).all():
        return
    for c in range(n):
        if _live(segments, owner, c):
            try:
                check_finite(buf.ys[c], buf.shared_out[c], layer, buf.ids[c, layer], token_ids[c], source)
            except Ds4fError as err:
                bad(c, err)


def _route_rows(source: WeightSource, layer: int, H: np.ndarray, token_ids: list[int], buf: ChunkBuffers) -> None:
    """The routing of the step's rows (their MoE inputs H [n, hidden]): buf.xs (each row's normed
    input), ids and weights. The router's logits of all rows in one multi-token call (each row the
    single-vector product's bits), the norms and selections row by row."""
    g = source.geometry
    n = len(token_ids)
    router = source.router(layer)
    xs = buf.xs[:n]
    for c in range(n):
        rms_norm(H[c], router.ffn_norm, g.rms_norm_eps, xs[c], buf.h64)
    scores = router_scores(router, xs, buf.router_rows[:n], buf.mm_scratch)
    for c in range(n):
        buf.ids[c, layer], buf.weights[c, layer] = route(scores[c], router, token_ids[c], g)


def _experts(source: WeightSource, layer: int, buf: ChunkBuffers, n: int, bad=None, ahead=None) -> None:
    """buf.ys and buf.shared_out for the step's n rows at `layer`: the routed experts that land
    together go through one multi-token kernel call, each applied to every row that chose it
    (its weights decoded once); the shared expert to all n rows at once. Each row's outputs are
    bit-identical to the single-vector kernels' (kernels.experts_forward_tokens, *_matmul).
    bad(row, error): where the rows of an expert whose read failed are reported (their outputs
    are NaN); None: such a read raises. ahead: the source's lookahead (chunk_arrivals)."""
    g = source.geometry
    users: dict[int, list[tuple[int, int]]] = {}      # expert -> [(row, rank)] that chose it
    for c in range(n):
        for rank, e in enumerate(buf.ids[c, layer]):
            users.setdefault(int(e), []).append((c, rank))

    def failed(e: int, err: Ds4fError) -> None:
        for c, rank in users[e]:
            buf.ys[c, rank] = np.nan
            bad(c, err)

    xs = buf.xs[:n]
    for batch in source.chunk_arrivals(layer, buf.ids[:n, layer], None if bad is None else failed, ahead):
        routed = [(e, w) for e, w in batch if e != SHARED]
        if routed:
            tokens = [[c for c, _ in users[e]] for e, _ in routed]
            weights = [[buf.weights[c, layer, rank] for c, rank in users[e]] for e, _ in routed]
            pairs = sum(len(t) for t in tokens)
            out = kernels.experts_forward_tokens([w for _, w in routed], tokens, weights, xs, g.swiglu_limit,
                                                 out=buf.pair_out[:pairs], scratch=buf.pair_scratch)
            i = 0
            for e, _ in routed:
                for c, rank in users[e]:
                    buf.ys[c, rank] = out[i]
                    i += 1
        for e, w in batch:
            if e == SHARED:
                shared_expert(w, xs, buf.gate[:n], buf.up[:n], buf.act[:n], buf.shared_out[:n], buf.mm_scratch)
