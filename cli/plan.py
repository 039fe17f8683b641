"""`ds4f plan [--geometry flash] [--ram 24GiB] [--preset laptop] [--parallel N] [--spec [auto|off|K]] [--dump MODE]`: the
memory plan of a model under a preset on a machine's RAM, for N sequences decoded together, runs writing
state dumps of MODE (what a prompt chunk keeps per layer), without the weights (see ds4f.runs.plan)."""
from __future__ import annotations

import argparse

from ds4f.api import (CONVERSATION_TOKENS, MAX_PARALLEL, RECORDS_OF_DUMP, Ds4fError, bookkeeping, format_bytes,
                      get_geometry, load_settings, memory_plan, parse_budget, parse_spec)
from ds4f.cli.options import (add_config, add_dump_option, add_geometry, add_output_option, add_parallel, add_preset,
                              add_spec, geometry_name)
from ds4f.cli.output import Column, Table, print_tables

HIT_RATES = (0.0, 0.5, 0.75)   # what a token reads from disk at these expert-cache hit rates
RECORD_WHAT = {"full": "every layer's hidden and attention states, for the state dump",
               "compact": "routing, per-layer digests and sketches, the last layer's states",
               "none": "routing and the last layer's states"}


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    add_geometry(parser, "flash")
    parser.add_argument("--ram", help="the machine's RAM, e.g. 24GiB (default: this machine's)")
    add_preset(parser)
    add_parallel(parser, 1, note="as ds4f serve --parallel: N KV caches and prompt chunks, and the batched step's"
                                 " buffers")
    add_spec(parser, "the plan holds the MTP layer when it is not off: its block, the slots for its experts,"
                     " its buffers")
    add_dump_option(parser, "runs")
    add_config(parser)
    add_output_option(parser)


def run(args) -> int:
    settings = load_settings(args.config)
    cfg = settings.engine
    dump = args.dump or settings.dump.mode("runs")
    preset = cfg.get_preset(args.preset)
    g = get_geometry(geometry_name(args))
    spec = parse_spec(args.spec) != "off"
    if args.ram:
        ram = parse_budget(args.ram, "--ram")
        if ram.nbytes is None:
            raise Ds4fError(f"--ram: give a size like '24GiB', got {args.ram!r}")
        ram_bytes = ram.nbytes
    else:
        import psutil

        ram_bytes = int(psutil.virtual_memory().total)
    if not 1 <= args.parallel <= MAX_PARALLEL:
        raise Ds4fError(f"--parallel: sequences decoded together, between 1 and {MAX_PARALLEL}, got {args.parallel}")
    plan = memory_plan(g, preset, ram_bytes, cfg.kv.ram_bytes if cfg.kv is not None else 0, args.parallel,
                       spec=spec, records=RECORDS_OF_DUMP[dump])
    seqs = f", {args.parallel} sequences decoded together" if args.parallel > 1 else ""
    seqs += ", speculative decoding with the MTP layer" if spec else ""
    seqs += f", state dumps {dump}"
    parts = Table("resident", [Column("part", align="left"), Column("bytes", "size", align="left")],
                  title=f"{args.geometry} under preset {preset.describe()}, context {preset.context}{seqs}")
    raw = args.output in ("csv", "json")
    for name, n in plan.resident.items():
        parts.add(name, n if raw else format_bytes(n))
        if name.startswith("attention"):                # its parts, under it
            for dtype, m in plan.attention_by_dtype.items():
                parts.add(f"  attention {dtype}", m if raw else format_bytes(m))
        if name.startswith("prefill chunk") and plan.chunk_records_bytes:
            parts.add(f"  of it the tokens' records ({RECORD_WHAT[RECORDS_OF_DUMP[dump]]})",
                      plan.chunk_records_bytes if raw else format_bytes(plan.chunk_records_bytes))
    sizes = [("KV cache" if args.parallel == 1 else f"KV caches ({args.parallel} sequences)", plan.kv_bytes), ("expert cache (the preset's)", plan.cache_bytes),
             ("total", plan.total_bytes), ("RAM", ram_bytes),
             ("largest expert cache that fits", plan.cache_fit_bytes), ("expert pool", plan.pool_bytes)]
    for name, n in sizes:
        parts.add(name, n if args.output in ("csv", "json") else format_bytes(n))
    disk = Table("disk", [Column("hit_rate", "expert-cache hits", ".0%"), Column("gb_per_token", "GB/token", ".2f")],
                 title="disk reads per token (the unpinned layers' trunk, and the routed experts the cache misses)")
    for h in HIT_RATES + ((plan.cache_bytes / plan.pool_bytes,) if plan.pool_bytes else ()):
        disk.add(h, plan.gb_per_token(h))
    books = Table("bookkeeping", [Column("what", align="left"), Column("per_token", "bytes/token", align="left"),
                                  Column("conversation", f"at {CONVERSATION_TOKENS:,} tokens", align="left")],
                  title=f"what runs write and keep beside the math ([dump], [kv]), per token and for a"
                        f" {CONVERSATION_TOKENS:,}-token conversation")
    for what, per_token, total in bookkeeping(g):
        raw = args.output in ("csv", "json")
        books.add(what, per_token if raw else format_bytes(per_token), total if raw else format_bytes(total))
    if args.output != "text":
        print_tables([parts, disk, books], args.output)
    else:
        print("\n\n".join(f"{t.title}\n{t.text()}" for t in (parts, disk, books)))
        verdict = "fits" if plan.fits else "does NOT fit"
        print(f"\n{verdict}: {format_bytes(plan.total_bytes)} planned + 2 GiB for the OS, of {format_bytes(ram_bytes)} RAM"
              f" (the last GB/token row: hits = the cache's share of the pool, as with uniform routing)")
        if args.parallel > 1:
            print(f"each sequence holds {format_bytes(plan.sequence_bytes)} (its KV cache and prompt chunk);"
                  f" with this cache, at most {min(plan.sequences_fit, MAX_PARALLEL)} sequences fit")
    return 0 if plan.fits else 1
