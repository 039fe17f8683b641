"""`ds4f bench-kernels [--repeat N] [--json PATH]`: the native kernels on the real expert shapes."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ds4f.api import Ds4fError


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per case, median reported (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write one record per (kernel, shape, backend, threads)")
    parser.add_argument(
        "--backends", help="comma-separated subset of the available backends (scalar is always measured)"
    )
    parser.add_argument("--threads", help="comma-separated thread counts (default: 1 and all cores)")
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

    console = Console(width=None if sys.stdout.isatty() else 120)  # the table needs ~110 columns
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

    best = api.best_backend()
    if backends and best not in backends:
        best = max(backends, key=api.BACKENDS.index)
    if best != "scalar":
        console.print(f"targets, backend {best}, worst shape:")
        for desc, got, target, met in api.check_kernel_targets(records, best):
            console.print(f"  {'met ' if met else 'MISS'}  {desc}: {got:.2f} (target >= {target:g})")

    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump([r.to_dict() for r in records], f, indent=1)
                f.write("\n")
        except OSError as exc:
            raise Ds4fError(f"--json: cannot write {args.json}: {exc.strerror}") from None
        print(f"wrote {len(records)} records to {args.json}", file=sys.stderr)
    return 0
