"""`ds4f bench-kernels [--repeat N] [--cases hot|cold|all] [--pages huge|normal|both] [--json PATH]
[--ggml DIR]`: the memory floor, then the native kernels on the real shapes, hot and cold; with
--ggml, ds4f's MXFP4 matvec against ggml's MXFP4 kernels from that build (ds4f/bench/ggml.py)."""
from __future__ import annotations

import argparse
import os
import sys

from ds4f.api import Ds4fError
from ds4f.cli.output import Column, Table, check_streams, human_stream, print_tables, write_json
from ds4f.cli.options import add_json_option, add_output_option, add_repeat, add_threads

CASES = ("hot", "cold", "all")
PAGES = ("huge", "normal", "both")


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    add_repeat(parser, 5, "timed calls per case, the median reported")
    add_json_option(parser, "one record per (kernel, shape, hot/cold, pages, backend, threads)")
    add_output_option(parser)
    parser.add_argument(
        "--backends", help="comma-separated subset of the available backends (scalar is always measured)"
    )
    add_threads(parser, counts=True)
    parser.add_argument("--kernels", help="comma-separated subset of memory,fma,decode,matvec,bf16_matvec,experts,"
                                          "fp8_matvec,multi (memory = the RAM floor the others are divided by; "
                                          "fma = the FMA peak, the compute wall; "
                                          "multi = several vectors per call against single-vector calls)")
    parser.add_argument("--cases", choices=CASES, default="all",
                        help="hot (weights reused, in cache), cold (a working set beyond 2x the last-level cache, "
                             "read from RAM: experts and fp8_matvec) or all (default)")
    parser.add_argument("--pages", choices=PAGES, default="huge",
                        help="pages of the floor's and the cold cases' buffers: transparent huge pages "
                             "(default), normal 4 KiB pages, or both")
    parser.add_argument("--ggml", metavar="DIR",
                        help="also compare the MXFP4 matvec (2048x4096, 1 thread, the first of --backends, "
                             "else avx2) with ggml's MXFP4 kernels, standard and repacked, from the ggml CMake "
                             "build in DIR (static libraries built with -DCMAKE_POSITION_INDEPENDENT_CODE=ON, "
                             "or shared ones): 10 rounds in turn; --kernels ggml runs only that")


def _list(arg: str | None, what: str, conv=str) -> list | None:
    if not arg:
        return None
    try:
        return [conv(v.strip()) for v in arg.split(",") if v.strip()]
    except ValueError:
        raise Ds4fError(f"--{what}: cannot parse {arg!r}") from None


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _data(r) -> str:
    if not r.cold:
        return "hot"
    return "cold 4K" if r.pages == "normal" else "cold huge"


def _size(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f} GiB" if n >= 1 << 30 else f"{n / 2**20:.0f} MiB"


def run(args: argparse.Namespace) -> int:
    from ds4f import api, bench

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
    kernels = tuple(_list(args.kernels, "kernels") or bench.KERNEL_NAMES)
    for k in kernels:
        if k not in bench.KERNEL_NAMES and k != "ggml":
            raise Ds4fError(f"--kernels: unknown kernel {k!r} ({', '.join(bench.KERNEL_NAMES)}, ggml)")
    if "ggml" in kernels and not args.ggml:
        raise Ds4fError("--kernels ggml: give the ggml build with --ggml DIR", param="ggml")
    kernels = tuple(k for k in kernels if k != "ggml")

    from rich.console import Console

    out = human_stream(args)
    console = Console(file=out, width=None if out.isatty() else 150)  # the table needs ~140 columns
    err = Console(stderr=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    notes: list[str] = []
    records, ggml = [], []
    with err.status("benchmarking") as status:
        if kernels:
            records = bench.run_kernel_bench(args.repeat, backends, threads, kernels,
                                             progress=lambda m: status.update(m), cases=args.cases, pages=args.pages,
                                             notes=notes)
        if args.ggml:
            backend = backends[0] if backends else "avx2" if "avx2" in api.available_backends() else api.best_backend()
            ggml = bench.bench_ggml(args.ggml, backend=backend, progress=lambda m: status.update(m), notes=notes)
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None

    head = f"median of {args.repeat}, {os.cpu_count()} cores, best backend {api.best_backend()}"
    if load is not None:
        head += f", load avg {load[0]:.1f} before / {load_after[0]:.1f} after"
    memory = [r for r in records if r.kernel == "memory"]
    if memory:
        console.print(_floor_table(memory, head))
    peak = [r for r in records if r.kernel == "fma"]
    if peak:
        console.print(_peak_table(peak))
    rest = [r for r in records if r.kernel not in ("memory", "fma")]
    single = [r for r in rest if r.kernel != "multi"]  # multi has its own table below
    if single:
        console.print(_kernel_table(single, head, bool(memory), bool(peak)))
    ratio = _experts_table(rest)
    if ratio is not None:
        console.print(ratio)
    multi = _multi_table(rest)
    if multi is not None:
        console.print(multi)
    if ggml:
        console.print(_ggml_table(ggml))
    for line in _working_sets(records) + notes:
        console.print(line, highlight=False)
    if args.output != "text":
        print_tables([_table(records)], args.output)
    if args.json:
        write_json([r.to_dict() for r in records] + [{"kernel": "ggml", **g.to_dict()} for g in ggml], args.json)
        if args.json != "-":
            print(f"wrote {len(records) + len(ggml)} records to {args.json}", file=sys.stderr)
    return 0


def _ggml_table(rounds):
    from statistics import median

    from rich.table import Table as RichTable

    vs_s, vs_r = [g.vs_standard for g in rounds], [g.vs_repacked for g in rounds]
    t = RichTable(title=f"MXFP4 matvec {rounds[0].shape}, 1 thread: ds4f ({rounds[0].backend}) against ggml, "
                        f"the three in turn each round, {os.cpu_count()} cores",
                  caption=f"ds4f / standard: median {median(vs_s):.2f} ({min(vs_s):.2f}–{max(vs_s):.2f}), "
                          f"ds4f / repacked: median {median(vs_r):.2f} ({min(vs_r):.2f}–{max(vs_r):.2f}); "
                          "ggml quantizes x to q8_0 in every call (counted); G weights/s, median of 50 calls per round")
    for col in ("round", "load", "ds4f", "ggml standard", "ggml repacked", "÷ standard", "÷ repacked"):
        t.add_column(col, justify="right")
    for g in rounds:
        t.add_row(str(g.round + 1), _fmt(g.load, ".2f"), f"{g.gw['ds4f']:.1f}", f"{g.gw['standard']:.1f}",
                  f"{g.gw['repacked']:.1f}", f"{g.vs_standard:.2f}", f"{g.vs_repacked:.2f}")
    return t


_WIDTH = {"scalar": "64-bit", "neon": "128-bit", "avx2": "256-bit", "avx512": "512-bit"}


def _floor_table(memory, head: str):
    from rich.table import Table as RichTable

    threads = sorted({r.threads for r in memory})
    t = RichTable(title=f"memory floor — one streaming read of {memory[0].shape.removesuffix(' read')}, {head}",
                  caption="GB/s of plain loads of the backend's width on the kernels' pool, hardware prefetch only; "
                          "×1T = all cores / 1 thread")
    for col in ("backend", "loads", "pages"):
        t.add_column(col)
    for nt in threads:
        t.add_column(f"{nt} thr GB/s", justify="right")
    if len(threads) > 1:
        t.add_column("×1T", justify="right")
    rows: dict[tuple[str, str], dict[int, float]] = {}
    for r in memory:
        rows.setdefault((r.backend, r.pages or ""), {})[r.threads] = r.gb_per_s
    for (backend, pages), by_nt in rows.items():
        cells = [backend, _WIDTH.get(backend, ""), pages] + [_fmt(by_nt.get(nt), ".2f") for nt in threads]
        if len(threads) > 1:
            lo, hi = by_nt.get(threads[0]), by_nt.get(threads[-1])
            cells.append(_fmt(hi / lo if lo and hi else None, ".2f"))
        t.add_row(*cells)
    return t


def _peak_table(peak):
    from rich.table import Table as RichTable

    threads = sorted({r.threads for r in peak})
    t = RichTable(title="FMA peak — 12 independent multiply-add chains of the backend's width",
                  caption="G multiply-add lanes/s on the kernels' pool (scalar: a multiply and an add, as its kernels "
                          "do); ×1T = all cores / 1 thread")
    for col in ("backend", "per op"):
        t.add_column(col)
    for nt in threads:
        t.add_column(f"{nt} thr G lanes/s", justify="right")
    if len(threads) > 1:
        t.add_column("×1T", justify="right")
    rows: dict[str, dict[int, object]] = {}
    for r in peak:
        rows.setdefault(r.backend, {"shape": r.shape})[r.threads] = r.glanes_per_s
    for backend, by_nt in rows.items():
        cells = [backend, by_nt["shape"].removesuffix(" per op")] + [_fmt(by_nt.get(nt), ".1f") for nt in threads]
        if len(threads) > 1:
            lo, hi = by_nt.get(threads[0]), by_nt.get(threads[-1])
            cells.append(_fmt(hi / lo if lo and hi else None, ".2f"))
        t.add_row(*cells)
    return t


def _kernel_table(records, head: str, with_floor: bool, with_peak: bool = False):
    from rich.table import Table as RichTable

    table = RichTable(
        title=f"ds4f kernels — {head}",
        caption="hot = the same weights every call (cached as far as they fit) · cold = a new copy each call from a working set "
                "beyond 2x the LLC (from RAM), on huge or 4 KiB pages · GB/s = weight bytes read/s · "
                "Gw/s = G weights/s · of floor = GB/s / the memory floor at the same backend and threads"
                + ("" if with_floor else " (not measured: add memory to --kernels)")
                + " · of FMA = Gw/s / the FMA peak in lanes/s (one multiply-add lane per weight)"
                + ("" if with_peak else " (not measured: add fma to --kernels)")
                + " · wall = memory at 0.7 of the floor or more, else compute"
                + " · ×scalar at the same thread count · ×numpy = table decode + np.dot (its own BLAS threads) · "
                "×1T = same backend at 1 thread",
    )
    for col, just in (("kernel", "left"), ("shape", "left"), ("data", "left"), ("backend", "left"),
                      ("thr", "right"), ("median ms", "right"), ("GB/s", "right"), ("Gw/s", "right"),
                      ("of floor", "right"), ("of FMA", "right"), ("wall", "left"), ("×scalar", "right"),
                      ("×numpy", "right"), ("×1T", "right")):  # fmt: skip
        table.add_column(col, justify=just)
    last = None
    for r in records:
        key = (r.kernel, r.shape, r.cold, r.pages)
        if last is not None and key != last:
            table.add_section()
        last = key
        table.add_row(
            r.kernel, r.shape, _data(r), r.backend, str(r.threads) if r.threads else "np",
            f"{r.median_s * 1e3:.2f}", f"{r.gb_per_s:.2f}", _fmt(r.gweights_per_s, ".2f"),
            _fmt(r.fraction_of_floor, ".2f"), _fmt(r.fraction_of_fma_peak, ".2f"), r.wall or "—",
            _fmt(r.speedup_vs_scalar, ".1f"), _fmt(r.speedup_vs_numpy, ".0f"), _fmt(r.speedup_vs_1thread, ".2f"),
        )  # fmt: skip
    return table


def _experts_table(records):
    """The 6-expert entry point's Gw/s against hot single-matrix matvecs on the same shapes."""
    from rich.table import Table as RichTable

    rows = [r for r in records if r.kernel == "experts" and r.vs_hot_matvec is not None]
    if not rows:
        return None
    t = RichTable(title="6 experts against hot matvec",
                  caption="hot matvec = the hot MXFP4 matvecs of this run in the experts' mix of shapes "
                          "(2/3 of the weights 2048x4096, 1/3 4096x2048), same backend and threads; "
                          "ratio = experts Gw/s / hot matvec Gw/s")
    for col, just in (("backend", "left"), ("thr", "right"), ("data", "left"), ("experts Gw/s", "right"),
                      ("hot matvec Gw/s", "right"), ("ratio", "right")):
        t.add_column(col, justify=just)
    for r in sorted(rows, key=lambda r: (r.backend, r.threads, r.cold, r.pages or "")):
        t.add_row(r.backend, str(r.threads), _data(r), f"{r.gweights_per_s:.2f}",
                  f"{r.gweights_per_s / r.vs_hot_matvec:.2f}", f"{r.vs_hot_matvec:.2f}")
    return t


def _multi_table(records):
    """The multi-token kernels against single-vector calls on the same vectors."""
    from rich.table import Table as RichTable

    rows = [r for r in records if r.kernel == "multi"]
    if not rows:
        return None
    t = RichTable(title="several vectors per call against single-vector calls",
                  caption="Gw/s = G weights/s, each weight counted once per vector · batched = one call on all "
                          "vectors · single = one call per vector, measured in turn · ratio = batched / single · "
                          "of FMA = batched Gw/s / the FMA peak in lanes/s")
    for col, just in (("format", "left"), ("vectors", "right"), ("backend", "left"), ("thr", "right"),
                      ("batched Gw/s", "right"), ("single Gw/s", "right"), ("ratio", "right"), ("of FMA", "right")):
        t.add_column(col, justify=just)
    for r in rows:
        t.add_row(r.shape, str(r.tokens), r.backend, str(r.threads), f"{r.gweights_per_s:.2f}",
                  f"{r.single_gweights_per_s:.2f}", f"{r.vs_single:.2f}", _fmt(r.fraction_of_fma_peak, ".2f"))
    return t


def _working_sets(records) -> list[str]:
    lines, seen = [], set()
    for r in records:
        if not r.cold or (r.kernel, r.pages) in seen or r.working_set_bytes is None:
            continue
        seen.add((r.kernel, r.pages))
        what = "memory floor" if r.kernel == "memory" else f"{r.kernel} cold"
        huge = ""
        if r.huge_page_bytes is not None:
            huge = f", {r.huge_page_bytes / r.working_set_bytes:.0%} of it on transparent huge pages"
        lines.append(f"{what}: {_size(r.working_set_bytes)} on {r.pages} pages{huge}")
    return lines


def _table(records) -> Table:
    t = Table("kernels", [Column("kernel", align="left"), Column("shape", align="left"),
                          Column("cold", align="left"), Column("pages", align="left"),
                          Column("backend", align="left"), Column("threads", "thr"),
                          Column("median_ms", "median ms", ".2f"), Column("gb_per_s", "GB/s", ".2f"),
                          Column("gweights_per_s", "Gw/s", ".2f"), Column("fraction_of_floor", "of floor", ".2f"),
                          Column("fraction_of_fma_peak", "of FMA", ".2f"), Column("wall", align="left"),
                          Column("glanes_per_s", "G lanes/s", ".1f"),
                          Column("x_scalar", "×scalar", ".1f"), Column("x_numpy", "×numpy", ".0f"),
                          Column("x_1thread", "×1T", ".2f"), Column("vs_hot_matvec", "÷ hot matvec", ".2f"),
                          Column("tokens", "vectors"), Column("vs_single", "×single", ".2f"),
                          Column("working_set_bytes", "working set"),
                          Column("huge_page_bytes", "on huge pages")])
    for r in records:
        t.add(r.kernel, r.shape, r.cold, r.pages, r.backend, r.threads if r.threads else "numpy", r.median_s * 1e3,
              r.gb_per_s, r.gweights_per_s, r.fraction_of_floor, r.fraction_of_fma_peak, r.wall, r.glanes_per_s,
              r.speedup_vs_scalar, r.speedup_vs_numpy,
              r.speedup_vs_1thread, r.vs_hot_matvec, r.tokens, r.vs_single, r.working_set_bytes, r.huge_page_bytes)
    return t
