"""`ds4f replay` and `ds4f trace export`: the cache lab from the shell."""
from __future__ import annotations

import argparse

from ds4f.api import Ds4fError
from ds4f.cli.output import Column, Table, check_output, command_inputs, human_stream, print_tables
from ds4f.cli.options import add_force, add_output_option

DEFAULT_SWEEP = "5%,10%,15%,20%,25%,30%,40%,50%,60%,75%"


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "replay":
        parser.add_argument("trace", help="a run's state dump (state.bin) or an exported trace (.npz)")
        parser.add_argument("--cache", default="25%", metavar="BUDGET",
                            help="cache budget: a size ('4 GiB') or a fraction of the pool ('25%%'); default 25%%")
        parser.add_argument("--policy", default="all",
                            help="lru | lfu | fcr | cycle | duel | belady | belady@N | all, or a comma-separated "
                                 "list (default: all). belady@N sees only the next N tokens' requests and evicts "
                                 "as the default policy beyond them: how much foresight the optimum needs")
        parser.add_argument("--sweep", nargs="?", const=DEFAULT_SWEEP, default=None, metavar="BUDGETS",
                            help=f"replay at several budgets (comma-separated; default {DEFAULT_SWEEP.replace('%', '%%')})")
        parser.add_argument("--plot", metavar="PNG", help="with --sweep: save hit rate against budget to this .png,"
                            " .svg or .pdf (needs matplotlib)")
        add_force(parser, "the --plot file")
        add_output_option(parser)
    elif name == "trace":
        sub = parser.add_subparsers(dest="action", required=True)
        export = sub.add_parser("export", help="write a run's routing trace compactly (.npz)")
        export.add_argument("state", help="the run's state dump (state.bin)")
        export.add_argument("out", help="output file (.npz)")
        add_force(export, "OUT")


def run(args) -> int:
    if args.command == "trace":
        from ds4f.api import export_trace, load_trace

        check_output(args.out, "OUT", args.force, inputs=command_inputs(extra=[("the state dump", args.state)]),
                     suffixes=(".npz",))
        out = export_trace(args.state, args.out)
        t = load_trace(out)
        print(f"{out}: {len(t.ids)} tokens x {t.geometry.n_layers} layers x top-{t.geometry.top_k} "
              f"({out.stat().st_size} bytes)")
        return 0
    return _replay(args)


def _policies(text: str) -> list[str]:
    from ds4f.api import ONLINE_POLICIES, parse_policy

    known = [*ONLINE_POLICIES, "belady"]
    if text == "all":
        return known
    names = [p.strip() for p in text.split(",") if p.strip()]
    for p in names:
        try:
            parse_policy(p)
        except Ds4fError as exc:
            raise Ds4fError(f"--policy: {exc}") from None
    bad = [p for p in names if p not in known and not p.startswith("belady@")]
    if bad:
        raise Ds4fError(f"--policy: unknown policy {bad[0]!r} (known: {', '.join(known)}, belady@N, all)")
    return names


def _replay(args) -> int:
    from ds4f.api import format_table, load_trace, plot_sweep, sweep

    if args.plot:
        check_output(args.plot, "--plot", args.force, inputs=command_inputs(extra=[("the trace", args.trace)]),
                     suffixes=(".png", ".svg", ".pdf"))
    trace = load_trace(args.trace)
    policies = _policies(args.policy)
    budgets = [b.strip() for b in (args.sweep or args.cache).split(",") if b.strip()]
    g = trace.geometry
    if args.plot and not args.sweep:
        raise Ds4fError("--plot needs --sweep")
    out = human_stream(args)
    print(f"{args.trace}: {len(trace.ids)} tokens, {g.n_layers} layers x {g.n_experts} experts, top-{g.top_k}, "
          f"pool {trace.pool_bytes / 2**30:.2f} GiB in {trace.slot_nbytes / 2**20:.2f} MiB records", file=out)
    results = sweep([trace], budgets, policies)
    if args.output == "text":
        print(format_table(results, budgets, policies))
    else:
        print_tables([sweep_table(results, budgets, policies)], args.output)
    if args.plot:
        plot_sweep(results, budgets, policies, args.plot, title=str(args.trace))
        print(f"plot: {args.plot}", file=out)
    return 0


def sweep_table(results, budgets: list[str], policies: list[str]) -> Table:
    """The sweep as a table: a row per budget, its size in GiB, the hit rate of each policy
    (empty where the budget cannot hold one token's experts)."""
    table = Table("sweep", [Column("budget", align="left"), Column("budget_gib", "GiB", ".2f"),
                            *(Column(p, spec=".1%") for p in policies)])
    for b in budgets:
        gib = next((results[b, p].budget_bytes for p in policies if results[b, p].budget_bytes), 0) / 2**30
        table.add(b, gib, *(results[b, p].hit_rate for p in policies))
    return table
