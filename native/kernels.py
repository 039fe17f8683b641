"""The native kernels from Python: numpy arrays in and out, checked before any C runs.

Every function validates dtype, shape, C-contiguity, k % 32 (MXFP4, bf16) or the scale-tile
shape (FP8) and output sizes and raises ValueError naming the offending argument; nothing
reaches C that could make it read or write out of bounds.  Arrays may be views into larger buffers (expert-cache slots): any C-contiguous
array of the right dtype and shape is used in place, never copied.

A weight used for many products can be checked once: prepare_fp8 / prepare_bf16 /
prepare_mxfp4 give a PreparedMatrix for matmul, prepare_expert a PreparedExpert for the experts
kernels; a call then checks only its x, out and scratch (the engine keeps one per trunk matrix
and one per expert-cache slot).

The *_matmul functions and experts_forward_tokens take several input vectors at once (the
tokens of a prompt): each weight block is decoded once and applied to all of them, and each
result row is bit-identical to the single-vector kernel's on that vector (same backend).

The GIL is released while a kernel runs: these are cffi API-mode (out-of-line, compiled) calls,
and cffi wraps every such call in Py_BEGIN_ALLOW_THREADS / Py_END_ALLOW_THREADS
(tests/test_kernels.py::test_gil_released checks it).  Native jobs are serialised by the
kernels' own pool, so calling from several Python threads is safe.

Backend and thread count are process-wide settings of the native library; a change made
between calls applies from the next call on.  DS4F_KERNELS=scalar|avx2|avx512|neon|auto picks
the initial backend (unknown or unsupported values fall back to auto, with a warning here).
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import NamedTuple, Sequence

import numpy as np

from ds4f.native._kernels import ffi, lib

# The backends' names, in the order of the C enum (a backend's number is its index: also its code
# in state dumps); every other list of backends derives from this one.
BACKENDS = tuple(ffi.string(lib.ds4f_backend_name(i)).decode() for i in range(lib.DS4F_N_BACKENDS))
SIMD_BACKENDS = tuple(b for b in BACKENDS if b != "scalar")
MAX_EXPERTS = int(lib.DS4F_MAX_EXPERTS)

try:  # bf16 / FP8 weights may come as ml_dtypes arrays or as their bit patterns (uint16 / uint8)
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
    _E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
    _E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    _BF16 = _E4M3 = _E8M0 = None

FP8_TILE = int(lib.DS4F_FP8_TILE)  # one E8M0 scale per FP8_TILE x FP8_TILE tile of an FP8 weight
_U8 = np.dtype(np.uint8)
_U16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)


def available_backends() -> list[str]:
    """Backends compiled in and usable on this CPU and OS (scalar always)."""
    return [name for i, name in enumerate(BACKENDS) if lib.ds4f_backend_supported(i)]


def best_backend() -> str:
    return BACKENDS[lib.ds4f_best_backend()]


def get_backend() -> str:
    return BACKENDS[lib.ds4f_get_backend()]


def set_backend(name: str) -> str:
    """Select the backend for the next calls ("auto" = best); returns the active name."""
    if name == "auto":
        name = best_backend()
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown kernel backend {name!r} (choose from auto, {', '.join(BACKENDS)})")
    if lib.ds4f_set_backend(BACKENDS.index(name)) != 0:
        raise ValueError(
            f"backend: {name!r} is not supported on this machine (available: {', '.join(available_backends())})"
        )
    return get_backend()


def get_threads() -> int:
    return int(lib.ds4f_get_threads())


def set_threads(n: int) -> None:
    """Size of the native pool, the calling thread included (n >= 1)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"threads: expected an integer >= 1, got {n!r}")
    if lib.ds4f_set_threads(int(n)) != 0:
        raise ValueError(f"threads: {n} is more than the pool allows")


@contextmanager
def alone():
    """The calling thread's kernel calls inside the block do all their work on this thread, the
    pool's workers untouched: for a helper that computes beside a thread busy with work of its
    own, so the two keep to one core each. The same bits (a task's result does not depend on the
    thread that runs it)."""
    before = lib.ds4f_get_alone()
    lib.ds4f_set_alone(1)
    try:
        yield
    finally:
        lib.ds4f_set_alone(before)


# ---- argument checks ---------------------------------------------------------------------


def _arr(name: str, a, dtype: np.dtype, shape: tuple, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array of {dtype}, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (got a strided view; use np.ascontiguousarray)")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name}: output array is read-only")
    return a


def _mxfp4_shape(codes, scales, what: str = "codes") -> tuple[int, int]:
    if not isinstance(codes, np.ndarray) or codes.ndim != 2:
        got = codes.shape if isinstance(codes, np.ndarray) else type(codes).__name__
        raise ValueError(f"{what}: expected a 2-D uint8 array [rows, k//2], got {got}")
    rows, half = codes.shape
    k = 2 * half
    if k % 32:
        raise ValueError(f"{what}: k = {k} (2 x {half} bytes per row) is not a multiple of 32")
    _arr(what, codes, _U8, (rows, half))
    sname = "scales" if what == "codes" else what.replace(".w", ".s")
    _arr(sname, scales, _U8, (rows, k // 32))
    return rows, k


def _fp8_shape(w, scales) -> tuple[int, int]:
    """rows, k of an FP8 weight w [rows, k] (E4M3 or uint8) with scales [ceil(rows/128), ceil(k/128)]
    (E8M0 or uint8), both C-contiguous."""
    if not isinstance(w, np.ndarray) or w.ndim != 2:
        got = w.shape if isinstance(w, np.ndarray) else type(w).__name__
        raise ValueError(f"w: expected a 2-D float8_e4m3fn or uint8 array [rows, k], got {got}")
    if w.dtype != _U8 and w.dtype != _E4M3:
        raise ValueError(f"w: expected dtype float8_e4m3fn or uint8, got {w.dtype}")
    rows, k = w.shape
    if k == 0:
        raise ValueError("w: k = 0 (rows need at least one element)")
    _arr("w", w, w.dtype, (rows, k))
    tiles = (-(-rows // FP8_TILE), -(-k // FP8_TILE))
    if not isinstance(scales, np.ndarray) or (scales.dtype != _U8 and scales.dtype != _E8M0):
        got = scales.dtype if isinstance(scales, np.ndarray) else type(scales).__name__
        raise ValueError(f"scales: expected a float8_e8m0fnu or uint8 array, got {got}")
    if scales.shape != tiles:
        raise ValueError(f"scales: expected shape {tiles} (one per {FP8_TILE}x{FP8_TILE} tile of a "
                         f"{rows}x{k} weight), got {scales.shape}")
    _arr("scales", scales, scales.dtype, tiles)
    return rows, k


def _out(name: str, out, shape: tuple) -> np.ndarray:
    if out is None:
        return np.empty(shape, _F32)
    return _arr(name, out, _F32, shape, writable=True)


def _ptr(ctype: str, a: np.ndarray):
    # from_buffer keeps `a` exported (alive, unresizable) while the returned cdata lives
    return ffi.from_buffer(ctype, a)


# ---- kernels -------------------------------------------------------------------------------


def mxfp4_decode(codes: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """MXFP4 (official packing) -> float32 [rows, k]; bit-identical on every backend."""
    rows, k = _mxfp4_shape(codes, scales)
    out = _out("out", out, (rows, k))
    lib.ds4f_mxfp4_decode(_ptr("uint8_t[]", codes), _ptr("uint8_t[]", scales), rows, k, _ptr("float[]", out))
    return out


def mxfp4_matvec(
    codes: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """y = W . x for MXFP4 W [rows, k] and float32 x [k], fp32 accumulation."""
    rows, k = _mxfp4_shape(codes, scales)
    _arr("x", x, _F32, (k,))
    out = _out("out", out, (rows,))
    lib.ds4f_mxfp4_matvec(
        _ptr("uint8_t[]", codes), _ptr("uint8_t[]", scales), rows, k, _ptr("float[]", x), _ptr("float[]", out)
    )
    return out


def _bf16_shape(w) -> tuple[int, int]:
    """(rows, k) of a bf16 weight, checked: 2-D, bfloat16 or uint16 bits, k a multiple of 32, contiguous."""
    if not isinstance(w, np.ndarray) or w.ndim != 2:
        got = w.shape if isinstance(w, np.ndarray) else type(w).__name__
        raise ValueError(f"w: expected a 2-D bfloat16 or uint16 array [rows, k], got {got}")
    if w.dtype != _U16 and w.dtype != _BF16:
        raise ValueError(f"w: expected dtype bfloat16 or uint16, got {w.dtype}")
    rows, k = w.shape
    if k % 32:
        raise ValueError(f"w: k = {k} is not a multiple of 32")
    _arr("w", w, w.dtype, (rows, k))
    return rows, k


def bf16_matvec(w: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = W . x for W [rows, k] of bfloat16 (ml_dtypes.bfloat16 or uint16 bits), float32 x."""
    rows, k = _bf16_shape(w)
    _arr("x", x, _F32, (k,))
    out = _out("out", out, (rows,))
    lib.ds4f_bf16_matvec(_ptr("uint16_t[]", w.view(_U16)), rows, k, _ptr("float[]", x), _ptr("float[]", out))
    return out


def fp8_decode(w: np.ndarray, scales: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """FP8 E4M3 w [rows, k] with E8M0 scales per 128x128 tile -> float32 [rows, k]; bit-identical
    on every backend (NaN codes and NaN scales give the quiet NaN 0x7fc00000)."""
    rows, k = _fp8_shape(w, scales)
    out = _out("out", out, (rows, k))
    lib.ds4f_fp8_decode(_ptr("uint8_t[]", w.view(_U8)), _ptr("uint8_t[]", scales.view(_U8)), rows, k,
                        _ptr("float[]", out))
    return out


def fp8_matvec(w: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = W . x for FP8 W [rows, k] (E4M3, E8M0 scales per 128x128 tile) and float32 x [k], fp32
    accumulation; a row holding a NaN code or a NaN scale gives NaN."""
    rows, k = _fp8_shape(w, scales)
    _arr("x", x, _F32, (k,))
    out = _out("out", out, (rows,))
    lib.ds4f_fp8_matvec(_ptr("uint8_t[]", w.view(_U8)), _ptr("uint8_t[]", scales.view(_U8)), rows, k,
                        _ptr("float[]", x), _ptr("float[]", out))
    return out


class ExpertWeights(NamedTuple):
    """One routed expert as uint8 arrays (views into a cache slot are fine):
    w1, w3 [inter, hidden//2] with s1, s3 [inter, hidden//32]; w2 [hidden, inter//2], s2 [hidden, inter//32]."""

    w1: np.ndarray
    s1: np.ndarray
    w3: np.ndarray
    s3: np.ndarray
    w2: np.ndarray
    s2: np.ndarray


def _check_dims(n: int, hidden: int, inter: int) -> None:
    if not 1 <= n <= MAX_EXPERTS:
        raise ValueError(f"experts: expected 1..{MAX_EXPERTS} experts, got {n}")
    if hidden <= 0 or hidden % 32:
        raise ValueError(f"hidden: {hidden} is not a positive multiple of 32")
    if inter <= 0 or inter % 32:
        raise ValueError(f"inter: {inter} is not a positive multiple of 32")


def experts_scratch(n: int, hidden: int, inter: int) -> np.ndarray:
    """The float32 work buffer experts_forward needs for n experts: allocate once, reuse."""
    _check_dims(n, hidden, inter)
    return np.zeros(int(lib.ds4f_experts_scratch_floats(n, hidden, inter)), _F32)


class PreparedExpert:
    """An expert's six arrays checked once and their native buffers kept (prepare_expert): the
    experts kernels then take it without checking or exporting them again. It indexes like the
    ExpertWeights it holds. The arrays stay exported (alive, unresizable) while it lives."""

    __slots__ = ("arrays", "bufs", "hidden", "inter")

    def __init__(self, arrays: ExpertWeights, bufs: tuple, hidden: int, inter: int) -> None:
        self.arrays, self.bufs, self.hidden, self.inter = arrays, bufs, hidden, inter

    def __getitem__(self, i):
        return self.arrays[i]

    def __len__(self) -> int:
        return 6


_EXPERT_FIELDS = ("w1", "s1", "w3", "s3", "w2", "s2")


def _expert_specs(hidden: int, inter: int) -> tuple:
    return ((inter, hidden // 2), (inter, hidden // 32), (inter, hidden // 2), (inter, hidden // 32),
            (hidden, inter // 2), (hidden, inter // 32))


def prepare_expert(ex: ExpertWeights) -> PreparedExpert:
    """ex checked (uint8, C-contiguous, the shapes of one hidden x inter expert) once, for many calls."""
    if len(ex) != 6:
        raise ValueError("expert: expected ExpertWeights(w1, s1, w3, s3, w2, s2)")
    w1, w2 = ex[0], ex[4]
    if not isinstance(w1, np.ndarray) or w1.ndim != 2 or not isinstance(w2, np.ndarray) or w2.ndim != 2:
        raise ValueError("expert: w1 and w2 must be 2-D uint8 arrays [inter, hidden//2], [hidden, inter//2]")
    hidden, inter = w2.shape[0], w1.shape[0]
    _check_dims(1, hidden, inter)
    bufs = []
    for field, shape, a in zip(_EXPERT_FIELDS, _expert_specs(hidden, inter), ex):
        _arr(f"expert.{field}", a, _U8, shape)
        bufs.append(ffi.from_buffer("uint8_t[]", a))
    return PreparedExpert(ExpertWeights(*ex), tuple(bufs), hidden, inter)


def _expert_buffers(e: int, ex, hidden: int, inter: int, ce, keep: list) -> None:
    """Check expert e's six arrays and point the native struct ce (ds4f_expert or
    ds4f_expert_tokens) at them; the buffers go to keep, which must outlive the call. A
    PreparedExpert was checked when it was made: its buffers are used as they are."""
    if type(ex) is PreparedExpert:
        if ex.hidden != hidden or ex.inter != inter:
            raise ValueError(f"experts[{e}]: prepared for {ex.hidden}x{ex.inter}, this call is {hidden}x{inter}")
        keep.append(ex)
        ce.w1, ce.s1, ce.w3, ce.s3, ce.w2, ce.s2 = ex.bufs
        return
    if len(ex) != 6:
        raise ValueError(f"experts[{e}]: expected ExpertWeights(w1, s1, w3, s3, w2, s2)")
    for field, shape, a in zip(_EXPERT_FIELDS, _expert_specs(hidden, inter), ex):
        # fast path first (called once per layer per token); the full check names the culprit
        if type(a) is not np.ndarray or a.dtype != _U8 or a.shape != shape or not a.flags.c_contiguous:
            _arr(f"experts[{e}].{field}", a, _U8, shape)
        buf = ffi.from_buffer("uint8_t[]", a)
        keep.append(buf)
        setattr(ce, field, buf)


def _experts_args(experts: Sequence[ExpertWeights], weights, x: np.ndarray, out, out_name: str, each: bool,
                  scratch: np.ndarray):
    """The checks experts_forward and experts_forward_each share; returns the native expert array
    (with the buffers that must outlive the call), hidden and inter.  out is [hidden], or
    [n, hidden] when each."""
    n = len(experts)
    if not isinstance(x, np.ndarray) or x.ndim != 1:
        raise ValueError("x: expected a 1-D float32 array [hidden]")
    hidden = x.shape[0]
    if n == 0:
        raise ValueError(f"experts: expected 1..{MAX_EXPERTS} experts, got 0")
    w1 = experts[0][0]
    if not isinstance(w1, np.ndarray) or w1.ndim != 2:
        raise ValueError("experts[0].w1: expected a 2-D uint8 array [inter, hidden//2]")
    inter = w1.shape[0]
    _check_dims(n, hidden, inter)
    if len(weights) != n:
        raise ValueError(f"weights: expected {n} routing weights (one per expert), got {len(weights)}")
    _arr("x", x, _F32, (hidden,))
    _arr(out_name, out, _F32, (n, hidden) if each else (hidden,), writable=True)
    need = int(lib.ds4f_experts_scratch_floats(n, hidden, inter))
    if not isinstance(scratch, np.ndarray) or scratch.dtype != _F32 or not scratch.flags.c_contiguous:
        raise ValueError("scratch: expected a C-contiguous float32 array (see experts_scratch)")
    if not scratch.flags.writeable:
        raise ValueError("scratch: array is read-only")
    if scratch.size < need:
        raise ValueError(f"scratch: holds {scratch.size} floats, {n} experts of {hidden}x{inter} need {need}")
    if np.may_share_memory(scratch, out) or np.may_share_memory(scratch, x):
        raise ValueError(f"scratch: must not overlap x or {out_name}")

    cex = ffi.new("ds4f_expert[]", n)
    keep = []  # the from_buffer objects must outlive the call
    for e, ex in enumerate(experts):
        ce = cex[e]
        _expert_buffers(e, ex, hidden, inter, ce, keep)
        try:
            ce.weight = float(weights[e])
        except (TypeError, ValueError):
            raise ValueError(f"weights[{e}]: expected a number, got {weights[e]!r}") from None
    return (cex, keep), hidden, inter


def experts_forward(
    experts: Sequence[ExpertWeights],
    weights,
    x: np.ndarray,
    limit: float,
    out: np.ndarray,
    scratch: np.ndarray,
) -> np.ndarray:
    """out[hidden] = sum over experts e (in order) of
    w2_e . (silu(min(w1_e.x, limit)) * clip(w3_e.x, -limit, limit) * weights[e]).

    Expert-parallel on the native pool; nothing is allocated in C.  Returns out."""
    (cex, _keep), hidden, inter = _experts_args(experts, weights, x, out, "out", False, scratch)
    rc = lib.ds4f_experts_forward(
        cex, len(experts), _ptr("float[]", x), hidden, inter, float(limit), _ptr("float[]", out),
        _ptr("float[]", scratch),
    )
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("experts_forward: the native kernel rejected its arguments")
    return out


def experts_forward_each(
    experts: Sequence[ExpertWeights],
    weights,
    x: np.ndarray,
    limit: float,
    out_each: np.ndarray,
    scratch: np.ndarray,
) -> np.ndarray:
    """out_each[e] = w2_e . (silu(min(w1_e.x, limit)) * clip(w3_e.x, -limit, limit) * weights[e]),
    float32 [n, hidden]: experts_forward without the sum, so the caller can sum experts computed
    in different calls in an order of its own.  Summing the rows in order 0..n-1 in float32 gives
    experts_forward's out bit for bit.  Returns out_each."""
    (cex, _keep), hidden, inter = _experts_args(experts, weights, x, out_each, "out_each", True, scratch)
    rc = lib.ds4f_experts_forward_each(
        cex, len(experts), _ptr("float[]", x), hidden, inter, float(limit), _ptr("float[]", out_each),
        _ptr("float[]", scratch),
    )
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("experts_forward_each: the native kernel rejected its arguments")
    return out_each


# ---- several vectors at once ----------------------------------------------------------------
#
# The multi-token kernels: x holds n input vectors as rows [n, k], the result one row per vector
# [n, rows].  Each weight block is decoded once per call (per 32 vectors) and applied to all of
# them, and row t of the result is bit-identical to the single-vector kernel on x[t] with the same
# backend, whatever n and the thread count: batching never changes a result.


def _x_rows(x, k: int) -> int:
    """n of an input batch x [n, k] (float32, C-contiguous)."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        got = x.shape if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"x: expected a 2-D float32 array [n, {k}] (one input vector per row), got {got}")
    _arr("x", x, _F32, (x.shape[0], k))
    return x.shape[0]


def _scratch(scratch, need: int, what: str, *others: np.ndarray) -> np.ndarray:
    """The caller's float32 work buffer (checked), or a new one when scratch is None."""
    if scratch is None:
        return np.empty(max(need, 1), _F32)
    if not isinstance(scratch, np.ndarray) or scratch.dtype != _F32 or not scratch.flags.c_contiguous:
        raise ValueError(f"scratch: expected a C-contiguous float32 array (see {what})")
    if not scratch.flags.writeable:
        raise ValueError("scratch: array is read-only")
    if scratch.size < need:
        raise ValueError(f"scratch: holds {scratch.size} floats, this call needs {need} (see {what})")
    for a in others:
        if np.may_share_memory(scratch, a):
            raise ValueError("scratch: must not overlap the inputs or the output")
    return scratch


def matmul_scratch(n: int, k: int) -> np.ndarray:
    """The float32 work buffer a multi-token matmul of n vectors of length k needs (the same size
    for every backend and format): allocate once, reuse."""
    return np.empty(max(int(lib.ds4f_matmul_scratch_floats(n, k)), 1), _F32)


class PreparedMatrix:
    """A weight checked once and its native pointers kept (prepare_mxfp4 / prepare_bf16 /
    prepare_fp8), for many products: matmul then checks only x, out and scratch. The arrays stay
    exported (alive, unresizable) while it lives."""

    __slots__ = ("fn", "args", "rows", "k", "kind")

    def __init__(self, fn, args: tuple, rows: int, k: int, kind: int) -> None:
        self.fn, self.args, self.rows, self.k, self.kind = fn, args, rows, k, kind


def prepare_mxfp4(codes: np.ndarray, scales: np.ndarray) -> PreparedMatrix:
    rows, k = _mxfp4_shape(codes, scales)
    return PreparedMatrix(lib.ds4f_mxfp4_matmul, (_ptr("uint8_t[]", codes), _ptr("uint8_t[]", scales)), rows, k,
                          lib.DS4F_MM_MXFP4)


def prepare_bf16(w: np.ndarray) -> PreparedMatrix:
    rows, k = _bf16_shape(w)
    return PreparedMatrix(lib.ds4f_bf16_matmul, (_ptr("uint16_t[]", w.view(_U16)),), rows, k, lib.DS4F_MM_BF16)


def prepare_fp8(w: np.ndarray, scales: np.ndarray) -> PreparedMatrix:
    rows, k = _fp8_shape(w, scales)
    return PreparedMatrix(lib.ds4f_fp8_matmul, (_ptr("uint8_t[]", w.view(_U8)), _ptr("uint8_t[]", scales.view(_U8))),
                          rows, k, lib.DS4F_MM_FP8)


class MatmulGroup:
    """Prepared matrices applied to the same vectors in one native call (ds4f_matmul_group): matrix
    i reads columns x_col .. x_col + k of each row of x [n, ldx] and writes columns y_col .. y_col +
    rows of out [n, ldy], each row bit for bit its own product (see matmul_group). Built once per
    set of weights: the call then checks only x, out and scratch."""

    __slots__ = ("items", "count", "ldx", "ldy", "kmax", "mats")

    def __init__(self, parts: Sequence[tuple[PreparedMatrix, int, int]], ldx: int, ldy: int) -> None:
        if not 0 < len(parts) <= lib.DS4F_GROUP_MAX:
            raise ValueError(f"a group holds 1 to {lib.DS4F_GROUP_MAX} matrices, not {len(parts)}")
        taken = []
        for i, (m, x_col, y_col) in enumerate(parts):
            if not (isinstance(m, PreparedMatrix) and 0 <= x_col and x_col + m.k <= ldx and 0 <= y_col
                    and y_col + m.rows <= ldy):
                raise ValueError(f"group matrix {i}: its columns fall outside x's {ldx} or out's {ldy}")
            for a, b in taken:
                if y_col < b and a < y_col + m.rows:
                    raise ValueError(f"group matrix {i}: its output columns overlap another matrix's")
            taken.append((y_col, y_col + m.rows))
        self.items = ffi.new("ds4f_matrix[]", len(parts))
        for item, (m, x_col, y_col) in zip(self.items, parts):
            item.kind, item.w = m.kind, m.args[0]
            item.scales = m.args[1] if len(m.args) > 1 else ffi.NULL
            item.rows, item.k, item.x_col, item.y_col = m.rows, m.k, x_col, y_col
        self.count, self.ldx, self.ldy = len(parts), ldx, ldy
        self.kmax = max(m.k for m, _, _ in parts)
        self.mats = tuple(m for m, _, _ in parts)   # their arrays stay exported while the group lives


def matmul_group(g: MatmulGroup, x: np.ndarray, out: np.ndarray | None = None,
                 scratch: np.ndarray | None = None) -> np.ndarray:
    """out [n, ldy] float32 with each matrix's products of x [n, ldx] float32 in its columns (see
    MatmulGroup); the columns no matrix writes are left as they were.  Matrix i's block of row t
    equals matmul(matrix i, the slice of x[t]) bit for bit.  scratch: see matmul_scratch with the
    group's largest k (None: allocated for this call)."""
    n = x.shape[0] if type(x) is np.ndarray and x.ndim == 2 else -1
    if n < 0 or x.dtype != _F32 or x.shape[1] != g.ldx or not x.flags.c_contiguous:
        n = _x_rows(x, g.ldx)
    need = int(lib.ds4f_matmul_scratch_floats(n, g.kmax))
    if out is None or not _plain(out, (n, g.ldy)):
        out = _out("out", out, (n, g.ldy))
    if scratch is None or not (type(scratch) is np.ndarray and scratch.dtype == _F32 and scratch.size >= need
                               and scratch.flags.c_contiguous and scratch.flags.writeable):
        scratch = _scratch(scratch, need, "matmul_scratch")
    if np.may_share_memory(out, x):
        raise ValueError("out: must not overlap x")
    if np.may_share_memory(scratch, x) or np.may_share_memory(scratch, out):
        raise ValueError("scratch: must not overlap the inputs or the output")
    rc = lib.ds4f_matmul_group(g.items, g.count, n, ffi.from_buffer("float[]", x), g.ldx,
                               ffi.from_buffer("float[]", out), g.ldy, ffi.from_buffer("float[]", scratch))
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("matmul_group: the native kernel rejected its arguments")
    return out


def _plain(a, shape: tuple) -> bool:
    """a is a C-contiguous, writeable float32 ndarray of `shape` (the common case, checked in one line)."""
    return type(a) is np.ndarray and a.dtype == _F32 and a.shape == shape and a.flags.c_contiguous and a.flags.writeable


def matmul(m: PreparedMatrix, x: np.ndarray, out: np.ndarray | None = None,
           scratch: np.ndarray | None = None) -> np.ndarray:
    """out[t] = W . x[t] for a prepared W [rows, k] and float32 x [n, k]; out is float32 [n, rows].
    Row t equals the single-vector product of x[t] bit for bit.  scratch: see matmul_scratch
    (None: allocated for this call)."""
    k = m.k
    n = x.shape[0] if type(x) is np.ndarray and x.ndim == 2 else -1
    if n < 0 or x.dtype != _F32 or x.shape[1] != k or not x.flags.c_contiguous:
        n = _x_rows(x, k)
    need = int(lib.ds4f_matmul_scratch_floats(n, k))
    if out is None or scratch is None or not (_plain(out, (n, m.rows)) and type(scratch) is np.ndarray
                                              and scratch.dtype == _F32 and scratch.size >= need
                                              and scratch.flags.c_contiguous and scratch.flags.writeable):
        out = _out("out", out, (n, m.rows))
        scratch = _scratch(scratch, need, "matmul_scratch")
    if np.may_share_memory(out, x):
        raise ValueError("out: must not overlap x")
    if np.may_share_memory(scratch, x) or np.may_share_memory(scratch, out):
        raise ValueError("scratch: must not overlap the inputs or the output")
    rc = m.fn(*m.args, m.rows, k, n, ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", out),
              ffi.from_buffer("float[]", scratch))
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("matmul: the native kernel rejected its arguments")
    return out


def mxfp4_matmul(codes: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray | None = None,
                 scratch: np.ndarray | None = None) -> np.ndarray:
    """out[t] = W . x[t] for MXFP4 W [rows, k] and float32 x [n, k]; out is float32 [n, rows].
    Row t equals mxfp4_matvec(codes, scales, x[t]) bit for bit.  scratch: see matmul_scratch
    (None: allocated for this call)."""
    return matmul(prepare_mxfp4(codes, scales), x, out, scratch)


def bf16_matmul(w: np.ndarray, x: np.ndarray, out: np.ndarray | None = None,
                scratch: np.ndarray | None = None) -> np.ndarray:
    """out[t] = W . x[t] for bf16 W [rows, k] (ml_dtypes.bfloat16 or uint16 bits) and float32
    x [n, k]; row t equals bf16_matvec(w, x[t]) bit for bit."""
    return matmul(prepare_bf16(w), x, out, scratch)


def fp8_matmul(w: np.ndarray, scales: np.ndarray, x: np.ndarray, out: np.ndarray | None = None,
               scratch: np.ndarray | None = None) -> np.ndarray:
    """out[t] = W . x[t] for FP8 W [rows, k] (E4M3, E8M0 scales per 128x128 tile) and float32
    x [n, k]; row t equals fp8_matvec(w, scales, x[t]) bit for bit (NaN rows included)."""
    return matmul(prepare_fp8(w, scales), x, out, scratch)


def experts_tokens_scratch(pairs: int, hidden: int, inter: int) -> np.ndarray:
    """The float32 work buffer experts_forward_tokens needs for `pairs` (token, expert) pairs."""
    _check_dims(1, hidden, inter)
    return np.empty(max(int(lib.ds4f_experts_tokens_scratch_floats(pairs, hidden, inter)), 1), _F32)


def experts_forward_tokens(
    experts: Sequence[ExpertWeights],
    tokens: Sequence,
    weights: Sequence,
    x: np.ndarray,
    limit: float,
    out: np.ndarray | None = None,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """Routed experts applied to the tokens routed to them, each expert read once for all of
    its tokens: x is float32 [n_tokens, hidden]; tokens[e] lists the rows of x expert e applies
    to and weights[e] their routing weights.  out [pairs, hidden] (pairs = all the tokens
    lists' lengths added) gets one row per pair, expert by expert in order and within an
    expert in its tokens' order:
        w2_e . (silu(min(w1_e.x[t], limit)) * clip(w3_e.x[t], -limit, limit) * weight),
    bit-identical to experts_forward_each's row for that expert, token and weight.  scratch: see
    experts_tokens_scratch (None: allocated for this call).  Returns out.  (experts_forward_pairs
    with the lists joined.)"""
    n = len(experts)
    if len(tokens) != n or len(weights) != n:
        raise ValueError(f"tokens, weights: expected one list per expert ({n}), got {len(tokens)} and {len(weights)}")
    ts = [np.asarray(t) for t in tokens]
    for e, (t, wt) in enumerate(zip(ts, weights)):
        if t.ndim != 1 or (t.size and not np.issubdtype(t.dtype, np.integer)):
            raise ValueError(f"tokens[{e}]: expected a 1-D array of row indices into x, got {t.dtype} {t.shape}")
        if np.shape(wt) != t.shape:
            raise ValueError(f"weights[{e}]: expected {t.size} routing weights (one per token), got shape"
                             f" {np.shape(wt)}")
        if t.size and isinstance(x, np.ndarray) and x.ndim == 2 and (t.min() < 0 or t.max() >= len(x)):
            raise ValueError(f"tokens[{e}]: row indices must be in 0..{len(x) - 1} (x has {len(x)} rows)")
    wl = []
    for e, w in enumerate(weights):
        try:
            wl.append(np.asarray(w, dtype=_F32).ravel())
        except (TypeError, ValueError):
            raise ValueError(f"weights[{e}]: expected numbers, got {np.asarray(w).dtype}") from None
    wts = np.concatenate(wl) if n else np.empty(0, _F32)
    rows = np.concatenate([t.astype(np.int64).ravel() for t in ts]) if n else np.empty(0, np.int64)
    return experts_forward_pairs(experts, [t.size for t in ts], rows, wts, x, limit, out, scratch)


def experts_forward_pairs(
    experts: Sequence[ExpertWeights],
    counts: Sequence[int],
    rows: np.ndarray,
    weights: np.ndarray,
    x: np.ndarray,
    limit: float,
    out: np.ndarray | None = None,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """experts_forward_tokens with the (token, expert) pairs as flat arrays, expert by expert:
    expert e takes the next counts[e] entries of rows (int, rows of x [n_tokens, hidden]) and
    weights (float32, their routing weights).  out [pairs, hidden] row i is pair i's output (same
    expression and bits).  Checks the arrays once, whatever the number of experts."""
    n = len(experts)
    if n == 0:
        raise ValueError("experts: expected at least one expert")
    if len(counts) != n:
        raise ValueError(f"counts: expected one per expert ({n}), got {len(counts)}")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError("x: expected a 2-D float32 array [n_tokens, hidden]")
    ntok, hidden = x.shape
    w1 = experts[0][0]
    if not isinstance(w1, np.ndarray) or w1.ndim != 2:
        raise ValueError("experts[0].w1: expected a 2-D uint8 array [inter, hidden//2]")
    inter = w1.shape[0]
    _check_dims(1, hidden, inter)
    _arr("x", x, _F32, (ntok, hidden))
    pairs = int(sum(counts))
    if min(counts) < 0 or not isinstance(rows, np.ndarray) or rows.shape != (pairs,) or \
            not isinstance(weights, np.ndarray) or weights.shape != (pairs,):
        raise ValueError(f"rows, weights: expected {pairs} entries each (the counts added), one per pair")
    if pairs and (rows.min() < 0 or rows.max() >= ntok):
        raise ValueError(f"rows: row indices must be in 0..{ntok - 1} (x has {ntok} rows)")
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    weights = np.ascontiguousarray(weights, dtype=_F32)
    cex = ffi.new("ds4f_expert_tokens[]", n)
    bt, bw = ffi.from_buffer("int32_t[]", rows), ffi.from_buffer("float[]", weights)
    keep = [bt, bw]
    at = 0
    for e, ex in enumerate(experts):
        ce = cex[e]
        _expert_buffers(e, ex, hidden, inter, ce, keep)
        ce.tokens, ce.weights, ce.n = bt + at, bw + at, counts[e]
        at += counts[e]
    out = _out("out", out, (pairs, hidden))
    if np.may_share_memory(out, x):
        raise ValueError("out: must not overlap x")
    need = int(lib.ds4f_experts_tokens_scratch_floats(pairs, hidden, inter))
    scratch = _scratch(scratch, need, "experts_tokens_scratch", x, out)
    rc = lib.ds4f_experts_forward_tokens(cex, n, _ptr("float[]", x), ntok, hidden, inter, float(limit),
                                         _ptr("float[]", out), _ptr("float[]", scratch))
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("experts_forward_tokens: the native kernel rejected its arguments")
    return out


def hc_mix(x: np.ndarray, fn_t: np.ndarray, eps: float) -> np.ndarray:
    """The hyper-connections' mix of n tokens: x float32 [n, k] (each token's streams, flattened),
    fn_t float32 [k, rows] (the mix matrix transposed; widened exactly in the kernel); float64
    [n, rows], row t = fn_t.T . (x[t] / sqrt(mean(x[t]^2) + eps)) in float64, every sum one fused
    multiply-add per element in element order (ds4f_kernels.h): the same bits on every backend,
    at every n."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError("x: expected a 2-D float32 array [n, k]")
    n, k = x.shape
    if k == 0:
        raise ValueError("x: k = 0 (a token needs at least one value)")
    if not isinstance(fn_t, np.ndarray) or fn_t.ndim != 2 or fn_t.shape[0] != k or fn_t.shape[1] == 0:
        got = fn_t.shape if isinstance(fn_t, np.ndarray) else type(fn_t).__name__
        raise ValueError(f"fn_t: expected a float32 array [{k}, rows], got {got}")
    _arr("x", x, _F32, (n, k))
    _arr("fn_t", fn_t, _F32, fn_t.shape)
    rows = fn_t.shape[1]
    out = np.empty((n, rows), np.float64)
    scratch = np.empty(int(lib.ds4f_hc_mix_scratch_doubles(k, rows)), np.float64)
    rc = lib.ds4f_hc_mix(_ptr("float[]", x), n, k, _ptr("float[]", fn_t), rows, float(eps),
                         _ptr("double[]", out), _ptr("double[]", scratch))
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("hc_mix: the native kernel rejected its arguments")
    return out


def hc_pre(X: np.ndarray, fn_t: np.ndarray, base: np.ndarray, scale: np.ndarray, eps: float, hc_eps: float,
           iters: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The hyper-connection before a sublayer for n tokens' streams X float32 [n, N, hidden]: (h
    float32 [n, hidden], post float64 [n, N], comb float64 [n, N, N]) (ds4f_kernels.h's ds4f_hc_pre;
    engine/model/hyper.py's docstring). fn_t float32 [N hidden, rows] as for hc_mix, base float32
    [rows], scale float32 [3]; rows = N (the head's reduction): post and comb are None."""
    if not isinstance(X, np.ndarray) or X.ndim != 3:
        raise ValueError("X: expected a 3-D float32 array [n, N, hidden]")
    n, N, hidden = X.shape
    _arr("X", X, _F32, (n, N, hidden))
    if not isinstance(fn_t, np.ndarray) or fn_t.ndim != 2 or fn_t.shape[0] != N * hidden:
        raise ValueError(f"fn_t: expected a float32 array [{N * hidden}, rows]")
    rows = fn_t.shape[1]
    if rows not in (N, (2 + N) * N):
        raise ValueError(f"fn_t: {rows} rows; a hyper-connection of {N} streams has {(2 + N) * N} (the head: {N})")
    _arr("fn_t", fn_t, _F32, (N * hidden, rows))
    _arr("base", base, _F32, (rows,))
    _arr("scale", scale, _F32, (3,) if rows != N else scale.shape)
    if scale.size < 1 or iters < 1:
        raise ValueError("scale, iters: at least one each")
    h = np.empty((n, hidden), np.float32)
    pre = np.empty((n, N), np.float64)
    whole = rows != N
    post = np.empty((n, N), np.float64) if whole else None
    comb = np.empty((n, N, N), np.float64) if whole else None
    scratch = np.empty(int(lib.ds4f_hc_pre_scratch_doubles(n, N * hidden, rows)), np.float64)
    null = ffi.NULL
    rc = lib.ds4f_hc_pre(_ptr("float[]", X), n, N, hidden, _ptr("float[]", fn_t), rows, _ptr("float[]", base),
                         _ptr("float[]", scale), float(eps), float(hc_eps), int(iters), _ptr("float[]", h),
                         _ptr("double[]", pre), _ptr("double[]", post) if whole else null,
                         _ptr("double[]", comb) if whole else null, _ptr("double[]", scratch))
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("hc_pre: the native kernel rejected its arguments")
    return h, post, comb


def hc_post(X: np.ndarray, Y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """The hyper-connection after a sublayer, in place on n tokens' streams X float32 [n, N, hidden]:
    X[k] = sum_j comb[j, k] X[j] + post[k] Y (ds4f_kernels.h's ds4f_hc_post), Y float32 [n, hidden],
    post float64 [n, N], comb float64 [n, N, N]. Returns X."""
    if not isinstance(X, np.ndarray) or X.ndim != 3:
        raise ValueError("X: expected a 3-D float32 array [n, N, hidden]")
    n, N, hidden = X.shape
    _arr("X", X, _F32, (n, N, hidden), writable=True)
    _arr("Y", Y, _F32, (n, hidden))
    _arr("post", post, np.dtype(np.float64), (n, N))
    _arr("comb", comb, np.dtype(np.float64), (n, N, N))
    if N > 64:
        raise ValueError(f"X: {N} streams; at most 64")
    rc = lib.ds4f_hc_post(_ptr("float[]", X), n, N, hidden, _ptr("float[]", Y), _ptr("double[]", post),
                          _ptr("double[]", comb))
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("hc_post: the native kernel rejected its arguments")
    return X


def rms_rows(x: np.ndarray, eps: float, weight: np.ndarray | None = None,
             out: np.ndarray | None = None) -> np.ndarray:
    """Each row of x float32 [n, d] over sqrt(mean(row^2) + eps), in float64 and rounded to float32
    once; with weight float32 [d], that times the weight in float32 (ds4f_kernels.h's
    ds4f_rms_rows). numpy's bits for
        x64 = x.astype(np.float64)
        y = (x64 / np.sqrt(np.add.reduce(np.square(x64), axis=-1, keepdims=True) / d + eps)).astype(np.float32)
        y * weight
    on every backend and thread count. out float32 [n, d] (None: a new array) may be x itself."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        got = x.shape if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"x: expected a 2-D float32 array [n, d], got {got}")
    n, d = x.shape
    if d == 0:
        raise ValueError("x: d = 0 (a row needs at least one value)")
    _arr("x", x, _F32, (n, d))
    if weight is not None:
        _arr("weight", weight, _F32, (d,))
    if out is None:
        out = np.empty((n, d), _F32)
    else:
        _arr("out", out, _F32, (n, d), writable=True)
        if out is not x and np.may_share_memory(out, x) and out.ctypes.data != x.ctypes.data:
            raise ValueError("out: overlaps x without being x (each row is read whole before it is written)")
    rc = lib.ds4f_rms_rows(_ptr("float[]", x), n, d, float(eps),
                           _ptr("float[]", weight) if weight is not None else ffi.NULL, _ptr("float[]", out))
    if rc != 0:  # unreachable after the checks above; kept as a guard
        raise ValueError("rms_rows: the native kernel rejected its arguments")
    return out


_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)


def attention_rows(q: np.ndarray, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray, win_first: np.ndarray,
                   n_win: np.ndarray, comp: list[np.ndarray], part: np.ndarray, n_comp: np.ndarray,
                   sel_first: np.ndarray | None, sel: np.ndarray | None, sinks: np.ndarray, scale: float,
                   out: np.ndarray | None = None) -> np.ndarray:
    """The attention core of n rows (ds4f_kernels.h's ds4f_attention_rows): q float32 [n, H, head_dim]
    (RoPE not applied), cos and sin float32 [n, rope_dim / 2] (each row's angles), keys float32
    [rows, head_dim] (row t's window: keys[win_first[t]:win_first[t] + n_win[t]]), comp a list of
    float32 [rows, head_dim] (row t's compressed rows: comp[part[t]][:n_comp[t]], or where sel_first
    is given and sel_first[t] >= 0, comp[part[t]][sel[sel_first[t]:sel_first[t] + n_comp[t]]]),
    sinks float32 [H]. Returns out float32 [n, H, head_dim], inverse RoPE applied."""
    if not isinstance(q, np.ndarray) or q.ndim != 3:
        raise ValueError("q: expected a 3-D float32 array [n, heads, head_dim]")
    n, H, hd = q.shape
    _arr("q", q, _F32, (n, H, hd))
    if not isinstance(cos, np.ndarray) or cos.ndim != 2 or cos.shape[0] != n or 2 * cos.shape[1] > hd:
        raise ValueError(f"cos: expected a float32 array [{n}, rope_dim / 2] with rope_dim <= {hd}")
    half = cos.shape[1]
    _arr("cos", cos, _F32, (n, half))
    _arr("sin", sin, _F32, (n, half))
    if not isinstance(keys, np.ndarray) or keys.ndim != 2:
        raise ValueError(f"keys: expected a float32 array [rows, {hd}]")
    _arr("keys", keys, _F32, (len(keys), hd))
    _arr("win_first", win_first, _I64, (n,))
    _arr("n_win", n_win, _I32, (n,))
    _arr("part", part, _I32, (n,))
    _arr("n_comp", n_comp, _I32, (n,))
    _arr("sinks", sinks, _F32, (H,))
    for i, c in enumerate(comp):
        if not isinstance(c, np.ndarray) or c.ndim != 2:
            raise ValueError(f"comp[{i}]: expected a float32 array [rows, {hd}]")
        _arr(f"comp[{i}]", c, _F32, (len(c), hd))
    if sel_first is not None:
        _arr("sel_first", sel_first, _I64, (n,))
        if not isinstance(sel, np.ndarray) or sel.ndim != 1:
            raise ValueError("sel: expected a 1-D int32 array")
        _arr("sel", sel, _I32, sel.shape)
    out = _out("out", out, (n, H, hd)).reshape(n, H, hd)
    a = ffi.new("ds4f_attention_rows_args *")
    keep = [_ptr("float[]", c) for c in comp]
    comps = ffi.new("float *[]", keep or [ffi.NULL])
    a.n, a.heads, a.head_dim, a.rope_half = n, H, hd, half
    a.q, a.cos, a.sin, a.keys = _ptr("float[]", q), _ptr("float[]", cos), _ptr("float[]", sin), _ptr("float[]", keys)
    a.win_first, a.n_win = _ptr("int64_t[]", win_first), _ptr("int32_t[]", n_win)
    a.comp, a.part, a.n_comp = comps, _ptr("int32_t[]", part), _ptr("int32_t[]", n_comp)
    a.sel_first = _ptr("int64_t[]", sel_first) if sel_first is not None else ffi.NULL
    a.sel = _ptr("int32_t[]", sel) if sel_first is not None else ffi.NULL
    a.sinks, a.scale, a.out = _ptr("float[]", sinks), float(scale), _ptr("float[]", out)
    rows = ffi.new("int64_t[]", [len(c) for c in comp] or [0])
    a.n_keys, a.n_parts, a.n_sel, a.comp_rows = len(keys), len(comp), len(sel) if sel_first is not None else 0, rows
    rc = lib.ds4f_attention_rows(a) if n else 0
    if rc != 0:   # the index arrays, checked in C against the sizes before anything is read
        raise ValueError(_ATTENTION_ERRORS.get(rc, "attention_rows: the native kernel rejected its arguments"))
    return out


_ATTENTION_ERRORS = {
    -2: "n_win, n_comp: every row needs at least one key",
    -3: "win_first, n_win: a row's window runs outside keys",
    -4: "part: a row names no compressed rows",
    -5: "sel_first, n_comp: a row's selection runs outside sel",
    -6: "sel: a row selects a compressed row its part does not hold",
    -7: "n_comp: a row attends to more compressed rows than its part holds",
}


def _check_env() -> None:
    want = os.environ.get("DS4F_KERNELS")
    if want and want != "auto":
        if want not in BACKENDS:
            warnings.warn(f"DS4F_KERNELS={want!r} is not a kernel backend; using {get_backend()}", stacklevel=3)
        elif want not in available_backends():
            warnings.warn(f"DS4F_KERNELS={want!r} is not supported on this machine; using {get_backend()}", stacklevel=3)


_check_env()
