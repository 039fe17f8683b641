"""HTTP plumbing of `ds4f serve`, on the standard library's http.server.

What is here knows HTTP and nothing of runs: the options of the listener, bearer-token
authorization, the Host, Origin, Referer and cross-site checks that keep web pages out, body
size limits, socket timeouts, a cap on concurrent connections, and answers as JSON (errors
included).

A route is a function `(request, **path_groups) -> Response`; the server is given a table of
them (see ds4f.server.routes) and an object with `count_response(status)` that is told the
status of every answer (the Service, for /metrics).
"""
from __future__ import annotations

import hashlib
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
import traceback
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO, Callable
from urllib.parse import unquote, urlsplit

from ds4f import __version__
from ds4f.api import Ds4fError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8734
MAX_BODY_BYTES = 64 * 1024          # POST bodies; larger ones get 413
MIN_TOKEN_CHARS = 16
_TOKEN_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")   # RFC 6750 b64token
_LENGTH_RE = re.compile(r"[0-9]{1,20}")
_DEFAULT_PORTS = {"http": 80, "https": 443}


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


# -- answers -------------------------------------------------------------------------------------
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
    """400 naming the parameter: `param: message`."""
    return HttpError(400, f"{param}: {message}" if param else message, param=param)


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
    return json.dumps(json_safe(obj), allow_nan=False).encode() + b"\n"


@dataclass
class Response:
    """A whole answer in memory; every one is sent with Cache-Control: no-store."""
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict = field(default_factory=dict)


def json_response(status: int, obj, headers: dict | None = None) -> Response:
    return Response(status, json_bytes(obj), "application/json", dict(headers or {}))


@dataclass
class FileResponse:
    """An open file sent as 200 with its size as Content-Length; the transport closes it.

    sha256: what the file's bytes must hash to. The last chunk is held back until the bytes sent
    before it and it hash to that; if they do not (the file changed while being sent), the
    connection is closed short of Content-Length, so the client never gets a whole body that is
    not the one named."""
    file: BinaryIO
    content_type: str = "application/octet-stream"
    headers: dict = field(default_factory=dict)
    sha256: str | None = None


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


# -- requests ------------------------------------------------------------------------------------
Route = Callable[..., "Response | FileResponse"]
Routes = tuple[tuple[re.Pattern, dict[str, Route]], ...]    # path pattern -> {method: route}
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")   # methods that change nothing, unless a route says otherwise


def changes_state(route: Route) -> Route:
    """Mark a route of a safe method that changes state (a GET that starts a run): it gets the
    Origin and Referer checks that every other method gets."""
    route.changes_state = True
    return route


class Request:
    """What a route sees of a request: the query string, the headers, the body, the service."""

    def __init__(self, handler: "Handler", method: str, path: str, query: str):
        self._handler = handler
        self.method, self.path, self.query = method, path, query
        self.headers = handler.headers
        self.service = handler.server.service

    def body(self) -> bytes:
        """The body, read within the size limit (411 chunked, 413 too large, 400 short)."""
        return self._handler.read_body()

    def no_body(self) -> None:
        """For endpoints that take no body: one sent anyway makes the connection close after."""
        self._handler.no_body()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ds4f/{__version__}"
    sys_version = ""
    server: "Ds4fHTTPServer"

    def version_string(self) -> str:
        return self.server_version

    def setup(self) -> None:
        self.timeout = self.server.options.request_timeout_s
        super().setup()

    def log_message(self, format: str, *args) -> None:
        if self.server.options.access_log:
            sys.stderr.write(f"ds4f serve: {self.address_string()} {format % args}\n")

    def send_response(self, code: int, message: str | None = None) -> None:
        self.server.service.count_response(code)
        super().send_response(code, message)

    # -- sending ------------------------------------------------------------------------------------
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
        self._send_bytes(status, json_bytes(obj), "application/json", headers)

    def _send_file(self, answer: FileResponse) -> None:
        with answer.file as f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", answer.content_type)
            self.send_header("Content-Length", str(size))
            for key, value in answer.headers.items():
                self.send_header(key, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            digest = hashlib.sha256() if answer.sha256 else None
            held = b""          # with a digest to check: the last chunk read, not sent yet
            remaining = size
            while remaining > 0:
                chunk = f.read(min(1 << 20, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
                if digest is None:
                    self.wfile.write(chunk)
                    continue
                digest.update(chunk)
                if held:
                    self.wfile.write(held)
                held = chunk
            if digest is not None and not remaining and digest.hexdigest() == answer.sha256:
                self.wfile.write(held)
            elif digest is not None or remaining:
                # the file shrank or changed under us: the client sees a short body, not a lie
                self.close_connection = True
                sys.stderr.write(f"ds4f serve: {self.path}: the file changed while it was sent; "
                                 f"the connection was closed before the end of the body\n")

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
            if method not in SAFE_METHODS:
                self._check_same_origin()
            url = urlsplit(self.path)
            path = unquote(url.path)
            for pattern, methods in self.server.routes:
                m = pattern.match(path)
                if m is None:
                    continue
                if method not in methods:
                    raise HttpError(405, f"{method} is not allowed on {path} (allowed: {', '.join(methods)})",
                                    headers={"Allow": ", ".join(methods)})
                route = methods[method]
                if getattr(route, "changes_state", False):
                    self._check_same_origin()
                answer = route(Request(self, method, path, url.query), **m.groupdict())
                if isinstance(answer, FileResponse):
                    self._send_file(answer)
                else:
                    self._send_bytes(answer.status, answer.body, answer.content_type, answer.headers)
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

    def _check_same_origin(self) -> None:
        """For requests that change state: an Origin or Referer header, when sent, must name this
        server, i.e. the host and port the request was addressed to (its Host header) or the
        address the server listens on. A page elsewhere that makes the browser send a request
        here (a form, an <img>, fetch without CORS) is refused; clients that send neither header
        (curl, scripts), or send it empty, are not concerned."""
        for header in ("Origin", "Referer"):
            value = (self.headers.get(header) or "").strip()
            if value and not self._names_this_server(value):
                raise HttpError(403, f"{header}: {value[:80]!r} is not this server ({self._own_address()}); a "
                                     f"request that changes state is refused from a web page of another site",
                                param=header)

    def _own_address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def _names_this_server(self, url: str) -> bool:
        """Does the URL (an Origin or a Referer) name this server's host and port?"""
        origin = _url_endpoint(url)
        if origin is None:
            return False   # "null" (a sandboxed page, a file), or not a URL: nothing to vouch for it
        _scheme, name, port = origin
        own_host, own_port = self.server.server_address[:2]
        own_host = str(own_host).lower()
        if port == own_port and (name == own_host or (name == "localhost" and own_host in ("127.0.0.1", "::1"))):
            return True
        addressed = self.headers.get("Host")
        if addressed is None:
            return False
        return _authority_endpoint(addressed, origin[0]) == origin

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

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "send the body with a Content-Length (chunked bodies are not accepted)")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            self._body_read = True
            return b""
        if not _LENGTH_RE.fullmatch(length_text.strip()):
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

    def no_body(self) -> None:
        if self._has_unread_body():
            self.close_connection = True


class Ds4fHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on concurrent connections (503 beyond it) and no DNS at bind."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, service, options: ServerOptions, routes: Routes):
        self.service = service
        self.options = options
        self.routes = routes
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
