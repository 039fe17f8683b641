"""The streamed answers of OpenAI's chat and the Responses API as generation.streamed writes them
through each dialect's writer (the Anthropic one: test_messages), fed the tool model's scripted
answers a few characters at a time, with no model: what the events build is the whole answer."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds4f.api import SamplingParams
from ds4f.engine.text.dsml import pieces_text, render_calls
from ds4f.server import openai, responses
from ds4f.server.errors import HttpError
from ds4f.server.generation import Ask, counted, streamed

SCRIPT = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "toolcall" / "script.json")
                    .read_text(encoding="utf-8"))
CASES = {c["name"]: c for c in SCRIPT["cases"]}
NAMES = ["weather_Paris", "pair_Paris_Rome", "think_pair_Paris_Rome", "think_hello"]


def _svc():
    return SimpleNamespace(model_id="tiny", metrics=SimpleNamespace(tool_reply=lambda endpoint, reply: None))


def _run(text: str, finish: str = "eos"):
    return SimpleNamespace(id="r1", started_at=1.0, prompt_tokens=9, prompt_tokens_reused=4, generated_tokens=6,
                           generated_ids=[1, 2, 3], finish_reason=finish, state="done", error=None, tokenizer=None,
                           output_text=text, stop_string=None)


def _text(case) -> str:
    reply = case["reply"]
    return (reply["reasoning"] + "</think>" if case["thinking"] else "") + reply["content"] + \
        pieces_text(render_calls(reply["tool_calls"]))


def _stream(ask: Ask, raw: dict, writer, text: str, run=None, refusal=None) -> bytes:
    run = run or _run(text)

    async def events():
        yield ("queued", 2, 3)
        if refusal is not None:
            yield ("refused", refusal)
            return
        yield ("started", run)
        for i in range(0, len(text), 3):
            yield ("piece", text[i:i + 3])
        yield ("end", run)

    async def collect():
        return b"".join([c async for c in streamed(SimpleNamespace(ask=ask, svc=_svc(), raw=raw, events=events),
                                                   writer)])
    return asyncio.run(collect())


def _whole(ask: Ask, text: str):
    parser = ask.parser()
    parser.push(text)
    parser.finish()
    return counted(ask, parser.result, _svc())


def _ask(case, parallel: bool, endpoint: str) -> Ask:
    return Ask("chat", {}, 200, "max_tokens", SamplingParams(temperature=0.0), True, thinking=case["thinking"],
               tools=tuple(SCRIPT["tools"]), parallel_calls=parallel, endpoint=endpoint)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("parallel", [True, False])
def test_the_responses_events_build_the_whole_response(name, parallel):
    case, text = CASES[name], _text(CASES[name])
    ask = _ask(case, parallel, "responses")
    raw = {"input": "hi", "tools": [{"type": "function", **t} for t in SCRIPT["tools"]]}
    body = _stream(ask, raw, responses._Items(ask, _svc(), raw), text)
    assert body.startswith(b": queued, position 2 of 3\n\n")
    events = []
    for chunk in body.decode().split("\n\n")[1:-1]:
        head, data = chunk.split("\n")
        data = json.loads(data.removeprefix("data: "))
        assert head == f"event: {data['type']}"
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    built, texts = {}, {}        # the items as added and done, the text their deltas carry
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(built) and e["item"]["status"] == "in_progress"
            built[e["output_index"]] = None
        elif e["type"] == "response.output_item.done":
            built[e["output_index"]] = e["item"]
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta",
                           "response.function_call_arguments.delta"):
            texts[e["output_index"]] = texts.get(e["output_index"], "") + e["delta"]
    shape = responses.Shape(ask, raw, _svc(), _run(text))
    whole = responses._output(shape, _whole(ask, text))
    output = events[-1]["response"]["output"]
    assert list(built.values()) == output
    assert [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in output] == \
        [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in whole]
    for index, item in enumerate(output):
        want = item.get("arguments") if item["type"] == "function_call" else item["content"][0]["text"]
        assert texts.get(index, "") == want
    calls = [i for i in output if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c["name"], c["arguments"]) for c in case["reply"]["tool_calls"]][:None if parallel else 1]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("parallel", [True, False])
def test_the_chat_chunks_build_the_whole_message(name, parallel):
    case, text = CASES[name], _text(CASES[name])
    ask = _ask(case, parallel, "chat")
    ask.include_usage = True
    body = _stream(ask, {}, openai._Chunks(ask, _svc()), text)
    assert body.startswith(b": queued, position 2 of 3\n\n") and body.endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(c.removeprefix("data: ")) for c in body.decode().split("\n\n")[1:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    message, calls = {"reasoning_content": "", "content": ""}, {}
    for chunk in chunks[1:-2]:
        (choice,) = chunk["choices"]
        assert choice["finish_reason"] is None and chunk["id"] == "chatcmpl-r1"
        for key in ("reasoning_content", "content"):
            message[key] += choice["delta"].get(key, "")
        for call in choice["delta"].get("tool_calls", []):
            got = calls.setdefault(call["index"], {"id": call.get("id"), "name": None, "arguments": ""})
            got["name"] = call["function"].get("name", got["name"])
            got["arguments"] += call["function"]["arguments"]
    reply = _whole(ask, text)
    assert chunks[-2]["choices"][0]["finish_reason"] == openai.finish_of(_run(text), reply)
    assert message == {"reasoning_content": reply.reasoning or "", "content": reply.content}
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c["name"], c["arguments"]) for c in case["reply"]["tool_calls"]][:None if parallel else 1]
    assert list(calls) == list(range(len(calls)))


def test_a_refusal_in_the_queue_ends_each_stream_in_its_dialect():
    case = CASES["weather_Paris"]
    refusal = HttpError(503, "the engine queue is full", code="queue_full")
    ask = _ask(case, True, "chat")
    body = _stream(ask, {}, openai._Chunks(ask, _svc()), "", refusal=refusal)
    assert body == b": queued, position 2 of 3\n\n" + openai.sse(refusal.body()) + b"data: [DONE]\n\n"
    ask = _ask(case, True, "responses")
    body = _stream(ask, {}, responses._Items(ask, _svc(), {}), "", refusal=refusal)
    head, data = body.decode().split("\n\n")[1].split("\n")
    assert head == "event: error" and json.loads(data.removeprefix("data: ")) == \
        {"type": "error", "sequence_number": 0, "code": "queue_full", "message": "the engine queue is full",
         "param": None}
