"""`ds4f-console`'s entry point: the console's command line, with what `--serve` starts.

The console reaches the engine only through ds4f.api and never imports the server; `--serve` (a
`ds4f serve` in the console's own process, on loopback, watched and steered by the attached
console) is put together here, where both may be imported. The options it shares with the `ds4f`
commands come from their one builder each (ds4f.cli.options); the console adds its own.
"""
from __future__ import annotations

import argparse
import secrets
import sys

from ds4f.api import Ds4fError
from ds4f.cli.options import (add_config, add_model, add_operator_token, add_parallel, add_preset, add_token_file,
                              model_arg)
from ds4f.console import app as console_app


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4f-console", description=console_app.DESCRIPTION)
    add_config(parser)
    add_model(parser, "checkpoint to run (default: ds4f.toml's [model] path, else the demo model)")
    add_preset(parser, "ds4f.toml's engine.preset; p cycles presets")
    add_parallel(parser, 1, note="runs that may go at once: r starts another while one runs")
    console_app.configure(parser)
    add_operator_token(parser, "with --attach: the servers'; default: the token file a server on this machine names"
                               " in GET /status, when this user can read it")
    add_token_file(parser, "with --attach: a server's started with ds4f serve --token-file")
    return parser


def main(argv: list[str] | None = None, serve_here=serve_here) -> int:
    """ds4f-console [MODEL] [options]; serve_here=None: a console that cannot start a server (--serve refused)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.model = model_arg(args)
    except Ds4fError as exc:
        parser.error(str(exc))
    return console_app.run(args, parser, serve_here)


if __name__ == "__main__":
    sys.exit(main())
