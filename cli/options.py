"""The command line's options: one builder per option, used by every command that takes it.

An option means the same on every command that has it, with the same spelling, values and help;
where a command needs to say more (what its default is, what it does with the value), it passes
that in and the builder adds it to the one text. The readers beside the builders (`model_arg`,
`default_model`, `geometry_name`) turn a parsed option into what the command uses.
"""
from __future__ import annotations

import argparse
import sys

from ds4f.api import Ds4fError
from ds4f.cli.output import FORMATS


# -- the config and the model ---------------------------------------------------------------------
def add_config(parser: argparse.ArgumentParser, *, dest: str = "config", hidden: bool = False) -> None:
    """--config PATH. hidden: a second spelling place (e.g. after a subcommand), left out of --help."""
    parser.add_argument("--config", metavar="PATH", dest=dest,
                        help=argparse.SUPPRESS if hidden else
                        "ds4f.toml to use (default: ./ds4f.toml, then the user config dir, then the built-in one)")


def add_model(parser: argparse.ArgumentParser, help_text: str) -> None:
    """MODEL, as the argument or with -m/--model (read it with `model_arg`)."""
    parser.add_argument("model", nargs="?", metavar="MODEL", help=help_text)
    parser.add_argument("-m", "--model", dest="model_option", metavar="MODEL", help="the same as the MODEL argument")


def model_arg(args) -> str | None:
    """MODEL, given as the argument or with -m; None when neither is."""
    if args.model and args.model_option and args.model != args.model_option:
        raise Ds4fError(f"-m {args.model_option} and MODEL {args.model}: give the model once")
    return args.model or args.model_option


def default_model(args, config_path: str | None) -> str:
    """MODEL, else ds4f.toml's [model] path, else the demo model (made on first use, with bars)."""
    from ds4f.api import ensure_demo_model, load_settings

    model = model_arg(args)
    if model:
        return model
    cfg = load_settings(config_path).engine
    if cfg.model_path:
        return cfg.model_path
    return str(ensure_demo_model(progress=True, announce=announce))


def announce(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_preset(parser: argparse.ArgumentParser, default: str = "ds4f.toml's engine.preset") -> None:
    parser.add_argument("--preset", metavar="NAME", default=None,
                        help=f"a preset of ds4f.toml's [presets] (default: {default})")


def add_geometry(parser: argparse.ArgumentParser, default: str) -> None:
    """--geometry NAME (read it with `geometry_name`: `real` is flash)."""
    from ds4f.api import GEOMETRIES

    parser.add_argument("--geometry", default=default, choices=(*sorted(GEOMETRIES), "real"), metavar="NAME",
                        help=f"a named geometry ({', '.join(sorted(GEOMETRIES))}; `real` = flash, the released"
                             f" model; default {default})")


def geometry_name(args) -> str:
    return "flash" if args.geometry == "real" else args.geometry


# -- how a run goes -------------------------------------------------------------------------------
def add_gen(parser: argparse.ArgumentParser, default: str, *, max_tokens: bool = False, dest: str = "gen",
            note: str = "") -> None:
    """-n/--gen N (max_tokens: also spelled --max-tokens, the text commands' and the server's name)."""
    flags = ("-n", "--max-tokens", "--gen") if max_tokens else ("-n", "--gen")
    parser.add_argument(*flags, dest=dest, type=int, default=None, metavar="N",
                        help=f"tokens to generate at most{f' {note}' if note else ''}"
                             f" (default{'' if default[:1].isdigit() else ':'} {default})")


def add_prompt(parser: argparse.ArgumentParser, *, token_ids: bool = False) -> None:
    """-p/--prompt: text (required), or token_ids: comma-separated token ids (default: bos)."""
    how = (dict(default=None, metavar="IDS", help="the prompt: comma-separated token ids (default: bos)") if token_ids
           else dict(required=True, metavar="TEXT", help="the prompt: its text (with --chat: the user's message)"))
    parser.add_argument("-p", "--prompt", **how)


def add_repeat(parser: argparse.ArgumentParser, default: int | None, what: str, default_text: str = "") -> None:
    parser.add_argument("--repeat", type=int, default=default, metavar="N",
                        help=f"measurements repeated: {what} (default {default_text or default})")


SPEC_HELP = ("speculative decoding with the checkpoint's MTP layer: off (default) | auto (drafts per round"
             " where they pay, measured; --spec alone) | 1..3 drafts per round; the output is the same tokens")


def add_spec(parser: argparse.ArgumentParser, note: str = "") -> None:
    """--spec [auto|off|K], `--spec` alone meaning auto; checked by ds4f.api.parse_spec."""
    parser.add_argument("--spec", nargs="?", const="auto", default="off", metavar="auto|off|K",
                        help=SPEC_HELP + (f"; {note}" if note else ""))


def add_parallel(parser: argparse.ArgumentParser, default: int | None, default_text: str | None = None,
                 note: str = "") -> None:
    parser.add_argument("--parallel", type=int, default=default, metavar="N",
                        help=f"sequences decoded together, one forward pass over their rows"
                             f"{f' ({note})' if note else ''} (default {default_text or default})")


def add_threads(parser, *, counts: bool = False, default: int | None = None, help: str | None = None) -> None:
    """-t/--threads N; counts: a comma-separated list of thread counts to measure (bench-kernels);
    default and help: a command whose threads do not come from ds4f.toml (bench llama's)."""
    how = (dict(metavar="N,...", help="kernel threads: comma-separated thread counts to measure (default: 1 and"
                                      " all cores)") if counts
           else dict(type=int, default=default, metavar="N",
                     help=help or "kernel threads (default: ds4f.toml's engine.kernel_threads; 0: all cores)"))
    parser.add_argument("-t", "--threads", **how)


def add_io_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--io-threads", type=int, default=None, metavar="N",
                        help="expert-read threads, the disk's queue depth (default: ds4f.toml's engine.io_threads)")


def add_backend(parser: argparse.ArgumentParser, note: str = "") -> None:
    parser.add_argument("--backend", default=None, metavar="NAME",
                        help="kernel backend: auto | scalar | avx2 | avx512 | neon (default: ds4f.toml's "
                             "engine.backend; with auto, DS4F_KERNELS if set)" + (f"; {note}" if note else ""))


def add_seed(parser: argparse.ArgumentParser, default: int | None) -> None:
    parser.add_argument("--seed", type=int, default=default, metavar="N",
                        help=f"random seed (default {default})" if default is not None else
                        "random seed (default: a random one, printed)")


def add_token_file(parser: argparse.ArgumentParser, note: str) -> None:
    parser.add_argument("--token-file", metavar="PATH",
                        help=f"the file holding the bearer token of requests (Authorization: Bearer ...): {note}")


def add_operator_token(parser: argparse.ArgumentParser, note: str) -> None:
    parser.add_argument("--operator-token", metavar="TOKEN",
                        help=f"the token of the operator's endpoints, POST /operator/... ({note})")


def add_history(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--history", action="store_true", help="record the runs in the history database")


# -- what a command writes ------------------------------------------------------------------------
def add_output_option(parser: argparse.ArgumentParser, formats: tuple[str, ...] = FORMATS) -> None:
    listed = ", ".join(f for f in formats if f != "text")
    parser.add_argument("-o", "--output", choices=formats, default="text",
                        help=f"format of what goes to stdout: text (default) or {listed}; "
                             f"with {listed} stdout holds only that")


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


def add_json(parser: argparse.ArgumentParser, what: str = "the results", *, to_file: bool = True,
             stdout: bool = True) -> None:
    """--json PATH (stdout: '-' writes to stdout); to_file=False: a flag, the JSON on stdout."""
    how = (dict(metavar="PATH", help=f"write {what} as JSON to PATH" +
                (" ('-': stdout, the other output then goes to stderr)" if stdout else "")) if to_file
           else dict(action="store_true", help=f"print {what} as JSON on stdout"))
    parser.add_argument("--json", **how)


def add_force(parser: argparse.ArgumentParser, what: str = "the --json file", replaces: str | None = None) -> None:
    """--force: overwrite `what` (replaces: only when it is that, anything else refused); never an input."""
    if replaces is None:
        text = f"overwrite {what} if it exists (never a file the command reads)"
    else:
        text = f"replace {what} if it is {replaces}; anything else is refused, and never a file the command reads"
    parser.add_argument("--force", action="store_true", help=text)


def add_json_option(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    """--json PATH and --force (over the --json file)."""
    add_json(parser, what)
    add_force(parser)
