"""`ds4f bench cache`: policies against Belady on the bench checkpoint's traces, and prefetch.

1. Traces: one run per sample prompt (the synthetic generator's prompts.json) records the
   routing; the math does not depend on the cache, so these runs use the server preset.
2. Sweep: every policy at every budget over all traces (hits summed), with targets: the
   default policy >= LRU at every budget, and within 10% of Belady at the laptop budget.
3. Prefetch: the laptop preset with lookahead prefetch off and on, same prompts, in this
   invocation: stall time per token, and wasted reads per useful one.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from ds4f.engine.errors import Ds4fError

BUDGETS = ["10%", "15%", "20%", "25%", "30%", "40%", "50%", "75%"]


def _run(model: Path, preset, prompt, gen: int, dump: Path, config_path, backend: str | None = None) -> dict:
    from ds4f.engine.runs import RunConfig, start_run

    run = start_run(RunConfig(model=str(model), preset=preset, gen=gen, prompt=tuple(prompt), backend=backend,
                              config_path=config_path, probe_floor=False, dump_path=str(dump)))
    run.wait()
    if run.state != "done":
        raise Ds4fError(run.error or f"bench run ended {run.state}")
    return run.report


def bench_cache(args) -> int:
    from ds4f.engine.bench.engine import bench_scratch_dir
    from ds4f.engine.runtime.policies import DEFAULT_POLICY, ONLINE_POLICIES
    from ds4f.engine.lab.trace import load_trace
    from ds4f.engine.lab.sweep import format_table, sweep
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.checkpoint.demo import ensure_synthetic

    model = Path(args.model) if args.model else ensure_synthetic("bench")
    with open_checkpoint(model) as ck:
        prompts = ck.prompts[:4]
    if not prompts:
        raise Ds4fError(f"{model}: no sample prompts (prompts.json); bench cache needs a synthetic checkpoint")
    gen = args.gen or 24
    scratch = bench_scratch_dir()

    print(f"bench cache: {model}, {len(prompts)} prompts + {gen} generated tokens each", file=sys.stderr)
    traces = []
    for i, prompt in enumerate(prompts):
        dump = scratch / f"trace-{i}.bin"
        _run(model, "server", prompt, gen, dump, args.config)
        traces.append(load_trace(dump))
        print(f"  trace {i}: {len(traces[-1].ids)} tokens", file=sys.stderr)

    cfg = load_config(args.config)
    laptop = cfg.get_preset(args.preset)
    policies = [*ONLINE_POLICIES, "belady"]
    budgets = list(BUDGETS)
    laptop_budget = str(laptop.cache)
    if laptop_budget not in budgets:
        budgets.append(laptop_budget)
    results = sweep(traces, budgets, policies)
    print("\nhit rate by policy and budget (all traces):")
    print(format_table(results, budgets, policies))

    default = DEFAULT_POLICY
    below = [b for b in budgets if results[b, default].hit_rate is not None and results[b, "lru"].hit_rate is not None
             and results[b, default].hit_rate < results[b, "lru"].hit_rate]
    d, opt = results[laptop_budget, default].hit_rate, results[laptop_budget, "belady"].hit_rate
    gap = (opt - d) / opt if d is not None and opt else None
    print(f"\ndefault policy {default} >= lru at every budget: {'met' if not below else 'NOT met at ' + ', '.join(below)}")
    if gap is not None:
        print(f"{default} vs belady at the {args.preset} budget ({laptop_budget}): {d:.1%} vs {opt:.1%}, "
              f"{gap:.1%} below the optimum: {'met' if gap <= 0.10 else 'NOT met'} (target <= 10%)")
        # how much foresight the optimum needs: Belady that sees N tokens ahead, the default beyond
        horizons = [1, 2, 3, 4, 8]
        seen = sweep(traces, [laptop_budget], [f"belady@{n}" for n in horizons])
        rates = {n: seen[laptop_budget, f"belady@{n}"].hit_rate for n in horizons}
        enough = [n for n in horizons if rates[n] is not None and (opt - rates[n]) / opt <= 0.10]
        print("  foresight: belady seeing N tokens ahead (then evicting as " + default + "): "
              + ", ".join(f"N={n} {rates[n]:.1%}" for n in horizons)
              + (f"; within 10% of the optimum needs N >= {enough[0]} tokens of exact future routing"
                 if enough else "; none of these is within 10%"))

    # prefetch off / on, same prompts, this invocation; the two runs of a prompt alternate
    # which goes first, so a disk that speeds up or slows down during the bench favours neither
    presets = {label: replace(laptop, prefetch=label == "on", name=f"{laptop.name}+prefetch-{label}")
               for label in ("off", "on")}
    stalls: dict = {"off": [], "on": []}
    s_tok: dict = {"off": [], "on": []}
    disk: dict = {"off": [], "on": []}  # (summary dicts) for the disk's busy share and depth
    pf_total = {"off": Counter(), "on": Counter()}
    for i, prompt in enumerate(prompts):
        for label in (("off", "on") if i % 2 == 0 else ("on", "off")):
            report = _run(model, presets[label], prompt, gen, scratch / f"pf-{label}-{i}.bin", args.config,
                          args.backend)
            stalls[label] += [t["stall_s"] for t in report["tokens"][1:]]
            s_tok[label].append(report["summary"]["s_per_token"])
            pf_total[label].update(report["summary"]["prefetch"] or {})
            disk[label].append(report["summary"])
    rows = {label: (statistics.mean(stalls[label]), statistics.median(s_tok[label]), pf_total[label])
            for label in ("off", "on")}
    off, on = rows["off"], rows["on"]
    drop = 1 - on[0] / off[0] if off[0] else 0.0
    pf = on[2]
    waste = pf["wasted"] / pf["useful"] if pf["useful"] else float("inf")
    print(f"\nprefetch ({args.preset} preset, policy {laptop.policy}, {report['backend_by_token'][-1]} "
          f"kernels, warm tokens):")
    print(f"  stall s/token   off {off[0]:.4f}   on {on[0]:.4f}   drop {drop:.1%} "
          f"({'met' if drop >= 0.25 else 'NOT met'}, target >= 25%)")
    print(f"  s/token median  off {off[1]:.4f}   on {on[1]:.4f}")
    print(f"  prefetches: {pf['issued']} issued, {pf['useful']} useful, {pf['late']} late, {pf['wasted']} wasted, "
          f"{pf['cancelled']} cancelled unread; "
          f"wasted per useful {waste:.2f} ({'met' if waste < 0.5 else 'NOT met'}, target < 0.5)")
    busy = {k: statistics.mean(r["disk_busy_fraction"] for r in disk[k]) for k in disk}
    depth = {k: statistics.mean(r["mean_read_depth"] for r in disk[k]) for k in disk}
    gbt = {k: statistics.mean(r["gb_per_token"] for r in disk[k]) for k in disk}
    io_threads = cfg.effective_io_threads(laptop)
    print(f"  disk: a read in flight {busy['off']:.0%} of the time off, {busy['on']:.0%} on; mean reads in flight "
          f"{depth['off']:.2f} off, {depth['on']:.2f} on (of {io_threads}); GB/token {gbt['off']:.3f} off, "
          f"{gbt['on']:.3f} on")
    if busy["off"] > 0.8:
        print(f"  read-bound: with prefetch off the disk is already busy {busy['off']:.0%} of each token, so an early "
              f"read mostly displaces a demand read; prefetch can only win the idle {1 - busy['off']:.0%} and the "
              f"shallow-queue time, minus its wasted reads")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "sweep": {f"{b}|{p}": results[b, p].hit_rate for b in budgets for p in policies},
            "default_policy": default, "laptop_budget": laptop_budget, "gap_to_belady": gap,
            "stall_off": off[0], "stall_on": on[0], "stall_drop": drop, "prefetch": dict(pf),
            "s_per_token_off": off[1], "s_per_token_on": on[1], "disk_busy": busy, "mean_read_depth": depth,
            "gb_per_token": gbt, "belady_foresight": {str(n): r for n, r in rates.items()} if gap is not None else None},
            indent=1))
    return 0
