"""Structured outputs (engine.text.constraint): a sampler held to a JSON Schema, driven by random
logits over the synthetic tokenizer's vocabulary, so the answers are whatever the mask lets
through; each is checked by `jsonschema` (an independent validator), and each pick against a
plain sampler on the logits with every disallowed token set to -inf.
"""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import GEOMETRIES
from ds4f.engine.text.constraint import Constraint, ResponseFormat, check_response_format, compiled_for
from ds4f.engine.text.sampling import Sampler, SamplingParams
from ds4f.engine.text.synthetic import write_tokenizer_files
from ds4f.engine.text.tokenizer import END_THINK, Tokenizer

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
          "required": ["name", "age", "color", "tags"], "additionalProperties": False}
LIMIT = 400         # tokens an answer may take here (the schema bounds every value)
PADDED = 64         # ids the model's vocabulary has past the tokenizer's


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, GEOMETRIES["tiny"])
    return Tokenizer.load(d)


def _answer(tok, fmt, params, seed, vocab=None, thinking=False, bias=None):
    """Generate with random logits until the end-of-sentence token: (the answer's ids, the constraint)."""
    vocab = vocab or tok.vocab_size
    c = Constraint(tok, fmt, vocab, thinking=thinking)
    sampler = Sampler(params, constraint=c)
    rng = np.random.default_rng(seed)
    ids = []
    for step in range(LIMIT):
        logits = rng.normal(0, 3, vocab).astype(np.float32)
        if bias is not None:
            bias(step, logits)
        t = sampler.sample(logits)
        if t == tok.eos_id:
            return ids, c
        ids.append(t)
    raise AssertionError(f"no end within {LIMIT} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
                                    SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.7, top_p=0.9,
                                                                                             top_k=40, seed=5)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_answers_follow_the_schema(tok, params, seed):
    ids, c = _answer(tok, ResponseFormat.json_schema(PERSON, name="person"), params, seed)
    value = json.loads(tok.decode(ids))
    jsonschema.validate(value, PERSON)
    assert list(value) == ["name", "age", "color", "tags"]      # in the schema's order
    assert c.accepting and c.tokens == len(ids) + 1              # the end-of-sentence token consumed too


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_object_answers_are_objects(tok, seed):
    # the end-of-sentence token's logit raised: a random walk through any JSON ends sooner
    def bias(step, logits):
        logits[tok.eos_id] += 8
    ids, _ = _answer(tok, ResponseFormat.json_object(), SamplingParams(temperature=1.0, seed=seed), seed, bias=bias)
    assert isinstance(json.loads(tok.decode(ids)), dict)


def test_each_pick_is_the_plain_samplers_on_the_masked_logits(tok):
    """The constrained pick equals a plain sampler's (same seed) on the logits with every id the
    constraint does not allow at -inf; the end-of-sentence token only where the text is whole."""
    fmt = ResponseFormat.json_schema(PERSON)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=50, min_p=0.01, seed=9)):
        shadow = Constraint(tok, fmt, tok.vocab_size)
        constrained = Sampler(params, constraint=Constraint(tok, fmt, tok.vocab_size))
        plain = Sampler(params)
        rng = np.random.default_rng(4)
        ids = []
        for _ in range(LIMIT):
            logits = rng.normal(0, 3, tok.vocab_size).astype(np.float32)
            allowed = shadow.allowed()
            masked = np.full_like(logits, -np.inf)
            masked[allowed] = logits[allowed]
            t = constrained.sample(logits)
            assert t == plain.sample(masked)
            if tok.eos_id in allowed:
                jsonschema.validate(json.loads(tok.decode(ids)), PERSON)
            shadow.advance(t)
            if t == tok.eos_id:
                break
            ids.append(t)
        else:
            raise AssertionError("no end")
        assert constrained.draws == plain.draws


def test_padded_ids_are_never_picked(tok):
    """A model whose vocabulary is past the tokenizer's: its extra ids are never allowed, even
    with the highest logits."""
    vocab = tok.vocab_size + PADDED

    def bias(step, logits):
        logits[tok.vocab_size:] = 100.0
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=2)):
        ids, _ = _answer(tok, ResponseFormat.json_schema(PERSON), params, 0, vocab=vocab, bias=bias)
        assert max(ids) < tok.vocab_size
        jsonschema.validate(json.loads(tok.decode(ids)), PERSON)


def test_thinking_mode_reasons_freely_then_answers_after_think_end(tok):
    end = tok.special_id(END_THINK)

    def bias(step, logits):
        logits[tok.eos_id] = 50.0          # the model would end at once: not before the answer
        if step == 20:
            logits[end] = 100.0
    ids, c = _answer(tok, ResponseFormat.json_schema(PERSON), SamplingParams(temperature=1.0, seed=1), 0,
                     thinking=True, bias=bias)
    assert ids[20] == end and end not in ids[:20] and tok.eos_id not in ids
    jsonschema.validate(json.loads(tok.decode(ids[21:])), PERSON)
    assert c.answering and c.tokens == len(ids) - 21 + 1


@pytest.mark.parametrize("schema, reason", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"$ref": "#/$defs/Missing"}, "Missing"),
    ({"type": "integer", "minimum": 10, "maximum": 1}, "minimum"),
    ({"type": "nonsense"}, "nonsense"),
])
def test_schemas_the_library_cannot_compile_are_refused_naming_response_format(tok, schema, reason):
    fmt = ResponseFormat.json_schema(schema)
    for attempt in (lambda: check_response_format(fmt), lambda: Constraint(tok, fmt, tok.vocab_size)):
        with pytest.raises(Ds4fError) as exc:
            attempt()
        assert exc.value.param == "response_format" and exc.value.kind == "invalid"
        assert reason in exc.value.message and exc.value.message.startswith("response_format: ")


@pytest.mark.parametrize("schema", [[1, 2], "not json", True])
def test_a_schema_must_be_a_json_object(schema):
    with pytest.raises(Ds4fError) as exc:
        ResponseFormat.json_schema(schema)
    assert exc.value.param == "response_format"


def test_a_compiled_grammar_is_kept_by_schema_text(tok):
    fmt = ResponseFormat.json_schema({"type": "object", "properties": {"kept": {"type": "boolean"}}})
    comp = compiled_for(tok)
    Constraint(tok, fmt, tok.vocab_size)
    kept = comp.matchers[fmt.schema]
    a, b = Constraint(tok, fmt, tok.vocab_size), Constraint(tok, fmt, tok.vocab_size)
    assert comp.matchers[fmt.schema] is kept and a.matcher is not b.matcher     # one compilation, own states
    a.advance(tok.encode("{")[0])
    assert a.tokens == 1 and b.tokens == 0 and b.allowed().tolist() != a.allowed().tolist()


def test_without_a_constraint_the_sampler_is_unchanged(tok):
    """No constraint: the same picks and draws as a sampler made without the argument."""
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 2, (50, tok.vocab_size)).astype(np.float32)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.8, seed=7)):
        a, b = Sampler(params), Sampler(params, constraint=None)
        assert [a.sample(r) for r in rows] == [b.sample(r) for r in rows] and a.state() == b.state()
        assert a.plain_greedy == params.greedy


# ---- whole runs on the tiny model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from ds4f.engine.checkpoint.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("tiny-mtp") / "official", "tiny", seed=0, mtp=True)


def _run(model, **kw):
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    kw.setdefault("dump", "off")
    run = start_run(RunConfig(model=str(model), probe_floor=False, backend="scalar", reuse_prefix=False,
                              messages=({"role": "user", "content": "A person, as JSON."},), gen=120, **kw))
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=1.0, seed=4)])
def test_a_run_answers_in_the_schema_and_speculation_keeps_its_tokens(tiny_mtp, sampling):
    """A chat run's answer follows the schema; with drafts verified in rounds (spec 2) the tokens
    are the plain run's, greedy and sampled (each judged row picks under the constraint)."""
    fmt = ResponseFormat.json_schema(PERSON)
    from ds4f.runs.statedump import read_state

    plain = _run(tiny_mtp, sampling=sampling, response_format=fmt, dump="compact")
    assert plain.finish_reason == "eos"
    jsonschema.validate(json.loads(plain.output_text), PERSON)
    assert plain.report["text"]["response_format"] == fmt.to_dict()
    assert read_state(plain.dump_path).header["response_format"] == fmt.to_dict()   # it decided the tokens
    spec = _run(tiny_mtp, sampling=sampling, response_format=fmt, spec=2)
    assert spec.generated_ids == plain.generated_ids and spec.report["summary"]["spec"]["rounds"] > 0


def test_a_run_refuses_a_format_it_cannot_honour(tiny_mtp):
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    fmt = ResponseFormat.json_object()
    for kw, words in (({"prompt": (0, 5)}, "text or chat prompt"),
                      ({"text": "Hi", "stop_at_eos": False}, "end-of-sentence"),
                      ({"messages": ({"role": "user", "content": "Hi"},), "tools": (
                          {"name": "f", "description": "", "parameters": {"type": "object"}},)}, "tool")):
        with pytest.raises(Ds4fError) as exc:
            start_run(RunConfig(model=str(tiny_mtp), probe_floor=False, dump="off", response_format=fmt, **kw))
        assert exc.value.param == "response_format" and words in exc.value.message
