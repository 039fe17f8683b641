"""The NEON backend, tested on any machine: the kernel sources (with the build's own flags) and
tests/native/neon_driver.c are cross-compiled for aarch64 and run under qemu-aarch64 on
fixtures written here.  NEON output is checked against the scalar backend of the same binary
(decode bit-identical) and, independently, against ml_dtypes / float64 numpy references:
MXFP4 and bf16, FP8 E4M3 with 128x128 E8M0 tiles, and the routed experts (experts_forward_each
against experts_forward).  The multi-token kernels (*_matmul, experts_forward_tokens) are checked
bit for bit against the same binary's single-vector kernels on each vector, per backend and
thread count, and against float64."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"
DRIVER = Path(__file__).resolve().parent / "neon_driver.c"
CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
SYSROOT = "/usr/aarch64-linux-gnu"

pytestmark = pytest.mark.skipif(
    not (CC and QEMU),
    reason="NEON cross-test needs aarch64-linux-gnu-gcc and qemu-aarch64 "
    "(apt-get install gcc-aarch64-linux-gnu qemu-user); missing: "
    + ", ".join(n for n, p in (("aarch64-linux-gnu-gcc", CC), ("qemu-aarch64", QEMU)) if not p),
)

# (rows, k): awkward row counts (not multiples of 4 or 16), and k = 32, 64, 96, 4096
CASES = [(1, 32), (3, 64), (17, 96), (33, 4096), (130, 512), (256, 512)]
ALL_PAIRS = 5  # index of the case that holds every (code byte, scale byte) pair

# FP8 (rows, k): ragged tiles and k tails of every SIMD width; the last holds every code under
# the edge scale bytes (decode) and so a NaN code in every row (matvec)
FP8_CASES = [(1, 1), (3, 17), (17, 63), (130, 129), (33, 1000), (9, 4100), (130, 1792)]
FP8_ALL = 6
FP8_EDGE_SCALES = (127, 0, 1, 100, 200, 254, 255)
FP8_NAN_ROWS = {3: [128, 129], 4: [5, 20]}  # case -> rows made NaN (a 255 scale tile, NaN codes)
TILE = 128
EXPERTS = (3, 256, 128, 7.0)  # n, hidden, inter, limit
# several vectors at once: tmax input rows per case, matmuls of the first t of them (odd counts,
# and one beyond the kernels' 32-token accumulator block)
MULTI_TMAX, MULTI_T = 33, (1, 2, 3, 7, 33)
# experts_forward_tokens: the tokens routed to each of the EXPERTS (one token alone, repeats of
# the fixture's order, all of them)
EXPERT_NTOK = 9
EXPERT_TOKENS = ([0, 2, 3, 8], [5], list(range(EXPERT_NTOK)))
HC = (11, 1030, 7, 1e-6)  # hyper-connection mix: tokens (past a vector group), k (not a multiple of 4), rows, eps


def hc_fixture():
    """The mix's inputs (x [n, k] fp32, fn_t [k, rows] fp32), the same whoever asks."""
    n, k, rows, _ = HC
    rng = np.random.default_rng(77)
    return rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((k, rows)).astype(np.float32)


def _build_config():
    spec = importlib.util.spec_from_file_location("_ds4f_build_kernels", NATIVE / "build_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SOURCES, mod.NATIVE_CFLAGS, mod.INCLUDE


def ref_decode(codes, scales):
    rows, half = codes.shape
    nib = np.empty((rows, 2 * half), np.uint8)
    nib[:, 0::2], nib[:, 1::2] = codes & 15, codes >> 4
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    sc = np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=1)
    with np.errstate(over="ignore"):
        return vals * sc


def fp8_tiles(rows, k):
    return -(-rows // TILE), -(-k // TILE)


def ref_fp8_decode64(w, scales):
    """ml_dtypes' E4M3 values times 2^(b-127) (NaN for 255), in float64 (exact)."""
    rows, k = w.shape
    b = scales.astype(np.float64)
    sc = np.where(b == 255, np.nan, np.exp2(b - 127))
    sc = np.repeat(np.repeat(sc, TILE, axis=0)[:rows], TILE, axis=1)[:, :k]
    return w.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * sc


def fp8_fixtures(rng):
    out = []
    for i, (rows, k) in enumerate(FP8_CASES):
        if i == FP8_ALL:
            w = ((np.arange(k)[None, :] + np.arange(rows)[:, None]) % 256).astype(np.uint8)
            pairs = np.repeat(np.array(FP8_EDGE_SCALES, np.uint8), 2)
            ds = np.stack([pairs, pairs[::-1]])
        else:
            w = rng.integers(0, 256, (rows, k), dtype=np.uint8)
            ds = rng.integers(0, 256, fp8_tiles(rows, k), dtype=np.uint8)  # incl. 0, 1, 254, 255
            w[(w & 0x7F) == 0x7F] ^= 1  # no NaN codes but the ones planted below
        ms = rng.integers(110, 136, fp8_tiles(rows, k), dtype=np.uint8)
        if i == 3:
            ms[1, 0] = 255  # rows 128, 129
        if i == 4:
            w[5, 999], w[20, 0] = 0x7F, 0xFF
        x = rng.standard_normal(k).astype(np.float32)
        out.append((w, ds, ms, x))
    return out


def rand_mxfp4(rng, rows, k):
    return rng.integers(0, 256, (rows, k // 2), dtype=np.uint8), rng.integers(118, 130, (rows, k // 32), dtype=np.uint8)


def ref_expert(e, weight, x, limit):
    """one routed expert in float64: y and the per-row bound sum |w2| |a| (+ slack for a's error)"""
    w1, w3, w2 = (ref_decode(c, s).astype(np.float64) for c, s in ((e[0], e[1]), (e[2], e[3]), (e[4], e[5])))
    x64 = x.astype(np.float64)
    g, u = np.minimum(w1 @ x64, limit), np.clip(w3 @ x64, -limit, limit)
    a = g / (1.0 + np.exp(-g)) * u * weight
    da = (np.abs(w1) @ np.abs(x64) + np.abs(w3) @ np.abs(x64)) * (abs(weight) * limit + 1.0)
    return w2 @ a, np.abs(w2) @ (np.abs(a) + 1e-2 * da)


@pytest.fixture(scope="module")
def neon_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("neon")
    sources, cflags, include = _build_config()
    exe = tmp / "neon_driver"
    cmd = [CC, *cflags, "-pthread", f"-I{include}", *(str(NATIVE / s) for s in sources),
           str(DRIVER), "-lm", "-o", str(exe)]  # fmt: skip
    env = dict(os.environ)
    built = subprocess.run([*cmd, "-static"], capture_output=True, text=True)
    if built.returncode != 0:  # no static libc for aarch64: link dynamically, point qemu at the sysroot
        built = subprocess.run(cmd, capture_output=True, text=True)
        env["QEMU_LD_PREFIX"] = SYSROOT
    assert built.returncode == 0, f"aarch64 build failed:\n{built.stderr}"

    rng = np.random.default_rng(1234)
    fixtures = []
    for i, (rows, k) in enumerate(CASES):
        if i == ALL_PAIRS:
            codes = np.tile(np.arange(256, dtype=np.uint8), (rows, 1))
            dscales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], k // 32, axis=1)
        else:
            codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
            dscales = rng.integers(0, 256, (rows, k // 32), dtype=np.uint8)  # incl. 0, 1, 2, 253..255
        mscales = rng.integers(118, 130, (rows, k // 32), dtype=np.uint8)
        x = rng.standard_normal(k).astype(np.float32)
        w16 = rng.standard_normal((rows, k)).astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        xs = rng.standard_normal((MULTI_TMAX, k)).astype(np.float32)
        for ext, a in (("codes", codes), ("dscales", dscales), ("mscales", mscales), ("x", x), ("bf16", w16),
                       ("xs", xs)):
            (tmp / f"{i}.{ext}").write_bytes(np.ascontiguousarray(a).tobytes())
        fixtures.append((codes, dscales, mscales, x, w16, xs))
    (tmp / "cases.txt").write_text("".join(f"{r} {k}\n" for r, k in CASES))
    (tmp / "multi.txt").write_text(" ".join(map(str, (MULTI_TMAX, *MULTI_T))) + "\n")
    fp8 = fp8_fixtures(rng)
    fp8_xs = []
    for i, (w, ds, ms, x) in enumerate(fp8):
        fp8_xs.append(rng.standard_normal((MULTI_TMAX, w.shape[1])).astype(np.float32))
        for ext, a in (("w", w), ("ds", ds), ("ms", ms), ("x", x), ("xs", fp8_xs[-1])):
            (tmp / f"f{i}.{ext}").write_bytes(np.ascontiguousarray(a).tobytes())
    (tmp / "fp8.txt").write_text("".join(f"{r} {k}\n" for r, k in FP8_CASES))
    n, hidden, inter, limit = EXPERTS
    experts = []
    for e in range(n):
        parts = (*rand_mxfp4(rng, inter, hidden), *rand_mxfp4(rng, inter, hidden), *rand_mxfp4(rng, hidden, inter))
        for ext, a in zip(("w1", "s1", "w3", "s3", "w2", "s2"), parts):
            (tmp / f"e{e}.{ext}").write_bytes(a.tobytes())
        experts.append(parts)
    ew = rng.uniform(0.05, 0.5, n).astype(np.float32)
    ex = (rng.standard_normal(hidden) * 0.05).astype(np.float32)
    (tmp / "e.weights").write_bytes(ew.tobytes())
    (tmp / "e.x").write_bytes(ex.tobytes())
    (tmp / "experts.txt").write_text(f"{n} {hidden} {inter} {limit}\n")
    exs = (rng.standard_normal((EXPERT_NTOK, hidden)) * 0.05).astype(np.float32)
    etw = rng.uniform(0.05, 0.5, sum(map(len, EXPERT_TOKENS))).astype(np.float32)
    (tmp / "e.tok.txt").write_text(f"{EXPERT_NTOK}\n" + "".join(f"{len(t)} {' '.join(map(str, t))}\n"
                                                                for t in EXPERT_TOKENS))
    (tmp / "e.xs").write_bytes(exs.tobytes())
    (tmp / "e.tw").write_bytes(etw.tobytes())
    hx, hfn = hc_fixture()
    (tmp / "hc.x").write_bytes(hx.tobytes())
    (tmp / "hc.fn").write_bytes(hfn.tobytes())
    (tmp / "hc.txt").write_text(" ".join(map(repr, HC)) + "\n")

    run = subprocess.run([QEMU, str(exe), str(tmp)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, f"neon_driver failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    assert "neon_supported=1" in run.stdout and "best=3" in run.stdout, run.stdout

    assert f"fp8 case {len(FP8_CASES) - 1}:" in run.stdout and "experts:" in run.stdout, run.stdout
    assert "expert tokens:" in run.stdout and "hc mix:" in run.stdout, run.stdout

    def load(i, ext):
        return np.fromfile(tmp / f"{i}.{ext}", dtype=np.float32)

    return fixtures, load, fp8, (experts, ew, ex), (fp8_xs, exs, etw)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{r}x{k}" for r, k in CASES])
def test_neon_decode_bit_identical(neon_run, i):
    fixtures, load, *_ = neon_run
    codes, dscales, *_ = fixtures[i]
    ref = ref_decode(codes, dscales).ravel().view(np.uint32)
    neon, scalar = load(i, "neon.decode").view(np.uint32), load(i, "scalar.decode").view(np.uint32)
    np.testing.assert_array_equal(neon, scalar)
    np.testing.assert_array_equal(neon, ref)


@pytest.mark.parametrize("kind", ["matvec", "bf16"])
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{r}x{k}" for r, k in CASES])
def test_neon_matvecs_within_tolerance(neon_run, i, kind):
    fixtures, load, *_ = neon_run
    codes, _, mscales, x, w16, _ = fixtures[i]
    if kind == "matvec":
        w = ref_decode(codes, mscales).astype(np.float64)
    else:
        w = w16.view(ml_dtypes.bfloat16).astype(np.float64)
    x64 = x.astype(np.float64)
    ref, bound = w @ x64, np.abs(w) @ np.abs(x64)
    for backend in ("neon", "scalar"):
        y = load(i, f"{backend}.t1.{kind}")
        assert np.all(np.abs(y - ref) <= 1e-5 * bound), (backend, np.max(np.abs(y - ref) / bound))
        for t in (2, 3):  # deterministic across thread counts
            np.testing.assert_array_equal(load(i, f"{backend}.t{t}.{kind}").view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("i", range(len(FP8_CASES)), ids=[f"{r}x{k}" for r, k in FP8_CASES])
def test_neon_fp8_decode_bit_identical(neon_run, i):
    """NEON's FP8 decode = scalar's, bit for bit (one quiet NaN pattern), = ml_dtypes x 2^(b-127)."""
    _, load, fp8, *_ = neon_run
    w, ds, _, _ = fp8[i]
    neon, scalar = load(f"f{i}", "neon.decode"), load(f"f{i}", "scalar.decode")
    np.testing.assert_array_equal(neon.view(np.uint32), scalar.view(np.uint32))
    with np.errstate(over="ignore"):
        ref = ref_fp8_decode64(w, ds).astype(np.float32).ravel()
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(neon), nan)
    np.testing.assert_array_equal(neon.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    assert np.all(neon.view(np.uint32)[nan] == 0x7FC00000)


@pytest.mark.parametrize("i", range(len(FP8_CASES)), ids=[f"{r}x{k}" for r, k in FP8_CASES])
def test_neon_fp8_matvec(neon_run, i):
    """Within 1e-5 * sum |w*x| of float64, NaN exactly in the rows with a NaN code or a 255
    scale, the same bits for 1, 2 and 3 threads."""
    _, load, fp8, *_ = neon_run
    w, _, ms, x = fp8[i]
    w64 = ref_fp8_decode64(w, ms)
    want_nan = np.isnan(w64).any(axis=1)
    assert want_nan.any() == (i in FP8_NAN_ROWS or i == FP8_ALL)
    w64 = np.where(np.isnan(w64), 0.0, w64)
    x64 = x.astype(np.float64)
    ref, bound = w64 @ x64, np.abs(w64) @ np.abs(x64)
    for backend in ("neon", "scalar"):
        y = load(f"f{i}", f"{backend}.t1.matvec")
        np.testing.assert_array_equal(np.isnan(y), want_nan)
        ok = ~want_nan
        assert np.all(np.abs(y[ok] - ref[ok]) <= 1e-5 * bound[ok]), (backend, np.max(np.abs(y - ref)[ok] / bound[ok]))
        for t in (2, 3):
            np.testing.assert_array_equal(load(f"f{i}", f"{backend}.t{t}.matvec").view(np.uint32), y.view(np.uint32))


def test_neon_experts_forward_each(neon_run):
    """Summing experts_forward_each's rows in order in float32 gives experts_forward's bits; each
    row is within tolerance of that expert in float64; 1, 2 and 3 threads agree bit for bit."""
    _, load, _, (experts, ew, ex), _ = neon_run
    n, hidden, _, limit = EXPERTS
    refs = [ref_expert(experts[e], float(ew[e]), ex, limit) for e in range(n)]
    for backend in ("neon", "scalar"):
        each = load("e", f"{backend}.t1.each").reshape(n, hidden)
        total = each[0].copy()
        for e in range(1, n):
            total += each[e]
        np.testing.assert_array_equal(total.view(np.uint32), load("e", f"{backend}.t1.sum").view(np.uint32))
        for e, (ref, bound) in enumerate(refs):
            assert np.all(np.abs(each[e] - ref) <= 1e-5 * bound), (backend, e)
        for t in (2, 3):
            for kind in ("each", "sum"):
                np.testing.assert_array_equal(load("e", f"{backend}.t{t}.{kind}").view(np.uint32),
                                              load("e", f"{backend}.t1.{kind}").view(np.uint32))


# ---- several vectors at once ----------------------------------------------------------------------


def _check_matmul(load, prefix, tag, rows, w64, xs):
    """Each backend's matmul of the first t vectors = its single-vector kernel on each of them, bit
    for bit, at 1, 2 and 3 threads; and within 1e-5 * sum |w*x| of float64 (NaN rows aside)."""
    nan_rows = np.isnan(w64).any(axis=1)
    w64 = np.where(np.isnan(w64), 0.0, w64)
    x64 = xs.astype(np.float64)
    ref, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    for backend in ("neon", "scalar"):
        single = load(prefix, f"{backend}.{tag}rows").reshape(MULTI_TMAX, rows)
        ok = ~nan_rows
        assert np.all(np.abs(single[:, ok] - ref[:, ok]) <= 1e-5 * bound[:, ok]), backend
        assert np.isnan(single[:, nan_rows]).all()
        for threads in (1, 2, 3):
            for t in MULTI_T:
                got = load(prefix, f"{backend}.t{threads}.{tag}mm{t}").reshape(t, rows)
                np.testing.assert_array_equal(got.view(np.uint32), single[:t].view(np.uint32),
                                              err_msg=f"{backend}, {threads} threads, {t} vectors")


@pytest.mark.parametrize("kind", ["mxfp4", "bf16"])
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{r}x{k}" for r, k in CASES])
def test_neon_matmul_bit_identical_to_matvec(neon_run, i, kind):
    fixtures, load, *_ = neon_run
    codes, _, mscales, _, w16, xs = fixtures[i]
    if kind == "mxfp4":
        w64 = ref_decode(codes, mscales).astype(np.float64)
    else:
        w64 = w16.view(ml_dtypes.bfloat16).astype(np.float64)
    _check_matmul(load, i, "" if kind == "mxfp4" else "bf", CASES[i][0], w64, xs)


@pytest.mark.parametrize("i", range(len(FP8_CASES)), ids=[f"{r}x{k}" for r, k in FP8_CASES])
def test_neon_fp8_matmul_bit_identical_to_matvec(neon_run, i):
    _, load, fp8, _, (fp8_xs, _, _) = neon_run
    w, _, ms, _ = fp8[i]
    _check_matmul(load, f"f{i}", "", FP8_CASES[i][0], ref_fp8_decode64(w, ms), fp8_xs[i])


def test_neon_experts_forward_tokens(neon_run):
    """experts_forward_tokens' rows = experts_forward_each on each (expert, token, weight) pair
    bit for bit (both backends, 1..3 threads), and within tolerance of float64."""
    _, load, _, (experts, _, _), (_, exs, etw) = neon_run
    _, hidden, _, limit = EXPERTS
    pairs = [(e, t) for e, toks in enumerate(EXPERT_TOKENS) for t in toks]
    for backend in ("neon", "scalar"):
        each = load("e", f"{backend}.pairs").reshape(len(pairs), hidden)
        for p, (e, t) in enumerate(pairs):
            ref, bound = ref_expert(experts[e], float(etw[p]), exs[t], limit)
            assert np.all(np.abs(each[p] - ref) <= 1e-5 * bound), (backend, e, t)
        for threads in (1, 2, 3):
            got = load("e", f"{backend}.t{threads}.tokens").reshape(len(pairs), hidden)
            np.testing.assert_array_equal(got.view(np.uint32), each.view(np.uint32), err_msg=f"{backend}, {threads}")


def test_neon_hc_mix_has_this_machines_bits(neon_run):
    """The hyper-connections' mix on aarch64 (both backends, all tokens in one call and each
    alone) has the bits it has here with the best backend: its order is the project's own
    (correctly rounded steps), not the machine's or the backend's."""
    from ds4f.native import kernels

    _, load, _, _, _ = neon_run
    n, _, rows, eps = HC
    x, fn = hc_fixture()
    want = kernels.hc_mix(x, fn, eps)
    for backend in ("neon", "scalar"):
        for how in ("all", "one"):
            got = load("hc", f"{backend}.{how}").view(np.float64).reshape(n, rows)
            np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64), err_msg=f"{backend}, {how}")
