"""Kernel benchmark on the real expert shapes: every available backend, 1 thread and all cores,
against scalar and against a numpy baseline (table decode + np.dot) measured in the same run.

Figures: median wall time of `repeat` calls, each after an untimed warm-up call, with the
thread counts measured in turn (time.perf_counter);
G weights/s = matrix elements processed per second; GB/s = weight bytes read per second
(MXFP4: k/2 code bytes + k/32 scale bytes per row; bf16: 2 bytes per element).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from ds4f.engine import kernels as K
from ds4f.engine.checkpoint.formats import E2M1_VALUES

SHAPES = ((2048, 4096), (4096, 2048))  # w1/w3 (inter x hidden) and w2 (hidden x inter)
HIDDEN, INTER, N_EXPERTS = 4096, 2048, 6
KERNELS = ("decode", "matvec", "bf16_matvec", "experts")


@dataclass
class Record:
    kernel: str
    shape: str
    backend: str
    threads: int
    median_s: float
    gb_per_s: float
    gweights_per_s: float
    speedup_vs_scalar: float | None = None
    speedup_vs_numpy: float | None = None
    speedup_vs_1thread: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: page faults, pool start, caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved_times(call: Callable[[], object], threads: list[int], repeat: int) -> dict[int, float]:
    """Median time per thread count, the counts measured in turn within each repeat, so that
    load from other processes (a shared box) hits 1 thread and n threads alike.  Each timed
    call follows an untimed one at the same setting (pool threads started, caches warm)."""
    times: dict[int, list[float]] = {nt: [] for nt in threads}
    for _ in range(repeat):
        for nt in threads:
            K.set_threads(nt)
            call()
            t0 = time.perf_counter()
            call()
            times[nt].append(time.perf_counter() - t0)
    return {nt: statistics.median(v) for nt, v in times.items()}


# ---- numpy baseline --------------------------------------------------------------------------


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


# ---- the run ---------------------------------------------------------------------------------


def _mxfp4(rng, rows, k):
    return (
        rng.integers(0, 256, (rows, k // 2), dtype=np.uint8),
        rng.integers(118, 130, (rows, k // 32), dtype=np.uint8),
    )


def run_bench(
    repeat: int = 5,
    backends: list[str] | None = None,
    threads: list[int] | None = None,
    kernels: tuple[str, ...] = KERNELS,
    progress: Callable[[str], None] | None = None,
) -> list[Record]:
    backends = backends or K.available_backends()
    if "scalar" not in backends:
        backends = ["scalar", *backends]
    if threads is None:
        threads = sorted({1, os.cpu_count() or 1})
    rng = np.random.default_rng(2024)
    saved = K.get_backend(), K.get_threads()
    records: list[Record] = []

    def note(msg):
        if progress:
            progress(msg)

    # (kernel, shape) -> (label, weights, bytes, call(ffi), numpy baseline)
    cases = []
    for rows, k in SHAPES:
        codes, scales = _mxfp4(rng, rows, k)
        x = rng.standard_normal(k).astype(np.float32)
        out2, out1 = np.empty((rows, k), np.float32), np.empty(rows, np.float32)
        w16 = (rng.standard_normal((rows, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        label, nw, mx_bytes = f"{rows}x{k}", rows * k, rows * k // 2 + rows * k // 32
        cases += [
            ("decode", label, nw, mx_bytes,
             lambda c=codes, s=scales, o=out2: K.mxfp4_decode(c, s, o), lambda c=codes, s=scales: np_decode(c, s)),
            ("matvec", label, nw, mx_bytes,
             lambda c=codes, s=scales, x=x, o=out1: K.mxfp4_matvec(c, s, x, o),
             lambda c=codes, s=scales, x=x: np_matvec(c, s, x)),
            ("bf16_matvec", label, nw, 2 * nw,
             lambda w=w16, x=x, o=out1: K.bf16_matvec(w, x, o), lambda w=w16, x=x: np_bf16_matvec(w, x)),
        ]  # fmt: skip
    experts = []
    for _ in range(N_EXPERTS):
        w1, s1 = _mxfp4(rng, INTER, HIDDEN)
        w3, s3 = _mxfp4(rng, INTER, HIDDEN)
        w2, s2 = _mxfp4(rng, HIDDEN, INTER)
        experts.append(K.ExpertWeights(w1, s1, w3, s3, w2, s2))
    weights = list(rng.uniform(0.05, 0.3, N_EXPERTS))
    xh = (rng.standard_normal(HIDDEN) * 0.05).astype(np.float32)
    yh = np.empty(HIDDEN, np.float32)
    scratch = K.experts_scratch(N_EXPERTS, HIDDEN, INTER)
    nw = N_EXPERTS * 3 * HIDDEN * INTER
    cases.append(
        ("experts", f"{N_EXPERTS} experts", nw, nw // 2 + nw // 32,
         lambda: K.experts_forward(experts, weights, xh, 10.0, yh, scratch),
         lambda: np_experts(experts, weights, xh, 10.0))
    )  # fmt: skip

    try:
        for kernel, label, nweights, nbytes, call, baseline in cases:
            if kernel not in kernels:
                continue
            note(f"{kernel} {label}: numpy baseline")
            t_np = _median_time(baseline, max(1, min(repeat, 3)))
            scalar_t: dict[int, float] = {}
            for backend in backends:
                K.set_backend(backend)
                note(f"{kernel} {label}: {backend}")
                times = _interleaved_times(call, threads, repeat)
                for nt in threads:
                    t = times[nt]
                    if backend == "scalar":
                        scalar_t[nt] = t
                    records.append(Record(
                        kernel, label, backend, nt, t, nbytes / t / 1e9, nweights / t / 1e9,
                        scalar_t[nt] / t if nt in scalar_t else None, t_np / t, times[threads[0]] / t,
                    ))  # fmt: skip
            records.append(Record(kernel, label, "numpy", 0, t_np, nbytes / t_np / 1e9, nweights / t_np / 1e9))
    finally:
        K.set_backend(saved[0])
        K.set_threads(saved[1])
    return records
