"""What the kernel test files share: one parameter per backend (skipped with the reason where
this CPU lacks it), an autouse fixture that restores the backend and thread count, and array
helpers."""
from __future__ import annotations

import numpy as np
import pytest

from ds4f.engine import kernels as K


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
