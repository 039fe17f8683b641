"""Structured outputs through `ds4f serve` (server.structured, engine.text.constraint): response_format
on chat completions and text.format on the Responses API, with OpenAI's own client (its
`parse` helper included, which sends a pydantic model's strict schema). The tiny model's weights
are random, so whatever it writes is what the mask let through; each answer is checked by
`jsonschema`, an independent validator.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from ds4f.server.app import Server, ServerOptions

from server_helpers import Srv, idle  # noqa: F401 (fixtures)

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
          "required": ["name", "age", "color", "tags"], "additionalProperties": False}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Describe a person."}]
MAX_TOKENS = 300
SAMPLED = [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3)]     # (temperature, seed): greedy, then sampled


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    color: Literal["red", "green", "blue"]
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=3)


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory) -> Srv:
    root = tmp_path_factory.mktemp("structured")
    config = root / "ds4f.toml"
    config.write_text(f'[engine]\nkernel_threads = 1\nprobe_floor = false\n\n[history]\npath = "{root / "h.sqlite3"}"\n')
    srv = Srv(Server(ServerOptions(model=str(tiny_model), config_path=str(config), port=0, access_log=False,
                                   parallel=1)))
    yield srv
    srv.close()


def _chat(srv, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return srv.openai().chat.completions.create(model=srv.service.model_id, messages=ASK, **kw)


@pytest.mark.parametrize("temperature,seed", SAMPLED)
def test_json_schema_answers_parse_and_validate(served, temperature, seed):
    r = _chat(served, response_format=AS_SCHEMA, temperature=temperature, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content)
    jsonschema.validate(value, PERSON)
    assert list(value) == ["name", "age", "color", "tags"]
    report = served.get(f"/runs/{r.id.removeprefix('chatcmpl-')}/report").json()
    assert report["text"]["response_format"]["kind"] == "json_schema"


def test_the_stream_is_the_answer(served):
    whole = _chat(served, response_format=AS_SCHEMA, temperature=1.0, seed=5).choices[0].message.content
    chunks = list(_chat(served, response_format=AS_SCHEMA, temperature=1.0, seed=5, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), PERSON)


@pytest.mark.parametrize("temperature,seed", SAMPLED[:2])
def test_json_object_answers_are_json_objects(served, temperature, seed):
    r = _chat(served, response_format={"type": "json_object"}, temperature=temperature, seed=seed, max_tokens=600)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_openai_parse_helper_gets_its_pydantic_model(served):
    """client.chat.completions.parse sends the model's strict schema and reads the answer back into it."""
    r = served.openai().chat.completions.parse(model=served.service.model_id, messages=ASK, response_format=Person,
                                               max_tokens=MAX_TOKENS, temperature=1.0, seed=2)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.color in ("red", "green", "blue") and 0 <= person.age <= 150


def test_thinking_mode_reasons_then_answers_in_the_schema(served):
    """The reasoning is free, the answer after </think> follows the schema."""
    for seed in (1, 2, 3, 4):
        r = _chat(served, response_format=AS_SCHEMA, temperature=1.0, seed=seed, max_tokens=400,
                  extra_body={"thinking": True})
        if r.choices[0].finish_reason == "stop":
            break
    else:
        pytest.fail("no thinking-mode answer ended within the token limit")
    message = r.choices[0].message
    assert message.model_extra.get("reasoning_content")
    jsonschema.validate(json.loads(message.content), PERSON)


def test_responses_text_format_json_schema(served):
    client = served.openai()
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=served.service.model_id, input=ASK, max_output_tokens=MAX_TOKENS,
                                temperature=1.0, text={"format": fmt})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    parsed = client.responses.parse(model=served.service.model_id, input=ASK, max_output_tokens=MAX_TOKENS,
                                    temperature=0, text_format=Person)
    assert isinstance(parsed.output_parsed, Person)


def test_anthropic_output_config_format(served):
    """Anthropic's structured outputs (output_config.format) through the anthropic SDK's own client."""
    import anthropic

    client = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=60)
    msg = client.messages.create(model=served.service.model_id, max_tokens=MAX_TOKENS, system=ASK[0]["content"],
                                 messages=ASK[1:], extra_body={"temperature": 0, "output_config": {
                                     "format": {"type": "json_schema", "schema": PERSON}}})
    assert msg.stop_reason == "end_turn", msg
    jsonschema.validate(json.loads(msg.content[0].text), PERSON)
    report = served.get(f"/runs/{msg.id.removeprefix('msg_')}/report").json()
    assert report["text"]["response_format"]["kind"] == "json_schema"


def test_without_a_format_the_answer_is_unchanged(served):
    """response_format text (or none) is the free answer: the same tokens, greedy and sampled."""
    for temperature in (0.0, 1.0):
        free = _chat(served, temperature=temperature, seed=7, max_tokens=24)
        text = _chat(served, temperature=temperature, seed=7, max_tokens=24, response_format={"type": "text"})
        assert free.choices[0].message.content == text.choices[0].message.content
        ids = [served.get(f"/runs/{r.id.removeprefix('chatcmpl-')}/report").json()["generated"] for r in (free, text)]
        assert ids[0] == ids[1]


UNCOMPILABLE = {"type": "array", "uniqueItems": True}
BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNCOMPILABLE}}},
     "response_format", "uniqueItems"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}}, "response_format", "no-such-format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/Missing"}}}}, "response_format", "Missing"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON Schema object"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"},
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "response_format", "tool"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": UNCOMPILABLE}}},
     "text.format", "uniqueItems"),
    ("/v1/responses", {"text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "required"),
]


@pytest.mark.parametrize("path,body,param,words", BAD, ids=[f"{p}-{i}" for i, (_, _, p, _) in enumerate(BAD)])
def test_formats_that_cannot_be_honoured_are_a_400_naming_them(idle, path, body, param, words):
    body = dict(body, **({"messages": ASK} if path.endswith("completions") else {"input": "Hi"}))
    r = idle.request("POST", path, body=body)
    assert r.status == 400, r.body
    err = r.error()
    assert err["param"] == param and err["message"].startswith(param) and words in err["message"], err
    assert idle.service.runs_started == 0
