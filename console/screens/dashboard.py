"""The dashboard: the live panels over the current (or last) run's Snapshot, and the chat.

The app hands the screen a Snapshot at each refresh and the next run's settings when they
change; the screen hands the Snapshot to each panel. Keys become messages the app acts on.
With the chat shown (i), the transcript and the prompt line take the place of the run and
event panels (of the event panel alone on a wide terminal); the other panels stay.
"""
from __future__ import annotations

from textual import on
from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.containers import Container
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Input

from ds4f.api import Snapshot

from ..core.bindings import CHAT_BINDINGS, DASHBOARD_BINDINGS
from ..core.controller import NextRun
from ..widgets.panels import (DashboardPanel, EventsPanel, HitRatePanel, KernelsPanel, MemoryPanel, ProgressPanel,
                      ReadRatePanel, SpeedPanel, StatusLine)
from ..widgets.chat import ChatPanel, PromptInput, Transcript
from ..widgets.common import EventLog, KeyBar, SizeNotice
from .modals import TokenCountScreen


class DashboardScreen(Screen):
    """Live panels over the current (or last) run's Snapshot, refreshed by the app's timer."""

    BINDINGS = DASHBOARD_BINDINGS + CHAT_BINDINGS
    CHAT_ACTIONS = frozenset(b.action for b in CHAT_BINDINGS)   # active while the chat is shown

    # -- what the keys ask of the app ---------------------------------------------------------
    class StartRun(Message):
        """Start a run with the settings in the status line."""

    class StopRun(Message):
        """Stop the live run."""

    class CyclePreset(Message):
        """The next preset for the next run."""

    class CycleSpec(Message):
        """The next speculative-decoding mode for the next run."""

    class StepIoThreads(Message):
        """One I/O thread more (delta 1) or fewer (delta -1)."""

        def __init__(self, delta: int) -> None:
            super().__init__()
            self.delta = delta

    class StepKernelThreads(Message):
        """One kernel thread more (delta 1) or fewer (delta -1)."""

        def __init__(self, delta: int) -> None:
            super().__init__()
            self.delta = delta

    class ToggleKernels(Message):
        """Switch the kernels between SIMD and scalar."""

    class SetTokenCount(Message):
        """The number of tokens the next run decodes."""

        def __init__(self, tokens: int) -> None:
            super().__init__()
            self.tokens = tokens

    class OpenHistory(Message):
        """Open the run history."""

    class DiffLastTwo(Message):
        """Diff the state dumps of the last two finished runs."""

    class CompareSimdScalar(Message):
        """Diff the newest SIMD run against the newest comparable scalar run."""

    class StepRefreshPeriod(Message):
        """A longer (step 1) or shorter (step -1) refresh period."""

        def __init__(self, step: int) -> None:
            super().__init__()
            self.step = step

    class ToggleFreeze(Message):
        """Freeze or unfreeze the display."""

    class Shown(Message):
        """The dashboard is the current screen again and wants a fresh Snapshot."""

    class SubmitPrompt(Message):
        """The operator sent a line from the prompt line (a prompt, or a /command)."""

        def __init__(self, line: str) -> None:
            super().__init__()
            self.line = line

    class CycleMode(Message):
        """The next prompt mode: chat, chat with thinking, plain completion."""

    class ClearChat(Message):
        """Clear the conversation and the transcript."""

    # -----------------------------------------------------------------------------------------
    def __init__(self, refresh_s: float = 1.0, snapshot: Snapshot | None = None) -> None:
        """`snapshot`: what the panels show from the first frame (None: no run yet)."""
        super().__init__(id="dashboard")
        # What the status line shows besides the run; the app sets these before each refresh.
        self.next_run: NextRun | None = None
        self.refresh_s = refresh_s
        self.frozen = False
        self.shown = snapshot  # the snapshot the panels show (kept while frozen)
        self.live = False      # a run is live (the app says): ctrl+c stops it rather than copying
        self.chat_shown = False

    def compose(self) -> ComposeResult:
        yield StatusLine()
        with Container(id="panels"):
            yield SpeedPanel()
            yield ReadRatePanel()
            yield HitRatePanel()
            with Container(id="memkern"):
                yield MemoryPanel()
                yield KernelsPanel()
            yield ProgressPanel()
            yield EventsPanel()
            yield ChatPanel()
        yield KeyBar()
        yield SizeNotice()

    def on_mount(self) -> None:
        self.log_line("ds4f-console ready: r runs, ? lists every key, ctrl+p or : opens the command palette",
                      "dim")
        self.show(self.shown)

    def on_screen_resume(self) -> None:
        self.post_message(self.Shown())

    def log_line(self, text: str, style: str = "") -> None:
        """A line of the console's own in the event log."""
        try:
            self.query_one(EventsPanel).add_line(text, style)
        except NoMatches:  # not composed yet, or already torn down
            pass

    def show(self, snap: Snapshot | None) -> None:
        """One refresh: the status line, then every panel draws `snap` (None: no run yet this
        session). While frozen, only the status line changes and the panels keep what they show."""
        if self.frozen:
            self.show_status(self.shown)
            return
        self.shown = snap
        self.show_status(snap)
        self.query_one(KernelsPanel).next_run = self.next_run
        for panel in self.query(DashboardPanel):
            panel.update(snap)

    def show_status(self, snap: Snapshot | None) -> None:
        """Redraw the status line alone (after a settings change, or while frozen)."""
        self.query_one(StatusLine).show(snap, self.next_run, self.refresh_s, self.frozen)

    # -- the chat ------------------------------------------------------------------------------
    @property
    def chat(self) -> ChatPanel:
        return self.query_one(ChatPanel)

    def show_chat(self, shown: bool) -> None:
        """Show the transcript and the prompt line in place of the run and event panels, or not."""
        if shown == self.chat_shown:
            return
        self.chat_shown = shown
        self.set_class(shown, "-chat")
        if not shown and (self.focused is None or not self.focused.display or
                          self.chat in self.focused.ancestors):
            self.query_one(EventLog).focus()
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The chat's keys act (and show) only while the chat is shown."""
        if action in self.CHAT_ACTIONS and not self.chat_shown:
            return False
        return True

    @on(Input.Submitted, "#prompt")
    def _prompt_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.post_message(self.SubmitPrompt(event.value))

    @on(PromptInput.Leave)
    def _prompt_left(self, event: PromptInput.Leave) -> None:
        event.stop()
        self.query_one(Transcript).focus()

    def prompt_taken(self) -> None:
        """The app took the prompt line's text: empty it for the next one."""
        self.chat.prompt.value = ""

    # -- actions: each asks the app by a message ----------------------------------------------
    def action_chat(self) -> None:
        self.show_chat(True)
        prompt = self.chat.prompt
        if not prompt.disabled:
            self.call_after_refresh(prompt.focus)

    def action_back(self) -> None:
        self.show_chat(False)

    def action_cycle_mode(self) -> None:
        self.post_message(self.CycleMode())

    def action_clear_chat(self) -> None:
        self.post_message(self.ClearChat())

    def action_interrupt(self) -> None:
        if not self.live:
            raise SkipAction()   # nothing to stop: ctrl+c copies, as it does elsewhere
        self.post_message(self.StopRun())

    def action_run(self) -> None:
        self.post_message(self.StartRun())

    def action_stop(self) -> None:
        self.post_message(self.StopRun())

    def action_cycle_preset(self) -> None:
        self.post_message(self.CyclePreset())

    def action_cycle_spec(self) -> None:
        self.post_message(self.CycleSpec())

    def action_io_threads(self, delta: int) -> None:
        self.post_message(self.StepIoThreads(delta))

    def action_kernel_threads(self, delta: int) -> None:
        self.post_message(self.StepKernelThreads(delta))

    def action_toggle_simd(self) -> None:
        self.post_message(self.ToggleKernels())

    def action_set_tokens(self) -> None:
        if self.next_run is None:  # no config loaded yet
            return

        def done(n: int | None) -> None:
            if n is not None:
                self.post_message(self.SetTokenCount(n))

        self.app.push_screen(TokenCountScreen(self.next_run.gen), done)

    def action_history(self) -> None:
        self.post_message(self.OpenHistory())

    def action_diff_last(self) -> None:
        self.post_message(self.DiffLastTwo())

    def action_compare_simd_scalar(self) -> None:
        self.post_message(self.CompareSimdScalar())

    def action_refresh_period(self, step: int) -> None:
        self.post_message(self.StepRefreshPeriod(step))

    def action_freeze(self) -> None:
        self.post_message(self.ToggleFreeze())
