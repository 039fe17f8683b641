"""The console's plain-Python parts: thresholds, figures, the controller's settings logic."""
import dataclasses

import pytest

from ds4f.console.core import figures as F
from ds4f.console.core import thresholds as T
from ds4f.console.core.controller import REFRESH_STEPS, Controller, next_refresh, simd_scalar_pair
from ds4f.errors import Ds4fError
from ds4f.runs.history import History
from ds4f.themes import THEME_NAMES, THEMES, next_theme, stylesheet_text

from test_console_data import builtin_settings, fixed_history, fixed_snapshot, fixed_tokens


def test_thresholds():
    assert [T.hit_rate_level(x) for x in (0.9, 0.7, 0.6, 0.4, 0.1, None)] == \
        ["fine", "fine", "careful", "warning", "critical", None]
    assert [T.io_efficiency_level(x) for x in (0.85, 0.7, 0.5, 0.2)] == ["fine", "careful", "warning", "critical"]
    gib = 2**30
    # over the plan is a warning at once, 15% over critical
    assert [T.rss_level(int(r * gib), gib) for r in (0.5, 0.99, 1.03, 1.1, 1.2)] == \
        ["fine", "fine", "warning", "warning", "critical"]
    assert T.rss_level(5, 0) is None
    # the RAM the machine can still give: under 20% careful, 10% warning, 5% critical
    assert [T.ram_level(int(f * 24 * gib), 24 * gib) for f in (0.5, 0.15, 0.08, 0.03)] == \
        ["fine", "careful", "warning", "critical"]
    assert T.ram_level(0, 0) is None
    assert T.worst("fine", None, "warning", "careful") == "warning" and T.worst(None, None) is None
    assert T.state_level("failed") == "critical"


def test_formatting():
    assert F.fmt_s_per_token(0.19) == "0.190" and F.fmt_s_per_token(7.47) == "7.47"
    assert F.fmt_s_per_token(None) == F.DASH
    assert F.fmt_seconds(0.0123) == "12 ms" and F.fmt_seconds(3.21) == "3.2 s" and F.fmt_seconds(300) == "5m00s"
    assert F.fmt_gbps(2.3) == "2.30" and F.fmt_pct(0.729) == "72.9%"
    assert F.short_path("/a/very/long/path/to/a/model", 12).startswith("…")
    gib = 2**30
    assert [F.fmt_size(x) for x in (6.2 * gib, 22.4 * gib, 101.5 * gib, 512 * 2**20, 24 * gib)] == \
        ["6.2 GiB", "22.4 GiB", "102 GiB", "512 MiB", "24.0 GiB"]
    assert F.fmt_pts(14.04) == "14.0 pts" and F.fmt_pts(None) == F.DASH
    assert [F.fmt_age(x) for x in (1, 40, 185, 5 * 3600, 3 * 86400, None)] == \
        ["just now", "40 s old", "3 min old", "5 h old", "3 d old", "age unknown"]


def test_series_and_switches():
    toks = fixed_tokens(24, switch_at=14)
    assert len(F.token_seconds(toks)) == 24
    assert all(0 <= r <= 1 for r in F.token_policy_hit_rates(toks))
    snap = fixed_snapshot()
    sw = F.run_switches(snap)
    assert len(sw) == 1 and sw[0].token == 14 and str(sw[0]) == "backend avx2→scalar at token 14"
    # a switch long before the recent tokens the snapshot holds is still the run's
    late = dataclasses.replace(snap, tokens=snap.tokens[-3:],
                               switches=snap.switches + ((22, "scalar", 8, 8),))
    assert [str(s) for s in F.run_switches(late)] == ["backend avx2→scalar at token 14",
                                                       "kernel threads 16→8 at token 22"]
    assert [s.short for s in F.run_switches(late)] == ["avx2→scalar @14", "k16→8 @22"]
    rates = F.layer_policy_hit_rates(snap)
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
    return Controller(builtin_settings(), History(tmp_path / "h.db"), model="/m", **kw)


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
    from ds4f.native import kernels

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
    c = Controller(builtin_settings(), None, model="")
    with pytest.raises(Ds4fError, match="no model"):
        c.start()


def test_simd_scalar_pair(tmp_path):
    h = fixed_history(tmp_path / "h.db")
    simd, scalar = simd_scalar_pair(h.list_runs())
    assert simd.kind == "simd" and scalar.kind == "scalar" and simd.comparable_with(scalar)
    assert simd.run_id.endswith("77e2")  # the newest SIMD run, not the mixed one
    assert simd_scalar_pair([r for r in h.list_runs() if r.kind != "scalar"]) is None


# ------------------------------------------------------------------------------ the panels' words
from ds4f.console.widgets import panels as P  # noqa: E402


def test_cache_panel_puts_the_policys_own_rate_beside_belady():
    done = fixed_snapshot("done")
    lines = P.hits_text(done).plain.splitlines()
    assert lines[0] == f"lru {F.fmt_pct(done.policy_hit_rate)} · Belady {F.fmt_pct(done.optimum_hit_rate)}"
    assert lines[1] == f"regret {done.regret_pp:.1f} pts · +{100 * done.prefetch_hit_share:.1f} pts prefetch"
    # the prefetch-inclusive rate is not comparable with Belady's: it is nowhere in the panel
    assert F.fmt_pct(done.hit_rate) not in P.hits_text(done).plain
    live = P.hits_text(fixed_snapshot("running")).plain
    assert "Belady when done" in live and "regret" not in live and "pts prefetch" in live
    off = P.hits_text(dataclasses.replace(done, prefetch={}, prefetch_hit_share=0.0)).plain
    assert "prefetch off" in off


def test_read_panel_says_what_bounds_the_run():
    disk = fixed_snapshot("running")                    # disk-bound, busy 87%, no replay yet
    assert P.bound_text(disk).plain == "disk-bound, disk busy 87%" and P.io_level(disk) == (None, "disk-bound")
    done = fixed_snapshot("done")                       # the replay's efficiency, judged
    assert P.bound_text(done).plain == "disk-bound, I/O efficiency 75%"
    assert P.io_level(done) == ("careful", "disk-bound · eff 75%")
    # compute-bound with a poor replay: calm, and said in words
    cpu = fixed_snapshot("done", bound="compute", disk_busy_fraction=0.52, io_efficiency=0.3)
    assert P.bound_text(cpu).plain == "compute-bound, disk busy 52%"
    assert P.io_level(cpu) == ("fine", "compute-bound")


def test_memory_levels_warn_before_the_box_runs_out():
    gib = 2**30
    snap = fixed_snapshot("running")                    # 102 of 120 GiB planned, 22.4 of 128 GiB free
    assert P.memory_level(snap) == ("careful", "17% RAM free")
    roomy = dataclasses.replace(snap, ram_available_bytes=60 * gib)
    assert P.memory_level(roomy) == ("fine", "85% of plan")
    over = dataclasses.replace(roomy, rss_bytes=125 * gib)
    assert P.memory_level(over) == ("warning", "104% of plan")
    assert P.memory_level(dataclasses.replace(roomy, rss_bytes=140 * gib))[0] == "critical"
    low = dataclasses.replace(snap, ram_available_bytes=int(9 * gib))
    assert P.memory_level(low) == ("warning", "7% RAM free")
    assert P.memory_level(dataclasses.replace(snap, ram_available_bytes=4 * gib)) == ("critical", "3% RAM free")
    # what the plan has yet to take (150 - 101.5 GiB) does not fit in the 40 GiB free: warn now
    short = dataclasses.replace(snap, rss_budget_bytes=150 * gib, ram_available_bytes=40 * gib)
    assert P.memory_level(short) == ("warning", "plan > free RAM")
    assert P.memory_level(dataclasses.replace(short, state="done"))[0] == "fine", "a finished run grows no more"
    assert P.memory_level(dataclasses.replace(snap, rss_budget_bytes=0, ram_bytes=0)) == (None, None)


def test_switches_newest_first_as_many_as_fit():
    sw = [F.Switch(14, "backend", "avx2", "scalar"), F.Switch(20, "kernel threads", "16", "8"),
          F.Switch(25, "io threads", "8", "12"), F.Switch(31, "backend", "scalar", "avx2")]
    assert F.switches_text([]) == ""
    assert F.switches_text(sw) == "⇄ scalar→avx2 @31 · io8→12 @25 · k16→8 @20 · avx2→scalar @14"
    assert F.switches_text(sw, width=36, lines=2) == "⇄ scalar→avx2 @31 · io8→12 @25 ·\nk16→8 @20 · avx2→scalar @14"
    assert F.switches_text(sw, width=36, lines=1) == "⇄ scalar→avx2 @31 · +3 earlier"
    assert F.switches_text(sw, keep=2) == "⇄ scalar→avx2 @31 · io8→12 @25 · +2 earlier"


def test_history_token_counts(tmp_path):
    h = fixed_history(tmp_path / "h.db")
    by_state = {r.state: r for r in h.list_runs()}
    done, cancelled = by_state["done"], by_state["cancelled"]
    assert F.record_tokens(done) == 16 and F.record_tokens_text(done) == "16"
    # a cancelled run has no report: the count is what the console saw, else unknown
    assert F.record_tokens(cancelled) is None and F.record_tokens_text(cancelled) == "?/16"
    assert F.record_tokens_text(cancelled, known=7) == "7/16"
    # should the engine record the count with the run, that is used
    h.record("20261130-020000-aaaa", dict(cancelled.config, tokens_done=5), "cancelled")
    assert F.record_tokens_text(h.get("20261130-020000-aaaa")) == "5/16"


def test_hit_rate_series_are_the_policys_own():
    # the per-token history and the per-layer strip share the yardstick of the figure beside
    # Belady's: hits on prefetched experts left out
    snap = fixed_snapshot()
    own = F.token_policy_hit_rates(snap.tokens)
    assert own == pytest.approx([(t.hits - t.prefetch_hits) / (t.hits + t.misses) for t in snap.tokens])
    assert any(t.prefetch_hits for t in snap.tokens)
    assert all(o < t.hits / (t.hits + t.misses) for o, t in zip(own, snap.tokens) if t.prefetch_hits)
    layers = F.layer_policy_hit_rates(snap)
    assert layers == pytest.approx([(h - p) / (h + m) for h, m, p in
                                    zip(snap.layer_hits, snap.layer_misses, snap.layer_prefetch_hits)])
    # requested over the whole run, the layers' own hits are the run's
    requests = sum(snap.layer_hits) + sum(snap.layer_misses)
    assert sum(h - p for h, p in zip(snap.layer_hits, snap.layer_prefetch_hits)) / requests == \
        pytest.approx(snap.policy_hit_rate)
    # a snapshot from before the per-layer counts (none given): the cache's hits as they are
    old = dataclasses.replace(snap, layer_prefetch_hits=())
    assert F.layer_policy_hit_rates(old) == pytest.approx([h / (h + m) for h, m in zip(snap.layer_hits, snap.layer_misses)])
    # the diff screen's side by side: the policy's own rate; an old report's rate said to include prefetch
    assert F.own_hit_rate_text({"policy_hit_rate": 0.712, "hit_rate": 0.78}) == "71.2%"
    assert F.own_hit_rate_text({"hit_rate": 0.78, "prefetch": {"useful": 3}}) == "78.0% with prefetch"
    assert F.own_hit_rate_text({"hit_rate": 0.78, "prefetch": None}) == "78.0%"
    assert F.own_hit_rate_text({}) == F.DASH


def test_run_panel_lines_fit_the_panel():
    snap = fixed_snapshot("running")
    # room to spare: each group of figures on its own line
    lines, error = F.run_lines(snap, 60, 10)
    assert lines == ["ETA 1.5 s · elapsed 7.9 s", "stall 12 ms/token", "preset server · run 20261130-015508-a1b2"]
    assert error == []
    # 80x24: 36 columns and 4 lines under the state line
    lines, _ = F.run_lines(snap, 36, 4)
    assert lines == ["ETA 1.5 s · elapsed 7.9 s", "stall 12 ms/token", "preset server", "run 20261130-015508-a1b2"]
    # shorter still: the figures share lines
    assert F.run_lines(snap, 36, 3)[0] == ["ETA 1.5 s · elapsed 7.9 s", "stall 12 ms/token · preset server",
                                          "run 20261130-015508-a1b2"]
    # a prompt read layer by layer: its progress, rate and reads per prompt token, from the snapshot
    pre = dataclasses.replace(snap, phase="prefill", prompt_tokens=512, prefill_tokens=256, prefill_chunk=256,
                              prefill_tokens_per_s=8.25, prefill_gb_per_token=0.0241)
    lines, _ = F.run_lines(pre, 120, 10)
    assert lines[1] == "prefill 256/512 prompt tokens (chunks of 256) · 8.25 tok/s · 0.024 GB/prompt token"
    assert F.run_lines(dataclasses.replace(pre, phase="decode"), 120, 10)[0][1].startswith("prefilled 256/512")
    # a failed run's error gets what room is left, one line at least, cut with an ellipsis
    failed = dataclasses.replace(fixed_snapshot("failed"), error="reading expert 17 of layer 12: short read " * 3)
    lines, error = F.run_lines(failed, 36, 4)
    assert len(lines) + len(error) == 4 and len(error) == 1
    assert error[0].startswith("reading expert 17") and error[0].endswith("…") and len(error[0]) <= 36
    assert all(len(line) <= 36 for line in lines)
    # unknown size (before the first layout): nothing is cut
    lines, error = F.run_lines(failed)
    assert error == [failed.error] and "run 20261130-015508-a1b2" in " · ".join(lines)
    assert F.clip_text("a b c d e f", 3, 2) == ["a b", "c…"]
    assert F.clip_text("a b c d e f g h", 5, 2) == ["a b c", "d e…"]
    assert F.clip_text("a b c d e f", 5, 2) == ["a b c", "d e f"], "what fits is not cut"
    assert F.pack_lines([["a"], ["b"], ["c"]], 5, 2) == ["a · b", "c"], "as tight as the width allows"
    assert F.pack_lines([["a"], ["b"], ["c"]], 5, 3) == ["a", "b", "c"]


def test_the_runs_directory_against_its_budget_as_the_history_screen_says_it(tmp_path, monkeypatch):
    """Controller.runs_dir_figures reads the real runs directory (its files on disk and the
    history) against [runs] budget; runs_dir_text says it in one line."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    settings = dataclasses.replace(builtin_settings(), runs_budget=4 * 10**6)
    c = Controller(settings, History(tmp_path / "h.db"), model="/m")
    run_dir = tmp_path / "xdg" / "ds4f" / "runs" / "19990101-000000-abcd"
    run_dir.mkdir(parents=True)
    (run_dir / "state.bin").write_bytes(b"s" * 1_500_000)
    fig = c.runs_dir_figures()
    assert fig["budget_bytes"] == 4 * 10**6 and 1_500_000 < fig["used_bytes"] < 2_000_000, fig
    assert fig["dir"] == str(run_dir.parent) and fig["runs"] == 1 and fig["removed"] == 0
    line = F.runs_dir_text(fig)
    assert line.startswith("runs dir 1.") and "MiB of 3.8 MiB (" in line and "removed" not in line, line
    assert F.runs_dir_text({**fig, "removed": 3, "history_rows_removed": 1}).endswith(
        " · 3 old runs' files removed · 1 old record removed")
    assert F.runs_dir_text(None) == "" and Controller(settings, None, model="/m").runs_dir_figures() is None
