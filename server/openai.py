"""The OpenAI-compatible endpoints: what an OpenAI client library, or curl, expects of a local server.

    GET  /v1/models              the model served (one)
    GET  /v1/models/{model}
    POST /v1/chat/completions    messages -> an assistant message; "stream": true for server-sent events
    POST /v1/completions         a prompt (text, or token ids) -> its continuation; streams too

Parameters: model, max_tokens (chat also max_completion_tokens), temperature, top_p, top_k, min_p,
seed, stop (a string or a list), n (1 only), stream, stream_options.include_usage; chat also
`thinking` (DeepSeek's thinking mode: the reasoning comes as reasoning_content). A parameter left
out (or null) takes the checkpoint's generation_config.json; seed, a fresh random one, recorded
with the run. Parameters OpenAI has and this server cannot honour are refused (400 naming them)
unless they ask for the default (frequency_penalty 0, logprobs false...); unknown ones too.

Each request is one run of the engine (the run API, on the server's loaded engine), waiting its
turn in the engine queue; the completion's id is `chatcmpl-<run id>` / `cmpl-<run id>`, so
GET /runs/<run id> shows it. A streaming request that waits for the engine gets SSE comment lines
(`: queued, position 2 of 3`) until its run starts. A client that disconnects cancels its run at
the next token, or leaves the queue.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from ds4f import __version__
from ds4f.api import MAX_GEN, Ds4fError, ReasoningSplit, RunConfig, SamplingParams

from .errors import HttpError, bad, json_bytes, json_response
from .feed import END
from .queue import QueueFull, Ticket
from .routes import json_body, refused

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
MAX_STOP = 4               # as OpenAI
QUEUE_LOOK_S = 1.0         # how often a queued streaming request looks at its position
QUEUE_REPEAT_S = 15.0      # and says it again, unchanged (a keep-alive for proxies and clients)

COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream",
          "stream_options", "user")
CHAT_PARAMS = COMMON + ("messages", "max_completion_tokens", "thinking")
COMPLETION_PARAMS = COMMON + ("prompt",)
# OpenAI parameters accepted when they ask for what this server does anyway
DEFAULT_ONLY = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False, 0),
                "top_logprobs": (0,), "logit_bias": ({},), "echo": (False,), "suffix": ("",), "best_of": (1,),
                "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (False, True),
                "response_format": ({"type": "text"},), "modalities": (["text"],), "store": (False,),
                "metadata": ({},), "service_tier": ("auto", "default")}


@dataclass
class Ask:
    """One generation request, parsed."""
    kind: str                      # "chat" | "completion"
    fields: dict                   # RunConfig's text fields: messages / text / prompt, thinking, stop, stop_at_eos
    gen: int
    gen_param: str                 # what the request called it: max_tokens, max_completion_tokens
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    thinking: bool = False

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


# -- parameters ----------------------------------------------------------------------------------
def _number(raw: dict, name: str, lo: float, hi: float):
    v = raw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not lo <= v <= hi:
        raise bad(name, f"must be a number from {lo:g} to {hi:g}, got {json.dumps(v)}")
    return v


def _whole(raw: dict, name: str, lo: int, hi: int):
    v = raw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(name, f"must be a whole number from {lo} to {hi}, got {json.dumps(v)}")
    return v


def _check_names(raw: dict, known: tuple) -> None:
    for key, value in raw.items():
        if key in known or value is None:
            continue
        if key in DEFAULT_ONLY:
            if value not in DEFAULT_ONLY[key]:
                raise bad(key, f"not supported by this server (only {json.dumps(DEFAULT_ONLY[key][0])})",
                          code="unsupported_parameter")
            continue
        raise bad(key, f"unknown parameter (known: {', '.join(known)})", code="unknown_parameter")


def _text_parts(value, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "\n".join(p["text"] for p in value)
    raise bad(where, "expected text: a string, or a list of {\"type\": \"text\", \"text\": ...} parts")


def parse_messages(value) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "expected a non-empty list of {role, content} messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "expected a {role, content} object")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad(f"{where}.role", f"{json.dumps(role)} is not supported (system, developer, user, assistant)")
        if m.get("tool_calls"):
            raise bad(f"{where}.tool_calls", "tools are not supported", code="unsupported_parameter")
        msg = {"role": role, "content": _text_parts(m.get("content"), f"{where}.content")}
        reasoning = m.get("reasoning_content")
        if reasoning is not None:
            msg["reasoning"] = _text_parts(reasoning, f"{where}.reasoning_content")
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
    _check_names(raw, CHAT_PARAMS if kind == "chat" else COMPLETION_PARAMS)
    model = raw.get("model")
    if model is not None and model != svc.model_id:
        if not isinstance(model, str):
            raise bad("model", f"expected a model name, got {json.dumps(model)}")
        raise HttpError(404, f"model: no model {model!r} here; this server serves {svc.model_id!r} "
                             f"(GET /v1/models)", param="model", code="model_not_found")
    n = raw.get("n")
    if n is not None and n != 1:
        raise bad("n", f"only 1 choice per request is supported, got {json.dumps(n)}", code="unsupported_value")
    stream = raw.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", f"expected true or false, got {json.dumps(stream)}")
    options = raw.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "only with \"stream\": true")
        if not isinstance(options, dict) or any(k != "include_usage" for k in options) \
                or not isinstance(options.get("include_usage", False), bool):
            raise bad("stream_options", "expected {\"include_usage\": true|false}")
        include_usage = options.get("include_usage", False)

    default_gen = svc.options.default_max_tokens if kind == "chat" else 16
    gen_param, gen = "max_tokens", default_gen
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    given = {k: _whole(raw, k, 1, MAX_GEN) for k in names if raw.get(k) is not None}
    if len(set(given.values())) > 1:
        raise bad("max_tokens", "max_tokens and max_completion_tokens differ; give one")
    if given:
        gen_param, gen = next(iter(given.items()))

    stop = raw.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stop = tuple(stop)
    else:
        raise bad("stop", f"expected a string or a list of at most {MAX_STOP} strings")

    thinking = False
    if kind == "chat":
        thinking = raw.get("thinking") or False
        if not isinstance(thinking, bool):
            raise bad("thinking", f"expected true or false, got {json.dumps(thinking)}")
        if "messages" not in raw:
            raise bad("messages", "required: the conversation to answer", code="missing_parameter")
        fields = {"messages": parse_messages(raw["messages"]), "thinking": thinking}
    else:
        if "prompt" not in raw:
            raise bad("prompt", "required: the text to continue", code="missing_parameter")
        fields = parse_prompt(raw["prompt"])
    fields["stop"] = stop
    fields["stop_at_eos"] = True
    return Ask(kind, fields, gen, gen_param, parse_sampling(raw, svc), bool(stream), include_usage, thinking)


def parse_sampling(raw: dict, svc) -> SamplingParams:
    """The request's sampling settings over the checkpoint's defaults; seed: random unless given."""
    d = svc.generation_defaults
    given = {"temperature": _number(raw, "temperature", 0, 2), "top_p": _number(raw, "top_p", 0, 1),
             "top_k": _whole(raw, "top_k", 0, 1 << 31), "min_p": _number(raw, "min_p", 0, 1)}
    seed = _whole(raw, "seed", 0, (1 << 63) - 1)
    settings = {"temperature": d.temperature if d.do_sample else 0.0, "top_p": d.top_p, "top_k": d.top_k,
                "min_p": d.min_p}
    settings.update({k: v for k, v in given.items() if v is not None})
    settings["seed"] = seed if seed is not None else secrets.randbelow(1 << 31)
    try:
        return SamplingParams(**settings)
    except Ds4fError as exc:
        raise bad(exc.param or "sampling", exc.message.split(": ", 1)[-1]) from None


# -- answers -------------------------------------------------------------------------------------
def _usage(run) -> dict:
    return {"prompt_tokens": run.prompt_tokens, "completion_tokens": run.generated_tokens,
            "total_tokens": run.prompt_tokens + run.generated_tokens,
            # as OpenAI reports it: the prompt tokens served from the prefix cache
            "prompt_tokens_details": {"cached_tokens": run.prompt_tokens_reused}}


def _ended_badly(run) -> HttpError | None:
    if run.state == "failed":
        return HttpError(500, f"the run failed: {run.error}", code="run_failed", extra={"run_id": run.id})
    if run.state == "cancelled":
        return HttpError(503, "the run was cancelled (an operator cancelled it, or the server is shutting down)",
                         code="cancelled", extra={"run_id": run.id})
    return None


def _answer(ask: Ask, run, svc) -> dict:
    text = run.output_text
    finish = FINISH_REASONS.get(run.finish_reason, "length")
    head = {"id": ("chatcmpl-" if ask.kind == "chat" else "cmpl-") + run.id, "object": ask.object,
            "created": int(run.started_at), "model": svc.model_id, "system_fingerprint": f"ds4f-{__version__}"}
    if ask.kind == "chat":
        parts = ReasoningSplit(ask.thinking, reasoning="reasoning_content", answer="content")
        fields = parts.push(text) + parts.finish()
        message = {"role": "assistant", "content": "".join(v for k, v in fields if k == "content")}
        if ask.thinking:
            message["reasoning_content"] = "".join(v for k, v in fields if k == "reasoning_content")
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {**head, "choices": [choice], "usage": _usage(run)}


def _run_config(ask: Ask, svc) -> RunConfig:
    return RunConfig(model=svc.model, preset=svc.preset, gen=ask.gen, backend=svc.cfg.backend,
                     config_path=svc.options.config_path, sampling=ask.sampling, kv_dir=svc.options.kv_dir,
                     reuse_prefix=svc.options.reuse_prefix, **ask.fields)


def _names(ask: Ask) -> dict:
    """The run API's parameter names as this request spells them."""
    return {"gen": ask.gen_param, "text": "prompt", "sampling": "temperature"}


async def _disconnected(receive) -> None:
    """Returns when the client has gone (http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(aw, gone: asyncio.Task) -> bool:
    """Await `aw` unless the client goes first (then `aw` is cancelled): True if `aw` finished."""
    task = asyncio.ensure_future(aw)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def NO_ANSWER(scope, receive, send) -> None:
    """The answer to a client that is gone: nothing (the access log says `-`)."""


async def _generate(request: Request, kind: str) -> Response:
    svc = request.app.state.service
    raw = await json_body(request, "request parameters")
    ask = parse_ask(raw, kind, svc)
    config = _run_config(ask, svc)
    ticket = Ticket(ask.object, request.client.host if request.client else "-")
    svc.join(ticket)
    waited_from = time.monotonic()
    run = feed = None
    if ticket.granted.done():   # the engine was free: start now, so a refusal is a proper status
        svc.metrics.queue_wait.observe(0.0)
        try:
            run, feed = await svc.start(config, ticket)
        except Ds4fError as exc:
            raise refused(exc, raw, _names(ask)) from None
    if ask.stream:
        return EventStream(_events(svc, ask, config, ticket, run, feed, raw, waited_from), svc.abandon_factory(ticket))
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        if run is None:
            try:
                if not await _unless_gone(svc.queue.wait(ticket), gone):
                    return NO_ANSWER
            except QueueFull as exc:
                raise HttpError(503, exc.message, code=exc.code, headers={"Retry-After": "5"}) from None
            svc.metrics.queue_wait.observe(time.monotonic() - waited_from)
            try:
                run, feed = await svc.start(config, ticket)
            except Ds4fError as exc:
                raise refused(exc, raw, _names(ask)) from None
        if not await _unless_gone(feed.ended.wait(), gone):
            ticket.abandon()
            return NO_ANSWER
    except BaseException:
        svc.abandon(ticket)
        raise
    finally:
        gone.cancel()
    failure = _ended_badly(run)
    if failure is not None:
        raise failure
    return json_response(200, _answer(ask, run, svc))


def _sse(obj) -> bytes:
    return b"data: " + json_bytes(obj).rstrip(b"\n") + b"\n\n"


async def _events(svc, ask: Ask, config: RunConfig, ticket: Ticket, run, feed, raw: dict, waited_from: float):
    """The SSE body: queue comments while waiting, a chunk per piece of text, the final chunk, [DONE]."""
    if run is None:
        shown, shown_at = None, 0.0
        while True:
            pos = svc.queue.position(ticket)
            if pos and (pos != shown or time.monotonic() - shown_at >= QUEUE_REPEAT_S):   # news, or a keep-alive
                shown, shown_at = pos, time.monotonic()
                yield f": queued, position {pos} of {len(svc.queue.waiting)}\n\n".encode()
            try:
                await asyncio.wait_for(asyncio.shield(ticket.granted), QUEUE_LOOK_S)
                break
            except asyncio.TimeoutError:
                continue
            except QueueFull as exc:
                yield _sse(HttpError(503, exc.message, code=exc.code).body())
                yield b"data: [DONE]\n\n"
                return
        svc.metrics.queue_wait.observe(time.monotonic() - waited_from)
        try:
            run, feed = await svc.start(config, ticket)
        except (Ds4fError, HttpError) as exc:
            err = refused(exc, raw, _names(ask)) if isinstance(exc, Ds4fError) else exc
            yield _sse(err.body())
            yield b"data: [DONE]\n\n"
            return
    head = {"id": ("chatcmpl-" if ask.kind == "chat" else "cmpl-") + run.id,
            "object": "chat.completion.chunk" if ask.kind == "chat" else "text_completion",
            "created": int(run.started_at), "model": svc.model_id, "system_fingerprint": f"ds4f-{__version__}"}
    if ask.include_usage:
        head["usage"] = None

    def chunk(delta: dict | str | None, finish: str | None = None) -> bytes:
        if ask.kind == "chat":
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [choice]})

    def pieces(fields: list[tuple[str, str]]):
        for key, text in fields:
            yield chunk({key: text} if ask.kind == "chat" else text)

    split = ReasoningSplit(ask.thinking, reasoning="reasoning_content", answer="content")
    if ask.kind == "chat":
        yield chunk({"role": "assistant", "content": ""})
    sent = []
    while (piece := await feed.pieces.get()) is not END:
        sent.append(piece)
        for c in pieces(split.push(piece) if ask.kind == "chat" else [("text", piece)]):
            yield c
    text, streamed = run.output_text, "".join(sent)
    if len(text) > len(streamed) and text.startswith(streamed):   # anything the records did not carry
        rest = text[len(streamed):]
        for c in pieces(split.push(rest) if ask.kind == "chat" else [("text", rest)]):
            yield c
    for c in pieces(split.finish()):
        yield c
    failure = _ended_badly(run)
    if failure is not None:
        yield _sse(failure.body())
    else:
        yield chunk(None, FINISH_REASONS.get(run.finish_reason, "length"))
        if ask.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(run)})
    yield b"data: [DONE]\n\n"


class EventStream:
    """A server-sent-events answer (an ASGI app). The events are sent as they come; if the client
    disconnects first, the events stop and `on_close` is called (it cancels the run or leaves the
    queue), as it is however the stream ends."""

    def __init__(self, events, on_close):
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            while True:
                nxt = asyncio.ensure_future(self.events.__anext__())
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await nxt
                    break
                try:
                    data = nxt.result()
                except StopAsyncIteration:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
        finally:
            gone.cancel()
            await self.events.aclose()
            self.on_close()


# -- endpoints ----------------------------------------------------------------------------------
def _model_card(svc) -> dict:
    return {"id": svc.model_id, "object": "model", "created": int(svc.started_at), "owned_by": "ds4f",
            "ds4f": {"path": svc.model, "kind": svc.checkpoint_kind, "preset": svc.preset}}


async def list_models(request: Request) -> Response:
    return json_response(200, {"object": "list", "data": [_model_card(request.app.state.service)]})


async def get_model(request: Request) -> Response:
    svc = request.app.state.service
    name = request.path_params["model"]
    if name != svc.model_id:
        raise HttpError(404, f"model: no model {name!r} here; this server serves {svc.model_id!r}", param="model",
                        code="model_not_found")
    return json_response(200, _model_card(svc))


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")
