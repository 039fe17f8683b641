"""`ds4f run`, `ds4f diff`, `ds4f probe-disk`, `ds4f bench engine|cache|console`: the engine from the shell.

All of them go through ds4f.api (the run API, the probe, the benchmarks), like the console and
the server do; `bench console` measures the console itself (ds4f.console.bench).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from ds4f.api import DEFAULT_GEN, Ds4fError


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "run":
        parser.add_argument("model", help="checkpoint directory (official shards or ds4f layout)")
        _run_options(parser)
        parser.add_argument("--dump-state", metavar="PATH", help="write the state dump here")
        parser.add_argument("--json", metavar="PATH", help="write the JSON report here")
        parser.add_argument("--history", action="store_true", help="record the run in the history database")
    elif name == "diff":
        parser.add_argument("a", help="state dump A (state.bin)")
        parser.add_argument("b", help="state dump B")
        parser.add_argument("--json", action="store_true", help="print the diff as JSON")
        parser.epilog = ("exit codes: 0 identical, 1 low-bit, 3 routing divergence, 4 drift,"
                         " 5 same prefix with different lengths, 2 error")
    elif name == "probe-disk":
        parser.add_argument("path", help="checkpoint directory whose expert pool to read")
        parser.add_argument("--io-threads", type=int, default=None, help="queue depth (default: ds4f.toml's)")
        parser.add_argument("--seconds", type=float, default=3.0, help="time bound (default 3 s)")
        parser.add_argument("--config", help="ds4f.toml to use")
    elif name == "bench":
        parser.add_argument("what", choices=["engine", "cache", "console"],
                            help="which benchmark: engine (SIMD against scalar), cache (policies and prefetch), "
                                 "console (key-to-action latency and bytes per refresh during a run)")
        parser.add_argument("model", nargs="?", help="checkpoint (default: the bench geometry, made on demand)")
        parser.add_argument("--gen", type=int, default=None, help="tokens per run")
        parser.add_argument("--preset", default=None, help="bench engine, bench cache: preset (default laptop)")
        parser.add_argument("--config", help="ds4f.toml to use")
        parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
        parser.add_argument("--backend", default=None,
                            help="bench cache: kernel backend of the prefetch runs (default: ds4f.toml's); "
                                 "scalar shows what prefetch does when the disk has idle time")


def _run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, help="preset from ds4f.toml (default: engine.preset)")
    parser.add_argument("--gen", type=int, default=None, help=f"tokens to generate (default {DEFAULT_GEN})")
    parser.add_argument("--prompt", default=None, help="comma-separated prompt token ids (default: bos)")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads")
    parser.add_argument("--io-threads", type=int, default=None, help="expert-read threads")
    parser.add_argument("--backend", default=None, help="auto | scalar | avx2 | avx512 | neon (default: ds4f.toml's)")
    parser.add_argument("--no-simd", action="store_true", help="scalar kernels (same as --backend scalar)")
    parser.add_argument("--no-probe", action="store_true", help="skip the NVMe floor probe")
    parser.add_argument("--config", help="ds4f.toml to use")


def run(args) -> int:
    return {"run": _run, "diff": _diff, "probe-disk": _probe, "bench": _bench}[args.command](args)


def _parse_prompt(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise Ds4fError(f"--prompt: expected comma-separated token ids, got {text!r}") from None


def _fmt(value, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def _run(args) -> int:
    from ds4f.api import History, RunConfig, load_config, start_run

    cfg = load_config(args.config)
    history = History(cfg.history_path) if args.history else None
    config = RunConfig(model=args.model, preset=args.preset or cfg.preset,
                       gen=DEFAULT_GEN if args.gen is None else args.gen,
                       prompt=_parse_prompt(args.prompt), io_threads=args.io_threads, kernel_threads=args.threads,
                       backend="scalar" if args.no_simd else args.backend, dump_path=args.dump_state,
                       report_path=args.json, config_path=args.config, probe_floor=False if args.no_probe else None)
    try:
        signal.signal(signal.SIGTERM, _cancel_on_sigterm)   # `kill` stops the run as Ctrl-C does: no files left
    except ValueError:   # not the main thread (called in-process): signals are not ours to handle
        pass
    run = start_run(config, history=history)
    print(f"run {run.id}: {args.model} · preset {run.preset.describe()} · {run.n_steps} tokens", file=sys.stderr)
    shown = 0
    try:
        while not run.wait(0.05):
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
    print(f"s/token        {_fmt(s['s_per_token'], '.3f')} warm (median) · {_fmt(s['s_first_token'], '.3f')} first token (cold)")
    print(f"GB/token       {_fmt(s['gb_per_token'], '.3f')} warm · {_fmt(s['gb_first_token'], '.3f')} first token")
    print(f"effective read {_fmt(s['eff_read_gbps'], '.2f', ' GB/s')} · floor {_fmt(s['floor_gbps'], '.2f', ' GB/s')} · "
          f"I/O efficiency {_fmt(s['io_efficiency'], '.2f')}")
    if s["io_efficiency"] is not None and s["io_efficiency"] > 1.05:
        from ds4f.api import FLOOR_CAVEAT

        print(f"               {FLOOR_CAVEAT}")
    print(f"cache          {_fmt(s['hit_rate'], '.1%')} hits ({s['hits']} hits, {s['misses']} misses, {s['evictions']} evictions) · "
          f"read latency {_fmt(s['read_latency_ms'], '.1f', ' ms')} · stall {_fmt(s['stall_s_per_token'], '.3f', ' s/token')}")
    pf = s.get("prefetch")
    if s.get("optimum_hit_rate") is not None:
        requests = s["hits"] + s["misses"]
        own = (s["hits"] - (pf["useful"] if pf else 0)) / requests if requests else 0.0
        print(f"policy         {run.preset.policy}: {own:.1%} of requests hit without prefetch's help; "
              f"Belady (same budget, no prefetch) {s['optimum_hit_rate']:.1%}")
    if pf:
        print(f"prefetch       {pf['issued']} issued · {pf['useful']} useful ({pf['late']} late) · "
              f"{pf['wasted']} wasted · {pf['cancelled']} cancelled")
    print(f"memory         RSS {s['rss_bytes'] / 2**30:.2f} GiB of {s['rss_budget_bytes'] / 2**30:.2f} GiB budget · {snap.io_mode}")
    print(f"kernels        {', '.join(sorted(set(run.summary_report['backend_by_token'])))} · {snap.kernel_threads} kernel threads · {snap.io_threads} I/O threads")
    print(f"generated      {run.summary_report['generated']}")
    print(f"state          {run.summary_report['state_path']} sha256 {run.summary_report['state_sha256']}")
    print(f"report         {run.report_path}")
    return 0


def _cancel_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the first one cancels; the cancel then runs to its end
    raise KeyboardInterrupt


def _print_tokens(run, shown: int) -> int:
    """Print the tokens from index `shown` on that the snapshot still holds; the next index to show."""
    snap = run.snapshot()
    if snap.tokens and snap.tokens[0].index > shown:
        print(f"({snap.tokens[0].index - shown} tokens not shown)", file=sys.stderr)
    for t in (t for t in snap.tokens if t.index >= shown):
        hr = t.hits / (t.hits + t.misses) if t.hits + t.misses else 0.0
        print(f"token {t.index + 1:>4}/{snap.gen}  id {t.token_id:>6} -> {t.next_token_id:>6}  {t.seconds:7.3f} s  "
              f"{t.bytes_read / 1e9:6.3f} GB  hits {hr:6.1%}  stall {t.stall_s:6.3f} s  {t.backend}", file=sys.stderr)
    return snap.tokens[-1].index + 1 if snap.tokens else shown


def _diff(args) -> int:
    from ds4f.api import diff_states

    d = diff_states(args.a, args.b)
    if args.json:
        print(json.dumps(d.to_dict(), indent=1))
        return d.exit_code
    print(d.summary())
    print(f"A {args.a}  sha256 {d.sha_a}  backends {','.join(sorted(set(d.backends_a)))}")
    print(f"B {args.b}  sha256 {d.sha_b}  backends {','.join(sorted(set(d.backends_b)))}")
    if d.cls != "identical":
        print(f"{'layer':>5}  {'max abs':>10}  {'max rel':>10}")
        for i, (a, r) in enumerate(zip(d.layer_max_abs, d.layer_max_rel)):
            print(f"{i:>5}  {a:10.3e}  {r:10.3e}")
    return d.exit_code


def _probe(args) -> int:
    from ds4f.api import load_config, open_checkpoint, probe_floor

    threads = args.io_threads or load_config(args.config).io_threads
    if threads < 1 or args.seconds <= 0:
        raise Ds4fError("--io-threads and --seconds must be positive")
    with open_checkpoint(args.path) as ck:
        r = probe_floor(ck, threads, args.seconds)
    print(f"NVMe floor {r.gbps:.2f} GB/s: {r.reads} random reads of {r.record_nbytes / 2**20:.2f} MiB records "
          f"in {r.seconds:.2f} s at queue depth {r.io_threads} ({r.io_mode})")
    return 0


def _bench(args) -> int:
    if args.what == "console":
        return _bench_console(args)
    args.preset = args.preset or "laptop"
    if args.what == "engine":
        from ds4f.api import bench_engine

        if args.backend is not None:
            raise Ds4fError("--backend: bench engine always compares the best SIMD backend with scalar; "
                            "--backend is for bench cache")
        return bench_engine(args)
    from ds4f.api import bench_cache

    return bench_cache(args)


def _bench_console(args) -> int:
    from ds4f.api import ensure_synthetic, open_checkpoint
    from ds4f.console.bench import bench_console

    for flag, value in (("--gen", args.gen), ("--preset", args.preset), ("--config", args.config),
                        ("--backend", args.backend)):
        if value is not None:
            raise Ds4fError(f"{flag}: bench console drives the console's own run of MODEL; "
                            f"{flag} is for bench engine and bench cache")
    model = args.model or str(ensure_synthetic("bench"))
    open_checkpoint(model).close()   # a bad checkpoint is named here, not as a console error screen
    print(f"bench console: {model}, keys and refreshes timed while the console's run decodes", file=sys.stderr)
    r = bench_console(model)
    print(f"terminal       {r['terminal']} · refresh every {r['refresh_s']:g} s")
    print(f"key to action  median {_fmt(_ms(r['key_latency_median_s']), '.1f', ' ms')} · "
          f"max {_fmt(_ms(r['key_latency_max_s']), '.1f', ' ms')} over {r['keys']} keys "
          f"({r['tokens_during_keys']} tokens decoded meanwhile)")
    if r["bytes_per_refresh"] is None:
        print("bytes/refresh  — (no pseudo-terminals here)")
    else:
        print(f"bytes/refresh  {r['bytes_per_refresh']:.0f} B over {r['refreshes']} refreshes of a live run · "
              f"first screen {r['first_screen_bytes']} B")
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1)
                f.write("\n")
        except OSError as exc:
            raise Ds4fError(f"--json: cannot write {args.json}: {exc.strerror}") from None
    return 0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
