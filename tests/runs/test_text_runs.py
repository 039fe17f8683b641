"""Runs that read and write text: the prompt through the checkpoint's tokenizer, the output
streamed token by token, sampling, stop strings and the end-of-sentence token.

Reference values come from outside the run: the HF tokenizer itself (decode), the state dump's
own records, and a float64 numpy sampler written here from the documented order."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from ds4f.errors import Ds4fError
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.runs.statedump import read_state
from ds4f.engine.text.sampling import SamplingParams
from ds4f.engine.text.tokenizer import Tokenizer


def _run(model, tmp_path, name, **kw):
    pieces = []
    kw.setdefault("backend", "scalar")
    run = start_run(RunConfig(model=str(model), probe_floor=False, dump_path=str(tmp_path / f"{name}.bin"), **kw),
                    on_token=lambda r: pieces.append(r.text))
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run, pieces


def _generated(run) -> list[int]:
    return run.report["generated"]


def test_a_text_prompt_is_tokenized_and_the_output_is_the_tokens_decoded(tiny_model, tmp_path):
    tok = Tokenizer.load(tiny_model)
    run, pieces = _run(tiny_model, tmp_path, "text", text="The cache keeps hot experts.", gen=12,
                       stop_at_eos=False)
    assert run.prompt == (tok.bos_id, *tok.encode("The cache keeps hot experts."))
    gen = _generated(run)
    assert len(gen) == run.generated_tokens == 12 and run.finish_reason == "length"
    assert run.output_text == tok.decode(gen)            # the HF tokenizer's own decoding
    assert "".join(pieces) == run.output_text            # streamed pieces add up to the output
    assert all(p == "" for p in pieces[:len(run.prompt) - 1])   # prompt tokens add no output
    text = run.report["text"]
    assert (text["prompt"], text["output"], text["finish_reason"]) == ("The cache keeps hot experts.",
                                                                       run.output_text, "length")
    assert text["prompt_tokens"] == len(run.prompt) and text["generated_tokens"] == 12
    assert read_state(run.dump_path).header["n_tokens"] == len(run.prompt) - 1 + 12


def test_chat_messages_use_the_chat_format(tiny_model, tmp_path):
    from ds4f.engine.text.chat import chat_prompt_ids

    tok = Tokenizer.load(tiny_model)
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"})
    run, _ = _run(tiny_model, tmp_path, "chat", messages=messages, gen=3)
    assert list(run.prompt) == chat_prompt_ids(tok, list(messages))
    assert run.prompt[0] == tok.bos_id and run.prompt[-1] == tok.special_id("</think>")


def _numpy_sample(top_logits: np.ndarray, top_ids: np.ndarray, temperature: float, rng) -> int:
    """Top-k sampling over the k recorded logits, written from the documented order: scale,
    softmax, sort descending (ties by id), renormalise, one uniform, first cumulative above it."""
    z = top_logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    order = sorted(range(len(p)), key=lambda i: (-p[i], top_ids[i]))
    r = np.array([p[i] for i in order]) / sum(p[i] for i in order)
    u = rng.random()
    c = 0.0
    for j, i in enumerate(order):
        c += r[j]
        if c > u:
            return int(top_ids[i])
    return int(top_ids[order[-1]])


def test_sampled_tokens_equal_an_independent_sampler_on_the_recorded_logits(tiny_model, tmp_path):
    params = SamplingParams(temperature=1.7, top_k=8, seed=1234)
    run, _ = _run(tiny_model, tmp_path, "sampled", text="Hello", gen=16, sampling=params, stop_at_eos=False)
    recs = read_state(run.dump_path).records
    first = len(run.prompt) - 1
    rng = np.random.Generator(np.random.PCG64(1234))
    expected = [_numpy_sample(r["top_logits"], r["top_ids"], 1.7, rng) for r in recs[first:]]
    assert _generated(run) == expected
    greedy = [int(r["top_ids"][0]) for r in recs[first:]]
    assert expected != greedy     # at this temperature the draws leave the argmax somewhere in 16 tokens


def test_same_seed_same_dump_at_any_thread_count_and_seeds_differ(tiny_model, tmp_path):
    params = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, seed=7)
    a, _ = _run(tiny_model, tmp_path, "a", text="Hello", gen=10, sampling=params, kernel_threads=1,
                stop_at_eos=False)
    b, _ = _run(tiny_model, tmp_path, "b", text="Hello", gen=10, sampling=params, kernel_threads=2,
                stop_at_eos=False)
    assert a.dump_path.read_bytes() == b.dump_path.read_bytes()
    assert read_state(a.dump_path).header["sampling"] == params.to_dict()
    others = [_generated(_run(tiny_model, tmp_path, f"s{seed}", text="Hello", gen=10, stop_at_eos=False,
                              sampling=SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, seed=seed))[0])
              for seed in (8, 9)]
    assert any(o != _generated(a) for o in others)


def test_greedy_equals_temperature_zero_and_top_k_one(tiny_model, tmp_path):
    plain, _ = _run(tiny_model, tmp_path, "greedy", text="Hello", gen=6, stop_at_eos=False)
    for name, params in (("t0", SamplingParams(temperature=0.0, seed=3)), ("k1", SamplingParams(top_k=1, seed=3))):
        other, _ = _run(tiny_model, tmp_path, name, text="Hello", gen=6, sampling=params, stop_at_eos=False)
        assert other.dump_path.read_bytes() == plain.dump_path.read_bytes()


def test_a_stop_string_ends_the_output_before_it_and_the_dump_is_whole(tiny_model, tmp_path):
    tok = Tokenizer.load(tiny_model)
    free, _ = _run(tiny_model, tmp_path, "free", text="Hello", gen=24, stop_at_eos=False)
    out = free.output_text
    assert len(out) > 6
    stop = out[3:6]                                     # a string the greedy output contains
    cut = out.index(stop)
    run, pieces = _run(tiny_model, tmp_path, "stopped", text="Hello", gen=24, stop=(stop,), stop_at_eos=False)
    assert run.finish_reason == "stop" and run.output_text == out[:cut]
    assert "".join(pieces) == out[:cut]                 # what was streamed never ran past the stop
    n = run.generated_tokens
    assert n < 24 and tok.decode(_generated(free)[:n]).find(stop) >= 0
    assert tok.decode(_generated(free)[:n - 1]).find(stop) < 0   # the token that completed it ended the run
    state = read_state(run.dump_path)                 # the dump's header counts the records written
    assert state.header["n_tokens"] == len(state.records) == len(run.prompt) - 1 + n
    assert run.report["state_sha256"] == state.sha256


def test_the_end_of_sentence_token_ends_a_text_run(tiny_model, tmp_path):
    """Random weights seldom pick the real EOS, so a copy of the model names as its eos_token
    (tokenizer_config.json) the token greedy decoding produces third: the run must end there."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    free, _ = _run(tiny_model, tmp_path, "free", text="Hello", gen=8, stop_at_eos=False)
    gen = _generated(free)
    target = gen[2]
    first = gen.index(target)                            # where that token first appears
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_model, model)
    name = HFTokenizer.from_file(str(model / "tokenizer.json")).id_to_token(target)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["eos_token"] = name
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.load(model)
    assert tok.eos_id == target
    run, pieces = _run(model, tmp_path, "eos", text="Hello", gen=8)
    assert run.finish_reason == "eos" and run.generated_tokens == first + 1
    assert _generated(run) == gen[:first + 1]
    assert run.output_text == tok.decode(gen[:first]) == "".join(pieces)   # the EOS itself adds no text
    kept, _ = _run(model, tmp_path, "kept", text="Hello", gen=8, stop_at_eos=False)
    assert _generated(kept) == gen                     # without stop_at_eos the run goes on


def test_text_without_a_tokenizer_is_refused_with_the_reason(tiny_model, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(Ds4fError) as e:
        start_run(RunConfig(model=str(bare), text="Hello", gen=2, probe_floor=False))
    assert e.value.param == "model" and "tokenizer" in str(e.value)
    run, pieces = _run(bare, tmp_path, "ids", prompt=(0, 17), gen=2)      # token ids still run
    assert run.output_text == "" and pieces == ["", "", ""]


@pytest.mark.parametrize("kw, param", [
    (dict(text="Hi", prompt=(0, 1)), "text"),
    (dict(text=""), "text"),
    (dict(messages=({"role": "robot", "content": "x"},)), "messages"),
    (dict(text="Hi", stop="x"), "stop"),
    (dict(text="Hi", stop=("",)), "stop"),
    (dict(text="Hi", sampling={"temperature": 1}), "sampling"),
])
def test_bad_text_settings_name_the_parameter(tiny_model, kw, param):
    with pytest.raises(Ds4fError) as e:
        start_run(RunConfig(model=str(tiny_model), gen=2, probe_floor=False, **kw))
    assert e.value.param == param, str(e.value)
