"""`ds4f bench cache`: policies against Belady on the bench checkpoint's traces, and prefetch.

1. Traces: one run per sample prompt (the synthetic generator's prompts.json) records the
   routing; the math does not depend on the cache, so these runs use the server preset.
2. Sweep: every policy at every budget over all traces (hits summed); where the default
   policy falls below LRU, how far it is below Belady at the preset's budget, and how many
   tokens of exact future routing Belady needs to come within 10% of its own optimum.
3. Prefetch: the preset with lookahead prefetch off and on, same prompts, in this
   invocation: stall time per token, and wasted reads per useful one.

bench_cache returns the figures; the CLI prints them. `log(line)` receives progress lines;
`progress` and `log` are passed on to ensure_synthetic when the bench checkpoint has to be made.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path

from ds4f.errors import Ds4fError

BUDGETS = ["10%", "15%", "20%", "25%", "30%", "40%", "50%", "75%"]


def _run(model: Path, preset, prompt, gen: int, dump: Path, config_path, backend: str | None = None) -> dict:
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    run = start_run(RunConfig(model=str(model), preset=preset, gen=gen, prompt=tuple(prompt), backend=backend,
                              config_path=config_path, probe_floor=False, dump_path=str(dump)))
    run.wait()
    if run.state != "done":
        raise Ds4fError(run.error or f"bench run ended {run.state}")
    return run.report


def bench_cache(model: str | Path | None = None, preset: str = "laptop", gen: int | None = None,
                config_path: str | None = None, backend: str | None = None, *, log=None, progress=None) -> dict:
    """Traces, the policy sweep and prefetch off/on (see the module docstring).

    Returns a dict: "sweep" ("budget|policy" -> hit rate), "cells" (one per budget and policy:
    budget_bytes, hits, misses, bytes_read, hit_rate), "budgets", "policies", "default_policy",
    "laptop_budget" (the preset's budget), "below_lru" (budgets where the default policy hits
    less than LRU), "default_hit_rate", "belady_hit_rate", "gap_to_belady", "belady_foresight"
    (N -> hit rate), "stall_off"/"stall_on"/"stall_drop", "s_per_token_off"/"_on", "prefetch"
    (counts of the runs with it on), "wasted_per_useful", "disk_busy", "mean_read_depth",
    "gb_per_token" (each {"off", "on"}), "io_threads", "backend", "policy", "preset", "model",
    "prompts", "gen"."""
    from ds4f.bench.engine import bench_model, bench_scratch_dir
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.runs.traces import load_trace
    from ds4f.settings import load_settings

    log = log or (lambda _line: None)
    model = bench_model(model, progress, log)
    with open_checkpoint(model) as ck:
        prompts = ck.prompts[:4]
    if not prompts:
        raise Ds4fError(f"{model}: no sample prompts (prompts.json); bench cache needs a synthetic checkpoint")
    gen = gen or 24
    scratch = bench_scratch_dir()

    log(f"bench cache: {model}, {len(prompts)} prompts + {gen} generated tokens each")
    traces = []
    for i, prompt in enumerate(prompts):
        dump = scratch / f"trace-{i}.bin"
        _run(model, "server", prompt, gen, dump, config_path)
        traces.append(load_trace(dump))
        log(f"  trace {i}: {len(traces[-1].ids)} tokens")

    cfg = load_settings(config_path).engine
    laptop = cfg.get_preset(preset)
    policy = _policy_sweep(traces, str(laptop.cache), log)
    pf = _prefetch_off_on(model, laptop, prompts, gen, scratch, config_path, backend, log)
    return {
        "model": str(model), "prompts": len(prompts), "gen": gen, "preset": preset, "policy": laptop.policy,
        "backend": pf.pop("backend"), "io_threads": cfg.effective_io_threads(laptop), **policy, **pf,
    }


def _policy_sweep(traces, laptop_budget: str, log) -> dict:
    """Every policy at every budget (the preset's among them) on the traces; the default policy
    against LRU and Belady at the preset's budget, and how much foresight Belady needs."""
    from ds4f.cachelab.sweep import sweep
    from ds4f.engine.runtime.policies import DEFAULT_POLICY, ONLINE_POLICIES

    policies = [*ONLINE_POLICIES, "belady"]
    budgets = list(BUDGETS)
    if laptop_budget not in budgets:
        budgets.append(laptop_budget)
    log("  sweep: every policy at every budget")
    results = sweep(traces, budgets, policies)
    default = DEFAULT_POLICY
    below = [b for b in budgets if results[b, default].hit_rate is not None and results[b, "lru"].hit_rate is not None
             and results[b, default].hit_rate < results[b, "lru"].hit_rate]
    d, opt = results[laptop_budget, default].hit_rate, results[laptop_budget, "belady"].hit_rate
    gap = (opt - d) / opt if d is not None and opt else None
    rates = None
    if gap is not None:
        # how much foresight the optimum needs: Belady that sees N tokens ahead, the default beyond
        horizons = [1, 2, 3, 4, 8]
        seen = sweep(traces, [laptop_budget], [f"belady@{n}" for n in horizons])
        rates = {n: seen[laptop_budget, f"belady@{n}"].hit_rate for n in horizons}
    return {
        "budgets": budgets, "policies": policies,
        "sweep": {f"{b}|{p}": results[b, p].hit_rate for b in budgets for p in policies},
        "cells": [{"budget": b, "policy": p, "budget_bytes": results[b, p].budget_bytes, "hits": results[b, p].hits,
                   "misses": results[b, p].misses, "bytes_read": results[b, p].bytes_read,
                   "hit_rate": results[b, p].hit_rate} for b in budgets for p in policies],
        "default_policy": default, "laptop_budget": laptop_budget, "below_lru": below,
        "default_hit_rate": d, "belady_hit_rate": opt, "gap_to_belady": gap,
        "belady_foresight": {str(n): r for n, r in rates.items()} if rates is not None else None,
    }


def _prefetch_off_on(model, laptop, prompts, gen: int, scratch: Path, config_path, backend, log) -> dict:
    """The same prompts with prefetch off and on, in this invocation; the two runs of a prompt
    alternate which goes first, so a disk that speeds up or slows down during the bench favours
    neither. Stall, s/token, the disk's busy share and depth, GB/token, prefetch's counts."""
    presets = {label: replace(laptop, prefetch=label == "on", name=f"{laptop.name}+prefetch-{label}")
               for label in ("off", "on")}
    stalls: dict = {"off": [], "on": []}
    s_tok: dict = {"off": [], "on": []}
    disk: dict = {"off": [], "on": []}  # (summary dicts) for the disk's busy share and depth
    pf_total = {"off": Counter(), "on": Counter()}
    for i, prompt in enumerate(prompts):
        for label in (("off", "on") if i % 2 == 0 else ("on", "off")):
            log(f"  prompt {i}: prefetch {label}")
            report = _run(model, presets[label], prompt, gen, scratch / f"pf-{label}-{i}.bin", config_path, backend)
            stalls[label] += [t["stall_s"] for t in report["tokens"][1:]]
            s_tok[label].append(report["summary"]["s_per_token"])
            pf_total[label].update(report["summary"]["prefetch"] or {})
            disk[label].append(report["summary"])
    stall = {k: statistics.mean(v) if v else 0.0 for k, v in stalls.items()}
    s_med = {k: statistics.median([x for x in v if x is not None] or [0.0]) for k, v in s_tok.items()}
    pf = pf_total["on"]
    return {
        "backend": report["backend_by_token"][-1],
        "stall_off": stall["off"], "stall_on": stall["on"],
        "stall_drop": 1 - stall["on"] / stall["off"] if stall["off"] else 0.0, "prefetch": dict(pf),
        "wasted_per_useful": pf["wasted"] / pf["useful"] if pf["useful"] else None,
        "s_per_token_off": s_med["off"], "s_per_token_on": s_med["on"],
        "disk_busy": {k: statistics.mean(r["disk_busy_fraction"] for r in disk[k]) for k in disk},
        "mean_read_depth": {k: statistics.mean(r["mean_read_depth"] for r in disk[k]) for k in disk},
        "gb_per_token": {k: statistics.mean(r["gb_per_token"] for r in disk[k]) for k in disk},
    }
