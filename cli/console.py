"""`ds4f-console`'s entry point: the console's command line, with what `--serve` starts.

The console reaches the engine only through ds4f.api and never imports the server; `--serve` (a
`ds4f serve` in the console's own process, on loopback, watched and steered by the attached
console) is put together here, where both may be imported.
"""
from __future__ import annotations

import secrets
import sys

from ds4f.api import Ds4fError
from ds4f.console.app import main as console_main


def serve_here(*, model: str | None = None, preset: str | None = None, config_path: str | None = None,
               port: int = 0, parallel: int | None = None, **options):
    """A `ds4f serve` in this process on 127.0.0.1:`port`, with an operator token of its own ->
    (the started Server, that token). The console attached to it loads no engine of its own: the
    server's one engine serves both."""
    from ds4f.server.app import Server, ServerOptions

    token = secrets.token_urlsafe(24)
    try:
        server = Server(ServerOptions(model=model, preset=preset, config_path=config_path, host="127.0.0.1",
                                      port=port, parallel=parallel, operator_token=token, access_log=False,
                                      **options))
        server.start()
    except OSError as exc:
        raise Ds4fError(f"--serve {port}: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}") from None
    return server, token


def main(argv: list[str] | None = None) -> int:
    return console_main(argv, serve_here=serve_here)


if __name__ == "__main__":
    sys.exit(main())
