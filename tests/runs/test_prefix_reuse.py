"""Runs reuse the prefix cache exactly: a chat's next turn, on a loaded engine or after a restart
(from disk), computes only what its prompt adds, and its state dump (so its tokens, routing,
hidden states and logits) is byte for byte a cold run's, in chat and thinking mode and with
layer-major chunks; a cold start or reuse_prefix=False computes the whole prompt."""
from __future__ import annotations

import hashlib

import pytest

from ds4f.engine.text.sampling import SamplingParams
from ds4f.native import kernels
from ds4f.runs.config import RunConfig
from ds4f.runs.host import EngineHost
from ds4f.runs.run import start_run

GEN = 6


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _config(tmp_path, kv=True) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[kv]\nenabled = {"true" if kv else "false"}\nram = "64 MiB"\ndir = "{tmp_path / "kv"}"\n'
                   f'budget = "1 GB"\n')
    return str(cfg)


def _chat(model, tmp_path, name, messages, host=None, **kw):
    kw.setdefault("gen", GEN)
    kw.setdefault("probe_floor", False)
    kw.setdefault("config_path", _config(tmp_path))
    kw.setdefault("sampling", SamplingParams(temperature=0.8, seed=3))
    run = start_run(RunConfig(model=str(model), messages=tuple(messages), dump_path=str(tmp_path / f"{name}.bin"),
                              **kw), engines=host)
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


def _turns(first, question="What is an expert cache?", ids=True):
    """Turn two's messages: turn one's question, its answer (as the console and ds4f chat keep it,
    with the ids it was generated as; or as text alone, as an OpenAI client sends it), and a new
    question."""
    answer = first.assistant_message if ids else {"role": "assistant", "content": first.output_text}
    return [{"role": "user", "content": question}, answer, {"role": "user", "content": "And why keep it warm?"}]


@pytest.mark.parametrize("thinking, ids", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("chunk", [0, 8])
def test_a_chats_next_turn_reuses_the_first_and_writes_a_cold_runs_dump(tiny_model, tmp_path, thinking, ids, chunk):
    q1 = [{"role": "user", "content": "What is an expert cache?"}]
    kw = dict(thinking=thinking, prefill_chunk=chunk, backend=kernels.best_backend())
    host = EngineHost()
    try:
        one = _chat(tiny_model, tmp_path, "one", q1, host, **kw)
        assert one.prompt_tokens_reused == 0
        two = _chat(tiny_model, tmp_path, "two", _turns(one, ids=ids), host, **kw)
        assert two.prompt_tokens_reused > 0
        # everything up to the turn's own assistant opening comes from turn one's states
        assert two.prompt_tokens_reused >= one.prompt_tokens - 2
        if not thinking:   # and the answer too: all that turn one fed (not its last pick)
            # (sent back as text alone, it is spelled as the kept state spells it)
            fed = one.prompt + one.generated_ids[:-1]
            assert two.prompt[:len(fed)] == fed and two.prompt_tokens_reused == len(fed)
            if ids:
                assert two.prompt[:len(fed) + 1] == one.prompt + one.generated_ids
        computed = two.prompt_tokens - two.prompt_tokens_reused
        s = two.report["summary"]
        assert s["prompt_tokens_reused"] == two.prompt_tokens_reused
        assert two.report["text"]["prompt_tokens_reused"] == two.prompt_tokens_reused
        assert any("prompt tokens reused" in e for e in two.report["events"])
        rows = two.report["tokens"]
        assert sum(t["reused"] for t in rows) == two.prompt_tokens_reused
        assert all(t["seconds"] == 0 and t["bytes_read"] == 0 for t in rows if t["reused"])
        assert computed < two.prompt_tokens
    finally:
        host.close()
    # the same turn computed whole, on a fresh engine, with no prefix cache: the same conversation,
    # its answer as the ids turn two's prompt holds
    messages = _turns(one, ids=ids)
    if not ids and not thinking:
        end = two.prompt.index(one.tokenizer.eos_id, one.prompt_tokens)
        messages[1] = dict(messages[1], tokens=list(two.prompt[one.prompt_tokens:end]))
    cold = _chat(tiny_model, tmp_path, "cold", messages, config_path=_config(tmp_path / "off", kv=False), **kw)
    assert cold.prompt == two.prompt
    assert cold.prompt_tokens_reused == 0
    assert _sha(two.dump_path) == _sha(cold.dump_path)
    assert two.output_text == cold.output_text and two.report["generated"] == cold.report["generated"]


def test_a_restart_reuses_the_states_kept_on_disk(tiny_model, tmp_path):
    q1 = [{"role": "user", "content": "Hello there"}]
    one = _chat(tiny_model, tmp_path, "one", q1)               # its own engine, gone after the run
    assert list((tmp_path / "kv").glob("*.kv"))
    two = _chat(tiny_model, tmp_path, "two", _turns(one, "Hello there"))   # a new engine: states from disk
    assert two.prompt_tokens_reused >= one.prompt_tokens - 2
    cold = _chat(tiny_model, tmp_path, "cold", _turns(one, "Hello there"), reuse_prefix=False)
    assert cold.prompt_tokens_reused == 0 and _sha(two.dump_path) == _sha(cold.dump_path)


def test_a_cold_start_computes_the_whole_prompt(tiny_model, tmp_path):
    q1 = [{"role": "user", "content": "Hello there"}]
    host = EngineHost()
    try:
        one = _chat(tiny_model, tmp_path, "one", q1, host)
        again = _chat(tiny_model, tmp_path, "again", q1, host)
        assert again.prompt_tokens_reused == one.prompt_tokens - 1    # all but the last prompt token
        cold = _chat(tiny_model, tmp_path, "cold", q1, host, cold_start=True)
        assert cold.prompt_tokens_reused == 0
        assert _sha(one.dump_path) == _sha(again.dump_path) == _sha(cold.dump_path)
    finally:
        host.close()


def test_the_records_a_kept_state_gives_are_a_cold_runs_of_the_same_tokens(tiny_model, tmp_path):
    """The state kept at a run's end covers its prompt and its answer (sampled: each answer
    token's record names the drawn next token); reused as a prompt, its records must be those a
    run on these tokens as its prompt writes (each names the greedy choice)."""
    from ds4f.runs.prefix import reusable_records
    from ds4f.runs.statedump import read_records

    host = EngineHost()
    try:
        one = _chat(tiny_model, tmp_path, "one", [{"role": "user", "content": "Hello there"}], host,
                    sampling=SamplingParams(temperature=5.0, seed=11))      # draws far from the greedy ones
        fed = one.report["prompt"] + one.report["generated"][:-1]      # every token the run evaluated
        cache = host._engine.prefix_cache
        state = cache.lookup(fed, host._engine.backend)
        assert state is not None and state.position == len(fed)       # the end-of-run state
        records = reusable_records(state, read_records(one.dump_path, 0, 1).dtype)
    finally:
        host.close()
    # the same tokens as a prompt (and one more), computed whole on an engine of its own
    run = start_run(RunConfig(model=str(tiny_model), prompt=tuple(fed) + (5,), gen=2, probe_floor=False,
                              backend=one.report["backend_by_token"][0], dump_path=str(tmp_path / "ids.bin"),
                              dump="compact"))
    assert run.wait(120) and run.state == "done", run.error
    cold = read_records(run.dump_path, 0, len(fed))
    assert records.tobytes() == cold.tobytes()
    # and the run's own records differ where it drew its answer: the rewrite is what makes them equal
    assert read_records(one.dump_path, 0, len(fed)).tobytes() != cold.tobytes()


@pytest.mark.parametrize("chunk", [0, 7])
def test_another_conversation_reuses_the_system_prompt(tiny_model, tmp_path, chunk):
    """A run keeps a state before its first user message, so a conversation with
    the same system prompt starts from it; a chunk ends there (7: not a divisor of that position)."""
    system = {"role": "system", "content": "You keep a lighthouse on a rock in the sea. Answer in one line."}
    host = EngineHost()
    try:
        one = _chat(tiny_model, tmp_path, "one", [system, {"role": "user", "content": "Any boats?"}], host,
                    prefill_chunk=chunk)
        user = one.tokenizer.special_id("<｜User｜>")
        assert one.prompt.index(user) % 7 and one.prompt.index(user) > 7
        two = _chat(tiny_model, tmp_path, "two", [system, {"role": "user", "content": "How is the weather?"}],
                    host, prefill_chunk=chunk)
        assert two.prompt_tokens_reused == two.prompt.index(user) == one.prompt.index(user)
    finally:
        host.close()
    cold = _chat(tiny_model, tmp_path, "cold", [system, {"role": "user", "content": "How is the weather?"}],
                 prefill_chunk=chunk, reuse_prefix=False)
    assert cold.prompt_tokens_reused == 0 and _sha(two.dump_path) == _sha(cold.dump_path)


def test_marks():
    from ds4f.runs.prefix import marks

    U = 2
    assert marks([0, 7, U, 8, 3, 5]) == [5]
    assert marks([0, 7, U, 8, 3, 5], U) == [2, 5]
    assert marks([0, 4, U, 8, 3, 1, U, 9, 3, 5], U) == [2, 9]    # the first user message only
    assert marks([0, U, 8, 3, 1, U, 9, 3, 5], U) == [8]          # not at BOS alone
    assert marks([0, 7, 5], U) == [2] and marks([0, 7], U) == marks([0], U) == []
