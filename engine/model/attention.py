"""Attention for one query token, with the compressors, the Lightning indexer and the KV cache
(transformers' DeepseekV4Attention, its HCA / CSA compressors and DeepseekV4Indexer, in fp32).

One shared K = V head of head_dim; H query heads. For a token at position pos, a = the
sublayer's normed input [hidden]:

    qr = q_norm(wq_a . a)                         [q_lora]
    q  = rms(wq_b . qr viewed [H, head_dim])      per-head norm, no weight; RoPE at pos
    kv = kv_norm(wkv . a)                         [head_dim]; RoPE at pos; pushed to the window
    compressors step (CSA / HCA layers), then
    keys = the window's rows (the last `window` positions, pos included)
           + the compressed rows: all of them (HCA) or the indexer's top index_topk (CSA)
    o[h] = sum_j p_j keys_j,  p = softmax(q[h] . keys / sqrt(head_dim)) with the sink attn_sink[h]
           in the denominator only; inverse RoPE at pos
    y  = wo_b . concat_g(wo_a[g] . o viewed [o_groups, H head_dim / o_groups][g])

A compressor (ratio m, width = 2 dim with overlap (CSA, the indexer's), else dim (HCA)) buffers
kv = wkv . a and gate = wgate . a + ape[pos % m] per token; when a window of m closes, each dim
is a softmax-weighted sum over the window's tokens (with overlap: over 2m candidates, the
previous window's first halves and this window's second halves; window 0 has no previous one),
then its norm, then RoPE at the window's first position. A row emitted at pos is visible at pos.

The indexer scores compressed row t as sum_h (w_h / sqrt(ih)) relu(iq_h . k_t) / sqrt(id), with
w = weights_proj . a and iq = wq_b . qr viewed [ih, id] (RoPE at pos), and keeps the top
index_topk; equal scores keep the LOWER row index first (a documented rule: torch's topk has none).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from ds4f.native import kernels
from ds4f.engine.model.ops import in_halves
from ds4f.engine.model.rope import Rope, inv_freq_default, inv_freq_yarn


class Matrix(Protocol):
    """A linear's weight [rows, k] that can multiply an fp32 vector (Fp8Matrix, Bf16Matrix, ...)."""

    shape: tuple[int, int]

    def matvec(self, x: np.ndarray, out: np.ndarray) -> np.ndarray: ...
    def matmul(self, x: np.ndarray, out: np.ndarray) -> np.ndarray: ...   # row t: matvec(x[t]), bit for bit


@dataclass
class CompressorWeights:
    wkv: Matrix                     # [width, hidden]   width = 2 dim (overlap) or dim
    wgate: Matrix                   # [width, hidden]
    ape: np.ndarray                 # fp32 [ratio, width]   position bias of the gate
    norm: np.ndarray                # fp32 [dim]            RMSNorm weight of a compressed row


@dataclass
class IndexerWeights:
    wq_b: Matrix                    # [ih id, q_lora]   the indexer's query from qr
    weights_proj: Matrix            # [ih, hidden]      per-head weights from a
    compressor: CompressorWeights   # width 2 id, dim id


@dataclass
class AttentionWeights:
    wq_a: Matrix                    # [q_lora, hidden]
    q_norm: np.ndarray              # fp32 [q_lora]
    wq_b: Matrix                    # [H head_dim, q_lora]
    wkv: Matrix                     # [head_dim, hidden]
    kv_norm: np.ndarray             # fp32 [head_dim]
    wo_a: list[Matrix]              # o_groups x [o_lora, H head_dim / o_groups]
    wo_b: Matrix                    # [hidden, o_groups o_lora]
    sinks: np.ndarray               # fp32 [H]
    compressor: CompressorWeights | None = None   # CSA and HCA layers
    indexer: IndexerWeights | None = None         # CSA layers

    @cached_property
    def input_group(self) -> kernels.MatmulGroup | None:
        """The projections of the normed input in one native call (input_projections, side_by_side)."""
        return side_by_side(input_projections(self))

    @cached_property
    def output_group(self) -> kernels.MatmulGroup | None:
        """wo_a's groups in one native call (grouped)."""
        return grouped(self.wo_a)


@dataclass(frozen=True)
class AttentionShape:
    """What one layer's attention needs to know besides its weights."""

    kind: str                       # "swa" | "csa" | "hca"
    ratio: int                      # compression ratio (0 for swa)
    heads: int
    head_dim: int
    window: int                     # sliding window, the current token included
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    eps: float = 1e-6


class CompressorState:
    """A compressor's carried state: the open window's buffered tokens, the previous window's
    first halves (overlap), and every compressed row so far (capacity fixed up front)."""

    def __init__(self, ratio: int, width: int, dim: int, overlap: bool, capacity: int) -> None:
        self.ratio, self.width, self.dim, self.overlap = ratio, width, dim, overlap
        self.kv = np.zeros((ratio, width), np.float32)       # the open window's kv, by slot
        self.gate = np.zeros((ratio, width), np.float32)     # and its gate (ape added)
        self.prev_kv = np.zeros((ratio, dim), np.float32)    # the previous window's first halves
        self.prev_gate = np.full((ratio, dim), -np.inf, np.float32)
        self.rows = np.zeros((capacity, dim), np.float32)    # compressed rows, RoPE applied
        self.n_rows = 0

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.gate.nbytes + self.prev_kv.nbytes + self.prev_gate.nbytes + self.rows.nbytes

    def reset(self) -> None:
        self.prev_kv[:] = 0
        self.prev_gate[:] = -np.inf
        self.n_rows = 0


@dataclass
class LayerCache:
    """One layer's KV cache: the window ring and the compressors' states."""

    window: np.ndarray                              # fp32 [window, head_dim], row pos % window
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    tokens: int = 0                                 # positions pushed so far

    @property
    def nbytes(self) -> int:
        return self.window.nbytes + sum(s.nbytes for s in (self.compressor, self.indexer) if s is not None)

    def reset(self) -> None:
        self.tokens = 0
        for s in (self.compressor, self.indexer):
            if s is not None:
                s.reset()


def new_layer_cache(shape: AttentionShape, context: int) -> LayerCache:
    """The cache of one layer for up to `context` positions, allocated now."""
    window = np.zeros((shape.window, shape.head_dim), np.float32)
    if shape.kind == "swa":
        return LayerCache(window)
    rows = context // shape.ratio
    overlap = shape.kind == "csa"
    width = 2 * shape.head_dim if overlap else shape.head_dim
    comp = CompressorState(shape.ratio, width, shape.head_dim, overlap, rows)
    index = CompressorState(shape.ratio, 2 * shape.index_dim, shape.index_dim, True, rows) if overlap else None
    return LayerCache(window, comp, index)


def layer_cache_nbytes(shape: AttentionShape, context: int) -> int:
    """Bytes new_layer_cache(shape, context) holds (the plan counts them before allocating)."""
    n = shape.window * shape.head_dim * 4
    if shape.kind == "swa":
        return n
    rows = context // shape.ratio
    width = 2 * shape.head_dim if shape.kind == "csa" else shape.head_dim

    def comp(r, w, d):
        return 4 * (2 * r * w + 2 * r * d + rows * d)

    n += comp(shape.ratio, width, shape.head_dim)
    if shape.kind == "csa":
        n += comp(shape.ratio, 2 * shape.index_dim, shape.index_dim)
    return n


# ---- the steps --------------------------------------------------------------------------------


def rms_rows(x: np.ndarray, eps: float, weight: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Each row of x [n, d] over sqrt(mean(row^2) + eps) in float64, rounded once; fp32. With weight
    [d] (fp32), that times the weight in fp32: the bits of rms_rows(x, eps) * weight. Rows are
    independent (each one's mean is its own reduction): kernels.rms_rows, numpy's bits for the
    float64 expression, spreads them over the kernels' threads itself. x may be a view of columns
    (a block of products(): copied to whole rows first). out: where the result goes (None: a new
    array; it may be x itself, a row being read whole before it is written)."""
    return kernels.rms_rows(x if x.flags.c_contiguous else np.ascontiguousarray(x), eps, weight, out)


def weighted_rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm with its weight, normalised in float64 and rounded once before the weight (as
    transformers' RMSNorm multiplies the weight last). ops.rms_norm rounds x * inv in fp32 first,
    which the attention's norms feel: 4.3e-5 instead of 2.6e-5 on the scalar `ratios` fixture."""
    return kernels.rms_rows(x[None, :], eps, weight)[0]


def compressor_step(w: CompressorWeights, s: CompressorState, kv: np.ndarray, gate: np.ndarray, pos: int,
                    rope: Rope, eps: float) -> bool:
    """Buffer this token's kv = wkv . a and gate = wgate . a (projected beforehand, see project);
    on a closing window append a compressed row. True if a row was appended."""
    slot = pos % s.ratio
    s.kv[slot] = kv
    s.gate[slot] = gate
    s.gate[slot] += w.ape[slot]
    if slot != s.ratio - 1:
        return False
    if s.overlap:
        d = s.dim
        cand_kv = np.concatenate([s.prev_kv, s.kv[:, d:]])          # [2 ratio, dim]
        cand_gate = np.concatenate([s.prev_gate, s.gate[:, d:]])
        s.prev_kv[:] = s.kv[:, :d]
        s.prev_gate[:] = s.gate[:, :d]
    else:
        cand_kv, cand_gate = s.kv, s.gate
    g = cand_gate.astype(np.float64)
    e = np.exp(g - g.max(axis=0, keepdims=True))
    row = ((e / e.sum(axis=0, keepdims=True)) * cand_kv.astype(np.float64)).sum(axis=0).astype(np.float32)
    row = weighted_rms(row, w.norm, eps)
    if s.n_rows >= len(s.rows):
        raise IndexError("compressed rows beyond the cache's context")  # the session checks first
    s.rows[s.n_rows] = rope.apply(row, pos + 1 - s.ratio)
    s.n_rows += 1
    return True


def indexer_select(rows: np.ndarray, iq: np.ndarray, hw: np.ndarray, pos: int, rope: Rope,
                   shape: AttentionShape) -> np.ndarray:
    """Indices (ascending) of the compressed rows the query attends to: the top index_topk by
    score, equal scores to the lower index. iq = wq_b . qr, hw = weights_proj . a (see project)."""
    T = len(rows)
    k = min(shape.index_topk, T)
    if k == T:
        return np.arange(T)
    iq = rope.apply(iq.reshape(shape.index_heads, shape.index_dim).copy(), pos)
    scores = np.maximum(iq.astype(np.float64) @ rows.astype(np.float64).T, 0.0) * shape.index_dim ** -0.5
    score = ((hw.astype(np.float64) * shape.index_heads ** -0.5)[:, None] * scores).sum(axis=0)   # [T]
    order = np.argsort(-score, kind="stable")      # stable: equal scores keep the lower index first
    return np.sort(order[:k])


@dataclass
class Projected:
    """The projections of n rows' normed inputs A [n, hidden] (row t: one token), everything the
    attention computes before it needs the cache: they depend on each row's own input only, so a
    step's rows are projected together (each weight decoded once), whichever sequences they are of."""

    q: np.ndarray                   # [n, H, head_dim]  after the per-head norm (RoPE not yet)
    kv: np.ndarray                  # [n, head_dim]     after kv_norm (RoPE not yet)
    comp: tuple | None = None       # the compressor's (kv [n, width], gate [n, width]), ape not yet
    index: tuple | None = None      # the indexer's compressor (kv, gate)
    # the indexer's query (iq [selecting, ih id], hw [selecting, ih]) for the rows expected to
    # select (qrow[t] >= 0: row t's place in it): a token with at most index_topk compressed rows
    # behind it attends to all of them and needs no query (see first_selecting)
    query: tuple | None = None
    qrow: np.ndarray | None = None
    qr: np.ndarray | None = None    # [n, q_lora] and the inputs A [n, hidden]: a query computed
    A: np.ndarray | None = None     # for a row not expected to select if its cache says it selects


def first_selecting(pos0: int, n: int, shape: AttentionShape) -> int:
    """The first of n tokens at positions pos0, pos0 + 1, ... whose attention chooses among the
    compressed rows (a sequence from position 0 has (pos + 1) // ratio of them after its step at
    pos): the indexer's query is computed from it on. n if none of them does."""
    t = (shape.index_topk + 1) * shape.ratio - 1 - pos0
    return min(max(t, 0), n)


def _matmul(m: Matrix, x: np.ndarray) -> np.ndarray:
    return m.matmul(x, np.empty((len(x), m.shape[0]), np.float32))


def side_by_side(ms: list[Matrix]) -> kernels.MatmulGroup | None:
    """Matrices of one input width, their products of an input side by side in one output row (one
    native call, kernels.matmul_group); None where one of them has no native form (an F32Matrix)."""
    if not all(hasattr(m, "native") for m in ms):
        return None
    cols = np.cumsum([0] + [m.shape[0] for m in ms])
    return kernels.MatmulGroup([(m.native, 0, int(c)) for m, c in zip(ms, cols[:-1])], ms[0].shape[1],
                               int(cols[-1]))


def products(ms: list[Matrix], group: kernels.MatmulGroup | None, x: np.ndarray) -> list[np.ndarray]:
    """[m . x for m in ms] for the rows of x [n, k] (each [n, rows of m]): through the group's one
    call (side_by_side), the products then views of its output, or one product at a time."""
    if group is None:
        return [_matmul(m, x) for m in ms]
    y = kernels.matmul_group(group, x)
    out, a = [], 0
    for m in ms:
        out.append(y[:, a:a + m.shape[0]])
        a += m.shape[0]
    return out


def input_projections(w: AttentionWeights) -> list[Matrix]:
    """The projections of the sublayer's normed input a: wq_a, wkv, then the compressor's wkv and
    wgate (CSA, HCA), then the indexer's compressor's (CSA)."""
    ms = [w.wq_a, w.wkv]
    if w.compressor is not None:
        ms += [w.compressor.wkv, w.compressor.wgate]
    if w.indexer is not None:
        ms += [w.indexer.compressor.wkv, w.indexer.compressor.wgate]
    return ms


def project(w: AttentionWeights, A: np.ndarray, shape: AttentionShape, parts: list[tuple[int, int]]) -> Projected:
    """The projections of the rows of A [n, hidden] (see Projected); parts: (pos0, count) of each
    run of consecutive rows, in row order, the tokens of one sequence at positions pos0, pos0 + 1, ..."""
    n, eps = len(A), shape.eps
    ys = products(input_projections(w), w.input_group, A)
    qr = rms_rows(ys[0], eps, w.q_norm)                                       # [n, q_lora], weighted_rms by row
    q = _matmul(w.wq_b, qr).reshape(n * shape.heads, shape.head_dim)            # heads x head_dim a row:
    q = rms_rows(q, eps, out=q)                                                 # normed in place, no second copy
    kv = rms_rows(ys[1], eps, w.kv_norm)
    p = Projected(q.reshape(n, shape.heads, shape.head_dim), kv)
    if shape.kind != "swa":
        p.comp = (ys[2], ys[3])
    if shape.kind == "csa":
        ix = w.indexer
        p.index = (ys[4], ys[5])
        p.qr, p.A = qr, A
        rows, a = [], 0
        for pos0, count in parts:
            rows.extend(range(a + first_selecting(pos0, count, shape), a + count))
            a += count
        p.qrow = np.full(n, -1, np.int64)
        if rows:
            p.qrow[rows] = np.arange(len(rows))
            sel = np.asarray(rows)
            p.query = (_matmul(ix.wq_b, qr[sel]), _matmul(ix.weights_proj, A[sel]))
    return p


def _index_query(w: AttentionWeights, p: Projected, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Row t's indexer query (iq [ih id], hw [ih]): from the batch, or for a row the batch did not
    expect to select, computed alone (the same bits: a row of a batch is its own product)."""
    i = p.qrow[t]
    if i >= 0:
        return p.query[0][i], p.query[1][i]
    ix = w.indexer
    return _matmul(ix.wq_b, p.qr[t:t + 1])[0], _matmul(ix.weights_proj, p.A[t:t + 1])[0]


def _selections(w: AttentionWeights, where: list[tuple[LayerCache, int]], p: Projected, shape: AttentionShape,
                rope: Rope) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The compressors' steps of a step's rows, row after row in position order (each row's cache is
    the one the row before it left), and what each row attends to among the compressed rows: n_comp
    [n] (the rows its sequence had after its own step), and for a row whose indexer chooses among
    them, sel_first [n] (-1: all n_comp rows) into sel (the chosen rows, ascending). A row's compressed
    rows stay where they are in its cache (rows are only appended), so the attention reads them there."""
    n, eps = len(where), shape.eps
    n_comp = np.zeros(n, np.int32)
    if shape.kind == "swa":
        return n_comp, None, None
    sel_first = np.full(n, -1, np.int64) if shape.kind == "csa" else None
    chosen = []
    taken = 0
    for t, (cache, pos) in enumerate(where):
        comp = cache.compressor
        compressor_step(w.compressor, comp, p.comp[0][t], p.comp[1][t], pos, rope, eps)
        n_comp[t] = comp.n_rows
        if shape.kind == "csa":
            index = cache.indexer
            compressor_step(w.indexer.compressor, index, p.index[0][t], p.index[1][t], pos, rope, eps)
            if index.n_rows > shape.index_topk:
                picked = indexer_select(index.rows[:index.n_rows], *_index_query(w, p, t), pos, rope, shape)
                sel_first[t], n_comp[t] = taken, len(picked)
                chosen.append(picked)
                taken += len(picked)
    sel = np.concatenate(chosen).astype(np.int32) if chosen else np.zeros(0, np.int32)
    return n_comp, sel_first, sel


def attend(w: AttentionWeights, parts: list[tuple[LayerCache, int, int]], p: Projected, shape: AttentionShape,
           rope: Rope) -> np.ndarray:
    """The attention of a step's rows, projected (p), against their sequences' caches: o (fp32 [n, H
    head_dim], inverse RoPE applied), updating the caches (each row's key into its window, the
    compressors' steps). parts: (cache, pos0, count) as for attention_parts.

    Row t at position pos attends to its window, the keys at positions pos - n_win + 1 .. pos (n_win
    = min(pos + 1, window)), oldest first, then its compressed rows. The keys of a part are laid out
    once, in position order: the window's rows from before the step (up to window - 1 of them), then
    the part's own keys, so any row's window is a run of them, whatever the count (a chunk longer than
    the window too). The compressors go row after row here (cheap: a row is pooled every ratio
    tokens); the core (logits over the keys, the softmax with the sink, the keys' weighted sum, the
    RoPE of the queries and outputs) goes for all rows at once in native code, rows spread over the
    kernels' threads (kernels.attention_rows: every float64 sum in key order, so a row's bits are its
    own, whichever rows share its call and however many threads run it)."""
    n, W = len(p.q), shape.window
    pos = np.concatenate([np.arange(pos0, pos0 + count, dtype=np.int64) for _, pos0, count in parts])
    cos, sin = rope.cos_sin_rows(pos)
    kv = rope.apply_rows(p.kv.copy(), cos, sin)                  # [n, head_dim], each row's key at its position
    blocks, win_first = [], np.empty(n, np.int64)
    a = off = 0
    for cache, pos0, count in parts:
        before = min(pos0, W - 1)                                # window rows from before the step
        slots = np.arange(pos0 - before, pos0) % W
        blocks += [cache.window[slots], kv[a:a + count]]
        at = pos[a:a + count]
        win_first[a:a + count] = off + (at - np.minimum(at + 1, W) + 1) - (pos0 - before)
        last = max(count - W, 0)                                 # the part's keys the window keeps
        cache.window[(pos0 + np.arange(last, count)) % W] = kv[a + last:a + count]
        cache.tokens = pos0 + count
        off += before + count
        a += count
    keys = np.concatenate(blocks)
    n_win = np.minimum(pos + 1, W).astype(np.int32)
    where = [(cache, pos0 + i) for cache, pos0, count in parts for i in range(count)]
    n_comp, sel_first, sel = _selections(w, where, p, shape, rope)
    comp = [cache.compressor.rows for cache, _, _ in parts] if shape.kind != "swa" else []
    part = np.repeat(np.arange(len(parts), dtype=np.int32), [count for _, _, count in parts])
    O = kernels.attention_rows(p.q, cos, sin, keys, win_first, n_win, comp, part, n_comp, sel_first, sel, w.sinks,
                               shape.head_dim ** -0.5)
    return O.reshape(n, shape.heads * shape.head_dim)


def output_projection(w: AttentionWeights, O: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y [n, hidden] = wo_b . concat_g(wo_a[g] . O[:, group g]) for the rows of O [n, H head_dim]."""
    n, groups = len(O), len(w.wo_a)
    if w.output_group is not None:
        lo = kernels.matmul_group(w.output_group, O)
    else:
        og = O.reshape(n, groups, -1)
        lo = np.concatenate([_matmul(w.wo_a[g], np.ascontiguousarray(og[:, g])) for g in range(groups)], axis=1)
    return w.wo_b.matmul(lo, np.empty((n, w.wo_b.shape[0]), np.float32) if out is None else out)


def grouped(ms: list[Matrix]) -> kernels.MatmulGroup | None:
    """The groups of a grouped projection in one native call: matrix g reads the g-th equal slice of
    the input row and writes the g-th slice of the output row; None where one has no native form."""
    if not all(hasattr(m, "native") for m in ms):
        return None
    rows, k = ms[0].shape
    return kernels.MatmulGroup([(m.native, g * k, g * rows) for g, m in enumerate(ms)], len(ms) * k,
                               len(ms) * rows)


def attention_rows(w: AttentionWeights, cache: LayerCache, A: np.ndarray, pos0: int, shape: AttentionShape,
                   rope: Rope, beside=None) -> np.ndarray:
    """The attention sublayer's outputs (fp32 [n, hidden]) for n consecutive tokens of one
    sequence at positions pos0, pos0 + 1, ... with normed inputs A [n, hidden]: attention_parts
    with one part."""
    return attention_parts(w, [(cache, pos0, len(A))], A, shape, rope, beside)


def attention_parts(w: AttentionWeights, parts: list[tuple[LayerCache, int, int]], A: np.ndarray,
                    shape: AttentionShape, rope: Rope, beside=None) -> np.ndarray:
    """The attention sublayer's outputs (fp32 [n, hidden]) for a step's rows, normed inputs A
    [n, hidden]; parts: (cache, pos0, count) of each run of consecutive rows in row order, the
    tokens of one sequence at positions pos0, pos0 + 1, ..., updating that sequence's cache
    (window, compressors). The projections go all rows at once, then the attention (attend: each
    row against its own sequence's cache as the rows before it left it), then the output
    projection of all rows. Each row of a product is its own, and so is each row's attention, so a
    row's output is the one it gets in a step of its own. beside(fn, *args): where the output
    projection of half of more than OUTPUT_HALF_ROWS rows runs (runtime.helper_thread); None:
    everything here."""
    p = project(w, A, shape, [(pos0, count) for _, pos0, count in parts])
    O = attend(w, parts, p, shape, rope)
    if beside is None or len(O) <= OUTPUT_HALF_ROWS:
        return output_projection(w, O)
    Y = np.empty((len(O), w.wo_b.shape[0]), np.float32)
    in_halves(beside, lambda a, b: _project_alone(w, O[a:b], Y[a:b]), len(O), OUTPUT_HALF_ROWS)
    return Y


OUTPUT_HALF_ROWS = 64   # rows from which the output projection goes in two halves, one per core


def _project_alone(w: AttentionWeights, O: np.ndarray, Y: np.ndarray) -> None:
    """output_projection of some rows on this thread alone (kernels.alone: the pool untouched), so
    the two halves keep to a core each, as two streams that do not wait on each other's tasks."""
    with kernels.alone():
        output_projection(w, O, Y)


def push_window_rows(w: AttentionWeights, cache: LayerCache, A: np.ndarray, pos0: int, shape: AttentionShape,
                     rope: Rope) -> None:
    """The keys of n consecutive tokens at positions pos0, ... (normed inputs A [n, hidden]) into
    a sliding-window layer's cache, without attending: the rows attention_parts would push (a
    row's key depends on its input alone), for tokens whose outputs are not wanted."""
    if shape.kind != "swa":
        raise ValueError("only a sliding-window layer's keys can be pushed alone")
    kv = rms_rows(_matmul(w.wkv, A), shape.eps, w.kv_norm)
    for t in range(len(A)):
        cache.window[(pos0 + t) % shape.window] = rope.apply(kv[t].copy(), pos0 + t)
    cache.tokens = pos0 + len(A)


def attention_step(w: AttentionWeights, cache: LayerCache, a: np.ndarray, pos: int, shape: AttentionShape,
                   rope: Rope) -> np.ndarray:
    """The attention sublayer's output (fp32 [hidden]) for the token at `pos` with normed input a;
    updates the cache (window, compressors)."""
    return attention_rows(w, cache, a[None, :], pos, shape, rope)[0]


# ---- a model's layers ---------------------------------------------------------------------------

def attention_shapes(att, eps: float) -> list[AttentionShape]:
    """Each layer's AttentionShape from the geometry's attention settings (geometry.AttentionGeometry)."""
    return [AttentionShape(att.kind(i), att.ratio(i), att.n_heads, att.head_dim, att.window, att.index_n_heads,
                           att.index_head_dim, att.index_topk, eps) for i in range(len(att.layer_kinds))]


def layer_ropes(att) -> tuple[Rope, Rope]:
    """(main, compress): plain RoPE of rope_theta for sliding-window layers; compress_rope_theta,
    with YaRN when configured, for CSA and HCA layers."""
    main = Rope(inv_freq_default(att.rope_theta, att.rope_dim))
    y = att.yarn
    comp = Rope(inv_freq_yarn(att.compress_rope_theta, att.rope_dim, y.factor, y.original_max_position_embeddings,
                              y.beta_fast, y.beta_slow) if y is not None
                else inv_freq_default(att.compress_rope_theta, att.rope_dim))
    return main, comp


class KVCache:
    """A sequence's attention state: every layer's LayerCache, for up to `context` positions."""

    def __init__(self, shapes: list[AttentionShape], context: int) -> None:
        self.context = context
        self.layers = [new_layer_cache(s, context) for s in shapes]

    @staticmethod
    def nbytes_for(shapes: list[AttentionShape], context: int) -> int:
        return sum(layer_cache_nbytes(s, context) for s in shapes)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    def reset(self) -> None:
        for c in self.layers:
            c.reset()
