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


def _palettes(app) -> int:
    from textual.command import CommandPalette

    return sum(isinstance(s, CommandPalette) for s in app.screen_stack)


@async_test
async def test_a_palette_closed_and_asked_for_again_in_one_tick_opens_once(tiny_model, history_path):
    """The palette dismissed and asked for again before its removal ran (the removal comes after
    the key that closed it), and asked for twice before the first one mounted: one palette, no
    clash of ids, no error."""
    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        for _ in range(5):
            app.action_command_palette()
            app.action_command_palette()          # pushed, not yet mounted: no second one
            assert _palettes(app) == 1
            await wait_for(pilot, lambda: _palettes(app) == 1 and app.screen.is_mounted, 10, "the palette")
            app.screen.dismiss()
            app.action_command_palette()          # the closed one is still being removed
            app.action_command_palette()
            assert _palettes(app) == 1
            await pilot.pause(0.1)
            assert app._exception is None
            app.screen.dismiss()
            await wait_for(pilot, lambda: _palettes(app) == 0, 10, "the palette to close")
        assert app.is_running and app._exception is None


@async_test
async def test_bursts_of_palette_keys_with_no_pause_never_stack_two(tiny_model, history_path):
    """ctrl+p, :, Escape and Enter queued at once, many times over with no pause between: never a
    second palette on the stack, never an error."""
    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        seen = []
        app.screen_change_signal.subscribe(app, lambda _screen: seen.append(_palettes(app)))
        for seed in range(12):
            _queue(app, random.Random(seed).choices(["ctrl+p", "colon", "ctrl+p", "escape", "escape"], k=80))
        await pilot.pause(1.0)
        _queue(app, ["escape"] * 4)
        await wait_for(pilot, lambda: _palettes(app) == 0, 10, "the palettes to close")
        assert seen and max(seen) == 1, seen      # opened, and never two at once
        assert app.is_running and app._exception is None


@async_test
async def test_the_attached_console_opens_one_palette_too():
    """The same in ds4f-console --attach (here on a port with no server: its error screen)."""
    import socket

    from ds4f.console.attach import AttachConsole

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = AttachConsole([f"http://127.0.0.1:{port}"], refresh_s=0.2)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.3)
        below = len(app.screen_stack)
        app.action_command_palette()
        await wait_for(pilot, lambda: _palettes(app) == 1 and app.screen.is_mounted, 10, "the palette")
        app.screen.dismiss()
        app.action_command_palette()
        app.action_command_palette()
        assert _palettes(app) == 1 and len(app.screen_stack) == below + 1
        await pilot.pause(0.2)
        assert app.is_running and app._exception is None
