"""`ds4f serve`: the engine over HTTP, on Starlette and uvicorn, on the same run API as the
console and the CLI.

    server = Server(ServerOptions(model=path, port=0))   # validates, opens the model, binds
    server.start()                                       # serves in a thread of its own
    ...; server.stop()                                   # cancels the run, stops serving

One engine, kept loaded between runs; one sequence computes at a time and requests wait their
turn in a bounded queue. When a bearer token is set every endpoint requires it, and a bind
beyond loopback without one is refused. The operator's endpoints (POST /operator/{action})
take the operator's token instead, from loopback peers only unless allowed; GET /events streams
the server's log and snapshots to watchers (the operator's console).

    options.py   the options, the token file, loopback
    guard.py     token, Host / Origin / Referer / Sec-Fetch-Site checks, per-client cap, body
                 size and deadline, access log, request counts (ASGI middleware)
    protocol.py  uvicorn's h11 protocol with a deadline for request heads, connections per client
    routes.py    the operator's endpoints: /, /health, /status, /metrics, /runs...
    events.py    GET /events: server-sent events for watchers (hello, log, snapshot), the log,
                 the latency rings
    operator.py  POST /operator/{action}: backend, threads, preset, cancel, drain, resume; the
                 operator's token and its file
    openai.py    the OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions
    anthropic.py Anthropic's Messages API: /v1/messages, /v1/messages/count_tokens
    responses.py OpenAI's Responses API: /v1/responses
    generation.py the engine path every generating endpoint shares
    service.py   the Service: the engine host and its queue, runs, their views, the history
    queue.py     the engine's waiting line
    feed.py      a run's tokens, from its thread to the event loop
    metrics.py   Prometheus metrics (prometheus_client)
    ecosystem.py vLLM's metric names and llama-server's /slots, for the ecosystem's monitors
    errors.py    errors in OpenAI's JSON shape
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Match, Route

from ds4f.api import Ds4fError

from . import anthropic, ecosystem, events, openai, operator, responses, routes
from .errors import HttpError
from .guard import Guard
from .options import DEFAULT_HOST, DEFAULT_PORT, ServerOptions, is_loopback, read_token_file
from .protocol import protocol_class
from .request import refused
from .service import Service

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "Server", "ServerOptions", "Service", "build_app", "is_loopback",
           "read_token_file"]

ROUTES = [
    Route("/", routes.about, methods=["GET"]),
    Route("/health", routes.health, methods=["GET"]),
    Route("/status", routes.status, methods=["GET"]),
    Route("/metrics", routes.metrics, methods=["GET"]),
    Route("/slots", ecosystem.slots, methods=["GET"]),
    Route("/runs", routes.list_runs, methods=["GET"]),
    Route("/runs", routes.start_json, methods=["POST"]),
    Route("/run", routes.start_query, methods=["GET"]),
    Route("/runs/{id}", routes.get_run, methods=["GET"]),
    Route("/runs/{id}", routes.switch_run, methods=["PATCH"]),
    Route("/runs/{id}", routes.cancel_run, methods=["DELETE"]),
    Route("/runs/{id}/report", routes.get_report, methods=["GET"]),
    Route("/runs/{id}/state", routes.download_state, methods=["GET"]),
    Route("/events", events.events, methods=["GET"]),
    Route("/operator/{action}", operator.act, methods=["POST"]),
    Route("/v1/models", openai.list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", openai.get_model, methods=["GET"]),
    Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai.completions, methods=["POST"]),
    Route("/v1/responses", responses.create, methods=["POST"]),
    Route("/v1/messages", anthropic.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
]


METHOD_ORDER = ("GET", "HEAD", "POST", "PATCH", "DELETE")


def _allowed(scope) -> list[str]:
    """The methods the routes take on this path (for 405's Allow)."""
    methods = set()
    for route in ROUTES:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            methods |= route.methods
    return [m for m in METHOD_ORDER if m in methods]


async def _http_error(request, exc: HttpError):
    return exc.response(request.url.path)


async def _starlette_error(request, exc: HTTPException):
    if exc.status_code == 405:
        allowed = _allowed(request.scope)
        return HttpError(405, f"{request.method} is not allowed on {request.url.path} (allowed: "
                              f"{', '.join(allowed)})", code="method_not_allowed",
                         headers={"Allow": ", ".join(allowed)}).response(request.url.path)
    if exc.status_code == 404:
        return HttpError(404, f"no such endpoint: {request.url.path}", code="not_found").response(request.url.path)
    return HttpError(exc.status_code, str(exc.detail), headers=exc.headers).response(request.url.path)


async def _ds4f_error(request, exc: Ds4fError):
    return refused(exc, {}).response(request.url.path)


def build_app(service: Service):
    """The ASGI app: the Guard around Starlette's router."""
    service_ref = service

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service_ref.loop = asyncio.get_running_loop()
        service_ref.events.bind(service_ref.loop)
        yield
        service_ref.queue.close()

    app = Starlette(routes=ROUTES, lifespan=lifespan,
                    exception_handlers={HttpError: _http_error, HTTPException: _starlette_error,
                                        Ds4fError: _ds4f_error})
    app.router.redirect_slashes = False   # /runs/ is not /runs
    app.state.service = service
    service.metrics.serve(service)   # vLLM's series and llama-server's slots, read from the service
    return Guard(app, service.options, service.metrics, ROUTES, events=service.events)


CONCURRENCY_HEADROOM = 64      # connections being closed, and requests' tasks, past max_connections


class Server:
    """uvicorn serving the app in a thread of its own, on a socket bound at construction."""

    def __init__(self, options: ServerOptions, start_run=None):
        """Check the options, open the model, bind. Ds4fError on anything the operator must fix.
        start_run: a stand-in for ds4f.api.start_run (see Service)."""
        options.check()
        self.options = options
        self.service = Service(options, start_run=start_run)
        try:
            self.socket = self._bind(options.host, options.port)
        except BaseException:
            self.service.close()
            raise
        try:
            self.service.operator.write_file(self.port)   # a random operator token's file, named by the port
        except BaseException:
            self.socket.close()
            self.service.close()
            raise
        self.app = build_app(self.service)
        config = uvicorn.Config(self.app, http=protocol_class(options.header_timeout_s, options.max_client_connections,
                                                                    options.max_connections),
                                lifespan="on", log_config=None, log_level="warning", access_log=False,
                                timeout_keep_alive=max(1, int(round(options.keep_alive_s))),
                                timeout_graceful_shutdown=5,
                                # the protocol keeps the connections within max_connections, closing
                                # waiting ones first; uvicorn's own bound is the backstop past it
                                limit_concurrency=options.max_connections + CONCURRENCY_HEADROOM,
                                server_header=False, date_header=True, ws="none",
                                h11_max_incomplete_event_size=64 * 1024)
        self.uvicorn = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        name = host.strip("[]")
        family = socket.AF_INET6 if ":" in name else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((name, port))
            sock.listen(1024)
            sock.set_inheritable(True)
        except OSError as exc:
            sock.close()
            raise Ds4fError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        except UnicodeError as exc:
            sock.close()
            raise Ds4fError(f"--host {host}: {exc}") from None
        return sock

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.socket.getsockname()[:2]
        return str(host), int(port)

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self, timeout: float = 30.0) -> None:
        """Serve in a thread; returns once the server accepts connections."""
        self.thread = threading.Thread(target=self._serve, name="ds4f-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self.thread.is_alive():
                raise Ds4fError("the server stopped while starting (see the errors above)")
            if time.monotonic() > deadline:
                raise Ds4fError("the server did not start in time")
            time.sleep(0.01)

    def _serve(self) -> None:
        try:
            self.uvicorn.run(sockets=[self.socket])
        except BaseException as exc:   # SystemExit from a failed startup included
            sys.stderr.write(f"ds4f serve: the HTTP server stopped: {type(exc).__name__}: {exc}\n")

    @property
    def serving(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self, timeout: float = 60.0) -> bool:
        """Refuse new runs, cancel the active one and wait for it (at most `timeout` s), stop
        serving. False if the run did not stop in time."""
        stopped = self.service.close(timeout=timeout)
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.socket.close()
        return stopped
