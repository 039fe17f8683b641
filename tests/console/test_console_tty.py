"""The console in a real pseudo-terminal: what it costs an SSH link.

The dashboard is fed a fixed Snapshot (unchanging) or one whose progress moves every poll;
we count the bytes the app writes to the terminal per refresh, once it has drawn its first
screen. The waits are counted in refreshes (the child reports each one), not in seconds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("pty")
pytest.importorskip("fcntl")
pytest.importorskip("termios")

from ds4f.console.bench import count_refresh_bytes

APP = """
import dataclasses, itertools, os, sys, tempfile
sys.path.insert(0, {tests!r})
from test_console_data import MODEL, builtin_settings, fixed_history, fixed_snapshot
from ds4f.console.app import Ds4fConsole
from ds4f.console.bench import reporting_source
snap = fixed_snapshot()
count = itertools.count()
def source():
    if sys.argv[1] == "moving":
        n = next(count)
        return dataclasses.replace(snap, tokens_done=n % 32, elapsed_s=n * 1.0)
    return snap
history = fixed_history(os.path.join(tempfile.mkdtemp(), "h.sqlite3"))
Ds4fConsole(settings=builtin_settings(), history=history, model=MODEL, validate_model=False,
            snapshot_source=reporting_source(source), refresh_s=1.0, theme="ds4f-dark").run()
"""

# Polls before the counting starts: the first frame's, the start-up ones, then timer refreshes
# enough for the first screen to be complete.
SETTLE = 5


def _bytes_per_refresh(mode: str, refreshes: int) -> dict:
    script = APP.format(tests=str(Path(__file__).parent))
    out = count_refresh_bytes([sys.executable, "-c", script, mode], settle=SETTLE, refreshes=refreshes,
                              size=(80, 24))
    assert out["first_screen_bytes"] > 2000, "the console drew its first screen"
    return out


def test_an_unchanging_dashboard_sends_nothing():
    assert _bytes_per_refresh("idle", refreshes=3)["refresh_bytes"] == 0


def test_a_moving_run_costs_about_a_kilobyte_per_refresh():
    out = _bytes_per_refresh("moving", refreshes=5)
    assert 0 < out["bytes_per_refresh"] < 3000, out


def test_bench_console_measures_a_live_run(tiny_model):
    from ds4f.console.bench import bench_console

    out = bench_console(str(tiny_model), keys=6, refreshes=3, refresh_s=0.25, warm_tokens=5)
    assert out["keys"] >= 6 and len(out["key_latency_s"]) == out["keys"]
    assert all(x > 0 for x in out["key_latency_s"])
    assert out["key_latency_max_s"] >= out["key_latency_median_s"] > 0
    assert out["tokens_during_keys"] > 0, "the keys were timed while the run decoded"
    assert out["refreshes"] == 3 and out["refresh_bytes"] > 0, "a live run redraws"
    assert out["bytes_per_refresh"] == out["refresh_bytes"] / 3 and out["first_screen_bytes"] > 2000
    assert out["terminal"] == "80x24"
