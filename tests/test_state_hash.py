"""A fixed tiny run's state dump, byte for byte.

The hashes were recorded when the engine began computing the whole model (attention, its KV
cache and the hyper-connections; state dump version 2, whose records hold every layer's
hyper-connection streams). The whole model's numbers are checked against transformers in
tests/test_whole_engine.py; this test pins them, so a change that moves a single bit of what a
run computes (a reorganisation must not) fails here. Earlier hashes pinned the MoE half alone
(version 1 dumps).
They were recorded on x86-64 (numpy's float64 dot in rms_norm goes through BLAS, whose
summation order is chosen per CPU family): on another CPU family only the structure check applies.
"""
from __future__ import annotations

import hashlib
import platform

import pytest

from ds4f.engine import kernels
from ds4f.engine.runs import RunConfig, start_run

RECORDED = {
    "scalar": "6b0faf0403a499dc890ad1560d7b548a8f52d644c1d4808cc4e98a06b61f1210",
    "avx2": "e303907e9117e6681ed8f03cdd131be61b9640ded3344b7ac9e67c7ca83b252e",
    "avx512": "ccad51f03bd3b672e0326246db64ee6be38f24b6b4aea0e8f9b10f4e1def3eb5",
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
