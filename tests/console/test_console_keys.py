"""Key bursts: random runs of the console's keys during a live run (the palette opened and closed,
modals pushed and dismissed twice over, Escape and Enter anywhere, the switch keys) never end the
console or its run. The keys are queued at once, as a held key or a paste over SSH delivers them,
so several reach a screen before it has handled the first (two Escapes for one modal)."""
from __future__ import annotations

import random

from textual import events

from console_helpers import _no_run_left_behind, async_test, history_path, make_app, wait_for  # noqa: F401 (fixtures)

KEYS = ["colon", "ctrl+p", "escape", "escape", "escape", "enter", "enter", "h", "d", "c", "n", "question_mark", "f1",
        "k", "p", "i", "left_square_bracket", "right_square_bracket", "left_curly_bracket", "right_curly_bracket",
        "plus", "minus", "space", "tab", "up", "down", "x", "backspace", "1"]
CHARS = {"colon": ":", "question_mark": "?", "left_square_bracket": "[", "right_square_bracket": "]",
         "left_curly_bracket": "{", "right_curly_bracket": "}", "plus": "+", "minus": "-", "space": " ",
         "enter": "\r", "tab": "\t", "escape": "\x1b", "backspace": "\x7f"}


def _queue(app, keys) -> None:
    for key in keys:
        char = CHARS.get(key, key if len(key) == 1 else None)
        app.post_message(events.Key(key, char))


@async_test
async def test_random_key_bursts_never_end_the_console(tiny_model, history_path):
    app = make_app(tiny_model, history_path, gen=4000)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        await pilot.press("r")
        await wait_for(pilot, lambda: app.controller.run is not None, 30, "a run")
        run = app.controller.run
        for seed in range(7):
            burst = random.Random(seed).choices(KEYS, k=60)
            _queue(app, burst)
            await pilot.pause(0.5)
            assert app.is_running and app._exception is None, (seed, burst)
        assert not run.finished, "the bursts never stop the run (no stop key in them)"
        run.cancel()
        run.wait(30)
        _queue(app, ["escape"] * 6)
        await pilot.pause(0.3)
        assert app._exception is None


PALETTE_KEYS = ["ctrl+p", "colon", "a", "r", "u", "escape", "enter", "backspace", "down"]


@async_test
async def test_palette_bursts_never_end_the_console(tiny_model, history_path):
    """The command palette opened, typed into and closed faster than its search runs: the search
    must end quietly when its palette is gone (Textual's own fails its worker, and the app)."""
    app = make_app(tiny_model, history_path, gen=4000)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        for seed in range(40):
            _queue(app, random.Random(seed).choices(PALETTE_KEYS, k=40))
            await pilot.pause(0.15)
            assert app.is_running and app._exception is None, seed
        run = app.controller.run
        if run is not None:            # "r" typed outside the palette starts one
            run.cancel()
            run.wait(30)
