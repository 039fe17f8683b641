"""The AVX2 MXFP4 kernels sum each 32-weight block's products of the unscaled E2M1 values, then
scale the block's sum once (native/include/kernels_avx2.h).  Every kernel that runs that block
step (the single-vector matvec, the multi-token matmul, the routed experts on one token or on
several) must give the same bits for the same row and vector at every thread count, and every
result stays within 1e-5 * sum |w*x| of a float64 product of the weights decoded with ml_dtypes.
Skipped where the CPU lacks AVX2."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ds4f.native import kernels as K

from kernel_params import bits, kernel_settings_restored

pytestmark = pytest.mark.skipif("avx2" not in K.available_backends(), reason="avx2: not supported by this CPU/OS")
restore_kernel_settings = kernel_settings_restored()

THREADS = (1, 2, 3)


def mxfp4_64(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """ml_dtypes' E2M1 values times 2^(s-127) in float64 (exact; NaN for the scale byte 255)."""
    rows, half = codes.shape
    nib = np.empty((rows, 2 * half), np.uint8)
    nib[:, 0::2], nib[:, 1::2] = codes & 15, codes >> 4
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sc = np.where(scales == 255, np.nan, np.exp2(scales.astype(np.float64) - 127))
    return vals * np.repeat(sc, 32, axis=1)


def assert_close(y: np.ndarray, w64: np.ndarray, x: np.ndarray) -> None:
    """y [n, rows] within 1e-5 * sum |w*x| of float64 x . w64^T"""
    x64 = x.astype(np.float64)
    ref, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    assert np.all(np.abs(y - ref) <= 1e-5 * bound), np.max(np.abs(y - ref) / bound)


def rand_mxfp4(rng, rows, k, lo=118, hi=130):
    return rng.integers(0, 256, (rows, k // 2), dtype=np.uint8), rng.integers(lo, hi, (rows, k // 32), dtype=np.uint8)


@pytest.mark.parametrize("rows,k", [(1, 32), (5, 96), (67, 4096), (131, 512), (13, 8224)])
def test_matvec_and_matmul_agree_row_by_row(rows, k):
    """Odd row counts (4-row groups and a tail), k beyond the matvec's stack copy of x: the
    matmul's every row and vector = the matvec's, at 1, 2 and 3 threads, and close to float64."""
    rng = np.random.default_rng(rows * 31 + k)
    codes, scales = rand_mxfp4(rng, rows, k)
    xs = rng.standard_normal((33, k)).astype(np.float32)
    K.set_backend("avx2")
    K.set_threads(1)
    single = np.stack([K.mxfp4_matvec(codes, scales, v) for v in xs])
    assert_close(single, mxfp4_64(codes, scales), xs)
    for threads in THREADS:
        K.set_threads(threads)
        again = np.stack([K.mxfp4_matvec(codes, scales, v) for v in xs[:3]])
        np.testing.assert_array_equal(bits(again), bits(single[:3]), err_msg=f"matvec, {threads} threads")
        for n in (2, 3, 4, 5, 8, 33):
            got = K.mxfp4_matmul(codes, scales, xs[:n])
            np.testing.assert_array_equal(bits(got), bits(single[:n]), err_msg=f"{n} vectors, {threads} threads")


def test_experts_one_token_and_many_agree():
    """experts_forward (summed), experts_forward_each and experts_forward_tokens run gate, up
    and down through the same block step: each pair's row is the same bits by every route, at 1,
    2 and 3 threads, and the summed output is the per-expert rows summed in order."""
    hidden, inter, limit = 256, 96, 7.0
    rng = np.random.default_rng(3)
    experts = [K.ExpertWeights(*rand_mxfp4(rng, inter, hidden), *rand_mxfp4(rng, inter, hidden),
                               *rand_mxfp4(rng, hidden, inter)) for _ in range(3)]
    x = (rng.standard_normal((5, hidden)) * 0.05).astype(np.float32)
    weights = rng.uniform(0.05, 0.5, 3).astype(np.float32)
    K.set_backend("avx2")
    scratch = K.experts_scratch(3, hidden, inter)
    for threads in THREADS:
        K.set_threads(threads)
        each = np.stack([K.experts_forward_each(experts, weights, x[t], limit, np.empty((3, hidden), np.float32),
                                                scratch) for t in range(5)])  # [token, expert, hidden]
        if threads == 1:
            first = each
        np.testing.assert_array_equal(bits(each), bits(first), err_msg=f"{threads} threads")
        summed = K.experts_forward(experts, weights, x[2], limit, np.empty(hidden, np.float32), scratch)
        np.testing.assert_array_equal(bits(summed), bits((first[2, 0] + first[2, 1]) + first[2, 2]))
        tokens = [list(range(5)), [4, 1], [3]]
        got = K.experts_forward_tokens(experts, tokens, [np.full(len(t), weights[e], np.float32)
                                                         for e, t in enumerate(tokens)], x, limit)
        want = np.stack([first[t, e] for e, ts in enumerate(tokens) for t in ts])
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"tokens, {threads} threads")
    for e in range(3):  # the down projection's row against float64, from the kernel's own activation
        g = K.mxfp4_matvec(experts[e].w1, experts[e].s1, x[0])
        u = K.mxfp4_matvec(experts[e].w3, experts[e].s3, x[0])
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        a = (g / (1 + np.exp(-g.astype(np.float64))) * u * weights[e]).astype(np.float32)
        w2 = mxfp4_64(experts[e].w2, experts[e].s2)
        ref, bound = w2 @ a.astype(np.float64), np.abs(w2) @ np.abs(a.astype(np.float64))
        assert np.all(np.abs(first[0, e] - ref) <= 1e-5 * bound + 1e-6 * np.abs(ref))


def test_zero_blocks_nan_scale_and_large_scales():
    """A row of -0 codes sums to +0; a 255 scale makes its row NaN and no other; scale bytes 253
    and 254, whose decoded weights of 4 and 6 (253) or 2 and up (254) overflow fp32, give the
    finite float64 value here, as the block's sum is what gets scaled."""
    rng = np.random.default_rng(11)
    rows, k = 9, 128
    codes, scales = rand_mxfp4(rng, rows, k)
    codes[0] = 0x88
    scales[3, 2] = 255
    scales[5, 1], scales[6, :] = 253, 254
    x = (rng.standard_normal((4, k)) * 2.0**-16).astype(np.float32)
    K.set_backend("avx2")
    K.set_threads(1)
    single = np.stack([K.mxfp4_matvec(codes, scales, v) for v in x])
    assert np.all(bits(single[:, 0]) == 0)
    assert np.isnan(single[:, 3]).all() and not np.isnan(np.delete(single, 3, axis=1)).any()
    w64 = mxfp4_64(codes, scales)
    ok = np.arange(rows) != 3
    assert np.isfinite(single[:, 6]).all()
    assert_close(single[:, ok], w64[ok], x)
    np.testing.assert_array_equal(bits(K.mxfp4_matmul(codes, scales, x)), bits(single))
