"""The multi-token kernels (mxfp4_matmul, bf16_matmul, fp8_matmul, experts_forward_tokens) on every
backend this CPU supports (NEON: tests/test_neon.py, under qemu).

Two references for every result: the same backend's single-vector kernel on each input vector,
which a batched result must equal bit for bit (batching never changes a state dump), at any
number of vectors and thread count; and an independent float64 numpy product of the weights
decoded with ml_dtypes, which it must match within 1e-5 * sum |w*x| per element.
"""
from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

from ds4f.native import kernels as K

from kernel_params import backend_marks, bits, kernel_settings_restored, progress_seen_during, unaligned

BACKEND, _ = backend_marks()
restore_kernel_settings = kernel_settings_restored()

TOKENS = (1, 2, 3, 4, 7, 8, 9, 32, 33, 65)   # each few-token count, odd counts, the last few-token count and the first
                                          # beyond it (8, 9), one beyond each accumulator block (32, 64)
THREADS = (1, 2, 3)
TILE = 128
QNAN = 0x7FC00000


# ---- independent references ----------------------------------------------------------------


def mxfp4_64(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """ml_dtypes: float4_e2m1fn x float8_e8m0fnu, in float64."""
    rows, half = codes.shape
    nib = np.empty((rows, 2 * half), np.uint8)
    nib[:, 0::2], nib[:, 1::2] = codes & 15, codes >> 4
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return vals * np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64), 32, axis=1)


def fp8_64(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """ml_dtypes' E4M3 values times 2^(b-127) per 128x128 tile (NaN for 255), in float64."""
    rows, k = w.shape
    b = scales.astype(np.float64)
    sc = np.repeat(np.repeat(np.where(b == 255, np.nan, np.exp2(b - 127)), TILE, axis=0)[:rows], TILE, axis=1)
    return w.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * sc[:, :k]


def check_close(y: np.ndarray, w64: np.ndarray, x: np.ndarray) -> None:
    """y [n, rows] against float64 x . w64^T, within 1e-5 * sum |w*x|; rows of w64 holding a NaN
    must give NaN for every vector."""
    nan = np.isnan(w64).any(axis=1)
    w64 = np.where(np.isnan(w64), 0.0, w64)
    x64 = x.astype(np.float64)
    ref, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    assert np.isnan(y[:, nan]).all()
    ok = ~nan
    err = np.abs(y[:, ok] - ref[:, ok])
    assert np.all(err <= 1e-5 * bound[:, ok]), np.max(err / np.maximum(bound[:, ok], 1e-300))


def rand_mxfp4(rng, rows, k, lo=118, hi=130):
    return rng.integers(0, 256, (rows, k // 2), dtype=np.uint8), rng.integers(lo, hi, (rows, k // 32), dtype=np.uint8)


def rand_fp8(rng, rows, k, lo=110, hi=136):
    w = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] ^= 1  # no NaN codes unless planted
    return w, rng.integers(lo, hi, (-(-rows // TILE), -(-k // TILE)), dtype=np.uint8)


def check_batches(backend, matmul, matvec, w64, k, rng, x_scale=1.0):
    """For every token count and thread count: matmul = the single-vector kernel on each vector,
    bit for bit, and close to float64."""
    K.set_backend(backend)
    xs = (rng.standard_normal((max(TOKENS), k)) * x_scale).astype(np.float32)
    K.set_threads(1)
    single = np.stack([matvec(v) for v in xs])
    check_close(single, w64, xs)
    for threads in THREADS:
        K.set_threads(threads)
        for n in TOKENS:
            got = matmul(xs[:n])
            assert got.shape == (n, w64.shape[0]) and got.dtype == np.float32
            np.testing.assert_array_equal(bits(got), bits(single[:n]), err_msg=f"{n} vectors, {threads} threads")
            check_close(got, w64, xs[:n])


# ---- matmuls -------------------------------------------------------------------------------

SHAPES = [(1, 32), (7, 96), (37, 64), (130, 4096), (301, 512)]


@BACKEND
@pytest.mark.parametrize("rows,k", SHAPES)
def test_mxfp4_matmul(backend, rows, k):
    rng = np.random.default_rng(rows * 7 + k)
    codes, scales = rand_mxfp4(rng, rows, k)
    check_batches(backend, lambda x: K.mxfp4_matmul(codes, scales, x), lambda v: K.mxfp4_matvec(codes, scales, v),
                  mxfp4_64(codes, scales), k, rng)


@BACKEND
def test_mxfp4_matmul_every_scale_byte(backend):
    """Scale bytes over the whole E8M0 range: 0..2 and 3..26 (weights in float32's subnormals),
    up to 250 (x small, so that nothing overflows float32; every fifth row holds one above 232),
    and 255 (NaN rows); every vector bit for bit the single-vector kernel's, and close to float64."""
    rng = np.random.default_rng(17)
    rows, k = 203, 512
    codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.integers(3, 251, (rows, k // 32), dtype=np.uint8)
    scales[::3, 5] = rng.integers(0, 3, len(range(0, rows, 3)))  # every third row: a scale below 3
    scales[2::5, 9] = rng.integers(233, 251, len(range(2, rows, 5)))  # every fifth: one above 232
    scales[1::7, 2] = rng.integers(3, 27, len(range(1, rows, 7)))
    scales[[10, 101, 202], [0, 15, 7]] = 255
    w64 = mxfp4_64(codes, scales)
    assert np.isnan(w64).any(axis=1).sum() == 3
    check_batches(backend, lambda x: K.mxfp4_matmul(codes, scales, x), lambda v: K.mxfp4_matvec(codes, scales, v),
                  w64, k, rng, x_scale=2.0**-20)


@BACKEND
@pytest.mark.parametrize("rows,k", SHAPES)
@pytest.mark.parametrize("as_bf16", [False, True], ids=["uint16", "bfloat16"])
def test_bf16_matmul(backend, rows, k, as_bf16):
    rng = np.random.default_rng(rows * 5 + k)
    w = rng.standard_normal((rows, k)).astype(np.float32).astype(ml_dtypes.bfloat16)
    arg = w if as_bf16 else w.view(np.uint16)
    check_batches(backend, lambda x: K.bf16_matmul(arg, x), lambda v: K.bf16_matvec(arg, v),
                  w.astype(np.float64), k, rng)


# FP8: ragged row and column tiles, k tails of every SIMD width
FP8_SHAPES = [(1, 1), (3, 17), (17, 63), (130, 129), (33, 1000), (9, 4100), (260, 1792)]


@BACKEND
@pytest.mark.parametrize("rows,k", FP8_SHAPES)
def test_fp8_matmul(backend, rows, k):
    rng = np.random.default_rng(rows * 3 + k)
    w, scales = rand_fp8(rng, rows, k)
    check_batches(backend, lambda x: K.fp8_matmul(w, scales, x), lambda v: K.fp8_matvec(w, scales, v),
                  fp8_64(w, scales), k, rng)


@BACKEND
def test_fp8_matmul_extreme_scales_and_nan_rows(backend):
    """Scale bytes at the edges of the tile factor's range (0, 1, 246..254; codes below 2 and a
    small x so that nothing overflows float32) and NaN: a 255 scale tile and NaN codes make their
    rows the quiet NaN 0x7fc00000 for every vector; all bit for bit the single-vector kernel's."""
    rng = np.random.default_rng(9)
    rows, k = 260, 300
    w = rng.integers(0, 256, (rows, k), dtype=np.uint8) & 0xBF
    scales = np.array([[0, 1, 246], [247, 250, 254], [255, 120, 130]], np.uint8)
    w[5, 200], w[131, 7] = 0x7F, 0xFF
    w64 = fp8_64(w, scales)
    assert np.isnan(w64).any(axis=1).sum() == 4 + 2  # rows 256..259 (scale 255) and the two NaN codes
    check_batches(backend, lambda x: K.fp8_matmul(w, scales, x), lambda v: K.fp8_matvec(w, scales, v),
                  w64, k, rng, x_scale=2.0**-20)
    K.set_backend(backend)
    y = K.fp8_matmul(w, scales, rng.standard_normal((3, k)).astype(np.float32))
    assert (bits(y)[:, [5, 131, 256, 259]] == QNAN).all()


@BACKEND
def test_matmul_views_outputs_and_scratch(backend):
    """Unaligned inputs and views are used in place; out and scratch are filled in place and can
    be reused across calls of any size; 0 vectors give an empty result."""
    K.set_backend(backend)
    rng = np.random.default_rng(4)
    codes, scales = rand_mxfp4(rng, 64, 256)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    ref = K.mxfp4_matmul(codes, scales, x)
    big = np.full((8, 70), -1.0, np.float32)
    out = big[1:6, 3:67]  # not contiguous: refused
    with pytest.raises(ValueError, match="^out"):
        K.mxfp4_matmul(codes, scales, x, out=out)
    flat = np.full(5 * 64 + 20, -1.0, np.float32)
    out = flat[10:10 + 5 * 64].reshape(5, 64)
    scratch = K.matmul_scratch(5, 256)
    got = K.mxfp4_matmul(unaligned(codes, 1), unaligned(scales, 3), unaligned(x, 4), out=out, scratch=scratch)
    assert got is out and np.all(flat[:10] == -1) and np.all(flat[-10:] == -1)
    np.testing.assert_array_equal(bits(got), bits(ref))
    np.testing.assert_array_equal(bits(K.mxfp4_matmul(codes, scales, x[:2], scratch=scratch)), bits(ref[:2]))
    assert K.mxfp4_matmul(codes, scales, x[:0]).shape == (0, 64)
    w16 = rng.integers(0x3C00, 0x4400, (64, 256), dtype=np.uint16)
    assert K.bf16_matmul(w16, x[:0]).shape == (0, 64)


def test_matmul_bad_input_names_the_argument():
    rng = np.random.default_rng(1)
    codes, scales = rand_mxfp4(rng, 8, 64)
    w8, s8 = rand_fp8(rng, 8, 64)
    w16 = np.zeros((8, 64), np.uint16)
    x = np.zeros((3, 64), np.float32)
    bad = [
        (lambda: K.mxfp4_matmul(codes, scales, x[0]), "x"),                      # 1-D
        (lambda: K.mxfp4_matmul(codes, scales, x.astype(np.float64)), "x"),
        (lambda: K.mxfp4_matmul(codes, scales, np.zeros((3, 32), np.float32)), "x"),
        (lambda: K.mxfp4_matmul(codes, scales, np.asfortranarray(np.zeros((64, 64), np.float32))[:3]), "x"),
        (lambda: K.mxfp4_matmul(codes, scales[:, :1], x), "scales"),
        (lambda: K.mxfp4_matmul(codes, scales, x, out=np.empty((3, 7), np.float32)), "out"),
        (lambda: K.mxfp4_matmul(codes, scales, x, out=np.empty((8, 3), np.float32)), "out"),
        (lambda: K.mxfp4_matmul(codes, scales, x, scratch=np.empty(10, np.float32)), "scratch"),
        (lambda: K.mxfp4_matmul(codes, scales, x, scratch=K.matmul_scratch(3, 64).astype(np.float64)), "scratch"),
        (lambda: K.bf16_matmul(w16[:, :48], x[:, :48]), "w"),
        (lambda: K.bf16_matmul(w16.astype(np.int16), x), "w"),
        (lambda: K.fp8_matmul(w8, s8, x[:, :63]), "x"),
        (lambda: K.fp8_matmul(w8, s8[:, :0], x), "scales"),
    ]
    buf = np.zeros(4096, np.float32)
    bad.append((lambda: K.mxfp4_matmul(codes, scales, buf[:192].reshape(3, 64), scratch=buf[100:]), "scratch"))
    bad.append((lambda: K.mxfp4_matmul(codes, scales, buf[:192].reshape(3, 64), out=buf[:24].reshape(3, 8)), "out"))
    for call, name in bad:
        with pytest.raises(ValueError, match=rf"^{name}"):
            call()


@BACKEND
def test_prepared_matrices_give_the_single_vector_bits(backend):
    """A weight prepared once (its checks and pointers kept) serves calls of any row count: every
    row is the single-vector kernel's bits, and the bad x, out and scratch of a call are still named."""
    K.set_backend(backend)
    rng = np.random.default_rng(12)
    codes, scales = rand_mxfp4(rng, 40, 256)
    w8, s8 = rand_fp8(rng, 130, 256)
    w16 = rng.standard_normal((40, 256)).astype(np.float32).astype(ml_dtypes.bfloat16)
    cases = [(K.prepare_mxfp4(codes, scales), lambda v: K.mxfp4_matvec(codes, scales, v), mxfp4_64(codes, scales)),
             (K.prepare_fp8(w8, s8), lambda v: K.fp8_matvec(w8, s8, v), fp8_64(w8, s8)),
             (K.prepare_bf16(w16), lambda v: K.bf16_matvec(w16, v), w16.astype(np.float64))]
    for m, matvec, w64 in cases:
        x = rng.standard_normal((9, 256)).astype(np.float32)
        single = np.stack([matvec(v) for v in x])
        scratch = K.matmul_scratch(9, 256)
        for n in (1, 4, 9, 2):
            out = np.empty((n, m.rows), np.float32)
            got = K.matmul(m, x[:n], out, scratch)
            assert got is out
            np.testing.assert_array_equal(bits(got), bits(single[:n]))
        check_close(K.matmul(m, x), w64, x)
        for call, name in [(lambda: K.matmul(m, x.astype(np.float64)), "x"),
                           (lambda: K.matmul(m, x, np.empty((9, m.rows + 1), np.float32), scratch), "out"),
                           (lambda: K.matmul(m, x, None, scratch[:5]), "scratch"),
                           (lambda: K.matmul(m, x, np.empty((9, m.rows), np.float32), scratch.reshape(1, -1)[:, ::2]),
                            "scratch"),
                           (lambda: K.matmul(m, x, x[:, :m.rows] if m.rows <= 256 else None, scratch), "out")]:
            if name == "out" and m.rows > 256:
                continue
            with pytest.raises(ValueError, match=rf"^{name}"):
                call()
    with pytest.raises(ValueError, match="^scales"):
        K.prepare_fp8(w8, s8[:, :1])


@BACKEND
def test_prepared_experts_give_the_same_bits(backend):
    """Experts prepared once (the engine keeps one per cache slot) give experts_forward_tokens the
    bits their plain arrays give, mixed with plain ones in one call; a prepared expert of another
    width, or a bad array, is named."""
    K.set_backend(backend)
    hidden, inter, limit = 128, 64, 7.0
    rng = np.random.default_rng(13)
    experts = [rand_expert(rng, hidden, inter) for _ in range(3)]
    tokens = [[0, 2], [1], [2, 0, 1]]
    weights = [rng.uniform(0.05, 0.5, len(t)).astype(np.float32) for t in tokens]
    x = (rng.standard_normal((3, hidden)) * 0.05).astype(np.float32)
    plain = K.experts_forward_tokens(experts, tokens, weights, x, limit)
    prepared = [K.prepare_expert(e) for e in experts]
    mixed = [prepared[0], experts[1], prepared[2]]
    for ex in (prepared, mixed, prepared):
        np.testing.assert_array_equal(bits(K.experts_forward_tokens(ex, tokens, weights, x, limit)), bits(plain))
    other = K.prepare_expert(rand_expert(rng, 2 * hidden, inter))
    with pytest.raises(ValueError, match=r"^experts\[1\]: prepared for 256x64"):
        K.experts_forward_tokens([prepared[0], other], tokens[:2], weights[:2], x, limit)
    with pytest.raises(ValueError, match=r"^expert\.s3"):
        K.prepare_expert(experts[0]._replace(s3=experts[0].s3[:, :1]))


# ---- routed experts on their tokens ----------------------------------------------------------


def rand_expert(rng, hidden, inter) -> K.ExpertWeights:
    return K.ExpertWeights(*rand_mxfp4(rng, inter, hidden), *rand_mxfp4(rng, inter, hidden),
                           *rand_mxfp4(rng, hidden, inter))


def ref_expert(e: K.ExpertWeights, weight: float, x: np.ndarray, limit: float):
    """One routed expert in float64 and a per-element bound for the tolerance (the fp32
    activation's own error widens it)."""
    w1, w3, w2 = (mxfp4_64(c, s) for c, s in ((e.w1, e.s1), (e.w3, e.s3), (e.w2, e.s2)))
    x64 = x.astype(np.float64)
    g, u = np.minimum(w1 @ x64, limit), np.clip(w3 @ x64, -limit, limit)
    a = g / (1.0 + np.exp(-g)) * u * weight
    da = (np.abs(w1) @ np.abs(x64) + np.abs(w3) @ np.abs(x64)) * (abs(weight) * limit + 1.0)
    return w2 @ a, np.abs(w2) @ (np.abs(a) + 1e-2 * da)


ROUTINGS = {  # tokens per expert, out of 40 tokens
    "one-each": [[3], [0], [39]],
    "mixed": [[0, 2, 3, 8], [5], [], list(range(40)), [7, 7, 1]],  # an idle expert, a repeated token
    "many": [list(range(0, 40, 2)) + list(range(1, 40, 2)), list(range(39, -1, -1))],
}


@BACKEND
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_experts_forward_tokens(backend, routing):
    """Each output row = experts_forward_each for that (expert, token, weight) bit for bit, at 1,
    2 and 3 threads, and within tolerance of float64."""
    hidden, inter, limit, ntok = 256, 128, 7.0, 40
    rng = np.random.default_rng(len(routing))
    tokens = ROUTINGS[routing]
    experts = [rand_expert(rng, hidden, inter) for _ in tokens]
    weights = [rng.uniform(0.05, 0.5, len(t)).astype(np.float32) for t in tokens]
    x = (rng.standard_normal((ntok, hidden)) * 0.05).astype(np.float32)
    pairs = [(e, i) for e, t in enumerate(tokens) for i in range(len(t))]
    K.set_backend(backend)
    K.set_threads(1)
    one = K.experts_scratch(1, hidden, inter)
    single = np.stack([K.experts_forward_each([experts[e]], [weights[e][i]], x[tokens[e][i]], limit,
                                              np.empty((1, hidden), np.float32), one)[0] for e, i in pairs])
    for p, (e, i) in enumerate(pairs):
        ref, bound = ref_expert(experts[e], float(weights[e][i]), x[tokens[e][i]], limit)
        assert np.all(np.abs(single[p] - ref) <= 1e-5 * bound), (e, i)
    scratch = K.experts_tokens_scratch(len(pairs), hidden, inter)
    for threads in THREADS:
        K.set_threads(threads)
        out = np.full((len(pairs), hidden), np.nan, np.float32)
        got = K.experts_forward_tokens(experts, tokens, weights, x, limit, out=out, scratch=scratch)
        assert got is out
        np.testing.assert_array_equal(bits(got), bits(single), err_msg=f"{threads} threads")
    # token lists as any integer arrays, weights as lists; no out/scratch given
    got = K.experts_forward_tokens(experts, [np.array(t, np.int64) for t in tokens], [list(w) for w in weights],
                                   x, limit)
    np.testing.assert_array_equal(bits(got), bits(single))


@BACKEND
def test_experts_forward_tokens_real_shape(backend):
    """The real geometry (hidden 4096, inter 2048): 2 experts on 33 and 5 tokens, on 2 threads."""
    hidden, inter, limit = 4096, 2048, 10.0
    rng = np.random.default_rng(8)
    experts = [rand_expert(rng, hidden, inter) for _ in range(2)]
    tokens = [list(range(33)), [30, 4, 17, 0, 9]]
    weights = [rng.uniform(0.05, 0.3, len(t)).astype(np.float32) for t in tokens]
    x = (rng.standard_normal((33, hidden)) * 0.02).astype(np.float32)
    K.set_backend(backend)
    K.set_threads(2)
    got = K.experts_forward_tokens(experts, tokens, weights, x, limit)
    one = K.experts_scratch(1, hidden, inter)
    p = 0
    for e, toks in enumerate(tokens):
        for i, t in enumerate(toks):
            each = K.experts_forward_each([experts[e]], [weights[e][i]], x[t], limit, np.empty((1, hidden), np.float32), one)
            np.testing.assert_array_equal(bits(got[p]), bits(each[0]), err_msg=f"expert {e}, token {t}")
            p += 1
    ref, bound = ref_expert(experts[1], float(weights[1][2]), x[17], limit)
    assert np.all(np.abs(got[33 + 2] - ref) <= 1e-5 * bound)


def test_experts_forward_tokens_bad_input_names_the_argument():
    rng = np.random.default_rng(2)
    hidden, inter = 64, 32
    ex = [rand_expert(rng, hidden, inter)]
    x = np.zeros((4, hidden), np.float32)
    w = [np.array([0.5, 0.5], np.float32)]
    bad = [
        (lambda: K.experts_forward_tokens([], [], [], x, 1.0), "experts"),
        (lambda: K.experts_forward_tokens(ex, [[0, 1]], [], x, 1.0), "tokens, weights"),
        (lambda: K.experts_forward_tokens(ex, [[0, 4]], w, x, 1.0), r"tokens\[0\]"),
        (lambda: K.experts_forward_tokens(ex, [[-1, 0]], w, x, 1.0), r"tokens\[0\]"),
        (lambda: K.experts_forward_tokens(ex, [[0.5, 1.0]], w, x, 1.0), r"tokens\[0\]"),
        (lambda: K.experts_forward_tokens(ex, [[0, 1]], [[0.5]], x, 1.0), r"weights\[0\]"),
        (lambda: K.experts_forward_tokens(ex, [[0, 1]], [["a", "b"]], x, 1.0), r"weights\[0\]"),
        (lambda: K.experts_forward_tokens(ex, [[0, 1]], w, x[0], 1.0), "x"),
        (lambda: K.experts_forward_tokens(ex, [[0, 1]], w, x[:, :48], 1.0), "hidden"),
        (lambda: K.experts_forward_tokens([ex[0]._replace(w2=ex[0].w2[:, :8])], [[0, 1]], w, x, 1.0),
         r"experts\[0\]\.w2"),
        (lambda: K.experts_forward_tokens(ex, [[0, 1]], w, x, 1.0, out=np.empty((3, hidden), np.float32)), "out"),
        (lambda: K.experts_forward_tokens(ex, [[0, 1]], w, x, 1.0, scratch=np.empty(8, np.float32)), "scratch"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=rf"^{name}"):
            call()


# ---- GIL ---------------------------------------------------------------------------------------


def test_gil_released_during_matmul():
    """While one thread is inside a long batched call, Python keeps running in another (it reads
    the pool's task count part way through the call)."""
    K.set_backend("scalar")
    K.set_threads(2)
    rng = np.random.default_rng(3)
    codes, scales = rand_mxfp4(rng, 256, 4096)
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    seen, tasks = progress_seen_during(K.mxfp4_matmul, codes, scales, x)
    assert tasks >= 4 and seen >= 1, (seen, tasks)


def test_alone_keeps_a_threads_calls_on_it_with_the_same_bits():
    """kernels.alone(): this thread's calls do all their work on it (the pool's workers run none of
    their tasks), give the pool's bits, and the setting is this thread's only, restored on exit."""
    import threading

    K.set_backend(K.best_backend())
    K.set_threads(2)
    rng = np.random.default_rng(11)
    codes, scales = rand_mxfp4(rng, 2048, 4096)
    w8, s8 = rand_fp8(rng, 1024, 4096)
    x = rng.standard_normal((24, 4096)).astype(np.float32)
    pooled = (K.mxfp4_matmul(codes, scales, x), K.fp8_matmul(w8, s8, x))
    seen = {}
    with K.alone():
        assert K.lib.ds4f_get_alone() == 1
        other = threading.Thread(target=lambda: seen.setdefault("other", K.lib.ds4f_get_alone()))
        other.start()
        other.join()
        done0, workers0 = K.lib.ds4f_tasks_done(), K.lib.ds4f_worker_tasks_done()
        for _ in range(3):
            alone = (K.mxfp4_matmul(codes, scales, x), K.fp8_matmul(w8, s8, x))
        done, workers = K.lib.ds4f_tasks_done() - done0, K.lib.ds4f_worker_tasks_done() - workers0
    assert K.lib.ds4f_get_alone() == 0 and seen["other"] == 0
    for a, b in zip(alone, pooled):
        np.testing.assert_array_equal(bits(a), bits(b))
    assert done >= 6 and workers == 0, (done, workers)   # every task of the 6 calls ran on this thread
    # and without alone() the pool's workers do take tasks of the same calls (else the count above proves nothing)
    workers0 = K.lib.ds4f_worker_tasks_done()
    for _ in range(20):
        K.mxfp4_matmul(codes, scales, x)
        if K.lib.ds4f_worker_tasks_done() > workers0:
            break
    assert K.lib.ds4f_worker_tasks_done() > workers0


# ---- the bench's multi case (structure only: no figure is asserted) ---------------------------------


def test_bench_multi_records(monkeypatch):
    from ds4f.bench import kernels as B

    monkeypatch.setattr(B, "MULTI_CASES", (("mxfp4", 64, 256), ("bf16", 32, 128), ("fp8", 16, 300)))
    backends = K.available_backends()
    records = B.run_bench(repeat=1, backends=backends, threads=[1, 2], kernels=("multi",), cases="hot")
    assert {(r.shape, r.tokens, r.backend, r.threads) for r in records} == {
        (f"{f} {rows}x{k}", n, b, nt) for f, rows, k in B.MULTI_CASES for n in B.MULTI_TOKENS
        for b in backends for nt in (1, 2)}
    sizes = {f"{f} {rows}x{k}": rows * k for f, rows, k in B.MULTI_CASES}
    for r in records:
        assert r.kernel == "multi" and not r.cold
        assert r.gweights_per_s == pytest.approx(sizes[r.shape] * r.tokens / r.median_s / 1e9)
        assert r.vs_single == pytest.approx(r.gweights_per_s / r.single_gweights_per_s)
        assert r.to_dict()["tokens"] == r.tokens
    assert B.run_bench(repeat=1, backends=["scalar"], threads=[1], kernels=("multi",), cases="cold") == []
