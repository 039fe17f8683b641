"""`ds4f plan [--geometry flash] [--ram 24GiB] [--preset laptop]`: the memory plan of a model under a
preset on a machine's RAM, without the weights (see ds4f.runs.plan)."""
from __future__ import annotations

import argparse

from ds4f.api import GEOMETRIES, Ds4fError, format_bytes, get_geometry, load_config, memory_plan, parse_budget
from ds4f.cli.output import Column, Table, add_output_option, print_tables

HIT_RATES = (0.0, 0.5, 0.75)   # what a token reads from disk at these expert-cache hit rates


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", default="flash",
                        help=f"a named geometry ({', '.join(GEOMETRIES)}; `real` = flash, the released model)")
    parser.add_argument("--ram", help="the machine's RAM, e.g. 24GiB (default: this machine's)")
    parser.add_argument("--preset", help="a preset of ds4f.toml (default: the configured one)")
    parser.add_argument("--config", help="ds4f.toml to use")
    add_output_option(parser)


def run(args) -> int:
    cfg = load_config(args.config)
    preset = cfg.get_preset(args.preset)
    g = get_geometry("flash" if args.geometry == "real" else args.geometry)
    if args.ram:
        ram = parse_budget(args.ram, "--ram")
        if ram.nbytes is None:
            raise Ds4fError(f"--ram: give a size like '24GiB', got {args.ram!r}")
        ram_bytes = ram.nbytes
    else:
        import psutil

        ram_bytes = int(psutil.virtual_memory().total)
    plan = memory_plan(g, preset, ram_bytes, cfg.kv.ram_bytes if cfg.kv is not None else 0)
    parts = Table("resident", [Column("part", align="left"), Column("bytes", "size", align="left")],
                  title=f"{args.geometry} under preset {preset.describe()}, context {preset.context}")
    for name, n in plan.resident.items():
        parts.add(name, n if args.output in ("csv", "json") else format_bytes(n))
    for dtype, n in plan.attention_by_dtype.items():
        parts.add(f"  attention {dtype}", n if args.output in ("csv", "json") else format_bytes(n))
    sizes = [("KV cache", plan.kv_bytes), ("expert cache (the preset's)", plan.cache_bytes),
             ("total", plan.total_bytes), ("RAM", ram_bytes),
             ("largest expert cache that fits", plan.cache_fit_bytes), ("expert pool", plan.pool_bytes)]
    for name, n in sizes:
        parts.add(name, n if args.output in ("csv", "json") else format_bytes(n))
    disk = Table("disk", [Column("hit_rate", "expert-cache hits", ".0%"), Column("gb_per_token", "GB/token", ".2f")],
                 title="disk reads per token (the unpinned layers' trunk, and the routed experts the cache misses)")
    for h in HIT_RATES + ((plan.cache_bytes / plan.pool_bytes,) if plan.pool_bytes else ()):
        disk.add(h, plan.gb_per_token(h))
    if args.output != "text":
        print_tables([parts, disk], args.output)
    else:
        print("\n\n".join(f"{t.title}\n{t.text()}" for t in (parts, disk)))
        verdict = "fits" if plan.fits else "does NOT fit"
        print(f"\n{verdict}: {format_bytes(plan.total_bytes)} planned + 2 GiB for the OS, of {format_bytes(ram_bytes)} RAM"
              f" (the last GB/token row: hits = the cache's share of the pool, as with uniform routing)")
    return 0 if plan.fits else 1
