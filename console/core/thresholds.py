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
IO_EFFICIENCY = (0.80, 0.60, 0.40)     # the disk's own time for the run's reads (a replay) / the run's
                                       # time with reads in flight; judged only when the run is disk-bound
# Lower is better: RSS / the plan (Snapshot.rss_budget_bytes: the process before the run plus
# what the preset plans for the engine and the run). A healthy run stays within it once its
# cache has filled, so up to it is fine; over it is a warning, 15% over critical (something
# the preset does not account for is growing).
RSS_RATIO = (1.00, 1.00, 1.15)
# Higher is better: the RAM the machine can still give (psutil's "available") / all of its RAM.
# Under 20% careful, under 10% a warning, under 5% critical: the box is about to swap or kill.
RAM_FREE = (0.20, 0.10, 0.05)


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


def ram_level(available_bytes: int | None, ram_bytes: int | None) -> str | None:
    if not ram_bytes or available_bytes is None:
        return None
    return higher_is_better(available_bytes / ram_bytes, RAM_FREE)


def worst(*levels: str | None) -> str | None:
    """The most severe of some levels (None: none of them is known)."""
    known = [lv for lv in levels if lv in LEVELS]
    return max(known, key=LEVELS.index) if known else None


def state_level(state: str | None) -> str | None:
    return {"running": FINE, "starting": CAREFUL, "done": FINE, "cancelled": WARNING,
            "failed": CRITICAL}.get(state or "")
