"""The OpenAI-compatible endpoints: what an OpenAI client library, or curl, expects of a local server.

    GET  /v1/models              the model served (one), with its context (max_model_len, context_length)
    GET  /v1/models/{model}
    POST /v1/chat/completions    messages -> an assistant message (reasoning, content, tool calls); streams too
    POST /v1/completions         a prompt (text, or token ids) -> its continuation; streams too

Parameters: model (one of the served model's names), max_tokens (chat also max_completion_tokens;
left out, a chat answer may fill what the context leaves after the prompt, or at most the operator's
--max-tokens; a completion gets 16), temperature, top_p, top_k, min_p, seed, stop (a string or a
list), n (1 only), stream, stream_options.include_usage; and IGNORED below (store, metadata, user,
prompt_cache_key, safety_identifier, service_tier, verbosity: they do not change the answer, the
Responses API takes them too). Chat also:

- messages: system, developer, user, assistant and tool messages, each kept with its role at its
  place for the chat layer (a developer or system message after the last user turn included).
- tools (function schemas: the prompt shows name, description and parameters, as on every
  endpoint, server.conversation), tool_choice (none, auto, required, {"type": "function", "function":
  {"name"}}), parallel_tool_calls (false: the first call only). The model's DSML calls come back
  as `tool_calls` (finish_reason "tool_calls"); tool results go back as `tool` messages. With
  tool_choice none the tools stay in the prompt and DSML is read as content; required or a name
  puts the call's opening in the prompt (the model then writes the call; no reasoning first).
- thinking (DeepSeek's thinking mode: the reasoning comes as reasoning_content), asked for by any
  of the shapes clients use (see `thinking_of`): `thinking` true/false or {"type": "enabled" |
  "disabled"}, `reasoning_effort` (none turns it off; xhigh or max ask for the release's maximum
  effort), `reasoning` {"effort", "enabled"}, `chat_template_kwargs` {"thinking" |
  "enable_thinking", "reasoning_effort"}. Earlier turns' reasoning_content (or reasoning) is
  taken back; "" and null are the same.
- response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}: the answer held to JSON, or to the schema, token by token (server.structured,
  engine.text.constraint); a schema that cannot be compiled is a 400 naming response_format.
- An answer whose calls do not parse, or that the tools refuse (an unknown function, arguments
  against the schema): its text is the content, finish_reason "tool_call_error", and the choice's
  `tool_call_error` says what was wrong; counted in /metrics (engine.text.reply lists what is
  repaired instead).

A parameter left out (or null) takes the checkpoint's generation_config.json; seed, a fresh random
one, recorded with the run. Parameters OpenAI has and this server cannot honour are refused (400
naming them) unless they ask for the default (frequency_penalty 0, logprobs false...); unknown
ones too.

Each request is one run of the engine (server.generation, shared with /v1/responses and
/v1/messages); the completion's id is `chatcmpl-<run id>` / `cmpl-<run id>`, so GET /runs/<run id>
shows it. A streaming request that waits for the engine gets SSE comment lines (`: queued,
position 2 of 3`) until its run starts. A client that disconnects cancels its run at the next
token, or leaves the queue.
"""
from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from ds4f import __version__
from ds4f.api import MAX_GEN, Ds4fError, check_call

from .conversation import chat_fields, from_ds4f
from .errors import HttpError, bad, json_bytes, json_response
from .generation import Ask, SseWaits, reply_of, respond, streamed
from .request import (EFFORTS, IGNORED, boolean, check_model, check_names, parse_sampling, parse_stop,
                      parse_tool_choice, parse_tools, text_parts, whole)
from .structured import response_format_of

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
TOOL_CALL_ERROR = "tool_call_error"    # the finish reason of an answer whose calls were refused
COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream",
          "stream_options", *IGNORED)
THINKING_PARAMS = ("thinking", "reasoning_effort", "reasoning", "chat_template_kwargs")
CHAT_PARAMS = COMMON + ("messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                        "response_format") + THINKING_PARAMS
COMPLETION_PARAMS = COMMON + ("prompt",)
# OpenAI parameters accepted when they ask for what this server does anyway
DEFAULT_ONLY = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False, 0),
                "top_logprobs": (0,), "logit_bias": ({},), "echo": (False,), "suffix": ("",), "best_of": (1,),
                "response_format": ({"type": "text"},), "modalities": (["text"],)}
STREAM_OPTIONS = ("include_usage", "include_obfuscation")


# -- parameters ----------------------------------------------------------------------------------



# -- parameters ----------------------------------------------------------------------------------
def thinking_of(raw: dict, default: bool = False) -> tuple[bool, str | None]:
    """(thinking mode, reasoning effort) from the shapes clients ask with; an explicit on/off
    (`thinking`, `chat_template_kwargs`) wins over what an effort implies."""
    explicit, effort = None, None
    kwargs = raw.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "expected an object")
    kwargs = kwargs or {}
    reasoning = raw.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad("reasoning", "expected an object: {\"effort\": ..., \"enabled\": ...}")
    reasoning = reasoning or {}
    for name, value in (("reasoning_effort", raw.get("reasoning_effort")),
                        ("reasoning.effort", reasoning.get("effort")),
                        ("chat_template_kwargs.reasoning_effort", kwargs.get("reasoning_effort"))):
        if value is None:
            continue
        if value == "none":
            explicit = False if explicit is None else explicit
            continue
        if value not in EFFORTS:
            raise bad(name.split(".")[0], f"{json.dumps(value)} is not an effort ({', '.join(['none', *EFFORTS])})")
        effort = EFFORTS[value]
    if effort is not None and explicit is None:
        explicit = True
    for name, value in (("reasoning.enabled", reasoning.get("enabled")),
                        ("chat_template_kwargs.enable_thinking", kwargs.get("enable_thinking")),
                        ("chat_template_kwargs.thinking", kwargs.get("thinking")),
                        ("thinking", raw.get("thinking"))):
        if value is None:
            continue
        if isinstance(value, dict):
            kind = value.get("type")
            if kind not in ("enabled", "disabled", "adaptive"):
                raise bad(name.split(".")[0], "expected {\"type\": \"enabled\"} or {\"type\": \"disabled\"}")
            value = kind != "disabled"
        if not isinstance(value, bool):
            raise bad(name.split(".")[0], f"expected true or false, got {json.dumps(value)}")
        explicit = value
    thinking = default if explicit is None else explicit
    return thinking, effort if thinking else None


def _reasoning_field(m: dict, where: str) -> str | None:
    for key in ("reasoning_content", "reasoning"):
        value = m.get(key)
        if value is not None:
            return text_parts(value, f"{where}.{key}") or None
    return None


def parse_messages(value) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "expected a non-empty list of {role, content} messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "expected a {role, content} object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{where}.role", f"{json.dumps(role)} is not supported (system, developer, user, assistant,"
                                       f" tool)")
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise bad(f"{where}.tool_calls", "expected a list of tool calls")
            parsed = []
            for j, c in enumerate(calls):
                if not isinstance(c, dict) or not isinstance(c.get("function"), dict) \
                        or c.get("type", "function") != "function":
                    raise bad(f"{where}.tool_calls[{j}]", "expected {\"id\", \"type\": \"function\", \"function\": "
                                                          "{\"name\", \"arguments\"}}")
                try:
                    parsed.append(check_call({"id": c.get("id"), **c["function"]}, f"{where}.tool_calls[{j}]",
                                             "messages"))
                except Ds4fError as exc:
                    raise from_ds4f(exc) from None
            content = m.get("content")
            msg = {"role": role, "content": "" if content is None else text_parts(content, f"{where}.content"),
                   "tool_calls": parsed}
        elif calls:
            raise bad(f"{where}.tool_calls", "on an assistant message only")
        else:
            content = m.get("content")
            if content is None and role == "assistant":
                content = ""
            msg = {"role": role, "content": text_parts(content, f"{where}.content")}
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        if role == "assistant":
            reasoning = _reasoning_field(m, where)
            if reasoning:
                msg["reasoning"] = reasoning
        out.append(msg)
    return tuple(out)


def parse_prompt(value) -> dict:
    """A completion's prompt: text, one text in a list, or token ids."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return {"text": value} if value else {"prompt": None}
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return {"prompt": tuple(value)}
    raise bad("prompt", "expected a string, or a list of token ids (one prompt per request)")


def parse_ask(raw: dict, kind: str, svc) -> Ask:
    check_names(raw, CHAT_PARAMS if kind == "chat" else COMPLETION_PARAMS, DEFAULT_ONLY)
    check_model(raw, svc)
    n = raw.get("n")
    if n is not None and n != 1:
        raise bad("n", f"only 1 choice per request is supported, got {json.dumps(n)}", code="unsupported_value")
    stream_ = boolean(raw.get("stream"), "stream")
    options = raw.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream_:
            raise bad("stream_options", "only with \"stream\": true")
        if not isinstance(options, dict) or any(k not in STREAM_OPTIONS for k in options) \
                or not all(isinstance(v, bool) for v in options.values()):
            raise bad("stream_options", "expected {\"include_usage\": true|false} (include_obfuscation is ignored)")
        include_usage = options.get("include_usage", False)

    # without a limit a chat answer may fill the context (None: the room the prompt leaves), as OpenAI's
    # do; a completion gets OpenAI's 16 tokens
    gen_param, gen = "max_tokens", None if kind == "chat" else 16
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    given = {k: whole(raw, k, 1, MAX_GEN) for k in names if raw.get(k) is not None}
    if len(set(given.values())) > 1:
        raise bad("max_tokens", "max_tokens and max_completion_tokens differ; give one")
    if given:
        gen_param, gen = next(iter(given.items()))
    stop = parse_stop(raw.get("stop"))

    thinking, tools, choice, parallel = False, (), None, True
    if kind == "chat":
        thinking, effort = thinking_of(raw)
        if "messages" not in raw:
            raise bad("messages", "required: the conversation to answer", code="missing_parameter")
        tools = parse_tools(raw.get("tools"))
        choice = parse_tool_choice(raw.get("tool_choice"), tools)
        parallel = boolean(raw.get("parallel_tool_calls"), "parallel_tool_calls") is not False
        fields = chat_fields(parse_messages(raw["messages"]), tools, choice, thinking, effort)
        fields["response_format"] = response_format_of(raw.get("response_format"), tools, choice)
    else:
        if "prompt" not in raw:
            raise bad("prompt", "required: the text to continue", code="missing_parameter")
        fields = parse_prompt(raw["prompt"])
    fields["stop"] = stop
    fields["stop_at_eos"] = True
    return Ask(kind, fields, gen, gen_param, parse_sampling(raw, svc), bool(stream_), include_usage, thinking,
               tools, choice, parallel, names={"gen": gen_param, "text": "prompt", "sampling": "temperature",
                                                  "prompt": "messages" if kind == "chat" else "prompt"})


# -- answers -------------------------------------------------------------------------------------
def usage_of(run) -> dict:
    return {"prompt_tokens": run.prompt_tokens, "completion_tokens": run.generated_tokens,
            "total_tokens": run.prompt_tokens + run.generated_tokens,
            # as OpenAI reports it: the prompt tokens served from the prefix cache
            "prompt_tokens_details": {"cached_tokens": run.prompt_tokens_reused}}


def finish_of(run, reply=None) -> str:
    if reply is not None and reply.error is not None:
        return TOOL_CALL_ERROR
    if reply is not None and reply.calls:
        return "tool_calls"
    return FINISH_REASONS.get(run.finish_reason, "length")


def openai_calls(reply) -> list[dict]:
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in reply.calls]


def _head(ask: Ask, run, svc, obj: str) -> dict:
    return {"id": ("chatcmpl-" if ask.kind == "chat" else "cmpl-") + run.id, "object": obj,
            "created": int(run.started_at), "model": svc.model_id, "system_fingerprint": f"ds4f-{__version__}"}


def _answer(ask: Ask, run, svc) -> dict:
    if ask.kind == "chat":
        reply = reply_of(ask, run, svc)
        message = {"role": "assistant", "content": reply.content if reply.content or not reply.calls else None}
        if ask.thinking:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = openai_calls(reply)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_of(run, reply)}
        if reply.error is not None:
            choice[TOOL_CALL_ERROR] = reply.error
        return {**_head(ask, run, svc, "chat.completion"), "choices": [choice], "usage": usage_of(run)}
    choice = {"index": 0, "text": run.output_text, "logprobs": None, "finish_reason": finish_of(run)}
    return {**_head(ask, run, svc, "text_completion"), "choices": [choice], "usage": usage_of(run)}


async def _generate(request: Request, kind: str) -> Response:
    svc = request.app.state.service
    return await respond(request, lambda raw: parse_ask(raw, kind, svc), _events,
                         lambda ask, run, raw: _answer(ask, run, svc))


def sse(obj) -> bytes:
    return b"data: " + json_bytes(obj).rstrip(b"\n") + b"\n\n"


DONE = b"data: [DONE]\n\n"


class _Chunks(SseWaits):
    """The chunks of a streamed answer, under the completion's head: a chat's opening (the role), one
    per piece of text (reasoning, content) or per call's opening and argument fragment; a
    completion's one per piece of text; then the finish and the usage."""

    def __init__(self, ask: Ask, svc) -> None:
        self.ask, self.svc = ask, svc
        self.chat = ask.kind == "chat"
        self.head: dict | None = None       # once the run has started
        self.calls = 0

    def chunk(self, delta, finish: str | None = None) -> bytes:
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return sse({**self.head, "choices": [choice]})

    @staticmethod
    def refused(error) -> list[bytes]:
        return [sse(error.body()), DONE]

    def start(self, run) -> list[bytes]:
        self.head = _head(self.ask, run, self.svc, "chat.completion.chunk" if self.chat else "text_completion")
        if self.ask.include_usage:
            self.head["usage"] = None
        return [self.chunk({"role": "assistant", "content": ""})] if self.chat else []

    def feed(self, events) -> list[bytes]:
        """A chat's reply parser events, or a completion's pieces of text."""
        out: list[bytes] = []
        for event in events:
            if not self.chat:
                out.append(self.chunk(event))
            elif event[0] == "call":
                if self.calls and not self.ask.parallel_calls:
                    continue
                call, index = event[1], self.calls
                out.append(self.chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                                       "function": {"name": call["name"], "arguments": ""}}]}))
                out += [self.chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
                        for fragment in call["fragments"]]
                self.calls += 1
            else:
                out.append(self.chunk({"reasoning_content" if event[0] == "reasoning" else "content": event[1]}))
        return out

    @staticmethod
    def failed(error) -> list[bytes]:
        return [sse(error.body()), DONE]

    def end(self, run, reply) -> list[bytes]:
        """The finish (a chat's reply read whole; None for a completion), the usage if asked for, [DONE]."""
        if reply is not None and reply.error is not None:
            out = [sse({**self.head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                  "finish_reason": TOOL_CALL_ERROR, TOOL_CALL_ERROR: reply.error}]})]
        else:
            out = [self.chunk(None, finish_of(run, reply))]
        if self.ask.include_usage:
            out.append(sse({**self.head, "choices": [], "usage": usage_of(run)}))
        return out + [DONE]


def _events(pending):
    """The SSE body: queue comments while waiting, the chunks (see _Chunks), [DONE]."""
    return streamed(pending, _Chunks(pending.ask, pending.svc))


# -- endpoints ----------------------------------------------------------------------------------
def _model_card(svc, name: str | None = None) -> dict:
    """The model as OpenAI lists it, with its context (prompt and answer together, in tokens) under
    the names vLLM and OpenRouter give it (aider and other clients read them)."""
    return {"id": name or svc.model_id, "object": "model", "created": int(svc.started_at), "owned_by": "ds4f",
            "max_model_len": svc.context, "context_length": svc.context,
            "ds4f": {"path": svc.model, "kind": svc.checkpoint_kind, "preset": svc.preset}}


async def list_models(request: Request) -> Response:
    return json_response(200, {"object": "list", "data": [_model_card(request.app.state.service)]})


async def get_model(request: Request) -> Response:
    svc = request.app.state.service
    name = request.path_params["model"]
    if not svc.serves(name):
        raise HttpError(404, f"model: no model {name!r} here; this server serves {svc.model_id!r}", param="model",
                        code="model_not_found")
    return json_response(200, _model_card(svc, name))


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")
