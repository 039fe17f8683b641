"""cffi (API mode) build of the native kernels: compiled by `pip install` into ds4f.native._kernels.

Flags: never -ffast-math/-Ofast (they turn on flush-to-zero process-wide); no FP contraction
anywhere in the portable code, and no auto-vectorisation, so the scalar reference stays scalar.
SIMD code selects its instruction set per function with target attributes. Frame pointers are
kept: a SIMD function that realigns its stack for its vector spills has unwind rules that
sampling profilers (py-spy --native, which `ds4f bench split` uses) often cannot follow, and
its samples then land on the Python caller's line, counted as interpreter time.
"""
import os
import sys
import sysconfig

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(HERE, "include")
# scalar/ is the reference; the SIMD files compile to nothing on other architectures
# and select their instruction set per function (target attributes), so no global -m flags.
SOURCES = [
    "scalar/matvec.c",
    "scalar/matmul.c",
    "x86/avx2_matvec.c",
    "x86/avx2_matmul.c",
    "x86/avx512_matvec.c",
    "x86/avx512_matmul.c",
    "arm/neon_matvec.c",
    "arm/neon_matmul.c",
    "dispatch_matvec.c",
    "dispatch_matmul.c",
    "hyper.c",
    "attention.c",
    "norms.c",
    "threadpool.c",
    "membench.c",
]
HEADERS = ["ds4f_kernels.h", "ds4f_membench.h", "kernels_internal.h", "kernels_avx2.h", "kernels_avx512.h",
           "kernels_neon.h",
           "attention_simd.h"]
PUBLIC_HEADERS = ["ds4f_kernels.h", "ds4f_membench.h"]  # what Python sees (the cdef)

NATIVE_CFLAGS = ("-O2", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-fno-tree-vectorize",
                 "-fno-omit-frame-pointer")

ffibuilder = FFI()
cdef = ""
for header in PUBLIC_HEADERS:
    with open(os.path.join(INCLUDE, header)) as f:
        cdef += "".join(line for line in f if not line.startswith("#") and "DS4F_MAX_EXPERTS" not in line)
ffibuilder.cdef(cdef + "\n#define DS4F_MAX_EXPERTS 8\n")

if sys.platform == "win32":
    extra = ["/O2", "/fp:precise"]
else:
    # The same flags as tests/test_neon.py's cross build (NATIVE_CFLAGS).
    extra = list(NATIVE_CFLAGS)
    if "clang" in (os.environ.get("CC", "") + (sysconfig.get_config_var("CC") or "")) or sys.platform == "darwin":
        extra = ["-O2", "-std=c11", "-ffp-contract=off", "-fno-vectorize", "-fno-slp-vectorize",
                 "-fno-omit-frame-pointer"]

ffibuilder.set_source(
    "ds4f.native._kernels",
    "".join(f'#include "{h}"\n' for h in PUBLIC_HEADERS),
    sources=[os.path.relpath(os.path.join(HERE, s)) for s in SOURCES],
    include_dirs=[os.path.relpath(INCLUDE)],
    extra_compile_args=extra,
    depends=[os.path.relpath(os.path.join(INCLUDE, h)) for h in HEADERS],
    libraries=["m", "pthread"] if sys.platform != "win32" else [],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
