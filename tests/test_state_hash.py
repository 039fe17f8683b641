"""A fixed tiny run's state dump, byte for byte.

The hashes were recorded from the engine before its modules were reorganised into the model /
runtime / checkpoint subpackages; a reorganisation moves code, it does not change a single bit of
what a run computes. They were recorded on x86-64 (numpy's float64 dot in rms_norm goes through
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
    "avx2": "d40c6809ecf39af62a85e9d4592b14a737faf22852346a0255ba885426ca7c02",
    "avx512": "bb49df3768735dc3704a61e34bcd3188021eae8bdba6234388ffc97b8c582002",
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
