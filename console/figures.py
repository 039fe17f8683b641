"""Pure helpers that turn a Snapshot or a run record into the strings and series the panels draw.

No Textual here: these are plain functions, tested directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ds4f.api import Snapshot, TokenRecord, format_bytes

DASH = "—"
STATE_MARK = {"starting": "◌", "running": "●", "done": "✓", "cancelled": "■", "failed": "✗"}


def state_mark(state: str) -> str:
    """A run's state as its one-character mark (? for a state the console does not know)."""
    return STATE_MARK.get(state, "?")


def model_name(path: str) -> str:
    """The checkpoint's directory name, which is what tells models apart in a status line."""
    if not path:
        return "(no model)"
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return name or path


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return DASH
    if s < 0.001:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def fmt_s_per_token(s: float | None) -> str:
    """The big number: seconds per token with three significant figures."""
    if s is None:
        return DASH
    if s >= 100:
        return f"{s:.0f}"
    if s >= 10:
        return f"{s:.1f}"
    if s >= 1:
        return f"{s:.2f}"
    if s >= 0.01:
        return f"{s:.3f}"
    return f"{s:.1e}"


def fmt_gbps(v: float | None) -> str:
    if v is None:
        return DASH
    if v >= 10:
        return f"{v:.1f}"
    if v >= 0.1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def fmt_pct(v: float | None, digits: int = 1) -> str:
    return DASH if v is None else f"{v * 100:.{digits}f}%"


def fmt_bytes(n: int | float | None) -> str:
    return DASH if n is None else format_bytes(n)


def fmt_when(ts: float) -> str:
    """Local date and time of a run, compact: '11-30 01:55'."""
    return time.strftime("%m-%d %H:%M", time.localtime(ts))


def short_path(path: str, width: int = 40) -> str:
    if len(path) <= width:
        return path
    return "…" + path[-(width - 1):]


def token_seconds(tokens: tuple[TokenRecord, ...]) -> list[float]:
    return [t.seconds for t in tokens]


def token_gbps(tokens: tuple[TokenRecord, ...]) -> list[float]:
    return [(t.bytes_read / 1e9) / t.seconds if t.seconds > 0 else 0.0 for t in tokens]


def token_hit_rates(tokens: tuple[TokenRecord, ...]) -> list[float]:
    out = []
    for t in tokens:
        n = t.hits + t.misses
        out.append(t.hits / n if n else 0.0)
    return out


def layer_hit_rates(snap: Snapshot) -> list[float | None]:
    out: list[float | None] = []
    for h, m in zip(snap.layer_hits, snap.layer_misses):
        out.append(h / (h + m) if h + m else None)
    return out


@dataclass(frozen=True)
class Switch:
    token: int          # index of the first token that ran with the new setting
    what: str           # "backend", "kernel threads", "io threads"
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.what} {self.before}→{self.after} at token {self.token}"


def run_switches(snap: Snapshot) -> list[Switch]:
    """Every live switch of the run, from its settings at the start and at each change
    (Snapshot.switches: the whole run, where Snapshot.tokens holds only the recent tokens)."""
    out: list[Switch] = []
    for (_, b0, k0, i0), (token, b1, k1, i1) in zip(snap.switches, snap.switches[1:]):
        if b1 != b0:
            out.append(Switch(token, "backend", b0, b1))
        if k1 != k0:
            out.append(Switch(token, "kernel threads", str(k0), str(k1)))
        if i1 != i0:
            out.append(Switch(token, "io threads", str(i0), str(i1)))
    return out


def progress_text(snap: Snapshot) -> str:
    return f"{snap.tokens_done}/{snap.gen} tokens"
