"""The answer reader (engine.text.reply) against the release's parser and DeepSeek's own, on
well-formed answers: the same reasoning, content and calls.

References: parse_message_from_completion_text of the release's encoding file
(tests/reference/deepseek_v4_encoding.py, from vLLM 0.20.0) and deepseek-recipe 0.2.0's stream
processor fed the answer in pieces, as a server would (its chat completions response, accumulated).
Where ds4f reads more (misspelt markers, an unclosed </think>, values of the wrong type),
docs/tools.md says so; those cases are in test_text_tools.py.
"""
import json

import pytest

from ds4f.engine.text.reply import ReplyParser

B = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string"}}}},
    {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "number"}, "safe": {"type": "boolean"},
        "tags": {"type": "array"}, "filters": {"type": "object"}, "cursor": {"type": ["string", "null"]}}}},
    {"name": "clock", "parameters": {"type": "object", "properties": {}}},
]


def param(name, value, string):
    return f'<{B}parameter name="{name}" string="{"true" if string else "false"}">{value}</{B}parameter>'


def invoke(name, *params):
    return f'<{B}invoke name="{name}">\n' + "\n".join(params) + f'\n</{B}invoke>'


def block(*invokes):
    return f"\n\n<{B}tool_calls>\n" + "\n".join(invokes) + f"\n</{B}tool_calls>"


WEATHER = invoke("get_weather", param("city", "Paris", True), param("days", "3", False))
SEARCH = invoke("search", param("query", 'café "au lait"\nnews & <b>more</b>', True), param("limit", "2.5", False),
                param("safe", "true", False), param("tags", '["a", "b"]', False),
                param("filters", '{"lang": "fr", "n": [1, 2]}', False), param("cursor", "null", False))
CLOCK = invoke("clock")

ANSWERS = {   # name: (thinking, text without EOS)
    "content": (False, "The answer is 42.\n\nThat is all."),
    "empty": (False, ""),
    "one_call": (False, "Let me check." + block(WEATHER)),
    "bare_call": (False, block(WEATHER)),
    "every_type": (False, block(SEARCH)),
    "parallel": (False, "Two things." + block(WEATHER, CLOCK, SEARCH)),
    "no_params": (False, block(CLOCK)),
    "unicode": (False, "Voilà: 東京 🌧" + block(invoke("get_weather", param("city", "東京", True)))),
    "think_content": (True, "The user greets me.</think>Hello!"),
    "think_call": (True, "I need the weather for Paris.\nTwo lines.</think>" + block(WEATHER)),
    "think_content_call": (True, "Plan.</think>Checking now." + block(WEATHER, CLOCK)),
}


def ours(thinking, text, pieces=7):
    """ds4f's reader, streamed in pieces of `pieces` characters."""
    p = ReplyParser(thinking, TOOLS)
    for i in range(0, len(text), pieces):
        p.push(text[i:i + pieces])
    p.finish()
    r = p.result
    assert r.error is None and r.repairs == []
    return r.reasoning, r.content, [(c["name"], json.loads(c["arguments"])) for c in r.calls]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_reader_agrees_with_the_release_parser(release, name):
    thinking, text = ANSWERS[name]
    want = release.parse_message_from_completion_text(text + EOS, "thinking" if thinking else "chat")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want["tool_calls"]]
    assert ours(thinking, text) == (want["reasoning"], want["content"], calls)


def recipe_parse(d, thinking, text, pieces=5):
    body = {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "enabled" if thinking else "disabled"},
            "tools": [{"type": "function", "function": t} for t in TOOLS]}
    req = d.ChatCompletionRequest(body).convert(d.ConversionOptions())
    sp = d.StreamProcessor(d.ChatCompletionRequest.chunk_generator(req, "id", "m"), req.parsing_options)
    resp = d.ChatCompletionResponse("id", "m", 0, 1, 0)
    chunks = sp.push(d.InferenceChunk.ready())
    for i in range(0, len(text), pieces):
        chunks += sp.push(d.InferenceChunk.text(text[i:i + pieces], 1))
    chunks += sp.push(d.InferenceChunk.finish(d.InferenceFinishReason.Stop)) + sp.finish()
    for c in chunks:
        resp.accumulate(c)
    msg = json.loads(resp.to_json())["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or ()]
    return msg.get("reasoning_content") or "", msg.get("content") or "", calls


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_reader_agrees_with_deepseeks_parser(name):
    d = pytest.importorskip("deepseek_recipe")
    thinking, text = ANSWERS[name]
    assert ours(thinking, text, pieces=3) == recipe_parse(d, thinking, text)
