"""FP8 E4M3 kernels with 128x128 E8M0 tile scales (kernels.fp8_decode / fp8_matvec) on every
backend this CPU supports, against references that never use the code under test: ml_dtypes'
float8_e4m3fn decode, E8M0 values computed here, float64 numpy matvecs, and (for the scalar
reference's bit identity) the scalar bf16 matvec of the matrix widened by formats.dequantize_fp8."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ds4f.native import kernels as K

from kernel_params import backend_marks, bits, kernel_settings_restored, unaligned
from ds4f.engine.checkpoint import formats

TILE = 128
QNAN = 0x7FC00000


BACKEND, SIMD = backend_marks()
restore_kernel_settings = kernel_settings_restored()


# ---- independent references ----------------------------------------------------------------


def tiles(rows: int, k: int) -> tuple[int, int]:
    return -(-rows // TILE), -(-k // TILE)


def e8m0_values(scales: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float64 2^(b-127), NaN for 255 (computed here, not with ml_dtypes)."""
    b = scales.view(np.uint8).astype(np.float64)
    return np.where(b == 255, np.nan, np.exp2(b - 127))


def ref_decode64(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 values: ml_dtypes' E4M3 decode times the tile's E8M0 value (exact in float64)."""
    rows, k = w.shape
    vals = w.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sc = np.repeat(np.repeat(e8m0_values(scales), TILE, axis=0)[:rows], TILE, axis=1)[:, :k]
    return vals * sc


def ref_decode32(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 every backend must produce: the exact product rounded once (it is exact, or
    overflows to +-inf)."""
    with np.errstate(over="ignore"):
        return ref_decode64(w, scales).astype(np.float32)


def ref_matvec(w64: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    return w64 @ x64, np.abs(w64) @ np.abs(x64)


def rand_fp8(rng, rows: int, k: int, lo: int = 110, hi: int = 136):
    """Random codes without the NaN codes 0x7F / 0xFF, random scale bytes lo..hi-1."""
    w = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] ^= 1  # 0x7F -> 0x7E, 0xFF -> 0xFE
    return w, rng.integers(lo, hi, tiles(rows, k), dtype=np.uint8)



# ---- decode --------------------------------------------------------------------------------

SCALE_BYTES = (127, 0, 1, 100, 200, 254, 255)


@BACKEND
def test_decode_every_code_with_edge_scales(backend):
    """All 256 codes under scale bytes 127, 0, 1, 100, 200, 254 and 255, bit for bit against
    ml_dtypes x 2^(b-127): +-0, subnormal codes, subnormal products (scale 0, 1), overflow to
    inf (254), NaN for the codes 0x7F / 0xFF and for scale 255.  Two tile rows (130 rows), each
    column tile with its own scale, every code in every column position mod 256."""
    K.set_backend(backend)
    rows, k = 130, 256 * len(SCALE_BYTES)
    w = (np.arange(k)[None, :] + np.arange(rows)[:, None]).astype(np.uint8)
    pairs = np.repeat(np.array(SCALE_BYTES, np.uint8), 2)  # a code row of 256 spans two tiles
    scales = np.stack([pairs, pairs[::-1]])
    got = K.fp8_decode(w, scales)
    ref = ref_decode32(w, scales)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(bits(got)[~nan], bits(ref)[~nan])
    assert np.all(bits(got)[nan] == QNAN)  # one NaN bit pattern on every backend
    # the cases spelled out (row 0, tile t has scale byte pairs[t]; column j holds code j % 256)
    col = {b: 256 * i for i, b in enumerate(SCALE_BYTES)}  # first column of each scale's codes
    assert bits(got)[0, col[127] + 0x80] == 0x80000000  # code 0x80 is -0.0
    assert got[0, col[127] + 0x01] == 2.0**-9  # smallest subnormal code
    assert got[0, col[0] + 0x01] == 2.0**-136  # ... times 2^-127: a subnormal float32, not flushed
    assert got[0, col[127] + 0x7E] == 448.0 and got[0, col[127] + 0xFE] == -448.0
    assert np.isinf(got[0, col[254] + 0x7E]) and got[0, col[254] + 0x08] == 2.0**121
    assert np.isnan(got[0, col[127] + 0x7F]) and np.isnan(got[0, col[127] + 0xFF])
    assert np.isnan(got[0, col[255] : col[255] + 256]).all() and np.isnan(got[128, :256]).all()


@SIMD
@pytest.mark.parametrize("rows,k", [(1, 1), (3, 15), (17, 63), (5, 200), (130, 129), (33, 1000), (2, 8300)])
def test_simd_decode_bit_identical_to_scalar(backend, rows, k):
    """Random codes (NaN codes included) and every scale byte, ragged shapes, unaligned buffers."""
    rng = np.random.default_rng(rows * 7919 + k)
    w = unaligned(rng.integers(0, 256, (rows, k), dtype=np.uint8), 3)
    scales = unaligned(rng.integers(0, 256, tiles(rows, k), dtype=np.uint8), 1)
    K.set_backend("scalar")
    ref = K.fp8_decode(w, scales)
    K.set_backend(backend)
    out = unaligned(np.zeros((rows, k), np.float32), 4)
    got = K.fp8_decode(w, scales, out=out)
    assert got is out
    np.testing.assert_array_equal(bits(got), bits(ref))


# ---- matvec --------------------------------------------------------------------------------

MATVEC_SHAPES = [(1, 1), (1, 130), (3, 64), (17, 63), (127, 129), (128, 128), (129, 257), (300, 1000),
                 (9, 8193), (1024, 4096)]  # fmt: skip


@BACKEND
@pytest.mark.parametrize("rows,k", MATVEC_SHAPES, ids=[f"{r}x{k}" for r, k in MATVEC_SHAPES])
def test_fp8_matvec(backend, rows, k):
    """Within 1e-5 * sum |w*x| of float64; threads 1 and 2 (and repeats) give identical bits."""
    rng = np.random.default_rng(rows * 31 + k)
    w, scales = rand_fp8(rng, rows, k)
    x = rng.standard_normal(k).astype(np.float32)
    ref, bound = ref_matvec(ref_decode64(w, scales), x)
    K.set_backend(backend)
    results = []
    for threads in (1, 2):
        K.set_threads(threads)
        for offset in (0, 1):
            results.append(K.fp8_matvec(unaligned(w, offset), scales, unaligned(x, 4 * offset)))
    y = results[0]
    assert np.all(np.abs(y - ref) <= 1e-5 * bound), np.max(np.abs(y - ref) / bound)
    for other in results[1:]:
        np.testing.assert_array_equal(bits(other), bits(y))


@BACKEND
def test_fp8_matvec_extreme_scale_bytes(backend):
    """Scale bytes from 0 (a subnormal 2^-127) to 254, 247..254 included (where SIMD backends
    cannot fold their 2^8 into the tile factor): still within tolerance.  Codes are kept below
    2 (exponent <= 7) so that no decoded value overflows float32 (the scalar reference would
    rightly give inf there)."""
    rows, k = 260, 1300
    rng = np.random.default_rng(11)
    w = rng.integers(0, 256, (rows, k), dtype=np.uint8) & 0xBF
    scales = rng.choice(np.array([0, 1, 2, 60, 127, 200, 246, 247, 250, 254], np.uint8), tiles(rows, k))
    x = (rng.standard_normal(k) * 2.0**-20).astype(np.float32)
    ref, bound = ref_matvec(ref_decode64(w, scales), x)
    assert np.isfinite(ref).all()
    K.set_backend(backend)
    y = K.fp8_matvec(w, scales, x)
    assert np.all(np.abs(y - ref) <= 1e-5 * bound), np.max(np.abs(y - ref) / bound)


@BACKEND
def test_nan_code_or_scale_makes_the_row_nan(backend):
    """A NaN code (0x7F or 0xFF, even where x is 0, in the k tail or the first column) or a 255
    scale makes exactly the rows it touches NaN; every other row stays finite."""
    rows, k = 300, 1000
    rng = np.random.default_rng(3)
    w, scales = rand_fp8(rng, rows, k)
    x = rng.standard_normal(k).astype(np.float32)
    w[5, 999] = 0x7F  # the last element (k tail of every SIMD width)
    w[140, 0] = 0xFF
    w[141, 500] = 0x7F
    x[500] = 0.0  # NaN * 0 is still NaN
    w[200, 960:] = 0xFF  # a whole tail run
    scales[2, 3] = 255  # tile row 2 = rows 256..299
    want_nan = np.zeros(rows, bool)
    want_nan[[5, 140, 141, 200]] = True
    want_nan[256:] = True
    K.set_backend(backend)
    for threads in (1, 2):
        K.set_threads(threads)
        y = K.fp8_matvec(w, scales, x)
        np.testing.assert_array_equal(np.isnan(y), want_nan)
        assert np.isfinite(y[~want_nan]).all()


@pytest.mark.parametrize("rows,k", [(1, 32), (129, 288), (300, 1024), (64, 4096)])
def test_scalar_fp8_matvec_equals_scalar_bf16_on_the_widened_matrix(rows, k):
    """The scalar FP8 matvec is the scalar bf16 matvec of the exactly widened matrix, bit for bit
    (same values, one accumulator, element order, no FMA); its decode is the widening itself."""
    rng = np.random.default_rng(rows + k)
    w, scales = rand_fp8(rng, rows, k)
    x = rng.standard_normal(k).astype(np.float32)
    widened = formats.dequantize_fp8(w, scales)  # bf16, exactness checked by formats
    K.set_backend("scalar")
    np.testing.assert_array_equal(bits(K.fp8_decode(w, scales)), bits(widened.astype(np.float32)))
    np.testing.assert_array_equal(bits(K.fp8_matvec(w, scales, x)), bits(K.bf16_matvec(widened, x)))


@BACKEND
def test_quantized_weights_round_trip(backend):
    """Weights quantized by formats.quantize_fp8 (real tile scales 2^ceil(log2(amax/448))) as
    ml_dtypes arrays: the matvec tracks float64 and the decode is formats' widening."""
    rng = np.random.default_rng(8)
    w32 = (rng.standard_normal((200, 300)) * 0.02).astype(np.float32)
    q, s = formats.quantize_fp8(w32)
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and s.dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
    x = rng.standard_normal(300).astype(np.float32)
    K.set_backend(backend)
    np.testing.assert_array_equal(K.fp8_decode(q, s), formats.dequantize_fp8(q, s).astype(np.float32))
    ref, bound = ref_matvec(ref_decode64(q.view(np.uint8), s.view(np.uint8)), x)
    y = K.fp8_matvec(q, s, x)
    assert np.all(np.abs(y - ref) <= 1e-5 * bound)
    np.testing.assert_array_equal(bits(y), bits(K.fp8_matvec(q.view(np.uint8), s.view(np.uint8), x)))


def test_outputs_filled_in_place_and_inputs_used_as_views():
    rng = np.random.default_rng(5)
    w, scales = rand_fp8(rng, 64, 200)
    x = rng.standard_normal(200).astype(np.float32)
    big = np.full(100, -1.0, np.float32)
    got = K.fp8_matvec(w, scales, x, out=big[10:74])
    assert got.base is big and np.all(big[:10] == -1) and np.all(big[74:] == -1)
    np.testing.assert_array_equal(got, K.fp8_matvec(w, scales, x))
    slab = np.zeros((70, 200), np.uint8)  # a weight living in a larger buffer (rows 3..66)
    slab[3:67] = w
    np.testing.assert_array_equal(K.fp8_matvec(slab[3:67], scales, x), got)
    dec = np.empty((64, 200), np.float32)
    assert K.fp8_decode(w, scales, out=dec) is dec


def test_zero_rows():
    w = np.zeros((0, 300), np.uint8)
    s = np.zeros((0, 3), np.uint8)
    assert K.fp8_matvec(w, s, np.zeros(300, np.float32)).shape == (0,)
    assert K.fp8_decode(w, s).shape == (0, 300)


# ---- bad input ------------------------------------------------------------------------------


def test_bad_input_raises_naming_the_argument():
    rng = np.random.default_rng(0)
    w, s = rand_fp8(rng, 130, 200)  # tiles (2, 2)
    x = np.zeros(200, np.float32)
    ro = np.empty(130, np.float32)
    ro.flags.writeable = False
    bad = [
        (lambda: K.fp8_matvec(w.astype(np.int8), s, x), "w"),
        (lambda: K.fp8_matvec(w.astype(np.float32), s, x), "w"),
        (lambda: K.fp8_matvec(w.ravel(), s, x[:1]), "w"),
        (lambda: K.fp8_matvec(w.tolist(), s, x), "w"),
        (lambda: K.fp8_matvec(np.zeros((4, 0), np.uint8), np.zeros((1, 0), np.uint8), x[:0]), "w"),
        (lambda: K.fp8_matvec(np.zeros((130, 400), np.uint8)[:, ::2], s, x), "w"),
        (lambda: K.fp8_matvec(np.asfortranarray(w), s, x), "w"),
        (lambda: K.fp8_matvec(w, s[:1], x), "scales"),  # one tile row short
        (lambda: K.fp8_matvec(w, np.zeros((130, 200), np.uint8), x), "scales"),  # per element, not per tile
        (lambda: K.fp8_matvec(w, np.zeros((2, 7), np.uint8), x), "scales"),  # 32-wide blocks (MXFP4's)
        (lambda: K.fp8_matvec(w, s.astype(np.float32), x), "scales"),
        (lambda: K.fp8_matvec(w, s.tolist(), x), "scales"),
        (lambda: K.fp8_matvec(w, np.zeros((2, 4), np.uint8)[:, ::2], x), "scales"),
        (lambda: K.fp8_matvec(w, s, x[:128]), "x"),
        (lambda: K.fp8_matvec(w, s, x.astype(np.float64)), "x"),
        (lambda: K.fp8_matvec(w, s, np.zeros(400, np.float32)[::2]), "x"),
        (lambda: K.fp8_matvec(w, s, x, out=np.empty(129, np.float32)), "out"),
        (lambda: K.fp8_matvec(w, s, x, out=np.empty(130, np.float64)), "out"),
        (lambda: K.fp8_matvec(w, s, x, out=np.empty(260, np.float32)[::2]), "out"),
        (lambda: K.fp8_matvec(w, s, x, out=ro), "out"),
        (lambda: K.fp8_decode(w.astype(np.uint16), s), "w"),
        (lambda: K.fp8_decode(w, s[:, :1]), "scales"),
        (lambda: K.fp8_decode(w, s, out=np.empty((130, 199), np.float32)), "out"),
        (lambda: K.fp8_decode(w, s, out=np.empty((130, 400), np.float32)[:, ::2]), "out"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            call()
