"""The screens over the dashboard: help, the token count, an error with a way out, and the
first-launch setup while the demo model is made."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Input, Label, ProgressBar, Static

from ds4f.api import MAX_GEN

from ..core.bindings import SCREENS_FOR_HELP, by_action


class HelpScreen(ModalScreen[None]):
    """Every key of every screen, and where the console's files are.

    `files`: (what, where) rows, e.g. ("config", path of the ds4f.toml in use); `sections`: (title,
    bindings) of the screens to list (the local console's by default)."""

    BINDINGS = [("escape,question_mark,q,f1", "dismiss", "close")]

    def __init__(self, files: list[tuple[str, str]], sections=SCREENS_FOR_HELP) -> None:
        super().__init__()
        self.files = files
        self.sections = sections

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "keys"
            box.border_subtitle = "esc closes · every key is also in the command palette (ctrl+p or :)"
            for title, bindings in self.sections:
                table = Table(box=None, show_header=False, pad_edge=False, expand=True, title=title,
                              title_justify="left", title_style="bold")
                table.add_column(style="bold", no_wrap=True, width=12)
                table.add_column()
                for _action, keys, b in by_action(bindings):
                    table.add_row(keys, b.tooltip or b.description)
                yield Static(table)
            files = Table(box=None, show_header=False, pad_edge=False, expand=True, title="Files",
                          title_justify="left", title_style="bold")
            files.add_column(style="bold", no_wrap=True, width=12)
            files.add_column(overflow="fold")
            for what, where in self.files:
                files.add_row(what, where)
            yield Static(files)

    def action_dismiss(self, result=None) -> None:
        if self.is_active:   # not gone (a second key of a burst), nor under help or the palette
            self.dismiss(None)


class TokenCountScreen(ModalScreen[int | None]):
    """Asks for the next run's token count; dismissed with the count, or None on escape."""

    BINDINGS = [("escape", "cancel", "cancel")]

    def __init__(self, current: int) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="tokens-box") as box:
            box.border_title = "tokens to decode"
            yield Static("Tokens for the next run to decode (enter accepts, esc cancels):")
            yield Input(value=str(self.current), type="integer", id="tokens-input")
            yield Label("", id="tokens-error")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        try:
            n = int(event.value)
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_GEN:
            self.query_one("#tokens-error", Label).update(f"Enter a whole number between 1 and {MAX_GEN}.")
            return
        if self.is_active:   # not gone (a second key of a burst), nor under help or the palette
            self.dismiss(n)

    def action_cancel(self) -> None:
        if self.is_active:   # not gone (a second key of a burst), nor under help or the palette
            self.dismiss(None)


class ErrorScreen(Screen[str]):
    """What went wrong and where, with a way out: the demo model, retry, or quit."""

    BINDINGS = [("d", "choose('demo')", "open the demo model"), ("r", "choose('retry')", "retry"),
                ("escape", "choose('back')", "back"), ("q", "app.quit", "quit")]

    def __init__(self, title: str, message: str, offer_demo: bool = True, can_go_back: bool = False) -> None:
        super().__init__()
        self.title_text, self.message = title, message
        self.offer_demo, self.can_go_back = offer_demo, can_go_back

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box") as box:
            box.border_title = "ds4f-console"
            yield Static(Text(self.title_text, style="bold"), id="error-title")
            yield Static(Text(self.message), id="error-message")
            opts = Text()
            if self.offer_demo:
                opts.append("d", "bold reverse")
                opts.append(" open the demo model instead   ")
            opts.append("r", "bold reverse")
            opts.append(" retry   ")
            if self.can_go_back:
                opts.append("esc", "bold reverse")
                opts.append(" back   ")
            opts.append("q", "bold reverse")
            opts.append(" quit")
            yield Static(opts, id="error-options")

    def action_choose(self, choice: str) -> None:
        if choice == "demo" and not self.offer_demo:
            return
        if choice == "back" and not self.can_go_back:
            return
        if self.is_active:   # not gone (a second key of a burst), nor under help or the palette
            self.dismiss(choice)


class SetupScreen(Screen[None]):
    """First launch: the demo checkpoint is being made (synthesised, converted) in the cache dir."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def compose(self) -> ComposeResult:
        with Vertical(id="setup-box") as box:
            box.border_title = "ds4f-console · first launch"
            yield Static(Text("Making the demo model (a small synthetic DeepSeek-V4-Flash-shaped checkpoint, "
                              "written in the official format and converted to the ds4f layout). "
                              "This happens once; later launches reuse it.", style=""), id="setup-text")
            yield Static(Text(self.where, style="dim"), id="setup-where")
            yield ProgressBar(total=100, show_eta=False, id="setup-bar")
            yield Static("starting…", id="setup-stage")

    def progress(self, done: float, total: float, label: str) -> None:
        bar = self.query_one("#setup-bar", ProgressBar)
        bar.update(total=max(1.0, float(total)), progress=float(done))
        self.query_one("#setup-stage", Static).update(label)
