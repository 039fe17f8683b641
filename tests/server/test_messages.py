"""Anthropic's Messages API on `ds4f serve` (POST /v1/messages, /v1/messages/count_tokens), driven by
Anthropic's own Python client, `anthropic`, and by raw HTTP where the bytes matter.

Most tests run on the tiny random-weight checkpoint, whose text is noise: they check the shapes,
the event order, that streamed and whole answers agree, and the figures against the run's own
(GET /runs/<run id>) and the tokenizer's. The tool loop runs on tests/fixtures/toolcall, a tiny
model trained (tools/make_tool_model.py) to answer the conversations of its script.json exactly:
its calls, and its answer to the tools' results.
"""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from ds4f.api import Tokenizer, chat_prompt_ids
from ds4f.server.anthropic import signature

from server_helpers import HELLO, Srv, idle, serve_config, srv, start  # noqa: F401 (fixtures)

TOKEN = "k3Y-for-the-ds4f-tests_0123456789"
BUSY_GEN = 4000
GREEDY = {"temperature": 0}     # the client has no sampling arguments any more: sent as extra body fields
TOOL_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "toolcall"
SCRIPT = json.loads((TOOL_MODEL / "script.json").read_text(encoding="utf-8"))
WEATHER = [{"name": "get_weather", "description": "Current weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def client(srv: Srv, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "none")
    return anthropic.Anthropic(base_url=srv.url, max_retries=0, timeout=60, **kw)


def run_of(message_id: str) -> str:
    assert message_id.startswith("msg_"), message_id
    return message_id.removeprefix("msg_")


def post(srv: Srv, body: dict, path: str = "/v1/messages", headers=None):
    return srv.request("POST", path, body=body, headers=headers)


def anthropic_error(r) -> dict:
    """Anthropic's error shape, checked: {"type": "error", "error": {"type", "message"}}."""
    body = r.json()
    assert body["type"] == "error" and {"type", "message"} <= set(body["error"]), body
    return body["error"]


def raw_events(srv: Srv, body: dict, timeout: float = 60.0):
    """The SSE answer of a streaming request as (event, data) pairs, read with httpx."""
    out = []
    with httpx.stream("POST", f"{srv.url}/v1/messages", json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == event, (event, data)
                out.append((event, data))
    return out


def check_event_order(events: list) -> list[dict]:
    """Anthropic's order: message_start, then each block's start, deltas and stop (indexed from 0,
    one open at a time), message_delta, message_stop; -> the blocks as the deltas build them."""
    kinds = [e for e, _ in events if e != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks, open_index = [], None
    for kind, data in events[1:-2]:
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert open_index is None and data["index"] == len(blocks), data
            open_index = data["index"]
            blocks.append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            assert data["index"] == open_index, data
            block, delta = blocks[open_index], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                block["json"] = block.get("json", "") + delta["partial_json"]
        else:
            assert kind == "content_block_stop" and data["index"] == open_index, (kind, data)
            open_index = None
    assert open_index is None
    for block in blocks:
        if block["type"] == "tool_use":
            assert block["input"] == {}
            block["input"] = json.loads(block.pop("json"))
    return blocks


def dumped(blocks) -> list[dict]:
    return [b.model_dump(exclude_none=True) if hasattr(b, "model_dump") else b for b in blocks]


# -- answers ---------------------------------------------------------------------------------------
def test_a_plain_answer_whole_streamed_and_as_raw_events(srv, tiny_model):
    c = client(srv)
    model = srv.service.model_id
    msg = c.messages.create(model=model, max_tokens=6, messages=HELLO, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model
    assert all(b.type == "text" for b in msg.content) and len(msg.content) <= 1
    text = msg.content[0].text if msg.content else ""
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    if msg.stop_reason == "max_tokens":
        assert msg.usage.output_tokens == 6
    view = srv.wait_state(run_of(msg.id))             # the message is a run like any other
    assert view["state"] == "done" and view["config"]["messages"] == HELLO
    assert msg.usage.output_tokens == view["generated_tokens"]
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == view["prompt_tokens"]
    assert msg.usage.cache_read_input_tokens == view["live"]["prompt_tokens_reused"]
    assert msg.usage.cache_creation_input_tokens == 0
    assert view["prompt_tokens"] == len(chat_prompt_ids(Tokenizer.load(tiny_model), HELLO))   # counted apart
    assert view["live"]["output_text"] == text

    with c.messages.stream(model=model, max_tokens=6, messages=HELLO, extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and dumped(final.content) == dumped(msg.content)
    assert (final.stop_reason, final.stop_sequence) == (msg.stop_reason, None)
    assert final.id != msg.id and final.usage.output_tokens == msg.usage.output_tokens
    view = srv.wait_state(run_of(final.id))
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == view["prompt_tokens"]
    assert final.usage.cache_read_input_tokens == view["live"]["prompt_tokens_reused"]

    events = list(c.messages.create(model=model, max_tokens=6, messages=HELLO, extra_body=GREEDY, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    start_message = events[0].message
    assert start_message.content == [] and start_message.stop_reason is None and start_message.model == model
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    if text:
        assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) + \
            ["content_block_stop"]
        assert events[1].content_block.type == "text" and events[1].index == 0
    assert events[-2].delta.stop_reason == msg.stop_reason
    assert events[-2].usage.output_tokens == msg.usage.output_tokens


def test_the_raw_stream_is_anthropics_sse(srv):
    events = raw_events(srv, {"model": srv.service.model_id, "max_tokens": 5, "messages": HELLO, "temperature": 0})
    assert [e for e, _ in events[:2]] == ["message_start", "ping"]
    start = events[0][1]["message"]
    assert start["type"] == "message" and start["role"] == "assistant" and start["content"] == []
    assert set(start["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                   "cache_creation_input_tokens"} and start["usage"]["output_tokens"] == 0
    blocks = check_event_order(events)
    delta = events[-2][1]
    view = srv.wait_state(run_of(start["id"]))
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["delta"]["stop_sequence"] is None
    assert delta["usage"] == {"input_tokens": view["prompt_tokens"] - view["live"]["prompt_tokens_reused"],
                              "output_tokens": view["generated_tokens"],
                              "cache_read_input_tokens": view["live"]["prompt_tokens_reused"],
                              "cache_creation_input_tokens": 0}
    text = view["live"]["output_text"]
    assert blocks == ([{"type": "text", "text": text}] if text else [])


def test_thinking_mode_gives_a_thinking_block(srv):
    c = client(srv)
    model = srv.service.model_id
    msg = c.messages.create(model=model, max_tokens=8, messages=HELLO, extra_body=GREEDY,
                            thinking={"type": "enabled", "budget_tokens": 1024})
    view = srv.wait_state(run_of(msg.id))
    assert view["config"]["thinking"] is True
    output = view["live"]["output_text"]
    # the noise may never write </think>: then all of it is the reasoning
    reasoning, marker, content = output.partition("</think>")
    if not marker:
        reasoning, content = output, ""
    want = ([{"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)}] if reasoning else []) + \
        ([{"type": "text", "text": content}] if content else [])
    assert dumped(msg.content) == want
    events = raw_events(srv, {"model": model, "max_tokens": 8, "messages": HELLO, "temperature": 0,
                              "thinking": {"type": "adaptive"}})
    assert check_event_order(events) == want
    with c.messages.stream(model=model, max_tokens=8, messages=HELLO, extra_body=GREEDY,
                           thinking={"type": "enabled", "budget_tokens": 2048}) as s:
        assert dumped(s.get_final_message().content) == want
    off = c.messages.create(model=model, max_tokens=8, messages=HELLO, extra_body=GREEDY, thinking={"type": "disabled"})
    assert srv.wait_state(run_of(off.id))["config"]["thinking"] is False
    assert all(b.type == "text" for b in off.content)


def test_a_stop_sequence_ends_the_answer_and_is_named(srv):
    c = client(srv)
    model = srv.service.model_id
    first = c.messages.create(model=model, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    text = first.content[0].text if first.content else ""
    candidates = [text[i:i + 2] for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2]
                  and text[i:i + 2].strip()]
    if not candidates:
        pytest.skip(f"the tiny model's greedy output has no usable stop string: {text!r}")
    stop = candidates[len(candidates) // 2]
    cut = text.find(stop)
    stops = ["never-in-the-output", stop]
    msg = c.messages.create(model=model, max_tokens=12, messages=HELLO, extra_body=GREEDY, stop_sequences=stops)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in msg.content) == text[:cut] and msg.usage.output_tokens < 12
    with c.messages.stream(model=model, max_tokens=12, messages=HELLO, extra_body=GREEDY, stop_sequences=stops) as s:
        assert "".join(s.text_stream) == text[:cut]
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_usage_counts_the_prefix_cache_and_count_tokens_the_prompt(srv, tiny_model):
    c = client(srv)
    model = srv.service.model_id
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    first = c.messages.create(model=model, max_tokens=6, system=system, messages=HELLO, extra_body=GREEDY)
    view = srv.wait_state(run_of(first.id))
    counted = c.messages.count_tokens(model=model, system=system, messages=HELLO)
    assert counted.input_tokens == view["prompt_tokens"] == first.usage.input_tokens + \
        first.usage.cache_read_input_tokens
    tok = Tokenizer.load(tiny_model)
    internal = [{"role": "system", "content": "You are terse."}, *HELLO]
    assert counted.input_tokens == len(chat_prompt_ids(tok, internal))
    srv.wait_idle()

    # the next turn: the answer sent back as text, the prefix cache gives the conversation so far
    answer = first.content[0].text if first.content else ""
    turn = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": "And then?",
                                          "cache_control": {"type": "ephemeral"}}]}]
    second = c.messages.create(model=model, max_tokens=6, system=system, messages=turn, extra_body=GREEDY)
    view = srv.wait_state(run_of(second.id))
    assert second.usage.cache_read_input_tokens == view["live"]["prompt_tokens_reused"] > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == view["prompt_tokens"]
    assert second.usage.output_tokens == view["generated_tokens"]

    # tools, thinking and a forced call change the prompt; count_tokens follows
    for extra in ({"tools": WEATHER}, {"tools": WEATHER, "tool_choice": {"type": "any"}},
                  {"thinking": {"type": "enabled", "budget_tokens": 1024}, "tools": WEATHER},
                  {"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}}):
        srv.wait_idle()
        n = c.messages.count_tokens(model=model, messages=HELLO, **extra).input_tokens
        msg = c.messages.create(model=model, max_tokens=2, messages=HELLO, extra_body=GREEDY, **extra)
        assert n == srv.wait_state(run_of(msg.id))["prompt_tokens"], extra
    assert srv.service.runs_started == 6


def test_tools_become_function_schemas_in_the_prompt(srv, tiny_model):
    c = client(srv)
    model = srv.service.model_id
    tools = [{"type": "custom", "name": "get_weather", "description": "Current weather in a city",
              "input_schema": WEATHER[0]["input_schema"], "cache_control": {"type": "ephemeral"}},
             {"name": "now", "input_schema": {"type": "object", "properties": {}}}]
    msg = c.messages.create(model=model, max_tokens=2, messages=HELLO, tools=tools, extra_body=GREEDY,
                            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                            metadata={"user_id": "someone"}, service_tier="auto")
    view = srv.wait_state(run_of(msg.id))
    schemas = view["config"]["tools"]
    assert schemas == [{"name": "get_weather", "description": "Current weather in a city",
                        "parameters": WEATHER[0]["input_schema"]},
                       {"name": "now", "parameters": {"type": "object", "properties": {}}}]
    assert list(schemas[0]) == ["name", "description", "parameters"]        # the order the prompt shows
    assert view["config"]["tool_choice"] == "auto"
    internal = [{"name": "get_weather", "description": "Current weather in a city",
                 "parameters": WEATHER[0]["input_schema"]}, {"name": "now", "parameters": {"type": "object",
                                                                                          "properties": {}}}]
    assert view["prompt_tokens"] == len(chat_prompt_ids(Tokenizer.load(tiny_model), HELLO, tools=internal))
    srv.wait_idle()
    # an earlier turn's calls and results: the engine's tool messages
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "I look it up.", "signature": "x"},
                                              {"type": "redacted_thinking", "data": "abc"},
                                              {"type": "text", "text": "Let me see."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "sunny"}], "is_error": False},
                                         {"type": "text", "text": "Thanks."}]}]
    msg = c.messages.create(model=model, max_tokens=2, messages=turn, tools=tools, extra_body=GREEDY,
                            thinking={"type": "enabled", "budget_tokens": 1024})
    config = srv.wait_state(run_of(msg.id))["config"]
    assert config["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me see.", "reasoning": "I look it up.",
         "tool_calls": [{"id": "toolu_1", "name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "Thanks."}]


# -- refusals -------------------------------------------------------------------------------------
M = "HELLO"     # stands for the default messages
TOOL_TURN = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]}]
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}
BAD = [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"),
    ({"messages": None}, "messages"), ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"bogus": 1}, "bogus"), ({"seed": 3}, "seed"), ({"temperature": 1.5}, "temperature"), ({"top_p": 2}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences"), ({"stream": "yes"}, "stream"),
    ({"service_tier": "priority"}, "service_tier"), ({"metadata": "x"}, "metadata"),
    ({"system": 5}, "system"), ({"system": [{"type": "image", "source": {}}]}, "system[0]"),
    ({"thinking": "yes"}, "thinking"), ({"thinking": {"type": "on"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": "x"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget": 1}}, "thinking.budget"),
    ({"output_config": {"effort": "huge"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),     # no user's message to answer
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "name": "me"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                {"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": TOOL_TURN + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}], "tools": WEATHER},
     "messages[2].content[0].tool_use_id"),
    ({"messages": TOOL_TURN + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image"}]}]}], "tools": WEATHER},
     "messages[2].content[0].content[0]"),
    ({"messages": TOOL_TURN + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x", "is_error": "no"}]}], "tools": WEATHER},
     "messages[2].content[0].is_error"),
    ({"messages": TOOL_TURN, "tools": WEATHER}, "messages[1]"),                 # ends with a tool_use, no result
    ({"messages": TOOL_TURN + [{"role": "user", "content": "never mind"}], "tools": WEATHER}, "messages[2].content"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "Sure"}]}, "messages[1]"),    # a prefill
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": "Paris"}]}, RESULT], "tools": WEATHER},
     "messages[1].content[0].input"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "name": "get_weather", "input": {}}]}, RESULT], "tools": WEATHER},
     "messages[1].content[0].id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1"}]}, RESULT]}, "messages[1].content[0].type"),
    ({"tool_choice": {"type": "tool", "name": "get_time"}, "tools": WEATHER}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function"}, "tools": WEATHER}, "tool_choice.type"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}}, "tool_choice.disable_parallel_tool_use"),
    ({"tools": {"name": "x"}}, "tools"), ({"tools": ["x"]}, "tools[0]"),
    ({"tools": [{"name": "get_weather"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "get weather", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "x", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "x", "input_schema": {"type": "object", "properties": {"a": {"type": "text"}}}}]},
     "tools[0].input_schema.properties.a.type"),
    ({"tools": [*WEATHER, *WEATHER]}, "tools[1].name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}, "tools[0].type"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER[0], "input_examples": []}]}, "tools[0].input_examples"),
]


@pytest.mark.parametrize("params, name", BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD)])
def test_bad_requests_are_anthropic_shaped_400s_naming_the_parameter(idle, params, name):
    body = {"model": idle.service.model_id, "max_tokens": 8, "messages": HELLO, **params}
    body = {k: v for k, v in body.items() if v is not None}
    r = post(idle, body)
    assert r.status == 400, (params, r.body)
    err = anthropic_error(r)
    assert err["type"] == "invalid_request_error", err
    assert err["message"].startswith(f"{name}:"), (name, err["message"])


def test_refusals_through_the_client(idle):
    c = client(idle)
    model = idle.service.model_id
    with pytest.raises(anthropic.BadRequestError) as info:
        c.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert info.value.status_code == 400
    assert info.value.body["error"]["message"].startswith("messages[0].content[0]: image blocks are not supported")
    with pytest.raises(anthropic.NotFoundError) as info:            # the model is the served one
        c.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=HELLO)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    assert info.value.body["error"]["message"].startswith("model:")
    with pytest.raises(anthropic.BadRequestError) as info:
        c.messages.count_tokens(model=model, messages=[{"role": "user", "content": "x"},
                                                       {"role": "assistant", "content": "y"}])
    assert info.value.body["error"]["message"].startswith("messages[1]:")
    r = post(idle, {"model": model, "messages": HELLO, "max_tokens": 8}, path="/v1/messages/count_tokens")
    assert r.status == 400 and anthropic_error(r)["message"].startswith("max_tokens:")   # not a count's parameter
    r = idle.request("POST", "/v1/messages", raw=b"max_tokens=8", headers={"Content-Type": "text/plain"})
    assert r.status == 415 and anthropic_error(r)["type"] == "invalid_request_error"
    r = idle.request("POST", "/v1/messages", raw=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status == 400 and anthropic_error(r)["message"].startswith("body:")


def test_count_tokens_takes_anthropics_decorations(idle, tiny_model):
    """cache_control anywhere, tool type custom, string or block content: the same prompt."""
    c = client(idle)
    model = idle.service.model_id
    cc = {"type": "ephemeral"}
    plain = c.messages.count_tokens(model=model, system="Be brief.", messages=HELLO, tools=WEATHER).input_tokens
    decorated = c.messages.count_tokens(
        model=model, system=[{"type": "text", "text": "Be brief.", "cache_control": cc}],
        messages=[{"role": "user", "content": [{"type": "text", "text": HELLO[0]["content"], "cache_control": cc}]}],
        tools=[{**WEATHER[0], "type": "custom", "cache_control": cc}],
        extra_body={"cache_control": cc}).input_tokens
    assert plain == decorated
    internal = [{"name": "get_weather", "description": "Current weather in a city",
                 "parameters": WEATHER[0]["input_schema"]}]
    assert plain == len(chat_prompt_ids(Tokenizer.load(tiny_model), [{"role": "system", "content": "Be brief."},
                                                                      *HELLO], tools=internal))
    r = post(idle, {"messages": HELLO}, path="/v1/messages/count_tokens")       # model is left to the server
    assert r.status == 200 and r.json() == {"input_tokens": len(chat_prompt_ids(Tokenizer.load(tiny_model), HELLO))}


# -- auth, the queue, errors mid-stream -----------------------------------------------------------
def test_the_token_is_taken_as_x_api_key(start):
    srv = start(token=TOKEN)
    model = srv.service.model_id
    for headers in ({}, {"x-api-key": TOKEN + "x"}, {"x-api-key": ""}, {"Authorization": f"Bearer {TOKEN}x"}):
        r = post(srv, {"model": model, "max_tokens": 2, "messages": HELLO}, headers=headers)
        assert r.status == 401, (headers, r.body)
        body = r.json()      # the guard's refusal, in Anthropic's shape on this path
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
        assert "x-api-key" in body["error"]["message"] and r.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(anthropic.AuthenticationError):
        client(srv, api_key="wrong-key-0123456789").messages.count_tokens(model=model, messages=HELLO)
    assert srv.service.runs_started == 0
    msg = client(srv, api_key=TOKEN).messages.create(model=model, max_tokens=2, messages=HELLO)
    assert srv.wait_state(run_of(msg.id), headers={"x-api-key": TOKEN})["state"] == "done"
    n = client(srv, api_key=None, auth_token=TOKEN).messages.count_tokens(model=model, messages=HELLO)
    assert n.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens       # Bearer still works


def test_a_queued_stream_gets_pings_then_its_answer(srv):
    busy = srv.post_run(gen=BUSY_GEN).json()["id"]
    srv.wait_tokens(busy, 2)
    body = {"model": srv.service.model_id, "max_tokens": 3, "messages": HELLO, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/messages", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert r.status_code == 200
        assert next(lines) == "event: ping" and json.loads(next(lines).removeprefix("data: ")) == {"type": "ping"}
        queue = srv.get("/status").json()["queue"]
        assert queue["waiting"] == 1 and queue["queued"][0]["kind"] == "message"
        assert srv.request("DELETE", f"/runs/{busy}").status in (200, 202)
        rest = list(lines)
    events = [line.removeprefix("event: ") for line in rest if line.startswith("event: ")]
    events = [e for e in events if e != "ping"]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert srv.get(f"/runs/{busy}").json()["state"] == "cancelled"


def test_an_error_after_the_stream_started_is_an_error_event(srv):
    body = {"model": srv.service.model_id, "max_tokens": BUSY_GEN, "messages": HELLO, "stream": True}
    seen = []
    with httpx.stream("POST", f"{srv.url}/v1/messages", json=body, timeout=60) as r:
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                seen.append((event, data))
                if event == "message_start":
                    run_id = run_of(data["message"]["id"])
                    srv.wait_tokens(run_id, 4)
                    assert srv.request("DELETE", f"/runs/{run_id}").status in (200, 202)   # an operator cancels it
    kind, data = seen[-1]
    assert kind == "error" and data["type"] == "error", seen[-3:]
    assert data["error"]["type"] == "overloaded_error" and "cancelled" in data["error"]["message"]
    assert "message_stop" not in [e for e, _ in seen]


# -- the tool loop, with a model that calls tools ----------------------------------------------
needs_tool_model = pytest.mark.skipif(
    not (TOOL_MODEL / "model.safetensors").is_file(),
    reason="tests/fixtures/toolcall/model.safetensors is not built yet (tools/make_tool_model.py)")
CASES = {case["name"]: case for case in SCRIPT["cases"]}
TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
         for t in SCRIPT["tools"]]
LOOP_CASES = ["weather_Paris", "forecast_Paris_3", "pair_Paris_Rome", "think_weather_Paris", "think_pair_Paris_Rome"]


@pytest.fixture()
def start_tool(start):
    """A server on the tool-calling model."""
    return lambda **overrides: start(model=str(TOOL_MODEL), **overrides)


def _ask(c, srv, case: dict, messages: list, stream: bool, **extra):
    kw = dict(model=srv.service.model_id, max_tokens=200, system=SCRIPT["system"], tools=TOOLS, messages=messages,
              extra_body=GREEDY, **extra)
    if case["thinking"]:
        kw["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    if not stream:
        return c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        return s.get_final_message()


def _check_answer(msg, want: dict, thinking: bool) -> None:
    blocks = dumped(msg.content)
    thought = [b for b in blocks if b["type"] == "thinking"]
    assert [b["thinking"] for b in thought] == ([want["reasoning"]] if thinking and want["reasoning"] else [])
    assert all(b["signature"] == signature(b["thinking"]) for b in thought)      # never "": clients drop those
    assert "".join(b["text"] for b in blocks if b["type"] == "text") == want["content"]
    assert [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"] == \
        [(c["name"], c["arguments"]) for c in want["tool_calls"]]
    order = ["thinking", "text", "tool_use"]          # thinking first, calls last
    assert [b["type"] for b in blocks] == sorted((b["type"] for b in blocks), key=order.index)


def _script_turn(case: dict) -> list[dict]:
    """The script's second turn, as the engine's messages (tools/make_tool_model.py trains on these)."""
    calls = [{"id": f"call_{i + 1}", **c} for i, c in enumerate(case["reply"]["tool_calls"])]
    return [{"role": "assistant", "content": case["reply"]["content"], "reasoning": case["reply"]["reasoning"],
             "tool_calls": calls}] + [{"role": "tool", "tool_call_id": c["id"], "content": r}
                                      for c, r in zip(calls, case["results"], strict=True)]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["reply"]["tool_calls"]])
def test_the_tool_loop_sends_the_prompts_the_tool_model_learned(name):
    """What the endpoint makes of the Anthropic-shaped conversation is, as the prompt reads it, the
    script's conversation the tool model was trained on (call ids are not in the prompt)."""
    from ds4f.api import render_chat
    from ds4f.server.anthropic import parse_chat

    case = CASES[name]
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if case["thinking"] else {}
    assistant = ([{"type": "thinking", "thinking": case["reply"]["reasoning"], "signature": ""}]
                 if case["thinking"] else []) + \
        [{"type": "tool_use", "id": f"toolu_{i:024x}", "name": c["name"], "input": c["arguments"]}
         for i, c in enumerate(case["reply"]["tool_calls"])]
    results = [{"type": "tool_result", "tool_use_id": f"toolu_{i:024x}", "content": r}
               for i, r in enumerate(case["results"])]
    head = [{"role": "system", "content": SCRIPT["system"]}] + case["messages"]
    for messages, want in ((case["messages"], head),
                           (case["messages"] + [{"role": "assistant", "content": assistant},
                                                {"role": "user", "content": results}], head + _script_turn(case))):
        fields = parse_chat({"system": SCRIPT["system"], "tools": TOOLS, "messages": messages, **thinking})[0]
        assert fields["tools"] == tuple(SCRIPT["tools"]) and fields["thinking"] is case["thinking"]
        assert render_chat(list(fields["messages"]), thinking=case["thinking"], tools=fields["tools"]) == \
            render_chat(want, thinking=case["thinking"], tools=SCRIPT["tools"])


@pytest.mark.parametrize("name", ["weather_Paris", "think_pair_Paris_Rome", "think_hello"])
@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_blocks_are_the_whole_answers(name, parallel):
    """The tool model's answers as text, fed to the stream's block writer a few characters at a
    time: its events build the blocks the whole answer has (with no model: the text is the script's)."""
    from ds4f.engine.text.dsml import pieces_text, render_calls
    from ds4f.server.anthropic import _Blocks, blocks_of
    from ds4f.server.generation import Ask

    case = CASES[name]
    reply = case["reply"]
    text = (reply["reasoning"] + "</think>" if case["thinking"] else "") + reply["content"] + \
        pieces_text(render_calls(reply["tool_calls"]))
    ask = Ask("chat", {}, 200, "max_tokens", None, True, thinking=case["thinking"], tools=tuple(SCRIPT["tools"]),
              parallel_calls=parallel, endpoint="messages")
    parser, blocks = ask.parser(), _Blocks(ask)
    out = b"".join(b"".join(blocks.feed(parser.push(text[i:i + 3]))) for i in range(0, len(text), 3))
    out += b"".join(blocks.feed(parser.finish())) + b"".join(blocks.close())
    events = []
    for chunk in out.decode().split("\n\n")[:-1]:
        head, data = chunk.split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    calls = parser.result.calls[:1] if not parallel else parser.result.calls
    parser.result.calls = calls
    whole = blocks_of(ask, parser.result)
    streamed = check_event_order([("message_start", {})] + events + [("message_delta", {}), ("message_stop", {})])
    assert [{k: v for k, v in b.items() if k != "id"} for b in streamed] == \
        [{k: v for k, v in b.items() if k != "id"} for b in whole]
    assert [b["id"] for b in streamed if b["type"] == "tool_use"] == [b["id"] for b in whole if b["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in whole if b["type"] == "tool_use"] == \
        [(c["name"], c["arguments"]) for c in reply["tool_calls"]][:None if parallel else 1]
    assert "".join(b.get("text", "") for b in whole) == reply["content"]


@needs_tool_model
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", LOOP_CASES)
def test_messages_tool_loop(start_tool, name, stream):
    srv = start_tool()
    c = client(srv)
    case = CASES[name]
    first = _ask(c, srv, case, case["messages"], stream)
    _check_answer(first, case["reply"], case["thinking"])
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    uses = [b for b in first.content if b.type == "tool_use"]
    assert all(u.id.startswith("toolu_") for u in uses) and len({u.id for u in uses}) == len(uses)
    assert not hasattr(first, "tool_call_error") or first.tool_call_error is None
    view = srv.wait_state(run_of(first.id))
    assert first.usage.output_tokens == view["generated_tokens"] and view["finish_reason"] == "eos"

    # the assistant's turn back as it came (thinking block, tool_use blocks), then the tools' results
    turn = [{"role": "assistant", "content": dumped(first.content)},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": result}
                                         for u, result in zip(uses, case["results"], strict=True)]}]
    srv.wait_idle()
    final = _ask(c, srv, case, case["messages"] + turn, stream)
    _check_answer(final, case["final"], case["thinking"])
    assert final.stop_reason == "end_turn"
    assert final.content[-1].type == "text" and final.content[-1].text == case["final"]["content"]
    view = srv.wait_state(run_of(final.id))
    assert final.usage.cache_read_input_tokens == view["live"]["prompt_tokens_reused"] > 0   # the first turn's state
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == view["prompt_tokens"]
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if case["thinking"] else {}
    n = c.messages.count_tokens(model=srv.service.model_id, system=SCRIPT["system"], tools=TOOLS,
                                messages=case["messages"] + turn, **thinking)
    assert n.input_tokens == view["prompt_tokens"]


@needs_tool_model
def test_messages_tool_loop_raw_events_and_single_calls(start_tool):
    srv = start_tool()
    case = CASES["think_pair_Paris_Rome"]
    body = {"model": srv.service.model_id, "max_tokens": 200, "system": SCRIPT["system"], "tools": TOOLS,
            "messages": case["messages"], "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    events = raw_events(srv, body)
    blocks = check_event_order(events)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use", "tool_use"]
    assert blocks[0]["thinking"] == case["reply"]["reasoning"]
    assert [(b["name"], b["input"]) for b in blocks[1:]] == [(c["name"], c["arguments"])
                                                            for c in case["reply"]["tool_calls"]]
    starts = [d for e, d in events if e == "content_block_start" and d["content_block"]["type"] == "tool_use"]
    assert all(d["content_block"]["input"] == {} and d["content_block"]["id"].startswith("toolu_") for d in starts)
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}

    # disable_parallel_tool_use: the first call only, whole and streamed
    one = {**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    srv.wait_idle()
    r = post(srv, one)
    assert r.status == 200, r.body
    whole = r.json()
    assert [b["type"] for b in whole["content"]] == ["thinking", "tool_use"]
    assert whole["content"][1]["input"] == case["reply"]["tool_calls"][0]["arguments"]
    assert whole["stop_reason"] == "tool_use"
    srv.wait_idle()
    streamed = check_event_order(raw_events(srv, one))
    assert [(b["type"], b.get("input")) for b in streamed] == [(b["type"], b.get("input")) for b in whole["content"]]

    # no tool needed: a text answer
    srv.wait_idle()
    hello = CASES["hello"]
    msg = client(srv).messages.create(model=srv.service.model_id, max_tokens=100, system=SCRIPT["system"],
                                      tools=TOOLS, messages=hello["messages"], extra_body=GREEDY)
    assert dumped(msg.content) == [{"type": "text", "text": hello["reply"]["content"]}]
    assert msg.stop_reason == "end_turn"
