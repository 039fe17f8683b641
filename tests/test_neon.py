"""The NEON backend, tested on any machine: the kernel sources (with the build's own flags) and
native/tests/neon_driver.c are cross-compiled for aarch64 and run under qemu-aarch64 on
fixtures written here.  NEON output is checked against the scalar backend of the same binary
(decode bit-identical) and, independently, against ml_dtypes / float64 numpy references."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

NATIVE = Path(__file__).resolve().parent.parent / "native"
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


def _build_config():
    spec = importlib.util.spec_from_file_location("_ds4f_build_kernels", NATIVE / "build_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SOURCES, mod.NATIVE_CFLAGS


def ref_decode(codes, scales):
    rows, half = codes.shape
    nib = np.empty((rows, 2 * half), np.uint8)
    nib[:, 0::2], nib[:, 1::2] = codes & 15, codes >> 4
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    sc = np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=1)
    with np.errstate(over="ignore"):
        return vals * sc


@pytest.fixture(scope="module")
def neon_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("neon")
    sources, cflags = _build_config()
    exe = tmp / "neon_driver"
    cmd = [CC, *cflags, "-pthread", f"-I{NATIVE}", *(str(NATIVE / s) for s in sources),
           str(NATIVE / "tests" / "neon_driver.c"), "-lm", "-o", str(exe)]  # fmt: skip
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
        for ext, a in (("codes", codes), ("dscales", dscales), ("mscales", mscales), ("x", x), ("bf16", w16)):
            (tmp / f"{i}.{ext}").write_bytes(np.ascontiguousarray(a).tobytes())
        fixtures.append((codes, dscales, mscales, x, w16))
    (tmp / "cases.txt").write_text("".join(f"{r} {k}\n" for r, k in CASES))

    run = subprocess.run([QEMU, str(exe), str(tmp)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, f"neon_driver failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    assert "neon_supported=1" in run.stdout and "best=3" in run.stdout, run.stdout

    def load(i, ext):
        return np.fromfile(tmp / f"{i}.{ext}", dtype=np.float32)

    return fixtures, load


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{r}x{k}" for r, k in CASES])
def test_neon_decode_bit_identical(neon_run, i):
    fixtures, load = neon_run
    codes, dscales, *_ = fixtures[i]
    ref = ref_decode(codes, dscales).ravel().view(np.uint32)
    neon, scalar = load(i, "neon.decode").view(np.uint32), load(i, "scalar.decode").view(np.uint32)
    np.testing.assert_array_equal(neon, scalar)
    np.testing.assert_array_equal(neon, ref)


@pytest.mark.parametrize("kind", ["matvec", "bf16"])
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{r}x{k}" for r, k in CASES])
def test_neon_matvecs_within_tolerance(neon_run, i, kind):
    fixtures, load = neon_run
    codes, _, mscales, x, w16 = fixtures[i]
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
