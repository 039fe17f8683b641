"""The dashboard of running servers (ds4f-console --attach URL ...): one tab per server (no tab
bar for one), each a ServerPane; and the error screen of a server that cannot be attached.

The app hands each pane its server's ServerView and new log entries at every refresh; the keys
become messages the app turns into operator calls.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Static, TabbedContent, TabPane

from ..core.bindings import ATTACH_BINDINGS, ATTACH_ERROR_BINDINGS
from ..core.remote import Connection
from ..widgets.common import KeyBar, SizeNotice
from ..widgets.server import ServerPane


class AttachedScreen(Screen):
    """One ServerPane per server, in tabs when there are several."""

    BINDINGS = ATTACH_BINDINGS

    class Act(Message):
        """A key asks something of the shown server: `what` is the action, `arg` its argument."""

        def __init__(self, index: int, what: str, arg: int = 0) -> None:
            super().__init__()
            self.index, self.what, self.arg = index, what, arg

    class StepRefreshPeriod(Message):
        def __init__(self, step: int) -> None:
            super().__init__()
            self.step = step

    class ToggleFreeze(Message):
        pass

    class Shown(Message):
        """The dashboard is the current screen again."""

    def __init__(self, titles: list[str]) -> None:
        super().__init__(id="attached")
        self.titles = titles

    def compose(self) -> ComposeResult:
        if len(self.titles) == 1:
            yield ServerPane(0, id="server-0")
        else:
            with TabbedContent(id="servers"):
                for i, title in enumerate(self.titles):
                    with TabPane(f"{i + 1} {title}", id=f"tab-{i}"):
                        yield ServerPane(i, id=f"server-{i}")
        yield KeyBar()
        yield SizeNotice()

    def on_mount(self) -> None:
        self.set_focus(None)

    def on_screen_resume(self) -> None:
        self.post_message(self.Shown())

    # -- the panes ------------------------------------------------------------------------
    def pane(self, index: int) -> ServerPane:
        return self.query_one(f"#server-{index}", ServerPane)

    @property
    def shown_index(self) -> int:
        """The server whose tab is shown."""
        if len(self.titles) == 1:
            return 0
        active = self.query_one(TabbedContent).active or "tab-0"
        return int(active.rsplit("-", 1)[-1])

    def show_server(self, index: int) -> None:
        if len(self.titles) > 1:
            self.query_one(TabbedContent).active = f"tab-{index % len(self.titles)}"
            self.set_focus(None)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "next_server" and len(self.titles) == 1:
            return False
        return True

    # -- actions --------------------------------------------------------------------------
    def _act(self, what: str, arg: int = 0) -> None:
        self.post_message(self.Act(self.shown_index, what, arg))

    def action_reconnect(self) -> None:
        self._act("reconnect")

    def action_select_sequence(self, step: int) -> None:
        self._act("select", step)

    def action_cancel_sequence(self) -> None:
        self._act("cancel")

    def action_drain(self) -> None:
        self._act("drain")

    def action_resume(self) -> None:
        self._act("resume")

    def action_server_preset(self) -> None:
        self._act("preset")

    def action_server_io_threads(self, delta: int) -> None:
        self._act("io_threads", delta)

    def action_server_kernel_threads(self, delta: int) -> None:
        self._act("kernel_threads", delta)

    def action_server_toggle_simd(self) -> None:
        self._act("backend")

    def action_refresh_period(self, step: int) -> None:
        self.post_message(self.StepRefreshPeriod(step))

    def action_freeze(self) -> None:
        self.post_message(self.ToggleFreeze())

    def action_next_server(self, step: int) -> None:
        self.show_server(self.shown_index + step)
        self.post_message(self.Shown())


class AttachErrorScreen(Screen[str]):
    """A server that cannot be attached: its URL and what is wrong (nothing answers, not a ds4f
    server, an older one without /events, it refuses this console), with r to retry. A server
    that does not answer is retried by itself too; the screen closes once it is attached."""

    BINDINGS = ATTACH_ERROR_BINDINGS

    HINTS = {
        "refused": "Is `ds4f serve` running there? It prints `ds4f serve: listening on URL` once it takes connections.",
        "not_ds4f": "Something answers there, but not ds4f serve: check the host and port.",
        "old_server": "Upgrade ds4f on the server: the console reads GET /events, which this ds4f serve has not.",
        "unauthorized": "A server beyond loopback wants its token: ds4f-console --token-file PATH.",
    }

    def __init__(self, index: int, url: str, connection: Connection, several: bool = False) -> None:
        super().__init__()
        self.index, self.url, self.connection, self.several = index, url, connection, several
        self._shown: Text | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box") as box:
            box.border_title = "ds4f-console --attach"
            yield Static(Text(f"Cannot attach to {self.url}", style="bold"), id="error-title")
            yield Static(self._message(self.connection), id="error-message")
            yield Static(self._options(), id="error-options")
        yield KeyBar()

    def _message(self, connection: Connection) -> Text:
        msg = Text(connection.text())
        hint = self.HINTS.get(connection.state)
        if hint:
            msg.append("\n\n" + hint, "dim")
        return msg

    def show(self, connection: Connection) -> None:
        """The problem as it is now (a retry's countdown, another problem)."""
        message = self._message(connection)
        if connection != self.connection or message != self._shown:
            self.connection, self._shown = connection, message
            self.query_one("#error-message", Static).update(message)

    def _options(self) -> Text:
        opts = Text()
        opts.append("r", "bold reverse")
        opts.append(" retry now   ")
        if self.several:
            opts.append("esc", "bold reverse")
            opts.append(" the other servers   ")
        opts.append("q", "bold reverse")
        opts.append(" quit")
        return opts

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "back_to_tabs" and not self.several:
            return False
        return True

    class Retry(Message):
        """Try the server again now."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def action_retry(self) -> None:
        self.post_message(self.Retry(self.index))

    def action_back_to_tabs(self) -> None:
        if self.is_active and self.several:   # not gone (a second key of a burst), nor under help or the palette
            self.dismiss("back")
