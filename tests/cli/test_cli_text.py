"""`ds4f generate` and `ds4f chat` end to end, in subprocesses, on the tiny model with its tokenizer."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from ds4f.engine.text.chat import chat_prompt_ids
from ds4f.engine.text.tokenizer import Tokenizer


def _cli(*args, tmp_path, stdin=None):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          env=_env(tmp_path), input=stdin, timeout=300)


def test_generate_prints_the_tokens_decoded_and_a_summary(tiny_model, tmp_path):
    report = tmp_path / "r.json"
    out = _cli("generate", tiny_model, "-p", "Hello, world", "-n", "16", "--seed", "5", "--temp", "0.9",
               "--json", report, tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    r = json.loads(report.read_text())
    tok = Tokenizer.load(tiny_model)
    gen = r["generated"]
    ends = gen[-1] == tok.eos_id and r["text"]["finish_reason"] == "eos"
    expected = tok.decode(gen[:-1] if ends else gen)       # the HF tokenizer's decoding of the report's tokens
    assert out.stdout == expected + "\n"
    assert r["prompt"] == [tok.bos_id, *tok.encode("Hello, world")]
    assert r["text"]["sampling"] == {"temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 5}
    err = out.stderr
    assert f"{len(r['prompt'])} prompt tokens" in err and f"{len(gen)} generated" in err
    assert "tokens/s" in err and "s/token" in err and "GB/token" in err and "hit rate" in err and "seed 5" in err
    again = _cli("generate", tiny_model, "-p", "Hello, world", "-n", "16", "--seed", "5", "--temp", "0.9",
                 tmp_path=tmp_path)
    assert again.stdout == out.stdout                       # same seed, same settings: same text
    refused = _cli("generate", tiny_model, "-p", "x", "--json", report, tmp_path=tmp_path)
    assert refused.returncode == 2 and "already exists" in refused.stderr


def test_generate_chat_uses_the_chat_format(tiny_model, tmp_path):
    report = tmp_path / "c.json"
    out = _cli("generate", "-m", tiny_model, "--chat", "--system", "Be brief.", "-p", "Hi", "-n", "4", "--temp", "0",
               "--json", report, tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    tok = Tokenizer.load(tiny_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert json.loads(report.read_text())["prompt"] == chat_prompt_ids(tok, messages)
    assert "greedy" in out.stderr


def test_text_commands_need_a_tokenizer_and_say_so(tiny_model, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    (bare / "tokenizer.json").unlink()
    out = _cli("generate", bare, "-p", "Hello", tmp_path=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no tokenizer" in out.stderr and str(bare) in out.stderr


def test_chat_keeps_the_conversation_and_resets_it(tiny_model, tmp_path):
    out = _cli("chat", tiny_model, "-n", "3", "--temp", "0", "--history", tmp_path=tmp_path,
               stdin="Hello\nHow are you?\n/reset\nHello\n/quit\n")
    assert out.returncode == 0, out.stderr
    summaries = [line for line in out.stderr.splitlines() if line.startswith("[") and "prompt tokens" in line]
    assert len(summaries) == 3 and "(conversation cleared)" in out.stderr
    counts = [int(s[1:].split(" prompt tokens")[0]) for s in summaries]
    assert counts[1] > counts[0] and counts[2] == counts[0]   # the second turn carries the first; /reset drops it
    # and reuses all of it that was fed: the first prompt, its answer (as its ids) but the last pick
    generated = int(summaries[0].split(" generated")[0].split()[-1])
    assert f"{counts[1]} prompt tokens ({counts[0] + generated - 1} reused from the prefix cache)" in summaries[1]
    answers = [a for a in out.stdout.split("> ") if a]     # each answer after its prompt, "/reset" printed none
    assert len(answers) == 3 and answers[0] == answers[2]   # greedy: the same first answer again


def test_history_shows_a_text_run_with_its_prompt_output_and_sampling(tiny_model, tmp_path):
    out = _cli("generate", tiny_model, "-p", "Hello", "-n", "5", "--seed", "4", "--history", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    runs = json.loads(_cli("history", "list", "-o", "json", tmp_path=tmp_path).stdout)
    show = _cli("history", "show", runs[0]["run_id"], tmp_path=tmp_path)
    assert show.returncode == 0, show.stderr
    assert "prompt text    'Hello'" in show.stdout and "seed 4" in show.stdout
    assert f"output         {out.stdout[:-1]!r}" in show.stdout      # the text generate printed
    assert "tokens         5 generated of 5 asked" in show.stdout and "sha256" in show.stdout


def test_generate_reads_special_token_strings_as_text_unless_asked(tiny_model, tmp_path):
    """A prompt's "<｜User｜>" is text by default; --special-tokens makes it the control token;
    --chat never does (its messages are text) and refuses the flag."""
    from ds4f.engine.text import Tokenizer

    tok = Tokenizer.load(tiny_model)
    text = "Hi<｜User｜>there</think>"
    prompts = {}
    for flag in ((), ("--special-tokens",)):
        report = tmp_path / f"r{len(flag)}.json"
        out = _cli("generate", tiny_model, "-p", text, "-n", "2", "--temp", "0", "--json", report, *flag,
                   tmp_path=tmp_path)
        assert out.returncode == 0, out.stderr
        prompts[flag] = json.loads(report.read_text())["prompt"]
    assert prompts[()] == [tok.bos_id] + tok.encode_text(text)
    assert not any(tok.is_special(i) for i in prompts[()][1:])
    assert prompts[("--special-tokens",)] == [tok.bos_id] + tok.encode(text)
    assert tok.special_id("<｜User｜>") in prompts[("--special-tokens",)]
    bad = _cli("generate", tiny_model, "-p", text, "--chat", "--special-tokens", tmp_path=tmp_path)
    assert bad.returncode == 2 and "--special-tokens" in bad.stderr and "Traceback" not in bad.stderr


def _env(tmp_path):
    return dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data"), XDG_CACHE_HOME=str(tmp_path / "cache"),
                XDG_CONFIG_HOME=str(tmp_path / "config"))


def test_chat_refuses_a_line_of_invalid_utf8_and_goes_on(tiny_model, tmp_path):
    env = _env(tmp_path)
    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "chat", str(tiny_model), "-n", "2", "--temp", "0"],
                         input=b"Hello \xff\xfe there\nHello\n/quit\n", capture_output=True, timeout=300, env=env)
    err = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 0, err
    assert "not valid text" in err and "Traceback" not in err
    summaries = [line for line in err.splitlines() if line.startswith("[") and "prompt tokens" in line]
    assert len(summaries) == 1        # the bad line answered nothing; the next one was answered


def test_generate_refuses_invalid_utf8_in_its_prompt(tiny_model, tmp_path):
    out = subprocess.run([sys.executable.encode(), b"-m", b"ds4f.cli", b"generate", str(tiny_model).encode(), b"-p",
                          b"caf\xe9", b"-n", b"2"], capture_output=True, timeout=300, env=_env(tmp_path))
    err = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 2 and "not valid text" in err and "Traceback" not in err
