"""Speculative decoding with a trained MTP layer: tests/fixtures/toolcall's model-mtp.safetensors,
learned beside the frozen tool-calling model by tools/make_mtp_layer.py (its record:
mtp_training.json). Greedy speculation gives plain decoding's tokens on the script's
conversations, and the MTP layer's first drafts are kept at a rate that random weights never
reach (a synthetic MTP layer put beside the same model stays below the bar)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds4f.engine.checkpoint.synth import MTP_SHARD, add_mtp_layer
from ds4f.engine.model.mtp import MAX_DRAFTS
from ds4f.engine.speculative import SpecController
from ds4f.runs.config import RunConfig
from ds4f.runs.host import EngineHost
from ds4f.runs.run import start_run

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "toolcall"
CASES = ("weather_Paris", "think_pair_Paris_Rome")     # a plain call, and two calls in thinking mode
# What tools/make_mtp_layer.py measured on every conversation: 0.99 of the first drafts kept
# (mtp_training.json, "ds4f"); random MTP weights keep almost none.
MIN_DEPTH1_ACCEPTANCE = 0.45

pytestmark = pytest.mark.skipif(not (FIXTURE / MTP_SHARD).is_file(),
                                reason="tests/fixtures/toolcall has no trained MTP layer (tools/make_mtp_layer.py)")


def _conversation(name: str) -> dict:
    """A case's first turn as the tests send it: the system prompt, the user's messages, the tools."""
    script = json.loads((FIXTURE / "script.json").read_text(encoding="utf-8"))
    case = next(c for c in script["cases"] if c["name"] == name)
    return {"messages": tuple([{"role": "system", "content": script["system"]}] + case["messages"]),
            "thinking": case["thinking"], "tools": tuple(script["tools"])}


def _run(model: Path, tmp_path: Path, name: str, spec, engines=None, tag: str = "", **fields) -> object:
    run = start_run(RunConfig(model=str(model), **_conversation(name), gen=96, stop_at_eos=True, spec=spec,
                              probe_floor=False, reuse_prefix=False, kernel_threads=1, io_threads=1,
                              dump_path=str(tmp_path / f"{name}-{spec}{tag}.bin"), **fields), engines=engines)
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


def _depth1(model: Path, tmp_path: Path) -> tuple[int, int]:
    """(drafts kept, drafts made) with one draft per round, over CASES."""
    kept = made = 0
    for name in CASES:
        sp = _run(model, tmp_path, name, 1).report["summary"]["spec"]
        assert sp["active"] and sp["rounds"] > 0
        kept, made = kept + sp["accepted"], made + sp["drafted"]
    return kept, made


@pytest.mark.parametrize("name", CASES)
def test_greedy_speculation_gives_plain_decodings_tokens(name, tmp_path):
    plain = _run(FIXTURE, tmp_path, name, "off")
    assert plain.report["generated"][-1] == 1               # the answer ends at EOS
    for spec in (2, 3):
        fast = _run(FIXTURE, tmp_path, name, spec)
        assert list(fast.generated_ids) == list(plain.generated_ids), spec
        sp = fast.report["summary"]["spec"]
        assert sp["active"] and sp["mode"] == str(spec)
        # each round gives its kept drafts and one token more; the round that reaches EOS stops there
        assert sp["accepted"] + sp["rounds"] - 1 <= sp["tokens"] <= sp["accepted"] + sp["rounds"]
        assert sp["tokens_per_round"] > 1.5, sp              # drafts are kept: fewer rounds than tokens
        depth = sp["by_depth"]                               # every round judges its first draft; the
        assert depth["1"][0] == sp["rounds"]                 # kept ones at all depths are the accepted
        assert sum(kept for _judged, kept in depth.values()) == sp["accepted"] and len(depth) <= spec


def test_the_trained_layers_first_drafts_are_mostly_kept(tmp_path):
    kept, made = _depth1(FIXTURE, tmp_path)
    assert kept / made >= MIN_DEPTH1_ACCEPTANCE, (kept, made)


def test_random_mtp_weights_stay_below_the_bar(tmp_path):
    """The same main model with a synthetic MTP layer (random weights): the bar above is a real one."""
    root = tmp_path / "random-mtp"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns(MTP_SHARD, "model.safetensors.index.json"))
    add_mtp_layer(root, seed=0)
    kept, made = _depth1(root, tmp_path)
    assert kept / made < MIN_DEPTH1_ACCEPTANCE, (kept, made)


def test_auto_on_a_kept_engine_starts_from_what_the_runs_before_measured(tmp_path):
    """A console or a server keeps its engine: auto's second conversation starts from what the
    first measured (its acceptance and costs: the first choice is the first run's last, where a
    fresh controller steps plainly to measure), drafts what it knows is kept, and gives plain
    decoding's tokens. (How many plain steps either run takes follows from measured seconds, so
    the test compares decisions from the same figures, not step counts.)"""
    name = CASES[0]
    plain = _run(FIXTURE, tmp_path, name, "off")
    host = EngineHost()
    try:
        _run(FIXTURE, tmp_path, CASES[1], "auto", engines=host)
        learned = host._engine.spec_learned
        assert learned is not None and learned.tries[1] > 0
        start = SpecController("auto").learn_from(learned)
        assert SpecController("auto").choose(MAX_DRAFTS) == 0              # fresh: measures a plain step first
        assert start.choose(MAX_DRAFTS) == learned.choose(MAX_DRAFTS)      # kept: decides as the first run ended
        assert start.acceptance(1) == learned.acceptance(1) and start.plain_s == learned.plain_s
        second = _run(FIXTURE, tmp_path, name, "auto", engines=host, tag="-kept")
        cold = _run(FIXTURE, tmp_path, name, "auto", engines=host, tag="-cold", cold_start=True)
    finally:
        host.close()
    assert list(second.generated_ids) == list(plain.generated_ids)
    sp = second.report["summary"]["spec"]
    assert sp["accepted"] >= MIN_DEPTH1_ACCEPTANCE * sp["drafted"]
    assert any("earlier runs' measurements" in str(e) for e in second.report["events"])
    # a cold start measures afresh, as a fresh engine's run does
    assert cold.report["summary"]["spec"]["shadows"] >= 1
    assert not any("earlier runs' measurements" in str(e) for e in cold.report["events"])


def test_the_cli_says_what_the_drafts_kept(tmp_path):
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               XDG_CONFIG_HOME=str(tmp_path / "config"))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "ds4f.cli", *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=env)

    run = cli("run", str(FIXTURE), "--spec", "2", "-n", "12", "--dump-state", str(tmp_path / "r.bin"))
    assert run.returncode == 0, run.stderr
    line = next(ln for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("speculation"))
    assert "rounds with drafts" in line and "by depth 1: " in line, line
    gen = cli("generate", str(FIXTURE), "--chat", "-p", "What is the weather in Paris?", "--spec", "3", "-n", "8")
    assert gen.returncode == 0, gen.stderr
    assert "spec 3: " in gen.stderr and "of drafts kept" in gen.stderr, gen.stderr
