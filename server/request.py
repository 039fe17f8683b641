"""What every generating endpoint reads of a request, whatever its dialect (OpenAI's chat and
completions, the Responses API, Anthropic's Messages API, the operator's endpoints): the JSON body
and the query string, the checks of numbers, names and run ids, the parameters taken and ignored,
tools and tool_choice in OpenAI's shapes, stop strings and the sampling settings. The dialect files
import these from here, never from each other.
"""
from __future__ import annotations

import json
import re
import secrets
from urllib.parse import parse_qs

from starlette.requests import Request

from ds4f.api import Ds4fError, SamplingParams, check_choice, check_tools, parse_json

from .conversation import function_schema
from .errors import HttpError, bad

MAX_BODY_DEPTH = 100      # levels of arrays and objects a JSON body may nest (what reads it recurses once a level)
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
WHOLE_RE = re.compile(r"^[0-9]{1,9}$")

# OpenAI parameters that say how OpenAI's service keeps, bills or schedules a request, never what
# the model reads: taken (checked for their type) and ignored by chat completions, completions and
# the Responses API alike. Nothing is stored here (`store`), no tier is faster than another.
IGNORED = {"store": bool, "metadata": dict, "user": str, "prompt_cache_key": str, "prompt_cache_retention": str,
           "safety_identifier": str, "service_tier": ("auto", "default", "flex", "scale", "priority"),
           "verbosity": ("low", "medium", "high")}
MAX_STOP = 4               # as OpenAI
EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}

# The status of a run the run API refused, by the Ds4fError's kind.
STATUS_BY_KIND = {"invalid": 400, "busy": 429, "not_found": 404, "data": 400, "internal": 500}


def whole_number(name: str, value, from_query: bool) -> int:
    """A whole number: digits in a query string, an integer (not a bool) in JSON."""
    if from_query:
        if not isinstance(value, str) or not WHOLE_RE.match(value):
            raise bad(name, f"expected a whole number, got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected a whole number, got {json.dumps(value)}")
    return value


def refused(exc: Ds4fError, raw: dict, names: dict | None = None) -> HttpError:
    """The answer to something the run API refused. A parameter is named as the request spelled
    it (`names` maps the run API's names to the request's: gen -> max_tokens; `threads` is
    kernel_threads); `model` is the server's own checkpoint, so a problem with it is the server's."""
    if exc.param == "model":
        return HttpError(500, exc.message, param="model", code="model_error")
    name = exc.param
    if names and name in names:
        name = names[name]
    elif name == "kernel_threads" and "threads" in raw:
        name = "threads"
    if exc.kind == "invalid" and name:
        message = exc.message
        if name != exc.param and message.startswith(f"{exc.param}:"):
            message = name + message[len(exc.param):]
        elif not message.startswith(f"{name}:"):
            message = f"{name}: {message}"
        return HttpError(400, message, param=name, code="invalid_value")
    if exc.kind == "busy":
        return HttpError(429, f"busy: {exc.message}", code="busy", headers={"Retry-After": "1"})
    return HttpError(STATUS_BY_KIND.get(exc.kind, 500), exc.message, code=exc.kind)


def parse_json_object(body: bytes, what: str = "run parameters") -> dict:
    """A body's JSON object (an empty body: {}), nested at most MAX_BODY_DEPTH levels."""
    if not body.strip():
        return {}
    try:
        value = parse_json(body, "body", max_depth=MAX_BODY_DEPTH)
    except Ds4fError as exc:
        raise bad("body", exc.message.removeprefix("body: ")) from None
    if not isinstance(value, dict):
        raise bad("body", f"expected a JSON object of {what}, got {type(value).__name__}")
    return value


async def json_body(request: Request, what: str = "run parameters") -> dict:
    """The request's JSON object; 415 for a body that is not application/json (a browser can send
    a form or text/plain to another site without asking, but not JSON)."""
    body = await request.body()
    ctype = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if body.strip() and ctype != "application/json":
        raise HttpError(415, f"Content-Type: send the body as application/json, got {ctype or 'none'!r} "
                             f"(curl: -H 'Content-Type: application/json')", param="Content-Type",
                        code="unsupported_media_type")
    return parse_json_object(body, what)


def parse_query(query: str) -> dict:
    """A query string's parameters, each given once."""
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


def checked_run_id(run_id: str) -> str:
    """A run id as runs are named (letters, digits, - _ .); else 404 before anything looks it up."""
    if not _RUN_ID_RE.match(run_id):
        raise HttpError(404, f"no run {run_id[:80]!r}", code="not_found")
    return run_id


def number(raw: dict, name: str, lo: float, hi: float):
    """raw[name]: a number from lo to hi, or None when left out."""
    v = raw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not lo <= v <= hi:
        raise bad(name, f"must be a number from {lo:g} to {hi:g}, got {json.dumps(v)}")
    return v


def whole(raw: dict, name: str, lo: int, hi: int):
    """raw[name]: a whole number from lo to hi, or None when left out."""
    v = raw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(name, f"must be a whole number from {lo} to {hi}, got {json.dumps(v)}")
    return v


def boolean(value, where: str) -> bool | None:
    """true, false or left out (None)."""
    if value is not None and not isinstance(value, bool):
        raise bad(where, f"expected true or false, got {json.dumps(value)}")
    return value


def check_names(raw: dict, known: tuple, default_only: dict) -> None:
    """Every parameter known (the IGNORED ones of the right type), or one of default_only asking
    for the default; else a 400 naming it."""
    for key, value in raw.items():
        if value is None:
            continue
        if key in IGNORED and key in known:
            _check_ignored(key, value)
            continue
        if key in known:
            continue
        if key in default_only:
            if value not in default_only[key]:
                raise bad(key, f"not supported by this server (only {json.dumps(default_only[key][0])})",
                          code="unsupported_parameter")
            continue
        raise bad(key, f"unknown parameter (known: {', '.join(known)})", code="unknown_parameter")


def _check_ignored(key: str, value) -> None:
    kind = IGNORED[key]
    if isinstance(kind, tuple):
        if value not in kind:
            raise bad(key, f"expected one of {', '.join(kind)}, got {json.dumps(value)}")
    elif not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        what = {bool: "true or false", dict: "an object", str: "a string"}[kind]
        raise bad(key, f"expected {what}, got {json.dumps(value)}")


def text_parts(value, where: str, kinds: tuple = ("text",)) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") in kinds
                                       and isinstance(p.get("text"), str) for p in value):
        return "\n".join(p["text"] for p in value)
    raise bad(where, "expected text: a string, or a list of {\"type\": \"text\", \"text\": ...} parts")


def parse_tool_choice(value, tools: tuple, param: str = "tool_choice"):
    """OpenAI's tool_choice -> none | auto | required | a function's name."""
    if value is None:
        return None
    if isinstance(value, dict):
        fn = value.get("function") if isinstance(value.get("function"), dict) else value
        if value.get("type") not in ("function", None) or not isinstance(fn.get("name"), str):
            raise bad(param, "expected none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        value = fn["name"]
    elif value not in ("none", "auto", "required"):
        raise bad(param, f"expected none, auto, required or a function object, got {json.dumps(value)}")
    try:
        return check_choice(value, tools)
    except Ds4fError as exc:
        raise bad(param, exc.message.split(": ", 1)[-1]) from None


def parse_tools(value, param: str = "tools") -> tuple:
    """OpenAI's tools ({"type": "function", "function": {...}}, or the bare function) as the function
    schemas the prompt shows: name, description and parameters (`strict` and the like left out)."""
    if value is None:
        return ()
    try:
        return tuple(function_schema(fn) for fn in check_tools(value, param))
    except Ds4fError as exc:
        raise HttpError(400, exc.message, param=param, code="invalid_value") from None


def check_model(raw: dict, svc) -> None:
    """`model`, when given, names the served model: one of its names (--served-model-name) or its
    checkpoint directory's; else a 404."""
    model = raw.get("model")
    if model is not None and not svc.serves(model):
        if not isinstance(model, str):
            raise bad("model", f"expected a model name, got {json.dumps(model)}")
        raise HttpError(404, f"model: no model {model!r} here; this server serves {svc.model_id!r} "
                             f"(GET /v1/models)", param="model", code="model_not_found")


def parse_stop(stop, param: str = "stop") -> tuple:
    """OpenAI's stop: a string or a list of at most MAX_STOP."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        return tuple(stop)
    raise bad(param, f"expected a string or a list of at most {MAX_STOP} strings")


def parse_sampling(raw: dict, svc, names: dict | None = None) -> SamplingParams:
    """The request's sampling settings over the checkpoint's defaults; seed: random unless given.
    names: what the request calls them, where it is not OpenAI's name."""
    d = svc.generation_defaults
    names = names or {}
    given = {k: (number if k != "top_k" else whole)(raw, names.get(k, k), *rng)
             for k, rng in (("temperature", (0, 2)), ("top_p", (0, 1)), ("top_k", (0, 1 << 31)), ("min_p", (0, 1)))}
    seed = whole(raw, "seed", 0, (1 << 63) - 1)
    settings = {"temperature": d.temperature if d.do_sample else 0.0, "top_p": d.top_p, "top_k": d.top_k,
                "min_p": d.min_p}
    settings.update({k: v for k, v in given.items() if v is not None})
    settings["seed"] = seed if seed is not None else secrets.randbelow(1 << 31)
    try:
        return SamplingParams(**settings)
    except Ds4fError as exc:
        raise bad(exc.param or "sampling", exc.message.split(": ", 1)[-1]) from None
