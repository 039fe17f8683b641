"""A prompt's only bound is the preset's context (the positions its KV cache is allocated for):
one longer than 4096 tokens runs where the context holds it, one past the context is refused
before the run starts, naming the limit, the prompt's length and the setting that raises it, at
the run API and on the command line (the server's answers: tests/server/test_server.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ds4f.engine.config import Budget, Preset
from ds4f.errors import Ds4fError
from ds4f.runs.config import RunConfig, check_context
from ds4f.runs.run import start_run

CONTEXT = 6000
LONG = Preset(name="long", pinned_layers="all", cache=Budget(fraction=1.0), context=CONTEXT, prefill_chunk=512)
LONG_TOML = (f'[engine]\nkernel_threads = 1\nprobe_floor = false\n\n[presets.long]\npinned_layers = "all"\n'
             f'cache = "100%"\ncontext = {CONTEXT}\nprefill_chunk = 512\n')


def _ids(n: int) -> tuple[int, ...]:
    return (0, *((i * 7) % 500 + 2 for i in range(n - 1)))


def test_a_prompt_past_4096_tokens_runs_where_the_context_holds_it(tiny_model, tmp_path):
    prompt = _ids(4500)
    run = start_run(RunConfig(model=str(tiny_model), preset=LONG, gen=2, prompt=prompt, kernel_threads=1,
                              probe_floor=False, dump_path=str(tmp_path / "a.bin")))
    assert run.wait(300) and run.state == "done", run.error
    assert run.report["prompt"] == list(prompt) and len(run.report["generated"]) == 2
    assert run.report["summary"]["context"] == CONTEXT and run.report["summary"]["prefill"]["tokens"] == 4500


@pytest.mark.parametrize("length, gen, param, words", [
    (CONTEXT + 1, 1, "prompt", [f"prompt: {CONTEXT + 1} tokens, past the context of {CONTEXT} positions",
                                "shorten the prompt"]),
    (CONTEXT - 10, 20, "gen", [f"a prompt of {CONTEXT - 10} tokens and 20 generated ones reach {CONTEXT + 9} positions",
                               f"past the context of {CONTEXT}", "generate at most 11"]),
])
def test_a_prompt_past_the_context_is_refused_naming_the_limit_and_the_setting(tiny_model, length, gen, param,
                                                                                words):
    with pytest.raises(Ds4fError) as refused:
        start_run(RunConfig(model=str(tiny_model), preset=LONG, gen=gen, prompt=_ids(length), probe_floor=False))
    exc = refused.value
    assert exc.param == param and exc.kind == "invalid"
    for w in words + ["preset 'long'", "raise `context` in [presets.long] of ds4f.toml"]:
        assert w in exc.message, (w, exc.message)


def test_the_context_itself_is_within_it():
    check_context(CONTEXT, 1, LONG)                 # the prompt fills it; the one generated token is not fed
    check_context(CONTEXT - 10, 11, LONG)
    with pytest.raises(Ds4fError, match="generate at most 11"):
        check_context(CONTEXT - 10, 12, LONG)


def _cli(*args, tmp_path):
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               XDG_CONFIG_HOME=str(tmp_path / "config"))
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_the_command_line_takes_a_long_prompt_and_refuses_one_past_the_context(tiny_model, tmp_path):
    config = tmp_path / "ds4f.toml"
    config.write_text(LONG_TOML)
    out = _cli("generate", tiny_model, "--config", config, "--preset", "long", "-p", "x" * 4500, "-n", "2",
               "--temp", "0", "--json", tmp_path / "r.json", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "4501 prompt tokens" in out.stderr
    refused = _cli("generate", tiny_model, "--config", config, "--preset", "long", "-p", "x" * CONTEXT, "-n", "2",
                   tmp_path=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    err = refused.stderr
    assert f"{CONTEXT + 1} tokens, past the context of {CONTEXT} positions" in err, err
    assert "raise `context` in [presets.long] of ds4f.toml" in err
    ids = ",".join(map(str, _ids(CONTEXT - 1)))
    refused = _cli("run", tiny_model, "--config", config, "--preset", "long", "-p", ids, "-n", "8", "--no-probe",
                   tmp_path=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"reach {CONTEXT + 6} positions" in refused.stderr and "generate at most 2" in refused.stderr
