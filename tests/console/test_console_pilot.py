"""Pilot tests: every key of the console, driven against the real engine on the tiny checkpoint.

Runs are real (ds4f.runs.run on the session's tiny model); only the dashboard's refresh
period is shortened so a test sees a run progress. Each test gets its own history file.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil

import pytest
from textual.widgets import DataTable, Input, Static

from ds4f.console.core import figures as F
from ds4f.console.core import thresholds as T
from ds4f.console.app import Ds4fConsole
from ds4f.console.core.bindings import APP_BINDINGS, DASHBOARD_BINDINGS, DIFF_BINDINGS, HISTORY_BINDINGS
from ds4f.console.screens import (DashboardScreen, DiffScreen, ErrorScreen, HelpScreen, HistoryScreen,
                                  SetupScreen, TokenCountScreen)
from ds4f.console.widgets.common import EventLog, KeyBar, Meter, Panel, SizeNotice
from ds4f.native import kernels
from ds4f.runs.history import History

from console_helpers import _no_run_left_behind, async_test, history_path, make_app, wait_for  # noqa: F401 (fixtures)

SIMD = [b for b in kernels.available_backends() if b != "scalar"]
needs_simd = pytest.mark.skipif(not SIMD, reason="no SIMD backend on this CPU")
SIZE = (100, 30)


async def booted(pilot):
    await wait_for(pilot, lambda: pilot.app.controller is not None and pilot.app._booted, 30, "boot")
    await pilot.pause(0.1)


async def start_a_few_tokens(pilot, tokens: int = 3):
    """Start a run and wait until it has decoded more than `tokens` tokens."""
    app = pilot.app
    await pilot.press("r")
    await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.snapshot().tokens_done > tokens,
                   60, "a few tokens")


async def run_to_end(pilot, timeout: float = 120.0):
    app = pilot.app
    await pilot.press("r")
    await wait_for(pilot, lambda: app.controller.run is not None, 30, "the run to start")
    await wait_for(pilot, lambda: app.controller.run.finished, timeout, "the run to end")
    await pilot.pause(0.3)  # a refresh or two
    return app.controller.run


def text_of(app, selector: str) -> str:
    w = app.screen.query_one(selector, Static)
    return str(w.render())


def log_text(app) -> str:
    return "\n".join(t.plain for t in app.dashboard.query_one(EventLog).entries)


# ------------------------------------------------------------------------------ run, stop
@async_test
async def test_run_starts_progresses_and_finishes(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=1000)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        assert "idle" in text_of(app, "#run-state")
        await pilot.press("r")
        seen: list[int] = []
        await wait_for(pilot, lambda: app.controller.run is not None, 30, "start")
        while not app.controller.run.finished:
            state = text_of(app, "#run-state")
            for word in state.split():
                if "/" in word and word.split("/")[0].isdigit():
                    seen.append(int(word.split("/")[0]))
            await pilot.pause(0.05)
        await pilot.pause(0.3)
        run = app.controller.run
        assert run.state == "done", run.error
        assert "done" in text_of(app, "#run-state") and "1000/1000" in text_of(app, "#run-state")
        assert any(0 < n < 1000 for n in seen), f"never saw a partial count: {sorted(set(seen))[:10]}"
        assert seen == sorted(seen), "progress only goes forward"
        assert "s/token" in text_of(app, "#speed-caption")
        assert str(app.dashboard.query_one("#speed-digits").value) != "-.---"
        assert "done" in log_text(app)
        # what bounds the run, from the disk's occupancy as the report has it
        summary = run.report["summary"]
        busy, io = summary["disk_busy_fraction"], text_of(app, "#io-text")
        if summary["bound"] == "compute":
            assert f"compute-bound, disk busy {busy:.0%}" in io
        else:
            assert "disk-bound" in io
        assert app.dashboard.query_one("#io-plot").size.height >= 1
    rec = History(history_path).get(run.id)
    assert rec is not None and rec.state == "done" and len(rec.state_sha256) == 64
    assert os.path.isfile(rec.state_path)


@async_test
async def test_stop_cancels(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=8000)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await start_a_few_tokens(pilot)
        await pilot.press("r")  # a second run while one is live is refused, not started
        await pilot.press("s")
        run = app.controller.run
        assert run.wait(30)
        await pilot.pause(0.3)
        assert run.state == "cancelled"
        assert 3 < run.snapshot().tokens_done < 8000
        assert "cancelled" in text_of(app, "#run-state")
        await pilot.press("s")  # nothing live: harmless
    recs = History(history_path).list_runs()
    assert [r.state for r in recs] == ["cancelled"], "one run only, recorded as cancelled"
    assert recs[0].state_path is None


@async_test
async def test_with_parallel_a_second_run_starts_beside_the_first_and_both_decode_together(tiny_model, history_path):
    """ds4f-console --parallel 2: r while a run is live starts another beside it; the memory
    panel says what the batch holds; a third is refused; q stops both."""
    app = make_app(tiny_model, history_path, gen=8000, parallel=2)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await start_a_few_tokens(pilot)
        first = app.controller.run
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not first, 30, "the second run")
        second = app.controller.run
        await wait_for(pilot, lambda: second.snapshot().batch_shared_steps > 2, 60, "shared steps")
        assert first.state == "running" and second.state == "running"
        await wait_for(pilot, lambda: "batch 2/2 sequences" in text_of(app, "#mem-text"), 30, "the batch line")
        assert "shared" in text_of(app, "#mem-text")
        await pilot.press("r")                                  # a third: refused, nothing started
        await pilot.pause(0.3)
        assert app.controller.run is second and len(app.controller.running) == 2
        await pilot.press("s")                                  # s stops the current one; the first goes on
        assert second.wait(30) and second.state == "cancelled"
        assert first.state == "running"
        first.cancel()
        assert first.wait(30)


@async_test
async def test_the_engine_stays_loaded_between_runs(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=3)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        first = await run_to_end(pilot)
        await pilot.press("right_square_bracket")  # threads are per run: the engine is still reused
        second = await run_to_end(pilot)
        assert any(" engine loaded in " in e for e in first.snapshot().events)
        assert any(" engine reused in " in e for e in second.snapshot().events)
        assert app.engines.loads == 1
        assert "engine reused in" in log_text(app)
        await pilot.press("q")
    assert second.state == "done"


# ------------------------------------------------------------------------------ settings keys
@needs_simd
@async_test
async def test_simd_toggle_reaches_the_report(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=20)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        first = app.controller.next_backend()
        await pilot.press("k")
        toggled = app.controller.next_backend()
        assert {first, toggled} == {"scalar", kernels.best_backend()}
        run = await run_to_end(pilot)
        assert set(run.report["backend_by_token"]) == {toggled}
        await pilot.press("k")
        run = await run_to_end(pilot)
        assert set(run.report["backend_by_token"]) == {first}


@needs_simd
@async_test
async def test_simd_toggle_lands_live_at_a_token(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=1500)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        before = app.controller.next_backend()
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.snapshot().tokens_done >= 5,
                       60, "five tokens")
        await pilot.press("k")
        run = app.controller.run
        assert run.wait(180)
        await pilot.pause(0.3)
        assert run.state == "done", run.error
        by_token = run.report["backend_by_token"]
        switch = next(i for i, b in enumerate(by_token) if b != by_token[0])
        assert switch >= 5 and by_token[0] == before and set(by_token[switch:]) == {by_token[switch]}
        kern = text_of(app, "#kern-text")
        assert f"{by_token[0]}→{by_token[switch]} @{switch}" in kern
        rec = History(history_path).get(run.id)
        assert rec.backend == "mixed"


@async_test
async def test_threads_and_preset_reach_the_next_run(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=4)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        ctl = app.controller
        io0, k0, preset0 = ctl.effective_io_threads(), ctl.effective_kernel_threads(), ctl.preset
        await pilot.press("right_square_bracket", "right_square_bracket", "left_square_bracket")
        assert ctl.effective_io_threads() == io0 + 1
        await pilot.press("left_curly_bracket")
        k1 = max(1, k0 - 1)
        assert ctl.effective_kernel_threads() == k1
        await pilot.press("right_curly_bracket", "left_curly_bracket")
        assert ctl.effective_kernel_threads() == k1
        await pilot.press("p")
        assert ctl.preset != preset0
        assert f"next: {ctl.preset}" in text_of(app, "#status")
        run = await run_to_end(pilot)
        snap = run.snapshot()
        assert (snap.preset, snap.io_threads, snap.kernel_threads) == (ctl.preset, io0 + 1, k1)
        assert run.report["config"]["preset"] == ctl.preset
        assert run.report["config"]["io_threads"] == io0 + 1
        assert run.report["config"]["kernel_threads"] == k1
        assert {t["io_threads"] for t in run.report["tokens"]} == {io0 + 1}


@async_test
async def test_io_threads_change_live(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=8000)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        io0 = app.controller.effective_io_threads()
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.snapshot().tokens_done > 2,
                       60, "tokens")
        await pilot.press("right_square_bracket")
        await wait_for(pilot, lambda: app.controller.run.snapshot().io_threads == io0 + 1, 30, "the switch")
        await pilot.press("s")
        assert app.controller.run.wait(30)


@async_test
async def test_set_token_count(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=4)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await pilot.press("n")
        assert isinstance(app.screen, TokenCountScreen)
        inp = app.screen.query_one(Input)
        inp.value = ""
        await pilot.press("0", "enter")  # refused: stays open and says why
        assert isinstance(app.screen, TokenCountScreen)
        inp.value = ""
        await pilot.press("1", "2", "enter")
        assert isinstance(app.screen, DashboardScreen)
        assert app.controller.gen == 12
        await pilot.press("n", "escape")  # escape keeps the count
        assert app.controller.gen == 12
        run = await run_to_end(pilot)
        assert run.snapshot().tokens_done == 12


# ------------------------------------------------------------------------------ history and diffs
@async_test
async def test_history_persists_across_restarts(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=3)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        run = await run_to_end(pilot)
        await pilot.press("t")  # a theme choice, remembered too
        theme = app.theme
        await pilot.press("q")
    assert theme != "ds4f-dark"

    again = make_app(tiny_model, history_path)
    async with again.run_test(size=SIZE) as pilot:
        await booted(pilot)
        assert again.theme == theme
        await pilot.press("h")
        assert isinstance(again.screen, HistoryScreen)
        table = again.screen.query_one(DataTable)
        assert table.row_count == 1
        assert run.report["state_sha256"][:10] in str(table.get_row_at(0)[-1])
        assert run.id in text_of(again, "#run-detail")
        await pilot.press("escape")
        assert isinstance(again.screen, DashboardScreen)


@async_test
async def test_identical_runs_diff_as_identical(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=10)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await pilot.press("d")  # too few runs: a notice, no screen
        assert isinstance(app.screen, DashboardScreen)
        a = await run_to_end(pilot)
        await pilot.press("left_curly_bracket")  # a thread count does not change the state
        b = await run_to_end(pilot)
        assert a.report["state_sha256"] == b.report["state_sha256"]
        await pilot.press("h")
        table = app.screen.query_one(DataTable)
        assert all(" =A" in str(table.get_row_at(i)[-1]) for i in range(2)), "matching hashes are marked"
        await pilot.press("space", "down", "space", "d")
        assert isinstance(app.screen, DiffScreen)
        await wait_for(pilot, lambda: app.screen.diff is not None, 30, "the diff")
        await pilot.pause(0.1)
        assert app.screen.diff.cls == "identical"
        assert "IDENTICAL" in text_of(app, "#verdict") and "equal" in text_of(app, "#verdict")
        await pilot.press("x")  # swap A and B
        await wait_for(pilot, lambda: isinstance(app.screen, DiffScreen) and app.screen.diff is not None, 30, "swap")
        assert app.screen.a.run_id == b.id
        await pilot.press("escape")
        assert isinstance(app.screen, HistoryScreen)
        await pilot.press("m")  # jump to the other run with the same hash
        await pilot.press("escape", "d")  # dashboard d: the last two runs
        assert isinstance(app.screen, DiffScreen)
        await wait_for(pilot, lambda: app.screen.diff is not None, 30, "the diff")
        assert app.screen.diff.cls == "identical"


@needs_simd
@async_test
async def test_simd_scalar_pair_one_keystroke(tiny_model, history_path):
    from ds4f.runs.diff import diff_states

    app = make_app(tiny_model, history_path, gen=30)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await pilot.press("c")  # no pair yet: a notice
        assert isinstance(app.screen, DashboardScreen)
        first = await run_to_end(pilot)
        await pilot.press("k")
        second = await run_to_end(pilot)
        simd, scalar = (first, second) if first.report["backend_by_token"][0] != "scalar" else (second, first)
        await pilot.press("c")
        assert isinstance(app.screen, DiffScreen)
        await wait_for(pilot, lambda: app.screen.diff is not None, 30, "the diff")
        await pilot.pause(0.1)
        assert (app.screen.a.run_id, app.screen.b.run_id) == (simd.id, scalar.id)
        expected = diff_states(simd.report["state_path"], scalar.report["state_path"]).cls
        assert app.screen.diff.cls == expected
        assert expected in ("identical", "low-bit"), "SIMD and scalar agree on routing and within tolerance"
        word = {"identical": "IDENTICAL", "low-bit": "LOW-BIT"}[expected]
        assert word in text_of(app, "#verdict")
        await pilot.press("escape", "h", "c")  # the same key in the history screen
        assert isinstance(app.screen, DiffScreen)


# ------------------------------------------------------------------------------ errors
@async_test
async def test_engine_error_shows_and_app_keeps_working(tiny_model, history_path, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    app = make_app(model, history_path, gen=8000)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.snapshot().tokens_done > 2,
                       60, "tokens")
        pool = model / "pool-mxfp4.bin"
        with open(pool, "r+b") as fh:  # the disk goes bad under the run
            fh.truncate(4096)
        run = app.controller.run
        assert run.wait(60)
        await pilot.pause(0.4)
        assert run.state == "failed" and run.error
        assert "failed" in text_of(app, "#run-state")
        assert run.error[:30] in log_text(app)
        assert app.dashboard.query_one("#p-run", Panel).has_class("-critical")
        # the app keeps working: keys respond and a fresh model runs
        shutil.copy(tiny_model / "pool-mxfp4.bin", pool)
        app.controller.gen = 3
        run2 = await run_to_end(pilot)
        assert run2.state == "done"
    states = [r.state for r in History(history_path).list_runs()]
    assert states == ["done", "failed"]


@async_test
async def test_start_error_offers_the_demo(tiny_model, history_path, tmp_path):
    from ds4f.engine.checkpoint.demo import ensure_demo_model

    demo_root = tmp_path / "cache"
    app = Ds4fConsole(model=str(tmp_path / "no-such-model"), history=History(history_path), refresh_s=0.1,
                      demo_factory=lambda progress=None: ensure_demo_model(progress, root=demo_root, geometry="tiny"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), 30, "the error screen")
        msg = text_of(app, "#error-message")
        assert "no-such-model" in msg and "not found" in msg and "--model" in msg
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen) and app.controller
                       and app.controller.model.endswith("demo-ds4f"), 60, "the demo model")
        run = await run_to_end(pilot)
        assert run.state == "done"


@async_test
async def test_corrupt_checkpoint_error_screen(tiny_model, history_path, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "pool-mxfp4.json").write_text("{ not json")
    app = Ds4fConsole(model=str(model), history=History(history_path), demo_factory=lambda progress=None: tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), 30, "the error screen")
        msg = text_of(app, "#error-message")
        assert "pool-mxfp4.json" in msg, msg
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen) and app.controller
                       and app.controller.model == str(tiny_model), 30, "the demo model")


@async_test
async def test_bad_config_error_screen(tmp_path, history_path):
    bad = tmp_path / "ds4f.toml"
    bad.write_text("[engine]\nio_threads = 'many'\n")
    app = Ds4fConsole(config_path=str(bad), history=History(history_path),
                      demo_factory=lambda progress=None: tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), 30, "the error screen")
        msg = text_of(app, "#error-message")
        assert str(bad) in msg and "engine.io_threads" in msg
        await pilot.press("r")  # retry: still bad
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), 30, "the error screen again")
        await pilot.press("d")  # the demo model, with the built-in config
        await wait_for(pilot, lambda: app.controller is not None and app.controller.model == str(tmp_path), 30,
                       "the demo")
        assert app.settings.source == "built-in ds4f.toml" or app.settings.source.endswith("ds4f.toml")


@async_test
async def test_first_launch_makes_the_demo_then_reuses_it(tmp_path, history_path):
    from ds4f.engine.checkpoint.demo import ensure_demo_model

    root = tmp_path / "cache"
    calls = []

    def factory(progress=None):
        calls.append(progress)
        return ensure_demo_model(progress, root=root, geometry="tiny")

    for launch in range(2):
        app = Ds4fConsole(settings=None, model=None, history=History(history_path), demo_factory=factory,
                          refresh_s=0.1)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.controller is not None, 30, "boot")
            if launch == 0:
                await wait_for(pilot, lambda: isinstance(app.screen, SetupScreen) or app.controller.model, 30, "setup")
            await wait_for(pilot, lambda: app.controller.model and isinstance(app.screen, DashboardScreen), 60,
                           "the demo model")
            assert app.controller.model == str(root / "demo-ds4f")
    assert len(calls) == 2 and (root / "demo-ds4f" / "ds4f-demo.json").is_file()


# ------------------------------------------------------------------------------ display keys
@async_test
async def test_refresh_period_freeze_theme_help_quit(tiny_model, history_path):
    app = make_app(tiny_model, history_path, refresh_s=1.0, gen=3)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await pilot.press("plus")
        assert app.refresh_s == 2.0 and "⟳2s" in text_of(app, "#status")
        await pilot.press("minus", "minus", "minus")
        assert app.refresh_s == 0.25
        await pilot.press("space")
        assert app.frozen and "FROZEN" in text_of(app, "#status")
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.finished, 60, "run")
        await pilot.pause(0.6)
        assert "idle" in text_of(app, "#run-state"), "a frozen display does not move"
        await pilot.press("space")
        await pilot.pause(0.6)
        assert "done" in text_of(app, "#run-state")
        themes = []
        for _ in range(3):
            await pilot.press("t")
            themes.append(app.theme)
        assert themes == ["ds4f-light", "ds4f-contrast", "ds4f-dark"]
        assert History(history_path).get_setting("theme") == "ds4f-dark"
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        from rich.console import Console

        console = Console(width=400, record=True, file=open(os.devnull, "w"))
        for w in app.screen.query(Static):
            console.print(w.content)
        help_text = console.export_text()
        assert "toggle_simd" not in help_text and "Switch the kernels between SIMD and scalar" in help_text
        assert str(history_path) in help_text, "the help says where the history lives"
        await pilot.press("escape")
        assert isinstance(app.screen, DashboardScreen)
        await pilot.press("q")
    assert app.return_code == 0


@async_test
async def test_quit_stops_a_live_run(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=8000)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.state == "running", 60,
                       "running")
        run = app.controller.run
        await pilot.press("q")
    assert run.finished and run.state == "cancelled"


@async_test
async def test_every_key_acts_during_a_run(tiny_model, history_path):
    """Keys typed faster than the refresh period while a run decodes each do what they say.
    (How long a key takes is measured by ds4f.console.bench.bench_console, not asserted here.)"""
    from textual import events

    app = make_app(tiny_model, history_path, refresh_s=0.25, gen=8000)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.snapshot().tokens_done > 20,
                       60, "a busy run")
        tokens_before = app.controller.run.snapshot().tokens_done
        for i in range(30):  # a burst, delivered as the terminal driver delivers keys
            key, char = ("plus", "+") if i % 2 == 0 else ("minus", "-")
            event = events.Key(key, char)
            event.set_sender(app)
            app.post_message(event)

        def period_lines() -> list[str]:
            return [line for line in log_text(app).splitlines() if line.startswith("· refresh period")]

        await wait_for(pilot, lambda: len(period_lines()) >= 30, 60, "every key's action")
        await pilot.pause(0.3)
        assert period_lines() == ["· refresh period 0.5 s", "· refresh period 0.25 s"] * 15
        assert app.refresh_s == 0.25
        run = app.controller.run
        assert run.state == "running" and run.snapshot().tokens_done > tokens_before, "the run went on meanwhile"
        await pilot.press("s")
        run.wait(30)


# ------------------------------------------------------------------------------ palette and footer
ALL_ACTIONS = {b.action for b in APP_BINDINGS + DASHBOARD_BINDINGS + HISTORY_BINDINGS + DIFF_BINDINGS}


def test_every_binding_has_a_handler():
    screens = {id(DASHBOARD_BINDINGS): DashboardScreen, id(HISTORY_BINDINGS): HistoryScreen,
               id(DIFF_BINDINGS): DiffScreen, id(APP_BINDINGS): Ds4fConsole}
    for bindings in (APP_BINDINGS, DASHBOARD_BINDINGS, HISTORY_BINDINGS, DIFF_BINDINGS):
        owner = screens[id(bindings)]
        for b in bindings:
            name = b.action.split("(")[0]
            assert hasattr(owner, f"action_{name}"), f"{owner.__name__} lacks action_{name} for {b.key}"
            assert b.tooltip, f"{b.key} has no help text"


@async_test
async def test_every_dashboard_key_is_in_the_footer_and_the_palette(tiny_model, history_path):
    from ds4f.console.commands import ActionCommands

    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await booted(pilot)
        bar = app.screen.query_one(KeyBar)
        shown = " ".join(f"{k} {label}" for k, label in bar.items())
        for b in DASHBOARD_BINDINGS + APP_BINDINGS:
            if b.show:
                label = b.group.description if b.group else b.description
                assert f" {label}" in shown, f"{b.key} missing from the key bar: {shown}"
        assert bar.region.height <= 3 and bar.region.y + bar.region.height == 24
        app.dashboard.query_one(EventLog).focus()  # its scroll keys are active bindings now
        await pilot.pause()
        provider = ActionCommands(app.screen)
        actions = {cb.args[0] for _t, _h, cb in provider._entries()}
        assert {b.action for b in DASHBOARD_BINDINGS} <= actions
        assert {"help", "cycle_theme", "quit"} <= actions
        assert not any(a.startswith(("scroll_", "page_", "cursor_")) for a in actions), \
            "a focused widget's scroll keys are not the console's commands"
        assert not [hit async for hit in provider.search("scroll")]


@async_test
async def test_ctrl_p_and_colon_open_the_palette_and_its_input_takes_the_typing(tiny_model, history_path):
    from textual.command import CommandPalette

    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await booted(pilot)
        ctl = app.controller
        names = ctl.preset_names
        preset, theme = ctl.preset, app.theme
        expected = names[(names.index(preset) + 1) % len(names)]
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), 10, "the palette")
        search = app.screen.query_one("#--input Input", Input)  # the palette's own input
        assert search.has_focus
        # the keys go to the palette's input, not to the dashboard: "cycle preset" holds c, space,
        # p, r, s and t, which would compare, freeze, cycle the preset, run, stop and change theme
        await pilot.press(*["space" if ch == " " else ch for ch in "cycle preset"])
        assert search.value == "cycle preset"
        assert ctl.preset == preset and ctl.run is None and not app.frozen and app.theme == theme
        await pilot.pause(0.5)  # the palette searches in the background
        await pilot.press("enter")
        await wait_for(pilot, lambda: ctl.preset != preset, 10, "the palette command")
        assert ctl.preset == expected, "exactly one step: the command, not a leaked p"
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen), 10, "the palette to close")
        assert ctl.run is None and not app.frozen and app.theme == theme
        # k9s's : opens it too; escape closes it
        await pilot.press("colon")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), 10, "the palette")
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, DashboardScreen), 10, "the palette to close")
        # the help lists both keys on one line
        await pilot.press("question_mark")
        from rich.console import Console

        console = Console(width=200, record=True, file=open(os.devnull, "w"))
        for w in app.screen.query(Static):
            console.print(w.content)
        assert "ctrl+p or :" in console.export_text()


# ------------------------------------------------------------------------------ figures on one yardstick
async def show(pilot, snap) -> None:
    """Feed the dashboard one Snapshot (the app's snapshot_source reads `pilot.app.fed`) and let it draw."""
    pilot.app.fed = snap
    pilot.app.tick(force=True)
    await pilot.pause(0.1)


def fed_app(history_path) -> Ds4fConsole:
    app = Ds4fConsole(history=History(history_path), model="/fed", validate_model=False, refresh_s=10.0,
                      snapshot_source=lambda: getattr(app, "fed", None))
    return app


@async_test
async def test_cache_read_and_memory_panels_after_a_real_run(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=40)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        run = await run_to_end(pilot)
        assert run.state == "done", run.error
        snap = run.snapshot()
        # cache: the policy's own rate beside Belady's, prefetch's share apart, the regret in points
        first, second = text_of(app, "#hits-text").splitlines()[:2]
        assert first.startswith(f"{snap.policy} {F.fmt_pct(snap.policy_hit_rate)}")
        assert snap.optimum_hit_rate is not None, "Belady's optimum is computed for a short run"
        assert f"Belady {F.fmt_pct(snap.optimum_hit_rate)}" in first
        assert f"regret {snap.regret_pp:.1f} pts" in second
        assert f"+{100 * snap.prefetch_hit_share:.1f} pts prefetch" in second
        shown = {F.fmt_pct(snap.policy_hit_rate), F.fmt_pct(snap.optimum_hit_rate)}
        if F.fmt_pct(snap.hit_rate) not in shown:
            assert F.fmt_pct(snap.hit_rate) not in first, "the prefetch-inclusive rate is not beside Belady's"
        # read: the floor's ratio as a lower bound, the floor's age, what bounds the run
        io = text_of(app, "#io-text")
        assert snap.floor_gbps, "ds4f.toml measures the floor"
        assert f"at least {F.fmt_pct(snap.floor_ratio, 0)} of floor" in io
        assert f"floor {F.fmt_gbps(snap.floor_gbps)} GB/s, " in io and ("old" in io or "just now" in io)
        panel = app.dashboard.query_one("#p-io", Panel)
        if snap.bound == "compute":
            assert f"compute-bound, disk busy {F.fmt_pct(snap.disk_busy_fraction, 0)}" in io
            assert panel.level == "fine" and "compute-bound" in panel.border_subtitle
        else:
            assert f"disk-bound, I/O efficiency {F.fmt_pct(snap.io_efficiency, 0)}" in io
            assert panel.level == T.io_efficiency_level(snap.io_efficiency)
        # memory: RSS against the plan, and the machine's RAM, apart
        rss = app.dashboard.query_one("#rss-meter", Meter)
        assert rss.figures == f"{F.fmt_size(snap.rss_bytes)} · plan {F.fmt_size(snap.rss_budget_bytes)}"
        ram = app.dashboard.query_one("#ram-meter", Meter)
        assert ram.figures.startswith(f"{F.fmt_size(snap.ram_bytes)}, ") and ram.figures.endswith(" free")

    # the same run's figures, as other runs and other boxes would have them
    fed = fed_app(history_path)
    async with fed.run_test(size=(80, 24)) as pilot:
        await booted(pilot)
        io_panel, mem = fed.dashboard.query_one("#p-io", Panel), fed.dashboard.query_one("#p-mem", Panel)
        # compute-bound with a poor replay: words, at a calm level, not an I/O alarm
        await show(pilot, dataclasses.replace(snap, bound="compute", disk_busy_fraction=0.52, io_efficiency=0.2))
        assert "compute-bound, disk busy 52%" in text_of(fed, "#io-text")
        assert io_panel.level == "fine"
        # disk-bound: the replay's efficiency when known, judged; else the busy share
        await show(pilot, dataclasses.replace(snap, bound="disk", disk_busy_fraction=0.93, io_efficiency=0.35))
        assert "disk-bound, I/O efficiency 35%" in text_of(fed, "#io-text") and io_panel.level == "critical"
        await show(pilot, dataclasses.replace(snap, bound="disk", disk_busy_fraction=0.93, io_efficiency=None))
        assert "disk-bound, disk busy 93%" in text_of(fed, "#io-text") and io_panel.level is None
        # memory: RSS over the plan, then the box running out of RAM
        roomy = dataclasses.replace(snap, ram_available_bytes=snap.ram_bytes // 2)
        await show(pilot, roomy)
        assert mem.level == "fine"
        await show(pilot, dataclasses.replace(roomy, rss_bytes=int(snap.rss_budget_bytes * 1.05)))
        assert mem.level == "warning" and "105% of plan" in mem.border_subtitle
        await show(pilot, dataclasses.replace(snap, ram_available_bytes=int(snap.ram_bytes * 0.08)))
        assert mem.level == "warning" and "8% RAM free" in mem.border_subtitle
        await show(pilot, dataclasses.replace(snap, ram_available_bytes=int(snap.ram_bytes * 0.03)))
        assert mem.level == "critical" and "3% RAM free" in mem.border_subtitle
        assert fed.dashboard.query_one("#ram-meter", Meter).level == "critical"


@async_test
async def test_every_live_switch_stays_listed(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=8000)
    async with app.run_test(size=(160, 48)) as pilot:
        await booted(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.snapshot().tokens_done > 2,
                       60, "tokens")
        run = app.controller.run
        io0 = run.snapshot().io_threads
        for i in range(1, 4):  # three switches, each at its own token
            await pilot.press("right_square_bracket")
            await wait_for(pilot, lambda: run.snapshot().io_threads == io0 + i, 30, "the switch")
            done = run.snapshot().tokens_done
            await wait_for(pilot, lambda: run.snapshot().tokens_done > done + 1, 30, "more tokens")
        await pilot.press("s")
        assert run.wait(30)
        await pilot.pause(0.3)
        switches = F.run_switches(run.snapshot())
        assert len(switches) == 3 and len({s.token for s in switches}) == 3
        newest_first = [s.short for s in reversed(switches)]
        kern = text_of(app, "#kern-text")
        assert all(x in kern for x in newest_first), kern
        assert [kern.index(x) for x in newest_first] == sorted(kern.index(x) for x in newest_first)
        # at 80x24 the newest first, and a count of the ones that do not fit
        await pilot.resize_terminal(80, 24)
        await pilot.pause(0.3)
        kern = text_of(app, "#kern-text")
        assert newest_first[0] in kern
        missing = [x for x in newest_first if x not in kern]
        assert not missing or f"+{len(missing)} earlier" in kern, kern


@async_test
async def test_cancelled_runs_show_their_token_count_in_the_history(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=8000)
    async with app.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await start_a_few_tokens(pilot)
        await pilot.press("s")
        run = app.controller.run
        assert run.wait(30) and run.state == "cancelled"
        n = run.snapshot().tokens_done
        await pilot.press("h")
        assert isinstance(app.screen, HistoryScreen)
        table = app.screen.query_one(DataTable)
        assert str(table.get_row_at(0)[6]) == f"{n}/8000", "the count this session saw"
        assert f"cancelled after {n} of 8000 tokens" in text_of(app, "#run-detail")
    # a later session has the history's record alone
    rec = History(history_path).get(run.id)
    assert F.record_tokens(rec) in (None, n)  # None: the engine records no count for a cancelled run
    again = make_app(tiny_model, history_path)
    async with again.run_test(size=SIZE) as pilot:
        await booted(pilot)
        await pilot.press("h")
        cell = str(again.screen.query_one(DataTable).get_row_at(0)[6])
        detail = text_of(again, "#run-detail")
        if F.record_tokens(rec) is None:
            assert cell == "?/8000" and "no count" in detail, "says what it does not know, not 0"
        else:
            assert cell == f"{n}/8000" and f"cancelled after {n} of" in detail


@async_test
async def test_a_terminal_below_80x24_gets_a_notice(tiny_model, history_path):
    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(70, 20)) as pilot:
        await booted(pilot)
        notice = app.dashboard.query_one(SizeNotice)
        assert notice.display and notice.region.size == app.screen.region.size
        said = str(notice.render())
        assert "too small" in said and "70×20" in said and "80×24" in said
        await pilot.resize_terminal(80, 24)
        await pilot.pause(0.2)
        assert not notice.display
        assert app.dashboard.query_one("#p-kern").region.height > 0
        await pilot.resize_terminal(120, 23)  # wide enough, too short
        await pilot.pause(0.2)
        assert notice.display and "120×23" in str(notice.render())
        await pilot.press("h")  # every screen has it; keys still work under it
        assert isinstance(app.screen, HistoryScreen) and app.screen.query_one(SizeNotice).display
        await pilot.resize_terminal(100, 30)
        await pilot.pause(0.2)
        assert not app.screen.query_one(SizeNotice).display


def test_no_color_is_respected(monkeypatch, tiny_model, history_path):
    monkeypatch.setenv("NO_COLOR", "1")
    app = make_app(tiny_model, history_path)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await booted(pilot)
            assert app.no_color
            panel = app.dashboard.query_one("#p-io", Panel)
            panel.set_level("warning", "eff 45%")
            assert "warning" in str(panel.border_subtitle), "levels are words too, not colour alone"

    asyncio.run(go())


# ------------------------------------------------------------------------------ the run panel at 80x24
def panel_lines(app, selector: str) -> list[str]:
    """What the screen shows inside a panel's border, line by line (the composed screen, so a
    line the panel cuts off is not there)."""
    region = app.dashboard.query_one(selector, Panel).content_region
    strips = app.screen._compositor.render_strips()
    return [strips[y].crop(region.x, region.right).text.rstrip() for y in range(region.y, region.bottom)]


@async_test
async def test_the_run_panel_shows_every_line_at_80x24(history_path):
    from test_console_data import fixed_snapshot

    app = fed_app(history_path)
    error = ("reading expert 17 of layer 12: pool-mxfp4.bin: short read at offset 8388608 "
             "(expected 6372352 bytes, got 4096): the checkpoint is truncated or the disk failed")
    running = fixed_snapshot("running")
    cases = [running, fixed_snapshot("done"), fixed_snapshot("cancelled"),
             dataclasses.replace(fixed_snapshot("failed"), error=error)]
    async with app.run_test(size=(80, 24)) as pilot:
        await booted(pilot)
        for snap in cases:
            await show(pilot, snap)
            shown = panel_lines(app, "#p-run")
            text = "\n".join(shown)
            assert len(shown) == 5, "80x24: five lines inside the run panel's border"
            assert shown[0].startswith(f"{F.state_mark(snap.state)} {snap.state}  {F.progress_text(snap)}")
            wanted = [f"elapsed {F.fmt_seconds(snap.elapsed_s)}", f"stall {F.fmt_seconds(snap.stall_s_per_token)}/token",
                      f"preset {snap.preset}", f"run {snap.run_id}"]
            if snap.state == "running":
                wanted.append(f"ETA {F.fmt_seconds(snap.eta_s)}")
            for w in wanted:
                assert w in text, f"{snap.state}: {w!r} is cut off:\n{text}"
            if snap.error:
                assert shown[-1].startswith("reading expert 17") and shown[-1].endswith("…"), text
        # a wider terminal gives the figures their own lines back
        await pilot.resize_terminal(160, 48)
        await show(pilot, running)
        shown = panel_lines(app, "#p-run")
        assert f"preset {running.preset} · run {running.run_id}" in shown


@async_test
async def test_the_hit_rate_plot_and_strip_draw_the_policys_own_rate(history_path):
    from test_console_data import fixed_snapshot

    from ds4f.console.widgets.common import LayerStrip, Plot

    app = fed_app(history_path)
    snap = fixed_snapshot("done")
    async with app.run_test(size=(80, 24)) as pilot:
        await booted(pilot)
        await show(pilot, snap)
        plot, strip = app.dashboard.query_one("#hits-plot", Plot), app.dashboard.query_one("#hits-strip", LayerStrip)
        own = [(t.hits - t.prefetch_hits) / (t.hits + t.misses) for t in snap.tokens]
        assert plot.values == pytest.approx(own)
        assert strip.rates == pytest.approx([(h - p) / (h + m) for h, m, p in
                                             zip(snap.layer_hits, snap.layer_misses, snap.layer_prefetch_hits)])
        # the figure beside Belady's is the same yardstick
        assert text_of(app, "#hits-text").startswith(f"{snap.policy} {F.fmt_pct(snap.policy_hit_rate)}")
