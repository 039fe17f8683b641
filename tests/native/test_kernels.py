"""Native kernels: every backend this CPU supports, plus scalar, against references that do
not use the code under test (ml_dtypes decode, float64 numpy matvec and expert math)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

from ds4f.native import kernels as K

from kernel_params import backend_marks, bits, kernel_settings_restored, progress_seen_during, unaligned

AVAILABLE = K.available_backends()


BACKEND, SIMD = backend_marks()
restore_kernel_settings = kernel_settings_restored()


# ---- independent references ----------------------------------------------------------------


def ref_decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """ml_dtypes: float4_e2m1fn x float8_e8m0fnu, product in float32 (exact or inf/NaN)."""
    rows, half = codes.shape
    nib = np.empty((rows, 2 * half), np.uint8)
    nib[:, 0::2] = codes & 15
    nib[:, 1::2] = codes >> 4
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    sc = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    with np.errstate(over="ignore"):  # scale bytes 253, 254: overflow to inf is the point
        return vals * np.repeat(sc, 32, axis=1)


def ref_matvec(w64: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 W.x and the per-row bound sum |w*x| that scales the tolerance."""
    x64 = x.astype(np.float64)
    return w64 @ x64, np.abs(w64) @ np.abs(x64)


def rand_mxfp4(rng, rows: int, k: int, lo: int = 118, hi: int = 130):
    codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.integers(lo, hi, (rows, k // 32), dtype=np.uint8)
    return codes, scales



# ---- backend and thread settings -------------------------------------------------------------


def test_backend_settings():
    assert "scalar" in AVAILABLE
    assert K.best_backend() in AVAILABLE
    assert K.set_backend("auto") == K.best_backend() == K.get_backend()
    for name in AVAILABLE:
        assert K.set_backend(name) == name == K.get_backend()
    with pytest.raises(ValueError, match="'sse9'"):
        K.set_backend("sse9")
    for name in set(K.BACKENDS) - set(AVAILABLE):
        with pytest.raises(ValueError, match=repr(name)):
            K.set_backend(name)
    K.set_threads(3)
    assert K.get_threads() == 3
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="threads"):
            K.set_threads(bad)


# ---- decode --------------------------------------------------------------------------------


@BACKEND
def test_decode_every_code_and_scale_pair(backend):
    """All 256 code bytes (both nibbles) x all 256 scale bytes, bit for bit against ml_dtypes:
    -0.0, subnormal blocks (scale 0, 1, 2), overflow to inf (253, 254) and NaN blocks (255)."""
    K.set_backend(backend)
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))  # row r: every byte, scale byte r
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    got = K.mxfp4_decode(codes, scales)
    ref = ref_decode(codes, scales)
    np.testing.assert_array_equal(bits(got), bits(ref))
    # the edge cases the bit comparison covers, spelled out
    assert bits(got)[127, 16] == 0x80000000  # byte 8, low nibble = code 8 = -0.0
    assert 0 < got[0, 2] < np.finfo(np.float32).tiny  # 0.5 x 2^-127 is subnormal, not flushed
    assert np.isinf(got[254, 14]) and np.isinf(got[253, 14])  # 6 x 2^127, 6 x 2^126
    assert np.isnan(got[255]).all()


@SIMD
@pytest.mark.parametrize("rows", [1, 3, 17, 33])
@pytest.mark.parametrize("k", [32, 64, 96, 4096])
def test_simd_decode_bit_identical_to_scalar(backend, rows, k):
    rng = np.random.default_rng(rows * 10007 + k)
    codes, scales = rand_mxfp4(rng, rows, k, lo=0, hi=256)  # includes subnormal/inf/NaN blocks
    codes, scales = unaligned(codes, 1), unaligned(scales, 3)
    K.set_backend("scalar")
    ref = K.mxfp4_decode(codes, scales)
    K.set_backend(backend)
    out = unaligned(np.zeros((rows, k), np.float32), 4)
    got = K.mxfp4_decode(codes, scales, out=out)
    assert got is out
    np.testing.assert_array_equal(bits(got), bits(ref))


# ---- matvecs --------------------------------------------------------------------------------

MATVEC_SHAPES = [(1, 32), (7, 96), (37, 64), (130, 4096), (301, 512)]


@BACKEND
@pytest.mark.parametrize("rows,k", MATVEC_SHAPES)
def test_mxfp4_matvec(backend, rows, k):
    rng = np.random.default_rng(rows + k)
    codes, scales = rand_mxfp4(rng, rows, k)
    x = rng.standard_normal(k).astype(np.float32)
    ref, bound = ref_matvec(ref_decode(codes, scales).astype(np.float64), x)
    K.set_backend(backend)
    results = []
    for threads in (1, 2, 3):
        K.set_threads(threads)
        for _ in range(2):
            results.append(K.mxfp4_matvec(unaligned(codes, 1), scales, unaligned(x, 4)))
    y = results[0]
    assert np.all(np.abs(y - ref) <= 1e-5 * bound), np.max(np.abs(y - ref) / bound)
    for other in results[1:]:  # identical bits across repeats and thread counts
        np.testing.assert_array_equal(bits(other), bits(y))


@BACKEND
def test_mxfp4_matvec_rows_whatever_their_neighbours_scales(backend):
    """A SIMD kernel computes rows in groups of 4 and a tail one at a time: a large scale byte
    (233..235: weights up to 6 * 2^108) in one row changes nothing in the others, and that row
    stays close to float64."""
    rng = np.random.default_rng(23)
    rows, k = 13, 256  # groups of 4 rows, and a tail computed a row at a time
    codes, scales = rand_mxfp4(rng, rows, k, lo=0, hi=140)
    x = rng.standard_normal(k).astype(np.float32)
    K.set_backend(backend)
    K.set_threads(1)
    alone = K.mxfp4_matvec(codes, scales, x)
    for big_row in range(rows):
        s2 = scales.copy()
        s2[big_row, 3] = 233 + big_row % 3  # scale byte 233, 234 or 235: weights up to 6 * 2^108
        y = K.mxfp4_matvec(codes, s2, x)
        others = np.arange(rows) != big_row
        np.testing.assert_array_equal(bits(y[others]), bits(alone[others]), err_msg=f"row {big_row}: a large scale")
        ref, bound = ref_matvec(ref_decode(codes, s2).astype(np.float64), x)
        assert np.isfinite(ref[big_row]) and abs(y[big_row] - ref[big_row]) <= 1e-5 * bound[big_row]


def test_mxfp4_matvec_out_is_filled_in_place():
    rng = np.random.default_rng(5)
    codes, scales = rand_mxfp4(rng, 64, 128)
    x = rng.standard_normal(128).astype(np.float32)
    big = np.full(100, -1.0, np.float32)
    got = K.mxfp4_matvec(codes, scales, x, out=big[10:74])
    assert got.base is big and np.all(big[:10] == -1) and np.all(big[74:] == -1)
    np.testing.assert_array_equal(got, K.mxfp4_matvec(codes, scales, x))


@BACKEND
@pytest.mark.parametrize("rows,k", MATVEC_SHAPES)
@pytest.mark.parametrize("as_bf16", [False, True], ids=["uint16", "bfloat16"])
def test_bf16_matvec(backend, rows, k, as_bf16):
    rng = np.random.default_rng(rows * 3 + k)
    w32 = rng.standard_normal((rows, k)).astype(np.float32)
    w = w32.astype(ml_dtypes.bfloat16)
    x = rng.standard_normal(k).astype(np.float32)
    ref, bound = ref_matvec(w.astype(np.float64), x)
    arg = w if as_bf16 else w.view(np.uint16)
    K.set_backend(backend)
    results = []
    for threads in (1, 2, 3):
        K.set_threads(threads)
        for _ in range(2):
            results.append(K.bf16_matvec(arg, x))
    y = results[0]
    assert np.all(np.abs(y - ref) <= 1e-5 * bound), np.max(np.abs(y - ref) / bound)
    for other in results[1:]:
        np.testing.assert_array_equal(bits(other), bits(y))


# ---- experts --------------------------------------------------------------------------------


def rand_expert(rng, hidden: int, inter: int) -> K.ExpertWeights:
    w1, s1 = rand_mxfp4(rng, inter, hidden)
    w3, s3 = rand_mxfp4(rng, inter, hidden)
    w2, s2 = rand_mxfp4(rng, hidden, inter)
    return K.ExpertWeights(w1, s1, w3, s3, w2, s2)


def ref_experts(experts, weights, x, limit):
    """float64 routed-expert math; returns y and a per-row magnitude bound for the tolerance."""
    x64 = x.astype(np.float64)
    y = np.zeros(x.shape[0])
    bound = np.zeros(x.shape[0])
    for e, wt in zip(experts, weights):
        W1, W3, W2 = (ref_decode(c, s).astype(np.float64) for c, s in ((e.w1, e.s1), (e.w3, e.s3), (e.w2, e.s2)))
        g = np.minimum(W1 @ x64, limit)
        u = np.clip(W3 @ x64, -limit, limit)
        a = g / (1.0 + np.exp(-g)) * u * wt
        y += W2 @ a
        # |a| itself carries fp32 matvec error ~1e-6 relative to its own sum |w*x|: widen by that
        da = (np.abs(W1) @ np.abs(x64) + np.abs(W3) @ np.abs(x64)) * (abs(wt) * limit + 1.0)
        bound += np.abs(W2) @ (np.abs(a) + 1e-2 * da)
    return y, bound


@BACKEND
@pytest.mark.parametrize("n", [1, 3, 6, 8])
def test_experts_forward(backend, n):
    hidden, inter, limit = 256, 128, 7.0
    rng = np.random.default_rng(n)
    experts = [rand_expert(rng, hidden, inter) for _ in range(n)]
    weights = list(rng.uniform(0.05, 0.5, n))
    x = (rng.standard_normal(hidden) * 0.05).astype(np.float32)
    ref, bound = ref_experts(experts, weights, x, limit)
    scratch = K.experts_scratch(n, hidden, inter)
    K.set_backend(backend)
    results = []
    for threads in (1, 2, 3):
        K.set_threads(threads)
        out = np.empty(hidden, np.float32)
        assert K.experts_forward(experts, weights, x, limit, out, scratch) is out
        results.append(out)
    y = results[0]
    assert np.all(np.abs(y - ref) <= 1e-5 * bound), np.max(np.abs(y - ref) / bound)
    for other in results[1:]:
        np.testing.assert_array_equal(bits(other), bits(y))


@BACKEND
@pytest.mark.parametrize("n", [1, 3, 8])
def test_experts_forward_each(backend, n):
    """experts_forward_each keeps each expert's weighted output apart: each row is within
    tolerance of that expert alone in float64, summing the rows in order 0..n-1 in float32 gives
    experts_forward's bits exactly (threads 1 and 2), and an expert's row does not depend on which
    other experts share the call."""
    hidden, inter, limit = 256, 128, 7.0
    rng = np.random.default_rng(100 + n)
    experts = [rand_expert(rng, hidden, inter) for _ in range(n)]
    weights = list(rng.uniform(0.05, 0.5, n))
    x = (rng.standard_normal(hidden) * 0.05).astype(np.float32)
    scratch = K.experts_scratch(n, hidden, inter)
    K.set_backend(backend)
    rows = None
    for threads in (1, 2):
        K.set_threads(threads)
        each = np.full((n, hidden), np.nan, np.float32)
        assert K.experts_forward_each(experts, weights, x, limit, each, scratch) is each
        total = each[0].copy()
        for e in range(1, n):
            total += each[e]  # float32, in expert order
        out = K.experts_forward(experts, weights, x, limit, np.empty(hidden, np.float32), scratch)
        np.testing.assert_array_equal(bits(total), bits(out))
        if rows is None:
            rows = each
        else:  # the thread count changes nothing
            np.testing.assert_array_equal(bits(each), bits(rows))
    for e in range(n):
        ref, bound = ref_experts([experts[e]], [weights[e]], x, limit)
        assert np.all(np.abs(rows[e] - ref) <= 1e-5 * bound), (e, np.max(np.abs(rows[e] - ref) / bound))
        alone = K.experts_forward_each([experts[e]], [weights[e]], x, limit, np.empty((1, hidden), np.float32),
                                       scratch)
        np.testing.assert_array_equal(bits(alone[0]), bits(rows[e]))


def test_experts_forward_clamps():
    """limit small enough that gate and up both clamp: checks min(gate, limit), clip(up)."""
    hidden, inter = 64, 32
    rng = np.random.default_rng(11)
    experts = [rand_expert(rng, hidden, inter) for _ in range(2)]
    x = rng.standard_normal(hidden).astype(np.float32)
    ref, bound = ref_experts(experts, [0.7, -0.2], x, 0.5)
    out = K.experts_forward(experts, [0.7, -0.2], x, 0.5, np.empty(hidden, np.float32), K.experts_scratch(2, hidden, inter))
    assert np.all(np.abs(out - ref) <= 1e-5 * bound)


@pytest.fixture(scope="module")
def real_experts():
    hidden, inter, n = 4096, 2048, 6
    rng = np.random.default_rng(6)
    experts = [rand_expert(rng, hidden, inter) for _ in range(n)]
    weights = list(rng.uniform(0.05, 0.5, n))
    x = (rng.standard_normal(hidden) * 0.02).astype(np.float32)
    return experts, weights, x, ref_experts(experts, weights, x, 10.0)


@BACKEND
def test_experts_forward_real_shape(backend, real_experts):
    """The real geometry (hidden 4096, inter 2048), 6 experts, against numpy on 2 threads."""
    experts, weights, x, (ref, bound) = real_experts
    K.set_backend(backend)
    K.set_threads(2)
    out = np.empty(4096, np.float32)
    got = K.experts_forward(experts, weights, x, 10.0, out, K.experts_scratch(6, 4096, 2048))
    assert np.all(np.abs(got - ref) <= 1e-5 * bound)


# ---- bad input ------------------------------------------------------------------------------


def test_bad_input_raises_naming_the_argument():
    rng = np.random.default_rng(0)
    codes, scales = rand_mxfp4(rng, 8, 64)
    x = np.zeros(64, np.float32)
    bad = [
        (lambda: K.mxfp4_decode(codes.astype(np.int8), scales), "codes"),
        (lambda: K.mxfp4_decode(codes[:, :24], scales), "codes"),  # k = 48
        (lambda: K.mxfp4_decode(codes.ravel(), scales), "codes"),
        (lambda: K.mxfp4_decode(codes.tolist(), scales), "codes"),
        (lambda: K.mxfp4_decode(codes, scales[:, :1]), "scales"),
        (lambda: K.mxfp4_decode(codes, scales.astype(np.float32)), "scales"),
        (lambda: K.mxfp4_decode(np.asfortranarray(codes), scales), "codes"),
        (lambda: K.mxfp4_decode(codes, scales, out=np.empty((8, 63), np.float32)), "out"),
        (lambda: K.mxfp4_decode(codes, scales, out=np.empty((8, 64), np.float64)), "out"),
        (lambda: K.mxfp4_decode(codes, scales, out=np.empty((8, 128), np.float32)[:, ::2]), "out"),
        (lambda: K.mxfp4_matvec(codes, scales, x[:32]), "x"),
        (lambda: K.mxfp4_matvec(codes, scales, x.astype(np.float64)), "x"),
        (lambda: K.mxfp4_matvec(codes, scales, np.zeros(128, np.float32)[::2]), "x"),
        (lambda: K.mxfp4_matvec(codes, scales, x, out=np.empty(7, np.float32)), "out"),
        (lambda: K.bf16_matvec(np.zeros((4, 64), np.float32), x), "w"),
        (lambda: K.bf16_matvec(np.zeros((4, 48), np.uint16), x[:48]), "w"),
        (lambda: K.bf16_matvec(np.zeros((4, 64), np.uint16), x[:32]), "x"),
    ]
    ro = np.empty(8, np.float32)
    ro.flags.writeable = False
    bad.append((lambda: K.mxfp4_matvec(codes, scales, x, out=ro), "out"))
    for call, name in bad:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            call()


def test_bad_expert_input():
    hidden, inter = 64, 32
    rng = np.random.default_rng(1)
    e = rand_expert(rng, hidden, inter)
    x = np.zeros(hidden, np.float32)
    out = np.empty(hidden, np.float32)
    scratch = K.experts_scratch(2, hidden, inter)
    cases = [
        (lambda: K.experts_forward([], [], x, 1.0, out, scratch), "experts"),
        (lambda: K.experts_forward([e] * 9, [1.0] * 9, x, 1.0, out, K.experts_scratch(8, hidden, inter)), "experts"),
        (lambda: K.experts_forward([e, e], [1.0], x, 1.0, out, scratch), "weights"),
        (lambda: K.experts_forward([e], [1.0], x, 1.0, out, scratch[:10]), "scratch"),
        (lambda: K.experts_forward([e], [1.0], x, 1.0, out, scratch.astype(np.float64)), "scratch"),
        (lambda: K.experts_forward([e], [1.0], x[:32], 1.0, out, scratch), "out"),
        (lambda: K.experts_forward([e], [1.0], x, 1.0, out[:32], scratch), "out"),
        (lambda: K.experts_forward([e._replace(w2=e.w2[:, :8])], [1.0], x, 1.0, out, scratch), r"experts\[0\]\.w2"),
        (lambda: K.experts_forward([e, e._replace(s3=e.s3.astype(np.int16))], [1, 1], x, 1.0, out, scratch), r"experts\[1\]\.s3"),
        (lambda: K.experts_forward([e], ["a"], x, 1.0, out, scratch), r"weights\[0\]"),
        (lambda: K.experts_forward([e], [1.0], x, 1.0, out, out), "scratch"),
    ]
    each = np.empty((2, hidden), np.float32)
    ro = np.empty((1, hidden), np.float32)
    ro.flags.writeable = False
    cases += [  # experts_forward_each shares the checks, with out_each [n, hidden]
        (lambda: K.experts_forward_each([e, e], [1.0, 1.0], x, 1.0, each[:1], scratch), "out_each"),
        (lambda: K.experts_forward_each([e], [1.0], x, 1.0, out, scratch), "out_each"),
        (lambda: K.experts_forward_each([e], [1.0], x, 1.0, each[:1].astype(np.float64), scratch), "out_each"),
        (lambda: K.experts_forward_each([e], [1.0], x, 1.0, np.empty((1, 2 * hidden), np.float32)[:, ::2], scratch),
         "out_each"),
        (lambda: K.experts_forward_each([e], [1.0], x, 1.0, ro, scratch), "out_each"),
        (lambda: K.experts_forward_each([e], [1.0], x, 1.0, scratch[:hidden].reshape(1, hidden), scratch), "scratch"),
        (lambda: K.experts_forward_each([e, e], [1.0], x, 1.0, each, scratch), "weights"),
        (lambda: K.experts_forward_each([e._replace(w1=e.w1[:, :8])], [1.0], x, 1.0, each[:1], scratch),
         r"experts\[0\]\.w1"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=rf"^{name}"):
            call()
    with pytest.raises(ValueError, match="hidden"):
        K.experts_scratch(1, 48, 32)


# ---- GIL ------------------------------------------------------------------------------------


def test_gil_released_during_kernels():
    """While one thread is inside a long kernel call, Python keeps running in another: it reads
    the pool's task count part way through the call (counts, not times)."""
    K.set_backend("scalar")
    K.set_threads(2)
    rng = np.random.default_rng(2)
    codes, scales = rand_mxfp4(rng, 1024, 4096)
    x = rng.standard_normal(4096).astype(np.float32)
    seen, tasks = progress_seen_during(K.mxfp4_matvec, codes, scales, x)
    assert tasks >= 4 and seen >= 1, (seen, tasks)


# ---- environment and floating-point state -------------------------------------------------------


@pytest.mark.parametrize("value", ["scalar", *AVAILABLE[1:], "auto", "bogus"])
def test_ds4f_kernels_env_selects_initial_backend(value):
    code = "import warnings; warnings.simplefilter('error')\n" if value in AVAILABLE + ["auto"] else ""
    code += "from ds4f.native import kernels as K; print(K.get_backend())"
    env = {**os.environ, "DS4F_KERNELS": value}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (value if value in AVAILABLE else K.best_backend())
    if value == "bogus":
        assert "DS4F_KERNELS='bogus'" in out.stderr


def test_kernels_leave_subnormals_alone():
    """No flush-to-zero / denormals-are-zero in the process after the kernels ran (-ffast-math
    would set MXCSR FTZ/DAZ at load time; nothing here may)."""
    for backend in AVAILABLE:
        K.set_backend(backend)
        K.mxfp4_decode(np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.uint8))
    tiny = np.float32(2.0**-140)
    assert tiny * np.float32(1.0) > 0 and np.float32(2.0**-126) / np.float32(4.0) == np.float32(2.0**-128)


def test_concurrent_callers_and_live_resizing():
    """Several Python threads share the native pool while another resizes it: every result is
    still the same bits (jobs are serialised; a resize waits for the running job)."""
    rng = np.random.default_rng(9)
    codes, scales = rand_mxfp4(rng, 512, 1024)
    x = rng.standard_normal(1024).astype(np.float32)
    K.set_backend(K.best_backend())
    K.set_threads(1)
    want = K.mxfp4_matvec(codes, scales, x)
    bad = []

    def worker():
        for _ in range(30):
            if not np.array_equal(K.mxfp4_matvec(codes, scales, x).view(np.uint32), want.view(np.uint32)):
                bad.append(1)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(60):
        K.set_threads(1 + i % 3)
    for t in threads:
        t.join()
    assert not bad


def test_bench_kernels_cli_writes_json(tmp_path, capsys):
    import json

    from ds4f.cli import main

    path = tmp_path / "bench.json"
    rc = main(["bench-kernels", "--repeat", "1", "--kernels", "matvec", "--threads", "1", "--json", str(path)])
    assert rc == 0
    records = json.loads(path.read_text())
    backends = {r["backend"] for r in records}
    assert backends == set(AVAILABLE) | {"numpy"}
    for r in records:
        assert r["kernel"] == "matvec" and r["median_s"] > 0 and r["gweights_per_s"] > 0
        assert r["backend"] == "numpy" or r["speedup_vs_scalar"] > 0
    assert "matvec" in capsys.readouterr().out
    assert main(["bench-kernels", "--kernels", "nope"]) == 2


# ---- the hyper-connections' mix --------------------------------------------------------------


def ref_hc_mix(x: np.ndarray, fn: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """math.fsum (exactly rounded sums) of the float64 terms: the mix and the bound sum |terms|."""
    import math

    out, bound = np.empty((len(x), len(fn))), np.empty((len(x), len(fn)))
    for t, xt in enumerate(x.astype(np.float64)):
        xn = xt / math.sqrt(math.fsum(xt * xt) / len(xt) + eps)
        for r, f in enumerate(fn.astype(np.float64)):
            out[t, r], bound[t, r] = math.fsum(f * xn), math.fsum(np.abs(f * xn))
    return out, bound


@BACKEND
@pytest.mark.parametrize("n, k, rows", [(1, 32, 1), (11, 1030, 7), (9, 4 * 1024, 24), (17, 96, 6),
                                        (1, 4 * 1024, 24), (1, 4 * 1024, 4), (3, 1030, 7), (2, 96, 40),
                                        (4, 4 * 1024, 24), (5, 1030, 7), (12, 96, 13)])
def test_hc_mix(backend, n, k, rows):
    """Within a few float64 roundings of the exactly rounded sums, and the same bits whatever the
    backend (the scalar reference's) and whatever else is in the batch (each token alone)."""
    rng = np.random.default_rng(n * 1000 + k)
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[0, :3] = [0.0, -0.0, 1e-40]                    # zeros and a subnormal among the streams
    fn = rng.standard_normal((rows, k)).astype(np.float32)
    eps = 1e-6
    K.set_backend("scalar")
    fn_t = np.ascontiguousarray(fn.T)
    want = K.hc_mix(x, fn_t, eps)
    ref, bound = ref_hc_mix(x, fn, eps)
    assert np.all(np.abs(want - ref) <= 4 * k * np.finfo(np.float64).eps * bound)
    K.set_backend(backend)
    assert K.hc_mix(x, fn_t, eps).tobytes() == want.tobytes()
    alone = np.concatenate([K.hc_mix(x[t:t + 1], fn_t, eps) for t in range(n)])
    assert alone.tobytes() == want.tobytes()


def test_hc_mix_bad_input_names_the_argument():
    x, fn_t = np.zeros((2, 64), np.float32), np.zeros((64, 3), np.float32)
    for call, name in [(lambda: K.hc_mix(x.astype(np.float64), fn_t, 1e-6), "x"),
                       (lambda: K.hc_mix(x[:, ::2], fn_t[:32], 1e-6), "x"),
                       (lambda: K.hc_mix(x.ravel(), fn_t, 1e-6), "x"),
                       (lambda: K.hc_mix(x[:, :0], fn_t[:0], 1e-6), "x"),
                       (lambda: K.hc_mix(x, fn_t.astype(np.float64), 1e-6), "fn_t"),
                       (lambda: K.hc_mix(x, fn_t[:32], 1e-6), "fn_t"),
                       (lambda: K.hc_mix(x, fn_t[:, :0], 1e-6), "fn_t"),
                       (lambda: K.hc_mix(x, fn_t.T, 1e-6), "fn_t")]:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            call()


def test_bench_kernels_ggml_comparison(tmp_path, capsys):
    """`--kernels ggml` needs --ggml DIR, and DIR must be a ggml CMake build; with a real one (the
    environment variable DS4F_GGML_BUILD names it) ds4f's matvec and ggml's two MXFP4 kernels run
    in turn, each checked against float64 first."""
    import json

    from ds4f.cli import main

    assert main(["bench-kernels", "--kernels", "ggml"]) == 2
    assert "--ggml DIR" in capsys.readouterr().err
    assert main(["bench-kernels", "--kernels", "ggml", "--ggml", str(tmp_path)]) == 2
    assert "no CMake build directory" in capsys.readouterr().err
    (tmp_path / "CMakeCache.txt").write_text(f"ggml_SOURCE_DIR:STATIC={tmp_path}\n")
    assert main(["bench-kernels", "--kernels", "ggml", "--ggml", str(tmp_path)]) == 2
    assert "include/ggml-cpu.h" in capsys.readouterr().err
    build = os.environ.get("DS4F_GGML_BUILD")
    if not build or "avx2" not in AVAILABLE:
        pytest.skip("no ggml build given (DS4F_GGML_BUILD) or no AVX2 here")
    path = tmp_path / "ggml.json"
    assert main(["bench-kernels", "--kernels", "ggml", "--ggml", build, "--json", str(path)]) == 0
    rounds = json.loads(path.read_text())
    assert len(rounds) == 10 and all(r["kernel"] == "ggml" and min(r["gw"].values()) > 0 for r in rounds)
    out = capsys.readouterr().out
    assert "ggml standard" in out and "ds4f: max |y - float64| / sum |w*x|" in out
    err = float(out.split("ds4f: max |y - float64| / sum |w*x| = ")[1].split()[0])
    assert err <= 1e-5
