"""Requests built to break the server, sent for real to a `ds4f serve` on loopback: JSON nested
thousands of levels deep (a body, an earlier call's arguments), a lone surrogate (a JSON escape of
half a character) in every text field of every generating endpoint, parameters that ask for what
the server does not do (an answer in the background, logprobs); and `ds4f serve --spec K` with
what cannot go with it, checked at the start. Each is a clear 4xx in the API's error shape naming
the field, or an error at start naming both options, never a 500 or a traceback."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import openai
import pytest

from ds4f.api import Ds4fError
from ds4f.server.app import Server, ServerOptions

from server_helpers import Srv, idle, serve_config, srv, start  # noqa: F401 (fixtures)

DEEP = 5000
LIMIT = 100        # the levels of arrays and objects a body, or a call's arguments, may nest

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def nested(levels: int) -> str:
    """A JSON object whose value nests `levels` levels in all."""
    return '{"a": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}"


def chat_with_arguments(arguments: str) -> dict:
    return {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "get_weather", "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [TOOL], "max_tokens": 2, "temperature": 0}


def responses_with_arguments(arguments: str) -> dict:
    return {"input": [{"role": "user", "content": "hi"},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}],
            "max_output_tokens": 2, "temperature": 0}


def messages_with_input(value) -> dict:
    return {"max_tokens": 2, "temperature": 0, "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                            "input": value}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}


def post_raw(srv, path: str, raw: bytes):
    return srv.request("POST", path, raw=raw, headers={"Content-Type": "application/json"})


# -- depth --------------------------------------------------------------------------------------------
def test_arguments_nested_thousands_deep_are_a_400_naming_the_field(srv):
    r = srv.request("POST", "/v1/chat/completions", body=chat_with_arguments(nested(DEEP)))
    assert r.status == 400, r.body
    err = r.error()
    assert err["param"] == "messages" and err["message"].startswith("messages[1].tool_calls[0].arguments: "), err
    r = srv.request("POST", "/v1/responses", body=responses_with_arguments(nested(DEEP)))
    assert r.status == 400, r.body
    err = r.error()
    assert err["param"] == "input" and err["message"].startswith("input[1].arguments: "), err
    over = srv.request("POST", "/v1/chat/completions", body=chat_with_arguments(nested(LIMIT + 1)))
    assert over.status == 400 and f"more than the {LIMIT} levels" in over.error()["message"], over.body
    assert srv.service.runs_started == 0


def test_a_body_nested_thousands_deep_is_a_400_naming_the_body(srv):
    deep_input = ('{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": '
                  + "[" * DEEP + "]" * DEEP + "}").encode()
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/runs",
                 "/v1/completions"):
        r = post_raw(srv, path, deep_input)
        assert r.status == 400, (path, r.body)
        body = r.json()
        message = body["error"]["message"]
        assert message.startswith("body: ") and "nested" in message, (path, body)
    r = srv.request("POST", "/v1/messages", body=messages_with_input({"a": json.loads(nested(LIMIT))}))
    assert r.status == 400 and "more than the 100 levels" in r.json()["error"]["message"], r.body
    assert srv.service.runs_started == 0


def test_json_at_the_limit_is_answered(srv):
    """Nested as deep as taken, everywhere it may be: every reader after the parse copes with it."""
    r = srv.request("POST", "/v1/chat/completions", body=chat_with_arguments(nested(LIMIT)))
    assert r.status == 200, r.body
    r = srv.request("POST", "/v1/responses", body=responses_with_arguments(nested(LIMIT)))
    assert r.status == 200, r.body
    # brackets, escaped quotes and backslashes inside strings are text, not levels
    text = '\\"[{' * 300 + "\\" + "[" * 300 + '"'
    r = srv.request("POST", "/v1/chat/completions", body={"messages": [{"role": "user", "content": text}],
                                                          "max_tokens": 1, "stop": [text[:50]]})
    assert r.status == 200, r.body
    # the body's own levels (6 down to a tool_use's input) and the input's make the limit
    value = json.loads(nested(LIMIT - 5))
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = messages_with_input(value)
        if path.endswith("count_tokens"):
            body = {k: v for k, v in body.items() if k in ("messages", "tools")}
        r = srv.request("POST", path, body=body)
        assert r.status == 200, (path, r.body)


def test_a_call_the_model_writes_nested_thousands_deep_is_refused_as_a_call():
    from ds4f.engine.text.dsml import DSML as B
    from ds4f.engine.text.reply import parse_reply

    text = (f'\n\n<{B}tool_calls>\n<{B}invoke name="f">\n<{B}parameter name="x" string="false">'
            + "[" * DEEP + "]" * DEEP + f"</{B}parameter>\n</{B}invoke>\n</{B}tool_calls>")
    reply = parse_reply(text, False, None)
    assert reply.calls == [] and "parameter 'x'" in reply.error


# -- lone surrogates --------------------------------------------------------------------------------
CHAT = {"messages": [
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "ok", "reasoning_content": "think", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    "tools": [TOOL], "max_tokens": 1, "stop": ["zz"], "user": "u", "metadata": {"a": "b"}, "temperature": 0}
COMPLETION = {"prompt": "hello", "max_tokens": 1, "stop": ["zz"], "user": "u"}
RESPONSES = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                       {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
                       {"type": "function_call", "call_id": "c1", "name": "get_weather",
                        "arguments": '{"city": "Paris"}'},
                       {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
             "instructions": "be brief", "max_output_tokens": 1, "temperature": 0, "metadata": {"k": "v"},
             "tools": [{"type": "function", "name": "get_weather", "description": "Weather",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]}
MESSAGES = {"max_tokens": 1, "temperature": 0, "system": [{"type": "text", "text": "be brief"}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                                           {"type": "text", "text": "ok"},
                                                           {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                            "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                                      {"type": "text", "text": "and?"}]}],
            "tools": [{"name": "get_weather", "description": "Weather",
                       "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "stop_sequences": ["zz"], "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 9}}


def string_leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from string_leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from string_leaves(v, path + (i,))
    elif isinstance(obj, str):
        yield path


def with_surrogate(body: dict, path: tuple) -> bytes:
    """The body with half a character put into the string at `path`, as a JSON escape (\\ud800)."""
    out = copy.deepcopy(body)
    at = out
    for p in path[:-1]:
        at = at[p]
    at[path[-1]] = at[path[-1]][:1] + "\ud800" + at[path[-1]][1:]
    return json.dumps(out).encode()


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                        ("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES)],
                         ids=["chat", "completions", "responses", "messages"])
def test_a_lone_surrogate_in_any_text_field_is_never_a_500(srv, path, body):
    assert post_raw(srv, path, json.dumps(body).encode()).status == 200     # the request as it is: answered
    srv.wait_idle()
    for leaf in string_leaves(body):
        r = post_raw(srv, path, with_surrogate(body, leaf))
        assert r.status in (200, 400, 404), (leaf, r.status, r.body[:300])
        answer = r.json()                                 # JSON whatever the field
        if r.status != 200:
            assert answer["error"]["message"], (leaf, answer)
        srv.wait_idle()


def test_count_tokens_refuses_what_messages_refuses(srv):
    """/v1/messages/count_tokens answers each request as /v1/messages does: counted where that
    answers, the same 400 where that refuses, a lone surrogate in any field."""
    count = {k: v for k, v in MESSAGES.items() if k in ("system", "messages", "tools", "thinking", "metadata")}
    refused = 0
    for leaf in string_leaves(count):
        counted = post_raw(srv, "/v1/messages/count_tokens", with_surrogate(count, leaf))
        answered = post_raw(srv, "/v1/messages", with_surrogate(MESSAGES, leaf))
        srv.wait_idle()
        assert counted.status == answered.status, (leaf, counted.body[:200], answered.body[:200])
        if counted.status == 400:
            refused += 1
            assert counted.json()["error"]["message"] == answered.json()["error"]["message"], leaf
        else:
            assert counted.json()["input_tokens"] > 0
    assert refused >= 8


def test_an_echoed_field_with_a_lone_surrogate_comes_back_as_sent(srv):
    r = post_raw(srv, "/v1/responses", b'{"input": "hi", "max_output_tokens": 1, "metadata": {"k": "a\\ud800b"}}')
    assert r.status == 200, r.body
    assert r.json()["metadata"] == {"k": "a\ud800b"}


# -- what is not done ------------------------------------------------------------------------------
@pytest.mark.parametrize("path, base, param, value", [
    ("/v1/responses", {"input": "hi"}, "background", True),
    ("/v1/responses", {"input": "hi"}, "top_logprobs", 3),
    ("/v1/responses", {"input": "hi"}, "truncation", "middle"),
    ("/v1/responses", {"input": "hi"}, "include", ["message.output_text.logprobs"]),
    ("/v1/responses", {"input": "hi"}, "include", ["everything"]),
    ("/v1/responses", {"input": "hi"}, "include", "reasoning.encrypted_content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "n", 2),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "logprobs", True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "top_logprobs", 2),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "frequency_penalty", 0.5),
    ("/v1/completions", {"prompt": "hi"}, "echo", True),
    ("/v1/completions", {"prompt": "hi"}, "best_of", 3),
    ("/v1/completions", {"prompt": "hi"}, "response_format", {"type": "json_object"}),
])
def test_what_the_server_does_not_do_is_a_400_naming_it(idle, path, base, param, value):
    r = idle.request("POST", path, body={**base, param: value, "max_tokens" if "chat" in path or "completions" in path
                                         else "max_output_tokens": 2})
    assert r.status == 400, r.body
    err = r.error()
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err


def test_the_openai_sdk_is_told_background_is_not_done(idle):
    with pytest.raises(openai.BadRequestError) as exc:
        idle.openai().responses.create(model=idle.service.model_id, input="hi", background=True, max_output_tokens=2)
    assert exc.value.body["param"] == "background"


def test_what_changes_nothing_is_still_taken(srv):
    r = srv.request("POST", "/v1/responses", body={
        "input": "hi", "max_output_tokens": 1, "background": False, "truncation": "auto", "top_logprobs": 0,
        "store": True, "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
        "metadata": {"k": "v"}, "parallel_tool_calls": False})
    assert r.status == 200, r.body
    assert r.json()["store"] is False                 # the answer says nothing was stored
    r = srv.request("POST", "/v1/messages", body={"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                                                  "service_tier": "auto", "metadata": {"user_id": "u"}})
    assert r.status == 200, r.body
    r = srv.request("POST", "/v1/messages", body={"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                                                  "service_tier": "priority"})
    assert r.status == 400 and "service_tier" in r.json()["error"]["message"], r.body


# -- --spec with what cannot go with it ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from ds4f.engine.checkpoint.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("tiny-mtp") / "official", "tiny", seed=0, mtp=True)


def test_a_fixed_spec_with_parallel_is_refused_at_start_naming_both(tiny_mtp, serve_config, tmp_path):
    with pytest.raises(Ds4fError) as err:
        Server(ServerOptions(model=str(tiny_mtp), config_path=str(serve_config), port=0, parallel=2, spec="2"))
    assert "--spec 2" in err.value.message and "--parallel 2" in err.value.message
    config = tmp_path / "ds4f.toml"
    config.write_text(serve_config.read_text() + "\n[server]\nparallel = 3\n")
    with pytest.raises(Ds4fError) as err:
        Server(ServerOptions(model=str(tiny_mtp), config_path=str(config), port=0, spec="1"))
    assert "--spec 1" in err.value.message and "server.parallel 3" in err.value.message


def test_a_fixed_spec_without_an_mtp_layer_is_refused_at_start(tiny_model, serve_config):
    with pytest.raises(Ds4fError) as err:
        Server(ServerOptions(model=str(tiny_model), config_path=str(serve_config), port=0, spec="2"))
    assert err.value.message.startswith("--spec 2: ") and "MTP" in err.value.message


def test_a_fixed_spec_with_parallel_left_to_the_plan_serves_one_sequence_and_drafts(tiny_mtp, serve_config):
    srv = Srv(Server(ServerOptions(model=str(tiny_mtp), config_path=str(serve_config), port=0, access_log=False,
                                   spec="2")))
    try:
        assert srv.service.parallel == 1 and "--spec 2" in srv.service.parallel_why
        r = srv.post_run(gen=6, prompt=[3, 17, 42])
        assert r.status == 202, r.body
        assert srv.wait_state(r.json()["id"])["state"] == "done"
        assert srv.service.current_run.report["summary"]["spec"]["mode"] == "2"
        assert srv.chat(max_tokens=2, temperature=0).status == 200
    finally:
        srv.close()


def test_ds4f_serve_says_it_in_one_line(tiny_mtp, serve_config):
    proc = subprocess.run([sys.executable, "-m", "ds4f.cli", "serve", "--model", str(tiny_mtp), "--config",
                           str(serve_config), "--port", "0", "--spec", "2", "--parallel", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--spec 2" in lines[0] and "--parallel 2" in lines[0], proc.stderr
