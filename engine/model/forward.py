"""The forward pass, top to bottom: a step's rows, layer by layer, whichever sequences they are of.

A row is (sequence, token, position); a step's rows come in segments, each one sequence's tokens
at consecutive positions: a decode token (one row), a prompt chunk of one session, or one decode
token of each of several sequences. The whole model (a geometry with attention), transformers'
DeepseekV4Model, in fp32:

    X[c] = embed[token c] in each of N streams, for every row c       # [rows, N, hidden]
    for each layer l:
        h, post, C = hc_pre(X)                                        # model.hyper, all rows at once
        X = hc_post(X, attention(attn_norm(h)), post, C)              # model.attention: the projections
                                                                      # of every row together, then each
                                                                      # row against its own sequence's KV
                                                                      # cache, positions in order
        h, post, C = hc_pre(X)
        x[c] = rmsnorm(h[c]) * ffn_norm                               # the MoE block (model.moe), its
        scores = sqrt(softplus(W_gate . x[c]))                        # residual left to hc_post
        ids[c] = tid2eid[token c]            if l < num_hash_layers   # [top_k]
                 top_k(scores + bias)        otherwise
        w[c] = scores[ids[c]] / sum(scores[ids[c]]) * routed_scaling_factor
        for each distinct expert e of the step's ids (the union, each read once):
            ys[c, rank] = w2_e . (silu(min(w1_e.x[c], lim)) * clamp(w3_e.x[c], ±lim) * w[c, rank])
                          for every (c, rank) that chose e
        X = hc_post(X, sum over ranks of ys + shared(x), post, C)
    logits[c] = head . (rmsnorm(hc_head(X[c])) * norm)               # [rows, vocab]

The MoE-only model (a geometry without attention: the cache lab's checkpoints) has one stream
and no hyper-connections: X[c] = X[c] + moe(X[c]) in each layer, logits from rmsnorm(X[c]).

Semantics follow HF transformers' `deepseek_v4` (DeepseekV4SparseMoeBlock, its TopK/Hash routers,
DeepseekV4Experts, DeepseekV4MLP as the shared expert). A row's arithmetic does not depend on the
other rows of its step: each row of a multi-row product has its single-vector product's bits, the
routed outputs are summed in routing-rank order, each sequence's attention runs token after token
so its caches advance in order. So a row's record and logits are byte-identical whether its token
is fed alone or in a prompt chunk or beside other sequences' rows; what changes is the reads: an
expert that several rows chose is read and applied once per layer per step.

The weights come from a `source` (runtime.streamer.Streamer in the engine): this module has no
threads and reads no files. The source decides where weights live and when they arrive (a step of
one row is streamed as a token: its hash layers' experts at its start, the next layer's guessed
while one computes); the routed experts may arrive in any order, and the result does not depend
on I/O timing or threads.

A row that fails (a non-finite attention or expert output, an expert whose read failed) fails
its segment; with `isolate` the step goes on for the others (rows never mix), the failed
segment's Segment.error says why, and its rows are not to be used.
"""
from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Iterator, Protocol

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.native import kernels
from ds4f.engine.model.attention import attention_parts
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.hyper import HC_BLOCK, hc_head, hc_post_rows, hc_pre_rows
from ds4f.engine.model.moe import shared_expert, sum_outputs
from ds4f.engine.model.records import RECORD_KINDS, TOP_LOGITS, CompactLayers, top_logits
from ds4f.engine.model.ops import rms_norm
from ds4f.engine.model.router import route, router_scores, row_scores
from ds4f.engine.model.weights import GlobalWeights, LayerAttention, RouterWeights

SHARED = -1  # the rank an arrival carries when it is the shared expert's weights


class WeightSource(Protocol):
    """Where the forward pass gets its weights (runtime.streamer.Streamer; the MTP
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


ATTENTION_ROWS = 256   # rows of one sequence the attention sublayer takes at a time
HEAD_ROWS = 64         # rows the head takes at a time into a chunk's logits, without full records


def attention_blocks(parts: list, n: int) -> list[tuple[int, int, list]]:
    """The step's n rows as the attention sublayer takes them: (first row, end, parts). One
    sequence's rows (a prompt chunk) in blocks of ATTENTION_ROWS, in order, each block's part
    starting where the one before left its cache: the bits of a chunk of that size, which are those
    of any chunk (the state dump is the same at every chunk size); the chunk's experts are still
    read once for all its rows. Past a few hundred rows the attention's temporaries (a token's
    queries alone are heads x head_dim fp32, 128 KiB on flash) outgrow the core's caches. Several
    sequences (a batched step, a few rows each) go in one block."""
    if len(parts) != 1 or n <= ATTENTION_ROWS:
        return [(0, n, parts)]
    cache, pos0, _ = parts[0]
    return [(a, min(n, a + ATTENTION_ROWS), [(cache, pos0 + a, min(n, a + ATTENTION_ROWS) - a)])
            for a in range(0, n, ATTENTION_ROWS)]


class ChunkBuffers:
    """A chunk's working memory and its tokens' records, allocated once per session. records (see
    model.records): "full" keeps each layer's state and attention output (hidden, attn), "compact"
    their digests and sketches (compact), "none" neither; every kind keeps the routing (ids,
    weights) and the last layer's state (last_states)."""

    def __init__(self, g: Geometry, chunk: int, records: str = "full") -> None:
        if records not in RECORD_KINDS:
            raise ValueError(f"records: one of {RECORD_KINDS}, got {records!r}")
        att = g.attention
        streams = att.hc_mult if att is not None else 1
        self.chunk = chunk
        self.records = records
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
        # the tokens' records (the state dump's)
        self.ids = np.empty((chunk, g.n_layers, g.top_k), np.int32)
        self.weights = np.empty((chunk, g.n_layers, g.top_k), np.float32)
        full = records == "full"
        self.hidden = np.empty((chunk, g.n_layers, streams * g.hidden), np.float32) if full else None
        self.attn = np.zeros((chunk, g.n_layers, g.hidden if att is not None else 0), np.float32) if full else None
        self.compact = CompactLayers(chunk, g.n_layers, att is not None) if records == "compact" else None
        # without full records: the layer's attention outputs, and the last layer's states
        self.attn_layer = None if full else np.zeros((chunk, g.hidden if att is not None else 0), np.float32)
        self.last = None if full else np.empty((chunk, streams * g.hidden), np.float32)
        # the logits: every row's with full records; else the head's rows a block at a time, each
        # row's greedy pick and (compact) top logits kept, and the last row's whole (head_rows)
        self.logits = np.empty((chunk if full else min(chunk, HEAD_ROWS), g.vocab), np.float32)
        self.picks = None if full else np.empty(chunk, np.int64)
        top = records == "compact"
        self.top_ids = np.empty((chunk, TOP_LOGITS), np.int32) if top else None
        self.top_values = np.empty((chunk, TOP_LOGITS), np.float32) if top else None
        self.last_logits = None if full else np.empty(g.vocab, np.float32)
        self.times = np.zeros(3, np.float64)       # attention, MoE (reads waited for included), head

    @property
    def nbytes(self) -> int:
        arrays = list(vars(self).values()) + (list(vars(self.compact).values()) if self.compact else [])
        return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))

    def attn_out(self, layer: int) -> np.ndarray:
        """Where the rows' attention outputs at `layer` go (fp32 [chunk, hidden])."""
        return self.attn[:, layer] if self.attn is not None else self.attn_layer

    def keep_layer(self, layer: int, X: np.ndarray, n: int, last: bool) -> None:
        """Rows 0..n-1 are done with `layer` (X: their states fp32 [n, width], their attention
        outputs in attn_out(layer)): its records kept; `last`: the model's last layer."""
        if self.hidden is not None:
            self.hidden[:n, layer] = X
            return
        if self.compact is not None:
            attn = self.attn_layer[:n] if self.compact.attn_sketch is not None else None
            self.compact.keep_layer(layer, X, attn, n)
        if last:
            self.last[:n] = X

    def last_states(self, n: int) -> np.ndarray:
        """Rows 0..n-1's states after the last layer (fp32 [n, width])."""
        return self.hidden[:n, -1] if self.hidden is not None else self.last[:n]

    def keep_logits(self, c: int, logits: np.ndarray, last: bool) -> None:
        """Without full records: row c's logits (fp32 [vocab]) as its greedy pick and (compact) its
        top logits; `last`: the step's last row, whose logits are kept whole."""
        self.picks[c] = np.argmax(logits)
        if self.top_ids is not None:
            self.top_ids[c], self.top_values[c] = top_logits(logits)
        if last:
            self.last_logits[:] = logits

    def put_row(self, i: int, ids, weights, hidden, attn, logits, last: bool) -> None:
        """Row i from a full record computed elsewhere (a batched step's): routing, states
        [n_layers, width], attention outputs [n_layers, hidden], logits; kept as this buffer's kind
        (`last`: the rows' last, whose logits a buffer without full records keeps whole)."""
        self.ids[i], self.weights[i] = ids, weights
        if self.hidden is not None:
            self.hidden[i], self.attn[i], self.logits[i] = hidden, attn, logits
            return
        if self.compact is not None:
            self.compact.keep_row(i, hidden, attn)
        self.last[i] = hidden[-1]
        self.keep_logits(i, logits, last)

    def head_rows(self, n: int) -> np.ndarray:
        """The logits of rows 0..n-1 (fp32 [n, vocab]) with full records; else the last row's alone
        ([1, vocab]: the step's row n-1)."""
        return self.logits[:n] if self.picks is None else self.last_logits[None]

    def record_views(self, n: int) -> dict:
        """Rows 0..n-1's records (views): ids, weights, hidden and attn (None unless full), compact
        ((digest, hidden_sketch, attn_sketch) when compact, else None), top ((ids, values) [n,
        TOP_LOGITS] when compact, else None), picks (each row's greedy pick without full records)."""
        return {"ids": self.ids[:n], "weights": self.weights[:n],
                "hidden": None if self.hidden is None else self.hidden[:n],
                "attn": None if self.attn is None else self.attn[:n],
                "compact": None if self.compact is None else self.compact.rows(n),
                "top": None if self.top_ids is None else (self.top_ids[:n], self.top_values[:n]),
                "picks": None if self.picks is None else self.picks[:n]}

    @staticmethod
    def nbytes_for(g: Geometry, chunk: int, records: str = "full") -> int:
        """What ChunkBuffers(g, chunk, records) holds, without allocating it (the memory plan counts it)."""
        att = g.attention
        streams = att.hc_mult if att is not None else 1
        per_token = 4 * (streams * g.hidden + 3 * g.hidden + g.top_k * g.hidden
                         + g.top_k * g.hidden + 3 * g.shared_inter + g.hidden + g.n_experts)
        fixed = 8 * g.hidden + 3 * 8
        scratch = (kernels.experts_tokens_scratch(chunk * g.top_k, g.hidden, g.inter).nbytes
                   + kernels.matmul_scratch(chunk, max(g.hidden, g.shared_inter)).nbytes)
        if records == "full":
            logits = 4 * chunk * g.vocab
        else:        # a block of the head's rows, the last row's, the picks and (compact) the top logits
            logits = 4 * (min(chunk, HEAD_ROWS) + 1) * g.vocab + 8 * chunk \
                + (chunk * TOP_LOGITS * 8 if records == "compact" else 0)
        return chunk * per_token + logits + ChunkBuffers.records_nbytes_for(g, chunk, records) + fixed + scratch

    @staticmethod
    def records_nbytes_for(g: Geometry, chunk: int, records: str = "full") -> int:
        """Of nbytes_for, the tokens' records: routing, and per layer (full) the states and attention
        outputs, 3.4 MiB a token on DeepSeek-V4-Flash, or (compact) their digests and sketches, 1.9
        KiB; without full ones, the last layer's states and a layer's attention outputs."""
        att = g.attention
        streams = att.hc_mult if att is not None else 1
        attn = g.hidden if att else 0
        routing = 4 * chunk * g.n_layers * 2 * g.top_k
        if records == "full":
            return routing + 4 * chunk * g.n_layers * (streams * g.hidden + attn)
        compact = CompactLayers.nbytes_for(chunk, g.n_layers, att is not None) if records == "compact" else 0
        return routing + compact + 4 * chunk * (streams * g.hidden + attn)


def transient_nbytes(g: Geometry, chunk: int) -> int:
    """A bound on the numpy temporaries a layer of a `chunk`-token prefill holds at once, beyond
    ChunkBuffers (the memory plan and the session's budget count it). Per token, the attention's:
    the queries (their per-head norm in place) and the attention outputs (2 H head_dim), the key and its rotated copy in the keys the core reads (2 head_dim),
    the rows' cos and sin (rope_dim), the indexer's choice (index_topk int32) and eight words of
    each row's place in the keys, the indexer's query (twice), q_lora twice, the compressors' kv and
    gates, the whole-row copies of the joined projections' q_lora and head_dim blocks for their norms
    (q_lora + head_dim), the output groups' copies and low-rank products, and five hidden-sized rows (inputs,
    outputs, hyper-connection sums, those of a half chunk before they are joined); fixed, the
    window's rows from before the chunk (window - 1 head_dim), the float64 blocks of hc_pre_rows
    (hc_post_rows' are as large), two halves at once (the norms' float64 sums are the native
    kernel's, per row, on the stack). tests/engine/test_prefill.py holds a traced chunk to it."""
    att = g.attention
    if att is None:
        return 4 * chunk * 4 * g.hidden
    hd, heads = att.head_dim, att.n_heads
    per_token = (2 * heads * hd + 2 * hd + att.rope_dim + att.index_topk + 8
                 + 2 * att.index_n_heads * att.index_head_dim + 2 * att.q_lora_rank + att.q_lora_rank + hd
                 + 2 * (2 * hd + 2 * att.index_head_dim) + att.o_groups * att.o_lora_rank
                 + heads * hd // att.o_groups + 5 * g.hidden)
    fixed = 2 * 2 * HC_BLOCK * att.hc_mult * g.hidden * 8 + 4 * (att.window - 1) * hd
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
    """The step's logits (buf.head_rows: fp32 [rows, vocab], buf.logits' rows, the segments' rows in
    order; without full records the last row's alone, [1, vocab], and each row's pick and top logits
    in buf); buf.ids / weights / hidden / attn (or their compact records) hold each row's record. should_stop: asked before each
    layer (a step of the real model takes minutes); True raises Stopped. beside: where the
    hyper-connections and the attention's output projection may run half their rows beside this
    thread (runtime.helper_thread).
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
            attn_out = buf.attn_out(layer)
            for a, b, block in attention_blocks(parts, n):
                attn_out[a:b] = attention_sublayer(
                    la, X[a:b], block, g, layer, token_ids[a:b], buf.h64, beside,
                    lambda c, err, a=a: bad(a + c, err) if _live(segments, owner, a + c) else None,
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
        buf.keep_layer(layer, X.reshape(n, -1), n, layer == g.n_layers - 1)
        source.finish_chunk_layer(layer)
        t2 = perf_counter()
        times[ATTENTION] += t1 - t0
        times[MOE] += t2 - t1
    t0 = perf_counter()
    for c in range(n):
        h = hc_head(X[c], source.globals.hc_head, eps, att.hc_eps) if att is not None else X[c, 0]
        rms_norm(h, source.globals.final_norm, eps, buf.finals[c], buf.h64)
    rows = n if buf.picks is None else len(buf.logits)    # the head's rows at a time: all, or a block's
    for a in range(0, n, rows):
        b = min(n, a + rows)
        logits = kernels.matmul(source.globals.head_native, buf.finals[a:b], buf.logits[:b - a], buf.mm_scratch)
        for c in range(a, b):
            if _live(segments, owner, c):
                try:
                    check_logits(logits[c - a], token_ids[c])
                except Ds4fError as err:
                    bad(c, err)
            if buf.picks is not None:
                buf.keep_logits(c, logits[c - a], last=c == n - 1)
    times[HEAD] += perf_counter() - t0
    return buf.head_rows(n)


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
    router = source.router(layer)
    scores = row_scores(router, H[:len(token_ids)], g.rms_norm_eps, buf.xs, buf.router_rows, buf.mm_scratch, buf.h64)
    for c in range(len(token_ids)):
        buf.ids[c, layer], buf.weights[c, layer] = route(scores[c], router, token_ids[c], g)


def _experts(source: WeightSource, layer: int, buf: ChunkBuffers, n: int, bad=None, ahead=None) -> None:
    """buf.ys and buf.shared_out for the step's n rows at `layer`: the routed experts that land
    together go through one multi-token kernel call, each applied to every row that chose it
    (its weights decoded once); the shared expert to all n rows at once. Each row's outputs are
    bit-identical to the single-vector kernels' (kernels.experts_forward_tokens, *_matmul).
    bad(row, error): where the rows of an expert whose read failed are reported (their outputs
    are NaN); None: such a read raises. ahead: the source's lookahead (chunk_arrivals)."""
    g = source.geometry
    ids = buf.ids[:n, layer]                           # [n, top_k]: pair p = (row p // top_k, rank p % top_k)
    flat = ids.ravel()
    ys = buf.ys[:n].reshape(n * g.top_k, g.hidden)    # the pairs' outputs, a view

    def failed(e: int, err: Ds4fError) -> None:
        for p in np.flatnonzero(flat == e):
            ys[p] = np.nan
            bad(int(p) // g.top_k, err)

    xs = buf.xs[:n]
    for batch in source.chunk_arrivals(layer, ids, None if bad is None else failed, ahead):
        routed = [(e, w) for e, w in batch if e != SHARED]
        if routed:
            # the pairs of the batch's experts, expert by expert, each expert's by row then rank
            match = flat[None, :] == np.array([e for e, _ in routed])[:, None]
            which = np.nonzero(match)[1]
            out = kernels.experts_forward_pairs([w for _, w in routed], match.sum(axis=1).tolist(),
                                                which // g.top_k, buf.weights[:n, layer].ravel()[which], xs,
                                                g.swiglu_limit, out=buf.pair_out[:len(which)],
                                                scratch=buf.pair_scratch)
            ys[which] = out
        for e, w in batch:
            if e == SHARED:
                shared_expert(w, xs, buf.gate[:n], buf.up[:n], buf.act[:n], buf.shared_out[:n], buf.mm_scratch)
