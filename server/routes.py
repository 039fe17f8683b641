"""The URL table of `ds4f serve` and the parsing of run parameters.

    GET    /status            engine state, model geometry, preset, backend, live figures, last report
    POST   /runs              start a run (JSON body); 202 + id, 429 + Retry-After while busy
    GET    /run?gen=N         the same with query parameters, a compatibility alias of POST /runs
    GET    /runs              recent runs (this server's and the history's)
    GET    /runs/{id}         state, live figures, and when done the summary report with its state sha256
    DELETE /runs/{id}         cancel
    GET    /runs/{id}/report  the whole report of a done run, per-token records included
    GET    /runs/{id}/state   the state dump (state.bin), checked to be that run's before it is sent
    GET    /metrics           live figures in the Prometheus text format

`gen` is the number of tokens a run generates and `steps` its decode steps (the prompt's
tokens after the first plus gen), in every answer. Requests that start or cancel a run (every
method but GET, and GET /run) are refused with 403 when an Origin or Referer header names
another site (see ds4f.server.transport).

Parameters are parsed here: a query string holds text and a JSON body typed values, and each
must be of the right type (a whole number, a list of token ids...). Whether a value is in
range is the run API's to say (ds4f.api.start_run); its Ds4fError names the parameter, and a
400 names it as the request did. Checked here are the limits the run API states but leaves to
front ends (ds4f.api.MAX_GEN, MAX_PROMPT) and the preset's name, which the run API would report
as a problem of ds4f.toml rather than of the request.
"""
from __future__ import annotations

import json
import re
from urllib.parse import parse_qs

from ds4f.api import BACKEND_NAMES, MAX_GEN, MAX_PROMPT, Ds4fError

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .service import RunParams
from .transport import FileResponse, HttpError, Request, Response, bad, changes_state, json_response

RUN_PARAMS = ("gen", "preset", "threads", "kernel_threads", "io_threads", "backend", "prompt")
MAX_LIST_LIMIT = 200
DEFAULT_LIST_LIMIT = 20
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_INT_RE = re.compile(r"^[0-9]{1,9}$")

# The status of a run the run API refused, by the Ds4fError's kind.
STATUS_BY_KIND = {
    "invalid": 400,     # a parameter is wrong; the answer names it when the request gave it
    "busy": 429,        # another run is active; Retry-After says when to try again
    "not_found": 404,
    "data": 400,        # the run could not start from the server's files (ds4f.toml, the checkpoint)
    "internal": 500,
}


# -- parameters ----------------------------------------------------------------------------------
def whole_number(name: str, value, from_query: bool) -> int:
    """A whole number: digits in a query string, an integer (not a bool) in JSON."""
    if from_query:
        if not isinstance(value, str) or not _INT_RE.match(value):
            raise bad(name, f"expected a whole number, got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected a whole number, got {json.dumps(value)}")
    return value


def parse_run_params(raw: dict, presets, from_query: bool) -> RunParams:
    """The run parameters of a request, typed; HttpError(400) naming the first malformed one."""
    unknown = [k for k in raw if k not in RUN_PARAMS]
    if unknown:
        raise bad(unknown[0], f"unknown parameter (known: {', '.join(RUN_PARAMS)})")
    out: dict = {}
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
    if "threads" in raw and "kernel_threads" in raw:
        raise bad("threads", "give threads or kernel_threads, not both")
    for key, field_name in (("threads", "kernel_threads"), ("kernel_threads", "kernel_threads"),
                            ("io_threads", "io_threads")):
        if key in raw:
            out[field_name] = whole_number(key, raw[key], from_query)
    if "backend" in raw:
        backend = raw["backend"]
        if not isinstance(backend, str):
            raise bad("backend", f"unknown backend {json.dumps(backend)!r} (known: {', '.join(BACKEND_NAMES)})")
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
        out["prompt"] = tuple(prompt)
    return RunParams(**out)


def refused(exc: Ds4fError, raw: dict) -> HttpError:
    """The answer to a run the run API refused. A parameter of the request is named as the
    request spelled it (`threads` is kernel_threads); `model` is the server's own checkpoint,
    so a problem with it is the server's (500)."""
    if exc.param == "model":
        return HttpError(500, exc.message, param="model")
    name = "threads" if exc.param == "kernel_threads" and "threads" in raw else exc.param
    if exc.kind == "invalid" and name in RUN_PARAMS:
        message = exc.message
        if name != exc.param and message.startswith(f"{exc.param}:"):
            message = name + message[len(exc.param):]
        return HttpError(400, message, param=name)
    if exc.kind == "busy":
        return HttpError(429, f"busy: {exc.message}", headers={"Retry-After": "1"})
    return HttpError(STATUS_BY_KIND[exc.kind], exc.message)


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


def _check_id(run_id: str) -> None:
    if not _RUN_ID_RE.match(run_id):
        raise HttpError(404, f"no run {run_id!r}")


# -- endpoints ----------------------------------------------------------------------------------
def status(req: Request) -> Response:
    req.no_body()
    return json_response(200, req.service.status())


def metrics(req: Request) -> Response:
    req.no_body()
    return Response(200, req.service.metrics().encode(), METRICS_CONTENT_TYPE)


def list_runs(req: Request) -> Response:
    req.no_body()
    params = parse_query(req.query)
    unknown = [k for k in params if k != "limit"]
    if unknown:
        raise bad(unknown[0], "unknown parameter (known: limit)")
    limit = DEFAULT_LIST_LIMIT
    if "limit" in params:
        limit = whole_number("limit", params["limit"], from_query=True)
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise bad("limit", f"must be between 1 and {MAX_LIST_LIMIT}, got {limit}")
    runs, history_error = req.service.list_runs(limit)
    return json_response(200, {"runs": runs, "history_error": history_error})


def _start(req: Request, raw: dict, from_query: bool) -> Response:
    svc = req.service
    params = parse_run_params(raw, svc.cfg.presets, from_query)
    try:
        run = svc.start(params)
    except Ds4fError as exc:
        raise refused(exc, raw) from None
    snap = run.snapshot()
    return json_response(202, {"id": run.id, "state": snap.state, "gen": run.config.gen, "steps": snap.gen,
                               "preset": snap.preset,
                               "links": {"self": f"/runs/{run.id}", "state": f"/runs/{run.id}/state"}},
                         headers={"Location": f"/runs/{run.id}"})


def start_json(req: Request) -> Response:
    if req.query:
        raise bad("query", "POST /runs takes its parameters in a JSON body, not the query string")
    body = req.body()
    ctype = (req.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    if body.strip() and ctype != "application/json":
        raise HttpError(415, f"Content-Type: send the parameters as application/json, got {ctype or 'none'!r} "
                             f"(curl: -H 'Content-Type: application/json')", param="Content-Type")
    return _start(req, parse_json_body(body), from_query=False)


@changes_state
def start_query(req: Request) -> Response:
    req.no_body()
    return _start(req, parse_query(req.query), from_query=True)


def get_run(req: Request, id: str) -> Response:
    req.no_body()
    _check_id(id)
    return json_response(200, req.service.get(id))


def cancel_run(req: Request, id: str) -> Response:
    req.no_body()
    _check_id(id)
    code, view = req.service.cancel(id)
    return json_response(code, view)


def get_report(req: Request, id: str) -> Response:
    req.no_body()
    _check_id(id)
    return json_response(200, req.service.full_report(id))


def download_state(req: Request, id: str) -> FileResponse:
    req.no_body()
    _check_id(id)
    f, sha = req.service.open_state(id)
    headers = {"Content-Disposition": f'attachment; filename="{id}-state.bin"', "ETag": f'"{sha}"',
               "X-Ds4f-State-Sha256": sha}
    return FileResponse(f, "application/octet-stream", headers, sha256=sha)


ROUTES = (
    (re.compile(r"^/status$"), {"GET": status}),
    (re.compile(r"^/metrics$"), {"GET": metrics}),
    (re.compile(r"^/runs$"), {"GET": list_runs, "POST": start_json}),
    (re.compile(r"^/run$"), {"GET": start_query}),
    (re.compile(r"^/runs/(?P<id>[^/]+)$"), {"GET": get_run, "DELETE": cancel_run}),
    (re.compile(r"^/runs/(?P<id>[^/]+)/report$"), {"GET": get_report}),
    (re.compile(r"^/runs/(?P<id>[^/]+)/state$"), {"GET": download_state}),
)
