"""GET /events: a Server-Sent Events stream for watchers (the operator's console), and the
server's log of what happens to requests.

    GET /events?interval=1.0        seconds between snapshots, 0.2 to 10 (default 1)

Events, each `event: NAME` and one `data:` line of JSON:

    hello      once, first: {"server": "ds4f", "version", "model" (the model's id, as /v1/models
               lists it), "served_model_names", "events_version": 1}
    log        the last 200 log events first (oldest first), then each as it happens:
               {"time" (Unix seconds), "kind", "message", "run_id"? (when it concerns a run),
               "who"? (an operator's action: "operator@ADDRESS")}
    snapshot   right after the log, then every interval: GET /status's JSON, plus "sequences" (one
               object per live sequence, running or waiting) and "latency" (the last hour)
    dropped    the watcher fell `watcher_queue` (256) events behind: the last event, then the
               stream ends (if even that cannot be sent, the connection is closed)

Log kinds: `queued` (a request waits for the engine), `request` (its run started), `done`,
`cancelled`, `failed` (a run ended; `cancelled` also for a queued request whose client left),
`refused` (an answer 4xx or 503: the method, path, client, status and why), `kept_state` (the
prefix cache refused a kept-state file: damaged, foreign, gone; or keeps its states in RAM only:
its directory cannot be written, the day's write budget is spent), `operator` (an operator's action,
with `who`), `preset` (a preset change that waited for the engine to be idle took effect),
`drain` (a drain finished: nothing runs or waits), `watcher` (a watcher dropped), `shutdown`.

A sequence: {"run_id" (null while waiting), "endpoint" (chat | responses | messages | completions
| runs), "client" ("ADDRESS PRODUCT", the User-Agent's first product token after the address;
the address alone without one), "state" (waiting | prefill | decode), "prompt_tokens" (null while
waiting), "prompt_tokens_reused", "prompt_tokens_done" (reused ones included), "prefill_eta_s"
(null when unknown; 0 once decoding), "tokens" (generated so far), "max_tokens", "decode_tok_s"
(its generated tokens per second; null before two), "spec_acceptance" (drafts kept over proposed;
null without speculation), "batch_share" (its share of the rows the sequences stepping together
computed lately: its rows per second over all of theirs, 0..1; null while it steps alone),
"started_at" (Unix seconds the request arrived)}.

Latency, over the requests that ended in the last hour (seconds; null without data):
{"ttft_p50", "ttft_p90", "ttft_p99" (arrival to the first generated token, the wait in the queue
included), "itl_p50", "itl_p90", "itl_p99" (between consecutive generated tokens, from the last
hour's gaps, at most 65,536 of them), "prefill_share_of_waiting" (of the time to first token, the
share after the request got the engine: engine load and prefill, the rest being the queue),
"requests" (the requests that ended in the last hour, at most 4,096 kept)}.

A slow watcher never slows the server: each has its own bounded queue of encoded events; the
server only appends to it. One that falls behind is dropped, and at most `max_watchers` (16)
watch at once (more get 503). Reading /events needs what every endpoint needs (the API token when
one is set), nothing more.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import deque

import numpy as np
from starlette.requests import Request


from .errors import HttpError, bad, json_bytes
from .protocol import ABORT_KEY     # scope["state"][ABORT_KEY]: cuts the connection
from .request import parse_query

EVENTS_VERSION = 1
RECENT_LOG = 200            # log events kept for a new watcher
TICK_S = 0.1                # the snapshots' clock: a watcher's interval is rounded up to it
MIN_INTERVAL_S, MAX_INTERVAL_S, DEFAULT_INTERVAL_S = 0.2, 10.0, 1.0
DROP_SEND_S = 1.0           # the time `event: dropped` may take to go out before the connection is cut
LATENCY_WINDOW_S = 3600.0
LATENCY_GAPS = 65536        # inter-token gaps kept (the last hour's, at most these)
LATENCY_REQUESTS = 4096     # ended requests kept (likewise)
RATE_WINDOW = 32            # a sequence's last records, for its share of the batch

ENDPOINTS = {"run": "runs", "chat.completion": "chat", "text_completion": "completions", "response": "responses",
             "message": "messages"}


def client_label(ticket) -> str:
    return f"{ticket.client} {ticket.agent}" if ticket.agent else ticket.client


def endpoint_of(ticket) -> str:
    return ENDPOINTS.get(ticket.kind, ticket.kind)


# -- one request's times, and the last hour's ------------------------------------------------------
class Timing:
    """One request's times (time.monotonic()), from its arrival to its last token."""

    def __init__(self, arrived: float):
        self.arrived = arrived
        self.arrived_at = time.time() - (time.monotonic() - arrived)   # Unix time of the arrival
        self.granted: float | None = None       # it got the engine: its run starts
        self.first: float | None = None         # its first generated token
        self.last: float | None = None          # its last generated token so far
        self.generated = 0                      # generated tokens seen
        self.prompt_first: float | None = None  # its first and last prompt records, and how many
        self.prompt_last: float | None = None
        self.prompt_n = 0
        self.recent: deque[float] = deque(maxlen=RATE_WINDOW)   # its last records' times (any phase)

    def record(self, generated: bool, t: float) -> float | None:
        """One token record at t; the gap since the previous generated token, if this one is
        generated and not the first."""
        self.recent.append(t)
        if not generated:
            if self.prompt_first is None:
                self.prompt_first = t
            self.prompt_last, self.prompt_n = t, self.prompt_n + 1
            return None
        gap = None if self.last is None else max(0.0, t - self.last)
        if self.first is None:
            self.first = t
        self.last, self.generated = t, self.generated + 1
        return gap

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else max(0.0, self.first - self.arrived)

    @property
    def after_grant(self) -> float | None:
        """Of the time to first token, what came after it got the engine (load and prefill)."""
        if self.first is None or self.granted is None:
            return None
        return max(0.0, self.first - max(self.granted, self.arrived))

    @property
    def decode_tok_s(self) -> float | None:
        if self.generated < 2 or self.last is None or self.last <= self.first:
            return None
        return (self.generated - 1) / (self.last - self.first)

    @property
    def prefill_tok_s(self) -> float | None:
        if self.prompt_n < 2 or self.prompt_last <= self.prompt_first:
            return None
        return (self.prompt_n - 1) / (self.prompt_last - self.prompt_first)

    def rows_per_s(self, now: float, horizon: float = 5.0) -> float | None:
        """Its records per second lately (the last RATE_WINDOW within `horizon` seconds)."""
        times = [t for t in self.recent if now - t <= horizon]
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (now - times[0])


def _percentiles(values: np.ndarray) -> tuple:
    if values.size == 0:
        return None, None, None
    return tuple(float(v) for v in np.percentile(values, (50, 90, 99)))


class Latency:
    """The last hour's time to first token and inter-token latency, in bounded rings."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S, gaps: int = LATENCY_GAPS,
                 requests: int = LATENCY_REQUESTS):
        self.window_s = window_s
        self._gap_t = np.zeros(gaps)
        self._gap_v = np.zeros(gaps)
        self._gaps = 0                      # gaps written in all (the ring's next slot: _gaps % size)
        self._requests: deque[tuple[float, float | None, float | None]] = deque(maxlen=requests)

    def gap(self, t: float, seconds: float) -> None:
        i = self._gaps % self._gap_t.size
        self._gap_t[i], self._gap_v[i] = t, seconds
        self._gaps += 1

    def request(self, ended: float, timing: Timing) -> None:
        ttft = timing.ttft
        self._requests.append((ended, ttft, timing.after_grant if ttft is not None else None))

    def figures(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        since = now - self.window_s
        recent = [r for r in self._requests if r[0] >= since]
        ttfts = np.array([r[1] for r in recent if r[1] is not None], dtype=float)
        n = min(self._gaps, self._gap_t.size)
        gaps = self._gap_v[:n][self._gap_t[:n] >= since]
        waited = sum(r[1] for r in recent if r[1] is not None and r[2] is not None)
        after = sum(r[2] for r in recent if r[1] is not None and r[2] is not None)
        t50, t90, t99 = _percentiles(ttfts)
        i50, i90, i99 = _percentiles(gaps)
        return {"ttft_p50": t50, "ttft_p90": t90, "ttft_p99": t99, "itl_p50": i50, "itl_p90": i90, "itl_p99": i99,
                "prefill_share_of_waiting": min(1.0, after / waited) if waited > 0 else None,
                "requests": len(recent)}


def sequence_view(ticket, now: float) -> tuple[dict, float | None] | None:
    """One live sequence (see the module docstring) and its rows per second lately (None: not
    stepping with others, or unknown); None once its run has ended. Its batch_share is left to
    sequences(), which knows the others'."""
    timing = ticket.timing
    run = ticket.run
    view = {"run_id": None, "endpoint": endpoint_of(ticket), "client": client_label(ticket), "state": "waiting",
            "prompt_tokens": None, "prompt_tokens_reused": 0, "prompt_tokens_done": 0, "prefill_eta_s": None,
            "tokens": 0, "max_tokens": ticket.max_tokens, "decode_tok_s": None, "spec_acceptance": None,
            "batch_share": None, "started_at": timing.arrived_at if timing is not None else None}
    if run is None:
        return view, None
    snap = run.snapshot()
    if run.finished or snap.state not in ("starting", "running"):
        return None
    prompt = snap.prompt_tokens
    decoding = snap.phase == "decode"
    done = prompt if decoding else min(snap.tokens_done, max(0, prompt - 1))
    rate = snap.prefill_tokens_per_s or (timing.prefill_tok_s if timing is not None else None)
    eta = 0.0 if decoding else ((prompt - done) / rate if rate else None)
    view.update(run_id=run.id, state="decode" if decoding else "prefill", prompt_tokens=prompt,
                prompt_tokens_reused=snap.prompt_tokens_reused, prompt_tokens_done=done, prefill_eta_s=eta,
                tokens=snap.generated_tokens, max_tokens=run.config.gen,
                decode_tok_s=timing.decode_tok_s if timing is not None else None,
                spec_acceptance=snap.spec_acceptance if snap.spec_mode != "off" else None)
    together = snap.batch_sequences > 1 and timing is not None
    return view, timing.rows_per_s(now) if together else None


def sequences(tickets, now: float) -> list[dict]:
    """The live sequences of these tickets; each stepping with others gets its share of the rows
    all of them computed lately (its rows per second over theirs)."""
    seen = [v for v in (sequence_view(t, now) for t in tickets) if v is not None]
    rates = [rate for _, rate in seen if rate]
    total = sum(rates)
    for view, rate in seen:
        if rate and len(rates) > 1 and total > 0:
            view["batch_share"] = rate / total
    return [view for view, _ in seen]


# -- watchers ---------------------------------------------------------------------------------------
def sse_event(name: str, obj) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json_bytes(obj).rstrip(b"\n") + b"\n\n"


class Watcher:
    """One GET /events stream: its queue of encoded events, bounded; the hub only appends."""

    def __init__(self, hub: "EventHub", client: str, interval: float, abort=None):
        self.hub, self.client, self.interval, self.abort = hub, client, interval, abort
        self.first: deque[bytes] = deque()   # hello and the recent log: sent first, outside the bound
        self.items: deque[bytes] = deque()   # what came since, at most hub.queue_size
        self.wake = asyncio.Event()
        self.killed = asyncio.Event()   # dropped while a send was stuck: cut the connection
        self.dropped = False
        self.closed = False             # the server is stopping: end the stream
        self.in_send = False
        self.next_due = 0.0

    def offer(self, data: bytes) -> None:
        if self.dropped or self.closed:
            return
        if len(self.items) >= self.hub.queue_size:
            self._drop()
            return
        self.items.append(data)
        self.wake.set()

    def _drop(self) -> None:
        self.dropped = True
        self.first.clear()
        self.items.clear()
        self.wake.set()
        self.hub.dropped += 1
        self.hub.log("watcher", f"a watcher of /events from {self.client} fell {self.hub.queue_size} events behind"
                                f" and was disconnected")
        if self.in_send:
            self.killed.set()
            if self.abort is not None:
                self.abort()

    def close(self) -> None:
        self.closed = True
        self.wake.set()


class EventHub:
    """The log (the last RECENT_LOG events kept), the watchers and their snapshots, the latency
    rings. Its methods run in the server's event loop, except log(), which any thread may call."""

    def __init__(self, snapshot, hello, queue_size: int = 256, max_watchers: int = 16):
        self.snapshot = snapshot        # () -> the snapshot's dict
        self.hello = hello              # () -> the hello event's dict
        self.queue_size = queue_size
        self.max_watchers = max_watchers
        self.recent: deque[dict] = deque(maxlen=RECENT_LOG)
        self.watchers: set[Watcher] = set()
        self.latency = Latency()
        self.dropped = 0                # watchers dropped for falling behind
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._ticker: asyncio.Task | None = None
        self._lock = threading.Lock()   # the recent log, before the loop runs

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._loop_thread = threading.get_ident()

    # -- the log ----------------------------------------------------------------------------------
    def log(self, kind: str, message: str, run_id: str | None = None, who: str | None = None) -> None:
        """A log event, from any thread: kept among the recent ones and sent to every watcher."""
        event = {"time": time.time(), "kind": kind, "message": message}
        if run_id:
            event["run_id"] = run_id
        if who:
            event["who"] = who
        loop = self.loop
        if loop is None or threading.get_ident() == self._loop_thread:
            self._publish(event)
            return
        try:
            loop.call_soon_threadsafe(self._publish, event)
        except RuntimeError:    # the loop is closed: keep it for the record
            with self._lock:
                self.recent.append(event)

    def _publish(self, event: dict) -> None:
        with self._lock:
            self.recent.append(event)
        if self.watchers:
            data = sse_event("log", event)
            for w in list(self.watchers):
                w.offer(data)

    # -- watchers ---------------------------------------------------------------------------------
    def add(self, client: str, interval: float, abort=None) -> Watcher:
        if len(self.watchers) >= self.max_watchers:
            raise HttpError(503, f"too many watchers: {len(self.watchers)} streams of /events are open (at most "
                                 f"{self.max_watchers})", code="too_many_watchers", headers={"Retry-After": "5"})
        w = Watcher(self, client, interval, abort)
        w.first.append(sse_event("hello", self.hello()))
        with self._lock:
            recent = list(self.recent)
        w.first.extend(sse_event("log", e) for e in recent)
        w.wake.set()
        self.watchers.add(w)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())
        return w

    def remove(self, w: Watcher) -> None:
        self.watchers.discard(w)

    async def _tick(self) -> None:
        """Every TICK_S while anyone watches: a snapshot to each watcher whose interval is up
        (made once for all of them)."""
        loop = asyncio.get_running_loop()
        while self.watchers:
            now = loop.time()
            due = [w for w in self.watchers if w.next_due <= now and not w.dropped and not w.closed]
            if due:
                try:
                    data = sse_event("snapshot", self.snapshot())
                except Exception as exc:   # a bug: said once per tick, never the end of the stream
                    data = sse_event("log", {"time": time.time(), "kind": "error",
                                             "message": f"snapshot: {type(exc).__name__}: {exc}"})
                for w in due:
                    w.next_due = now + w.interval
                    w.offer(data)
            await asyncio.sleep(TICK_S)

    def close(self) -> None:
        """The server stops: every stream ends."""
        for w in list(self.watchers):
            w.close()

    def view(self) -> dict:
        return {"watchers": len(self.watchers), "max_watchers": self.max_watchers, "dropped": self.dropped}


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class WatchStream:
    """The answer of GET /events (an ASGI app): the watcher's events as they come."""

    def __init__(self, hub: EventHub, watcher: Watcher):
        self.hub, self.watcher = hub, watcher

    async def __call__(self, scope, receive, send) -> None:
        w = self.watcher
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            gone = asyncio.ensure_future(_disconnected(receive))
            try:
                await self._pump(send, gone)
            finally:
                gone.cancel()
        finally:
            self.hub.remove(w)

    async def _pump(self, send, gone: asyncio.Future) -> None:
        w = self.watcher
        while True:
            if not w.first and not w.items and not w.dropped and not w.closed:
                w.wake.clear()
                waker = asyncio.ensure_future(w.wake.wait())
                await asyncio.wait({waker, gone}, return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
            if gone.done():
                return
            if w.dropped:
                await self._last(send, sse_event("dropped", {
                    "message": f"this watcher fell {self.hub.queue_size} events behind and is disconnected"}))
                return
            if w.closed and not w.items:
                await self._last(send, b"")
                return
            if not w.first and not w.items:
                continue
            data = w.first.popleft() if w.first else w.items.popleft()
            if not await self._send(send, {"type": "http.response.body", "body": data, "more_body": True}, gone):
                return

    async def _send(self, send, message: dict, gone: asyncio.Future) -> bool:
        """Send, unless the client goes or the watcher is dropped first; whether it went."""
        w = self.watcher
        w.in_send = True
        task = asyncio.ensure_future(send(message))
        killed = asyncio.ensure_future(w.killed.wait())
        try:
            await asyncio.wait({task, gone, killed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            w.in_send = False
            killed.cancel()
        if task.done():
            task.result()
            return not w.killed.is_set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if w.abort is not None:
            w.abort()
        return False

    async def _last(self, send, data: bytes) -> None:
        """The stream's last bytes and its end, within DROP_SEND_S; else the connection is cut."""
        w = self.watcher
        try:
            await asyncio.wait_for(send({"type": "http.response.body", "body": data, "more_body": False}),
                                   DROP_SEND_S)
        except asyncio.TimeoutError:
            if w.abort is not None:
                w.abort()


def parse_interval(query: dict) -> float:
    unknown = [k for k in query if k != "interval"]
    if unknown:
        raise bad(unknown[0], "unknown parameter (known: interval)", code="unknown_parameter")
    if "interval" not in query:
        return DEFAULT_INTERVAL_S
    raw = query["interval"]
    try:
        value = float(raw)
    except ValueError:
        raise bad("interval", f"expected seconds between snapshots, got {raw!r}") from None
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:   # (also false for NaN)
        raise bad("interval", f"must be between {MIN_INTERVAL_S:g} and {MAX_INTERVAL_S:g} seconds, got {raw}")
    return value


async def events(request: Request):
    """GET /events: the watcher's stream (see the module docstring)."""
    interval = parse_interval(parse_query(request.scope.get("query_string", b"").decode("latin-1")))
    svc = request.app.state.service
    if svc.closing:
        raise HttpError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
    client = request.client.host if request.client else "-"
    abort = (request.scope.get("state") or {}).get(ABORT_KEY)
    if request.method == "HEAD":
        return _HeadAnswer()
    watcher = svc.events.add(client, interval, abort)
    return WatchStream(svc.events, watcher)


class _HeadAnswer:
    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def log_line(message: str) -> str:
    """A run's event line without its clock ("12:00:01 prefix cache: ..." -> "prefix cache: ...")."""
    head, _, rest = message.partition(" ")
    return rest if len(head) == 8 and head.count(":") == 2 else message


def kept_state_refusal(line: str) -> bool:
    """A run's event line saying the prefix cache refused a kept state's file, or keeps its states
    in RAM only (its directory cannot be written: a file where it should be; the day's write budget)."""
    return line.startswith("prefix cache:") and ("not used" in line or "gone (" in line or "in RAM only" in line)


def error_of(body: bytes) -> tuple[str | None, str | None]:
    """(code, message) of an error answer's JSON (OpenAI's shape or Anthropic's); Nones if not."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None, None
    if not isinstance(err, dict):
        return None, None
    return err.get("code") or err.get("type"), err.get("message")
