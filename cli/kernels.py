"""`ds4f bench-kernels [--repeat N] [--json PATH]`: the native kernels on the real expert shapes."""
from __future__ import annotations

import argparse
import os
import sys

from ds4f.api import Ds4fError
from ds4f.cli.output import (Column, Table, add_json_option, add_output_option, check_streams, human_stream,
                             print_tables, write_json)


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per case, median reported (default 5)")
    add_json_option(parser, "one record per (kernel, shape, backend, threads)")
    add_output_option(parser)
    parser.add_argument(
        "--backends", help="comma-separated subset of the available backends (scalar is always measured)"
    )
    parser.add_argument("-t", "--threads", help="comma-separated thread counts (default: 1 and all cores)")
    parser.add_argument("--kernels", help="comma-separated subset of decode,matvec,bf16_matvec,experts")


def _list(arg: str | None, what: str, conv=str) -> list | None:
    if not arg:
        return None
    try:
        return [conv(v.strip()) for v in arg.split(",") if v.strip()]
    except ValueError:
        raise Ds4fError(f"--{what}: cannot parse {arg!r}") from None


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def run(args: argparse.Namespace) -> int:
    from ds4f import api

    check_streams(args)
    if args.repeat < 1:
        raise Ds4fError("--repeat must be at least 1")
    backends = _list(args.backends, "backends")
    for b in backends or []:
        if b not in api.available_backends():
            raise Ds4fError(f"--backends: {b!r} is not available here ({', '.join(api.available_backends())})")
    threads = _list(args.threads, "threads", int)
    if threads and min(threads) < 1:
        raise Ds4fError("--threads: counts must be >= 1")
    kernels = tuple(_list(args.kernels, "kernels") or api.KERNEL_NAMES)
    for k in kernels:
        if k not in api.KERNEL_NAMES:
            raise Ds4fError(f"--kernels: unknown kernel {k!r} ({', '.join(api.KERNEL_NAMES)})")

    from rich.console import Console
    from rich.table import Table

    out = human_stream(args)
    console = Console(file=out, width=None if out.isatty() else 120)  # the table needs ~110 columns
    err = Console(stderr=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with err.status("benchmarking") as status:
        records = api.run_kernel_bench(args.repeat, backends, threads, kernels, progress=lambda m: status.update(m))

    table = Table(
        title=f"ds4f kernels — median of {args.repeat}, {os.cpu_count()} cores, best backend {api.best_backend()}"
        + ("" if load is None else f", load avg {load:.1f}"),
        caption="GB/s = weight bytes read/s · Gw/s = G weights/s · ×scalar at the same thread count · "
        "×numpy = table decode + np.dot (its own BLAS threads) · ×1T = same backend at 1 thread",
    )
    for col, just in (("kernel", "left"), ("shape", "left"), ("backend", "left"), ("thr", "right"),
                      ("median ms", "right"), ("GB/s", "right"), ("Gw/s", "right"), ("×scalar", "right"),
                      ("×numpy", "right"), ("×1T", "right")):  # fmt: skip
        table.add_column(col, justify=just)
    last = None
    for r in records:
        if last is not None and (r.kernel, r.shape) != last:
            table.add_section()
        last = (r.kernel, r.shape)
        table.add_row(
            r.kernel, r.shape, r.backend, str(r.threads) if r.threads else "np",
            f"{r.median_s * 1e3:.2f}", f"{r.gb_per_s:.2f}", f"{r.gweights_per_s:.2f}",
            _fmt(r.speedup_vs_scalar, ".1f"), _fmt(r.speedup_vs_numpy, ".0f"), _fmt(r.speedup_vs_1thread, ".2f"),
        )  # fmt: skip
    console.print(table)
    if args.output != "text":
        print_tables([_table(records)], args.output)
    if args.json:
        write_json([r.to_dict() for r in records], args.json)
        if args.json != "-":
            print(f"wrote {len(records)} records to {args.json}", file=sys.stderr)
    return 0


def _table(records) -> Table:
    t = Table("kernels", [Column("kernel", align="left"), Column("shape", align="left"),
                          Column("backend", align="left"), Column("threads", "thr"),
                          Column("median_ms", "median ms", ".2f"), Column("gb_per_s", "GB/s", ".2f"),
                          Column("gweights_per_s", "Gw/s", ".2f"), Column("x_scalar", "×scalar", ".1f"),
                          Column("x_numpy", "×numpy", ".0f"), Column("x_1thread", "×1T", ".2f")])
    for r in records:
        t.add(r.kernel, r.shape, r.backend, r.threads if r.threads else "numpy", r.median_s * 1e3, r.gb_per_s,
              r.gweights_per_s, r.speedup_vs_scalar, r.speedup_vs_numpy, r.speedup_vs_1thread)
    return t
