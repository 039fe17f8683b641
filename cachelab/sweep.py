"""Sweeps of the cache lab: every policy at every budget over one or more traces, as a table
(rows: budgets; columns: policies; cells: hit rate, with bytes read) and as a plot."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from ds4f.cachelab.replay import replay
from ds4f.cachelab.trace import Trace
from ds4f.engine.config import parse_budget
from ds4f.errors import Ds4fError


@dataclass
class Cell:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    budget_bytes: int = 0
    error: str = ""

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n and not self.error else None


def sweep(traces: list[Trace], budgets: list[str], policies: list[str]) -> dict[tuple[str, str], Cell]:
    """(budget, policy) -> hits and misses summed over the traces. A budget that is not a size or
    a fraction is an error here (only a budget too small for the traces becomes a cell's note)."""
    for budget in budgets:
        parse_budget(budget, "--cache")
    out: dict[tuple[str, str], Cell] = {}
    for budget in budgets:
        for policy in policies:
            cell = Cell()
            for trace in traces:
                try:
                    r = replay(trace, budget, policy)
                except Ds4fError as exc:  # e.g. a budget below one token's working set
                    cell.error = str(exc)
                    break
                cell.hits += r.hits
                cell.misses += r.misses
                cell.bytes_read += r.bytes_read
                cell.budget_bytes = r.budget_bytes
            out[budget, policy] = cell
    return out


def format_table(results: dict[tuple[str, str], Cell], budgets: list[str], policies: list[str]) -> str:
    lines = [f"{'budget':>10} {'GiB':>7} " + " ".join(f"{p:>8}" for p in policies)]
    for b in budgets:
        gib = next((results[b, p].budget_bytes for p in policies if results[b, p].budget_bytes), 0) / 2**30
        cells = []
        for p in policies:
            hr = results[b, p].hit_rate
            cells.append(f"{'too small' if hr is None else f'{hr:.1%}':>8}")
        lines.append(f"{b:>10} {gib:7.2f} " + " ".join(cells))
    lines.append("cells: hit rate (hits / routed expert requests); 'too small': the budget cannot hold one token's experts")
    return "\n".join(lines)


def plot_sweep(results, budgets, policies, path: str, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Ds4fError("--plot needs matplotlib: pip install 'ds4f[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for p in policies:
        xs, ys = [], []
        for b in budgets:
            cell = results[b, p]
            if cell.hit_rate is not None:
                xs.append(cell.budget_bytes / 2**30)
                ys.append(cell.hit_rate * 100)
        ax.plot(xs, ys, marker="o", label=p, linestyle="--" if p == "belady" else "-")
    ax.set_xlabel("expert-cache budget (GiB)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(title or "hit rate against cache budget")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")   # whole or not at all
    try:
        fig.savefig(tmp, format=out.suffix.lstrip(".").lower() or None)
        os.replace(tmp, out)
    except OSError as exc:   # a read-only filesystem, a directory gone, a full disk: said, nothing left
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise Ds4fError(f"{path}: cannot write the plot: {exc.strerror or exc}", path=str(path)) from None
    finally:
        plt.close(fig)
