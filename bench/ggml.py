"""ds4f's MXFP4 matvec against ggml's own MXFP4 kernels, in one process, the kernels taking turns.

ggml is no dependency of ds4f: `ds4f bench-kernels --ggml DIR` takes the CMake build directory of
a ggml tree (llama.cpp's ggml/ folder), with position-independent static libraries or shared ones:

    cmake -S llama.cpp/ggml -B DIR -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON \\
        -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DBUILD_SHARED_LIBS=OFF \\
        -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DGGML_OPENMP=OFF
    cmake --build DIR --target ggml ggml-cpu ggml-base

ggml_mxfp4.c (beside this file) is compiled with the C compiler against DIR's libraries and the
headers of the source tree DIR's CMakeCache.txt names, and loaded with ctypes.  It sets the same
random matrix (rows x k, scale bytes 118..129 as in the kernel tests) into ggml's blocks, plain and
repacked by ggml's CPU_REPACK buffer type, and runs ggml_vec_dot_mxfp4_q8_0 over the rows
("standard") or ggml_gemv_mxfp4_8x8_q8_0 over the repacked rows ("repacked"), each call quantizing
x to q8_0 first, as ggml does for every product.  ds4f's matvec runs on one thread on the chosen
backend.  Each round times `calls` calls of each kernel after one untimed call (median), the three
in turn, so that load from other processes falls on all of them alike; the load average is kept
with each round.  Every kernel's result is checked against float64 first (max |y - y64| /
sum |w*x| over the rows): ds4f's stays within 1e-5, ggml's reflects its int8 x (~1e-3).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ds4f.engine.checkpoint.formats import E2M1_VALUES
from ds4f.errors import Ds4fError
from ds4f.native import kernels as K
from ds4f.native._kernels import ffi, lib

HARNESS = Path(__file__).with_name("ggml_mxfp4.c")
LIBS = ("ggml", "ggml-cpu", "ggml-base")
KINDS = ("ds4f", "standard", "repacked")
SETUP_ERRORS = {-1: "this ggml has no CPU_REPACK buffer type", -2: "ggml did not repack MXFP4 here (no AVX2?)",
                -3: "out of memory"}


@dataclass
class GgmlRound:
    round: int
    backend: str
    shape: str
    load: float | None               # 1-minute load average when the round ended
    gw: dict[str, float]             # G weights/s of each kind: ds4f, standard, repacked

    @property
    def vs_standard(self) -> float:
        return self.gw["ds4f"] / self.gw["standard"]

    @property
    def vs_repacked(self) -> float:
        return self.gw["ds4f"] / self.gw["repacked"]

    def to_dict(self) -> dict:
        return {**asdict(self), "vs_standard": self.vs_standard, "vs_repacked": self.vs_repacked}


def _source_dir(build: Path) -> Path:
    cache = build / "CMakeCache.txt"
    if not cache.is_file():
        raise Ds4fError(f"--ggml: {build} is no CMake build directory (no CMakeCache.txt)", param="ggml", path=build)
    text = cache.read_text(errors="replace")
    for key in ("ggml_SOURCE_DIR", "CMAKE_HOME_DIRECTORY"):
        m = re.search(rf"^{key}:\w+=(.+)$", text, re.M)
        if m and (Path(m.group(1)) / "include" / "ggml-cpu.h").is_file():
            return Path(m.group(1))
    raise Ds4fError(f"--ggml: {cache} names no ggml source tree with include/ggml-cpu.h", param="ggml", path=cache)


def _library(build: Path, name: str) -> Path:
    for pattern in (f"lib{name}.so", f"lib{name}.a"):
        found = sorted(build.rglob(pattern))
        if found:
            return found[0]
    raise Ds4fError(f"--ggml: no lib{name}.so or lib{name}.a under {build} (build the ggml, ggml-cpu and ggml-base "
                    "targets)", param="ggml", path=build)


def load_harness(build: str | os.PathLike) -> ctypes.CDLL:
    """ggml_mxfp4.c compiled against the ggml build in `build` and loaded."""
    build = Path(build).expanduser().resolve()
    src = _source_dir(build)
    libs = [_library(build, n) for n in LIBS]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise Ds4fError("--ggml: no C compiler (cc) to build the harness", param="ggml", kind="data")
    out = Path(tempfile.mkdtemp(prefix="ds4f-ggml-")) / "ggml_mxfp4.so"
    rpath = sorted({str(p.parent) for p in libs if p.suffix == ".so"})
    cmd = [cc, "-O2", "-shared", "-fPIC", f"-I{src / 'include'}", str(HARNESS), "-o", str(out), *map(str, libs),
           *(f"-Wl,-rpath,{d}" for d in rpath), "-lstdc++", "-lm", "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-3:])
        raise Ds4fError(f"--ggml: building the harness failed (static ggml libraries need "
                        f"-DCMAKE_POSITION_INDEPENDENT_CODE=ON):\n{tail}", param="ggml", path=build)
    h = ctypes.CDLL(str(out))
    u8, f32 = ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_float)
    h.gb_setup.argtypes, h.gb_setup.restype = [u8, u8, ctypes.c_size_t, ctypes.c_size_t], ctypes.c_int
    for fn in (h.gb_standard, h.gb_repacked):
        fn.argtypes, fn.restype = [f32, f32], None
    return h


def _max_error(y: np.ndarray, w64: np.ndarray, x: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    return float(np.max(np.abs(y - w64 @ x64) / (np.abs(w64) @ np.abs(x64))))


def bench_ggml(build: str | os.PathLike, rounds: int = 10, calls: int = 50, rows: int = 2048, k: int = 4096,
               backend: str = "avx2", progress=None, notes: list[str] | None = None) -> list[GgmlRound]:
    """`rounds` rounds of the three kernels in turn on one rows x k matrix, one thread."""
    if rows % 8 or k % 32:
        raise Ds4fError("--ggml: rows must be a multiple of 8 and k of 32", param="ggml")
    if backend not in K.available_backends():
        raise Ds4fError(f"--ggml: backend {backend!r} is not available here", param="backends")
    h = load_harness(build)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.integers(118, 130, (rows, k // 32), dtype=np.uint8)
    x = rng.standard_normal(k).astype(np.float32)
    y = np.zeros(rows, np.float32)
    rc = h.gb_setup(codes.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                    scales.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), rows, k)
    if rc != 0:
        raise Ds4fError(f"--ggml: {SETUP_ERRORS.get(rc, f'setup failed ({rc})')}", param="ggml", kind="data")
    old = K.get_backend(), K.get_threads()
    K.set_backend(backend)
    K.set_threads(1)
    xf, yf = x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), y.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    cx, cy = ffi.cast("float *", x.ctypes.data), ffi.cast("float *", y.ctypes.data)
    cc, cs = ffi.cast("uint8_t *", codes.ctypes.data), ffi.cast("uint8_t *", scales.ctypes.data)
    run = {"ds4f": lambda: lib.ds4f_mxfp4_matvec(cc, cs, rows, k, cx, cy),
           "standard": lambda: h.gb_standard(xf, yf), "repacked": lambda: h.gb_repacked(xf, yf)}
    try:
        nib = np.empty((rows, k), np.uint8)
        nib[:, 0::2], nib[:, 1::2] = codes & 15, codes >> 4
        w64 = np.asarray(E2M1_VALUES, np.float64)[nib] * np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=1)
        for kind in KINDS:
            run[kind]()
            if notes is not None:
                notes.append(f"{kind}: max |y - float64| / sum |w*x| = {_max_error(y, w64, x):.2g}")
        del w64, nib
        out = []
        for r in range(rounds):
            if progress:
                progress(f"ggml comparison: round {r + 1} of {rounds}")
            gw = {}
            for kind in KINDS:
                fn = run[kind]
                fn()
                times = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                gw[kind] = rows * k / statistics.median(times) / 1e9
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            out.append(GgmlRound(r, backend, f"{rows}x{k}", load, gw))
        return out
    finally:
        K.set_backend(old[0])
        K.set_threads(old[1])
