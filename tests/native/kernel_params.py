"""What the kernel test files share: one parameter per backend (skipped with the reason where
this CPU lacks it), an autouse fixture that restores the backend and thread count, and array
helpers."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ds4f.native import kernels as K


def _backend_params() -> list:
    available = K.available_backends()
    out = []
    for name in K.BACKENDS:
        marks = []
        if name not in available:
            why = (
                "neon: not an aarch64 machine (NEON is tested under qemu by tests/test_neon.py)"
                if name == "neon"
                else f"{name}: not supported by this CPU/OS (CPUID/XGETBV)"
            )
            marks.append(pytest.mark.skip(reason=why))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def backend_marks():
    """(every backend, the SIMD ones): parametrize marks over `backend`."""
    params = _backend_params()
    return (pytest.mark.parametrize("backend", params),
            pytest.mark.parametrize("backend", [p for p in params if p.values[0] != "scalar"]))


def kernel_settings_restored():
    """An autouse fixture (assign it at module level) giving every test back the settings it found."""

    @pytest.fixture(autouse=True)
    def _restore_settings():
        backend, threads = K.get_backend(), K.get_threads()
        yield
        K.set_backend(backend)
        K.set_threads(threads)

    return _restore_settings


def unaligned(a: np.ndarray, offset: int) -> np.ndarray:
    """A copy of a whose data starts `offset` bytes past a 64-byte boundary."""
    buf = np.zeros(a.nbytes + 64 + offset, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    out = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def main_thread_gaps(kernel, codes: np.ndarray, scales: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """One kernel(codes, scales, x) call made to last about 0.4 s (the weights tiled), run in a
    thread while this one counts: (the longest this thread went without running, the call's
    duration). With the GIL released during the call, the first is far below the second."""
    t0 = time.perf_counter()
    kernel(codes, scales, x)
    reps = max(1, int(0.4 / max(time.perf_counter() - t0, 1e-4)))
    codes, scales = np.tile(codes, (reps, 1)), np.tile(scales, (reps, 1))
    started = threading.Event()
    duration = []

    def work():
        started.set()
        t = time.perf_counter()
        kernel(codes, scales, x)
        duration.append(time.perf_counter() - t)

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    gaps, last = [], time.perf_counter()
    while worker.is_alive():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    return max(gaps), duration[0]
