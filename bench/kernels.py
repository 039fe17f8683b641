"""Kernel benchmark on the real shapes: every available backend, 1 thread and all cores, against
scalar, against a numpy baseline (table decode + np.dot) and against the memory floor, all
measured in the same run.

The memory floor ("memory" records) is what RAM delivers to a plain streaming read of a buffer
well beyond the last-level cache (max(1 GiB, 2x LLC)), with the loads of each backend's width
(64-bit scalar, AVX2, AVX-512, NEON) on the kernels' own thread pool (native/membench.c); every
kernel record carries fraction_of_floor = its GB/s / the floor's GB/s at the same backend and
thread count (on the same kind of pages for cold cases; on the first --pages kind otherwise).
Hot cases reuse one set of weights call after call (they sit in the caches); cold cases cycle
through distinct copies whose working set exceeds 2x the LLC, so every timed call reads its
weights from RAM: 6 routed experts at the real shape (experts_forward), and FP8 matvec over the
attention projections.  Cold buffers are allocated on transparent huge pages, 4 KiB pages or
both (`pages`), one working set at a time.

The FMA peak ("fma" records) is what the backend's vector unit retires on 12 independent
multiply-add chains of its width and nothing else, on the same pool: G multiply-add lanes per
second (a fused multiply-add on the SIMD backends; a multiply and an add on scalar, which never
fuses).  Every kernel that does one multiply-add lane per weight and vector (the matvecs, the
experts, the multi-token kernels) carries fraction_of_fma_peak = its Gw/s / that peak, and wall:
"memory" when it reads at MEMORY_WALL (0.7) of the floor or more, else "compute" (then the FMA
fraction says how much of the core the products themselves take; the rest is decoding).

The "multi" records compare the multi-token kernels (several input vectors per call, each weight
decoded once) with as many single-vector calls on the same vectors, measured in turn in the same
run: MXFP4, bf16 and FP8 at 1, 8 and 32 vectors; their Gw/s count every weight once per vector.

Figures: median wall time of `repeat` calls, each after an untimed call at the same setting,
with the thread counts measured in turn (time.perf_counter).
G weights/s = matrix elements processed per second; GB/s = weight bytes read per second
(MXFP4: k/2 code bytes + k/32 scale bytes per row; bf16: 2 bytes per element; FP8: 1 byte per
element + one E8M0 byte per 128x128 tile; memory: the bytes read).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np

from ds4f.native import kernels as K
from ds4f.engine.checkpoint.formats import E2M1_VALUES, E4M3
from ds4f.engine.runtime.memory import available_bytes, huge_page_bytes, llc_bytes, page_buffer
from ds4f.native._kernels import ffi, lib

SHAPES = ((2048, 4096), (4096, 2048))  # w1/w3 (inter x hidden) and w2 (hidden x inter)
HIDDEN, INTER, N_EXPERTS = 4096, 2048, 6
# the attention projections in FP8: wq_a, wkv... as [rows, k]: q_a (1024x4096), q_b (32768x1024),
# kv (512x4096) and o (4096x8192)
FP8_SHAPES = ((1024, 4096), (32768, 1024), (512, 4096), (4096, 8192))
FP8_TILE = 128
KERNELS = ("memory", "fma", "decode", "matvec", "bf16_matvec", "experts", "fp8_matvec", "multi")
# the kernels that do one multiply-add lane per weight and vector, whose Gw/s is held to the FMA peak
FMA_KERNELS = ("matvec", "bf16_matvec", "experts", "fp8_matvec", "multi")
MEMORY_WALL = 0.7           # a kernel reading at this fraction of the floor or more stands at the memory wall
FMA_ITERS = 1 << 21         # per task of the FMA peak: 12 chains x 2^21 multiply-adds (~5 ms on one core)
# the multi-token kernels against single-vector calls: (format, rows, k) at MULTI_TOKENS vectors
MULTI_CASES = (("mxfp4", 2048, 4096), ("mxfp4", 4096, 2048), ("bf16", 2048, 4096), ("fp8", 1024, 4096))
MULTI_TOKENS = (1, 2, 4, 8, 32)   # 2, 4: a few sequences decoded together, an expert a few rows chose
COLD_KERNELS = ("experts", "fp8_matvec")
CASES = ("hot", "cold", "all")
PAGES = ("huge", "normal", "both")

FLOOR_MIN_BYTES = 1 << 30
MEMORY_CAP = 3 << 29        # 1.5 GiB: the largest buffer (floor or one cold working set) held at a time
ASSUMED_LLC = 32 << 20      # when neither sysfs nor sysconf knows the LLC
BLAS_SETTLE_S = 0.25        # after a numpy baseline: OpenBLAS's threads spin ~0.1 s before they sleep


@dataclass
class Record:
    kernel: str
    shape: str
    backend: str
    threads: int
    median_s: float
    gb_per_s: float
    gweights_per_s: float | None
    speedup_vs_scalar: float | None = None
    speedup_vs_numpy: float | None = None
    speedup_vs_1thread: float | None = None
    cold: bool = False
    pages: str | None = None              # cold cases and the floor: "huge" or "normal"
    fraction_of_floor: float | None = None
    vs_hot_matvec: float | None = None    # experts: Gw/s / hot matvec Gw/s on the same shapes
    working_set_bytes: int | None = None  # bytes the case cycles through (cold cases, the floor)
    huge_page_bytes: int | None = None    # of those, backed by transparent huge pages
    tokens: int | None = None             # multi: input vectors per call
    single_gweights_per_s: float | None = None  # multi: the same vectors through single-vector calls
    vs_single: float | None = None        # multi: gweights_per_s / single_gweights_per_s
    glanes_per_s: float | None = None     # fma: G multiply-add lanes per second, the backend's peak
    fraction_of_fma_peak: float | None = None  # Gw/s (one multiply-add lane per weight) / the FMA peak
    wall: str | None = None               # "memory" (>= MEMORY_WALL of the floor) or "compute"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Case:
    kernel: str
    label: str
    nweights: int
    nbytes: int
    call: Callable[[int], object]                # argument: which copy of the weights (cold cases)
    baseline: Callable[[int], object] | None = None
    cold: bool = False
    pages: str | None = None
    copies: int = 1
    working_set: int | None = None
    huge_bytes: int | None = None
    keep: list = field(default_factory=list)     # buffers the calls use


# ---- timing ------------------------------------------------------------------------------------


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: page faults, pool start, caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved_times(call: Callable[[int], object], threads: list[int], repeat: int,
                       copies: int = 1) -> dict[int, float]:
    """Median time per thread count, the counts measured in turn within each repeat, so that
    load from other processes (a shared box) hits 1 thread and n threads alike.  Each timed
    call follows an untimed one at the same setting (pool threads started; for hot cases
    caches warm).  call(i) works on copy i % copies: cold cases move to the next copy at every
    call, so a copy comes back only after all the others have pushed it out of the caches."""
    times: dict[int, list[float]] = {nt: [] for nt in threads}
    i = 0
    for _ in range(repeat):
        for nt in threads:
            K.set_threads(nt)
            call(i % copies)
            t0 = time.perf_counter()
            call((i + 1) % copies)
            times[nt].append(time.perf_counter() - t0)
            i += 2
    return {nt: statistics.median(v) for nt, v in times.items()}


# ---- the memory floor --------------------------------------------------------------------------


def mem_read(buf: np.ndarray, backend: str) -> int:
    """One streaming read of `buf` (8-byte aligned, a multiple of 8 bytes) with `backend`'s load
    width on the kernels' pool; returns the wrap-around sum of its 64-bit words."""
    if buf.nbytes % 8 or buf.__array_interface__["data"][0] % 8 or not buf.flags.c_contiguous:
        raise ValueError("buf: expected a C-contiguous buffer, 8-byte aligned, a multiple of 8 bytes")
    total = ffi.new("uint64_t *")
    if lib.ds4f_mem_read(ffi.from_buffer(buf), buf.nbytes, K.BACKENDS.index(backend), total) != 0:
        raise ValueError(f"backend: {backend!r} is not available here")
    return int(total[0])


def _floor_records(nbytes: int, pages: str, backends: list[str], threads: list[int], repeat: int) -> list[Record]:
    buf, _thp = page_buffer(nbytes, pages)
    buf.fill(1)  # faults every page in; every 64-bit word is 0x0101010101010101
    want = (nbytes // 8) * 0x0101010101010101 % (1 << 64)
    huge = huge_page_bytes(buf)
    records = []
    scalar_t: dict[int, float] = {}
    for backend in backends:
        def call(_i: int, b=backend) -> None:
            if mem_read(buf, b) != want:
                raise RuntimeError(f"memory floor ({b}): the read loop's sum is wrong")

        times = _interleaved_times(call, threads, repeat)
        for nt in threads:
            t = times[nt]
            if backend == "scalar":
                scalar_t[nt] = t
            records.append(Record(
                "memory", f"{nbytes / 2**30:.2f} GiB read", backend, nt, t, nbytes / t / 1e9, None,
                scalar_t[nt] / t if nt in scalar_t else None, None, times[threads[0]] / t,
                cold=True, pages=pages, working_set_bytes=nbytes, huge_page_bytes=huge,
            ))  # fmt: skip
    del buf
    return records


# ---- the FMA peak -------------------------------------------------------------------------------


def fma_peak(backend: str) -> float:
    """One run of the FMA peak loop (native/membench.c) on the kernels' pool; returns the
    multiply-add lanes it computed."""
    lanes = ffi.new("double *")
    if lib.ds4f_fma_peak(K.BACKENDS.index(backend), FMA_ITERS, lanes) < 0:
        raise ValueError(f"backend: {backend!r} is not available here")
    return float(lanes[0])


def _fma_records(backends: list[str], threads: list[int], repeat: int) -> list[Record]:
    records = []
    for backend in backends:
        lanes: dict[int, float] = {}

        def call(_i: int, b=backend) -> None:
            lanes[K.get_threads()] = fma_peak(b)

        times = _interleaved_times(call, threads, repeat)
        per = lib.ds4f_fma_lanes(K.BACKENDS.index(backend))
        for nt in threads:
            t = times[nt]
            records.append(Record("fma", f"{per} lane{'s' if per > 1 else ''} per op", backend, nt, t, 0.0, None,
                                  speedup_vs_1thread=times[threads[0]] / t, glanes_per_s=lanes[nt] / t / 1e9))
    return records


# ---- numpy baselines ---------------------------------------------------------------------------


def np_decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    rows, half = codes.shape
    w = np.empty((rows, 2 * half), np.float32)
    w[:, 0::2] = E2M1_VALUES[codes & 15]
    w[:, 1::2] = E2M1_VALUES[codes >> 4]
    sc = (scales.astype(np.uint32) << 23).view(np.float32)  # normal scale bytes only (bench data)
    w.reshape(rows, -1, 32)[...] *= sc[:, :, None]
    return w


def np_matvec(codes, scales, x):
    return np_decode(codes, scales) @ x


def np_bf16_matvec(w16, x):
    return (w16.astype(np.uint32) << 16).view(np.float32) @ x


def np_experts(experts, weights, x, limit):
    y = np.zeros(x.shape[0], np.float32)
    for e, wt in zip(experts, weights):
        g = np.minimum(np_matvec(e.w1, e.s1, x), limit)
        u = np.clip(np_matvec(e.w3, e.s3, x), -limit, limit)
        y += np_matvec(e.w2, e.s2, (g / (1 + np.exp(-g)) * u * wt).astype(np.float32))
    return y


_E4M3_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)


def np_fp8_decode(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    rows, k = w.shape
    out = _E4M3_F32[w]
    sc = (scales.astype(np.uint32) << 23).view(np.float32)  # normal scale bytes only (bench data)
    if rows % FP8_TILE == 0 and k % FP8_TILE == 0:
        out.reshape(rows // FP8_TILE, FP8_TILE, k // FP8_TILE, FP8_TILE)[...] *= sc[:, None, :, None]
    else:
        out *= np.repeat(np.repeat(sc, FP8_TILE, axis=0)[:rows], FP8_TILE, axis=1)[:, :k]
    return out


def np_fp8_matvec(w, scales, x):
    return np_fp8_decode(w, scales) @ x


# ---- data --------------------------------------------------------------------------------------


def _mxfp4(rng, rows, k):
    return (
        rng.integers(0, 256, (rows, k // 2), dtype=np.uint8),
        rng.integers(118, 130, (rows, k // 32), dtype=np.uint8),
    )


def _fp8(rng, rows, k):
    w = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    tiles = (-(-rows // FP8_TILE), -(-k // FP8_TILE))
    return w, rng.integers(118, 130, tiles, dtype=np.uint8)


def _fp8_nbytes(rows: int, k: int) -> int:
    return rows * k + -(-rows // FP8_TILE) * -(-k // FP8_TILE)


def _align(n: int, a: int = 4096) -> int:
    return -(-n // a) * a


def _expert_parts() -> list[tuple[int, int]]:
    """(rows, cols) in bytes of w1, s1, w3, s3, w2, s2: one expert's slot, parts back to back."""
    return [(INTER, HIDDEN // 2), (INTER, HIDDEN // 32), (INTER, HIDDEN // 2), (INTER, HIDDEN // 32),
            (HIDDEN, INTER // 2), (HIDDEN, INTER // 32)]


def _slot_offsets(parts: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Offsets of the parts in a slot (64-byte aligned) and the slot's bytes (page-aligned)."""
    offs, off = [], 0
    for rows, cols in parts:
        offs.append(off)
        off = _align(off + rows * cols, 64)
    return offs, _align(off)


def _slot_views(buf: np.ndarray, base: int, parts: list[tuple[int, int]]) -> list[np.ndarray]:
    return [buf[base + off:base + off + rows * cols].reshape(rows, cols)
            for off, (rows, cols) in zip(_slot_offsets(parts)[0], parts)]


def _fill_copies(buf: np.ndarray, copy_nbytes: int, copies: int) -> None:
    first = buf[:copy_nbytes]
    for c in range(1, copies):
        buf[c * copy_nbytes:(c + 1) * copy_nbytes] = first


def _cold_experts(rng, copies: int, pages: str) -> _Case:
    parts = _expert_parts()
    slot = _expert_slot_nbytes()
    group = N_EXPERTS * slot
    buf, _thp = page_buffer(copies * group, pages)
    for e in range(N_EXPERTS):  # one group of random experts, then copies of it
        for v, (rows, cols) in zip(_slot_views(buf, e * slot, parts), parts):
            v[...] = rng.integers(118, 130, v.shape, dtype=np.uint8) if cols in (HIDDEN // 32, INTER // 32) \
                else rng.integers(0, 256, v.shape, dtype=np.uint8)
    _fill_copies(buf, group, copies)
    groups = [[K.ExpertWeights(*_slot_views(buf, c * group + e * slot, parts)) for e in range(N_EXPERTS)]
              for c in range(copies)]
    return _experts_case(rng, f"{N_EXPERTS} experts ×{copies}", lambda i: groups[i],
                         cold=True, pages=pages, copies=copies, working_set=copies * group,
                         huge_bytes=huge_page_bytes(buf), keep=[buf])


def _experts_case(rng, label: str, group_of: Callable[[int], list], **where) -> "_Case":
    """The 6-expert entry point on the experts group_of(call index) gives, with its numpy baseline."""
    weights = list(rng.uniform(0.05, 0.3, N_EXPERTS))
    xh = (rng.standard_normal(HIDDEN) * 0.05).astype(np.float32)
    yh = np.empty(HIDDEN, np.float32)
    scratch = K.experts_scratch(N_EXPERTS, HIDDEN, INTER)
    nw = N_EXPERTS * 3 * HIDDEN * INTER
    return _Case("experts", label, nw, nw // 2 + nw // 32,
                 lambda i: K.experts_forward(group_of(i), weights, xh, 10.0, yh, scratch),
                 lambda i: np_experts(group_of(i), weights, xh, 10.0), **where)


def _fp8_layout() -> tuple[list[tuple[int, int, int, int, tuple[int, int]]], int]:
    """(rows, k, weight offset, scales offset, tiles) of one copy of FP8_SHAPES, and its bytes."""
    layout, off = [], 0
    for rows, k in FP8_SHAPES:
        tiles = (-(-rows // FP8_TILE), -(-k // FP8_TILE))
        layout.append((rows, k, off, _align(off + rows * k), tiles))
        off = _align(_align(off + rows * k) + tiles[0] * tiles[1])
    return layout, off


def _expert_slot_nbytes() -> int:
    return _slot_offsets(_expert_parts())[1]


def _cold_fp8(rng, copies: int, pages: str) -> _Case:
    layout, one = _fp8_layout()
    buf, _thp = page_buffer(copies * one, pages)
    for rows, k, w_off, s_off, tiles in layout:
        w, s = _fp8(rng, rows, k)
        buf[w_off:w_off + w.size] = w.reshape(-1)
        buf[s_off:s_off + s.size] = s.reshape(-1)
    _fill_copies(buf, one, copies)
    mats = [[(buf[c * one + w_off:c * one + w_off + rows * k].reshape(rows, k),
              buf[c * one + s_off:c * one + s_off + tiles[0] * tiles[1]].reshape(tiles))
             for rows, k, w_off, s_off, tiles in layout] for c in range(copies)]
    xs = {k: rng.standard_normal(k).astype(np.float32) for _rows, k in FP8_SHAPES}
    outs = [np.empty(rows, np.float32) for rows, _k in FP8_SHAPES]

    def call(i: int) -> None:
        for (w, s), o in zip(mats[i], outs):
            K.fp8_matvec(w, s, xs[w.shape[1]], o)

    def baseline(i: int) -> None:
        for w, s in mats[i]:
            np_fp8_matvec(w, s, xs[w.shape[1]])

    nw = sum(r * k for r, k in FP8_SHAPES)
    return _Case("fp8_matvec", f"attention ×{copies}", nw, sum(_fp8_nbytes(r, k) for r, k in FP8_SHAPES),
                 call, baseline, cold=True, pages=pages, copies=copies, working_set=copies * one,
                 huge_bytes=huge_page_bytes(buf), keep=[buf])


def _hot_cases(rng, kernels: tuple[str, ...]) -> Iterator[_Case]:
    for rows, k in SHAPES:
        codes, scales = _mxfp4(rng, rows, k)
        x = rng.standard_normal(k).astype(np.float32)
        out2, out1 = np.empty((rows, k), np.float32), np.empty(rows, np.float32)
        w16 = (rng.standard_normal((rows, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        label, nw, mx_bytes = f"{rows}x{k}", rows * k, rows * k // 2 + rows * k // 32
        yield from (
            _Case("decode", label, nw, mx_bytes,
                  lambda _i, c=codes, s=scales, o=out2: K.mxfp4_decode(c, s, o),
                  lambda _i, c=codes, s=scales: np_decode(c, s)),
            _Case("matvec", label, nw, mx_bytes,
                  lambda _i, c=codes, s=scales, x=x, o=out1: K.mxfp4_matvec(c, s, x, o),
                  lambda _i, c=codes, s=scales, x=x: np_matvec(c, s, x)),
            _Case("bf16_matvec", label, nw, 2 * nw,
                  lambda _i, w=w16, x=x, o=out1: K.bf16_matvec(w, x, o), lambda _i, w=w16, x=x: np_bf16_matvec(w, x)),
        )  # fmt: skip
    if "experts" in kernels:
        experts = []
        for _ in range(N_EXPERTS):
            w1, s1 = _mxfp4(rng, INTER, HIDDEN)
            w3, s3 = _mxfp4(rng, INTER, HIDDEN)
            w2, s2 = _mxfp4(rng, HIDDEN, INTER)
            experts.append(K.ExpertWeights(w1, s1, w3, s3, w2, s2))
        yield _experts_case(rng, f"{N_EXPERTS} experts", lambda _i: experts)
    if "fp8_matvec" in kernels and hasattr(K, "fp8_matvec"):
        for rows, k in FP8_SHAPES:
            w, s = _fp8(rng, rows, k)
            x = rng.standard_normal(k).astype(np.float32)
            o = np.empty(rows, np.float32)
            yield _Case("fp8_matvec", f"{rows}x{k}", rows * k, _fp8_nbytes(rows, k),
                        lambda _i, w=w, s=s, x=x, o=o: K.fp8_matvec(w, s, x, o),
                        lambda _i, w=w, s=s, x=x: np_fp8_matvec(w, s, x))


# ---- several vectors per call -------------------------------------------------------------------


def _multi_calls(rng, fmt: str, rows: int, k: int, n: int):
    """(batched call, n single-vector calls on the same vectors, weight bytes) for one case."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    out, out1 = np.empty((n, rows), np.float32), np.empty((n, rows), np.float32)
    scratch = K.matmul_scratch(n, k)
    if fmt == "mxfp4":
        c, s = _mxfp4(rng, rows, k)
        return (lambda: K.mxfp4_matmul(c, s, x, out, scratch),
                lambda: [K.mxfp4_matvec(c, s, x[t], out1[t]) for t in range(n)], rows * k // 2 + rows * k // 32)
    if fmt == "bf16":
        w = (rng.standard_normal((rows, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return (lambda: K.bf16_matmul(w, x, out, scratch),
                lambda: [K.bf16_matvec(w, x[t], out1[t]) for t in range(n)], 2 * rows * k)
    w, s = _fp8(rng, rows, k)
    return (lambda: K.fp8_matmul(w, s, x, out, scratch),
            lambda: [K.fp8_matvec(w, s, x[t], out1[t]) for t in range(n)], _fp8_nbytes(rows, k))


def _multi_records(rng, backends: list[str], threads: list[int], repeat: int,
                   note: Callable[[str], None]) -> list[Record]:
    """Per case, vector count, backend and thread count: the batched call and the single-vector
    calls timed in turn (each after an untimed one), medians of `repeat`."""
    records = []
    for fmt, rows, k in MULTI_CASES:
        for n in MULTI_TOKENS:
            batched, singles, nbytes = _multi_calls(rng, fmt, rows, k, n)
            nw = rows * k * n
            scalar_t: dict[int, float] = {}
            for backend in backends:
                K.set_backend(backend)
                note(f"multi {fmt} {rows}x{k} x{n}: {backend}")
                tb: dict[int, list[float]] = {nt: [] for nt in threads}
                ts: dict[int, list[float]] = {nt: [] for nt in threads}
                for _ in range(repeat):
                    for nt in threads:
                        K.set_threads(nt)
                        for fn, into in ((batched, tb[nt]), (singles, ts[nt])):
                            fn()
                            t0 = time.perf_counter()
                            fn()
                            into.append(time.perf_counter() - t0)
                for nt in threads:
                    t_b, t_s = statistics.median(tb[nt]), statistics.median(ts[nt])
                    if backend == "scalar":
                        scalar_t[nt] = t_b
                    records.append(Record(
                        "multi", f"{fmt} {rows}x{k}", backend, nt, t_b, nbytes / t_b / 1e9, nw / t_b / 1e9,
                        scalar_t[nt] / t_b if nt in scalar_t else None, None,
                        statistics.median(tb[threads[0]]) / t_b, tokens=n, single_gweights_per_s=nw / t_s / 1e9,
                        vs_single=t_s / t_b,
                    ))  # fmt: skip
    return records


# ---- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Buffer sizes of a run: the floor's buffer and the cold working sets."""

    llc_bytes: int
    llc_known: bool
    floor_bytes: int
    cold_target_bytes: int   # what the cold sets should exceed (2x LLC unless overridden)
    cap_bytes: int           # the most one buffer may take (MEMORY_CAP, or a quarter of free RAM)

    def copies(self, copy_nbytes: int) -> int:
        want = self.cold_target_bytes // copy_nbytes + 1
        return max(2, min(want, self.cap_bytes // copy_nbytes))


def plan_sizes(floor_bytes: int | None = None, cold_bytes: int | None = None,
               llc: int | None = None) -> Plan:
    known = llc is not None or llc_bytes() is not None
    llc = llc if llc is not None else (llc_bytes() or ASSUMED_LLC)
    cap = min(MEMORY_CAP, available_bytes() // 4)
    if floor_bytes is None:
        floor_bytes = min(max(FLOOR_MIN_BYTES, 2 * llc), cap)
    floor_bytes = max(8, floor_bytes // 8 * 8)
    return Plan(llc, known, floor_bytes, 2 * llc if cold_bytes is None else cold_bytes, cap)


def run_bench(
    repeat: int = 5,
    backends: list[str] | None = None,
    threads: list[int] | None = None,
    kernels: tuple[str, ...] = KERNELS,
    progress: Callable[[str], None] | None = None,
    *,
    cases: str = "all",
    pages: str = "huge",
    floor_bytes: int | None = None,
    cold_bytes: int | None = None,
    notes: list[str] | None = None,
) -> list[Record]:
    """The records of one run: the memory floor first ("memory", one record per backend, thread
    count and kind of pages), then per kernel its hot cases and its cold ones.

    cases: "hot", "cold" or "all"; pages: the cold buffers' (and the floor's) pages, "huge",
    "normal" or "both".  floor_bytes / cold_bytes override the floor buffer's size and the
    size the cold working sets must exceed (default: max(1 GiB, 2x LLC) and 2x LLC, each capped
    at MEMORY_CAP); tests make them small.  Lines for the reader (a capped working set, a
    skipped kernel) are appended to `notes`."""
    if cases not in CASES:
        raise ValueError(f"cases: expected one of {', '.join(CASES)}, got {cases!r}")
    if pages not in PAGES:
        raise ValueError(f"pages: expected one of {', '.join(PAGES)}, got {pages!r}")
    backends = backends or K.available_backends()
    if "scalar" not in backends:
        backends = ["scalar", *backends]
    if threads is None:
        threads = sorted({1, os.cpu_count() or 1})
    page_modes = ["huge", "normal"] if pages == "both" else [pages]
    notes = notes if notes is not None else []
    plan = plan_sizes(floor_bytes, cold_bytes)
    rng = np.random.default_rng(2024)
    saved = K.get_backend(), K.get_threads()
    records: list[Record] = []
    has_fp8 = hasattr(K, "fp8_matvec")

    def note(msg):
        if progress:
            progress(msg)

    if "fp8_matvec" in kernels and not has_fp8:
        notes.append("fp8_matvec: skipped, the kernels library has no FP8 matvec "
                     "(ds4f.native.kernels.fp8_matvec) in this build")
    if not plan.llc_known:
        notes.append(f"last-level cache size unknown: assumed {plan.llc_bytes >> 20} MiB")

    def measure(case: _Case) -> None:
        records.extend(_measure(case, backends, threads, repeat, note))

    try:
        if "memory" in kernels:
            for mode in page_modes:
                note(f"memory floor: {plan.floor_bytes / 2**30:.2f} GiB on {mode} pages")
                records += _floor_records(plan.floor_bytes, mode, backends, threads, repeat)
        if "fma" in kernels:
            note("FMA peak")
            records += _fma_records(backends, threads, repeat)
        if cases in ("hot", "all"):
            for case in _hot_cases(rng, kernels):
                if case.kernel in kernels:
                    measure(case)
            if "multi" in kernels:
                records.extend(_multi_records(rng, backends, threads, repeat, note))
        if cases in ("cold", "all"):
            _cold_cases(rng, kernels, plan, page_modes, has_fp8, notes, measure, note)
    finally:
        K.set_backend(saved[0])
        K.set_threads(saved[1])
    _relate(records, page_modes[0])
    order = {k: i for i, k in enumerate(KERNELS)}
    records.sort(key=lambda r: (order.get(r.kernel, len(order)), r.cold))  # stable: hot before cold
    return records


def _measure(case: _Case, backends: list[str], threads: list[int], repeat: int, note) -> list[Record]:
    """One case on every backend and thread count (scalar first: the others' ratio is to it),
    then numpy's baseline when the case has one."""
    scalar_t: dict[int, float] = {}
    mine: list[Record] = []
    for backend in backends:
        K.set_backend(backend)
        note(f"{case.kernel} {case.label}{' cold' if case.cold else ''}: {backend}")
        times = _interleaved_times(case.call, threads, repeat, case.copies)
        for nt in threads:
            t = times[nt]
            if backend == "scalar":
                scalar_t[nt] = t
            mine.append(Record(
                case.kernel, case.label, backend, nt, t, case.nbytes / t / 1e9, case.nweights / t / 1e9,
                scalar_t[nt] / t if nt in scalar_t else None, None, times[threads[0]] / t, cold=case.cold,
                pages=case.pages, working_set_bytes=case.working_set, huge_page_bytes=case.huge_bytes,
            ))  # fmt: skip
    if case.baseline is None:
        return mine
    # numpy last: its BLAS threads spin on the other cores for a while after a call (~0.1 s
    # with OpenBLAS), and a kernel measured in that time loses those cores
    note(f"{case.kernel} {case.label}: numpy baseline")
    if case.cold:  # a few calls, each on the next copy: numpy decodes, so it is slow anyway
        nxt = iter(range(1 << 30))
        t_np = _median_time(lambda: case.baseline(next(nxt) % case.copies), max(1, min(repeat, 2)))
    else:
        t_np = _median_time(lambda: case.baseline(0), max(1, min(repeat, 3)))
    for r in mine:
        r.speedup_vs_numpy = t_np / r.median_s
    mine.append(Record(case.kernel, case.label, "numpy", 0, t_np, case.nbytes / t_np / 1e9,
                       case.nweights / t_np / 1e9, cold=case.cold, pages=case.pages,
                       working_set_bytes=case.working_set, huge_page_bytes=case.huge_bytes))
    time.sleep(BLAS_SETTLE_S)
    return mine


def _cold_cases(rng, kernels, plan, page_modes: list[str], has_fp8: bool, notes: list[str], measure, note) -> None:
    """The cold cases: working sets past the last-level cache (capped by the memory cap, which a
    note then says), on each kind of pages, each measured as it is built and then freed."""
    builders = [("experts", _cold_experts, N_EXPERTS * _expert_slot_nbytes())]
    if has_fp8:
        builders.append(("fp8_matvec", _cold_fp8, _fp8_layout()[1]))
    for kernel, build, copy_nbytes in builders:
        if kernel not in kernels:
            continue
        copies = plan.copies(copy_nbytes)
        if copies * copy_nbytes <= plan.cold_target_bytes:
            notes.append(
                f"{kernel} cold: working set capped at {copies * copy_nbytes / 2**30:.2f} GiB "
                f"({copies} copies; the memory cap is {plan.cap_bytes / 2**30:.2f} GiB), "
                f"{copies * copy_nbytes / plan.llc_bytes:.1f}x the {plan.llc_bytes >> 20} MiB last-level "
                f"cache rather than the 2x wanted")
        for mode in page_modes:
            note(f"{kernel} cold: allocating {copies} copies on {mode} pages")
            case = build(rng, copies, mode)
            measure(case)
            del case


def _relate(records: list[Record], hot_pages: str) -> None:
    """fraction_of_floor on every kernel record, fraction_of_fma_peak and wall where they apply,
    vs_hot_matvec on the experts records."""
    floor = {(r.backend, r.threads, r.pages): r.gb_per_s for r in records if r.kernel == "memory"}
    peak = {(r.backend, r.threads): r.glanes_per_s for r in records if r.kernel == "fma"}
    for r in records:
        if r.kernel in ("memory", "fma") or r.backend == "numpy":
            continue
        f = floor.get((r.backend, r.threads, r.pages if r.cold else hot_pages))
        if f:
            r.fraction_of_floor = r.gb_per_s / f
        p = peak.get((r.backend, r.threads))
        if p and r.kernel in FMA_KERNELS and r.gweights_per_s:
            r.fraction_of_fma_peak = r.gweights_per_s / p
        if r.fraction_of_floor is not None:
            r.wall = "memory" if r.fraction_of_floor >= MEMORY_WALL else "compute"
    # the experts' work is 2/3 in w1/w3's shape and 1/3 in w2's: the same mix of hot matvecs
    mv = {(r.backend, r.threads, r.shape): r.gweights_per_s for r in records
          if r.kernel == "matvec" and not r.cold and r.backend != "numpy"}
    (i1, h1), (i2, h2) = SHAPES
    for r in records:
        if r.kernel != "experts" or r.backend == "numpy":
            continue
        g1, g2 = mv.get((r.backend, r.threads, f"{i1}x{h1}")), mv.get((r.backend, r.threads, f"{i2}x{h2}"))
        if g1 and g2 and r.gweights_per_s:
            r.vs_hot_matvec = r.gweights_per_s / (1 / (2 / 3 / g1 + 1 / 3 / g2))
