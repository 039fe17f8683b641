"""The attention core in native code (kernels.attention_rows, native/attention.c) against a float64
numpy statement of it, and the attention of a step's rows (attention.attend) against the same rows
one at a time.

The core's bits are its own: every float64 sum in key order and its own exp, so they do not depend on
the backend, the thread count or the other rows of a call (checked bit for bit); numpy's BLAS sums in
blocks of its own and numpy's exp is another one, so against numpy the fp32 outputs agree to a few
units in the last place (checked to 1e-6 of the row's largest value).
"""
from __future__ import annotations

import numpy as np
import pytest

from ds4f.native import kernels
from ds4f.engine.model import attention as A
from ds4f.engine.model.attention import KVCache, attention_parts, attention_step

from test_attention_model import FIXTURES, FixtureModel

BACKENDS = [b for b in ("scalar", "avx2", "avx512", "neon") if b in kernels.available_backends()]


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False) -> np.ndarray:
    """transformers' interleaved RoPE of x's last 2 len(cos) dims, fp32 (x [..., d], cos [len])."""
    x = x.copy()
    tail = x[..., x.shape[-1] - 2 * cos.shape[-1]:]
    s = -sin if inverse else sin
    even, odd = tail[..., 0::2].copy(), tail[..., 1::2].copy()
    tail[..., 0::2] = even * cos - odd * s
    tail[..., 1::2] = odd * cos + even * s
    return x


def _reference(case: dict) -> np.ndarray:
    """The core row by row in numpy float64: RoPE, q . K^T scaled, the softmax with the sink in its
    denominator, the probabilities' sum of the keys, fp32, inverse RoPE."""
    q, cos, sin, keys = case["q"], case["cos"], case["sin"], case["keys"]
    out = np.empty_like(q)
    for t in range(len(q)):
        K = [keys[case["win_first"][t]:case["win_first"][t] + case["n_win"][t]]]
        rows, n = case["comp"][case["part"][t]] if case["comp"] else None, case["n_comp"][t]
        if case["sel_first"] is not None and case["sel_first"][t] >= 0:
            K.append(rows[case["sel"][case["sel_first"][t]:case["sel_first"][t] + n]])
        elif n:
            K.append(rows[:n])
        K = np.concatenate(K).astype(np.float64)
        logits = _rope(q[t], cos[t], sin[t]).astype(np.float64) @ K.T * case["scale"]
        sink = case["sinks"].astype(np.float64)[:, None]
        m = np.maximum(logits.max(axis=1, keepdims=True), sink)
        e = np.exp(logits - m)
        p = e / (e.sum(axis=1, keepdims=True) + np.exp(sink - m))
        out[t] = _rope((p @ K).astype(np.float32), cos[t], sin[t], inverse=True)
    return out


def _case(rng, n: int, heads: int, hd: int, half: int, window: int, comp_rows: int, topk: int, parts: int,
          spread: float) -> dict:
    q = (rng.standard_normal((n, heads, hd)) * spread).astype(np.float32)
    angle = rng.uniform(0, 200, (n, half)).astype(np.float32)
    keys = rng.standard_normal((n + window, hd)).astype(np.float32)
    comp = [rng.standard_normal((comp_rows, hd)).astype(np.float32) for _ in range(parts)] if comp_rows else []
    n_comp = rng.integers(0, comp_rows + 1, n).astype(np.int32)
    n_win = rng.integers(1, window + 1, n).astype(np.int32)
    sel_first = sel = None
    if topk:
        sel_first, chosen, at = np.full(n, -1, np.int64), [], 0
        for t in range(n):
            if n_comp[t] > topk and rng.random() < 0.6:
                chosen.append(np.sort(rng.choice(n_comp[t], topk, replace=False)).astype(np.int32))
                sel_first[t], n_comp[t], at = at, topk, at + topk
        sel = np.concatenate(chosen) if chosen else np.zeros(0, np.int32)
    return {"q": q, "cos": np.cos(angle), "sin": np.sin(angle), "keys": keys,
            "win_first": rng.integers(0, n, n).astype(np.int64), "n_win": n_win, "comp": comp,
            "part": rng.integers(0, max(parts, 1), n).astype(np.int32), "n_comp": n_comp, "sel_first": sel_first,
            "sel": sel, "sinks": rng.standard_normal(heads).astype(np.float32) * 2, "scale": hd ** -0.5}


def _native(case: dict) -> np.ndarray:
    return kernels.attention_rows(case["q"], case["cos"], case["sin"], case["keys"], case["win_first"], case["n_win"],
                                  case["comp"], case["part"], case["n_comp"], case["sel_first"], case["sel"],
                                  case["sinks"], case["scale"])


def assert_close_to(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    scale = np.abs(want).max(axis=(1, 2), keepdims=True)
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= rel * scale).all(), float((np.abs(got - want) / scale).max())


@pytest.mark.parametrize("heads, hd, half, window, comp_rows, topk, parts, spread", [
    (4, 64, 8, 8, 12, 3, 1, 1.0),        # the tiny geometry's widths, a selection among the rows
    (12, 40, 4, 6, 9, 0, 2, 2.0),        # heads not a multiple of a vector, two sequences' rows
    (64, 128, 32, 16, 40, 8, 3, 4.0),    # whole vector tiles of heads and dims, sharp softmaxes
    (8, 32, 4, 5, 0, 0, 0, 1.0),         # a sliding-window layer: no compressed rows
])
def test_the_native_core_is_the_float64_statement_with_the_same_bits_everywhere(heads, hd, half, window, comp_rows,
                                                                                 topk, parts, spread):
    rng = np.random.default_rng(heads * 1000 + hd)
    case = _case(rng, 23, heads, hd, half, window, comp_rows, topk, parts, spread)
    want = _reference(case)
    saved, threads = kernels.get_backend(), kernels.get_threads()
    got = {}
    try:
        for backend in BACKENDS:
            kernels.set_backend(backend)
            for n in (1, 2, 3):
                kernels.set_threads(n)
                got[backend, n] = _native(case)
    finally:
        kernels.set_backend(saved)
        kernels.set_threads(threads)
    first = next(iter(got.values()))
    for key, out in got.items():
        assert out.tobytes() == first.tobytes(), key
    assert_close_to(first, want, 1e-6)
    # a row's bits whatever the other rows of the call: the last rows alone
    tail = {k: (v[15:] if isinstance(v, np.ndarray) and len(v) == 23 else v) for k, v in case.items()}
    assert _native(tail).tobytes() == first[15:].tobytes()


def test_bad_arguments_are_refused():
    case = _case(np.random.default_rng(3), 4, 4, 16, 4, 4, 6, 2, 1, 1.0)
    bad = dict(case, n_win=case["n_win"] + 100)
    with pytest.raises(ValueError, match="window"):
        _native(bad)
    bad = dict(case, n_win=np.zeros(4, np.int32), n_comp=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="at least one key"):
        _native(bad)
    if len(case["sel"]):
        bad = dict(case, sel=case["sel"] + 50)
        with pytest.raises(ValueError, match="^sel: a row selects"):
            _native(bad)
        bad = dict(case, sel_first=np.where(case["sel_first"] >= 0, case["sel_first"] + len(case["sel"]), -1))
        with pytest.raises(ValueError, match="^sel_first, n_comp"):
            _native(bad)
    has = case["n_comp"] > 0
    assert has.any()
    bad = dict(case, part=np.where(has, len(case["comp"]), case["part"]).astype(np.int32))
    with pytest.raises(ValueError, match="^part"):
        _native(bad)
    held = np.array([len(c) for c in case["comp"]])[case["part"]]
    bad = dict(case, sel_first=np.full(4, -1, np.int64), n_comp=np.where(has, held + 1, 0).astype(np.int32))
    with pytest.raises(ValueError, match="^n_comp: a row attends to more"):
        _native(bad)


def _old_core(w, cache, p, t, pos, shape, rope):
    """Row t's attention as numpy float64 statements over the cache as the rows before it left it."""
    hd = shape.head_dim
    q = rope.apply(p.q[t].copy(), pos)
    cache.window[pos % shape.window] = rope.apply(p.kv[t].copy(), pos)
    n_win = min(pos + 1, shape.window)
    rows = np.zeros((0, hd), np.float32)
    if shape.kind != "swa":
        A.compressor_step(w.compressor, cache.compressor, p.comp[0][t], p.comp[1][t], pos, rope, shape.eps)
        rows = cache.compressor.rows[:cache.compressor.n_rows]
        if shape.kind == "csa":
            index = cache.indexer
            A.compressor_step(w.indexer.compressor, index, p.index[0][t], p.index[1][t], pos, rope, shape.eps)
            if index.n_rows > shape.index_topk:
                rows = rows[A.indexer_select(index.rows[:index.n_rows], *A._index_query(w, p, t), pos, rope, shape)]
    order = [(pos - n_win + 1 + i) % shape.window for i in range(n_win)]
    K = np.concatenate([cache.window[order], rows]).astype(np.float64)
    logits = (q.astype(np.float64) @ K.T) * hd ** -0.5
    sink = w.sinks.astype(np.float64)[:, None]
    m = np.maximum(logits.max(axis=1, keepdims=True), sink)
    e = np.exp(logits - m)
    prob = e / (e.sum(axis=1, keepdims=True) + np.exp(sink - m))
    return rope.apply((prob @ K).astype(np.float32), pos, inverse=True).reshape(-1)


def test_a_steps_rows_attend_as_they_would_one_at_a_time():
    """The `ratios` fixture's layers (window 5, CSA with index_topk 3, HCA): two sequences in one step,
    40 rows of the first (past its window and through the indexer's choices) after 7 rows alone, and
    13 of the second from position 0: each row's output is the one it gets in a step of its own (bit
    for bit), and the float64 numpy statement's within 1e-6."""
    model = FixtureModel(FIXTURES / "ratios", context=64)
    rng = np.random.default_rng(11)
    seen = set()
    for attn, shape, _cache, rope, *_ in model.layers:
        if shape.kind in seen:
            continue
        seen.add(shape.kind)
        hidden = attn.wq_a.shape[1]
        A1 = rng.standard_normal((47, hidden)).astype(np.float32)
        A2 = rng.standard_normal((13, hidden)).astype(np.float32)
        one, two = KVCache([shape], 64).layers[0], KVCache([shape], 64).layers[0]
        attention_parts(attn, [(one, 0, 7)], A1[:7], shape, rope)
        Y = attention_parts(attn, [(one, 7, 40), (two, 0, 13)], np.concatenate([A1[7:], A2]), shape, rope)
        a1, a2 = KVCache([shape], 64).layers[0], KVCache([shape], 64).layers[0]
        alone = [attention_step(attn, a1, A1[t], t, shape, rope) for t in range(47)]
        alone += [attention_step(attn, a2, A2[t], t, shape, rope) for t in range(13)]
        assert Y.tobytes() == np.stack(alone[7:]).tobytes(), shape.kind
        assert one.window.tobytes() == a1.window.tobytes() and two.window.tobytes() == a2.window.tobytes()
        # the attention outputs before the output projection, against numpy's float64 statement
        r1, r2 = KVCache([shape], 64).layers[0], KVCache([shape], 64).layers[0]
        c1, c2 = KVCache([shape], 64).layers[0], KVCache([shape], 64).layers[0]
        for X, ref, cache in ((A1, r1, c1), (A2, r2, c2)):
            p = A.project(attn, X, shape, [(0, len(X))])
            want = np.stack([_old_core(attn, ref, p, t, t, shape, rope) for t in range(len(X))])
            got = A.attend(attn, [(cache, 0, len(X))], p, shape, rope)
            scale = np.abs(want).max(axis=1, keepdims=True)
            assert (np.abs(got - want) <= 1e-6 * scale).all(), shape.kind
        if shape.kind == "csa":
            assert c1.indexer.n_rows > shape.index_topk, "the indexer chose among the rows"
    assert seen == {"swa", "csa", "hca"}
