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


def progress_seen_during(kernel, codes: np.ndarray, scales: np.ndarray, x: np.ndarray) -> tuple[int, int]:
    """One kernel(codes, scales, x) call made long (the weights tiled to about 0.4 s of work) and
    run in a thread while this one reads the native pool's count of tasks done: (how many counts
    strictly between the call's first and last this thread saw, the tasks the call ran). This
    thread can read a count in between only if it ran Python while the call was in progress,
    that is, if the call released the GIL; holding it, the call lets this thread see only the
    counts before and after it."""
    lib = K.lib
    t0 = time.perf_counter()
    kernel(codes, scales, x)
    reps = max(1, int(0.4 / max(time.perf_counter() - t0, 1e-4)))   # sizing only: no time is asserted
    codes, scales = np.tile(codes, (reps, 1)), np.tile(scales, (reps, 1))
    before = lib.ds4f_tasks_done()
    worker = threading.Thread(target=kernel, args=(codes, scales, x))
    seen = set()
    worker.start()
    while worker.is_alive():
        seen.add(lib.ds4f_tasks_done())
    worker.join()
    after = lib.ds4f_tasks_done()
    return len({c for c in seen if before < c < after}), after - before
