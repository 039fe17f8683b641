"""What both consoles (the local one, console.app, and the attached one, console.attach) are as
Textual apps: their title, breakpoints, theme variables and command palette, and a screen stack
that a burst of keys cannot empty."""
from __future__ import annotations

from textual import events
from textual.app import App, ScreenStackError
from textual.await_complete import AwaitComplete

from ds4f.themes import LEVEL_VARIABLE_DEFAULTS

from .commands import ActionCommands, open_palette
from .core.bindings import APP_BINDINGS


class ConsoleApp(App):
    TITLE = "ds4f-console"
    BINDINGS = APP_BINDINGS
    COMMANDS = App.COMMANDS | {ActionCommands}
    # below 80x24 (widgets.MIN_SIZE) the screens show a SizeNotice instead of a squeezed layout
    HORIZONTAL_BREAKPOINTS = [(0, "-too-narrow"), (80, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-too-short"), (24, "-short"), (36, "-tall")]

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return dict(LEVEL_VARIABLE_DEFAULTS)

    def action_command_palette(self) -> None:
        """Textual's command palette, in the variant a burst of keys cannot break (one at a time)."""
        open_palette(self)

    def pop_screen(self):
        """Textual's, except with one screen left: a burst of keys (two Enters for one command
        palette) may ask to close a screen that is already closed; the console stays."""
        if len(self.screen_stack) <= 1:
            self.log.warning("a screen was closed twice (a key burst): nothing to pop")

            async def nothing() -> None:
                return None

            return AwaitComplete(nothing()).call_next(self)
        return super().pop_screen()

    async def on_event(self, event: events.Event) -> None:
        """Textual's, except for input still queued as the console closes (the rest of a key burst,
        handled after the screens were taken down): it finds no screen to go to, and is dropped."""
        try:
            await super().on_event(event)
        except ScreenStackError:
            if self.screen_stack or not isinstance(event, (events.InputEvent, events.Paste)):
                raise
