"""ds4f-console --attach URL [URL ...]: the console on running `ds4f serve`s, over HTTP.

One ServerLink per URL (console.core.remote: the event stream read in a thread, reconnecting) and one
tab per server (no tab bar for one). The app's timer reads each link's latest ServerView, as the
local console polls Run.snapshot(): a busy server costs the terminal one screen diff per refresh
period and the keys stay responsive. The keys become operator calls (POST /operator/...), each
on a thread of its own, their answers in the event log. A server that cannot be attached (nothing
answers, not ds4f, an older ds4f serve without /events) gets an error screen naming its URL and
the problem, with r to retry.
"""
from __future__ import annotations

from typing import Callable

from textual.css.query import NoMatches

from ds4f.api import Ds4fError, History, load_settings
from ds4f.themes import DEFAULT_THEME, THEMES, next_theme, stylesheet_path

from .core.bindings import ATTACH_SCREENS_FOR_HELP
from .base_app import ConsoleApp
from .core.controller import next_refresh
from .core.remote import ServerLink, ServerView, backend_toggle, next_preset, parse_address, threads_step
from .screens import HelpScreen
from .screens.attached import AttachedScreen, AttachErrorScreen


class AttachConsole(ConsoleApp):
    CSS_PATH = [str(stylesheet_path("console.tcss")), str(stylesheet_path("attach.tcss"))]

    def __init__(self, urls: list[str], *, operator_token: str | None = None, token: str | None = None,
                 config_path: str | None = None, refresh_s: float | None = None, theme: str | None = None,
                 link_factory: Callable[..., ServerLink] | None = None) -> None:
        super().__init__()
        self.addresses = [parse_address(u) for u in urls]
        if not self.addresses:
            raise Ds4fError("--attach: give at least one URL")
        self._config_path = config_path
        self._refresh_arg = refresh_s
        self._theme_arg = theme
        self.refresh_s = refresh_s or 1.0
        self.frozen = False
        self.history: History | None = None
        self.config_source = "—"
        make = link_factory or ServerLink
        self.links = [make(a, interval=self.refresh_s, operator_token=operator_token, token=token)
                      for a in self.addresses]
        self._timer = None
        self._error_for: int | None = None            # the server the error screen is about
        self._waved_off: dict[int, tuple] = {}        # problems the operator left the error screen of (esc)
        self._picked: dict[int, str | None] = {}      # the operator's pick of a sequence, by server
        for t in THEMES:
            self.register_theme(t)
        self.theme = theme or DEFAULT_THEME

    # -- Textual hooks ----------------------------------------------------------------------
    def get_default_screen(self) -> AttachedScreen:
        return AttachedScreen([a.short for a in self.addresses])

    @property
    def dashboard(self) -> AttachedScreen:
        return self.screen_stack[0]  # type: ignore[return-value]

    def on_mount(self) -> None:
        self._settings()
        for link in self.links:
            link.interval = self.refresh_s
            link.start()
        self._start_timer()
        self.theme_changed_signal.subscribe(self, self._theme_changed)

    def _settings(self) -> None:
        """The theme (remembered in the history database, as the local console does) and the
        refresh period from ds4f.toml, when there is one; without, the defaults."""
        try:
            settings = load_settings(self._config_path)
        except Ds4fError as exc:
            if self._config_path:
                self.notify(str(exc), severity="warning", timeout=8)
            return
        self.config_source = settings.source
        if self._refresh_arg is None:
            self.refresh_s = settings.console.refresh_s
        try:
            self.history = History(settings.history_path)
            remembered = self.history.get_setting("theme") if self._theme_arg is None else None
        except Ds4fError:
            self.history, remembered = None, None
        wanted = self._theme_arg or remembered or settings.console.theme
        if wanted in self.available_themes:
            self.theme = wanted

    def _theme_changed(self, theme) -> None:
        if self.history is not None:
            try:
                self.history.set_setting("theme", theme.name)
            except Ds4fError:
                pass

    def action_cycle_theme(self) -> None:
        self.theme = next_theme(self.theme)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            files = [("config", self.config_source)] + [(f"server {i + 1}", a.url) for i, a in enumerate(self.addresses)]
            self.push_screen(HelpScreen(files=files, sections=ATTACH_SCREENS_FOR_HELP))

    async def action_quit(self) -> None:
        self.exit()

    def on_unmount(self) -> None:
        for link in self.links:
            link.stop()
        for link in self.links:
            link.join(timeout=0.5)

    # -- the refresh timer ----------------------------------------------------------------
    def _start_timer(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_interval(self.refresh_s, self.tick, name="refresh")

    def tick(self) -> None:
        """Every pane draws its server's latest view (the shown one in full, the others' logs
        kept up); the error screen comes and goes with the shown server's problem."""
        if not self.screen_stack or not isinstance(self.screen_stack[0], AttachedScreen):
            return
        dash = self.dashboard
        try:
            shown = dash.shown_index
            for i, link in enumerate(self.links):
                pane = dash.pane(i)
                view = link.view()
                entries = link.log_after(pane.log_panel.last_seq)
                if i == shown or entries:
                    pane.show(view, entries, self.refresh_s, self.frozen)
            self._error_screen(shown)
        except NoMatches:   # shutting down
            pass

    def _error_screen(self, shown: int) -> None:
        conn = self.links[shown].connection
        screen = self.screen
        if isinstance(screen, AttachErrorScreen):
            if not self.links[screen.index].connection.problem or screen.index != shown:
                self._error_for = None
                self.pop_screen()
            else:
                screen.show(self.links[screen.index].connection)
            return
        if screen is not self.dashboard:
            return   # help, the palette: not over them
        key = (conn.state, conn.since)
        if conn.problem and self._waved_off.get(shown) != key:
            self._waved_off.pop(shown, None)
            self._error_for = shown

            def closed(choice: str | None, index: int = shown, key: tuple = key) -> None:
                if choice == "back":
                    self._waved_off[index] = key

            self.push_screen(AttachErrorScreen(shown, self.addresses[shown].url, conn,
                                               several=len(self.links) > 1), closed)

    # -- keys -----------------------------------------------------------------------------
    def on_attached_screen_shown(self, _message: AttachedScreen.Shown) -> None:
        self.tick()

    def on_attach_error_screen_retry(self, message: AttachErrorScreen.Retry) -> None:
        self.links[message.index].retry_now()
        self.links[message.index].note("· retrying now", "connection")

    def on_attached_screen_step_refresh_period(self, message: AttachedScreen.StepRefreshPeriod) -> None:
        self.refresh_s = next_refresh(self.refresh_s, message.step)
        self._start_timer()
        for link in self.links:
            link.set_interval(self.refresh_s)
        self._note(self.dashboard.shown_index, f"· refresh period {self.refresh_s:g} s")
        self.tick()

    def on_attached_screen_toggle_freeze(self, _message: AttachedScreen.ToggleFreeze) -> None:
        self.frozen = not self.frozen
        self._note(self.dashboard.shown_index, "· display frozen (space resumes; the server goes on)" if self.frozen
                   else "· display live again")
        self.tick()

    def _note(self, index: int, text: str) -> None:
        self.links[index].note(text)

    def on_attached_screen_act(self, message: AttachedScreen.Act) -> None:
        link = self.links[message.index]
        view = link.view()
        what = message.what
        if what == "reconnect":
            link.retry_now()
            link.note("· reconnecting now", "connection")
            return
        if what == "select":
            self._select(link, view, message.arg)
            self.tick()
            return
        if not view.connection.live:
            self.notify(f"{link.address.short}: {view.connection.text()}", severity="warning")
            return
        try:
            if what == "backend":
                body, note = backend_toggle(view)
            elif what == "io_threads":
                body, note = threads_step(view, io=message.arg)
            elif what == "kernel_threads":
                body, note = threads_step(view, kernel=message.arg)
            elif what == "preset":
                body, note = next_preset(view)
            elif what == "cancel":
                target = view.selected or view.followed
                live = {s.get("run_id") for s in view.sequences}
                if target is None or target not in live:
                    self.notify("No live sequence to cancel: ↑/↓ picks one.", severity="warning")
                    return
                body, note = {"run_id": target}, f"run {target}"
            elif what in ("drain", "resume"):
                body, note = {}, ""
            else:
                return
        except Ds4fError as exc:
            self.notify(str(exc), severity="error")
            link.note(f"✗ {what}: {exc}", "operator-call")
            return
        action = "threads" if what in ("io_threads", "kernel_threads") else what
        link.note(f"· operator {action}{f' ({note})' if note else ''}: asking the server", "operator-call")
        link.operator(action, body, note)
        self.tick()

    def _select(self, link: ServerLink, view: ServerView, step: int) -> None:
        """↑/↓ through the live sequences; past either end, back to following the most active."""
        ids = [s.get("run_id") for s in view.sequences if s.get("run_id")]
        if not ids:
            link.select(None)
            return
        current = view.selected
        if current in ids:
            i = ids.index(current) + step
        elif view.followed in ids:
            i = ids.index(view.followed)     # the first press picks the one followed
        else:
            i = 0 if step > 0 else len(ids) - 1
        link.select(ids[i] if 0 <= i < len(ids) else None)


def run_attached(urls: list[str], *, operator_token: str | None = None, token: str | None = None,
                 config_path: str | None = None) -> int:
    app = AttachConsole(urls, operator_token=operator_token, token=token, config_path=config_path)
    app.run()
    return int(app.return_code or 0)


__all__ = ["AttachConsole", "run_attached"]
