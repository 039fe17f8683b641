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


def _attached_to_nothing():
    """ds4f-console --attach on a loopback port no server listens on (it shows its error screen)."""
    import socket

    from ds4f.console.attach import AttachConsole

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return AttachConsole([f"http://127.0.0.1:{port}"], refresh_s=0.2)


@async_test
async def test_the_attached_console_opens_one_palette_too():
    """The same in ds4f-console --attach (here on a port with no server: its error screen)."""
    app = _attached_to_nothing()
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


def assert_only_the_dashboard(app) -> None:
    from ds4f.console.screens import DashboardScreen

    assert app.is_running and app._exception is None
    assert len(app.screen_stack) == 1 and isinstance(app.screen_stack[0], DashboardScreen), app.screen_stack


async def _open(pilot, app, key: str, kind) -> None:
    """Press `key` and wait until a `kind` screen is the mounted top of the stack."""
    await pilot.press(key)
    await wait_for(pilot, lambda: isinstance(app.screen, kind) and app.screen.is_mounted, 10, kind.__name__)


@async_test
async def test_escapes_beyond_the_last_screen_leave_the_dashboard(tiny_model, history_path):
    """Each screen over the dashboard closed by a burst of Escapes (more than there are screens to
    close), then every way back asked for once more with the dashboard alone: it stays, and the
    next key still acts."""
    from textual.command import CommandPalette

    from ds4f.console.screens import HelpScreen, HistoryScreen, TokenCountScreen

    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        dash = app.screen
        closed = []
        for key, kind in (("ctrl+p", CommandPalette), ("question_mark", HelpScreen), ("h", HistoryScreen),
                          ("n", TokenCountScreen)):
            await _open(pilot, app, key, kind)
            closed.append(app.screen)
            _queue(app, ["escape"] * 5)
            await wait_for(pilot, lambda: app.screen is dash, 10, f"{kind.__name__} to close")
            await pilot.pause(0.1)       # the Escapes after the first reach the dashboard
            assert_only_the_dashboard(app)
        for screen in closed:            # each asked to close again, long after it closed
            screen.dismiss()
        closed[2].action_back()
        closed[3].action_cancel()
        app.pop_screen()
        await app.run_action("app.pop_screen")
        await app.run_action("back", dash)
        await pilot.pause(0.1)
        assert_only_the_dashboard(app)
        assert app.screen is dash
        theme = app.theme
        await pilot.press("t")
        assert app.theme != theme, "a key after the bursts still acts"
        await _open(pilot, app, "question_mark", HelpScreen)
        await pilot.press("escape")
        assert_only_the_dashboard(app)


@async_test
async def test_a_screen_asked_to_close_under_another_closes_nothing(tiny_model, history_path):
    """A close that arrives for a screen no longer on top (the history's back, or the palette's
    Enter, handled after help opened over it) leaves the stack as it is: not the help on top."""
    from textual.command import CommandPalette

    from ds4f.console.screens import HelpScreen, HistoryScreen

    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        dash = app.screen
        for key, kind, close in (("h", HistoryScreen, lambda s: s.action_back()),
                                 ("ctrl+p", CommandPalette, lambda s: s.dismiss())):
            await _open(pilot, app, key, kind)
            under = app.screen
            app.action_help()
            await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen) and app.screen.is_mounted, 10, "help")
            stack = app.screen_stack
            close(under)
            await pilot.pause(0.1)
            assert app.screen_stack == stack, (kind.__name__, app.screen_stack)
            _queue(app, ["escape"] * 4)
            await wait_for(pilot, lambda: app.screen is dash, 10, f"{kind.__name__} to close")
            await pilot.pause(0.1)
            assert_only_the_dashboard(app)


CLOSING_BURST = ["ctrl+p", "a", "r", "escape", "escape", "colon", "u", "down", "escape", "x", "escape"] * 4


@async_test
async def test_a_burst_still_queued_as_the_console_closes_ends_nothing(tiny_model, history_path):
    """The console closed with a burst still queued (palettes opened and closed, their keys not yet
    handled as the screens are taken down, as at the end of a test): the keys find no screen and
    are dropped, a palette's search ends quietly; the close raises nothing."""
    app = make_app(tiny_model, history_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.controller is not None and app._booted, 30, "boot")
        _queue(app, CLOSING_BURST)
    assert app._exception is None     # run_test re-raised it, had there been one


@async_test
async def test_the_attached_console_closes_with_a_burst_queued_too():
    app = _attached_to_nothing()
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.3)
        _queue(app, CLOSING_BURST)
    assert app._exception is None


@async_test
async def test_the_first_launch_screen_closes_with_what_was_opened_over_it(tiny_model, history_path):
    """The demo model ready while the palette and the help are open over the first-launch screen:
    all three close and the dashboard shows (not the palette closed and the first-launch screen
    left behind, with no key of its own to leave it)."""
    import threading

    from ds4f.console.app import Ds4fConsole
    from ds4f.console.screens import HelpScreen, SetupScreen
    from ds4f.runs.history import History

    release = threading.Event()

    def factory(progress=None):
        release.wait(30)
        return tiny_model

    app = Ds4fConsole(model=None, history=History(history_path), demo_factory=factory, refresh_s=0.1)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, SetupScreen) and app.screen.is_mounted, 30, "setup")
            app.action_command_palette()
            await wait_for(pilot, lambda: _palettes(app) == 1 and app.screen.is_mounted, 10, "the palette")
            app.action_help()
            await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen) and app.screen.is_mounted, 10, "help")
            assert [type(s).__name__ for s in app.screen_stack] == ["DashboardScreen", "SetupScreen",
                                                                     "ConsolePalette", "HelpScreen"]
            release.set()
            await wait_for(pilot, lambda: app.controller.model == str(tiny_model), 30, "the demo model")
            await pilot.pause(0.1)
            assert_only_the_dashboard(app)
    finally:
        release.set()
