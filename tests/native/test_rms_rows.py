"""kernels.rms_rows (native/norms.c): each row of x over sqrt(mean(row^2) + eps) in float64, rounded
to float32 once, optionally times a float32 weight. The reference is numpy's own float64 expression,
written out here; the kernel must give its bits exactly (the attention's norms, whose state dumps
are recorded), at every width, row count, thread count and backend."""
from __future__ import annotations

import numpy as np
import pytest

from ds4f.engine.model import attention
from ds4f.native import kernels as K

from kernel_params import backend_marks, bits, kernel_settings_restored

BACKEND, _ = backend_marks()
restore_kernel_settings = kernel_settings_restored()

WIDTHS = list(range(1, 301)) + [383, 511, 512, 513, 1000, 1023, 1024, 1025, 1536, 2047, 2048, 4096, 4097, 8200]


def numpy_rms(x: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    """The float64 expression: squares, numpy's sum over the row, / d, + eps, sqrt, x / that, one
    rounding to float32; then the weight in float32."""
    x64 = x.astype(np.float64)
    ms = np.add.reduce(np.square(x64), axis=-1, keepdims=True)
    ms /= x.shape[-1]
    ms += eps
    np.sqrt(ms, out=ms)
    y = np.divide(x64, ms).astype(np.float32)
    return y if weight is None else y * weight


def spread(rng, shape) -> np.ndarray:
    """float32 values over some 14 orders of magnitude, both signs: rows whose squares differ
    enough that the order of the sum shows in the last bits."""
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-16, 16, shape))).astype(np.float32)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what) -> None:
    """Equal bits; a NaN only where the reference has one (NaN payloads are not compared)."""
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, what
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), what
    assert np.array_equal(bits(got)[~nan], bits(want)[~nan]), what


def exposing_eps(row: np.ndarray) -> float:
    """An eps just above -mean(row^2) (numpy's sum): mean + eps is then exact (the two are within a
    factor 2) and some 2^-40 of the mean, so a sum of the squares one unit in its last place away
    moves the norm by about a part in 2^13, far past float32's rounding: the sum's last bits show
    in the result. (With a small eps they almost never do: a float32 rounding flips for about one
    value in 2^29.)"""
    m = np.add.reduce(np.square(row.astype(np.float64)))
    m /= len(row)
    return float(-m + m * 2.0**-40)


def test_the_row_sum_is_numpys_to_its_last_bit():
    """Rows at every width, each with the eps that shows its sum's last bits: the kernel's sum is
    numpy's pairwise one. A sum in another order (left to right, or numpy's pairwise sum of all
    but the first square added to the first) gives other bits for most of these rows."""
    rng = np.random.default_rng(3)
    other_order = 0
    for d in WIDTHS:
        for _ in range(2):
            x = spread(rng, (1, d))
            eps = exposing_eps(x[0])
            want = numpy_rms(x, eps)
            assert_same_bits(K.rms_rows(x, eps), want, d)
            sq = np.square(x[0].astype(np.float64))
            for alt in (np.cumsum(sq)[-1], sq[0] + np.add.reduce(sq[1:])):
                y = (x[0] / np.sqrt(alt / d + eps)).astype(np.float32)
                other_order += not np.array_equal(bits(y), bits(want[0]))
    assert other_order > len(WIDTHS)                # the test tells the orders apart


@pytest.mark.parametrize("n", [1, 3])
def test_the_bits_of_numpys_expression_at_every_width(n):
    rng = np.random.default_rng(n)
    for d in WIDTHS:
        x = spread(rng, (n, d))
        w = rng.standard_normal(d).astype(np.float32)
        for eps in (1e-6, 0.0, 0.5):
            assert_same_bits(K.rms_rows(x, eps), numpy_rms(x, eps), (n, d, eps))
            assert_same_bits(K.rms_rows(x, eps, w), numpy_rms(x, eps, w), (n, d, eps, "weight"))


@pytest.mark.parametrize("n, d", [(700, 512), (64, 1536), (3, 16384), (600, 64), (96 * 64, 512)])
def test_rows_over_the_threads_give_the_same_bits_at_every_thread_count(n, d):
    rng = np.random.default_rng(d + n)
    x = spread(rng, (n, d))
    w = spread(rng, (d,))
    want, want_w = numpy_rms(x, 1e-6), numpy_rms(x, 1e-6, w)
    for threads in (1, 2, 3):
        K.set_threads(threads)
        before = int(K.lib.ds4f_tasks_done())
        got = K.rms_rows(x, 1e-6)
        tasks = int(K.lib.ds4f_tasks_done()) - before
        assert_same_bits(got, want, (n, d, threads))
        assert_same_bits(K.rms_rows(x, 1e-6, w), want_w, (n, d, threads, "weight"))
        assert tasks > 1                # the rows went to the pool in parts


@BACKEND
def test_every_backend_gives_numpys_bits(backend):
    K.set_backend(backend)
    rng = np.random.default_rng(11)
    for n, d in ((1, 1024), (64, 512), (5, 1536), (9, 4096), (200, 200), (2, 77)):
        x = spread(rng, (n, d))
        w = rng.standard_normal(d).astype(np.float32)
        assert_same_bits(K.rms_rows(x, 1e-6), numpy_rms(x, 1e-6), (backend, n, d))
        assert_same_bits(K.rms_rows(x, 1e-6, w), numpy_rms(x, 1e-6, w), (backend, n, d, "weight"))


def test_rows_with_nan_inf_zeros_and_extremes():
    rng = np.random.default_rng(5)
    d = 96
    x = rng.standard_normal((10, d)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2, :] = np.inf
    x[3, 7] = -np.inf
    x[4, :] = 0.0                                              # 0 / sqrt(eps); 0 / 0 with eps = 0
    x[5, :] = -0.0
    x[6, :] = np.float32(3.0e38) * np.sign(x[6])              # squares far past float32's range
    x[7, :] = np.float32(1e-45) * np.sign(x[7])                # subnormals
    x[8, ::2] = np.float32(1e-40)
    x[9, 11] = -np.nan
    w = rng.standard_normal(d).astype(np.float32)
    w[4] = np.inf
    with np.errstate(all="ignore"):
        for eps in (1e-6, 0.0):
            want, want_w = numpy_rms(x, eps), numpy_rms(x, eps, w)
            for threads in (1, 2):
                K.set_threads(threads)
                assert_same_bits(K.rms_rows(x, eps), want, eps)
                assert_same_bits(K.rms_rows(x, eps, w), want_w, (eps, "weight"))
    assert np.isnan(want[0]).all() and not np.isnan(want[1]).all()   # the cases do what they say


def test_out_given_in_place_and_empty():
    rng = np.random.default_rng(8)
    x = spread(rng, (40, 256))
    want = numpy_rms(x, 1e-6)
    out = np.full_like(x, 7.0)
    assert K.rms_rows(x, 1e-6, out=out) is out
    assert_same_bits(out, want, "out")
    y = x.copy()
    assert K.rms_rows(y, 1e-6, out=y) is y
    assert_same_bits(y, want, "in place")
    assert K.rms_rows(np.empty((0, 64), np.float32), 1e-6).shape == (0, 64)


def test_the_attentions_rms_rows_takes_a_weight_and_column_views():
    """engine/model/attention.py's rms_rows: with weight=, the bits of the norm times the weight;
    a view of some columns of a wider array is normed as those columns."""
    rng = np.random.default_rng(9)
    wide = spread(rng, (12, 640))
    view = wide[:, 64:576]
    w = rng.standard_normal(512).astype(np.float32)
    assert_same_bits(attention.rms_rows(view, 1e-6), numpy_rms(view, 1e-6), "view")
    assert_same_bits(attention.rms_rows(view, 1e-6, weight=w), numpy_rms(view, 1e-6, w), "weight")
    w640 = rng.standard_normal(640).astype(np.float32)
    assert_same_bits(attention.weighted_rms(wide[3], w640, 1e-6), numpy_rms(wide[3:4], 1e-6, w640)[0], "weighted_rms")


def test_bad_arguments_raise_named_errors():
    x = np.ones((4, 8), np.float32)
    cases = [
        (lambda: K.rms_rows(np.ones(8, np.float32), 1e-6), "x: expected a 2-D"),
        (lambda: K.rms_rows([[1.0]], 1e-6), "x: expected a 2-D"),
        (lambda: K.rms_rows(np.ones((4, 0), np.float32), 1e-6), "x: d = 0"),
        (lambda: K.rms_rows(np.ones((4, 8)), 1e-6), "x: expected dtype float32"),
        (lambda: K.rms_rows(np.ones((4, 16), np.float32)[:, ::2], 1e-6), "x: must be C-contiguous"),
        (lambda: K.rms_rows(x, 1e-6, np.ones(7, np.float32)), r"weight: expected shape \(8,\)"),
        (lambda: K.rms_rows(x, 1e-6, np.ones(8)), "weight: expected dtype float32"),
        (lambda: K.rms_rows(x, 1e-6, out=np.empty((4, 9), np.float32)), r"out: expected shape \(4, 8\)"),
        (lambda: K.rms_rows(x, 1e-6, out=np.empty((4, 8))), "out: expected dtype float32"),
        (lambda: K.rms_rows(x, 1e-6, out=np.broadcast_to(np.float32(0), (4, 8))), "out: must be C-contiguous"),
    ]
    read_only = np.empty((4, 8), np.float32)
    read_only.flags.writeable = False
    cases.append((lambda: K.rms_rows(x, 1e-6, out=read_only), "out: output array is read-only"))
    big = np.ones(40, np.float32)
    cases.append((lambda: K.rms_rows(big[:32].reshape(4, 8), 1e-6, out=big[8:].reshape(4, 8)), "out: overlaps x"))
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert K.lib.ds4f_rms_rows(K.ffi.NULL, 1, 8, 1e-6, K.ffi.NULL, K.ffi.NULL) == -1
    assert K.lib.ds4f_rms_rows(K.ffi.NULL, 0, 8, 1e-6, K.ffi.NULL, K.ffi.NULL) == 0
