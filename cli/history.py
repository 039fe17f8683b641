"""`ds4f history list|show|prune`: the run history (ds4f.toml's [history] path) from the shell.

`prune` removes history rows and the files those runs own: their state dumps and reports
inside the ds4f data directory, and a run's own directory there once empty. Files elsewhere
(a --dump-state the user chose) are never touched. Without --yes it only says what it would
remove.
"""
from __future__ import annotations

import argparse
import datetime
import sys

from ds4f.api import Ds4fError
from ds4f.cli.output import Column, Table, disk_size, print_tables, write_json
from ds4f.cli.options import add_config, add_output_option

DEFAULT_LIMIT = 20


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    add_config(parser)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser("list", help="the most recent runs, newest first")
    ls.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"how many runs (default {DEFAULT_LIMIT})")
    add_output_option(ls)
    show = sub.add_parser("show", help="one run: its settings, figures and files")
    show.add_argument("run_id", metavar="RUN_ID", help="the run's id, or a prefix of it that only one run has")
    add_output_option(show, ("text", "json"))
    prune = sub.add_parser("prune", help="remove old runs and the files they own in the data directory",
                           description="Remove runs from the history with the state dumps and reports they own "
                                       "inside the ds4f data directory. A run goes when every rule given says so. "
                                       "Without --yes, only list what would go.")
    prune.add_argument("--keep", type=int, metavar="N", help="keep the newest N runs")
    prune.add_argument("--older-than", type=float, metavar="DAYS",
                       help="remove only runs started more than DAYS days ago")
    prune.add_argument("--yes", action="store_true", help="remove them (without it, prune only lists them)")
    # ds4f history --config X list: also accepted after the action
    for p in (ls, show, prune):
        add_config(p, dest="config_after", hidden=True)


def _history(args):
    from ds4f.api import History, load_settings

    return History(load_settings(getattr(args, "config_after", None) or args.config).history_path)


def run(args) -> int:
    return {"list": _list, "show": _show, "prune": _prune}[args.action](args)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _per_second(seconds):
    return 1.0 / seconds if seconds else None


def _own_hits(summary: dict) -> float | None:
    """The policy's own hit rate (without prefetch's help), the rate runs are compared on."""
    own = summary.get("policy_hit_rate")
    return own if own is not None else (summary.get("hit_rate") if not summary.get("prefetch") else None)


def _list(args) -> int:
    if args.limit < 1:
        raise Ds4fError("--limit must be at least 1")
    history = _history(args)
    records = history.list_runs(limit=args.limit)
    table = Table("runs", [Column("run_id", "run", align="left"), Column("started", align="left"),
                           Column("state", align="left"), Column("model", align="left"),
                           Column("preset", align="left"), Column("backend", "kernels", align="left"),
                           Column("tokens"), Column("s_per_token", "s/token", ".3f"),
                           Column("tokens_per_s", "tokens/s", ".2f"), Column("policy_hit_rate", "own hits", ".1%"),
                           Column("state_sha256", "sha256", align="left")])
    for r in records:
        table.add(r.run_id, _when(r.started_at), r.state, r.model, r.preset, r.backend, r.tokens_done,
                  r.s_per_token, _per_second(r.s_per_token), _own_hits(r.summary),
                  r.state_sha256 if args.output in ("csv", "json") else r.short_sha)
    if args.output != "text":
        print_tables([table], args.output)
        return 0
    if not records:
        print(f"no runs recorded in {history.path}")
        return 0
    print(table.text())
    total = history.count()
    more = f", {total - len(records)} older not shown (--limit)" if total > len(records) else ""
    print(f"{len(records)} of {total} runs in {history.path}{more}", file=sys.stderr)
    return 0


def _find(history, run_id: str):
    record = history.get(run_id)
    if record is not None:
        return record
    matches = [r for r in history.list_runs(limit=max(history.count(), 1)) if r.run_id.startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise Ds4fError(f"{run_id}: no such run in {history.path} (ds4f history list shows them)")
    raise Ds4fError(f"{run_id}: {len(matches)} runs start with it ({', '.join(r.run_id for r in matches[:5])}"
                    f"{', …' if len(matches) > 5 else ''}); give more of the id")


def _show(args) -> int:
    from ds4f.api import run_files

    history = _history(args)
    r = _find(history, args.run_id)
    files = run_files(r)
    if args.output == "json":
        write_json({"run_id": r.run_id, "state": r.state, "started_at": r.started_at, "finished_at": r.finished_at,
                    "config": r.config, "summary": r.summary, "state_path": r.state_path,
                    "state_sha256": r.state_sha256, "error": r.error, "files": [str(f) for f in files]}, "-")
        return 0
    s = r.summary
    print(f"run            {r.run_id} · {r.state}")
    print(f"started        {_when(r.started_at)} · {r.duration_s:.1f} s")
    print(f"model          {r.model}")
    print(f"preset         {r.config.get('preset_detail') or r.preset}")
    print(f"kernels        {', '.join(r.backends) or '—'} · {r.config.get('kernel_threads', '—')} kernel threads · "
          f"{r.config.get('io_threads', '—')} I/O threads")
    prompt = r.config.get("prompt") or []
    made = r.config.get("generated_tokens", max(0, r.tokens_done - max(0, len(prompt) - 1)))
    print(f"tokens         {made} generated of {r.gen if r.gen is not None else '—'} asked · "
          f"prompt of {len(prompt)} {prompt if len(prompt) <= 16 else str(prompt[:16])[:-1] + ', …]'}")
    c = r.config
    if c.get("text") is not None or c.get("messages"):
        if c.get("messages"):
            turns = " | ".join(f"{m.get('role')}: {m.get('content')}" for m in c["messages"])
            print(f"chat           {turns}{' (thinking)' if c.get('thinking') else ''}")
        else:
            print(f"prompt text    {c['text']!r}")
        sampling = c.get("sampling")
        how = "greedy" if not sampling else " · ".join(f"{k} {v}" for k, v in sampling.items())
        print(f"sampling       {how}" + (f" · stop {c['stop']}" if c.get("stop") else ""))
        print(f"output         {c.get('output_text', '')!r} ({c.get('finish_reason') or r.state})")
    if s:
        sp = s.get("s_per_token")
        print(f"s/token        {_fmt(sp, '.3f')} warm (median) · {_fmt(_per_second(sp), '.2f')} tokens/s · "
              f"{_fmt(s.get('s_first_token'), '.3f')} first token (cold)")
        print(f"GB/token       {_fmt(s.get('gb_per_token'), '.3f')} warm · "
              f"effective read {_fmt(s.get('eff_read_gbps'), '.2f', ' GB/s')}")
        own, share, best = s.get("policy_hit_rate"), s.get("prefetch_hit_share"), s.get("optimum_hit_rate")
        if own is not None:
            print(f"cache          {own:.1%} own hits · +{_fmt(share * 100 if share is not None else None, '.1f')} pts"
                  f" prefetch · Belady {_fmt(best, '.1%')} · stall {_fmt(s.get('stall_s_per_token'), '.3f', ' s/token')}")
        else:  # a record written before the split
            print(f"cache          {_fmt(s.get('hit_rate'), '.1%')} hits (with prefetch) · stall "
                  f"{_fmt(s.get('stall_s_per_token'), '.3f', ' s/token')}")
        pre = s.get("prefill")
        if pre:
            print(f"prefill        {pre['tokens']} prompt tokens in chunks of {pre['chunk']} · "
                  f"{_fmt(pre.get('tokens_per_s'), '.2f')} tokens/s · {pre['gb_per_token']:.3f} GB/prompt token")
        if s.get("rss_bytes") is not None:
            print(f"memory         RSS {s['rss_bytes'] / 2**30:.2f} GiB of "
                  f"{(s.get('rss_budget_bytes') or 0) / 2**30:.2f} GiB budget")
    if r.error:
        print(f"error          {r.error}")
    if r.state_sha256:
        print(f"sha256         {r.state_sha256}")
    for label, f in zip(("state", "report"), files):
        print(f"{label:<15}{f}{'' if f.exists() else ' (gone)'}")
    return 0


def _fmt(value, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def _prune(args) -> int:
    from ds4f.api import plan_prune, prune_runs, user_data_dir

    if args.keep is None and args.older_than is None:
        raise Ds4fError("prune: say which runs go: --keep N (keep the newest N), --older-than DAYS, or both")
    history = _history(args)
    data_dir = user_data_dir()
    plan = plan_prune(history, data_dir, keep=args.keep,
                      older_than_s=None if args.older_than is None else args.older_than * 86400)
    if not plan.runs:
        print(f"nothing to prune: no run in {history.path} matches")
        return 0
    verb = "removing" if args.yes else "would remove"
    for r in plan.runs:
        print(f"{verb} run {r.run_id}  {_when(r.started_at)}  {r.state}")
    for f in plan.files:
        print(f"{verb} file {f}")
    for f, why in plan.kept:
        print(f"keeping file {f} ({why})")
    summary = (f"{len(plan.runs)} run{'s' if len(plan.runs) != 1 else ''} and {len(plan.files)} "
               f"file{'s' if len(plan.files) != 1 else ''} ({disk_size(plan.nbytes)}) in {data_dir}")
    if not args.yes:
        print(f"would remove {summary}; nothing removed: pass --yes to remove them")
        return 0
    n_runs, n_files, problems = prune_runs(history, plan)
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    print(f"removed {n_runs} run{'s' if n_runs != 1 else ''} and {n_files} file{'s' if n_files != 1 else ''} "
          f"({disk_size(plan.nbytes)}) from {history.path} and {data_dir}")
    return 1 if problems else 0
