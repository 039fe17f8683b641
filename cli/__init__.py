"""`ds4f` command line: one subcommand per module in this package.

Each command module defines `configure(name, parser)` (add its arguments) and `run(args) -> int`.
Modules are imported only when their command runs, so `ds4f --help` stays fast.
The engine is reached only through ds4f.api (tests/test_layering.py checks it), like the
console and the server do.
A Ds4fError (bad input, missing file, bad config) is printed as one line, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench-kernels": ("ds4f.cli.kernels", "benchmark the native kernels on the real expert shapes"),
    "synth": ("ds4f.cli.checkpoints", "write a synthetic checkpoint in the official format"),
    "convert": ("ds4f.cli.checkpoints", "convert official shards to the ds4f layout"),
    "verify": ("ds4f.cli.checkpoints", "check a checkpoint's structure, sizes and checksums"),
    "generate": ("ds4f.cli.text", "generate text from a prompt, streamed as it is produced"),
    "chat": ("ds4f.cli.text", "chat with the model in the terminal"),
    "run": ("ds4f.cli.runs", "decode tokens with the streaming engine (token ids, full figures)"),
    "diff": ("ds4f.cli.runs", "compare two state dumps"),
    "probe-disk": ("ds4f.cli.runs", "measure the NVMe floor with direct reads"),
    "bench": ("ds4f.cli.bench", "benchmarks: `bench engine`, `bench cache`, `bench console`, `bench prefill`, `bench chat`, `bench batch`, `bench spec`"),
    "serve": ("ds4f.cli.serve", "serve the engine over HTTP"),
    "replay": ("ds4f.cli.cache", "replay a routing trace through a cache policy"),
    "trace": ("ds4f.cli.cache", "export a run's routing trace"),
    "history": ("ds4f.cli.history", "list, show and prune the recorded runs"),
    "plan": ("ds4f.cli.plan", "the memory plan of a model under a preset, without its weights"),
}


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("ds4f")
    except Exception:  # not installed as a distribution (run from a source tree)
        from ds4f import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4f", description="ds4f: disk-streaming DeepSeek-V4-Flash")
    parser.add_argument("--version", action="version", version=f"ds4f {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv or ["--help"])
        return 2
    from ds4f.api import Ds4fError

    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"ds4f {name}", description=COMMANDS[name][1])
    module.configure(name, parser)
    args = parser.parse_args(argv[1:])
    args.command = name
    try:
        return int(module.run(args) or 0)
    except Ds4fError as exc:
        print(f"ds4f {name}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ds4f diff a b | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print(f"ds4f {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, not bad input: one line, the traceback on request
        if os.environ.get("DS4F_DEBUG"):
            raise
        print(f"ds4f {name}: internal error: {type(exc).__name__}: {exc} (DS4F_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 70


if __name__ == "__main__":
    sys.exit(main())
