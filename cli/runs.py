"""`ds4f run`, `ds4f diff`, `ds4f probe-disk`: the engine from the shell.

All of them go through ds4f.api (the run API, the probe), like the console and the server do.
MODEL defaults to ds4f.toml's [model] path, else the demo model (made on first use, announced,
with progress bars).
"""
from __future__ import annotations

import argparse
import builtins
import functools
import json
import os
import signal
import sys
from pathlib import Path

from ds4f.api import DEFAULT_GEN, Ds4fError
from ds4f.cli.options import (add_backend, add_config, add_dump_option, add_force, add_gen, add_history, add_io_threads,
                              add_json, add_model, add_preset, add_prompt, add_spec, add_threads, default_model,
                              model_arg)
from ds4f.cli.output import Inputs, check_output, check_streams, command_inputs, human_stream, write_json


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "run":
        add_model(parser, "checkpoint directory, official shards or ds4f layout "
                          "(default: ds4f.toml's [model] path, else the demo model)")
        _run_options(parser)
        parser.add_argument("--dump-state", metavar="PATH",
                            help="write the state dump here (default: a new directory under the data directory); "
                                 "the report goes next to it (a.bin -> a.report.json) unless --json names a file")
        add_json(parser, "the run's report")
        add_force(parser, "the state dump or the report")
        add_history(parser)
        add_dump_option(parser, "runs")
    elif name == "diff":
        parser.add_argument("a", help="state dump A (state.bin)")
        parser.add_argument("b", help="state dump B")
        add_json(parser, "the diff", to_file=False)
        parser.epilog = ("exit codes: 0 identical, 1 low-bit, 3 routing divergence, 4 drift,"
                         " 5 same prefix with different lengths, 2 error")
    elif name == "probe-disk":
        add_model(parser, "checkpoint directory whose expert pool to read "
                          "(default: ds4f.toml's [model] path, else the demo model)")
        add_io_threads(parser)
        parser.add_argument("--seconds", type=float, default=3.0, help="time bound (default 3 s)")
        add_config(parser)


def _run_options(parser: argparse.ArgumentParser) -> None:
    add_preset(parser)
    add_gen(parser, str(DEFAULT_GEN))
    add_prompt(parser, token_ids=True)
    add_threads(parser)
    add_io_threads(parser)
    add_backend(parser)
    parser.add_argument("--no-simd", action="store_true", help="scalar kernels (same as --backend scalar)")
    parser.add_argument("--no-probe", action="store_true", help="skip the NVMe floor probe")
    parser.add_argument("--moe-only", action="store_true",
                        help="allow a checkpoint without attention: run the MoE half alone (the cache lab)")
    add_spec(parser)
    add_config(parser)


def run(args) -> int:
    return {"run": _run, "diff": _diff, "probe-disk": _probe}[args.command](args)


def _parse_prompt(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise Ds4fError(f"--prompt: expected comma-separated token ids, got {text!r}") from None


def _fmt(value, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def _output_paths(dump: str | None, report: str | None, force: bool, inputs=()) -> tuple[str | None, str | None]:
    """The state dump and report paths, absolute (so the history records where they are),
    refused before the run if they are one file, a directory, one of the run's `inputs` (even
    with `force`), or exist without `force`."""
    if dump is None and report is None:
        return None, None   # a new directory under the data directory
    dump_p = Path(dump).expanduser().absolute() if dump else None
    report_p = Path(report).expanduser().absolute() if report else None
    effective = report_p or (dump_p.with_name(dump_p.stem + ".report.json") if dump_p else None)
    named = {"--dump-state": dump_p, "--json" if report_p else "the report (next to --dump-state)": effective}
    if dump_p is not None and effective is not None and _same_file(dump_p, effective):
        raise Ds4fError(f"--dump-state {dump} and --json {report}: the same file, so the report would overwrite "
                        f"the state dump; give them different paths")
    for option, path in named.items():
        if path is not None:
            check_output(path, option, force, inputs=inputs, makes_dirs=True)   # the dump makes its directories
    return (str(dump_p) if dump_p else None), (str(report_p) if report_p else None)


def _run(args) -> int:
    from ds4f.api import History, RunConfig, load_settings, start_run

    settings = load_settings(args.config)
    # what the run reads, which no output may replace, even with --force: the checkpoint (the demo
    # model's directory when none is named), the config, the history, the caches
    writes = args.dump_state or args.json not in (None, "-")
    inputs = command_inputs(args.config, model_arg(args)) if writes else Inputs()
    check_streams(args, inputs)
    to_stdout = args.json == "-"
    if args.dump == "off" and args.dump_state:
        raise Ds4fError(f"--dump-state {args.dump_state} with --dump off: give one or the other")
    dump, report = _output_paths(args.dump_state, None if to_stdout else args.json, args.force, inputs)
    model = default_model(args, args.config)
    history = History(settings.history_path) if args.history else None
    config = RunConfig(model=model, preset=args.preset or settings.engine.preset,
                       gen=DEFAULT_GEN if args.gen is None else args.gen,
                       prompt=_parse_prompt(args.prompt), io_threads=args.io_threads, kernel_threads=args.threads,
                       backend="scalar" if args.no_simd else args.backend, dump_path=dump,
                       report_path=report, config_path=args.config, probe_floor=False if args.no_probe else None,
                       moe_only=args.moe_only, spec=args.spec, dump=args.dump)
    try:
        signal.signal(signal.SIGTERM, _cancel_on_sigterm)   # `kill` stops the run as Ctrl-C does: no files left
    except ValueError:   # not the main thread (called in-process): signals are not ours to handle
        pass
    run = start_run(config, history=history)
    print(f"run {run.id}: {model} · preset {run.preset.describe()} · {run.n_steps} tokens", file=sys.stderr)
    shown = done = 0
    try:
        while not run.wait(0.05):
            if run.tokens_done != done:       # a snapshot only when a token has landed
                done = run.tokens_done
                shown = _print_tokens(run, shown)
    except KeyboardInterrupt:
        run.cancel()
        run.wait()
        print("cancelled; no files written", file=sys.stderr)
        return 130
    _print_tokens(run, shown)
    if run.state != "done":
        raise Ds4fError(run.error or f"run ended {run.state}")
    s = run.summary_report["summary"]
    snap = run.snapshot()
    out = human_stream(args)
    _print_summary(run, s, snap, out)
    if to_stdout:
        write_json(run.report, "-")
    elif args.json and run.report_path is None:   # no state dump (--dump off), so no report beside one: here
        write_json(run.report, str(report))
    if run.history_error:
        raise Ds4fError(run.history_error)
    return 0


def spec_line(sp: dict) -> str:
    """The report's speculation figures in a line (ds4f run's summary, ds4f generate's)."""
    if not sp.get("active"):
        return f"{sp['mode']}: stepped plainly (no MTP layer to draft with, or sequences stepping together)"
    by_k = ", ".join(f"k={k}: {n}" for k, n in sp["by_k"].items()) or "none"
    depths = ", ".join(f"{d}: {kept / judged:.0%}" for d, (judged, kept) in sp.get("by_depth", {}).items() if judged)
    return (f"{sp['mode']} · {sp['rounds']} rounds with drafts ({by_k}), {sp['plain_steps']} plain steps · "
            f"acceptance {_fmt(sp['acceptance'], '.0%')}" + (f" (by depth {depths})" if depths else "")
            + f" · {_fmt(sp['tokens_per_round'], '.2f')} tokens/round · "
            f"drafts cost {sp['draft_bytes'] / 1e9:.3f} GB and {sp['draft_s']:.2f} s · verify rows read "
            f"{sp['verify_extra_bytes'] / 1e9:.3f} GB beyond plain steps")


def _per_second(seconds: float | None) -> float | None:
    return 1.0 / seconds if seconds else None


def _print_summary(run, s: dict, snap, out) -> None:
    print = functools.partial(builtins.print, file=out)   # stderr when stdout carries the JSON

    print(f"s/token        {_fmt(s['s_per_token'], '.3f')} warm (median) · "
          f"{_fmt(_per_second(s['s_per_token']), '.2f')} tokens/s · "
          f"{_fmt(s['s_first_token'], '.3f')} first token (cold)")
    print(f"GB/token       {_fmt(s['gb_per_token'], '.3f')} warm · {_fmt(s['gb_first_token'], '.3f')} first token")
    pre = s.get("prefill")
    if pre:
        print(f"prefill        {pre['tokens']} prompt tokens layer by layer in chunks of {pre['chunk']} · "
              f"{_fmt(pre['tokens_per_s'], '.2f')} tokens/s · {pre['gb_per_token']:.3f} GB/prompt token · "
              f"{pre['experts_read_per_layer_chunk']:.1f} experts read per layer per chunk")
    print(f"effective read {_fmt(s['eff_read_gbps'], '.2f', ' GB/s')} · floor {_fmt(s['floor_gbps'], '.2f', ' GB/s')}"
          f" (read / floor {_fmt(s.get('floor_ratio'), '.2f')}, a lower bound)")
    if s.get("floor_ratio") is not None and s["floor_ratio"] > 1.05:
        from ds4f.api import FLOOR_CAVEAT

        print(f"               {FLOOR_CAVEAT}")
    busy = s.get("disk_busy_fraction")
    print(f"disk           {s.get('bound') or '-'}-bound, busy {_fmt(busy, '.0%')} · I/O efficiency "
          f"{_fmt(s['io_efficiency'], '.2f')} (a replay of the run's own reads against its time reading)")
    pf = s.get("prefetch")
    # the policy's own hit rate first (the one comparable with Belady's), prefetch's share apart
    share = f" + {s['prefetch_hit_share'] * 100:.1f} pts prefetch" if pf and s.get("prefetch_hit_share") is not None else ""
    print(f"cache          {run.preset.policy} {_fmt(s.get('policy_hit_rate'), '.1%')} hits on its own{share} "
          f"({s['hits']} hits, {s.get('prefetch_hits', 0)} of them on prefetched experts, {s['misses']} misses, "
          f"{s['evictions']} evictions) · "
          f"read latency {_fmt(s['read_latency_ms'], '.1f', ' ms')} · stall {_fmt(s['stall_s_per_token'], '.3f', ' s/token')}")
    if s.get("optimum_hit_rate") is not None and s.get("policy_hit_rate") is not None:
        print(f"policy         {run.preset.policy} {s['policy_hit_rate']:.1%} on its own · Belady {s['optimum_hit_rate']:.1%}"
              f" on the same requests · regret {s['regret_pp']:.1f} pts · prefetch +{s['prefetch_hit_share'] * 100:.1f} pts")
    if pf:
        print(f"prefetch       {pf['issued']} issued · {pf['useful']} useful ({pf['late']} late) · "
              f"{pf['wasted']} wasted · {pf['cancelled']} cancelled")
    print(f"memory         RSS {s['rss_bytes'] / 2**30:.2f} GiB of {s['rss_budget_bytes'] / 2**30:.2f} GiB budget · "
          f"plan {(s.get('plan_bytes') or 0) / 2**30:.2f} GiB · RAM {(s.get('ram_bytes') or 0) / 2**30:.1f} GiB · {snap.io_mode}")
    if s.get("kv_bytes"):
        print(f"KV cache       {s['kv_bytes'] / 2**20:.1f} MiB for {s['context']} positions (in the plan)")
    else:
        print("attention      none: this checkpoint's config has no attention, only the MoE half runs")
    sp = s.get("spec")
    if sp:
        print(f"speculation    {spec_line(sp)}")
    print(f"kernels        {', '.join(sorted(set(run.summary_report['backend_by_token'])))} · {snap.kernel_threads} kernel threads · {snap.io_threads} I/O threads")
    print(f"generated      {run.summary_report['generated']}")
    if run.summary_report["state_path"]:
        print(f"state          {run.summary_report['state_path']} ({run.dump_mode})"
              f" sha256 {run.summary_report['state_sha256']}")
        print(f"report         {run.report_path}")
    else:
        print("state          none written (--dump off); the report is in the history with --history")


def _cancel_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the first one cancels; the cancel then runs to its end
    raise KeyboardInterrupt


def _print_tokens(run, shown: int) -> int:
    """Print the tokens from index `shown` on that the snapshot still holds; the next index to show."""
    snap = run.snapshot()
    if snap.tokens and snap.tokens[0].index > shown:
        print(f"({snap.tokens[0].index - shown} tokens not shown)", file=sys.stderr)
    for t in (t for t in snap.tokens if t.index >= shown):
        # the policy's own hits (the yardstick of the summary and the console), prefetch's apart
        own, share = t.policy_hit_rate or 0.0, t.prefetch_hit_share or 0.0
        pf = f" +{share * 100:4.1f} pts prefetch" if snap.prefetch else ""
        print(f"token {t.index + 1:>4}/{snap.steps}  id {t.token_id:>6} -> {t.next_token_id:>6}  {t.seconds:7.3f} s  "
              f"{t.bytes_read / 1e9:6.3f} GB  own hits {own:6.1%}{pf}  stall {t.stall_s:6.3f} s  {t.backend}",
              file=sys.stderr)
    return snap.tokens[-1].index + 1 if snap.tokens else shown


def _diff(args) -> int:
    from ds4f.api import diff_states

    d = diff_states(args.a, args.b)
    if args.json:
        print(json.dumps(d.to_dict(), indent=1))
        return d.exit_code
    print(d.summary())
    if d.attention_summary():
        print(d.attention_summary())
    print(f"A {args.a}  sha256 {d.sha_a}  backends {','.join(sorted(set(d.backends_a)))}")
    print(f"B {args.b}  sha256 {d.sha_b}  backends {','.join(sorted(set(d.backends_b)))}")
    if d.cls != "identical":
        print(f"{'layer':>5}  {'max abs':>10}  {'max rel':>10}")
        for i, (a, r) in enumerate(zip(d.layer_max_abs, d.layer_max_rel)):
            print(f"{i:>5}  {a:10.3e}  {r:10.3e}")
    return d.exit_code


def _probe(args) -> int:
    from ds4f.api import load_settings, open_checkpoint, probe_floor

    threads = args.io_threads or load_settings(args.config).engine.io_threads
    if threads < 1 or args.seconds <= 0:
        raise Ds4fError("--io-threads and --seconds must be positive")
    with open_checkpoint(default_model(args, args.config)) as ck:
        r = probe_floor(ck, threads, args.seconds)
    print(f"NVMe floor {r.gbps:.2f} GB/s: {r.reads} random reads of {r.record_nbytes / 2**20:.2f} MiB records "
          f"in {r.seconds:.2f} s at queue depth {r.io_threads} ({r.io_mode})")
    return 0
