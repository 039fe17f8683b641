"""A fixed tiny run's state dump, byte for byte.

The hashes were recorded with state dump version 3 (the whole model: records hold every layer's
hyper-connection streams, its attention output and the step's top logits); the numbers in them
are those of version 2, which held the same states without the attention outputs and logits. The whole model's numbers are checked against transformers in
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

from ds4f.native import kernels
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run

RECORDED = {
    "scalar": "44b2a13b931b71e3ddf1921b1a1c4d1a1cabecc72a19765b3a8c2412c90d8678",
    "avx2": "ae2cc5bac470204c400e49aab1bf38cb43742a34e1e3b98cecf68ec9a97d0b1e",
    "avx512": "17d772e23a2cd23fd266e929ea6a8c5fed2bea888981098687a950e8e3c986e4",
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
