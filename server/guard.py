"""The ASGI middleware every request passes before an endpoint sees it.

In order: the bearer token (when one is set; Anthropic's clients send it as `x-api-key`, taken
too); the Host header (a loopback server answers only to loopback names, so DNS rebinding cannot
reach it); requests a browser marks as cross-site (Sec-Fetch-Site); for a request that starts
or cancels a run (any method but GET and HEAD, and the GET /run alias) an Origin or Referer
naming another site; the body, read whole within a size limit and a deadline for all of it
(408), so a client trickling its body cannot hold a request open; and a cap on the requests in
progress from one client address (its fair share), counted once a request's body has come (a
connection still sending one is a waiting one, ds4f.server.protocol). It adds Cache-Control: no-store, counts
every answer for /metrics, writes the access log: one line per request on stderr, with a
timestamp, and tells the watchers of /events of every refusal (a 4xx or a 503, and why).
The operator's endpoints (/operator/...) check the operator's token themselves, in place of the
API token.
"""
from __future__ import annotations

import asyncio
import hmac
import sys
import time
import traceback
from collections import Counter
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.routing import Match

from .errors import HttpError
from .events import error_of
from .options import ServerOptions, is_loopback

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")   # methods that change nothing...
ACTING_GETS = ("/run",)                      # ...except on these paths (the compatibility alias)
OPERATOR_PATHS = "/operator/"                # their own token (ds4f.server.operator)
REFUSAL_BODY = 4096                          # the bytes of an error answer read for the log
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _url_endpoint(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an absolute http(s) URL, the port from the scheme when it names
    none; None for anything else ("null", a relative or malformed URL, user info)."""
    try:
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username is not None:
            return None
        port = parts.port
    except ValueError:
        return None
    return scheme, parts.hostname.lower(), _DEFAULT_PORTS[scheme] if port is None else port


def _authority_endpoint(authority: str, scheme: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of a Host header's value, the port from `scheme` when it names none."""
    endpoint = _url_endpoint(f"{scheme}://{authority.strip()}")
    if endpoint is None or any(c in authority for c in "/?#"):
        return None
    return endpoint


def _host_name(host: str) -> str:
    name = host.strip()
    if name.startswith("["):
        return name[1:name.find("]")] if "]" in name else name
    return name.rsplit(":", 1)[0] if name.count(":") == 1 else name


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then what the connection says (a disconnect)."""
    given = False

    async def replayed():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed


class Guard:
    def __init__(self, app, options: ServerOptions, metrics, routes, events=None):
        self.app = app
        self.options = options
        self.metrics = metrics
        self.routes = routes            # Starlette routes: their path templates label the metrics
        self.events = events            # the EventHub refusals are logged to (None: not logged)
        self.in_progress: Counter = Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        sent = {"status": None, "bytes": 0, "error": b""}

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"cache-control" for k, _ in headers):
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                sent["bytes"] += len(body)
                if sent["status"] >= 400 and len(sent["error"]) < REFUSAL_BODY:
                    sent["error"] += body[:REFUSAL_BODY - len(sent["error"])]
            await send(message)

        client = scope["client"][0] if scope.get("client") else "-"
        counted = False
        try:
            self._check(scope)
            # the body first: a request whose body is still coming holds no place of the requests in
            # progress (its connection is a waiting one, closed first when another needs room)
            body = await self._read_body(scope, receive)
            if body is not None:   # None: the client left before its body came
                if self.in_progress[client] >= self.options.max_client_requests:
                    self.metrics.rejections.labels("client_requests").inc()
                    raise HttpError(429, f"too many requests in progress from your address (at most "
                                         f"{self.options.max_client_requests} at a time)", code="too_many_requests",
                                    headers={"Retry-After": "1"})
                self.in_progress[client] += 1
                counted = True
                await self.app(scope, _replay(body, receive), send_and_note)
        except HttpError as exc:
            if sent["status"] is None:
                await exc.response(scope["path"])(scope, receive, send_and_note)
        except Exception as exc:   # a bug: the traceback on stderr, a 500 if nothing was sent yet
            sys.stderr.write(f"ds4f serve: error in {scope['method']} {scope['path']}:\n{traceback.format_exc()}")
            if sent["status"] is None:
                await HttpError(500, f"internal error: {type(exc).__name__}: {exc}",
                                code="internal_error").response(scope["path"])(scope, receive, send_and_note)
        finally:
            if counted:
                self.in_progress[client] -= 1
                if self.in_progress[client] <= 0:
                    del self.in_progress[client]
            self._account(scope, client, sent, time.perf_counter() - t0)

    # -- checks ---------------------------------------------------------------------------------
    def _check(self, scope) -> None:
        headers = Headers(scope=scope)
        if not scope["path"].startswith(OPERATOR_PATHS):
            self._authorize(headers)
        host = headers.get("host")
        if host is not None and is_loopback(self.options.host) and not is_loopback(_host_name(host)):
            raise HttpError(403, f"Host: {host[:80]!r} is not a loopback name; this server answers only to "
                                 f"localhost, 127.0.0.1 and [::1]", param="Host", code="foreign_host")
        if headers.get("sec-fetch-site", "").strip().lower() in ("cross-site", "same-site"):
            raise HttpError(403, "Sec-Fetch-Site: cross-site browser requests are refused", param="Sec-Fetch-Site",
                            code="cross_site")
        if scope["method"] not in SAFE_METHODS or scope["path"] in ACTING_GETS:
            self._check_same_origin(scope, headers)

    def _authorize(self, headers: Headers) -> None:
        token = self.options.token
        if not token:
            return
        expected = token.encode("ascii")
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer" and hmac.compare_digest(
            credentials.strip().encode("latin-1", "replace"), expected)
        api_key = headers.get("x-api-key")    # Anthropic's clients send the key so
        keyed = api_key is not None and hmac.compare_digest(api_key.strip().encode("latin-1", "replace"), expected)
        if not (bearer or keyed):
            raise HttpError(401, "Authorization: a bearer token is required: Authorization: Bearer <token> (or, as "
                                 "Anthropic's clients send it, x-api-key: <token>)",
                            param="Authorization", code="invalid_api_key",
                            headers={"WWW-Authenticate": 'Bearer realm="ds4f"'})

    def _check_same_origin(self, scope, headers: Headers) -> None:
        """An Origin or Referer header, when sent, must name this server: the host and port the
        request was addressed to (its Host header) or the address the server listens on. A page
        elsewhere that makes a browser send a request here (a form, an <img>, fetch without CORS)
        is refused; clients that send neither header (curl, scripts, SDKs), or send it empty,
        are not concerned."""
        for header in ("Origin", "Referer"):
            value = (headers.get(header) or "").strip()
            if value and not self._names_this_server(value, scope, headers):
                own_host, own_port = scope["server"][:2] if scope.get("server") else ("?", 0)
                raise HttpError(403, f"{header}: {value[:80]!r} is not this server ({own_host}:{own_port}); a "
                                     f"request that starts or cancels a run is refused from a web page of another "
                                     f"site", param=header, code="cross_site")

    @staticmethod
    def _names_this_server(url: str, scope, headers: Headers) -> bool:
        origin = _url_endpoint(url)
        if origin is None:
            return False   # "null" (a sandboxed page, a file), or not a URL: nothing vouches for it
        _scheme, name, port = origin
        if scope.get("server"):
            own_host, own_port = str(scope["server"][0]).lower(), scope["server"][1]
            if port == own_port and (name == own_host or (name == "localhost" and own_host in ("127.0.0.1", "::1"))):
                return True
        addressed = headers.get("host")
        return addressed is not None and _authority_endpoint(addressed, origin[0]) == origin

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body within the size limit and the deadline; None if the client left."""
        limit = self.options.max_body_bytes
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            raise HttpError(413, f"body: {int(length)} bytes is over the limit of {limit}", param="body",
                            code="request_too_large", close=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.body_timeout_s
        chunks, n = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise HttpError(408, f"body: the request body did not arrive within "
                                     f"{self.options.body_timeout_s:g} s ({n} bytes came)", param="body",
                                code="timeout", close=True) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            n += len(chunk)
            if n > limit:
                raise HttpError(413, f"body: over the limit of {limit} bytes", param="body", code="request_too_large",
                                close=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    # -- accounting -----------------------------------------------------------------------------
    def _endpoint(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return route.path
        return "other"

    def _account(self, scope, client: str, sent: dict, seconds: float) -> None:
        status = sent["status"]
        self.metrics.request(self._endpoint(scope), scope["method"], status or 0)
        if self.events is not None and status is not None and (400 <= status < 500 or status == 503):
            code, message = error_of(sent["error"])
            self.events.log("refused", f"{scope['method']} {scope['path'][:200]} from {client}: {status}"
                                       + (f" {code}" if code else "") + (f": {message}" if message else ""))
        if not self.options.access_log:
            return
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        target = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        target = target[:200].encode("unicode_escape").decode("ascii").replace('"', '\\"')
        sys.stderr.write(f"ds4f serve: {stamp} {client} \"{scope['method']} {target} HTTP/{scope['http_version']}\" "
                         f"{status or '-'} {sent['bytes']} {seconds:.3f}s\n")
