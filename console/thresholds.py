"""The dashboard's colour thresholds, in one place (glances/btop style: four levels).

A level is one of fine, careful, warning, critical. The colour of each comes from the theme
($level-fine, ...); the level's word is also shown in text, so nothing depends on colour
alone (NO_COLOR, monochrome terminals, colour-blind operators).
"""
from __future__ import annotations

FINE, CAREFUL, WARNING, CRITICAL = "fine", "careful", "warning", "critical"
LEVELS = (FINE, CAREFUL, WARNING, CRITICAL)

# Higher is better: value >= first bound is fine, >= second careful, >= third warning, else critical.
HIT_RATE = (0.70, 0.50, 0.30)          # expert-cache hits / routed requests
IO_EFFICIENCY = (0.80, 0.60, 0.40)     # effective read GB/s / NVMe floor
# Lower is better: RSS / the preset's budget. The budget is what a healthy run holds once its
# cache has filled (pinned trunk, cache, buffers, the process before the run), so up to it is
# fine; 5% over is careful, 15% over a warning, beyond that critical (something the preset does
# not account for is growing).
RSS_RATIO = (1.00, 1.05, 1.15)


def higher_is_better(value: float | None, bounds: tuple[float, float, float]) -> str | None:
    if value is None:
        return None
    fine, careful, warning = bounds
    if value >= fine:
        return FINE
    if value >= careful:
        return CAREFUL
    if value >= warning:
        return WARNING
    return CRITICAL


def lower_is_better(value: float | None, bounds: tuple[float, float, float]) -> str | None:
    if value is None:
        return None
    fine, careful, warning = bounds
    if value < fine:
        return FINE
    if value < careful:
        return CAREFUL
    if value < warning:
        return WARNING
    return CRITICAL


def hit_rate_level(rate: float | None) -> str | None:
    return higher_is_better(rate, HIT_RATE)


def io_efficiency_level(eff: float | None) -> str | None:
    return higher_is_better(eff, IO_EFFICIENCY)


def rss_level(rss_bytes: int | None, budget_bytes: int | None) -> str | None:
    if not rss_bytes or not budget_bytes:
        return None
    return lower_is_better(rss_bytes / budget_bytes, RSS_RATIO)


def state_level(state: str | None) -> str | None:
    return {"running": FINE, "starting": CAREFUL, "done": FINE, "cancelled": WARNING,
            "failed": CRITICAL}.get(state or "")
