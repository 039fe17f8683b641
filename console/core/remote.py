"""A running `ds4f serve` seen from the console: its event stream, its latest figures, the
operator's calls. No Textual here.

    link = ServerLink("http://127.0.0.1:8734", interval=1.0)
    link.start()                  # reads GET /events in a thread of its own, reconnecting
    view = link.view()            # the latest figures: cheap, never blocks (the UI's timer reads it)
    link.log_after(seq)           # the event log's entries after `seq`
    link.operator("backend", {"backend": "scalar"})   # POST /operator/backend off the caller's thread
    link.close()

The stream (`GET /events?interval=S`, server-sent events) says `hello` once, then the server's
last log events, then a `snapshot` every interval: the JSON of GET /status with the live
sequences and the latency percentiles. A stream that ends, stays silent past its read timeout,
or is dropped by the server as too slow a reader (`dropped`) is reconnected with backoff. The
dashboard's run panels need a Snapshot: the run the link follows (the
operator's pick among the sequences, else the most active one) is rebuilt from its live view
(GET /runs/{id}, or the status's own `run` when it is that one), its last few token records
gathered across polls into a history.

What the link says of its connection (Connection.state): connecting, live, lost (it was live:
since when, and when it retries), refused (nothing answers: a closed port, an unreachable host;
retried by itself), and three it does not retry by itself: not a ds4f server, an older ds4f
server without /events, a server that refuses this console (401/403).

Operator calls carry the operator token (X-Ds4f-Operator-Token, and Authorization unless the
server's API token takes it): the one given (--operator-token), else the file the server names in
GET /status (`operator.token_file`) when the server is on this machine and the file is readable.
Each call is a short request on a thread of its own; its answer goes to the event log.
"""
from __future__ import annotations

import collections
import dataclasses
import http.client
import ipaddress
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit

from ds4f.api import Ds4fError, Snapshot, TokenRecord, read_regular

DEFAULT_PORT = 8734          # ds4f serve's
EVENTS_VERSION = 1           # the event stream's version this console reads
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 10.0)   # waits before the 1st, 2nd, ... retry after a failure
CONNECT_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 8.0         # an operator call (a cancel waits up to 5 s for the run), a poll of a run
MIN_READ_TIMEOUT_S = 10.0    # the stream is lost after this long without an event (or 3 intervals)
INTERVAL_S = (0.2, 10.0)     # the snapshots' period the server takes (GET /events?interval=)
KEEP_LOG = 500               # entries of the event log the link keeps
KEEP_TOKENS = 256            # token records of the followed run (as TokenLog.RECENT)
OPERATOR_ACTIONS = ("backend", "threads", "preset", "cancel", "drain", "resume")

# Connection.state
CONNECTING, LIVE, LOST, REFUSED = "connecting", "live", "lost", "refused"
NOT_DS4F, OLD_SERVER, UNAUTHORIZED = "not_ds4f", "old_server", "unauthorized"
STOPPED = {NOT_DS4F, OLD_SERVER, UNAUTHORIZED}      # not retried until the operator asks (r)
PROBLEMS = STOPPED | {REFUSED}                        # never reached: the error screen says why


# -- addresses ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Address:
    scheme: str      # http | https
    host: str
    port: int
    base: str        # a path prefix ('' for none), no trailing slash

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.base}"

    @property
    def short(self) -> str:
        """host:port, for a tab or a status line."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}{self.base}"

    @property
    def local(self) -> bool:
        """The server is on this machine (a loopback address), so a file it names is ours to read."""
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_address(text: str) -> Address:
    """`http://host:port`, `https://host`, `host:port` or `host` (port 8734, ds4f serve's, when
    an http URL names none); Ds4fError naming what is wrong."""
    raw = text.strip()
    if not raw:
        raise Ds4fError("--attach: an empty URL")
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise Ds4fError(f"--attach {text}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise Ds4fError(f"--attach {text}: an http:// or https:// URL, got {parts.scheme}://")
    if not parts.hostname:
        raise Ds4fError(f"--attach {text}: no host in the URL")
    if parts.username is not None or parts.query or parts.fragment:
        raise Ds4fError(f"--attach {text}: give the server's address alone (scheme, host, port)")
    if port is None:
        port = DEFAULT_PORT if parts.scheme == "http" else 443
    return Address(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


# -- what the link knows ----------------------------------------------------------------------
@dataclass(frozen=True)
class Connection:
    """Where the link stands with its server."""

    state: str                       # CONNECTING, LIVE, LOST, REFUSED, NOT_DS4F, OLD_SERVER, UNAUTHORIZED
    since: float                     # time.time() it came to this state (for LOST: when the stream broke)
    detail: str = ""                 # what went wrong, in words
    retry_at: float | None = None    # time.monotonic() of the next attempt (None: trying now, or not at all)
    attempts: int = 0                # failed attempts since the stream was last live
    ever_live: bool = False

    @property
    def live(self) -> bool:
        return self.state == LIVE

    @property
    def problem(self) -> bool:
        """Never reached, or reached and not usable: the error screen's case."""
        return self.state in PROBLEMS

    def retry_in(self, now: float | None = None) -> float | None:
        if self.retry_at is None:
            return None
        return max(0.0, self.retry_at - (time.monotonic() if now is None else now))

    def text(self, now: float | None = None) -> str:
        """One line: 'live', 'connection lost since 10:15:03 (the server closed the stream) · retrying
        in 4 s', 'nothing answers (connection refused) · retrying in 2 s', 'not a ds4f server: ...'."""
        wait = self.retry_in(now)
        retry = "" if self.state in STOPPED else (" · reconnecting…" if wait is None else f" · retrying in {wait:.0f} s")
        if self.state == LIVE:
            return "live"
        if self.state == CONNECTING:
            return "connecting…"
        if self.state == LOST:
            why = f" ({self.detail})" if self.detail else ""
            return f"connection lost since {time.strftime('%H:%M:%S', time.localtime(self.since))}{why}{retry}"
        if self.state == REFUSED:
            return f"nothing answers: {self.detail or 'no connection'}{retry}"
        if self.state == NOT_DS4F:
            return f"not a ds4f server: {self.detail}"
        if self.state == OLD_SERVER:
            return f"an older ds4f server, without /events: {self.detail}"
        return f"the server refuses this console: {self.detail}"


@dataclass(frozen=True)
class LogEntry:
    seq: int                   # the link's own count, for log_after
    time: float | str | None   # the server's time of the event (a number: seconds since the epoch)
    kind: str                  # the server's kind of event; "console" for the link's own lines
    message: str
    run_id: str | None = None
    who: str | None = None

    @property
    def console(self) -> bool:
        return self.kind in ("console", "operator-call", "connection")

    def clock(self) -> str:
        """HH:MM:SS of the entry (local time)."""
        t = self.time
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            return time.strftime("%H:%M:%S", time.localtime(t))
        if isinstance(t, str) and t:
            tail = t.split("T")[-1] if "T" in t else t.split(" ")[-1]
            return tail[:8]
        return "--:--:--"


@dataclass(frozen=True)
class ServerView:
    """All the UI needs of one server at one moment (immutable: the timer takes it, the link goes on)."""

    address: Address
    connection: Connection
    hello: dict | None = None        # the stream's hello: server, version, model, served_model_names
    status: dict | None = None       # the last snapshot: GET /status's JSON
    sequences: tuple = ()            # its live sequences (dicts), as the server lists them
    latency: dict | None = None      # its latency percentiles
    updated_at: float | None = None  # time.time() the last snapshot came
    followed: str | None = None      # the run the run panels show
    snapshot: Snapshot | None = None  # that run's figures, rebuilt
    selected: str | None = None      # the operator's pick among the sequences (None: the most active)
    token_known: bool = False        # an operator token is at hand
    calls: int = 0                   # operator calls answered (or failed) so far

    @property
    def url(self) -> str:
        return self.address.url


# -- the Snapshot from a live view ------------------------------------------------------------------
def _fallback(annotation: str):
    """A value for a Snapshot field an older server leaves out, from its annotation."""
    a = str(annotation)
    if "None" in a:
        return None
    if a.startswith("tuple"):
        return ()
    if a.startswith("dict"):
        return {}
    return {"int": 0, "float": 0.0, "str": "", "bool": False}.get(a.split("|")[0].strip(), None)


_SNAPSHOT_FIELDS = {f.name: f for f in dataclasses.fields(Snapshot)}
_TOKEN_FIELDS = {f.name: f for f in dataclasses.fields(TokenRecord)}


def _tupled(value):
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


def token_record(d: dict) -> TokenRecord | None:
    """A TokenRecord from its JSON (None if it is not one)."""
    if not isinstance(d, dict):
        return None
    kw = {}
    for name, f in _TOKEN_FIELDS.items():
        if name in d:
            kw[name] = d[name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            fb = _fallback(f.type)
            kw[name] = fb if fb is not None else 0
    try:
        return TokenRecord(**kw)
    except TypeError:
        return None


def snapshot_from_view(live: dict, tokens: tuple[TokenRecord, ...] | None = None) -> Snapshot:
    """The Snapshot a server's live view holds (GET /runs/{id} `live`, GET /status `run`: the
    Snapshot as a dict without its per-token list). `tokens`: the token history gathered so far
    (else the view's `recent_tokens`). Fields the server does not send take their defaults, and
    fields it sends that this console does not know are left out."""
    kw = {}
    for name, f in _SNAPSHOT_FIELDS.items():
        if name == "tokens":
            continue
        if name in live:
            value = live[name]
            kw[name] = dict(value) if isinstance(value, dict) else _tupled(value)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw[name] = _fallback(f.type)
    if tokens is None:
        tokens = tuple(t for t in (token_record(d) for d in live.get("recent_tokens") or ()) if t is not None)
    kw["tokens"] = tuple(tokens)
    if not isinstance(kw.get("events"), tuple):
        kw["events"] = ()
    kw["events"] = tuple(str(e) for e in kw["events"])
    return Snapshot(**kw)


class TokenHistory:
    """A run's token records gathered across polls (each poll gives the last few), by index, the
    last KEEP_TOKENS kept; a poll that skipped some leaves a gap, not a wrong order."""

    def __init__(self, keep: int = KEEP_TOKENS) -> None:
        self.keep = keep
        self.run_id: str | None = None
        self._by_index: dict[int, TokenRecord] = {}

    def add(self, run_id: str, records) -> tuple[TokenRecord, ...]:
        if run_id != self.run_id:
            self.run_id, self._by_index = run_id, {}
        for d in records or ():
            t = d if isinstance(d, TokenRecord) else token_record(d)
            if t is not None:
                self._by_index[t.index] = t
        if len(self._by_index) > self.keep:
            for i in sorted(self._by_index)[:len(self._by_index) - self.keep]:
                del self._by_index[i]
        return tuple(self._by_index[i] for i in sorted(self._by_index))


# -- which run the panels follow, and what the operator's keys ask --------------------------------------
PHASE_RANK = {"decode": 2, "prefill": 1, "waiting": 0}


def most_active(sequences) -> str | None:
    """The run the panels follow when the operator picked none: a decoding sequence before one
    in prefill before one waiting, then the fastest, then the newest."""
    best, key = None, None
    for s in sequences:
        run_id = s.get("run_id")
        if not run_id:
            continue
        k = (PHASE_RANK.get(s.get("state"), -1), s.get("decode_tok_s") or 0.0, s.get("started_at") or 0.0)
        if key is None or k > key:
            best, key = run_id, k
    return best


def server_settings(status: dict | None) -> dict:
    """What the server's next requests get: preset, backend, kernel and I/O threads, and whether
    it drains (None where the status does not say)."""
    status = status or {}
    settings = status.get("settings") if isinstance(status.get("settings"), dict) else {}
    operator = status.get("operator") if isinstance(status.get("operator"), dict) else {}
    backend = status.get("backend") if isinstance(status.get("backend"), dict) else {}
    threads = status.get("threads") if isinstance(status.get("threads"), dict) else {}
    preset = status.get("preset") if isinstance(status.get("preset"), dict) else {}
    run = status.get("run") if isinstance(status.get("run"), dict) else {}
    server = status.get("server") if isinstance(status.get("server"), dict) else {}

    def first(*values):
        return next((v for v in values if v is not None), None)

    chosen = first(settings.get("backend"), operator.get("backend"), backend.get("current"), backend.get("default"))
    if chosen in (None, "auto"):
        chosen = first(backend.get("best"), run.get("backend"), chosen)
    return {
        "preset": first(settings.get("preset"), operator.get("preset"), preset.get("name")),
        "backend": chosen,
        "pending_preset": preset.get("pending"),
        "kernel_threads": first(settings.get("kernel_threads"), threads.get("kernel_threads"),
                                run.get("kernel_threads")),
        "io_threads": first(settings.get("io_threads"), threads.get("io_threads"), run.get("io_threads")),
        "draining": bool(first(settings.get("draining"), operator.get("draining"), server.get("draining"),
                               status.get("draining"), False)),
    }


def backend_toggle(view: ServerView) -> tuple[dict, str]:
    """The body of POST /operator/backend for the k key (SIMD <-> scalar) and its note; Ds4fError
    when the server has no SIMD backend."""
    status = view.status or {}
    current = (view.snapshot.backend if view.snapshot is not None and view.snapshot.state in ("starting", "running")
               else server_settings(status)["backend"])
    backends = status.get("backend") if isinstance(status.get("backend"), dict) else {}
    if current == "scalar":
        target = backends.get("best")
        if not target or target == "scalar":
            available = ", ".join(backends.get("available") or ()) or "scalar"
            raise Ds4fError(f"the server has no SIMD backend (available: {available})")
    else:
        target = "scalar"
    return {"backend": target}, f"kernels {current or '?'} → {target}"


def threads_step(view: ServerView, kernel: int = 0, io: int = 0) -> tuple[dict, str]:
    """The body of POST /operator/threads for { } (kernel) and [ ] (I/O) and its note."""
    status = view.status or {}
    s = server_settings(status)
    limits = status.get("limits") if isinstance(status.get("limits"), dict) else {}
    cap = limits.get("max_threads") or 256
    body, notes = {}, []
    for key, delta, what in (("kernel_threads", kernel, "kernel threads"), ("io_threads", io, "I/O threads")):
        if not delta:
            continue
        current = s[key]
        if current is None:
            raise Ds4fError(f"the server does not say its {what} yet (they show once a request has run)")
        n = max(1, min(cap, int(current) + delta))
        body[key] = n
        notes.append(f"{what} {current} → {n}")
    return body, " · ".join(notes)


def next_preset(view: ServerView) -> tuple[dict, str]:
    """The body of POST /operator/preset for the p key (the server's next preset) and its note."""
    status = view.status or {}
    preset = status.get("preset") if isinstance(status.get("preset"), dict) else {}
    names = list(preset.get("available") or ())
    if not names:
        raise Ds4fError("the server lists no presets")
    settings = server_settings(status)
    current = settings["pending_preset"] or settings["preset"]
    i = names.index(current) if current in names else -1
    target = names[(i + 1) % len(names)]
    return {"preset": target}, f"preset {current or '?'} → {target} for the next requests"


# -- server-sent events ---------------------------------------------------------------------------
class SseReader:
    """Server-sent events from a file-like response read line by line: (event, data) pairs."""

    def __init__(self, readline) -> None:
        self.readline = readline

    def __iter__(self):
        event, data = "", []
        while True:
            raw = self.readline()
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line:
                if data or event:
                    yield event or "message", "\n".join(data)
                event, data = "", []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


class NotDs4f(Exception):
    """The server answered, and is not a ds4f server (or not one this console can read)."""


class Unauthorized(Exception):
    pass


class OldServer(Exception):
    pass


class Lost(Exception):
    """The stream broke or went silent: retried."""


def _error_message(body: bytes) -> str:
    """An error answer's message (OpenAI's shape), else the start of its body."""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict):
            err = doc.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
            if isinstance(err, str):
                return err
            if doc.get("message"):
                return str(doc["message"])
    except ValueError:
        pass
    text = body.decode("utf-8", "replace").strip()
    return text[:200] if text else "(no body)"


def _reach_problem(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (no server on that port)"
    if isinstance(exc, socket.gaierror):
        return f"the host name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "no answer in time"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the server closed the connection"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return f"{type(exc).__name__}: {exc}"


# -- the link ------------------------------------------------------------------------------------
def _period(seconds: float) -> float:
    low, high = INTERVAL_S
    return max(low, min(high, float(seconds)))


class ServerLink:
    """One server: its event stream read in a thread, its followed run polled in another, the
    operator's calls each on a thread of its own. Everything the UI reads is behind one lock,
    held only to copy."""

    def __init__(self, url: str | Address, *, interval: float = 1.0, operator_token: str | None = None,
                 token: str | None = None, backoff: tuple[float, ...] = BACKOFF_S,
                 connect_timeout: float = CONNECT_TIMEOUT_S, call_timeout: float = CALL_TIMEOUT_S,
                 read_timeout: float | None = None) -> None:
        self.address = url if isinstance(url, Address) else parse_address(url)
        self.interval = _period(interval)
        self.operator_token = operator_token
        self.token = token                      # the server's own bearer token (ds4f serve --token-file)
        self.backoff = tuple(backoff) or (1.0,)
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.read_timeout = read_timeout
        self._lock = threading.Lock()
        self._wake = threading.Event()          # a retry asked for, or closing
        self._poll_wake = threading.Event()
        self._closed = False
        self._restart = False                   # reconnect at once, not as a loss (a new interval, r)
        self._conn: http.client.HTTPConnection | None = None
        self._threads: list[threading.Thread] = []
        self._connection = Connection(CONNECTING, time.time())
        self._hello: dict | None = None
        self._status: dict | None = None
        self._sequences: tuple = ()
        self._latency: dict | None = None
        self._updated_at: float | None = None
        self._selected: str | None = None
        self._followed: str | None = None
        self._snapshot: Snapshot | None = None
        self._history = TokenHistory()
        self._log: collections.deque[LogEntry] = collections.deque(maxlen=KEEP_LOG)
        self._seq = 0
        self._seen: collections.OrderedDict = collections.OrderedDict()   # server entries already logged
        self._calls = 0

    # -- life -----------------------------------------------------------------------------
    def start(self) -> "ServerLink":
        for target, name in ((self._stream_loop, "events"), (self._poll_loop, "poll")):
            t = threading.Thread(target=target, name=f"ds4f-console {name} {self.address.short}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop reading and polling (the threads end soon after: join)."""
        self._closed = True
        self._wake.set()
        self._poll_wake.set()
        self._drop_connection()

    def join(self, timeout: float = 2.0) -> None:
        for t in self._threads:
            t.join(timeout)

    def close(self, timeout: float = 2.0) -> None:
        self.stop()
        self.join(timeout)

    def retry_now(self) -> None:
        """Reconnect at once (r): after a failure, or to a live stream (which restarts)."""
        with self._lock:
            self._restart = True
        self._wake.set()
        self._drop_connection()

    def set_interval(self, seconds: float) -> None:
        """The snapshots' period: the stream restarts with it."""
        seconds = _period(seconds)
        if abs(seconds - self.interval) < 1e-9:
            return
        self.interval = seconds
        if self._connection.live:
            self.retry_now()

    def select(self, run_id: str | None) -> None:
        """The run the panels follow (None: the most active sequence)."""
        with self._lock:
            self._selected = run_id
            self._refollow()
        self._poll_wake.set()

    # -- what the UI reads ------------------------------------------------------------------
    def view(self) -> ServerView:
        with self._lock:
            return ServerView(self.address, self._connection, self._hello, self._status, self._sequences,
                              self._latency, self._updated_at, self._followed, self._snapshot, self._selected,
                              self.operator_token is not None or self._token_file() is not None, self._calls)

    def log_after(self, seq: int) -> list[LogEntry]:
        with self._lock:
            return [e for e in self._log if e.seq > seq]

    @property
    def connection(self) -> Connection:
        return self._connection

    def note(self, message: str, kind: str = "console", run_id: str | None = None) -> None:
        """A line of the console's own in the event log."""
        with self._lock:
            self._add_log(time.time(), kind, message, run_id, None)

    # -- internals: state ---------------------------------------------------------------------
    def _add_log(self, when, kind, message, run_id, who) -> None:
        self._seq += 1
        self._log.append(LogEntry(self._seq, when, kind, message, run_id, who))

    def _set_connection(self, connection: Connection) -> None:
        with self._lock:
            self._connection = connection

    def _drop_connection(self) -> None:
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _http(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.address.scheme == "https" else http.client.HTTPConnection
        return cls(self.address.host, self.address.port, timeout=timeout)

    def _headers(self, extra: dict | None = None) -> dict:
        h = {"User-Agent": "ds4f-console"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        h.update(extra or {})
        return h

    def _get_json(self, path: str, timeout: float | None = None) -> tuple[int, dict | None, bytes]:
        conn = self._http(timeout or self.call_timeout)
        try:
            conn.request("GET", self.address.base + path, headers=self._headers({"Accept": "application/json"}))
            resp = conn.getresponse()
            body = resp.read()
            ctype = resp.getheader("Content-Type", "") or ""
        finally:
            conn.close()
        doc = None
        if ctype.startswith("application/json"):
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
        return resp.status, doc if isinstance(doc, dict) else None, body

    # -- the event stream ---------------------------------------------------------------------
    def _stream_loop(self) -> None:
        while not self._closed:
            with self._lock:
                self._restart = False
            outcome = self._attempt()
            if self._closed:
                return
            with self._lock:
                restart = self._restart
            if restart:
                self._wake.clear()
                continue
            state, detail = outcome
            previous = self._connection
            attempts = previous.attempts + 1
            if state in STOPPED:
                self._set_connection(Connection(state, time.time(), detail, None, attempts, previous.ever_live))
                self.note(f"{self.address.url}: {Connection(state, 0, detail).text()} (r retries)", "connection")
                self._wake.wait()
                self._wake.clear()
                continue
            delay = self.backoff[min(attempts - 1, len(self.backoff) - 1)]
            if previous.ever_live:
                state = LOST
                since = previous.since if previous.state == LOST else time.time()
            else:
                since = previous.since if previous.state == state else time.time()
            if previous.state == LIVE:
                self.note(f"connection lost: {detail}; retrying", "connection")
            self._set_connection(Connection(state, since, detail, time.monotonic() + delay, attempts,
                                            previous.ever_live))
            self._wake.wait(delay)
            self._wake.clear()
            self._set_connection(dataclasses.replace(self._connection, retry_at=None))

    def _attempt(self) -> tuple[str, str]:
        """One connection: until the stream ends, what ended it as (state, detail)."""
        conn = self._http(self.connect_timeout)
        self._conn = conn
        try:
            path = f"{self.address.base}/events?interval={quote(f'{self.interval:g}')}"
            try:
                conn.request("GET", path, headers=self._headers({"Accept": "text/event-stream",
                                                                 "Cache-Control": "no-cache"}))
                resp = conn.getresponse()
            except (http.client.BadStatusLine, http.client.LineTooLong) as exc:
                if isinstance(exc, http.client.RemoteDisconnected):
                    return REFUSED, _reach_problem(exc)
                return NOT_DS4F, f"it does not answer in HTTP ({type(exc).__name__})"
            except (OSError, http.client.HTTPException) as exc:
                return REFUSED, _reach_problem(exc)
            ctype = (resp.getheader("Content-Type", "") or "").split(";")[0].strip().lower()
            if resp.status == 200 and ctype == "text/event-stream":
                return self._read_stream(conn, resp)
            body = resp.read(64 * 1024) if resp.status != 200 else b""
            resp.close()
            if resp.status in (401, 403):
                return UNAUTHORIZED, f"GET /events: {resp.status} {_error_message(body)}" + (
                    "" if self.token or resp.status != 401 else " (its token: ds4f-console --token-file PATH)")
            if resp.status == 503:
                return REFUSED, f"GET /events: 503 {_error_message(body)}"
            return self._not_streaming(resp.status, ctype)
        except Lost as exc:
            return LOST, str(exc)
        except NotDs4f as exc:
            return NOT_DS4F, str(exc)
        except (OSError, http.client.HTTPException) as exc:
            return LOST, _reach_problem(exc)
        finally:
            self._conn = None
            conn.close()

    def _not_streaming(self, status: int, ctype: str) -> tuple[str, str]:
        """GET /events did not stream: what the server says it is (GET /)."""
        try:
            code, about, body = self._get_json("/")
        except (OSError, http.client.HTTPException) as exc:
            return REFUSED, _reach_problem(exc)
        what = f"GET /events: {status}" + (f" ({ctype})" if status == 200 else "")
        if about is None or about.get("name") != "ds4f":
            kind = "JSON" if about is not None else "not JSON"
            return NOT_DS4F, f"{what}; GET /: {code}, {kind}, not ds4f's answer"
        version = about.get("version", "?")
        if status == 404:
            return OLD_SERVER, (f"ds4f {version} has no /events (this console needs a newer ds4f serve; "
                                f"GET /status still answers)")
        return REFUSED, f"{what} from ds4f {version}"

    def _read_stream(self, conn, resp) -> tuple[str, str]:
        timeout = self.read_timeout or max(MIN_READ_TIMEOUT_S, 3 * self.interval)
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        first = True
        try:
            for event, data in SseReader(resp.readline):
                if self._closed:
                    return LOST, "closed"
                try:
                    doc = json.loads(data) if data else {}
                except ValueError:
                    if first:
                        raise NotDs4f(f"its event stream is not ds4f's (the first event is not JSON)") from None
                    continue
                if first:
                    first = False
                    if event != "hello" or not isinstance(doc, dict) or doc.get("server") != "ds4f":
                        raise NotDs4f(f"its event stream does not say hello as ds4f's does (first event: {event!r})")
                    self._on_hello(doc)
                    continue
                if event == "dropped":
                    return LOST, "the server dropped this console as too slow a reader"
                if isinstance(doc, dict):
                    self._on_event(event, doc)
        except (socket.timeout, TimeoutError):
            return LOST, f"no event for {timeout:.0f} s"
        if first:
            raise NotDs4f("its event stream ended before it said hello")
        return LOST, "the server closed the stream"

    def _on_hello(self, doc: dict) -> None:
        previous = self._connection
        with self._lock:
            self._hello = doc
            self._connection = Connection(LIVE, time.time(), "", None, 0, True)
        version = doc.get("events_version")
        names = doc.get("served_model_names") or []
        model = doc.get("model") or (names[0] if names else "?")
        if previous.state == LOST:
            self.note(f"reconnected to {self.address.url} after {time.time() - previous.since:.0f} s", "connection")
        elif not previous.live:
            self.note(f"attached to {self.address.url}: ds4f {doc.get('version', '?')}, model {model}", "connection")
        if isinstance(version, int) and version > EVENTS_VERSION:
            self.note(f"the server's events are version {version}; this console reads version {EVENTS_VERSION} "
                      f"(what it does not know it leaves out)", "connection")

    def _on_event(self, event: str, doc: dict) -> None:
        if event == "snapshot":
            sequences = doc.get("sequences")
            latency = doc.get("latency")
            status = {k: v for k, v in doc.items() if k not in ("sequences", "latency")}
            with self._lock:
                self._status = status
                self._sequences = tuple(s for s in sequences or () if isinstance(s, dict))
                self._latency = latency if isinstance(latency, dict) else None
                self._updated_at = time.time()
                self._refollow()
                run = status.get("run")
                if isinstance(run, dict) and run.get("run_id") == self._followed:
                    self._take_live(run)
            self._poll_wake.set()
        elif event == "log":
            key = (doc.get("time"), doc.get("kind"), doc.get("message"), doc.get("run_id"))
            with self._lock:
                if key in self._seen:
                    return      # a reconnection replays the last events
                self._seen[key] = None
                while len(self._seen) > 2 * KEEP_LOG:
                    self._seen.popitem(last=False)
                self._add_log(doc.get("time"), str(doc.get("kind") or "event"), str(doc.get("message") or ""),
                              doc.get("run_id"), doc.get("who"))

    # -- the followed run ---------------------------------------------------------------------
    def _refollow(self) -> None:
        """(lock held) The run the panels follow: the pick if it is still a sequence, else the most
        active sequence, else the run the status shows (the last one), else the one followed."""
        ids = {s.get("run_id") for s in self._sequences}
        if self._selected is not None and self._selected not in ids:
            self._selected = None      # it ended: back to the most active
        run = (self._status or {}).get("run")
        target = self._selected or most_active(self._sequences) or (
            run.get("run_id") if isinstance(run, dict) else None) or self._followed
        if target != self._followed:
            self._followed = target
            if self._snapshot is not None and self._snapshot.run_id != target:
                self._snapshot = None

    def _take_live(self, live: dict) -> None:
        """(lock held) A live view of the followed run: its Snapshot, the token history gathered."""
        run_id = live.get("run_id")
        if run_id != self._followed:
            return
        tokens = self._history.add(run_id, live.get("recent_tokens"))
        try:
            self._snapshot = snapshot_from_view(live, tokens)
        except (TypeError, ValueError):
            pass    # a view this console cannot read: the panels keep the last one

    def _poll_loop(self) -> None:
        """The followed run's live view, once an interval, unless the status already holds it."""
        while not self._closed:
            self._poll_wake.wait(self.interval)
            self._poll_wake.clear()
            if self._closed:
                return
            with self._lock:
                target, live = self._followed, self._connection.live
                run = (self._status or {}).get("run")
                in_status = isinstance(run, dict) and run.get("run_id") == target
                done = (self._snapshot is not None and self._snapshot.run_id == target
                        and self._snapshot.state not in ("starting", "running"))
            if not live or target is None or in_status or done:
                continue
            try:
                code, doc, _ = self._get_json(f"/runs/{quote(target, safe='')}")
            except (OSError, http.client.HTTPException):
                continue
            if code == 200 and doc is not None and isinstance(doc.get("live"), dict):
                with self._lock:
                    self._take_live(doc["live"])

    # -- the operator's calls ---------------------------------------------------------------
    def _token_file(self) -> str | None:
        """The token file the server names, when it is on this machine and readable by us."""
        status = self._status or {}
        operator = status.get("operator") if isinstance(status.get("operator"), dict) else {}
        path = operator.get("token_file")
        if not path or not self.address.local:
            return None
        try:
            return str(path) if Path(path).is_file() and Path(path).stat().st_size > 0 else None
        except OSError:
            return None

    def _operator_token(self) -> str:
        if self.operator_token:
            return self.operator_token
        with self._lock:
            path = self._token_file()
            status = self._status or {}
        if path is not None:
            try:   # the server's file, but a path from the network: a regular file within a bound only
                token = read_regular(path, "the operator token file", 64 << 10).decode("ascii").strip()
            except (Ds4fError, UnicodeDecodeError) as exc:
                raise Ds4fError(f"cannot read the operator token in {path}: {getattr(exc, 'message', None) or exc}"
                                f" (give --operator-token)") from None
            if token:
                return token
        operator = status.get("operator") if isinstance(status.get("operator"), dict) else {}
        where = operator.get("token_file")
        if where and not self.address.local:
            raise Ds4fError(f"no operator token: the server keeps it in {where} on its machine; give "
                            f"--operator-token")
        if where:
            raise Ds4fError(f"no operator token: {where} cannot be read by this user; give --operator-token")
        raise Ds4fError("no operator token: give --operator-token (the server does not name its token file)")

    def operator(self, action: str, body: dict | None = None, note: str = "") -> threading.Thread:
        """POST /operator/{action} with `body` on a thread of its own; the outcome goes to the log."""
        if action not in OPERATOR_ACTIONS:
            raise ValueError(f"unknown operator action {action!r}")
        t = threading.Thread(target=self._call, args=(action, dict(body or {}), note),
                             name=f"ds4f-console operator {action}", daemon=True)
        t.start()
        return t

    def _call(self, action: str, body: dict, note: str) -> None:
        what = f"{action}" + (f" ({note})" if note else "")
        run_id = body.get("run_id")
        try:
            try:
                token = self._operator_token()
            except Ds4fError as exc:
                self.note(f"✗ operator {what}: {exc}", "operator-call", run_id)
                return
            conn = self._http(self.call_timeout)
            try:
                # the operator's token in its own header; Authorization carries the API token when the
                # server has one, else the operator's too
                conn.request("POST", f"{self.address.base}/operator/{action}", body=json.dumps(body).encode(),
                             headers={"User-Agent": "ds4f-console", "Content-Type": "application/json",
                                      "Accept": "application/json", "X-Ds4f-Operator-Token": token,
                                      "Authorization": f"Bearer {self.token or token}"})
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self.note(f"✗ operator {what}: {self.address.short}: {_reach_problem(exc)}", "operator-call", run_id)
                return
            finally:
                conn.close()
            self.note(operator_outcome(what, resp.status, raw), "operator-call", run_id)
        finally:
            with self._lock:
                self._calls += 1


def operator_outcome(what: str, status: int, raw: bytes) -> str:
    """The log line for an operator call's answer."""
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    if 200 <= status < 300 and doc.get("ok", True):
        parts = []
        applied = doc.get("applied")
        if isinstance(applied, dict) and applied:
            parts.append("applied " + ", ".join(f"{k} {v}" for k, v in applied.items()))
        elif isinstance(applied, str) and applied:
            parts.append(f"applied: {applied}")
        elif applied is True:
            parts.append("applied")
        lands = doc.get("lands")
        if lands:
            parts.append(f"lands {lands}" if isinstance(lands, str) else f"lands {json.dumps(lands)}")
        return f"✓ operator {what}" + (": " + "; ".join(parts) if parts else "")
    message = _error_message(raw)
    if status == 401:
        hint = " (the operator token: --operator-token)"
    elif status == 403:
        hint = ""
    elif status == 404:
        hint = " (this server has no operator endpoints: an older ds4f serve?)"
    else:
        hint = ""
    return f"✗ operator {what}: {status} {message}{hint}"
