"""The console's state between runs, and its calls into the run API. No Textual here.

The dashboard's keys change *pending* settings (preset, threads, backend, token count) that
the next run starts with; thread and backend changes also go to the live run, where they land
at the next token boundary. Everything the console knows about a run comes from
Run.snapshot() (and a chat answer's text from Run.output_text); it never opens a checkpoint or
calls a kernel. Whether a checkpoint reads and writes text, and its default sampling, come from
the run API's tokenizer and generation-config loaders (probe_text).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ds4f import api
from ds4f.api import Config, Ds4fError, EngineHost, History, RunConfig, RunRecord, Settings, Snapshot

from .chat import CHECKING, Chat, TextSupport

REFRESH_STEPS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
MAX_IO_THREADS = 64     # where the ] key stops (the engine itself accepts up to api.MAX_THREADS)


def default_start_run(config: RunConfig, history: History | None, engines: EngineHost | None = None):
    """Start a run through the run API; `engines` keeps the loaded engine for the next run."""
    return api.start_run(config, history=history, engines=engines)


@dataclass(frozen=True)
class NextRun:
    """The settings the next run starts with, as the status line and the kernels panel show them."""

    model: str
    preset: str
    gen: int
    backend: str
    kernel_threads: int
    io_threads: int
    spec: str = "off"       # speculative decoding: off | auto | 1..3 drafts


SPEC_MODES = ("off", "auto", "1", "2", "3")   # what the spec key cycles through


@dataclass
class Controller:
    settings: Settings                     # ds4f.toml: the engine's settings (config) and [runs] budget
    history: History | None
    model: str = ""
    preset: str = ""
    gen: int = api.DEFAULT_GEN
    io_threads: int | None = None          # None: the preset's / ds4f.toml's
    kernel_threads: int | None = None
    backend: str = "auto"
    spec: str = "off"                      # speculative decoding for the next run (SPEC_MODES)
    config_path: str | None = None         # passed on to the run so it reads the same ds4f.toml
    start_run: Callable = default_start_run  # (RunConfig, History | None, EngineHost | None) -> Run
    engines: EngineHost | None = None      # keeps one loaded engine across this session's runs
    run: api.Run | None = None             # the current or last Run of this session
    others: list = field(default_factory=list)   # earlier runs still live beside it (--parallel)
    notes: list[str] = field(default_factory=list)   # console-side events (settings changes)
    # tokens decoded by this session's earlier runs, by run id: the history has no count for a
    # cancelled or failed run (no report), but the console saw it
    seen_tokens: dict[str, int] = field(default_factory=dict)
    chat: Chat = field(default_factory=Chat)               # the conversation and the prompt mode
    text: TextSupport = CHECKING                           # whether the model reads and writes text

    @property
    def config(self) -> Config:
        """ds4f.toml's engine settings: presets, threads, backend."""
        return self.settings.engine

    def __post_init__(self) -> None:
        self.preset = self.preset or self.config.preset
        self.config.get_preset(self.preset)  # a bad --preset is a Ds4fError now, not at the first run
        if self.backend == "auto" and self.config.backend != "auto":
            self.backend = self.config.backend

    # -- what the next run will use -------------------------------------------------------
    @property
    def preset_names(self) -> list[str]:
        return list(self.config.presets)

    def effective_io_threads(self) -> int:
        return self.io_threads or self.config.effective_io_threads(self.config.get_preset(self.preset))

    def effective_kernel_threads(self) -> int:
        return self.kernel_threads or self.config.effective_kernel_threads(self.config.get_preset(self.preset))

    def next_backend(self) -> str:
        return api.best_backend() if self.backend == "auto" else self.backend

    def next_run(self) -> NextRun:
        return NextRun(self.model, self.preset, self.gen, self.next_backend(), self.effective_kernel_threads(),
                       self.effective_io_threads(), self.spec)

    def run_config(self):
        if not self.model:
            raise Ds4fError("no model: give --model PATH, set [model] path in ds4f.toml, or use the demo model")
        return RunConfig(model=self.model, preset=self.preset, gen=self.gen,
                         io_threads=self.io_threads, kernel_threads=self.kernel_threads,
                         backend=self.backend, config_path=self.config_path, spec=self.spec,
                         cold_start=True)    # a measured run: its hit rate comparable with the others

    # -- the run --------------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self.run is not None and self.run.state in api.LIVE_STATES

    def text_run_config(self, request: dict) -> RunConfig:
        """The pending settings with a text prompt (`request`: Chat.request's fields), sampled with
        the checkpoint's generation defaults and the chat's seed."""
        if not self.text.ok:
            raise Ds4fError(f"prompt: {self.text.detail or self.text.message}", param="prompt")
        # a chat turn continues on the cache the turns before left warm
        return replace(self.run_config(), **request, sampling=self.text.sampling(self.chat.seed), cold_start=False)

    @property
    def parallel(self) -> int:
        """Sequences this session's engine decodes together (ds4f-console --parallel)."""
        return self.engines.parallel if self.engines is not None else 1

    @property
    def running(self) -> list:
        """This session's live runs: the current one and those started before it still going."""
        runs = [r for r in self.others if r.state in api.LIVE_STATES]
        self.others[:] = runs
        return runs + ([self.run] if self.live else [])

    @property
    def can_add(self) -> bool:
        """Another run may start beside the live ones (several sequences decode together)."""
        return len(self.running) < self.parallel

    def start(self, request: dict | None = None):
        """Start a run with the pending settings (blocking: it opens the checkpoint); `request`:
        a text prompt's fields (Chat.request), else the run is on token ids as before. With
        --parallel N, up to N runs go at once (the dashboard follows the newest)."""
        if self.live and not self.can_add:
            more = f" ({self.parallel} sequences at most)" if self.parallel > 1 else ""
            raise Ds4fError(f"run {self.run.id} is still {self.run.state}; stop it first (s){more}")
        config = self.text_run_config(request) if request is not None else self.run_config()
        run = self.start_run(config, self.history, self.engines)
        self._remember(self.run)
        if self.live:
            self.others.append(self.run)
        self.run = run
        return run

    def _remember(self, run) -> None:
        if run is not None:
            try:
                self.seen_tokens[run.id] = run.snapshot().tokens_done
            except Exception:  # a run that cannot say is simply not remembered
                pass

    def tokens_of(self, run_id: str) -> int | None:
        """Tokens a run of this session decoded, as the console saw it (None: not this session's)."""
        if self.run is not None and self.run.id == run_id:
            self._remember(self.run)
        return self.seen_tokens.get(run_id)

    def stop(self) -> bool:
        if not self.live:
            return False
        self.run.cancel()
        return True

    def stop_all(self) -> list:
        """Cancel every live run of this session; the ones cancelled."""
        runs = self.running
        for r in runs:
            r.cancel()
        return runs

    def snapshot(self) -> Snapshot | None:
        return self.run.snapshot() if self.run is not None else None

    # -- settings keys --------------------------------------------------------------------
    def _note(self, text: str) -> str:
        self.notes.append(text)
        return text

    def cycle_preset(self, step: int = 1) -> str:
        names = self.preset_names
        i = names.index(self.preset) if self.preset in names else -1
        self.preset = names[(i + step) % len(names)]
        when = " (next run)" if self.live else ""
        return self._note(f"preset {self.config.get_preset(self.preset).describe()}{when}")

    def cycle_spec(self) -> str:
        """Speculative decoding for the next run: off, auto, 1, 2, 3 drafts per round."""
        i = SPEC_MODES.index(self.spec) if self.spec in SPEC_MODES else -1
        self.spec = SPEC_MODES[(i + 1) % len(SPEC_MODES)]
        what = {"off": "off", "auto": "auto (drafts where they pay)"}.get(self.spec, f"{self.spec} drafts per round")
        return self._note(f"speculation {what}{' (next run)' if self.live else ''}")

    def adjust_io_threads(self, delta: int) -> str:
        n = max(1, min(MAX_IO_THREADS, self.effective_io_threads() + delta))
        self.io_threads = n
        return self._note(self._apply_live(f"I/O threads {n}", io_threads=n))

    def adjust_kernel_threads(self, delta: int) -> str:
        cap = max(1, os.cpu_count() or 1)
        n = max(1, min(cap, self.effective_kernel_threads() + delta))
        self.kernel_threads = n
        return self._note(self._apply_live(f"kernel threads {n}", kernel_threads=n))

    def toggle_backend(self) -> str:
        """SIMD <-> scalar: live at the next token, and for the next run."""
        current = self.run.snapshot().backend if self.live else self.next_backend()
        if current == "scalar":
            target = api.best_backend()
            if target == "scalar":
                raise Ds4fError(f"no SIMD backend on this CPU (available: {', '.join(api.available_backends())})")
        else:
            target = "scalar"
        self.backend = target
        return self._note(self._apply_live(f"kernels {current} → {target}", backend=target))

    def set_gen(self, n: int) -> str:
        if not isinstance(n, int) or not 1 <= n <= api.MAX_GEN:
            raise Ds4fError(f"token count: must be between 1 and {api.MAX_GEN}, got {n!r}")
        self.gen = n
        return self._note(f"token count {n}" + (" (next run)" if self.live else ""))

    def _apply_live(self, text: str, **change) -> str:
        if self.live:
            self.run.switch(**change)
            return f"{text}: at the next token, and for the next run"
        return f"{text} for the next run"

    # -- history --------------------------------------------------------------------------
    def runs(self, limit: int = 200) -> list[RunRecord]:
        return self.history.list_runs(limit) if self.history else []

    def runs_dir_figures(self) -> dict | None:
        """The runs directory and the history against [runs] budget (None: not known)."""
        if self.history is None:
            return None
        try:
            return api.runs_budget_for(api.user_data_dir() / "runs", self.settings.runs_budget, self.history.path,
                                       self.settings.source).figures()
        except (OSError, Ds4fError):
            return None

    def last_two(self) -> tuple[RunRecord, RunRecord] | None:
        done = [r for r in self.runs(50) if r.state == "done" and r.state_path]
        return (done[1], done[0]) if len(done) >= 2 else None

    def simd_scalar_pair(self) -> tuple[RunRecord, RunRecord] | None:
        """The newest scalar run and the newest SIMD run comparable with it (same model, prompt, length)."""
        return simd_scalar_pair(self.runs(200))


def demo_dir() -> Path:
    """Where the console makes the demo model (ensure_demo_model's default)."""
    return api.user_cache_dir() / "demo-ds4f"


def is_demo(model: str) -> bool:
    try:
        return bool(model) and Path(model).resolve() == demo_dir().resolve()
    except OSError:
        return False


def _synthetic(model: str) -> bool:
    """A checkpoint `ds4f synth` made: random weights, like the demo's."""
    try:
        return bool(api.checkpoint_summary(model).get("synthetic")) if model else False
    except Ds4fError:
        return False


def probe_text(model: str, demo: bool = False) -> TextSupport:
    """Whether `model` reads and writes text: its tokenizer and generation defaults (blocking:
    reads tokenizer.json and generation_config.json through the run API's loaders)."""
    demo = demo or is_demo(model) or _synthetic(model)
    try:
        tokenizer = api.find_tokenizer(model) if model and Path(model).is_dir() else None
        if tokenizer is None:
            return TextSupport(False, "needs a tokenizer: the checkpoint has no tokenizer.json",
                               f"{model} has no tokenizer.json, so it cannot read or write text; r still runs "
                               f"it on token ids", demo=demo)
        defaults = api.GenerationDefaults.load(model)
    except Ds4fError as exc:
        return TextSupport(False, "text is off: the checkpoint's tokenizer files cannot be used",
                           f"{exc}; r still runs the checkpoint on token ids", demo=demo)
    return TextSupport(True, defaults=defaults, demo=demo)


def simd_scalar_pair(records: list[RunRecord]) -> tuple[RunRecord, RunRecord] | None:
    done = [r for r in records if r.state == "done" and r.state_path]
    scalars = [r for r in done if r.kind == "scalar"]
    simds = [r for r in done if r.kind == "simd"]
    for s in scalars:                     # newest scalar first
        for v in simds:                   # newest SIMD run comparable with it
            if v.comparable_with(s):
                return (v, s)
    return None


def next_refresh(current: float, step: int) -> float:
    """+ lengthens the refresh period, - shortens it (btop's convention), along REFRESH_STEPS."""
    steps = REFRESH_STEPS
    if step > 0:
        bigger = [s for s in steps if s > current + 1e-9]
        return bigger[0] if bigger else steps[-1]
    smaller = [s for s in steps if s < current - 1e-9]
    return smaller[-1] if smaller else steps[0]
