"""Pure helpers that turn a Snapshot or a run record into the strings and series the panels draw.

No Textual here: these are plain functions, tested directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ds4f.engine.config import format_bytes
from ds4f.engine.snapshot import Snapshot, TokenRecord

DASH = "—"


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


def switches(tokens: tuple[TokenRecord, ...]) -> list[Switch]:
    """Where the backend or a thread count changed during the run, token by token."""
    out: list[Switch] = []
    for prev, cur in zip(tokens, tokens[1:]):
        if cur.backend != prev.backend:
            out.append(Switch(cur.index, "backend", prev.backend, cur.backend))
        if cur.kernel_threads != prev.kernel_threads:
            out.append(Switch(cur.index, "kernel threads", str(prev.kernel_threads), str(cur.kernel_threads)))
        if cur.io_threads != prev.io_threads:
            out.append(Switch(cur.index, "io threads", str(prev.io_threads), str(cur.io_threads)))
    return out


def backend_switches(tokens: tuple[TokenRecord, ...]) -> list[Switch]:
    return [s for s in switches(tokens) if s.what == "backend"]


def progress_text(snap: Snapshot) -> str:
    return f"{snap.tokens_done}/{snap.gen} tokens"
