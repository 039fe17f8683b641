"""The console's plain-Python parts: thresholds, figures, the controller's settings logic."""
import dataclasses

import pytest

from ds4f.console import figures as F
from ds4f.console import thresholds as T
from ds4f.console.controller import REFRESH_STEPS, Controller, next_refresh, simd_scalar_pair
from ds4f.engine.errors import Ds4fError
from ds4f.engine.history import History
from ds4f.themes import THEME_NAMES, THEMES, next_theme, stylesheet_text

from test_console_data import builtin_config, fixed_history, fixed_snapshot, fixed_tokens


def test_thresholds():
    assert [T.hit_rate_level(x) for x in (0.9, 0.7, 0.6, 0.4, 0.1, None)] == \
        ["fine", "fine", "careful", "warning", "critical", None]
    assert [T.io_efficiency_level(x) for x in (0.85, 0.7, 0.5, 0.2)] == ["fine", "careful", "warning", "critical"]
    gib = 2**30
    assert [T.rss_level(int(r * gib), gib) for r in (0.5, 0.99, 1.03, 1.1, 1.2)] == \
        ["fine", "fine", "careful", "warning", "critical"]
    assert T.rss_level(5, 0) is None
    assert T.state_level("failed") == "critical"


def test_formatting():
    assert F.fmt_s_per_token(0.19) == "0.190" and F.fmt_s_per_token(7.47) == "7.47"
    assert F.fmt_s_per_token(None) == F.DASH
    assert F.fmt_seconds(0.0123) == "12 ms" and F.fmt_seconds(3.21) == "3.2 s" and F.fmt_seconds(300) == "5m00s"
    assert F.fmt_gbps(2.3) == "2.30" and F.fmt_pct(0.729) == "72.9%"
    assert F.short_path("/a/very/long/path/to/a/model", 12).startswith("…")


def test_series_and_switches():
    toks = fixed_tokens(24, switch_at=14)
    assert len(F.token_seconds(toks)) == 24
    assert all(0 <= r <= 1 for r in F.token_hit_rates(toks))
    snap = fixed_snapshot()
    sw = F.run_switches(snap)
    assert len(sw) == 1 and sw[0].token == 14 and str(sw[0]) == "backend avx2→scalar at token 14"
    # a switch long before the recent tokens the snapshot holds is still the run's
    late = dataclasses.replace(snap, tokens=snap.tokens[-3:],
                               switches=snap.switches + ((22, "scalar", 8, 8),))
    assert [str(s) for s in F.run_switches(late)] == ["backend avx2→scalar at token 14",
                                                       "kernel threads 16→8 at token 22"]
    rates = F.layer_hit_rates(snap)
    assert len(rates) == 43 and all(0 < r < 1 for r in rates)


def test_refresh_steps():
    assert next_refresh(1.0, +1) == 2.0 and next_refresh(1.0, -1) == 0.5
    assert next_refresh(REFRESH_STEPS[-1], +1) == REFRESH_STEPS[-1]
    assert next_refresh(REFRESH_STEPS[0], -1) == REFRESH_STEPS[0]
    assert next_refresh(0.7, +1) == 1.0  # an odd value from ds4f.toml snaps onto the steps


def test_themes_and_stylesheet():
    assert len(THEMES) >= 3 and THEME_NAMES[0] == "ds4f-dark"
    assert {t.dark for t in THEMES} == {True, False}
    assert next_theme("ds4f-contrast") == "ds4f-dark" and next_theme("nord") == "ds4f-dark"
    css = stylesheet_text()
    for var in ("$level-fine", "$level-critical", "$plot-floor"):
        assert var in css
    for t in THEMES:
        assert {"level-fine", "level-careful", "level-warning", "level-critical"} <= set(t.variables)


def _controller(tmp_path, **kw):
    return Controller(builtin_config(), History(tmp_path / "h.db"), model="/m", **kw)


def test_controller_settings(tmp_path):
    c = _controller(tmp_path)
    assert c.preset == "laptop" and not c.live
    names = c.preset_names
    seen = [c.preset]
    for _ in names:
        c.cycle_preset()
        seen.append(c.preset)
    assert seen[-1] == "laptop" and set(seen) == set(names)
    io = c.effective_io_threads()
    c.adjust_io_threads(+3)
    assert c.effective_io_threads() == io + 3
    for _ in range(100):
        c.adjust_io_threads(-1)
    assert c.effective_io_threads() == 1
    for _ in range(300):
        c.adjust_kernel_threads(+1)
    import os

    assert c.effective_kernel_threads() == os.cpu_count()
    with pytest.raises(Ds4fError):
        c.set_gen(0)
    c.set_gen(64)
    rc = c.run_config()
    assert (rc.model, rc.gen, rc.preset, rc.io_threads) == ("/m", 64, "laptop", 1)
    assert any("for the next run" in n for n in c.notes)


def test_controller_rejects_a_bad_preset(tmp_path):
    with pytest.raises(Ds4fError, match="no preset named 'huge'"):
        _controller(tmp_path, preset="huge")


def test_controller_toggle_without_a_run(tmp_path):
    from ds4f.engine import kernels

    c = _controller(tmp_path)
    first = c.next_backend()
    if kernels.best_backend() == "scalar":
        with pytest.raises(Ds4fError, match="no SIMD"):
            c.toggle_backend()
        return
    c.toggle_backend()
    assert c.next_backend() != first and "scalar" in (first, c.next_backend())
    c.toggle_backend()
    assert c.next_backend() == first


def test_controller_needs_a_model(tmp_path):
    c = Controller(builtin_config(), None, model="")
    with pytest.raises(Ds4fError, match="no model"):
        c.start()


def test_simd_scalar_pair(tmp_path):
    h = fixed_history(tmp_path / "h.db")
    simd, scalar = simd_scalar_pair(h.list_runs())
    assert simd.kind == "simd" and scalar.kind == "scalar" and simd.comparable_with(scalar)
    assert simd.run_id.endswith("77e2")  # the newest SIMD run, not the mixed one
    assert simd_scalar_pair([r for r in h.list_runs() if r.kind != "scalar"]) is None
