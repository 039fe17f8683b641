"""The engine runs the whole model: a run on each transformers fixture (tests/fixtures/whole, made
by tools/make_golden_whole.py from DeepseekV4ForCausalLM) generates transformers' greedy tokens
after the prompt, its state dump holds each layer's hyper-connection state within tolerance of
transformers', on both checkpoint forms and every backend; the KV cache is sized from the
preset's context, counted in the memory plan, and a run past it is refused up front.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ds4f.native import kernels
from ds4f.engine.checkpoint.convert import convert_checkpoint
from ds4f.engine.config import load_config
from ds4f.errors import Ds4fError
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.runs.statedump import read_state

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "whole"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.npz").exists())
BACKENDS = [b for b in ("scalar", "avx2", "avx512") if b in kernels.available_backends()]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture converted to the ds4f layout."""
    out = {}
    for case in CASES:
        src = tmp_path_factory.mktemp(case) / "official"
        shutil.copytree(FIXTURES / case, src, ignore=shutil.ignore_patterns("expected.npz"))
        out[case] = convert_checkpoint(src, src.parent / "ds4f", progress=False)
    return out


def _run(model, exp, backend, dump, threads=2, preset="laptop"):
    prompt = tuple(int(t) for t in exp["tokens"][:int(exp["prompt_len"])])
    gen = len(exp["tokens"]) - len(prompt) + 1
    run = start_run(RunConfig(model=str(model), gen=gen, prompt=prompt, backend=backend, kernel_threads=threads,
                              preset=preset, dump_path=str(dump), probe_floor=False))
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["official", "ds4f"])
@pytest.mark.parametrize("case", CASES)
def test_a_run_generates_transformers_tokens(case, form, backend, converted, tmp_path):
    exp = np.load(FIXTURES / case / "expected.npz")
    model = FIXTURES / case if form == "official" else converted[case]
    run = _run(model, exp, backend, tmp_path / "state.bin")
    prompt_len = int(exp["prompt_len"])
    want = exp["tokens"][prompt_len:].tolist() + [int(exp["greedy"][-1])]
    assert run.report["generated"] == want
    state = read_state(tmp_path / "state.bin")
    hidden = state.records["hidden"]                       # [steps, layers, hc_mult * hidden]
    # the fixture's states: at every step, or (case long) at the steps it kept
    steps = exp["steps"] if "steps" in exp.files else np.arange(len(hidden))
    ref = exp["hc_state"].reshape(len(steps), *hidden.shape[1:])
    for row, step in enumerate(steps):
        for layer in range(hidden.shape[1]):
            err = np.abs(hidden[step, layer] - ref[row, layer]).max() / np.abs(ref[row, layer]).max()
            assert err < 3e-5, (step, layer, err)           # as tests/test_attention_model.py
    assert (state.records["ids"].astype(np.int64) == exp["route_ids"][:len(hidden)]).all()


def test_thread_counts_give_the_same_dump(converted, tmp_path):
    exp = np.load(FIXTURES / "tiny" / "expected.npz")
    for backend in BACKENDS:
        one = _run(converted["tiny"], exp, backend, tmp_path / f"{backend}-1.bin", threads=1)
        two = _run(converted["tiny"], exp, backend, tmp_path / f"{backend}-2.bin", threads=2)
        assert one.report["state_sha256"] == two.report["state_sha256"], backend
        assert (tmp_path / f"{backend}-1.bin").read_bytes() == (tmp_path / f"{backend}-2.bin").read_bytes()


def test_the_kv_cache_is_in_the_plan_and_the_context_is_enforced(converted, tmp_path):
    cfg = load_config()
    laptop, server = cfg.get_preset("laptop").context, cfg.get_preset("server").context
    assert laptop >= 32768 and server >= 32768          # what agents' prompts need
    exp = np.load(FIXTURES / "tiny" / "expected.npz")
    run = _run(converted["tiny"], exp, "auto", tmp_path / "a.bin", preset="laptop")
    kv = run.report["summary"]["kv_bytes"]
    assert kv > 0 and run.report["summary"]["context"] == laptop
    assert run.report["summary"]["plan_bytes"] > kv
    # a bigger context allocates a bigger cache (compressed rows scale with it)
    run = _run(converted["tiny"], exp, "auto", tmp_path / "b.bin", preset="server")
    assert run.report["summary"]["kv_bytes"] > kv and run.report["summary"]["context"] == server > laptop
    prompt = tuple(int(t) for t in exp["tokens"][:13])
    with pytest.raises(Ds4fError, match=rf"gen: a prompt of 13 tokens and {laptop} generated ones reach {laptop + 12}"
                                        rf" positions, past the context of {laptop} of preset 'laptop': generate at"
                                        rf" most {laptop - 12}, or raise `context` in \[presets\.laptop\] of ds4f\.toml"):
        start_run(RunConfig(model=str(converted["tiny"]), gen=laptop, prompt=prompt, preset="laptop",
                            probe_floor=False))


def test_a_checkpoint_without_attention_runs_only_when_asked(tiny_moe_only, tmp_path):
    with pytest.raises(Ds4fError, match=r"config\.json has no attention settings .* --moe-only"):
        start_run(RunConfig(model=str(tiny_moe_only), gen=2, probe_floor=False))
    import subprocess
    import sys

    cli = [sys.executable, "-m", "ds4f.cli", "run", str(tiny_moe_only), "-n", "2", "--no-probe",
           "--dump-state", str(tmp_path / "a.bin")]
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--moe-only" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "a.bin").exists()
    ran = subprocess.run(cli + ["--moe-only"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "attention      none: this checkpoint's config has no attention, only the MoE half runs" in ran.stdout
