"""`ds4f generate` and `ds4f chat`: text in, text out, streamed as the model produces it.

    ds4f generate [MODEL] -p "Once upon a time" -n 64 --temp 0.8 --seed 7
    ds4f generate -m MODEL --chat -p "What is an expert cache?"
    ds4f chat [MODEL]                       # /reset, /quit; Ctrl-C stops an answer, Ctrl-D leaves

The text goes to stdout as it is produced (each token's text once its UTF-8 is complete and it
cannot be the start of a stop string); the summary (prompt and generated tokens, tokens/s,
s/token, GB/token, hit rate) goes to stderr. Sampling defaults come from the checkpoint's
generation_config.json, else DeepSeek's recommendation (temperature 1.0, top-p 1.0); the seed
is drawn at random unless --seed gives it, and the summary prints it so a run can be repeated
exactly (same seed and settings: same tokens, same state dump). MODEL defaults to ds4f.toml's
[model] path, else the demo model, whose weights are random: its text is noise.
"""
from __future__ import annotations

import argparse
import secrets
import signal
import sys
from pathlib import Path

from ds4f.api import DEFAULT_GEN, Ds4fError
from ds4f.cli.options import (add_backend, add_config, add_dump_option, add_force, add_gen, add_history, add_io_threads,
                              add_json, add_kv_options, add_model, add_preset, add_prompt, add_seed, add_spec, add_threads,
                              default_model, model_arg)
from ds4f.cli.output import check_output, command_inputs, write_json
from ds4f.cli.runs import _per_second

DIM, RESET = "\x1b[2m", "\x1b[0m"


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    add_model(parser, "checkpoint with its tokenizer (default: ds4f.toml's [model], else the demo model)")
    if name == "generate":
        add_prompt(parser)
        parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format")
        parser.add_argument("--special-tokens", action="store_true",
                            help="without --chat: special-token strings in the prompt (<｜User｜>, </think>, ...) are"
                                 " their control tokens (default: plain text)")
        add_json(parser, "the run's report", stdout=False)
        add_force(parser)
    parser.add_argument("--system", default=None, help="chat: a system prompt")
    parser.add_argument("--think", action="store_true", help="chat: thinking mode (the model reasons first)")
    add_gen(parser, str(DEFAULT_GEN), max_tokens=True)
    parser.add_argument("--temp", type=float, default=None, help="temperature (0: greedy; default: the checkpoint's)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: the checkpoint's, else 1)")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the most likely's")
    add_seed(parser, None)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop before this text (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sentence token")
    add_preset(parser)
    add_threads(parser)
    add_io_threads(parser)
    add_backend(parser)
    parser.add_argument("--probe", action="store_true", help="measure the NVMe floor first (for the disk figures)")
    add_spec(parser)
    add_history(parser)
    add_dump_option(parser, "text")
    add_config(parser)
    add_kv_options(parser)


def run(args) -> int:
    return _generate(args) if args.command == "generate" else _chat(args)


class _Session:
    """What generate and chat share: the model, the loaded engine, the sampling settings, and one
    run at a time streamed to stdout."""

    def __init__(self, args) -> None:
        from ds4f.api import EngineHost, GenerationDefaults, History, load_settings

        self.args = args
        settings = load_settings(args.config)
        self.cfg = settings.engine
        if not args.no_kv:
            self.cfg.kv_directory(args.kv_dir)     # a --kv-dir that is a file refused now, not said later
        self.model = default_model(args, args.config)
        defaults = GenerationDefaults.load(self.model) if Path(self.model).is_dir() else GenerationDefaults()
        self.seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
        self.sampling = self._sampling(defaults)
        self.history = History(settings.history_path) if args.history else None
        self.host = EngineHost()
        self.color = sys.stdout.isatty()

    def _sampling(self, defaults):
        from ds4f.api import SamplingParams

        base = defaults.sampling(self.seed)
        a = self.args
        return SamplingParams(temperature=base.temperature if a.temp is None else a.temp,
                              top_k=base.top_k if a.top_k is None else a.top_k,
                              top_p=base.top_p if a.top_p is None else a.top_p,
                              min_p=base.min_p if a.min_p is None else a.min_p, seed=self.seed)

    def settings(self) -> str:
        s = self.sampling
        if s.greedy:
            return "greedy"
        return f"temp {s.temperature:g} · top-p {s.top_p:g} · top-k {s.top_k} · min-p {s.min_p:g} · seed {s.seed}"

    def answer(self, *, text: str | None = None, messages: tuple | None = None, thinking: bool = False,
               special_tokens: bool = False):
        """Start a run, stream its text to stdout; the finished run (Ctrl-C cancels it)."""
        from ds4f.api import RunConfig, start_run

        a = self.args
        config = RunConfig(model=self.model, preset=a.preset or self.cfg.preset,
                           gen=DEFAULT_GEN if a.gen is None else a.gen, text=text, messages=messages,
                           thinking=thinking, special_tokens=special_tokens,
                           sampling=self.sampling, stop=tuple(a.stop),
                           stop_at_eos=not a.ignore_eos, io_threads=a.io_threads, kernel_threads=a.threads,
                           backend=a.backend, config_path=a.config, probe_floor=a.probe,
                           kv_dir=a.kv_dir, reuse_prefix=not a.no_kv, spec=a.spec, dump=a.dump)
        printer = _Printer(thinking, self.color)
        run = start_run(config, history=self.history, engines=self.host, on_token=printer.token)
        try:
            while not run.wait(0.1):
                pass
        except KeyboardInterrupt:
            run.cancel()
            run.wait()
        printer.end()
        return run

    def close(self) -> None:
        self.host.close()


class _Printer:
    """Writes each token's text as it comes, read by the engine's answer reader: in thinking mode
    the reasoning dimmed (on a terminal) until `</think>`, which is not printed (the answer starts
    on a new line). No tools are offered here, so DSML the model writes is text."""

    def __init__(self, thinking: bool, color: bool) -> None:
        from ds4f.api import ReplyParser

        self.color = color
        self.reply = ReplyParser(thinking, calls=False)
        self.last = None        # the kind of what was written last

    def token(self, record) -> None:
        if record.text:
            self._events(self.reply.push(record.text))

    def end(self) -> None:
        self._events(self.reply.finish())
        sys.stdout.write("\n")
        sys.stdout.flush()

    def _events(self, events) -> None:
        for kind, value in events:
            if self.last is not None and kind != self.last:
                self._write("\n")
            self._write(value, dim=kind == "reasoning")
            self.last = kind

    def _write(self, text: str, dim: bool = False) -> None:
        if not text:
            return
        sys.stdout.write(f"{DIM}{text}{RESET}" if dim and self.color else text)
        sys.stdout.flush()


def _summary(run, session: _Session) -> str:
    """One line for stderr: tokens, speed, disk, cache, and the settings that repeat the run."""
    s = (run.summary_report or {}).get("summary") or {}
    snap = run.snapshot()
    spt = s.get("s_per_token") or snap.s_per_token
    gb = s.get("gb_per_token") or snap.gb_per_token
    hit = s.get("hit_rate") if s else snap.hit_rate
    pre = s.get("prefill") if s else None
    prompt = f"{run.prompt_tokens} prompt tokens"
    if run.prompt_tokens_reused:
        prompt += f" ({run.prompt_tokens_reused} reused from the prefix cache)"
    if pre and pre.get("tokens_per_s"):
        prompt += f" ({pre['tokens_per_s']:.2f} tokens/s layer by layer)"
    parts = [prompt, f"{run.generated_tokens} generated ({run.finish_reason or run.state})"]
    if spt:
        parts.append(f"{_per_second(spt):.2f} tokens/s ({spt:.3f} s/token)")
    if gb is not None:
        parts.append(f"{gb:.3f} GB/token")
    if hit is not None:
        parts.append(f"hit rate {hit:.1%}")
    sp = s.get("spec") or {}
    if sp.get("rounds"):
        parts.append(f"spec {sp['mode']}: {sp['acceptance']:.0%} of drafts kept, {sp['tokens_per_round']:.2f} tokens/round")
    elif sp.get("active"):
        parts.append(f"spec {sp['mode']}: stepped plainly")
    parts.append(session.settings())
    return " · ".join(parts)


def _generate(args) -> int:
    if args.json and args.json != "-":   # never one of what the run reads, even with --force
        check_output(args.json, "--json", args.force,
                     inputs=command_inputs(args.config, model_arg(args) or None, kv_dir=args.kv_dir))
    if args.json == "-":
        raise Ds4fError("--json -: stdout carries the generated text; give --json a file")
    if args.chat and args.special_tokens:
        raise Ds4fError("--special-tokens: not with --chat (a chat's messages are text; the format adds the markers)",
                        param="special_tokens")
    session = _Session(args)
    try:
        _sigterm_cancels()
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                       [{"role": "user", "content": args.prompt}]
            run = session.answer(messages=tuple(messages), thinking=args.think)
        else:
            run = session.answer(text=args.prompt, special_tokens=args.special_tokens)
        if run.state == "cancelled":
            print(f"interrupted after {run.generated_tokens} tokens; no files written", file=sys.stderr)
            return 130
        if run.state != "done":
            raise Ds4fError(run.error or f"run ended {run.state}")
        print(_summary(run, session), file=sys.stderr)
        if args.json:
            write_json(run.report, args.json)
        if run.history_error:
            raise Ds4fError(run.history_error)
        return 0
    finally:
        session.close()


def _sigterm_cancels() -> None:
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:   # not the main thread
        pass


HELP = "/reset clears the conversation · /quit (or Ctrl-D) leaves · Ctrl-C stops an answer"


def _chat(args) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    if hasattr(sys.stdin, "reconfigure"):   # a line of invalid UTF-8 is refused as that line, not the end of the chat
        sys.stdin.reconfigure(errors="surrogateescape")
    session = _Session(args)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    start = len(messages)
    print(f"ds4f chat · {session.model} · {session.settings()}", file=sys.stderr)
    print(HELP, file=sys.stderr)
    lost = 0          # turns whose history record was not written: the exit status says so
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 1 if lost else 0
            except KeyboardInterrupt:
                print(file=sys.stderr)
                continue
            command = line.strip()
            if not command:
                continue
            if command in ("/quit", "/exit"):
                return 1 if lost else 0
            if command == "/reset":
                del messages[start:]
                print("(conversation cleared)", file=sys.stderr)
                continue
            if command.startswith("/"):
                print(f"unknown command {command}; {HELP}", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            try:
                run = session.answer(messages=tuple(messages), thinking=args.think)
            except Ds4fError as exc:
                messages.pop()
                print(f"error: {exc}", file=sys.stderr)
                continue
            if run.state == "done":
                reply = run.assistant_message      # with the ids it was generated as: the next turn reuses it
                messages.append({k: reply[k] for k in ("role", "content", "tokens") if k in reply})
                print(f"[{_summary(run, session)}]", file=sys.stderr)
                if run.history_error:
                    lost += 1
                    print(f"error: {run.history_error}", file=sys.stderr)
            else:
                messages.pop()   # a stopped or failed answer is not part of the conversation
                why = "stopped" if run.state == "cancelled" else f"failed: {run.error}"
                print(f"[{why} after {run.generated_tokens} tokens]", file=sys.stderr)
    finally:
        session.close()
