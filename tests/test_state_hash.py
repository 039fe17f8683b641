"""A fixed tiny run's state dump, byte for byte.

The scalar hash was recorded from the engine before its modules were reorganised into the model /
runtime / checkpoint subpackages, and before the shared expert moved from a bf16 copy to its
shipped FP8 (the scalar FP8 matvec is bit-identical to the scalar bf16 one on the exactly widened
matrix): a reorganisation moves code, it does not change a single bit of what a run computes. The
SIMD hashes were recorded again when the shared expert moved to the FP8 kernels, whose lanes sum
in another order than the bf16 ones did (each within 1e-5 of float64); computing the ready
experts together in one kernel call instead of one at a time changed no bit. They were recorded on x86-64 (numpy's float64 dot in rms_norm goes through
BLAS, whose summation order is chosen per CPU family): on another CPU family only the structure
check applies.
"""
from __future__ import annotations

import hashlib
import platform

import pytest

from ds4f.engine import kernels
from ds4f.engine.runs import RunConfig, start_run

RECORDED = {
    "scalar": "3dd366d4bd42489728a0024c9ba9a20e5365b86c298285a2f201e62cde8a7d01",
    "avx2": "beaf1b6789e152854566795dd174fd541ddcd60f9ebc42d36438f6fd12f54abd",
    "avx512": "bfae85e0a1d7ce184368b14b7636e58318493c1396f7164bbf9254400d048923",
}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="hashes recorded on x86-64")
@pytest.mark.parametrize("backend", [b for b in RECORDED if b in kernels.available_backends()])
@pytest.mark.parametrize("which", ["tiny_official", "tiny_model"])
def test_fixed_tiny_run_has_the_recorded_state_hash(request, which, backend, tmp_path):
    model = request.getfixturevalue(which)
    dump = tmp_path / "state.bin"
    run = start_run(RunConfig(model=str(model), gen=5, prompt=(0, 17, 42), backend=backend, kernel_threads=2,
                              preset="laptop", dump_path=str(dump), probe_floor=False))
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    assert hashlib.sha256(dump.read_bytes()).hexdigest() == RECORDED[backend]
