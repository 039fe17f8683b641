"""One generation request's way through the engine, shared by every endpoint that generates
(OpenAI's chat and completions, the Responses API, Anthropic's Messages API).

    ask = Ask(...)                               # the request, parsed by its endpoint
    pending = await begin(request, ask, raw)     # joins the engine queue; starts the run if the engine is free
    run = await pending.finish(request)          # not streaming: the ended run (None: the client left)
    return await respond(request, parse, events, answer)     # all of that, as an endpoint does it
    async for event in pending.events(): ...     # streaming: ("queued", position, waiting) | ("piece", text)
                                                 # | ("alive",): nothing new for a while (a long prefill)
                                                 #   | ("refused", HttpError) | ("end", run)
    body = streamed(pending, writer)             # the same as the dialect's writer writes it (the bytes)
    reply = reply_of(ask, run, svc)              # a chat answer read whole: reasoning, content, calls

Each request is one run of the engine (the run API, on the server's loaded engine), waiting its turn
in the engine queue. A refusal before the run starts is a proper status when the engine was free
(the run is started inside `begin`), else an event of the stream. A client that disconnects
cancels its run at the next token, or leaves the queue.

A chat's answer is read by one state machine, engine.text.reply.ReplyParser: `Ask.parser()` makes
it with the request's thinking mode, tools and tool_choice, for the whole text or as it streams.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from starlette.requests import Request

from ds4f.api import MAX_GEN, Ds4fError, ReplyParser, RunConfig, SamplingParams, answer_opening, offered

from .errors import HttpError, json_response
from .feed import END
from .events import client_label, endpoint_of
from .queue import QueueFull, Ticket, product_token
from .request import json_body, refused
from .service import DEFAULTED

QUEUE_LOOK_S = 1.0         # how often a queued streaming request looks at its position
KEEPALIVE_S = 15.0         # a stream that has sent nothing this long (a long prefill) gets a keep-alive
QUEUE_REPEAT_S = 15.0      # and says it again, unchanged (a keep-alive for proxies and clients)


@dataclass
class Ask:
    """One generation request, parsed."""
    kind: str                      # "chat" | "completion"
    fields: dict                   # RunConfig's text fields: messages / text / prompt, thinking, tools, stop...
    gen: int | None                # None: what the context leaves after the prompt (at most --max-tokens)
    gen_param: str                 # what the request called the token limit: max_tokens, max_output_tokens...
    sampling: SamplingParams
    stream: bool
    include_usage: bool = False
    thinking: bool = False
    tools: tuple = ()              # the function schemas offered
    tool_choice: str | None = None
    parallel_calls: bool = True    # False: one call at most (the first)
    names: dict = field(default_factory=dict)   # the run API's parameter names as this request spells them
    endpoint: str = "chat"         # for the counters: chat | responses | messages
    gen_ceiling: bool = False      # gen is a ceiling: at most what the context leaves (Anthropic's max_tokens)

    @property
    def object(self) -> str:
        """What waits in the engine queue (GET /status shows it)."""
        return {"responses": "response", "messages": "message"}.get(
            self.endpoint, "chat.completion" if self.kind == "chat" else "text_completion")

    def parser(self) -> ReplyParser:
        """The answer's reader: reasoning first in thinking mode, calls read when tools are offered
        and tool_choice is not none (else DSML is text), a forced call's opening (in the prompt
        already) read first."""
        begins_in_reasoning, forced = answer_opening(self.thinking, self.tool_choice)
        schemas = offered(self.tools, self.tool_choice)      # the named function alone, none for "none"
        return ReplyParser(begins_in_reasoning, schemas, calls=bool(schemas), prefix=forced)


def run_config(ask: Ask, svc) -> RunConfig:
    gen = ask.gen if ask.gen is not None else svc.options.default_max_tokens or MAX_GEN
    return RunConfig(model=svc.model, preset=svc.preset, gen=gen, fit_gen=ask.gen is None or ask.gen_ceiling, backend=svc.backend,
                     kernel_threads=svc.kernel_threads, io_threads=svc.io_threads,
                     config_path=svc.options.config_path, sampling=ask.sampling, kv_dir=svc.options.kv_dir,
                     reuse_prefix=svc.options.reuse_prefix, spec=svc.options.spec,
                     dump=svc.options.dump or svc.settings.dump.server, **ask.fields)


def ended_badly(run) -> HttpError | None:
    if run.state == "failed":
        return HttpError(500, f"the run failed: {run.error}", code="run_failed", extra={"run_id": run.id})
    if run.state == "cancelled":
        return HttpError(503, "the run was cancelled (an operator cancelled it, or the server is shutting down)",
                         code="cancelled", extra={"run_id": run.id})
    return None


def reply_of(ask: Ask, run, svc):
    """A chat run's answer read whole (engine.text.reply.Reply), counted in the metrics."""
    parser = ask.parser()
    parser.push(run.output_text)
    parser.finish()
    return counted(ask, parser.result, svc)


def counted(ask: Ask, reply, svc):
    """The reply, its calls limited to one when the request asked so, counted in /metrics."""
    if not ask.parallel_calls and len(reply.calls) > 1:
        reply.calls = reply.calls[:1]
        reply.repairs.append("parallel_calls_dropped")
    svc.metrics.tool_reply(ask.endpoint, reply)
    return reply


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


class Pending:
    """A request in the engine queue, or running (see the module docstring)."""

    def __init__(self, svc, ask: Ask, raw: dict, ticket: Ticket) -> None:
        self.svc, self.ask, self.raw, self.ticket = svc, ask, raw, ticket
        self.config = run_config(ask, svc)
        self.waited_from = time.monotonic()
        self.run = self.feed = None
        self._waiting = None       # the feed's next piece, while a keep-alive's timeout runs

    async def _start(self) -> None:
        try:
            # preset, backend and threads as the server's defaults are when the run starts
            self.run, self.feed = await self.svc.start(self.config, self.ticket, DEFAULTED)
        except Ds4fError as exc:
            raise refused(exc, self.raw, self.ask.names) from None

    async def finish(self, request: Request):
        """Not streaming: the run, ended (None: the client went away first, its run cancelled)."""
        svc = self.svc
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            if self.run is None:
                try:
                    if not await _unless_gone(svc.queue.wait(self.ticket), gone):
                        return None
                except QueueFull as exc:
                    raise HttpError(503, exc.message, code=exc.code, headers={"Retry-After": "5"}) from None
                svc.metrics.queue_wait.observe(time.monotonic() - self.waited_from)
                await self._start()
            if not await _unless_gone(self.feed.ended.wait(), gone):
                self.ticket.abandon()
                return None
        except BaseException:
            svc.abandon(self.ticket)
            raise
        finally:
            gone.cancel()
        failure = ended_badly(self.run)
        if failure is not None:
            raise failure
        return self.run

    def _refused_in_stream(self, exc: HttpError) -> HttpError:
        """A refusal after waiting, sent as an event of the stream (its status was 200): logged
        for the watchers of /events here, as the Guard logs the refusals it sees."""
        t = self.ticket
        self.svc.events.log("refused", f"{endpoint_of(t)} request from {client_label(t)}, after waiting in the queue:"
                                       f" {exc.status} {exc.code or ''}: {exc.message}".replace("  ", " "))
        return exc

    def _next_piece(self):
        """The feed's next piece, one wait at a time (a keep-alive's timeout must not lose it)."""
        if self._waiting is None or self._waiting.done():
            self._waiting = asyncio.ensure_future(self.feed.pieces.get())
        return self._waiting

    async def events(self):
        """Streaming: the queue's news while waiting, then the run's text pieces, then its end."""
        svc = self.svc
        if self.run is None:
            shown, shown_at = None, 0.0
            while True:
                pos = svc.queue.position(self.ticket)
                if pos and (pos != shown or time.monotonic() - shown_at >= QUEUE_REPEAT_S):   # news, or a keep-alive
                    shown, shown_at = pos, time.monotonic()
                    yield ("queued", pos, len(svc.queue.waiting))
                try:
                    await asyncio.wait_for(asyncio.shield(self.ticket.granted), QUEUE_LOOK_S)
                    break
                except asyncio.TimeoutError:
                    continue
                except QueueFull as exc:
                    yield ("refused", self._refused_in_stream(HttpError(503, exc.message, code=exc.code)))
                    return
            svc.metrics.queue_wait.observe(time.monotonic() - self.waited_from)
            try:
                await self._start()
            except HttpError as exc:
                yield ("refused", self._refused_in_stream(exc))
                return
        yield ("started", self.run)
        sent = []
        while True:
            try:        # a long prefill sends nothing for minutes: a keep-alive now and then (clients time out)
                piece = await asyncio.wait_for(asyncio.shield(self._next_piece()), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield ("alive",)
                continue
            if piece is END:
                break
            sent.append(piece)
            yield ("piece", piece)
        text, streamed = self.run.output_text, "".join(sent)
        if len(text) > len(streamed) and text.startswith(streamed):   # anything the records did not carry
            yield ("piece", text[len(streamed):])
        yield ("end", self.run)


async def begin(request: Request, ask: Ask, raw: dict) -> Pending:
    """Join the engine queue; start at once when the engine is free (a refusal is then this
    request's status: HttpError)."""
    svc = request.app.state.service
    ticket = Ticket(ask.object, request.client.host if request.client else "-",
                    agent=product_token(request.headers.get("user-agent")))
    pending = Pending(svc, ask, raw, ticket)
    ticket.max_tokens = pending.config.gen
    svc.join(ticket)
    if ticket.granted.done():
        svc.metrics.queue_wait.observe(0.0)
        await pending._start()
    return pending


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


def stream(pending: Pending, body) -> EventStream:
    """The SSE answer of `body`, an async generator of bytes (the endpoint's reading of pending.events())."""
    return EventStream(body, pending.svc.abandon_factory(pending.ticket))


def queue_comment(position: int, waiting: int) -> bytes:
    """An SSE comment for a streaming request waiting its turn (OpenAI's and the Responses API's)."""
    return f": queued, position {position} of {waiting}\n\n".encode()


WORKING = b": working\n\n"       # an SSE comment while a long prefill sends nothing


class SseWaits:
    """What an OpenAI dialect's stream writer (`streamed`'s writer) sends while nothing else goes:
    a comment with the request's place in the queue, and one that says the work goes on."""

    @staticmethod
    def waiting(position: int, waiting: int) -> list[bytes]:
        return [queue_comment(position, waiting)]

    @staticmethod
    def alive() -> list[bytes]:
        return [WORKING]


async def streamed(pending: Pending, writer):
    """The bytes of a streamed answer: the pending request's events, the text read by the reply
    parser as it comes (a chat's; a completion's pieces go as they are), each turned into bytes by
    the dialect's writer, which has one method per moment: waiting(position, waiting), alive(),
    refused(error) (the end), start(run), feed(events), then failed(error) or end(run, reply)."""
    ask, svc = pending.ask, pending.svc
    parser = ask.parser() if ask.kind == "chat" else None
    async for event in pending.events():
        if event[0] == "queued":
            out = writer.waiting(event[1], event[2])
        elif event[0] == "alive":
            out = writer.alive()
        elif event[0] == "refused":
            for chunk in writer.refused(event[1]):
                yield chunk
            return
        elif event[0] == "started":
            out = writer.start(event[1])
        elif event[0] == "piece":
            out = writer.feed(parser.push(event[1]) if parser is not None else [event[1]])
        else:
            run = event[1]
            for chunk in writer.feed(parser.finish() if parser is not None else []):
                yield chunk
            failure = ended_badly(run)
            out = writer.failed(failure) if failure is not None else \
                writer.end(run, counted(ask, parser.result, svc) if parser is not None else None)
        for chunk in out:
            yield chunk


async def NO_ANSWER(scope, receive, send) -> None:
    """The answer to a client that is gone: nothing (the access log says `-`)."""


async def respond(request: Request, parse, events, answer):
    """A generating endpoint's whole way: its JSON body read and parsed (parse(raw) -> Ask), the run
    begun, then its SSE stream (events(pending): an async generator of bytes) or, once the run
    ended, its JSON answer (answer(ask, run, raw) -> dict); nothing for a client that left."""
    raw = await json_body(request, "request parameters")
    ask = parse(raw)
    pending = await begin(request, ask, raw)
    if ask.stream:
        return stream(pending, events(pending))
    run = await pending.finish(request)
    if run is None:
        return NO_ANSWER
    return json_response(200, answer(ask, run, raw))
