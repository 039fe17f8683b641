"""The operator's endpoints of `ds4f serve` (the OpenAI-compatible ones are in ds4f.server.openai).

    GET    /                  what this server is, and its endpoints
    GET    /health            {"status": "ok"} while it takes requests (503 while draining or shutting down)
    GET    /status            engine state, queue, model, preset, backends, live figures, last report
    GET    /metrics           Prometheus metrics (see ds4f.server.metrics, ds4f.server.ecosystem)
    GET    /slots             llama-server's slots: the sequences decoded together (ds4f.server.ecosystem)
    POST   /runs              start a run (JSON body); 202 + id, 429 + Retry-After while the engine is taken
    GET    /run?gen=N         the same with query parameters: a compatibility alias of POST /runs
    GET    /runs              recent runs (this server's and the history's)
    GET    /runs/{id}         state, live figures, and when done the summary report with its state sha256
    PATCH  /runs/{id}         switch the kernel backend and threads of a live run (at its next token;
                              its own, beside runs it steps with; io_threads is the engine's: 409 then)
    DELETE /runs/{id}         cancel
    GET    /runs/{id}/report  the whole report of a done run, per-token records included
    GET    /runs/{id}/state   the state dump (state.bin), checked to be that run's before and while it is sent
    GET    /events            server-sent events for watchers: hello, log, snapshot (ds4f.server.events)
    POST   /operator/{action} backend, threads, preset, cancel, drain, resume (ds4f.server.operator)

HEAD is answered wherever GET is (never for /run: it would start a run). Parameters are parsed
here: a query string holds text and a JSON body typed values, and each must be of the right
type. Whether a value is in range is the run API's to say (ds4f.api.start_run, Run.switch);
its Ds4fError names the parameter, and a 400 names it as the request did.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ds4f import __version__
from ds4f.api import BACKEND_NAMES, DEFAULT_GEN, MAX_GEN, Ds4fError, RunConfig, parse_spec

from .errors import HttpError, bad, json_response
from .queue import Ticket, product_token
from .request import WHOLE_RE, checked_run_id, json_body, parse_query, refused, whole_number

RUN_PARAMS = ("gen", "preset", "threads", "kernel_threads", "io_threads", "backend", "prompt", "spec")
SWITCH_PARAMS = ("backend", "threads", "kernel_threads", "io_threads")
MAX_LIST_LIMIT = 200
DEFAULT_LIST_LIMIT = 20


class AbortBody(Exception):
    """Stop sending a body short of its Content-Length: the client must not take it as whole."""


# -- parameters ----------------------------------------------------------------------------------
def _threads(raw: dict, from_query: bool) -> dict:
    """kernel_threads / io_threads / backend of a request (`threads` is kernel_threads)."""
    out: dict = {}
    if "threads" in raw and "kernel_threads" in raw:
        raise bad("threads", "give threads or kernel_threads, not both")
    for key, field_name in (("threads", "kernel_threads"), ("kernel_threads", "kernel_threads"),
                            ("io_threads", "io_threads")):
        if key in raw:
            out[field_name] = whole_number(key, raw[key], from_query)
    if "backend" in raw:
        backend = raw["backend"]
        if not isinstance(backend, str):
            raise bad("backend", f"unknown backend {json.dumps(backend)} (known: {', '.join(BACKEND_NAMES)})")
        out["backend"] = backend
    return out


def parse_run_params(raw: dict, presets, from_query: bool) -> dict:
    """The run parameters of a request as RunConfig fields; 400 naming the first malformed one."""
    unknown = [k for k in raw if k not in RUN_PARAMS]
    if unknown:
        raise bad(unknown[0], f"unknown parameter (known: {', '.join(RUN_PARAMS)})", code="unknown_parameter")
    out: dict = {"gen": DEFAULT_GEN}
    if "gen" in raw:
        gen = whole_number("gen", raw["gen"], from_query)
        if gen > MAX_GEN:
            raise bad("gen", f"must be between 1 and {MAX_GEN}, got {gen}")
        out["gen"] = gen
    if "preset" in raw:
        preset = raw["preset"]
        if not isinstance(preset, str):
            raise bad("preset", f"expected a preset name, got {json.dumps(preset)}")
        if preset not in presets:
            raise bad("preset", f"no preset named {preset!r} (have: {', '.join(presets)})")
        out["preset"] = preset
    out.update(_threads(raw, from_query))
    if "prompt" in raw:
        prompt = raw["prompt"]
        if from_query:
            parts = prompt.split(",") if isinstance(prompt, str) else [None]
            if not all(isinstance(p, str) and WHOLE_RE.match(p.strip()) for p in parts):
                raise bad("prompt", f"expected comma-separated token ids, got {prompt!r}")
            prompt = [int(p) for p in parts]
        elif not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("prompt", "expected a list of token ids (whole numbers)")
        if not prompt:
            raise bad("prompt", "must hold at least one token id")
        out["prompt"] = tuple(prompt)
    if "spec" in raw:
        value = raw["spec"]
        if from_query and isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        try:
            out["spec"] = parse_spec(value)
        except Ds4fError as exc:
            raise bad("spec", str(exc).removeprefix("spec: ")) from None
    return out


def _query(request: Request) -> str:
    return request.scope.get("query_string", b"").decode("latin-1")


def _run_id(request: Request) -> str:
    return checked_run_id(request.path_params["id"])


def _client(request: Request) -> str:
    return request.client.host if request.client else "-"


# -- endpoints ----------------------------------------------------------------------------------
ENDPOINTS = [
    ("GET", "/", "what this server is"), ("GET", "/health", "liveness"), ("GET", "/status", "engine, queue, model"),
    ("GET", "/metrics", "Prometheus metrics (ds4f_*, and vLLM's vllm:* names)"),
    ("GET", "/slots", "llama-server's slots: each parallel sequence, what it holds"),
    ("GET", "/v1/models", "OpenAI: the model served"),
    ("POST", "/v1/chat/completions", "OpenAI: chat, stream or not"),
    ("POST", "/v1/completions", "OpenAI: text completion, stream or not"),
    ("POST", "/v1/responses", "OpenAI Responses API: input items, function calls, stream or not"),
    ("POST", "/v1/messages", "Anthropic Messages API: content blocks, tool use, stream or not"),
    ("POST", "/v1/messages/count_tokens", "Anthropic: a request's prompt tokens"),
    ("POST", "/runs", "start a run (token ids)"), ("GET", "/run?gen=N", "compatibility alias of POST /runs"),
    ("GET", "/runs", "recent runs"), ("GET", "/runs/{id}", "a run"), ("PATCH", "/runs/{id}", "switch backend, threads"),
    ("DELETE", "/runs/{id}", "cancel"), ("GET", "/runs/{id}/report", "the whole report"),
    ("GET", "/runs/{id}/state", "the state dump"),
    ("GET", "/events?interval=S", "server-sent events for watchers: hello, log, snapshot"),
    ("POST", "/operator/{action}", "operator: backend, threads, preset, cancel, drain, resume (operator token)"),
]


async def about(request: Request) -> Response:
    svc = request.app.state.service
    return json_response(200, {
        "name": "ds4f", "version": __version__,
        "what": "ds4f serve: the ds4f disk-streaming inference engine over HTTP, with an OpenAI-compatible API",
        "model": svc.model_id, "endpoints": [{"method": m, "path": p, "what": w} for m, p, w in ENDPOINTS]})


async def health(request: Request) -> Response:
    svc = request.app.state.service
    if svc.closing:
        return json_response(503, {"status": "shutting down"}, {"Retry-After": "5"})
    if svc.draining:   # out of a balancer's rotation; what runs and waits still finishes
        return json_response(503, {"status": "draining", "draining": True, "busy": svc.busy,
                                   "queue_waiting": len(svc.queue.waiting)}, {"Retry-After": "30"})
    return json_response(200, {"status": "ok", "draining": False, "busy": svc.busy,
                               "queue_waiting": len(svc.queue.waiting)})


async def status(request: Request) -> Response:
    return json_response(200, request.app.state.service.status())


async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.service.metrics.render(request.headers.get("accept"))
    return Response(body, 200, media_type=content_type)


async def list_runs(request: Request) -> Response:
    params = parse_query(_query(request))
    unknown = [k for k in params if k != "limit"]
    if unknown:
        raise bad(unknown[0], "unknown parameter (known: limit)", code="unknown_parameter")
    limit = DEFAULT_LIST_LIMIT
    if "limit" in params:
        limit = whole_number("limit", params["limit"], from_query=True)
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise bad("limit", f"must be between 1 and {MAX_LIST_LIMIT}, got {limit}")
    runs, history_error = await run_in_threadpool(request.app.state.service.list_runs, limit)
    return json_response(200, {"runs": runs, "history_error": history_error})


async def _start(request: Request, raw: dict, from_query: bool) -> Response:
    svc = request.app.state.service
    fields = parse_run_params(raw, svc.cfg.presets, from_query)
    # what the request leaves out comes from the server's defaults as they are when the run starts
    defaults = tuple(k for k in ("preset", "backend", "kernel_threads", "io_threads") if k not in fields)
    fields.setdefault("preset", svc.preset)
    fields.setdefault("backend", svc.backend)
    # an operator's measured run starts on an empty expert cache, so its hit rate compares with others
    fields.setdefault("spec", svc.options.spec)
    config = RunConfig(model=svc.model, config_path=svc.options.config_path, cold_start=True, **fields)
    ticket = Ticket("run", _client(request), agent=product_token(request.headers.get("user-agent")),
                    max_tokens=config.gen)
    svc.take_now(ticket)
    try:
        run, _feed = await svc.start(config, ticket, defaults)
    except Ds4fError as exc:
        raise refused(exc, raw) from None
    snap = run.snapshot()
    return json_response(202, {"id": run.id, "state": snap.state, "gen": run.config.gen, "steps": snap.steps,
                               "preset": snap.preset,
                               "links": {"self": f"/runs/{run.id}", "state": f"/runs/{run.id}/state"}},
                         headers={"Location": f"/runs/{run.id}"})


async def start_json(request: Request) -> Response:
    if _query(request):
        raise bad("query", "POST /runs takes its parameters in a JSON body, not the query string")
    return await _start(request, await json_body(request), from_query=False)


async def start_query(request: Request) -> Response:
    if request.method == "HEAD":   # HEAD must not act
        raise HttpError(405, "HEAD is not allowed on /run (it would start a run; use GET or POST /runs)",
                        code="method_not_allowed", headers={"Allow": "GET"})
    return await _start(request, parse_query(_query(request)), from_query=True)


async def get_run(request: Request) -> Response:
    run_id = _run_id(request)
    return json_response(200, await run_in_threadpool(request.app.state.service.get, run_id))


async def cancel_run(request: Request) -> Response:
    run_id = _run_id(request)
    code, view = await run_in_threadpool(request.app.state.service.cancel, run_id)
    return json_response(code, view)


async def switch_run(request: Request) -> Response:
    """Switch a live run's kernel backend and threads; they apply at its next token."""
    run_id = _run_id(request)
    raw = await json_body(request, "settings to switch")
    unknown = [k for k in raw if k not in SWITCH_PARAMS]
    if unknown:
        raise bad(unknown[0], f"unknown parameter (known: {', '.join(SWITCH_PARAMS)})", code="unknown_parameter")
    if not raw:
        raise bad("body", f"nothing to switch: give one of {', '.join(SWITCH_PARAMS)}")
    settings = _threads(raw, from_query=False)
    svc = request.app.state.service
    run = await run_in_threadpool(svc.live_run, run_id)
    others = run.sharing_with() if "io_threads" in settings else []
    if others:   # the backend and kernel threads are the run's own; the reader is every sequence's
        raise HttpError(409, f"io_threads: run {run.id} steps together with run{'s' if len(others) > 1 else ''} "
                             f"{', '.join(others)} on one engine, whose I/O threads they share: switching them for "
                             f"one would switch them for all (POST /operator/threads switches every run's; backend "
                             f"and threads are each run's own)", param="io_threads", code="engine_shared",
                        extra={"sharing_with": others})
    try:
        run.switch(**settings)
    except Ds4fError as exc:
        raise refused(exc, raw) from None
    snap = run.snapshot()
    return json_response(202, {"id": run.id, "state": snap.state, "switch": settings, "applies": "at the next token",
                               "now": {"backend": snap.backend, "kernel_threads": snap.kernel_threads,
                                       "io_threads": snap.io_threads}})


async def get_report(request: Request) -> Response:
    run_id = _run_id(request)
    return json_response(200, await run_in_threadpool(request.app.state.service.full_report, run_id))


async def download_state(request: Request) -> Response:
    run_id = _run_id(request)
    f, sha = await run_in_threadpool(request.app.state.service.open_state, run_id)
    size = os.fstat(f.fileno()).st_size
    headers = {"Content-Disposition": f'attachment; filename="{run_id}-state.bin"', "ETag": f'"{sha}"',
               "X-Ds4f-State-Sha256": sha, "Content-Length": str(size)}
    if request.method == "HEAD":
        f.close()
        return Response(b"", 200, headers=headers, media_type="application/octet-stream")
    return StreamingResponse(_checked_chunks(f, size, sha, request.url.path), 200, headers=headers,
                             media_type="application/octet-stream")


async def _checked_chunks(f, size: int, sha: str, path: str):
    """The file's bytes, the last chunk held back until everything read hashes to `sha`: if it does
    not (the file changed while sent), the body stops short of Content-Length, so the client never
    gets a whole body that is not the one named."""
    try:
        digest, held, remaining = hashlib.sha256(), b"", size
        while remaining > 0:
            chunk = await run_in_threadpool(f.read, min(1 << 20, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            digest.update(chunk)
            if held:
                yield held
            held = chunk
        if remaining or digest.hexdigest() != sha:
            sys.stderr.write(f"ds4f serve: {path}: the file changed while it was sent; the connection was closed "
                             f"before the end of the body\n")
            raise AbortBody(path)
        yield held
    finally:
        f.close()
