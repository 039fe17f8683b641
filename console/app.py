"""ds4f-console: the Textual operator console over the run API.

    ds4f-console [--config PATH] [--model PATH] [--preset NAME]
    ds4f-console --attach URL [URL ...] [--operator-token TOKEN] [--token-file PATH]   (console.attach)

The app polls the live run's Snapshot on a timer (not a message per token), so a busy run
costs the SSH link one screen diff per refresh period and keys stay responsive. Long
blocking calls (making the demo model, opening a checkpoint, diffing dumps) run in thread
workers. The screens turn keys into messages (DashboardScreen.StartRun, HistoryScreen.OpenDiff,
...) that the app's on_<screen>_<message> handlers act on. The console never opens checkpoint
files or calls kernels: it uses the engine only through ds4f.api (load_settings,
ensure_demo_model, start_run / Run with one EngineHost for the session, History, diff_states).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from textual import work
from textual.css.query import NoMatches

from ds4f.api import (DEFAULT_GEN, MAX_PARALLEL, Ds4fError, EngineHost, History, RunRecord, Settings, checkpoint_summary,
                      diff_states, ensure_demo_model, load_settings, read_regular)
from ds4f.themes import DEFAULT_THEME, THEME_NAMES, THEMES, next_theme, stylesheet_path

from .core.chat import MODE_NAMES, PROMPT_KINDS, Command, TextSupport, parse_command
from .base_app import ConsoleApp
from .core.controller import Controller, default_start_run, demo_dir, next_refresh, probe_text, simd_scalar_pair
from .core.figures import ENDINGS, fmt_s_per_token, model_name, sampling_text
from .screens import DashboardScreen, DiffScreen, ErrorScreen, HelpScreen, HistoryScreen, SetupScreen

NO_PAIR = ("Needs a finished SIMD run and a scalar run of the same model and length: "
           "k switches the kernels, r runs.")
CHAT_REFRESH_S = 0.1   # how often a streaming answer's text is read (run.output_text: a string, no snapshot)
DEMO_NOTE = ("This is a synthetic model (the demo, or one ds4f synth made): its weights are random, so what it writes is noise. It is here to show "
             "what a run costs (s/token, GB/s, hit rate, memory), not what a model says.")


@dataclass
class Answer:
    """The answer being written: the request it answers and its run (None while it starts)."""

    request: dict
    run: object = None


def _default_validate(path: str) -> None:
    """Open and check the checkpoint with the engine's own validation (its errors name the bad file)."""
    checkpoint_summary(path)


def builtin_config_path() -> Path:
    return Path(str(resources.files("ds4f").joinpath("ds4f.toml")))


class Ds4fConsole(ConsoleApp):
    CSS_PATH = str(stylesheet_path("console.tcss"))

    def __init__(self, config_path: str | None = None, model: str | None = None, preset: str | None = None,
                 *, gen: int | None = None, settings: Settings | None = None, history: History | None = None,
                 start_run: Callable | None = None, demo_factory: Callable | None = None,
                 diff_fn: Callable | None = None, validate_model: Callable | None | bool = None,
                 snapshot_source: Callable | None = None, refresh_s: float | None = None,
                 theme: str | None = None, parallel: int = 1) -> None:
        super().__init__()
        self._config_path = config_path
        self._model_arg = model
        self._preset_arg = preset
        self._gen_arg = gen
        self._settings_given = settings
        self._history_given = history
        self._start_run_fn = start_run or default_start_run
        self._demo_factory = demo_factory or ensure_demo_model
        self._diff_fn = diff_fn or diff_states
        self._validate = _default_validate if validate_model in (None, True) else (validate_model or None)
        self._snapshot_source = snapshot_source
        self._refresh_arg = refresh_s
        self._theme_arg = theme
        self.controller: Controller | None = None
        self.settings: Settings | None = None
        self.history: History | None = None
        self.refresh_s = refresh_s or 1.0
        self.frozen = False
        self._timer = None
        self._booted = False
        self._starting = False
        self._seen_state: dict[str, str] = {}
        self._answer: Answer | None = None   # the chat answer being written
        self._chat_timer = None
        # one loaded engine, reused by every run of this session; with parallel > 1, that many runs
        # at once decode together on it
        self.engines = EngineHost(parallel)
        for t in THEMES:
            self.register_theme(t)
        self.theme = theme or DEFAULT_THEME

    # -- Textual hooks ----------------------------------------------------------------------
    def get_default_screen(self) -> DashboardScreen:
        try:
            snap = self.current_snapshot()  # None, unless a snapshot source was given
        except Exception:
            snap = None
        return DashboardScreen(refresh_s=self.refresh_s, snapshot=snap)

    @property
    def dashboard(self) -> DashboardScreen:
        return self.screen_stack[0]  # type: ignore[return-value]

    def log_event(self, text: str, style: str = "") -> None:
        """A line in the dashboard's event log (dropped while starting up or shutting down)."""
        if self.screen_stack and isinstance(self.screen_stack[0], DashboardScreen):
            self.screen_stack[0].log_line(text, style)

    def _tell_dashboard(self) -> DashboardScreen:
        """Tell the dashboard the settings its status line shows, and return it."""
        dash = self.dashboard
        dash.next_run = self.controller.next_run() if self.controller is not None else None
        dash.refresh_s = self.refresh_s
        dash.frozen = self.frozen
        dash.live = self._starting or (self.controller is not None and self.controller.live)
        return dash

    def on_mount(self) -> None:
        self.theme_changed_signal.subscribe(self, self._theme_changed)

    def on_ready(self) -> None:
        self.boot()

    # -- start-up: config, history, model ---------------------------------------------------
    def boot(self, use_demo: bool = False) -> None:
        """Load the config and history and make sure there is a model; any problem gets an error
        screen that says what and where, and offers the demo model."""
        self.controller = None
        try:
            if self._settings_given is not None:
                settings = self._settings_given
            else:
                try:
                    settings = load_settings(self._config_path)
                except Ds4fError:
                    if not use_demo:
                        raise
                    settings = load_settings(builtin_config_path())
        except Ds4fError as exc:
            where = self._config_path or "./ds4f.toml, then the user config directory, then the built-in defaults"
            self.show_error("The configuration could not be used", f"{exc}\n\nConfig lookup: {where}")
            return
        self.settings = settings
        try:
            self.history = self._history_given or History(settings.history_path)
        except Ds4fError as exc:
            self.show_error("The run history could not be opened", str(exc), offer_demo=False)
            return
        remembered = self.history.get_setting("theme") if self._theme_arg is None else None
        wanted = self._theme_arg or remembered or settings.console.theme
        if wanted in self.available_themes:
            self.theme = wanted
        elif self._theme_arg is None and not remembered:
            self.notify(f"{settings.source}: console.theme: unknown theme {settings.console.theme!r} "
                        f"(have: {', '.join(THEME_NAMES)})", severity="warning", timeout=8)
        if self._refresh_arg is None:
            self.refresh_s = settings.console.refresh_s
        model = "" if use_demo else (self._model_arg or settings.engine.model_path)
        try:
            self.controller = Controller(settings, self.history, model=model,
                                         preset=self._preset_arg if self._preset_arg and not use_demo else "",
                                         gen=self._gen_arg or DEFAULT_GEN, start_run=self._start_run_fn,
                                         engines=self.engines,
                                         config_path=self._config_path if not use_demo else None)
        except Ds4fError as exc:
            self.show_error("The preset could not be used", str(exc))
            return
        self._start_timer()
        self._booted = True
        if model:
            if self._validate is not None:
                self._validate_model(model, "--model" if self._model_arg else f"model.path in {settings.source}")
            else:
                self._model_ready(model)
        else:
            self._make_demo()

    def show_error(self, title: str, message: str, offer_demo: bool = True, can_go_back: bool = False) -> None:
        def chosen(choice: str | None) -> None:
            if choice == "demo":
                self.boot(use_demo=True)
            elif choice == "retry":
                self.boot()

        self.push_screen(ErrorScreen(title, message, offer_demo=offer_demo, can_go_back=can_go_back), chosen)

    @work(thread=True, exclusive=True, group="model", exit_on_error=False)
    def _validate_model(self, model: str, source: str) -> None:
        try:
            if not Path(model).exists():
                raise Ds4fError(f"{model}: checkpoint not found (set by {source})")
            self._validate(model)
        except Ds4fError as exc:
            self.call_from_thread(self.show_error, "The checkpoint could not be opened", str(exc))
        except Exception as exc:
            self.call_from_thread(self.show_error, "The checkpoint could not be opened",
                                  f"{model}: {type(exc).__name__}: {exc}")
        else:
            self.call_from_thread(self._model_ready, model)

    def _make_demo(self) -> None:
        where = str(demo_dir())
        screen = SetupScreen(where)
        self.push_screen(screen)
        self._demo_worker(screen)

    @work(thread=True, exclusive=True, group="model", exit_on_error=False)
    def _demo_worker(self, screen: SetupScreen) -> None:
        def progress(done, total, label) -> None:
            self.call_from_thread(screen.progress, done, total, label)

        try:
            path = self._demo_factory(progress=progress)
        except Exception as exc:
            message = str(exc) if isinstance(exc, Ds4fError) else f"{type(exc).__name__}: {exc}"
            self.call_from_thread(self._demo_failed, screen, message)
        else:
            self.call_from_thread(self._demo_ready, screen, str(path))

    def _demo_ready(self, screen: SetupScreen, path: str) -> None:
        if self.controller is not None:
            self.controller.model = path
        self._close_setup(screen)
        self.log_event(f"demo model ready: {path}", "dim")
        self._model_ready(path, demo=True)

    def _demo_failed(self, screen: SetupScreen, message: str) -> None:
        self._close_setup(screen)
        self.show_error("The demo model could not be made", message, offer_demo=False)

    def _close_setup(self, screen: SetupScreen) -> None:
        """Take the first-launch screen off the stack, with what was opened over it (the palette,
        the help): what comes next goes over the dashboard."""
        if screen in self.screen_stack:
            while self.screen is not screen:
                self.pop_screen()
            self.pop_screen()

    def _model_ready(self, model: str, demo: bool = False) -> None:
        """The checkpoint opened: show it, and find out whether it reads and writes text."""
        self.tick(force=True)
        self._probe_text(model, demo)

    @work(thread=True, exclusive=True, group="text", exit_on_error=False)
    def _probe_text(self, model: str, demo: bool) -> None:
        support = probe_text(model, demo)
        self.call_from_thread(self._text_ready, model, support)

    def _text_ready(self, model: str, support: TextSupport) -> None:
        ctl = self.controller
        if ctl is None or ctl.model != model:
            return  # the model changed meanwhile
        ctl.text = support
        self._show_prompt()
        transcript = self.dashboard.chat.transcript
        if support.demo:
            transcript.add_note(DEMO_NOTE, "dim italic")
        if not support.ok:
            transcript.add_note(support.detail, "bold")
        else:
            transcript.add_note(f"{model_name(model)} · {sampling_text(ctl.text.sampling(ctl.chat.seed))} · answers "
                                f"of up to {ctl.gen} tokens (n changes it)", "dim")

    def _show_prompt(self) -> None:
        """The prompt line's mode, sampling and state, as the controller has them."""
        ctl = self.controller
        if ctl is None:
            return
        self.dashboard.chat.set_prompt(ctl.chat.mode, sampling_text(ctl.text.sampling(ctl.chat.seed)),
                                       ctl.text.ok, ctl.text.message)

    # -- the refresh timer ----------------------------------------------------------------
    def _start_timer(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_interval(self.refresh_s, self.tick, name="refresh")

    def current_snapshot(self):
        if self._snapshot_source is not None:
            return self._snapshot_source()
        return self.controller.snapshot() if self.controller is not None else None

    def tick(self, force: bool = False) -> None:
        if not self.screen_stack or not isinstance(self.screen_stack[0], DashboardScreen):
            return  # starting up or shutting down
        try:
            snap = self.current_snapshot()
        except Exception as exc:  # the engine must never take the console down
            self.notify(f"snapshot failed: {exc}", severity="error")
            return
        if snap is not None:
            self._transitions(snap)
        if not (self.dashboard.is_current or force):
            return
        try:
            self._tell_dashboard().show(snap)  # frozen: the status line alone
        except NoMatches:  # the app is shutting down and the panels are gone
            pass

    def _transitions(self, snap) -> None:
        before = self._seen_state.get(snap.run_id)
        if before == snap.state:
            return
        self._seen_state[snap.run_id] = snap.state
        if snap.state == "done" and before is not None:
            spt = f"{snap.s_per_token:.3f} s/token" if snap.s_per_token is not None else ""
            self.notify(f"run {snap.run_id} done: {snap.tokens_done} tokens {spt}", title="run finished")
        elif snap.state == "cancelled" and before is not None:
            self.notify(f"run {snap.run_id} cancelled after {snap.tokens_done} tokens", severity="warning")
        elif snap.state == "failed":
            self.notify(snap.error or "the run failed", title=f"run {snap.run_id} failed", severity="error",
                        timeout=10)

    # -- the dashboard's keys --------------------------------------------------------------
    def on_dashboard_screen_shown(self, _message: DashboardScreen.Shown) -> None:
        self.tick(force=True)

    def on_dashboard_screen_step_refresh_period(self, message: DashboardScreen.StepRefreshPeriod) -> None:
        self.refresh_s = next_refresh(self.refresh_s, message.step)
        self._start_timer()
        self.log_event(f"· refresh period {self.refresh_s:g} s", "italic")
        self.tick(force=True)

    def on_dashboard_screen_toggle_freeze(self, _message: DashboardScreen.ToggleFreeze) -> None:
        self.frozen = not self.frozen
        self.log_event("· display frozen (space resumes; the run goes on)" if self.frozen
                       else "· display live again", "italic")
        self.tick(force=True)

    def on_dashboard_screen_start_run(self, _message: DashboardScreen.StartRun) -> None:
        ctl = self.controller
        if ctl is None:
            return
        if self._starting or (ctl.live and not ctl.can_add):
            more = f" ({ctl.parallel} at once at most)" if ctl.parallel > 1 else ""
            self.notify(f"A run is already live: s stops it{more}.", severity="warning")
            return
        self._start(ctl)

    def _start(self, ctl: Controller, request: dict | None = None) -> None:
        self._starting = True
        what = f"a {PROMPT_KINDS[ctl.chat.mode]} prompt on " if request is not None else ""
        self.log_event(f"· starting: {what}{ctl.model}, preset {ctl.preset}, {ctl.gen} tokens, "
                       f"{ctl.next_backend()}, k{ctl.effective_kernel_threads()} "
                       f"io{ctl.effective_io_threads()}", "italic")
        self._start_worker(ctl, request)

    def on_dashboard_screen_stop_run(self, _message: DashboardScreen.StopRun) -> None:
        ctl = self.controller
        if ctl is not None and ctl.stop():
            self.log_event("· stop requested: the run ends at the next token", "italic")
        else:
            self.notify("No live run to stop.")

    def on_dashboard_screen_cycle_preset(self, _message: DashboardScreen.CyclePreset) -> None:
        self._change_setting(lambda c: c.cycle_preset())

    def on_dashboard_screen_cycle_spec(self, _message: DashboardScreen.CycleSpec) -> None:
        self._change_setting(lambda c: c.cycle_spec())

    def on_dashboard_screen_step_io_threads(self, message: DashboardScreen.StepIoThreads) -> None:
        self._change_setting(lambda c: c.adjust_io_threads(message.delta))

    def on_dashboard_screen_step_kernel_threads(self, message: DashboardScreen.StepKernelThreads) -> None:
        self._change_setting(lambda c: c.adjust_kernel_threads(message.delta))

    def on_dashboard_screen_toggle_kernels(self, _message: DashboardScreen.ToggleKernels) -> None:
        self._change_setting(lambda c: c.toggle_backend())

    def on_dashboard_screen_set_token_count(self, message: DashboardScreen.SetTokenCount) -> None:
        self._change_setting(lambda c: c.set_gen(message.tokens))

    def on_dashboard_screen_open_history(self, _message: DashboardScreen.OpenHistory) -> None:
        ctl = self.controller
        if ctl is None or ctl.history is None:
            self.notify("No run history is open.", severity="warning")
            return
        self.push_screen(HistoryScreen(lambda: ctl.runs(500), known_tokens=ctl.tokens_of, disk=ctl.runs_dir_figures))

    def on_dashboard_screen_diff_last_two(self, _message: DashboardScreen.DiffLastTwo) -> None:
        pair = self.controller.last_two() if self.controller else None
        if pair is None:
            self.notify("Two finished runs are needed: r runs one.", severity="warning")
            return
        self._open_diff(*pair)

    def on_dashboard_screen_compare_simd_scalar(self, _message: DashboardScreen.CompareSimdScalar) -> None:
        self._open_pair(self.controller.simd_scalar_pair() if self.controller else None)

    # -- the chat --------------------------------------------------------------------------
    def on_dashboard_screen_submit_prompt(self, message: DashboardScreen.SubmitPrompt) -> None:
        ctl, dash = self.controller, self.dashboard
        if ctl is None:
            return
        transcript = dash.chat.transcript
        try:
            command = parse_command(message.line)
        except Ds4fError as exc:
            transcript.add_note(str(exc), "bold red")
            return
        if command is not None:
            dash.prompt_taken()
            self._chat_command(command)
            return
        if self._starting or ctl.live:
            self.notify("A run is live: ctrl+c (or s) stops it; your prompt waits in the prompt line.",
                        severity="warning")
            return
        try:
            request = ctl.chat.request(message.line)
            ctl.text_run_config(request)   # a prompt the model cannot take is refused here, not in a thread
        except Ds4fError as exc:
            transcript.add_note(str(exc), "bold red")
            return
        dash.prompt_taken()
        transcript.add_prompt(message.line, ctl.chat.mode)
        self._ask(request)

    def _ask(self, request: dict) -> None:
        """Start the answer to `request` (Chat's fields), shown in the transcript as it streams."""
        self.dashboard.chat.transcript.start_answer("starting…")
        self._answer = Answer(request)
        self._start(self.controller, request)

    def _chat_command(self, command: Command) -> None:
        ctl, transcript = self.controller, self.dashboard.chat.transcript
        if command.name == "reset":
            self._clear_chat()
            return
        if command.name in ("system", "tools", "result"):
            self._tool_command(command)
            return
        if command.name == "seed":
            try:
                ctl.chat.set_seed(int(command.arg))
            except Ds4fError as exc:
                transcript.add_note(str(exc), "bold red")
                return
            transcript.add_note(f"· seed {ctl.chat.seed}: {sampling_text(ctl.text.sampling(ctl.chat.seed))}", "dim")
        else:
            ctl.chat.set_mode(command.name)
            transcript.add_note(f"· mode: {MODE_NAMES[ctl.chat.mode]}", "dim")
        self._show_prompt()

    def _tool_command(self, command: Command) -> None:
        """/system, /tools, /result (see console.core.chat)."""
        ctl, transcript = self.controller, self.dashboard.chat.transcript
        try:
            if command.name == "system":
                ctl.chat.set_system(command.arg)
                transcript.add_note(f"· system prompt: {command.arg}" if command.arg else "· no system prompt", "dim")
            elif command.name == "tools":
                n = ctl.chat.load_tools(command.arg)
                names = ", ".join(t["name"] for t in ctl.chat.tools)
                transcript.add_note(f"· tools: {names} ({n} from {command.arg})" if n else "· no tools", "dim")
            else:
                if self._starting or ctl.live:
                    self.notify("A run is live: ctrl+c (or s) stops it first.", severity="warning")
                    return
                request = ctl.chat.result(command.arg)
                transcript.add_prompt(f"/result {command.arg}", "tool")
                if request is not None:
                    ctl.text_run_config(request)
                    self._ask(request)
        except Ds4fError as exc:
            transcript.add_note(str(exc), "bold red")

    def on_dashboard_screen_cycle_mode(self, _message: DashboardScreen.CycleMode) -> None:
        if self.controller is not None:
            self._chat_command(Command(self.controller.chat.next_mode()))

    def on_dashboard_screen_clear_chat(self, _message: DashboardScreen.ClearChat) -> None:
        self._clear_chat()

    def _clear_chat(self) -> None:
        ctl, transcript = self.controller, self.dashboard.chat.transcript
        if ctl is None:
            return
        if self._answer is not None:
            self.notify("An answer is being written: ctrl+c stops it, then clear.", severity="warning")
            return
        ctl.chat.reset()
        transcript.clear()
        transcript.add_note("· conversation cleared", "dim")

    def _chat_tick(self) -> None:
        """Show the answer so far; at its end, say how it ended and keep the turn."""
        answer = self._answer
        if answer is None or answer.run is None:
            self._stop_chat_timer()
            return
        run = answer.run
        ended = run.finished        # read first: the text read after it is then the whole output
        text = run.output_text
        try:
            transcript = self.dashboard.chat.transcript
        except NoMatches:           # shutting down
            return
        status = f"reading the prompt: {run.prompt_tokens} tokens…" if run.generated_tokens == 0 else "…"
        thinking = bool(answer.request.get("thinking"))
        transcript.show_answer(text, thinking, status, done=ended, tools=answer.request.get("tools"))
        if ended:
            self._answer_ended(answer)

    def _answer_ended(self, answer: Answer) -> None:
        run, ctl = answer.run, self.controller
        self._answer = None
        self._stop_chat_timer()
        n = run.generated_tokens
        snap = run.snapshot()
        spt = f" · {fmt_s_per_token(snap.s_per_token)} s/token" if snap.s_per_token is not None else ""
        if run.state == "done":
            ending = ENDINGS.get(run.finish_reason, run.finish_reason or "done")
            line, style = f"✓ {ending} · {n} tokens{spt} · run {run.id}", "dim"
        elif run.state == "cancelled":
            line, style = f"■ stopped after {n} tokens{spt} · run {run.id}", "bold yellow"
        else:
            line, style = f"✗ failed: {run.error}", "bold red"
        if run.state in ("done", "cancelled") and ctl is not None:
            ctl.chat.answered(answer.request, run.assistant_message)
        self.dashboard.chat.transcript.end_answer(line, style)

    def _stop_chat_timer(self) -> None:
        if self._chat_timer is not None:
            self._chat_timer.stop()
            self._chat_timer = None

    # -- the history's keys -----------------------------------------------------------------
    def on_history_screen_open_diff(self, message: HistoryScreen.OpenDiff) -> None:
        self._open_diff(message.a, message.b)

    def on_history_screen_compare_simd_scalar(self, message: HistoryScreen.CompareSimdScalar) -> None:
        self._open_pair(simd_scalar_pair(message.records))

    # -- run control ----------------------------------------------------------------------
    @work(thread=True, group="start", exit_on_error=False)
    def _start_worker(self, ctl: Controller, request: dict | None = None) -> None:
        try:
            run = ctl.start(request)
        except Ds4fError as exc:
            self.call_from_thread(self._start_failed, str(exc), ctl.model)
        except Exception as exc:
            self.call_from_thread(self._start_failed, f"internal error: {type(exc).__name__}: {exc}", "")
        else:
            self.call_from_thread(self._started, run)

    def _started(self, run) -> None:
        self._starting = False
        if self._answer is not None and self._answer.run is None:
            self._answer.run = run
            self._chat_timer = self.set_interval(CHAT_REFRESH_S, self._chat_tick, name="chat")
        self.tick(force=True)

    def _start_failed(self, message: str, model: str) -> None:
        self._starting = False
        if self._answer is not None and self._answer.run is None:
            self._answer = None
            self.dashboard.chat.transcript.end_answer(f"✗ not started: {message}", "bold red")
        self.log_event(f"cannot start the run: {message}", "bold red")
        self.notify(message, title="cannot start the run", severity="error", timeout=10)
        if model and model in message:
            self.show_error("The checkpoint could not be opened", message, can_go_back=True)

    def _change_setting(self, change: Callable[[Controller], str]) -> None:
        """Apply a settings key to the controller; its note goes to the event log."""
        ctl = self.controller
        if ctl is None:
            return
        try:
            note = change(ctl)
        except Ds4fError as exc:
            self.notify(str(exc), severity="error")
            return
        self.log_event(f"· {note}", "italic")
        self._tell_dashboard().show_status(self.current_snapshot())

    def _stop_live_run(self) -> None:
        """Stop a live run and give it a few seconds to end (it ends at its next token)."""
        ctl = self.controller
        if ctl is not None:
            for run in ctl.stop_all():
                run.wait(5.0)

    # -- diffs ----------------------------------------------------------------------------
    def _open_diff(self, a: RunRecord, b: RunRecord) -> None:
        self.push_screen(DiffScreen(a, b, diff_fn=self._diff_fn))

    def _open_pair(self, pair: tuple[RunRecord, RunRecord] | None) -> None:
        if pair is None:
            self.notify(NO_PAIR, severity="warning", timeout=8)
            return
        self._open_diff(*pair)

    # -- app-wide actions ----------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            ctl = self.controller
            self.push_screen(HelpScreen(files=[
                ("config", self.settings.source if self.settings else "—"),
                ("history", str(ctl.history.path) if ctl and ctl.history else "—"),
                ("model", (ctl.model or "—") if ctl else "—"),
            ]))

    def action_cycle_theme(self) -> None:
        self.theme = next_theme(self.theme)

    def _theme_changed(self, theme) -> None:
        if self._booted and self.history is not None:
            try:
                self.history.set_setting("theme", theme.name)
            except Ds4fError as exc:
                self.notify(str(exc), severity="warning")
        if self._booted:
            self.log_event(f"· theme {theme.name}", "italic")

    async def action_quit(self) -> None:
        self._stop_live_run()
        self.exit()

    def on_unmount(self) -> None:
        """The app is closing: stop a live run, then release the loaded engine."""
        self._stop_live_run()
        ctl = self.controller
        if ctl is None or not ctl.running:
            self.engines.close()


def read_token(path: str) -> str:
    """A bearer token from a file (surrounding whitespace stripped); Ds4fError naming the file."""
    try:   # a regular file within a bound: a FIFO or a device is refused, never read without end
        token = read_regular(path, "--token-file", 64 << 10).decode("ascii").strip()
    except UnicodeDecodeError:
        raise Ds4fError(f"--token-file {path}: the token must be ASCII") from None
    if not token or any(c.isspace() for c in token):
        raise Ds4fError(f"--token-file {path}: expected one token on one line")
    return token


DEFAULT_SERVE_PORT = 8734      # ds4f serve's default port


DESCRIPTION = "The ds4f operator console: run, watch and compare DeepSeek-V4-Flash disk-streaming runs."


def configure(parser: argparse.ArgumentParser) -> None:
    """The console's own options; the ones it shares with the `ds4f` commands (--config, MODEL/-m,
    --preset, --parallel, --operator-token, --token-file) are added by ds4f.cli.console, the
    command line's one builder of each."""
    parser.add_argument("--attach", nargs="+", metavar="URL",
                        help="watch and steer running `ds4f serve`s over HTTP instead, one tab per URL "
                             "(http://host:port, or host:port; port 8734 when none)")
    parser.add_argument("--serve", nargs="?", type=int, const=DEFAULT_SERVE_PORT, metavar="PORT",
                        help=f"serve the OpenAI and Anthropic APIs from this process on 127.0.0.1:PORT (default "
                             f"{DEFAULT_SERVE_PORT}) and watch and steer that server here: one engine for both")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, serve_here: Callable | None = None) -> int:
    """The console from its parsed command line (ds4f.cli.console builds it; args.model is MODEL).
    `serve_here(model=, preset=, config_path=, port=, parallel=)` -> (a started server, its
    operator token): what --serve starts (ds4f.cli.console passes it; the console itself never
    imports the server)."""
    if args.serve is not None:
        if args.attach or args.operator_token or args.token_file:
            parser.error("--serve watches the server it starts: not with --attach, --operator-token, --token-file")
        return _serve_and_watch(args, parser, serve_here)
    if args.attach:
        local = [f"--{name}" for name in ("model", "preset") if getattr(args, name)] + (
            ["--parallel"] if args.parallel != 1 else [])
        if local:
            parser.error(f"--attach watches running servers: {', '.join(local)} is for a local run")
        from .attach import AttachConsole
        try:
            token = read_token(args.token_file) if args.token_file else None
            app = AttachConsole(args.attach, operator_token=args.operator_token, token=token,
                                config_path=args.config)
        except Ds4fError as exc:
            parser.error(str(exc))
        app.run()
        return int(app.return_code or 0)
    if args.operator_token or args.token_file:
        parser.error("--operator-token and --token-file go with --attach")
    if not 1 <= args.parallel <= MAX_PARALLEL:
        parser.error(f"--parallel: between 1 and {MAX_PARALLEL} runs, got {args.parallel}")
    app = Ds4fConsole(config_path=args.config, model=args.model, preset=args.preset, parallel=args.parallel)
    app.run()  # a live run is stopped and the engine released as the app unmounts
    return int(app.return_code or 0)


def _serve_and_watch(args, parser, serve_here: Callable | None) -> int:
    """--serve: the server in a thread of this process, the attached console on its URL."""
    from .attach import AttachConsole

    if serve_here is None:
        parser.error("--serve: start the console as ds4f-console (its entry point brings the server)")
    if not 0 <= args.serve <= 65535 or not 1 <= args.parallel <= MAX_PARALLEL:
        parser.error(f"--serve: a port 0..65535 (got {args.serve}); --parallel: 1..{MAX_PARALLEL}")
    try:
        server, token = serve_here(model=args.model, preset=args.preset, config_path=args.config, port=args.serve,
                                   parallel=args.parallel if args.parallel != 1 else None)
    except Ds4fError as exc:
        parser.error(str(exc))
    try:
        app = AttachConsole([server.url], operator_token=token, config_path=args.config)
        app.run()
        return int(app.return_code or 0)
    finally:
        server.stop()

