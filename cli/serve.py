"""`ds4f serve`: the engine over HTTP, with an OpenAI-compatible API (see ds4f.server.app).

Prints "ds4f serve: listening on http://HOST:PORT" on stdout once it accepts connections.
SIGINT or SIGTERM: refuse new runs, turn queued requests away, cancel the active run and wait
for it (the run API removes its partial files), stop serving, exit 0 (1 if the run did not stop
within --stop-timeout).
"""
from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import threading

from ds4f.api import Ds4fError
from ds4f.cli.options import (add_config, add_dump_option, add_gen, add_kv_options, add_model, add_operator_token,
                              add_parallel, add_preset, add_spec, add_token_file, model_arg)


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    from ds4f.server.app import DEFAULT_HOST, DEFAULT_PORT, ServerOptions

    defaults = ServerOptions()
    parser.allow_abbrev = False   # `--token X` must not be taken for --token-file
    add_model(parser, "checkpoint (default: ds4f.toml's [model] path, else the demo model)")
    add_preset(parser)
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to bind (default {DEFAULT_HOST}; beyond loopback needs --token-file)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free port)")
    add_token_file(parser, "every request must send it")
    parser.add_argument("--token", metavar="TOKEN", help=argparse.SUPPRESS)
    add_operator_token(parser, "default: ds4f.toml's [server] operator_token, else a random one written to a file"
                               " only you can read; GET /status names it")
    parser.add_argument("--operator-remote", action="store_true", default=None,
                        help="let peers beyond loopback use the operator's endpoints (default: ds4f.toml's "
                             "[server] operator_remote, else loopback only)")
    add_config(parser)
    parser.add_argument("--queue", type=int, default=defaults.queue_size, metavar="N",
                        help=f"requests that may wait for the engine; more get 429 (default {defaults.queue_size})")
    add_parallel(parser, None, "ds4f.toml's [server] parallel; 0 there: as many as the memory plan fits, at most 4")
    add_gen(parser, "what the context leaves after the prompt", max_tokens=True, dest="max_tokens",
            note="in an answer whose request gives no max_tokens (chat completions, Responses)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the names requests may give as `model`; the first is what /v1/models lists and "
                             "answers report (default: ds4f.toml's [server] served_model_name, else the "
                             "checkpoint directory's name, which is always taken)")
    parser.add_argument("--stop-timeout", type=float, default=60.0, metavar="S",
                        help="on SIGINT/SIGTERM, how long to wait for the active run to cancel (default 60)")
    parser.add_argument("--quiet", action="store_true", help="no access log lines on stderr")
    add_spec(parser, "of every run: auto steps plainly while sequences step together, K needs one sequence at"
                     " a time (--parallel 1, the default with K)")
    add_kv_options(parser)
    add_dump_option(parser, "server")
    parser.epilog = ("endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, "
                     "GET /metrics, GET /status, POST /runs, GET /runs, GET|PATCH|DELETE /runs/ID, "
                     "GET /runs/ID/state, GET /events, POST /operator/ACTION (GET / lists them)")


def _say(message: str) -> None:
    print(f"ds4f serve: {message}", file=sys.stderr, flush=True)


def _prefix_cache_line(cfg, options) -> str:
    """The startup line on the prefix cache: off, or its RAM tier and its directory; a directory
    that a file has taken the place of since the config was read is said here (RAM only)."""
    from ds4f.api import directory_problem, format_bytes

    kv = cfg.kv
    if kv is None or not options.reuse_prefix:
        return "prefix cache: off" + ("" if kv is None else " (--no-kv)")
    ram = f"{format_bytes(kv.ram_bytes)} of kept states in RAM"
    where = (options.kv_dir or kv.dir) if kv.disk_bytes else None
    if where is None:
        return f"prefix cache: {ram}, none on disk (kv.budget 0)"
    problem = directory_problem(where)
    if problem is not None:
        return f"prefix cache: {ram} only: {problem}"
    return f"prefix cache: {ram}, {format_bytes(kv.disk_bytes)} in {where}"


def run(args) -> int:
    from ds4f.server.app import Server, ServerOptions, read_token_file

    if args.token is not None:
        raise Ds4fError("--token: the token is read from a file, never from the command line "
                        "(it would show in ps and the shell history); use --token-file PATH")
    token = None
    if args.token_file:
        token = read_token_file(args.token_file)
        try:
            if os.stat(args.token_file).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                _say(f"warning: {args.token_file} is readable by other users; chmod 600 it")
        except OSError:
            pass
    options = ServerOptions(model=model_arg(args), preset=args.preset, config_path=args.config, host=args.host,
                            port=args.port, token=token, queue_size=args.queue,
                            default_max_tokens=args.max_tokens, access_log=not args.quiet,
                            served_model_names=tuple(args.served_model_name or ()),
                            kv_dir=args.kv_dir, reuse_prefix=not args.no_kv, parallel=args.parallel,
                            spec=args.spec, dump=args.dump, operator_token=args.operator_token,
                            operator_remote=args.operator_remote)
    server = Server(options)
    service = server.service

    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        if stop.is_set():
            _say(f"{signal.Signals(signum).name} again: still waiting for the run to cancel "
                 f"(at most {args.stop_timeout:g} s)")
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        auth = "bearer token required" if token else "no token (loopback only)"
        names = ", ".join(map(repr, service.model_names))
        _say(f"model {service.model} ({service.checkpoint_kind}) as {names}, preset {service.preset}, "
             f"kernels {service.best_backend}, {service.parallel} sequences at once"
             f"{f' ({service.parallel_why})' if service.parallel_why else ''}, queue {options.queue_size}, history {service.history.path}, {auth}")
        operator = service.operator
        where = (f"token in {operator.token_file}" if operator.token_file else "token from --operator-token"
                 if args.operator_token else "token from ds4f.toml [server] operator_token")
        _say(f"operator endpoints (POST /operator/...): {where}, "
             + ("any peer" if operator.remote else "loopback peers only"))
        _say(_prefix_cache_line(service.cfg, options))
        print(f"ds4f serve: listening on {server.url}", flush=True)
        while not stop.wait(0.5):
            if not server.serving:
                _say("error: the HTTP server stopped unexpectedly")
                break
        current = service.current_run
        if current is not None and not current.finished:
            _say(f"stopping: cancelling run {current.id}")
        stopped = server.stop(timeout=args.stop_timeout)
        if not stopped:
            _say(f"error: run {current.id} did not stop within {args.stop_timeout:g} s")
            return 1
        _say("stopped")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
