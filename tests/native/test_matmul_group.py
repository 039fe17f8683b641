"""kernels.matmul_group: several prepared matrices of mixed formats on the same vectors in one
native call, on every backend this CPU supports. Each matrix's block of an output row must equal
that matrix's own single-vector kernel on its slice of the input row, bit for bit, at every token
count and thread count (a group never changes a state dump), and be close to an independent
float64 numpy product of the weights decoded with ml_dtypes."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ds4f.native import kernels as K

from kernel_params import backend_marks, kernel_settings_restored
from test_multitoken_kernels import TOKENS, THREADS, check_close, fp8_64, mxfp4_64, rand_fp8, rand_mxfp4

BACKEND, _ = backend_marks()
restore_kernel_settings = kernel_settings_restored()


def weights(rng):
    """[(prepared, float64 weights, single-vector product)] of each format, widths that differ."""
    c, s = rand_mxfp4(rng, 96, 256)
    f, fs = rand_fp8(rng, 200, 300)                       # k and rows not multiples of the 128 tile
    b = rng.standard_normal((80, 256)).astype(ml_dtypes.bfloat16)
    f2, f2s = rand_fp8(rng, 256, 256)
    return [
        (K.prepare_mxfp4(c, s), mxfp4_64(c, s), lambda v: K.mxfp4_matvec(c, s, v)),
        (K.prepare_fp8(f, fs), fp8_64(f, fs), lambda v: K.fp8_matvec(f, fs, v)),
        (K.prepare_bf16(b), b.astype(np.float64), lambda v: K.bf16_matvec(b, v)),
        (K.prepare_fp8(f2, f2s), fp8_64(f2, f2s), lambda v: K.fp8_matvec(f2, f2s, v)),
    ]


def assert_group_exact(y, x, placed, threads):
    """Each matrix's block of every row of y: its single-vector product bit for bit, and close to
    float64."""
    for (m, w64, matvec), x_col, y_col in placed:
        xs = np.ascontiguousarray(x[:, x_col:x_col + m.k])
        got = y[:, y_col:y_col + m.rows]
        K.set_threads(1)
        single = np.stack([matvec(v) for v in xs])
        K.set_threads(threads)
        assert np.array_equal(got.view(np.uint32), single.view(np.uint32))
        check_close(got, w64, xs)


@BACKEND
def test_side_by_side_and_block_diagonal_equal_each_matrix_alone(backend):
    """Matrices on one input with their outputs side by side, and matrices each on its own slice of
    the input (a grouped projection), with columns of out no matrix writes left alone."""
    K.set_backend(backend)
    rng = np.random.default_rng(7)
    ws = weights(rng)
    shared = [(ws[0], 0, 0), (ws[2], 0, 96), (ws[3], 0, 176)]              # all read x[:, 0:256]
    sliced = [(ws[0], 0, 0), (ws[1], 256, 96), (ws[2], 556, 300)]           # each its own slice
    for placed, ldx, ldy in ((shared, 256, 440), (sliced, 812, 400)):
        g = K.MatmulGroup([(w[0], xc, yc) for w, xc, yc in placed], ldx, ldy)
        for n in TOKENS:
            x = rng.standard_normal((n, ldx)).astype(np.float32)
            for threads in THREADS:
                K.set_threads(threads)
                y = np.full((n, ldy), 5.0, np.float32)
                assert K.matmul_group(g, x, y) is y
                assert_group_exact(y, x, placed, threads)
                written = np.zeros(ldy, bool)
                for (m, _, _), _, yc in placed:
                    written[yc:yc + m.rows] = True
                assert (y[:, ~written] == 5.0).all()


def test_bad_groups_and_calls_raise_named_errors():
    rng = np.random.default_rng(1)
    m = weights(rng)[0][0]                       # 96 rows, k 256
    with pytest.raises(ValueError, match="outside"):
        K.MatmulGroup([(m, 10, 0)], 256, 96)     # x slice past the row
    with pytest.raises(ValueError, match="outside"):
        K.MatmulGroup([(m, 0, 1)], 256, 96)      # out slice past the row
    with pytest.raises(ValueError, match="overlap"):
        K.MatmulGroup([(m, 0, 0), (m, 0, 50)], 256, 200)
    with pytest.raises(ValueError, match="1 to"):
        K.MatmulGroup([], 256, 96)
    g = K.MatmulGroup([(m, 0, 0)], 256, 96)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="x"):
        K.matmul_group(g, x[:, :128])
    with pytest.raises(ValueError, match="out"):
        K.matmul_group(g, x, np.empty((3, 95), np.float32))
    with pytest.raises(ValueError, match="scratch"):
        K.matmul_group(g, x, None, np.empty(4, np.float32))
    assert K.matmul_group(g, x).shape == (3, 96)
