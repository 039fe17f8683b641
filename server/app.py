"""`ds4f serve`: the engine over HTTP, on the same run API as the console and the CLI.

    server = make_server(ServerOptions(model=path, port=0))   # validates, binds, does not serve yet
    threading.Thread(target=server.serve_forever).start()
    ...; server.service.close(); server.shutdown(); server.server_close()

Endpoints (all JSON except /metrics and the state download):
    GET    /status            engine state, model geometry, preset, backend, live figures, last report
    POST   /runs              start a run (JSON body); 202 + id, 429 + Retry-After while busy
    GET    /run?gen=N         the prototype's way to start a run (query parameters)
    GET    /runs              recent runs (this server's and the history's)
    GET    /runs/{id}         state, live figures, and when done the report with its state sha256
    DELETE /runs/{id}         cancel
    GET    /runs/{id}/state   the state dump (state.bin)
    GET    /metrics           live figures in the Prometheus text format

One run at a time (the kernel backend and thread count are process-wide). Standard library
only: ThreadingHTTPServer with a cap on concurrent connections, socket timeouts, a body size
limit, and strict parameter checks that name the parameter. When a bearer token is set, every
endpoint requires it; a bind beyond loopback without one is refused.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
import re
import socket
import socketserver
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from ds4f import __version__
from ds4f.engine.config import BACKEND_NAMES, load_config
from ds4f.engine.errors import Ds4fError

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import render_metrics

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8734
MAX_BODY_BYTES = 64 * 1024          # POST bodies; larger ones get 413
MAX_GEN = 100_000                   # tokens per run
MAX_PROMPT = 4096                   # prompt token ids per run
MAX_THREADS = 256                   # the run API's own bound
MIN_TOKEN_CHARS = 16
RUN_PARAMS = ("gen", "preset", "threads", "kernel_threads", "io_threads", "backend", "prompt")
LIVE_STATES = ("starting", "running")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")   # RFC 6750 b64token
_INT_RE = re.compile(r"^[0-9]{1,9}$")


class HttpError(Exception):
    """An answer other than success: status, a one-line message and, for 400, the parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = int(status), message, param
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict:
        out = {"error": self.message, "status": self.status}
        if self.param:
            out["parameter"] = self.param
        out.update(self.extra)
        return out


def bad(param: str | None, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}" if param else message, param=param)


@dataclass
class ServerOptions:
    model: str | None = None            # checkpoint; None: ds4f.toml's [model] path, else the demo model
    preset: str | None = None           # default preset of runs; None: ds4f.toml's engine.preset
    config_path: str | None = None      # ds4f.toml to use (passed on to every run)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token: str | None = None            # bearer token; set: every endpoint requires it
    request_timeout_s: float = 15.0     # socket timeout per read/write: a slow client cannot pin a thread
    max_body_bytes: int = MAX_BODY_BYTES
    max_connections: int = 64           # concurrent connections; more get 503 at once
    cancel_wait_s: float = 5.0          # DELETE waits this long for the run to stop before answering 202
    access_log: bool = True             # one stderr line per request


# -- tokens and hosts ----------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token_file(path: str | os.PathLike) -> str:
    """The bearer token in `path` (surrounding whitespace stripped); Ds4fError if unusable."""
    where = f"--token-file {path}"
    try:
        text = Path(path).read_text(encoding="ascii")
    except UnicodeDecodeError:
        raise Ds4fError(f"{where}: the token must be ASCII") from None
    except OSError as exc:
        raise Ds4fError(f"{where}: cannot read: {exc.strerror or exc}") from None
    token = text.strip()
    if not token:
        raise Ds4fError(f"{where}: the file is empty")
    if len(token) < MIN_TOKEN_CHARS:
        raise Ds4fError(f"{where}: the token is {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                        f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if not _TOKEN_RE.match(token):
        raise Ds4fError(f"{where}: the token may only hold letters, digits and -._~+/ (one line)")
    return token


def resolve_model(explicit: str | None, cfg) -> str:
    """--model, else ds4f.toml's [model] path, else the demo model (made on first use)."""
    if explicit:
        return str(Path(explicit).expanduser())
    if cfg.model_path:
        return cfg.model_path
    from ds4f.engine.checkpoint.demo import ensure_synthetic

    return str(ensure_synthetic("demo"))


# -- parameters ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunParams:
    gen: int = 8
    preset: str | None = None
    kernel_threads: int | None = None
    io_threads: int | None = None
    backend: str | None = None
    prompt: tuple[int, ...] | None = None


def _int_param(name: str, value, lo: int, hi: int, from_query: bool) -> int:
    if from_query:
        if not isinstance(value, str) or not _INT_RE.match(value):
            raise bad(name, f"expected a whole number, got {value!r}")
        value = int(value)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected a whole number, got {json.dumps(value)}")
    if not lo <= value <= hi:
        raise bad(name, f"must be between {lo} and {hi}, got {value}")
    return value


def parse_run_params(raw: dict, vocab: int, presets, from_query: bool) -> RunParams:
    """Check types and ranges of the run parameters; HttpError(400) naming the first bad one."""
    unknown = [k for k in raw if k not in RUN_PARAMS]
    if unknown:
        raise bad(unknown[0], f"unknown parameter (known: {', '.join(RUN_PARAMS)})")
    out: dict = {}
    if "gen" in raw:
        out["gen"] = _int_param("gen", raw["gen"], 1, MAX_GEN, from_query)
    if "preset" in raw:
        preset = raw["preset"]
        if not isinstance(preset, str):
            raise bad("preset", f"expected a preset name, got {json.dumps(preset)}")
        if preset not in presets:
            raise bad("preset", f"no preset named {preset!r} (have: {', '.join(presets)})")
        out["preset"] = preset
    if "threads" in raw and "kernel_threads" in raw:
        raise bad("threads", "give threads or kernel_threads, not both")
    for key, field_name in (("threads", "kernel_threads"), ("kernel_threads", "kernel_threads"),
                            ("io_threads", "io_threads")):
        if key in raw:
            out[field_name] = _int_param(key, raw[key], 1, MAX_THREADS, from_query)
    if "backend" in raw:
        backend = raw["backend"]
        if not isinstance(backend, str) or backend not in BACKEND_NAMES:
            shown = backend if isinstance(backend, str) else json.dumps(backend)
            raise bad("backend", f"unknown backend {shown!r} (known: {', '.join(BACKEND_NAMES)})")
        out["backend"] = backend
    if "prompt" in raw:
        prompt = raw["prompt"]
        if from_query:
            parts = prompt.split(",") if isinstance(prompt, str) else [None]
            if not all(isinstance(p, str) and _INT_RE.match(p.strip()) for p in parts):
                raise bad("prompt", f"expected comma-separated token ids, got {prompt!r}")
            prompt = [int(p) for p in parts]
        elif not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("prompt", "expected a list of token ids (whole numbers)")
        if not prompt:
            raise bad("prompt", "must hold at least one token id")
        if len(prompt) > MAX_PROMPT:
            raise bad("prompt", f"at most {MAX_PROMPT} token ids, got {len(prompt)}")
        outside = [t for t in prompt if not 0 <= t < vocab]
        if outside:
            raise bad("prompt", f"token ids {outside[:5]} are outside the vocabulary (0..{vocab - 1})")
        out["prompt"] = tuple(prompt)
    return RunParams(**out)


def parse_json_body(body: bytes) -> dict:
    if not body.strip():
        return {}
    try:
        value = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("body", "not UTF-8") from None
    except ValueError as exc:
        raise bad("body", f"malformed JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad("body", f"expected a JSON object of run parameters, got {type(value).__name__}")
    return value


def parse_query(query: str) -> dict:
    try:
        pairs = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=32,
                         errors="strict")
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad("query", f"malformed query string: {exc}") from None
    out = {}
    for key, values in pairs.items():
        if len(values) != 1:
            raise bad(key, "given more than once")
        out[key] = values[0]
    return out


# -- JSON views ----------------------------------------------------------------------------------
def _clean(value):
    """JSON-safe: tuples to lists, non-finite floats to None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def snapshot_view(snap) -> dict:
    """The live figures without the per-token list (its last few records are kept)."""
    d = asdict(snap)
    tokens = d.pop("tokens")
    d["recent_tokens"] = tokens[-8:]
    d["events"] = list(d["events"])[-20:]
    return d


class Service:
    """What the handlers act on: the model, the current and recent runs, the history, counters."""

    def __init__(self, options: ServerOptions, start_run=None):
        from ds4f.engine import kernels
        from ds4f.engine.checkpoint import open_checkpoint
        from ds4f.engine.history import History
        from ds4f.engine.runs import start_run as _start_run

        self.options = options
        self.cfg = load_config(options.config_path)
        self.preset = self.cfg.get_preset(options.preset).name
        self.model = resolve_model(options.model, self.cfg)
        ck = open_checkpoint(self.model)
        try:
            self.geometry = ck.geometry.to_config()
            self.vocab = ck.geometry.vocab
            self.checkpoint_kind = ck.kind
            self.io_mode = ck.io_mode
        finally:
            ck.close()
        self.history = History(self.cfg.history_path)
        self.backends = list(kernels.available_backends())
        self.best_backend = kernels.best_backend()
        self._start_run = start_run or _start_run
        self._lock = threading.Lock()          # guards starting a run and _current
        self._counts_lock = threading.Lock()   # response counters: never waits behind a run's start
        # Only the current (or last) Run stays in memory: a Run keeps its engine (pinned trunk,
        # embeddings) referenced after it ends, so older runs are served from the history.
        self._current = None
        self._closing = False
        self.started_at = time.time()
        self.runs_started = 0
        self.busy_rejections = 0
        self._responses: Counter = Counter()
        self._last_report = self._last_report_from_history()

    # -- counters ---------------------------------------------------------------------------------
    def count_response(self, code: int) -> None:
        with self._counts_lock:
            self._responses[int(code)] += 1

    def _last_report_from_history(self) -> dict | None:
        try:
            for rec in self.history.list_runs(limit=50):
                if rec.state == "done" and rec.report:
                    return {"run_id": rec.run_id, "finished_at": rec.finished_at, "summary": rec.summary,
                            "state_sha256": rec.state_sha256, "source": "history"}
        except Ds4fError:
            pass
        return None

    # -- runs --------------------------------------------------------------------------------------
    @property
    def current_run(self):
        """The run started last (live or finished), or None."""
        return self._current

    @property
    def busy(self) -> bool:
        run = self._current
        return run is not None and not run.finished

    def _busy_error(self, run) -> HttpError:
        snap = run.snapshot()
        retry = max(1, min(3600, math.ceil(snap.eta_s))) if snap.eta_s else 1
        self.busy_rejections += 1
        return HttpError(429, f"busy: run {run.id} is {snap.state} ({snap.tokens_done}/{snap.gen} tokens); "
                              f"one run at a time", headers={"Retry-After": str(retry)},
                         extra={"run_id": run.id, "retry_after_s": retry})

    def start(self, params: RunParams):
        from ds4f.engine.runs import RunConfig, active_run

        with self._lock:
            if self._closing:
                raise HttpError(503, "the server is shutting down", headers={"Retry-After": "5"})
            cur = self._current
            if cur is not None and not cur.finished and cur.state not in LIVE_STATES:
                cur.wait(5.0)   # ended a moment ago; its thread is recording it in the history
            if cur is not None and not cur.finished:
                raise self._busy_error(cur)
            other = active_run()
            if other is not None:   # a run started by someone else in this process
                raise self._busy_error(other)
            backend = params.backend or self.cfg.backend
            config = RunConfig(model=self.model, preset=params.preset or self.preset, gen=params.gen,
                               prompt=params.prompt, io_threads=params.io_threads,
                               kernel_threads=params.kernel_threads, backend=backend,
                               config_path=self.options.config_path)
            try:
                run = self._start_run(config, history=self.history)
            except Ds4fError as exc:
                message = str(exc)
                if "still active" in message:
                    raise HttpError(429, f"busy: {message}", headers={"Retry-After": "1"}) from None
                head = message.split(":", 1)[0].strip()
                param = head if head in RUN_PARAMS or head == "model" else None
                raise HttpError(400 if param != "model" else 500, message, param=param) from None
            self._current = run
            self.runs_started += 1
            return run

    def _find(self, run_id: str):
        run = self._current
        return run if run is not None and run.id == run_id else None

    def run_view(self, run) -> dict:
        snap = run.snapshot()
        report = run.report if snap.state == "done" else None
        if report is not None:
            self._note_report(run.id, report)
        return {"id": run.id, "state": snap.state, "error": snap.error, "source": "server",
                "config": run.config_dict(), "live": snapshot_view(snap),
                "state_sha256": (report or {}).get("state_sha256"), "report": report,
                "links": self._links(run.id, snap.state)}

    @staticmethod
    def _links(run_id: str, state: str) -> dict:
        links = {"self": f"/runs/{run_id}"}
        if state == "done":
            links["state"] = f"/runs/{run_id}/state"
        return links

    def _note_report(self, run_id: str, report: dict) -> None:
        last = self._last_report
        if last is None or last.get("run_id") != run_id:
            finished = report.get("finished_at") or 0
            if last is None or last.get("source") == "history" or finished >= (last.get("finished_at") or 0):
                self._last_report = {"run_id": run_id, "finished_at": finished, "summary": report.get("summary"),
                                     "state_sha256": report.get("state_sha256"), "source": "server"}

    def get(self, run_id: str) -> dict:
        run = self._find(run_id)
        if run is not None:
            return self.run_view(run)
        rec = self.history.get(run_id)
        if rec is None:
            raise HttpError(404, f"no run {run_id!r}")
        return {"id": rec.run_id, "state": rec.state, "error": rec.error, "source": "history",
                "config": rec.config, "live": None, "state_sha256": rec.state_sha256, "report": rec.report,
                "started_at": rec.started_at, "finished_at": rec.finished_at,
                "links": self._links(rec.run_id, rec.state)}

    def cancel(self, run_id: str) -> tuple[int, dict]:
        run = self._find(run_id)
        if run is None:
            rec = self.history.get(run_id)
            if rec is None:
                raise HttpError(404, f"no run {run_id!r}")
            raise HttpError(409, f"run {run_id} already ended ({rec.state})", extra={"state": rec.state})
        if run.finished or run.state not in LIVE_STATES:
            raise HttpError(409, f"run {run_id} already ended ({run.state})", extra={"state": run.state})
        run.cancel()
        stopped = run.wait(self.options.cancel_wait_s)
        return (200 if stopped else 202), self.run_view(run)

    def state_file(self, run_id: str) -> tuple[Path, str | None]:
        run = self._find(run_id)
        if run is not None:
            state, report = run.state, run.report
        else:
            rec = self.history.get(run_id)
            if rec is None:
                raise HttpError(404, f"no run {run_id!r}")
            state, report = rec.state, rec.report or {}
            if rec.state_path:
                report = {**report, "state_path": rec.state_path, "state_sha256": rec.state_sha256}
        if state != "done" or not report or not report.get("state_path"):
            raise HttpError(409, f"run {run_id} is {state}: its state dump exists only once it is done",
                            extra={"state": state})
        path = Path(report["state_path"])
        if not path.is_file():
            raise HttpError(410, f"run {run_id}: the state dump {path} is gone")
        return path, report.get("state_sha256")

    def list_runs(self, limit: int) -> list[dict]:
        seen, out = set(), []
        run = self._current
        for run in ([run] if run is not None else []):
            snap = run.snapshot()
            seen.add(run.id)
            out.append({"id": run.id, "state": snap.state, "source": "server", "started_at": run.started_at,
                        "finished_at": run.finished_at, "preset": snap.preset, "gen": snap.gen,
                        "tokens_done": snap.tokens_done, "s_per_token": snap.s_per_token,
                        "state_sha256": (run.report or {}).get("state_sha256")})
        for rec in self.history.list_runs(limit=limit):
            if rec.run_id in seen:
                continue
            out.append({"id": rec.run_id, "state": rec.state, "source": "history", "started_at": rec.started_at,
                        "finished_at": rec.finished_at, "preset": rec.preset, "gen": rec.gen,
                        "tokens_done": rec.tokens_done, "s_per_token": rec.s_per_token,
                        "state_sha256": rec.state_sha256})
        out.sort(key=lambda r: r["started_at"] or 0, reverse=True)
        return out[:limit]

    # -- status and metrics ------------------------------------------------------------------------
    def status(self) -> dict:
        run = self._current
        snap = run.snapshot() if run is not None else None
        if run is not None and snap.state == "done" and run.report:
            self._note_report(run.id, run.report)
        preset = self.cfg.get_preset(self.preset)
        return {
            "server": {"version": __version__, "busy": self.busy, "closing": self._closing,
                       "auth": bool(self.options.token), "uptime_s": time.time() - self.started_at,
                       "runs_started": self.runs_started, "config": self.cfg.source,
                       "history": str(self.history.path)},
            "engine": {"state": snap.state if snap is not None and run is not None and not run.finished else "idle",
                       "current_run": run.id if run is not None else None},
            "model": {"path": self.model, "kind": self.checkpoint_kind, "io_mode": self.io_mode,
                      "geometry": self.geometry},
            "preset": {"name": preset.name, "detail": preset.describe(), "available": list(self.cfg.presets)},
            "backend": {"default": self.cfg.backend, "best": self.best_backend, "available": self.backends},
            "limits": {"max_gen": MAX_GEN, "max_prompt": MAX_PROMPT, "max_threads": MAX_THREADS,
                       "max_body_bytes": self.options.max_body_bytes},
            "run": snapshot_view(snap) if snap is not None else None,
            "last_report": self._last_report,
        }

    def metrics(self) -> str:
        run = self._current
        with self._counts_lock:
            responses = dict(self._responses)
        snap = run.snapshot() if run is not None else None
        return render_metrics(snap, {"busy": self.busy, "runs_started": self.runs_started,
                                     "busy_rejections": self.busy_rejections, "requests": responses})

    # -- shutdown -----------------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> bool:
        """Refuse new runs, cancel the current one and wait for it; False if it did not stop in time."""
        with self._lock:
            self._closing = True
            run = self._current
        if run is None or run.finished:
            return True
        run.cancel()
        return run.wait(timeout)


# -- HTTP ----------------------------------------------------------------------------------------
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ds4f/{__version__}"
    sys_version = ""
    server: "Ds4fHTTPServer"

    ROUTES = (
        (re.compile(r"^/status$"), {"GET": "status"}),
        (re.compile(r"^/metrics$"), {"GET": "metrics"}),
        (re.compile(r"^/runs$"), {"GET": "list_runs", "POST": "start_json"}),
        (re.compile(r"^/run$"), {"GET": "start_query"}),
        (re.compile(r"^/runs/(?P<id>[^/]+)$"), {"GET": "get_run", "DELETE": "cancel_run"}),
        (re.compile(r"^/runs/(?P<id>[^/]+)/state$"), {"GET": "download_state"}),
    )

    def version_string(self) -> str:
        return self.server_version

    def setup(self) -> None:
        self.timeout = self.server.options.request_timeout_s
        super().setup()

    @property
    def service(self) -> Service:
        return self.server.service

    # -- plumbing -----------------------------------------------------------------------------------
    def log_message(self, format: str, *args) -> None:
        if self.server.options.access_log:
            sys.stderr.write(f"ds4f serve: {self.address_string()} {format % args}\n")

    def send_response(self, code: int, message: str | None = None) -> None:
        self.service.count_response(code)
        super().send_response(code, message)

    def _has_unread_body(self) -> bool:
        if getattr(self, "_body_read", False) or not hasattr(self, "headers") or self.headers is None:
            return False
        return bool(self.headers.get("Transfer-Encoding")) or self.headers.get("Content-Length", "0").strip() not in ("", "0")

    def _send_bytes(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        if self._has_unread_body():
            self.close_connection = True   # the rest of the stream is not a request we can trust
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, obj, headers: dict | None = None) -> None:
        body = json.dumps(_clean(obj), allow_nan=False).encode() + b"\n"
        self._send_bytes(status, body, "application/json", headers)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and self.request_version == "HTTP/0.9":   # no headers, no status line: not worth serving
            self.send_error(400, "HTTP/0.9 requests are not supported")
            return False
        return ok

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol-level errors from http.server (bad request line, headers too large...) as JSON."""
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"            # always answer with a status line and headers
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        try:
            self._send_json(code, {"error": message or phrase, "status": code})
        except OSError:
            pass

    # -- dispatch -----------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def _dispatch(self, method: str) -> None:
        self._body_read = False
        try:
            self._authorize()
            self._check_browser_origin()
            url = urlsplit(self.path)
            path = unquote(url.path)
            for pattern, methods in self.ROUTES:
                m = pattern.match(path)
                if m is None:
                    continue
                if method not in methods:
                    raise HttpError(405, f"{method} is not allowed on {path} (allowed: {', '.join(methods)})",
                                    headers={"Allow": ", ".join(methods)})
                getattr(self, "h_" + methods[method])(url.query, **m.groupdict())
                return
            raise HttpError(404, f"no such endpoint: {path}")
        except HttpError as exc:
            self._send_json(exc.status, exc.body(), exc.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except (TimeoutError, socket.timeout):
            self.close_connection = True
            try:
                self._send_json(408, {"error": "request timed out", "status": 408})
            except OSError:
                pass
        except Exception as exc:  # a bug: answer 500 and keep serving
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            try:
                self._send_json(500, {"error": f"internal error: {type(exc).__name__}: {exc}", "status": 500})
            except OSError:
                pass

    def _check_browser_origin(self) -> None:
        """Keep web pages out: a loopback server answers only to loopback Host names (no DNS
        rebinding), and no request a browser marks as coming from another site is served."""
        host = self.headers.get("Host")
        if host is not None and is_loopback(self.server.options.host):
            name = host.strip()
            if name.startswith("["):
                name = name[1:name.find("]")] if "]" in name else name
            else:
                name = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
            if not is_loopback(name):
                raise HttpError(403, f"Host: {host[:80]!r} is not a loopback name; this server answers "
                                     f"only to localhost, 127.0.0.1 and [::1]")
        if self.headers.get("Sec-Fetch-Site", "").strip().lower() in ("cross-site", "same-site"):
            raise HttpError(403, "cross-site browser requests are refused")

    def _authorize(self) -> None:
        token = self.server.options.token
        if not token:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, credentials = header.partition(" ")
        given = credentials.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, token.encode("ascii")):
            raise HttpError(401, "a bearer token is required: Authorization: Bearer <token>",
                            headers={"WWW-Authenticate": 'Bearer realm="ds4f"'})

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "send the body with a Content-Length (chunked bodies are not accepted)")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            self._body_read = True
            return b""
        if not re.fullmatch(r"[0-9]{1,20}", length_text.strip()):
            raise bad("Content-Length", f"not a byte count: {length_text[:40]!r}")
        length = int(length_text)
        if length > self.server.options.max_body_bytes:
            raise HttpError(413, f"body of {length} bytes is over the limit of {self.server.options.max_body_bytes}")
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            raise bad("body", f"ended after {len(body)} of {length} bytes")
        self._body_read = True
        return body

    def _no_body(self) -> None:
        """Endpoints without a body ignore none silently: one sent makes the connection close after."""
        if self._has_unread_body():
            self.close_connection = True

    # -- endpoints ----------------------------------------------------------------------------------
    def h_status(self, query: str) -> None:
        self._no_body()
        self._send_json(200, self.service.status())

    def h_metrics(self, query: str) -> None:
        self._no_body()
        self._send_bytes(200, self.service.metrics().encode(), METRICS_CONTENT_TYPE)

    def h_list_runs(self, query: str) -> None:
        self._no_body()
        params = parse_query(query)
        unknown = [k for k in params if k != "limit"]
        if unknown:
            raise bad(unknown[0], "unknown parameter (known: limit)")
        limit = _int_param("limit", params["limit"], 1, 200, True) if "limit" in params else 20
        self._send_json(200, {"runs": self.service.list_runs(limit)})

    def _start(self, raw: dict, from_query: bool) -> None:
        svc = self.service
        params = parse_run_params(raw, svc.vocab, svc.cfg.presets, from_query)
        run = svc.start(params)
        snap = run.snapshot()
        self._send_json(202, {"id": run.id, "state": snap.state, "gen": run.config.gen, "steps": snap.gen,
                              "preset": snap.preset,
                              "links": {"self": f"/runs/{run.id}", "state": f"/runs/{run.id}/state"}},
                        headers={"Location": f"/runs/{run.id}"})

    def h_start_json(self, query: str) -> None:
        if query:
            raise bad("query", "POST /runs takes its parameters in a JSON body, not the query string")
        body = self._read_body()
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if body.strip() and ctype != "application/json":
            raise HttpError(415, f"Content-Type: send the parameters as application/json, got {ctype or 'none'!r} "
                                 f"(curl: -H 'Content-Type: application/json')", param="Content-Type")
        self._start(parse_json_body(body), from_query=False)

    def h_start_query(self, query: str) -> None:
        self._no_body()
        self._start(parse_query(query), from_query=True)

    @staticmethod
    def _check_id(run_id: str) -> None:
        if not _RUN_ID_RE.match(run_id):
            raise HttpError(404, f"no run {run_id!r}")

    def h_get_run(self, query: str, id: str) -> None:
        self._no_body()
        self._check_id(id)
        self._send_json(200, self.service.get(id))

    def h_cancel_run(self, query: str, id: str) -> None:
        self._no_body()
        self._check_id(id)
        status, view = self.service.cancel(id)
        self._send_json(status, view)

    def h_download_state(self, query: str, id: str) -> None:
        self._no_body()
        self._check_id(id)
        path, sha = self.service.state_file(id)
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise HttpError(410, f"run {id}: cannot open the state dump: {exc.strerror}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.send_header("Content-Disposition", f'attachment; filename="{id}-state.bin"')
            if sha:
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Ds4f-State-Sha256", sha)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            remaining = size
            while remaining > 0:
                chunk = f.read(min(1 << 20, remaining))
                if not chunk:
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)
            if remaining:   # the file shrank under us: the client sees a short body, not a lie
                self.close_connection = True


class Ds4fHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on concurrent connections (503 beyond it) and no DNS at bind."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, service: Service, options: ServerOptions):
        self.service = service
        self.options = options
        self._slots = threading.BoundedSemaphore(max(1, options.max_connections))
        host = options.host.strip("[]")
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, options.port), Handler)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            body = b'{"error": "too many connections; try again", "status": 503}\n'
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Content-Length: " + str(len(body)).encode() + b"\r\nRetry-After: 1\r\n"
                                b"Connection: close\r\n\r\n" + body)
            except OSError:
                pass
            self.service.count_response(503)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def make_server(options: ServerOptions, start_run=None) -> Ds4fHTTPServer:
    """Check the options, open the model, bind. Ds4fError on anything the operator must fix."""
    if not is_loopback(options.host) and not options.token:
        raise Ds4fError(f"--host {options.host}: serving beyond loopback requires a bearer token; "
                        f"write one to a file readable only by you and pass --token-file PATH")
    if not 0 <= options.port <= 65535:
        raise Ds4fError(f"--port: must be between 0 and 65535, got {options.port}")
    service = Service(options, start_run=start_run)
    try:
        return Ds4fHTTPServer(service, options)
    except OSError as exc:
        raise Ds4fError(f"cannot listen on {options.host}:{options.port}: {exc.strerror or exc}") from None
    except UnicodeError as exc:
        raise Ds4fError(f"--host {options.host}: {exc}") from None
