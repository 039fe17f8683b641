"""A forced tool call in thinking mode: DeepSeek-V4's format has none (DeepSeek's encoder refuses
it, as Anthropic's API does), so every endpoint answers 400 naming tool_choice, before any run."""
from __future__ import annotations

from server_helpers import idle, serve_config  # noqa: F401 (fixtures)

TOOL = {"name": "get_weather", "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_forced_choice_in_thinking_mode_is_refused_on_every_endpoint(idle):
    model = idle.service.model_id
    chat = idle.request("POST", "/v1/chat/completions", body={
        "model": model, "messages": ASK, "tools": [{"type": "function", "function": TOOL}],
        "tool_choice": "required", "thinking": {"type": "enabled"}})
    responses = idle.request("POST", "/v1/responses", body={
        "model": model, "input": ASK, "tools": [{"type": "function", **TOOL}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "reasoning": {"effort": "high"}})
    messages = idle.request("POST", "/v1/messages", headers={"anthropic-version": "2023-06-01"}, body={
        "model": model, "max_tokens": 16, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}],
        "tool_choice": {"type": "any"}})
    for r in (chat, responses, messages):
        assert r.status == 400, r.body
        err = r.json()["error"]
        assert "tool_choice" in (err.get("param") or err["message"]) and "thinking" in err["message"], err
    # chat mode is fine: the same requests without thinking are not refused for it
    ok = idle.request("POST", "/v1/chat/completions", body={
        "model": model, "messages": ASK, "tools": [{"type": "function", "function": TOOL}], "tool_choice": "required",
        "max_tokens": 0})
    assert ok.status == 400 and ok.error()["param"] == "max_tokens", ok.body
