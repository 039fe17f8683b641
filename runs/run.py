"""The run API: the one boundary the console, the CLI and the server use.

    run = start_run(RunConfig(model=..., preset="laptop", gen=8), history=History(path))
    run.snapshot()        # live figures, cheap, any thread, any time
    run.switch(backend="scalar", kernel_threads=1, io_threads=8)   # lands at the next token
    run.cancel(); run.wait(); run.state; run.error; run.report

A run executes in a background thread. It writes state.bin and report.json as a pair (the
report carries the state's sha256) under temporary names and commits them when complete, the
report first (see ds4f.runs.statedump); a cancelled or failed run leaves no files, and a run
cleans what a killed one left in its place. A write error (no space, no permission) fails the
run with a message naming the file. Runs are active one at a time, or up to N together on an
EngineHost(parallel=N) (runs.active).
"""
from __future__ import annotations

import collections
import secrets
import threading
import time
import traceback
from dataclasses import asdict

import psutil

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import Preset
from ds4f.engine.engine import Engine
from ds4f.engine.generate import Generation
from ds4f.engine.runtime.disk_floor import cached_floor
from ds4f.engine.speculative import SpecController
from ds4f.engine.text.constraint import prepare
from ds4f.errors import Ds4fError
from ds4f.native import kernels
from ds4f.runs.active import active_run, active_runs, admit, forget, sharing  # noqa: F401 (the run API)
from ds4f.runs.config import (RunConfig, check_fits, checked, fitted, kv_of,
                              open_writer, prompt_of, reserve_room, sampler_of, settle)
from ds4f.runs.host import EngineHost
from ds4f.runs.lease import Lease
from ds4f.runs.output import RunOutput
from ds4f.runs.prefix import kept_tokens_for, reuse_prefix
from ds4f.runs.report import fail_run, finish_bytes, finish_run, read_report
from ds4f.runs.snapshot import Snapshot, snapshot_of
from ds4f.runs.speculation import setup_spec
from ds4f.runs.steps import Steps
from ds4f.runs.switches import Switches
from ds4f.runs.statedump import StateWriter
from ds4f.settings import load_settings

MAX_EVENTS = 1000          # a run's event log keeps its last MAX_EVENTS lines (the report counts the rest)
LIVE_STATES = ("starting", "running")          # a run in these states can be switched or cancelled
END_STATES = ("done", "cancelled", "failed")


def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def start_run(config: RunConfig, history=None, engines: EngineHost | None = None, on_token=None) -> "Run":
    """Check the settings, open the checkpoint and start the run's thread; returns at once.

    engines: keep the engine loaded after the run for the next one (see EngineHost).
    on_token: called in the run's thread after each token with its TokenRecord (keep it short)."""
    settings = load_settings(config.config_path, check_dirs=False)   # a [kv] dir gone bad since: RAM only, logged
    cfg = settings.engine
    preset = config.preset if isinstance(config.preset, Preset) else cfg.get_preset(config.preset)
    config = checked(config, settings)
    checkpoint = open_checkpoint(config.model)
    try:
        kept = kept_tokens_for(config, kv_of(config, cfg), checkpoint, engines)
        prompt, tokenizer = prompt_of(config, checkpoint, kept)
        config = fitted(config, prompt, preset)
        check_fits(config, checkpoint, prompt, preset, settings)
        if config.response_format is not None:     # its grammar compiled for the tokenizer now, kept for the run
            prepare(tokenizer, config.response_format)
        if isinstance(config.spec, int) and engines is not None and engines.parallel > 1:
            raise Ds4fError(f"spec: {config.spec} drafts: not while sequences step together (parallel"
                            f" {engines.parallel}); spec auto steps plainly there", param="spec")
    except Ds4fError:
        checkpoint.close()
        raise
    try:
        run = admit(engines, lambda: Run(config, settings, preset, checkpoint, prompt, history, engines, on_token,
                                         tokenizer))
    except Ds4fError:
        checkpoint.close()
        raise
    try:
        reserve_room(run)      # room in the runs directory for its files, or refused now
    except BaseException:
        forget(run)
        checkpoint.close()
        raise
    run._thread.start()
    return run


class Run:
    def __init__(self, config: RunConfig, settings, preset, checkpoint, prompt, history, engines=None,
                 on_token=None, tokenizer=None) -> None:
        self.id = _new_run_id()
        self.engines = engines
        self.on_token = on_token
        self.config = config
        self.preset = preset
        self.checkpoint = checkpoint
        self.prompt = prompt
        self.history = history
        self.n_steps = len(prompt) - 1 + config.gen
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        settle(self, settings)
        self._output = RunOutput(tokenizer, config.stop, self.stop_at_eos, self.eos_id, self._lock)  # its text
        self._steps = Steps(self.n_steps, len(prompt), self._output, self._lock, on_token)   # each token's record
        self._switches = Switches(self)              # the live switches, landing at token boundaries
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._state = "starting"
        self._error: str | None = None
        self._report: dict | None = None
        self._events: collections.deque[str] = collections.deque(maxlen=MAX_EVENTS)
        self._n_events = 0
        self._finish_bytes = finish_bytes(self.n_steps, checkpoint.geometry)
        self._lease = Lease(self)                    # its engine and session (runs.lease)
        self._optimum: float | None = None
        self._replay: dict | None = None             # the replay of the run's last reads (when done)
        self._baseline_rss = psutil.Process().memory_info().rss  # the process before the engine
        self._rss_at_end = 0
        self._floor = None
        self._spec: SpecController | None = None       # speculative decoding, when on (runs.speculation)
        self.history_error: str | None = None         # why the run's record is not in the history (None: it is)
        self._marks: tuple[int, ...] = ()             # prompt positions to keep a state at (prefix cache)
        self._generation: Generation | None = None   # the generation loop (engine.generate), once started
        self._backend = config.backend if config.backend != "auto" else kernels.best_backend()
        self.started_at = time.time()
        self.finished_at: float | None = None
        self._process = psutil.Process()
        self._thread = threading.Thread(target=self._main, name=f"ds4f-run-{self.id}", daemon=True)

    # -- the public surface -------------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def report(self) -> dict | None:
        """The whole report of a done run, its per-token records included (read from report.json,
        so a long run's records are not held in memory); summary_report is the same without them."""
        return read_report(self)

    @property
    def summary_report(self) -> dict | None:
        """The report without its per-token records (cheap: kept in memory)."""
        return self._report

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def prompt_tokens_reused(self) -> int:
        """Of the prompt's tokens, those taken from the prefix cache (not computed)."""
        return self._steps.log.reused_tokens

    @property
    def bytes_read(self) -> int:
        """Disk bytes its tokens read so far (their share of a step shared with other sequences)."""
        with self._lock:
            return self._steps.log.bytes_read

    # the output (runs.output): its text, its token count and ids, why it ended
    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far (the prompt's not counted; an end-of-sentence token counted)."""
        return self._output.generated

    @property
    def generated_ids(self) -> tuple[int, ...]:
        """The ids of the tokens generated so far (an end-of-sentence token included)."""
        return self._output.ids

    @property
    def assistant_message(self) -> dict | None:
        """A chat run's answer as the next turn's assistant message; None for a run not a chat's."""
        return self._output.assistant_message(self.config)

    @property
    def output_text(self) -> str:
        """The text generated so far that is safe to show (the whole output once the run has ended)."""
        return self._output.text

    @property
    def finish_reason(self) -> str | None:
        """Why generation ended: "length" (the token limit), "eos" (the end-of-sentence token),
        "stop" (a stop string); None while running, or when cancelled or failed."""
        return self._output.finish_reason

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output (finish reason "stop"), else None."""
        return self._output.stop_string

    def switch(self, backend: str | None = None, kernel_threads: int | None = None,
               io_threads: int | None = None, engine_wide: bool = False) -> None:
        """Change settings; they take effect at the next token boundary (runs.switches: what a
        switch does among sequences stepping together, engine_wide)."""
        self._switches.ask(backend, kernel_threads, io_threads, engine_wide)

    def sharing_with(self) -> list[str]:
        """The ids of the other runs stepping on this run's engine (EngineHost(parallel=N)), or
        starting to; [] when it steps alone."""
        return sharing(self)

    @property
    def tokens_done(self) -> int:
        """Steps computed so far: a snapshot's tokens_done without the rest of it, for a loop that
        polls often and wants a snapshot only when a token has landed."""
        return self._steps.log.count

    def snapshot(self) -> Snapshot:
        """The run's live figures: cheap, from any thread, at any time (runs.snapshot.snapshot_of)."""
        return snapshot_of(self)

    # -- the run's thread ---------------------------------------------------------------------
    def _log(self, message: str) -> None:
        with self._lock:
            self._events.append(f"{time.strftime('%H:%M:%S')} {message}")
            self._n_events += 1

    def _apply_switches(self, eng: Engine, step: int) -> None:
        """Before each step: the switches asked for since the last (runs.switches)."""
        self._switches.apply(eng, step)

    def _main(self) -> None:
        writer = None
        try:
            self._log(f"run {self.id}: {self.config.model}, preset {self.preset.describe()}, {self.n_steps} tokens")
            writer = open_writer(self)
            eng, session = self._lease.take()
            if self.probe and not self._cancel.is_set():
                self._floor = cached_floor(self.checkpoint, self.io_threads)
                self._log(f"NVMe floor {self._floor.gbps:.2f} GB/s ({self._floor.io_mode}, queue depth {self.io_threads})")
            with self._lock:
                self._state = "running"
            setup_spec(self, eng, session)
            start, self._marks = reuse_prefix(self, eng, session, writer)
            if self.engines is not None and self.engines.parallel > 1:   # from here it steps with the others
                session.join(eng.batcher)
                self._log(f"batch: steps shared with up to {eng.batcher.parallel - 1} other sequences;"
                          f" {eng.batcher.members - 1} step now")
            self._generate(eng, session, writer, start)
            if self._cancel.is_set():
                writer.abort()
                writer = None
                finish_run(self, "cancelled")
                self._log(f"cancelled after {self._steps.log.count} tokens; no files written")
                return
            sha = writer.close()
            finish_run(self, "done", sha=sha, writer=writer)
            writer = None
        except Ds4fError as exc:
            fail_run(self, str(exc), writer)
        except Exception as exc:  # never a silently dead thread: the error is the run's
            self._log(traceback.format_exc(limit=8).rstrip())
            fail_run(self, f"internal error: {type(exc).__name__}: {exc}", writer)
        finally:
            self._release()

    def _generate(self, eng: Engine, session, writer: StateWriter, start: int = 0) -> None:
        """The generation loop (engine.generate) from `start`, each row it computes recorded
        (runs.steps): until the token count, the end of the output, or a cancel. With the prefix
        cache, the last prompt token goes alone, and a state is kept at each of the run's marks."""
        self._generation = Generation(
            session, self.prompt, self.n_steps, emit=lambda *row: self._steps.emit(eng, session, writer, *row),
            stopped=lambda: self._output.finish_reason is not None or self._cancel.is_set(),
            cancelled=self._cancel.is_set, sampler=sampler_of(self), spec=self._spec,
            marks=self._marks, hold_last=self._kv is not None, before_step=lambda step: self._apply_switches(eng, step),
            counted=self._steps.count)
        self._generation.run(start)

    def _release(self) -> None:
        """The run's end, whatever it was: the engine released (runs.lease), and the process free
        for the next run."""
        self._lease.release()
        self._done.set()
        forget(self)

    def config_dict(self) -> dict:
        d = asdict(self.config)
        d.update(preset=self.preset.name, prompt=list(self.prompt), preset_detail=self.preset.describe(),
                 io_threads=self.io_threads, kernel_threads=self.kernel_threads, backend_requested=self.config.backend)
        return d
