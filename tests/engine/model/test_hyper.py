"""The hyper-connections' native code (kernels.hc_pre, hc_post, the head's reduction) against a
float64 numpy statement of transformers' DeepseekV4HyperConnection written here, independent of
the code under test: within a few float64 roundings (exp is the C library's there, numpy's here),
the fp32 results within one rounding; and the same bits on every backend and at every batch size
(a token alone or among others), which the engine's determinism needs."""
from __future__ import annotations

import numpy as np
import pytest

from ds4f.engine.model.hyper import HyperWeights, hc_head, hc_post_rows, hc_pre_rows
from ds4f.native import kernels

BACKENDS = [b for b in ("scalar", "avx2", "avx512", "neon") if b in kernels.available_backends()]
N, HIDDEN, ITERS, EPS, HC_EPS = 4, 256, 20, 1e-6, 1e-6


def reference_pre(X: np.ndarray, fn: np.ndarray, base, scale, head: bool = False):
    """(h, post, comb) of one token's streams X [N, hidden] in float64 (fn [rows, N hidden])."""
    x = X.astype(np.float64).reshape(-1)
    mix = fn.astype(np.float64) @ (x / np.sqrt(np.mean(x * x) + EPS))
    base, scale = base.astype(np.float64), scale.astype(np.float64)
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
    pre = sig(mix[:N] * scale[0] + base[:N]) + HC_EPS
    h = (pre[:, None] * X.astype(np.float64)).sum(axis=0)
    if head:
        return h, None, None
    post = 2.0 * sig(mix[N:2 * N] * scale[1] + base[N:2 * N])
    logits = (mix[2 * N:] * scale[2] + base[2 * N:]).reshape(N, N)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    comb = e / e.sum(axis=1, keepdims=True) + HC_EPS
    comb /= comb.sum(axis=0, keepdims=True) + HC_EPS
    for _ in range(ITERS - 1):
        comb /= comb.sum(axis=1, keepdims=True) + HC_EPS
        comb /= comb.sum(axis=0, keepdims=True) + HC_EPS
    return h, post, comb


def weights(rng, rows: int) -> tuple[np.ndarray, HyperWeights]:
    fn = (rng.standard_normal((rows, N * HIDDEN)) * 0.05).astype(np.float32)
    base = rng.standard_normal(rows).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 3 if rows > N else 1).astype(np.float32)
    return fn, HyperWeights.of(fn, base, scale)


def assert_fp32_close(got: np.ndarray, want64: np.ndarray) -> None:
    """got (fp32) is want64 rounded to fp32, give or take one fp32 step (want64 is a few float64
    roundings off the exact value, so its rounding may fall either side)."""
    step = np.spacing(np.abs(want64).astype(np.float32))
    assert np.all(np.abs(got.astype(np.float64) - want64) <= step), np.abs(got - want64).max()


@pytest.mark.parametrize("n", [1, 3, 9])
def test_hc_pre_and_post_are_transformers_hyper_connection(n):
    rng = np.random.default_rng(n)
    fn, w = weights(rng, (2 + N) * N)
    X = rng.standard_normal((n, N, HIDDEN)).astype(np.float32)
    Y = rng.standard_normal((n, HIDDEN)).astype(np.float32)
    h, post, comb = hc_pre_rows(X, w, EPS, HC_EPS, ITERS)
    assert h.dtype == np.float32 and post.dtype == comb.dtype == np.float64
    out = hc_post_rows(X.copy(), Y, post, comb)
    for t in range(n):
        rh, rpost, rcomb = reference_pre(X[t], fn, w.base, w.scale)
        assert_fp32_close(h[t], rh)
        assert np.allclose(post[t], rpost, rtol=1e-14, atol=0) and np.allclose(comb[t], rcomb, rtol=1e-13, atol=0)
        assert np.allclose(comb[t].sum(axis=0), 1.0, atol=1e-6)          # Sinkhorn: columns sum to one
        want = rcomb.T @ X[t].astype(np.float64) + rpost[:, None] * Y[t].astype(np.float64)
        assert_fp32_close(out[t], want)


def test_the_heads_reduction():
    rng = np.random.default_rng(7)
    fn, w = weights(rng, N)
    X = rng.standard_normal((N, HIDDEN)).astype(np.float32)
    rh, _, _ = reference_pre(X, fn, w.base, w.scale, head=True)
    assert_fp32_close(hc_head(X, w, EPS, HC_EPS), rh)


def test_the_same_bits_on_every_backend_and_alone_or_in_a_batch():
    rng = np.random.default_rng(11)
    _, w = weights(rng, (2 + N) * N)
    X = rng.standard_normal((6, N, HIDDEN)).astype(np.float32)
    Y = rng.standard_normal((6, HIDDEN)).astype(np.float32)
    saved = kernels.get_backend()
    results = []
    try:
        for backend in BACKENDS:
            kernels.set_backend(backend)
            together = hc_pre_rows(X, w, EPS, HC_EPS, ITERS)
            alone = [hc_pre_rows(X[t:t + 1], w, EPS, HC_EPS, ITERS) for t in range(len(X))]
            for part, got in enumerate(together):
                assert got.tobytes() == np.concatenate([a[part] for a in alone]).tobytes(), (backend, part)
            post_all = hc_post_rows(X.copy(), Y, together[1], together[2])
            post_one = np.concatenate([hc_post_rows(X[t:t + 1].copy(), Y[t:t + 1], together[1][t:t + 1],
                                                    together[2][t:t + 1]) for t in range(len(X))])
            assert post_all.tobytes() == post_one.tobytes(), backend
            results.append((backend, [a.tobytes() for a in together], post_all.tobytes()))
    finally:
        kernels.set_backend(saved)
    for backend, parts, post in results[1:]:
        assert parts == results[0][1] and post == results[0][2], f"{backend} differs from {results[0][0]}"


def test_bad_arguments_name_the_argument():
    rng = np.random.default_rng(5)
    _, w = weights(rng, (2 + N) * N)
    X = rng.standard_normal((2, N, HIDDEN)).astype(np.float32)
    for call, name in [(lambda: kernels.hc_pre(X.astype(np.float64), w.fn_t, w.base, w.scale, EPS, HC_EPS, 3), "X"),
                       (lambda: kernels.hc_pre(X[:, :3].copy(), w.fn_t, w.base, w.scale, EPS, HC_EPS, 3), "fn_t"),
                       (lambda: kernels.hc_pre(X, w.fn_t[:, :5], w.base[:5], w.scale, EPS, HC_EPS, 3), "fn_t"),
                       (lambda: kernels.hc_pre(X, w.fn_t, w.base[:3], w.scale, EPS, HC_EPS, 3), "base"),
                       (lambda: kernels.hc_post(X, X[:, 0].copy(), np.zeros((2, 3)), np.zeros((2, N, N))), "post"),
                       (lambda: kernels.hc_post(X, X[:, 0, :8].copy(), np.zeros((2, N)), np.zeros((2, N, N))), "Y")]:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            call()
