"""Screenshots of the console with fixed data (pytest-textual-snapshot), kept in tests/console/snapshots/.

No engine runs here: the dashboard is fed one fixed Snapshot, the history a fixed SQLite
file, the diff screen a fixed StateDiff. Update with `pytest tests/console/test_console_snapshots.py
--snapshot-update` after checking the new images by eye (the HTML report shows them).
Textual is pinned in pyproject.toml because its rendering changes between releases.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import pytest_textual_snapshot

from ds4f.console.app import Ds4fConsole
from ds4f.console.core.controller import Controller
from ds4f.console.screens import DiffScreen

from test_console_data import MODEL, builtin_settings, fixed_diff, fixed_history, fixed_snapshot

SNAPSHOT_DIR = Path(__file__).parent / "snapshots"


class _Ds4fSVG(pytest_textual_snapshot.SVGImageExtension):
    """The plugin's SVG extension, storing files under tests/console/snapshots/<test module>/."""

    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(SNAPSHOT_DIR / test_location.basename)


@pytest.fixture(autouse=True)
def _snapshot_dir_and_clock(monkeypatch):
    monkeypatch.setattr(pytest_textual_snapshot, "SVGImageExtension", _Ds4fSVG)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.delenv("NO_COLOR", raising=False)
    # the runs directory's figures, fixed (the real one is this test session's data directory)
    monkeypatch.setattr(Controller, "runs_dir_figures", lambda self: {"used_bytes": 3_250_000_000,
                                                                      "budget_bytes": 20 * 10**9, "removed": 2})
    yield
    time.tzset()


def make_app(tmp_path, snap="running", theme=None, diff="low-bit", **changes) -> Ds4fConsole:
    """`changes`: Snapshot fields to replace in the fixed snapshot."""
    history = fixed_history(tmp_path / "history.sqlite3")
    snapshot = None if snap is None else fixed_snapshot(snap, **changes)
    # fixed settings, so the status line does not depend on this machine's CPU (best backend, cores)
    # nor on the engine's default token count
    settings = builtin_settings()
    settings = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, backend="avx2",
                                                                        kernel_threads=16, io_threads=8))
    return Ds4fConsole(settings=settings, history=history, model=MODEL, validate_model=False, gen=16,
                       snapshot_source=lambda: snapshot, diff_fn=lambda a, b: fixed_diff(diff), theme=theme)


def test_dashboard_80x24(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), terminal_size=(80, 24))


def test_dashboard_160x48(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), terminal_size=(160, 48))


def test_dashboard_done_compute_bound_80x24(snap_compare, tmp_path):
    # Belady and the regret once the run is done; a compute-bound run with a poor replay is calm;
    # the RAM gets short; three live switches in a panel with room for one
    app = make_app(tmp_path, snap="done", bound="compute", disk_busy_fraction=0.52, io_efficiency=0.31,
                   kernel_threads=12, io_threads=10,
                   ram_available_bytes=9 * 2**30,
                   switches=((0, "avx2", 16, 8), (14, "scalar", 16, 8), (19, "scalar", 12, 8), (22, "scalar", 12, 10)))
    assert snap_compare(app, terminal_size=(80, 24))


def test_dashboard_failed_80x24(snap_compare, tmp_path):
    # every line of the run panel shows at 80x24, a failed run's error in what room is left
    app = make_app(tmp_path, snap="failed", eta_s=None,
                   error="reading expert 17 of layer 12: pool-mxfp4.bin: short read at offset 8388608")
    assert snap_compare(app, terminal_size=(80, 24))


def test_too_small_70x20(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), terminal_size=(70, 20))


def test_dashboard_idle_80x24(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path, snap=None), terminal_size=(80, 24))


def test_dashboard_light_120x36(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path, theme="ds4f-light"), terminal_size=(120, 36))


def test_dashboard_contrast_80x24(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path, theme="ds4f-contrast"), terminal_size=(80, 24))


def test_history_80x24(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), press=["h", "down", "down", "down"], terminal_size=(80, 24))


def test_history_160x48(snap_compare, tmp_path):
    # marks two runs with the same hash
    assert snap_compare(make_app(tmp_path), press=["h", "down", "down", "down", "down", "space", "down", "space"],
                        terminal_size=(160, 48))


def _diff_of(kind: str):
    async def run_before(pilot) -> None:
        app = pilot.app
        while app.controller is None:  # booted on Ready
            await pilot.pause(0.02)
        runs = app.controller.runs()
        by_tail = {r.run_id[-4:]: r for r in runs}
        b = by_tail["0c11"] if kind == "identical" else by_tail["5a03"]
        app.push_screen(DiffScreen(by_tail["77e2"], b, diff=fixed_diff(kind)))
        await pilot.pause()

    return run_before


def test_diff_identical_80x24(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), run_before=_diff_of("identical"), terminal_size=(80, 24))


def test_diff_routing_80x24(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), run_before=_diff_of("routing"), terminal_size=(80, 24))


def test_diff_low_bit_160x48(snap_compare, tmp_path):
    assert snap_compare(make_app(tmp_path), run_before=_diff_of("low-bit"), terminal_size=(160, 48))
