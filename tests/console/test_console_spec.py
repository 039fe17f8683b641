"""The console's speculative decoding: `g` cycles the next run's mode, the status line shows it,
the run gets it, and the s/token panel shows what the drafts did."""
from __future__ import annotations

import pytest

from console_helpers import _no_run_left_behind, async_test, history_path, make_app, wait_for  # noqa: F401 (fixtures)
from textual.widgets import Static

SIZE = (100, 30)


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from ds4f.engine.checkpoint.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("tiny-mtp") / "official", "tiny", seed=0, mtp=True)


def _text(app, selector: str) -> str:
    return str(app.screen.query_one(selector, Static).render())


@async_test
async def test_the_spec_key_reaches_the_next_run_and_the_speed_panel_shows_its_drafts(tiny_mtp, history_path):
    app = make_app(tiny_mtp, history_path, gen=12)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        assert "spec" not in _text(app, "#status")
        await pilot.press("g")
        assert app.controller.spec == "auto" and "spec auto" in _text(app, "#status")
        await pilot.press("g")
        assert app.controller.spec == "1" and "spec 1" in _text(app, "#status")
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None and app.controller.run.finished, 120, "the run")
        await pilot.pause(0.3)
        run = app.controller.run
        assert run.state == "done", run.error
        spec = run.report["summary"]["spec"]
        assert spec["mode"] == "1" and spec["active"] and spec["rounds"] > 0
        caption = _text(app, "#speed-caption")
        assert "spec 1" in caption and "tok/round" in caption
        assert any("speculation" in line for line in run.report["events"])
        for _ in range(3):                         # 2, 3, then off again
            await pilot.press("g")
        assert app.controller.spec == "off" and "spec" not in _text(app, "#status")
