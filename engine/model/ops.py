"""The model's elementwise and reduction operations, each with a fixed order of evaluation, so a
result depends only on its inputs, never on threads, batching or I/O timing.

Vectors are fp32 numpy arrays; functions that take `out` write into it and return it, so the
forward pass allocates nothing per token.
"""
from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits


def rms_norm(h: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray,
             scratch64: np.ndarray | None = None) -> np.ndarray:
    """out = h / sqrt(mean(h^2) + eps) * weight, the mean taken in float64 (one dot product).
    scratch64: an optional float64 buffer of h's size, so nothing is allocated per call."""
    h64 = h.astype(np.float64) if scratch64 is None else scratch64
    if scratch64 is not None:
        np.copyto(h64, h)
    inv = np.float32(1.0 / np.sqrt(np.dot(h64, h64) / h.shape[0] + eps))
    np.multiply(h, inv, out=out)
    np.multiply(out, weight, out=out)
    return out


def sqrt_softplus(logits: np.ndarray) -> np.ndarray:
    """DeepSeek-V4's router scoring function sqrt(softplus(x)), evaluated in float64, returned fp32."""
    return np.sqrt(np.logaddexp(0.0, logits.astype(np.float64))).astype(np.float32)


def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up, in fp32, in this order of operations."""
    np.negative(gate, out=out)
    np.exp(out, out=out)
    out += np.float32(1.0)
    np.divide(gate, out, out=out)
    out *= up
    return out


def pin_numpy_blas() -> None:
    """numpy's BLAS (OpenBLAS) on one thread, for the whole process. OpenBLAS splits a float64
    dot product of more than 10k elements among its threads and adds the parts, so its last bits
    change with the thread count (the machine's cores, or OPENBLAS_NUM_THREADS); the model's
    matrix products here are small and run between the native kernels, which have the cores, and
    an idle OpenBLAS worker spins on one of them."""
    threadpool_limits(1, user_api="blas")


def in_halves(beside, run, n: int, least: int) -> list:
    """run(a, b) over rows 0..n that do not depend on each other, and its results in row order:
    [run(0, n)] here when beside is None or n <= least; else [run(0, n // 2), run(n // 2, n)], the
    first half through beside(fn, *args) (runtime.helper_thread: a helper thread) while this thread does
    the second. The first is waited for even when the second fails: nothing is left working on
    the rows."""
    if beside is None or n <= least:
        return [run(0, n)]
    first = beside(run, 0, n // 2)
    try:
        second = run(n // 2, n)
    finally:
        done = first.result()
    return [done, second]
