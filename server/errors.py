"""Answers of `ds4f serve` that are not a success, and JSON answers in general.

Every error has OpenAI's shape, so one client-side handler reads them all (on the Messages API's
paths, Anthropic's: {"type": "error", "error": {"type", "message"}}):

    {"error": {"message": "n: only 1 choice per request is supported, got 2",
               "type": "invalid_request_error", "param": "n", "code": "unsupported_value"}}

The message starts with the parameter it concerns; an error may carry a few more fields (the
busy run's id, a run's state) beside these four.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from starlette.responses import Response

# OpenAI's error types by status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               409: "conflict_error", 410: "not_found_error", 411: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


# Anthropic's error types by status (the Messages API's shape: {"type": "error", "error": {type, message}})
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                         409: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)     # paths whose errors take Anthropic's shape


class HttpError(Exception):
    """An answer other than success: status, a one-line message, the parameter it concerns."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, extra: dict | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code = int(status), message, param, code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})
        if close:   # the rest of the connection's bytes are not a request we can trust
            self.headers["Connection"] = "close"

    def body(self) -> dict:
        err = {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error" if self.status >= 500
                                                                  else "invalid_request_error"),
               "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_ERROR_TYPES.get(self.status) or ("api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message, **self.extra}}

    def response(self, path: str = "") -> Response:
        """The answer; on the Messages API's paths in Anthropic's error shape."""
        anthropic = path.startswith(ANTHROPIC_PATHS)
        return json_response(self.status, self.anthropic_body() if anthropic else self.body(), self.headers)


def bad(param: str | None, message: str, code: str = "invalid_value") -> HttpError:
    """400 naming the parameter: `param: message`."""
    return HttpError(400, f"{param}: {message}" if param else message, param=param, code=code)


def json_safe(value):
    """JSON-safe: tuples to lists, non-finite floats to None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def json_bytes(obj) -> bytes:
    """The JSON of an answer, UTF-8; a string that is not text (a lone surrogate a client sent in a
    field the answer echoes, such as metadata) is written as its escape, as the client sent it."""
    safe = json_safe(obj)
    try:
        return json.dumps(safe, allow_nan=False, ensure_ascii=False).encode() + b"\n"
    except UnicodeEncodeError:
        return json.dumps(safe, allow_nan=False).encode() + b"\n"


def json_response(status: int, obj, headers: dict | None = None) -> Response:
    return Response(json_bytes(obj), status, headers=headers, media_type="application/json")
