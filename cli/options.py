"""The command line's options: one builder per option, used by every command that takes it."""
from __future__ import annotations

import argparse
import sys

from ds4f.api import Ds4fError
from ds4f.cli.output import FORMATS


def add_output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=FORMATS, default="text",
                        help="format of the tables on stdout: text (default), md, csv or json; "
                             "with md, csv and json stdout holds only the tables")


def add_dump_option(parser: argparse.ArgumentParser, kind: str) -> None:
    """--dump full|compact|off: the state dump the run writes (default: ds4f.toml's [dump] `kind`)."""
    parser.add_argument("--dump", choices=("full", "compact", "off"), default=None,
                        help="the state dump to write: full (every float of every layer: for short experiments),"
                             " compact (ids, routing, top logits, per-layer digests and sketches: a few KB a"
                             f" token) or off (default: ds4f.toml's [dump] {kind})")


def add_kv_options(parser) -> None:
    """The prefix cache's options of the text commands and the server."""
    parser.add_argument("--kv-dir", metavar="DIR", default=None,
                        help="where the prefix cache keeps session states on disk (default: ds4f.toml's [kv] dir)")
    parser.add_argument("--no-kv", action="store_true", help="reuse no kept prefix: compute every prompt whole")


def add_json_option(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    parser.add_argument("--json", metavar="PATH",
                        help=f"write {what} as JSON to PATH ('-': stdout, the other output then goes to stderr)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the --json file if it exists (never a file the command reads)")


def _model_options(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL", help=help_text)
    parser.add_argument("-m", "--model", dest="model_option", metavar="MODEL", help="the same as the MODEL argument")


def _model_arg(args) -> str | None:
    """MODEL, given as the argument or with -m; None when neither is."""
    if args.model and args.model_option and args.model != args.model_option:
        raise Ds4fError(f"-m {args.model_option} and MODEL {args.model}: give the model once")
    return args.model or args.model_option


def _default_model(args, config_path: str | None) -> str:
    """MODEL, else ds4f.toml's [model] path, else the demo model (made on first use, with bars)."""
    from ds4f.api import ensure_demo_model, load_config

    model = _model_arg(args)
    if model:
        return model
    cfg = load_config(config_path)
    if cfg.model_path:
        return cfg.model_path
    return str(ensure_demo_model(progress=True, announce=_announce))


def _announce(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


SPEC_HELP = ("speculative decoding with the checkpoint's MTP layer: off (default) | auto (drafts per round"
             " where they pay, measured) | 1..3 drafts per round; the output is the same tokens")


def add_spec_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default="off", metavar="auto|off|K", help=SPEC_HELP)
