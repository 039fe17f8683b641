"""`ds4f serve`: the engine over HTTP, on the same run API as the console and the CLI.

    server = make_server(ServerOptions(model=path, port=0))   # validates, binds, does not serve yet
    threading.Thread(target=server.serve_forever).start()
    ...; server.service.close(); server.shutdown(); server.server_close()

The endpoints are listed in ds4f.server.routes; all answer JSON except /metrics and the state
download. One run at a time (the kernel backend and thread count are process-wide), on one
engine kept loaded between runs. Standard library only: ThreadingHTTPServer with a cap on
concurrent connections, socket timeouts, a body size limit, and strict parameter checks that
name the parameter. When a bearer token is set, every endpoint requires it; a bind beyond
loopback without one is refused.

    transport.py  HTTP: options, token, Host and cross-site checks, body limits, JSON answers
    routes.py     the URL table and the parsing of run parameters
    service.py    the Service: runs, their views, the history, busy answers, the engine host
    metrics.py    the Prometheus text exposition
"""
from __future__ import annotations

from ds4f.api import Ds4fError

from .routes import ROUTES
from .service import Service
from .transport import DEFAULT_HOST, DEFAULT_PORT, Ds4fHTTPServer, ServerOptions, is_loopback, read_token_file

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "Ds4fHTTPServer", "ServerOptions", "Service", "is_loopback",
           "make_server", "read_token_file"]


def make_server(options: ServerOptions, start_run=None) -> Ds4fHTTPServer:
    """Check the options, open the model, bind. Ds4fError on anything the operator must fix.

    start_run: a stand-in for ds4f.api.start_run (see Service)."""
    if not is_loopback(options.host) and not options.token:
        raise Ds4fError(f"--host {options.host}: serving beyond loopback requires a bearer token; "
                        f"write one to a file readable only by you and pass --token-file PATH")
    if not 0 <= options.port <= 65535:
        raise Ds4fError(f"--port: must be between 0 and 65535, got {options.port}")
    service = Service(options, start_run=start_run)
    try:
        return Ds4fHTTPServer(service, options, ROUTES)
    except OSError as exc:
        service.close()
        raise Ds4fError(f"cannot listen on {options.host}:{options.port}: {exc.strerror or exc}") from None
    except UnicodeError as exc:
        service.close()
        raise Ds4fError(f"--host {options.host}: {exc}") from None
