"""Agent clients' tool loops through `ds4f serve`, with the vendor's own client (`openai`) on a
model that really calls tools: tests/fixtures/toolcall, a tiny DeepSeek-V4 trained (by
tools/make_tool_model.py) on the conversations of its script.json, in the official format and
dtypes. The expected calls, arguments and answers are the script's: what the model was taught,
independent of the server's code. Each loop: a request with the tools, a tool_calls answer, the
tools' results sent back, the final answer; streaming and not; the chat completions endpoint and
the Responses API (the Messages API's loop is in test_messages.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4f.server.app import Server, ServerOptions

from server_helpers import Srv, idle, serve_config, srv, start  # noqa: F401 (fixtures)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "toolcall"
SCRIPT = json.loads((FIXTURE / "script.json").read_text(encoding="utf-8"))
TOOLS = [{"type": "function", "function": t} for t in SCRIPT["tools"]]
CASES = {c["name"]: c for c in SCRIPT["cases"]}
LOOPS = ["weather_Paris", "forecast_Paris_2", "pair_Paris_Rome", "think_weather_Paris", "think_forecast_Paris_3",
         "think_pair_Paris_Rome"]


@pytest.fixture(scope="module")
def tool_srv(tmp_path_factory):
    if not (FIXTURE / "model.safetensors").is_file():
        pytest.skip("tests/fixtures/toolcall/model.safetensors is not built (tools/make_tool_model.py)")
    root = tmp_path_factory.mktemp("toolsrv")
    config = root / "ds4f.toml"
    config.write_text(f'[engine]\nkernel_threads = 1\nprobe_floor = false\n\n[history]\npath = "{root / "h.sqlite3"}"\n'
                      f'\n[kv]\ndir = "{root / "kv"}"\n')
    server = Srv(Server(ServerOptions(model=str(FIXTURE), config_path=str(config), port=0, access_log=False,
                                      default_max_tokens=96)))
    yield server
    server.close()


def _thinking(case) -> dict:
    """Thinking mode asked the way agent clients ask (reasoning_effort, as Pi and opencode send it)."""
    return {"reasoning_effort": "high"} if case["thinking"] else {}


def _calls(tool_calls) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def _want_calls(case) -> list:
    return [(c["name"], c["arguments"]) for c in case["reply"]["tool_calls"]]


def _streamed_chat(client, **kw) -> dict:
    """A streamed chat completion put together from its deltas, checking their order on the way:
    reasoning before content, a call's id and name before its argument fragments."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "order": []}
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning = getattr(delta, "reasoning_content", None) or (delta.model_extra or {}).get("reasoning_content")
        if reasoning:
            out["reasoning"] += reasoning
            out["order"].append("reasoning")
        if delta.content:
            out["content"] += delta.content
            out["order"].append("content")
        for tc in delta.tool_calls or ():
            call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert call["id"] is None and tc.function.name and not call["arguments"], "id and name come first"
                call["id"], call["name"] = tc.id, tc.function.name
            else:
                assert call["id"] is not None, "an argument fragment before its call's id"
            call["arguments"] += tc.function.arguments or ""
            out["order"].append("call")
        if choice.finish_reason:
            out["finish"] = choice.finish_reason
    assert out["order"] == sorted(out["order"], key=["reasoning", "content", "call"].index)
    return out


@pytest.mark.parametrize("name", LOOPS)
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_chat_completions_tool_loop(tool_srv, name, streaming):
    case = CASES[name]
    client = tool_srv.openai()
    model = tool_srv.service.model_id
    msgs = [{"role": "system", "content": SCRIPT["system"]}] + case["messages"]
    kw = dict(model=model, messages=msgs, tools=TOOLS, **_thinking(case))
    if streaming:
        got = _streamed_chat(client, **kw)
        calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())]
        ids = [c["id"] for _, c in sorted(got["calls"].items())]
        reasoning, content, finish = got["reasoning"], got["content"], got["finish"]
    else:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls, ids = _calls(m.tool_calls or ()), [c.id for c in m.tool_calls or ()]
        reasoning = (m.model_extra or {}).get("reasoning_content") or ""
        content, finish = m.content or "", r.choices[0].finish_reason
        first_prompt, first_out = r.usage.prompt_tokens, r.usage.completion_tokens
    assert (finish, calls) == ("tool_calls", _want_calls(case))
    assert (reasoning, content) == (case["reply"]["reasoning"], case["reply"]["content"])
    assert len(set(ids)) == len(ids) and all(ids)

    # the tools' results go back; the model answers them
    turn = {"role": "assistant", "content": None,
            "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                           for i, (n, a) in zip(ids, calls)]}
    if case["thinking"]:
        turn["reasoning_content"] = reasoning      # as DeepSeek's API wants it back, for a turn with calls
    results = [{"role": "tool", "tool_call_id": i, "content": res} for i, res in zip(ids, case["results"])]
    kw["messages"] = msgs + [turn] + results[::-1]    # out of order: the prompt orders them by the calls
    if streaming:
        got = _streamed_chat(client, **kw)
        assert got["calls"] == {} and got["finish"] == "stop"
        assert (got["reasoning"], got["content"]) == (case["final"]["reasoning"], case["final"]["content"])
    else:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and not m.tool_calls
        assert (m.content, (m.model_extra or {}).get("reasoning_content") or "") == \
            (case["final"]["content"], case["final"]["reasoning"])
        # the second request continues the first one's kept state: all of it reused (at least: an
        # earlier test's run of the same conversation may have kept more)
        assert r.usage.prompt_tokens_details.cached_tokens >= first_prompt + first_out - 1


def test_tool_choice_forces_a_call_and_none_reads_dsml_as_text(tool_srv):
    case = CASES["weather_Paris"]
    client = tool_srv.openai()
    msgs = [{"role": "system", "content": SCRIPT["system"]}] + case["messages"]
    model = tool_srv.service.model_id
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice=choice)
        assert r.choices[0].finish_reason == "tool_calls"
        assert _calls(r.choices[0].message.tool_calls) == _want_calls(case)
    # none: the prompt leaves the tools out (DeepSeek's encoder), and whatever the model writes is text
    r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="none")
    m = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length") and not m.tool_calls
    bare = client.chat.completions.create(model=model, messages=msgs, max_tokens=1)
    assert r.usage.prompt_tokens == bare.usage.prompt_tokens
    one = client.chat.completions.create(model=model, messages=[msgs[0]] + CASES["pair_Paris_Rome"]["messages"],
                                         tools=TOOLS, parallel_tool_calls=False)
    assert _calls(one.choices[0].message.tool_calls) == _want_calls(CASES["pair_Paris_Rome"])[:1]


def test_a_call_the_tools_refuse_is_text_with_the_reason_and_counted(tool_srv):
    """The model calls get_weather; offered only get_forecast, that call is refused: its DSML is the
    content, finish_reason tool_call_error, the reason in the choice, counted in /metrics."""
    case = CASES["weather_Paris"]
    msgs = [{"role": "system", "content": SCRIPT["system"]}] + case["messages"]
    before = _metric(tool_srv, "ds4f_tool_call_errors_total", endpoint="chat")
    r = tool_srv.chat(messages=msgs, tools=[TOOLS[1]], max_tokens=96)
    assert r.status == 200, r.body
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_call_error" and "get_weather" in choice["tool_call_error"]
    assert '<｜DSML｜invoke name="get_weather">' in choice["message"]["content"]
    assert "tool_calls" not in choice["message"]
    assert _metric(tool_srv, "ds4f_tool_call_errors_total", endpoint="chat") == before + 1


def _metric(server, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = server.get("/metrics").body.decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


# -- the Responses API --------------------------------------------------------------------------------
def _responses_tools():
    return [{"type": "function", **t} for t in SCRIPT["tools"]]


@pytest.mark.parametrize("name", ["forecast_Paris_3", "think_pair_Paris_Rome", "think_forecast_Paris_2"])
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_responses_tool_loop(tool_srv, name, streaming):
    case = CASES[name]
    client = tool_srv.openai()
    kw = dict(model=tool_srv.service.model_id, instructions=SCRIPT["system"], input=case["messages"],
              tools=_responses_tools(), store=False, include=["reasoning.encrypted_content"])
    if case["thinking"]:
        kw["reasoning"] = {"effort": "high"}       # as Codex CLI asks for it

    def respond(**kw):
        if not streaming:
            return client.responses.create(**kw)
        kinds = []
        with client.responses.stream(**kw) as events:
            for e in events:
                kinds.append(e.type)
            final = events.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == \
            len(final.output)
        return final

    r = respond(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == _want_calls(case)
    reasoning = [o for o in r.output if o.type == "reasoning"]
    assert ["".join(p.text for p in o.content) for o in reasoning] == \
        ([case["reply"]["reasoning"]] if case["thinking"] else [])
    # the output goes back as input, with the results (as Codex sends them)
    kw["input"] = case["messages"] + [o.model_dump(exclude_none=True) for o in r.output] + \
        [{"type": "function_call_output", "call_id": c.call_id, "output": res} for c, res in zip(calls, case["results"])]
    r2 = respond(**kw)
    assert r2.status == "completed" and r2.output_text == case["final"]["content"]
    assert not [o for o in r2.output if o.type == "function_call"]
    if not streaming:
        assert r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + r.usage.output_tokens - 1


# -- the Responses API on the random-weight model: shapes, events, bad input ----------------------------

BAD_RESPONSES = [
    ({}, "input"), ({"input": []}, "input"), ({"input": 5}, "input"), ({"input": [{"type": "image"}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"), ({"input": "hi", "previous_response_id": "resp_1"},
                                                               "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "absent"}}, "tool_choice"),
    ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning"), ({"input": "hi", "max_output_tokens": 0},
                                                                     "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"), ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input"),       # the chat layer's refusals too name the Responses API's parameter
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": "hi", "bogus": 1}, "bogus"),
]


@pytest.mark.parametrize("body,param", BAD_RESPONSES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_RESPONSES)])
def test_bad_responses_requests_get_400_naming_them(idle, body, param):
    r = idle.request("POST", "/v1/responses", body=body)
    assert r.status == 400, r.body
    err = r.error()
    assert err["param"] == param and err["message"].startswith(param), err
    assert idle.service.runs_started == 0


def test_responses_answers_and_streams_the_same(srv):
    client = srv.openai()
    model = srv.service.model_id
    kw = dict(model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
              instructions="Be brief.", max_output_tokens=6, temperature=0)
    r = client.responses.create(**kw)
    view = srv.get(f"/runs/{r.id.removeprefix('resp_')}").json()
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text == view["live"]["output_text"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (view["prompt_tokens"], view["generated_tokens"])
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_responses_reasoning_goes_out_and_comes_back(srv):
    """Thinking mode's reasoning is a reasoning item (with encrypted_content when asked for, as
    Codex asks); sent back as input, it is the earlier turn's reasoning: with tools the prompt
    keeps it, so the next request's prompt holds it."""
    client = srv.openai()
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    r = client.responses.create(model=srv.service.model_id, input="Hello", max_output_tokens=6,
                                reasoning={"effort": "high"}, include=["reasoning.encrypted_content"], tools=tools)
    reasoning = [o for o in r.output if o.type == "reasoning"]
    assert len(reasoning) == 1 and r.usage.output_tokens_details.reasoning_tokens > 0
    text = "".join(p.text for p in reasoning[0].content)
    assert text and reasoning[0].encrypted_content
    back = {"type": "reasoning", "id": reasoning[0].id, "summary": [], "encrypted_content":
            reasoning[0].encrypted_content}      # the text itself left out: the encrypted copy carries it
    r2 = client.responses.create(model=srv.service.model_id, max_output_tokens=2, reasoning={"effort": "high"},
                                 tools=tools, input=[{"role": "user", "content": "Hello"}, back,
                                                     {"role": "assistant", "content": "ok"},
                                                     {"role": "user", "content": "again"}])
    report = srv.get(f"/runs/{r2.id.removeprefix('resp_')}/report").json()
    assert report["text"]["messages"][1] == {"role": "assistant", "content": "ok", "reasoning": text}
