"""`ds4f bench`'s tables and text: what cli/bench.py prints of the benchmarks' records."""
from __future__ import annotations

import builtins
import functools

from ds4f.cli.output import Cell, Column, Label, Table, human_stream, print_tables, write_json
from ds4f.cli.runs import _fmt, _per_second


def _prefill_table(records: list[dict]) -> Table:
    t = Table("prefill", [Column("prompt_tokens", "prompt"), Column("mode", align="left"), Column("chunk"),
                          Column("tokens_per_s", "prompt tok/s", ".2f"), Column("gb_per_token", "GB/prompt tok", ".4f"),
                          Column("read_gb_per_s", "read GB/s", ".2f"),
                          Column("experts_read_per_layer_chunk", "experts read/layer/chunk", ".1f"),
                          Column("decode_tokens_per_s", "decode tok/s", ".2f"),
                          Column("prefill_over_decode", "prefill/decode", ".1f")],
              title="the prompt token by token against layer-major chunks (cold cache each run)")
    for r in records:
        ratio = r["tokens_per_s"] / r["decode_tokens_per_s"] if r["tokens_per_s"] and r["decode_tokens_per_s"] else None
        t.add(r["prompt_tokens"], r["mode"], r["chunk"], r["tokens_per_s"], r["gb_per_token"], r["read_gb_per_s"],
              r["experts_read_per_layer_chunk"], r["decode_tokens_per_s"], ratio)
    return t


def _print_prefill(records: list[dict], table: Table, out) -> None:
    print = functools.partial(builtins.print, file=out)
    print()
    print(table.text())
    by = {(r["prompt_tokens"], r["mode"]): r for r in records}
    for n in sorted({r["prompt_tokens"] for r in records}):
        tok, lay = by.get((n, "token")), by.get((n, "layer"))
        if tok and lay and tok["tokens_per_s"] and lay["tokens_per_s"] and lay["gb_per_token"]:
            print(f"{n} prompt tokens: layer-major {lay['tokens_per_s'] / tok['tokens_per_s']:.1f}x the tokens/s of"
                  f" token by token, {tok['gb_per_token'] / lay['gb_per_token']:.1f}x fewer GB per prompt token")


def _show(args, tables: list, print_text, result) -> None:
    """The human text (stdout, or stderr when stdout has tables or JSON), the tables in -o's
    format on stdout, and the result as JSON where --json says."""
    print_text(human_stream(args))
    if args.output != "text":
        print_tables(tables, args.output)
    if args.json:
        write_json(result, args.json)


_ENGINE_ROWS = (   # summary key, label, format
    ("s_per_token", "s/token (warm, median)", ".3f"),
    ("tokens_per_s", "tokens/s (warm)", ".2f"),
    ("s_first_token", "s/token (first, cold)", ".3f"),
    ("gb_per_token", "GB/token (warm)", ".3f"),
    ("eff_read_gbps", "effective read GB/s", ".2f"),
    ("floor_gbps", "NVMe floor GB/s", ".2f"),
    ("io_efficiency", "I/O efficiency (replay)", ".2f"),
    ("floor_ratio", "read / floor (lower bound)", ".2f"),
    ("disk_busy_fraction", "disk busy", ".0%"),
    ("hit_rate", "hit rate", ".1%"),
    ("policy_hit_rate", "policy's own hit rate", ".1%"),
    ("stall_s_per_token", "stall s/token", ".3f"),
    ("read_latency_ms", "read latency ms", ".1f"),
    ("check_s_per_token", "crc32 check s/token (I/O threads)", ".4f"),
    ("split.attention_s", "  of s/token: attention", ".4f"),
    ("split.moe_compute_s", "  of s/token: MoE compute", ".4f"),
    ("split.read_wait_s", "  of s/token: waiting for reads", ".4f"),
    ("split.head_s", "  of s/token: head", ".4f"),
    ("split.other_s", "  of s/token: the rest", ".4f"),
    ("split.attention_share", "attention share of s/token", ".1%"),
)


def _summary_value(summary: dict, key: str):
    """summary[key], or summary["split"][...] for a "split.<name>" key (None when absent)."""
    if key == "tokens_per_s":
        return _per_second(summary["s_per_token"])
    if key.startswith("split."):
        return (summary.get("split") or {}).get(key[len("split."):])
    return summary[key]


def _engine_table(r: dict) -> Table:
    best = r["backend"]
    t = Table("engine", [Column("metric", "", align="left"), Column(best), Column("scalar")],
              title=f"{best} against scalar, {r['gen']} tokens generated each")
    for key, label, spec in _ENGINE_ROWS:
        values = [_summary_value(summary, key) for summary in (r["simd"], r["scalar"])]
        t.add(Label(key, label), *(Cell(v, spec) for v in values))
    return t


def _depth_table(r: dict) -> Table:
    """The attention alone at each position, the KV cache there, and the s/token it implies."""
    s = r["simd"]
    split = s.get("split") or {}
    rest = s["s_per_token"] - split["attention_s"] if s["s_per_token"] and split else None
    t = Table("attention_depth", [Column("position", spec=","), Column("kv_mib", "KV cache MiB", ".1f"),
                                  Column("attention_s", "attention s/token", ".4f"),
                                  Column("s_per_token", "s/token there (est.)", ".3f"),
                                  Column("attention_share", "attention share", ".1%")],
              title=f"attention at depth ({r['backend']}): a KV cache filled to each position")
    for d in r.get("attention_depth") or ():
        total = rest + d["attention_s_per_token"] if rest is not None else None
        t.add(d["position"], d["kv_bytes"] / 2**20, d["attention_s_per_token"], total,
              d["attention_s_per_token"] / total if total else None)
    return t


def _print_bench_engine(r: dict, out) -> None:
    print = functools.partial(builtins.print, file=out)
    best, s = r["backend"], r["simd"]
    print()
    print(_engine_table(r).text())
    if r.get("attention_depth"):
        print()
        print(_depth_table(r).text())
        print("s/token there (est.): the run's warm s/token with its attention replaced by the attention at"
              " that position (the MoE, head and reads do not grow with the position)")
    ratio = r["scalar_over_simd"]
    if ratio:
        print(f"\nscalar / {best} s/token: {ratio:.2f}x (the same prompt and {r['gen']} generated tokens on each)")
    print(f"io mode: {r['io_mode']} · cache {r['cache']['capacity_bytes'] / 2**30:.2f} GiB "
          f"({r['cache']['slots']} slots) · pinned layers {r['pinned_layers']}/{r['n_layers']}")
    eff = s.get("floor_ratio")
    if eff is not None and eff > 1.05:
        from ds4f.api import FLOOR_CAVEAT

        print(FLOOR_CAVEAT)


def _sweep_cells(r: dict) -> dict:
    return {(c["budget"], c["policy"]): _SweepCell(c) for c in r["cells"]}


def _cache_tables(r: dict) -> list:
    from ds4f.cli.cache import sweep_table

    sweep = sweep_table(_sweep_cells(r), r["budgets"], r["policies"])
    sweep.title = "hit rate by policy and budget (all traces)"
    tables = [sweep]
    if r["belady_foresight"]:
        fore = Table("foresight", [Column("tokens_ahead", "tokens ahead"), Column("hit_rate", "hit rate", ".1%")],
                     title=f"belady seeing N tokens ahead at {r['laptop_budget']} (then evicting as {r['default_policy']})")
        for n, rate in r["belady_foresight"].items():
            fore.add(int(n), rate)
        tables.append(fore)
    pf = r["prefetch"]
    pre = Table("prefetch", [Column("metric", align="left"), Column("off", spec=".4f"), Column("on", spec=".4f")],
                title=f"prefetch off and on ({r['preset']} preset, {r['backend']} kernels, warm tokens)")
    pre.add(Label("stall_s_per_token", "stall s/token"), r["stall_off"], r["stall_on"])
    pre.add(Label("s_per_token", "s/token (median)"), r["s_per_token_off"], r["s_per_token_on"])
    pre.add(Label("tokens_per_s", "tokens/s"), _per_second(r["s_per_token_off"]), _per_second(r["s_per_token_on"]))
    pre.add(Label("disk_busy_fraction", "disk busy share"), r["disk_busy"]["off"], r["disk_busy"]["on"])
    pre.add(Label("mean_read_depth", "mean reads in flight"), r["mean_read_depth"]["off"], r["mean_read_depth"]["on"])
    pre.add(Label("gb_per_token", "GB/token"), r["gb_per_token"]["off"], r["gb_per_token"]["on"])
    for key in ("issued", "useful", "late", "wasted", "cancelled"):
        pre.add(Label(f"prefetch_{key}", f"prefetches {key}"), None, pf.get(key, 0))
    tables.append(pre)
    return tables


def _print_bench_cache(r: dict, out) -> None:
    from ds4f.api import format_table

    print = functools.partial(builtins.print, file=out)
    default, budget = r["default_policy"], r["laptop_budget"]
    print("\nhit rate by policy and budget (all traces):")
    print(format_table(_sweep_cells(r), r["budgets"], r["policies"]))
    below = r["below_lru"]
    print(f"\n{default} >= lru at every budget: " + ("yes" if not below else "no, below at " + ", ".join(below)))
    if r["gap_to_belady"] is not None:
        print(f"{default} against belady at the {r['preset']} budget ({budget}): {r['default_hit_rate']:.1%} against "
              f"{r['belady_hit_rate']:.1%}, {r['gap_to_belady']:.1%} below the optimum")
        rates = {int(n): v for n, v in r["belady_foresight"].items()}
        enough = [n for n, v in rates.items() if v is not None and (r["belady_hit_rate"] - v) / r["belady_hit_rate"] <= 0.10]
        print(f"  foresight: belady seeing N tokens ahead (then evicting as {default}): "
              + ", ".join(f"N={n} {_fmt(v, '.1%')}" for n, v in rates.items())
              + (f"; within 10% of the optimum needs N >= {enough[0]} tokens of exact future routing"
                 if enough else "; none of these is within 10%"))
    pf = r["prefetch"]
    print(f"\nprefetch ({r['preset']} preset, policy {r['policy']}, {r['backend']} kernels, warm tokens):")
    print(f"  stall s/token   off {r['stall_off']:.4f}   on {r['stall_on']:.4f}   drop {r['stall_drop']:.1%}")
    print(f"  s/token median  off {r['s_per_token_off']:.4f}   on {r['s_per_token_on']:.4f}   "
          f"(tokens/s off {_fmt(_per_second(r['s_per_token_off']), '.2f')}, "
          f"on {_fmt(_per_second(r['s_per_token_on']), '.2f')})")
    print(f"  prefetches: {pf.get('issued', 0)} issued, {pf.get('useful', 0)} useful, {pf.get('late', 0)} late, "
          f"{pf.get('wasted', 0)} wasted, {pf.get('cancelled', 0)} cancelled unread; "
          f"wasted per useful {_fmt(r['wasted_per_useful'], '.2f')}")
    busy, depth, gbt = r["disk_busy"], r["mean_read_depth"], r["gb_per_token"]
    print(f"  disk: a read in flight {busy['off']:.0%} of the time off, {busy['on']:.0%} on; mean reads in flight "
          f"{depth['off']:.2f} off, {depth['on']:.2f} on (of {r['io_threads']}); GB/token {gbt['off']:.3f} off, "
          f"{gbt['on']:.3f} on")
    if busy["off"] > 0.8:
        print(f"  read-bound: with prefetch off the disk is already busy {busy['off']:.0%} of each token, so an early "
              f"read mostly displaces a demand read; prefetch can only win the idle {1 - busy['off']:.0%} and the "
              f"shallow-queue time, minus its wasted reads")


class _SweepCell:
    """What format_table reads of a sweep cell, from the bench's JSON-ready dict."""

    def __init__(self, c: dict):
        self.hit_rate, self.budget_bytes = c["hit_rate"], c["budget_bytes"]
