"""What the endpoints act on: the model, one loaded engine, its queue, the runs, the history.

Runs start through ds4f.api.start_run with one EngineHost, so a run after the first reuses the
loaded engine (pinned trunk, routers, cache slots, I/O threads). One run at a time: a request
takes a Ticket in the EngineQueue and starts its run once the ticket holds the engine; a
watcher gives the engine to the next ticket when the run has ended, and counts the run's end
for /metrics. Finished runs older than the current one are served from the history database,
which the console and `ds4f run` share.

The operator's actions (ds4f.server.operator) change the server's defaults for the runs to
come (backend, threads, preset) and switch the live runs at their next step, cancel a run, or
drain the server (finish what runs and waits, take nothing new). What happens is told to the
watchers of GET /events (ds4f.server.events): the log, snapshots of the status with every live
sequence's figures, and the last hour's latency.

In every answer `gen` is the number of tokens a run generates at most (as requested) and
`steps` its decode steps: the prompt's tokens after the first plus `gen`. Polling answers use a
run's summary report, kept in memory; only GET /runs/{id}/report reads the whole report, per-
token records included, from its file.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os

import psutil
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from ds4f import __version__
from ds4f.api import (kv_directory_usage, DEFAULT_PARALLEL, LIVE_STATES, MAX_GEN, MAX_PARALLEL, RECORDS_OF_DUMP, fit_parallel,
                      format_bytes, memory_plan,
                      open_checkpoint, MAX_THREADS, Ds4fError, EngineHost, GenerationDefaults,
                      History, RunConfig, active_run, available_backends, best_backend, checkpoint_summary, ensure_demo_model,
                      load_settings, report_file, runs_budget_for, user_data_dir)
from ds4f.api import start_run as api_start_run
from ds4f.api import parse_spec

from .errors import HttpError, bad
from .events import (EVENTS_VERSION, EventHub, Timing, client_label, endpoint_of, kept_state_refusal, log_line,
                     sequences as sequence_views)
from .feed import RunFeed
from .metrics import Metrics
from .operator import OperatorAuth
from .options import ServerOptions, check_token
from .queue import EngineQueue, QueueFull, Ticket

WATCH_S = 0.02        # how often a watcher looks whether its run has ended
EVICTIONS_EVERY_S = 1.0   # and how often it reads the run's snapshot for the evictions (and kept-state refusals)
DEFAULTED = ("preset", "backend", "kernel_threads", "io_threads")   # a run's settings the server's defaults give
SWITCHABLE = ("backend", "kernel_threads", "io_threads")            # of them, those a live run can switch


def resolve_model(explicit: str | None, cfg) -> str:
    """--model, else ds4f.toml's [model] path, else the demo model (made on first use)."""
    if explicit:
        return str(Path(explicit).expanduser())
    if cfg.model_path:
        return cfg.model_path
    return str(ensure_demo_model())


def snapshot_view(snap, gen: int) -> dict:
    """The live figures without the per-token list (its last few records are kept); `gen` is the
    tokens the run generates at most and `steps` its decode steps."""
    d = asdict(snap)
    d["gen"] = gen
    tokens = d.pop("tokens")
    d["recent_tokens"] = tokens[-8:]
    d["events"] = list(d["events"])[-20:]
    return d


def record_steps(config: dict) -> int | None:
    """The decode steps of a run as the history records its config: len(prompt) - 1 + gen."""
    gen, prompt = config.get("gen"), config.get("prompt")
    if isinstance(gen, bool) or not isinstance(gen, int) or not isinstance(prompt, list) or not prompt:
        return None
    return len(prompt) - 1 + gen


class RecordingHistory:
    """The History runs are given: a record that cannot be written (a full disk, a read-only
    file, a directory gone) is logged on stderr and kept by run id, then raised to the run,
    which logs it in its events and ends done or failed all the same."""

    KEEP = 32   # failures remembered, the latest

    def __init__(self, history: History):
        self.history = history
        self.failures: dict[str, str] = {}
        self.last_failure: str | None = None

    def record(self, *args, **kwargs):
        try:
            return self.history.record(*args, **kwargs)
        except Exception as exc:
            run_id = str(kwargs.get("run_id", args[0] if args else "?"))
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            self.failures[run_id] = message
            while len(self.failures) > self.KEEP:
                self.failures.pop(next(iter(self.failures)))
            self.last_failure = message
            sys.stderr.write(f"ds4f serve: run {run_id} ended {kwargs.get('state', '?')} but is not in the run "
                             f"history {self.history.path}: {message}\n")
            raise

    def __getattr__(self, name):
        return getattr(self.history, name)


class Service:
    """The model, the engine host and its queue, the current and recent runs, the history, the
    metrics.

    start_run: ds4f.api.start_run, or a stand-in with its signature (tests).
    """

    def __init__(self, options: ServerOptions, start_run=None):
        self.options = options
        self.settings = load_settings(options.config_path)
        self.cfg = self.settings.engine       # ds4f.toml's engine settings: presets, threads, backend, [kv]
        if options.reuse_prefix:
            self.cfg.kv_directory(options.kv_dir)  # a --kv-dir that is a file refused at start
        self.preset = self.cfg.get_preset(options.preset).name
        self.model = resolve_model(options.model, self.cfg)
        summary = checkpoint_summary(self.model)
        self.geometry = summary["geometry"]
        self.checkpoint_kind = summary["kind"]
        self.io_mode = summary["io_mode"]
        folder = Path(self.model).resolve().name or "ds4f"
        # the names requests may give as `model`; the first is the one listed and reported
        self.model_names = options.served_model_names or self.settings.server.served_model_names or (folder,)
        self.model_id = self.model_names[0]
        self._model_names = {*self.model_names, folder}
        self.generation_defaults = GenerationDefaults.load(self.model)   # sampling a request leaves out
        self.history = History(self.settings.history_path)
        self.run_history = RecordingHistory(self.history)   # what runs record themselves in
        self.backends = list(available_backends())
        self.best_backend = best_backend()
        self.parallel = self._parallel()       # sequences decoded together on the engine
        self.engines = EngineHost(self.parallel)   # one loaded engine, kept between runs; closed by close()
        self._start_run = start_run or api_start_run
        self.queue = EngineQueue(options.queue_size, options.queue_share, slots=self.parallel)
        self.queue.on_gone = self._left_queue
        self.queue.on_free = self._engine_freed
        self.metrics = Metrics(self._live_gauges)
        # the defaults of the runs to come (the operator changes them): backend, kernel and I/O threads
        # (None: the preset's), and a preset waiting for the engine to be idle
        self.backend = self.cfg.backend
        self.kernel_threads: int | None = None
        self.io_threads: int | None = None
        self.pending_preset: str | None = None
        self._defaults_lock = threading.Lock()
        self._defaults_version = 0
        self.draining = False
        self._drained_said = False
        self._cancelled_by: dict[str, str] = {}    # run id -> who cancelled it (an operator, DELETE)
        token, server = options.operator_token, self.settings.server
        if token is None and server.operator_token:
            token = check_token(server.operator_token, f"{self.settings.source}: server.operator_token")
        remote = options.operator_remote if options.operator_remote is not None else server.operator_remote
        self.operator = OperatorAuth(token, remote, options.operator_token_dir)
        self.events = EventHub(self._events_snapshot, self._hello, options.watcher_queue, options.max_watchers)
        self.loop: asyncio.AbstractEventLoop | None = None   # the server's, from its startup
        self._lock = threading.Lock()          # guards starting a run, _current and _closing
        self._hashes_lock = threading.Lock()
        self._dump_hashes: dict[tuple, str] = {}   # state dumps hashed: (dev, inode, size, mtime, ctime) -> sha256
        self._watchers: set[asyncio.Task] = set()
        # The live runs and the one started last stay in memory; older runs are served from the history.
        self._current = None
        self._live: dict[str, object] = {}
        self._closing = False
        self.started_at = time.time()
        self.runs_started = 0
        self._last_report = self._last_report_from_history()

    def _parallel(self) -> int:
        """--parallel, else [server] parallel, else as many as the memory plan fits (at most
        DEFAULT_PARALLEL); a number beyond what the plan fits is refused with the figures."""
        asked = self.options.parallel or self.settings.server.parallel
        preset = self.cfg.get_preset(self.preset)
        ram = int(psutil.virtual_memory().total)
        prefix_ram = self.cfg.kv.ram_bytes if self.cfg.kv is not None else 0
        with open_checkpoint(self.model) as ck:
            g = ck.geometry
            mtp, mtp_problem = bool(ck.mtp_layers), ck.mtp_problem
        self._geometry = g
        spec = parse_spec(self.options.spec)
        self.parallel_why = ""     # why the parallel is what it is, when the operator did not say it
        if isinstance(spec, int):  # a fixed number of drafts: one sequence's; checked now, not on every request
            if not mtp:
                raise Ds4fError(f"--spec {spec}: {mtp_problem or f'{self.model} has no MTP layer (mtp.0.*) to draft with'}"
                                f"; every request would be refused (--spec auto runs plainly where there is none)",
                                param="spec")
            if asked and asked > 1:
                where = "--parallel" if self.options.parallel else f"{self.cfg.source}: server.parallel"
                raise Ds4fError(f"--spec {spec} with {where} {asked}: a fixed number of drafts speculates for one "
                                f"sequence at a time, not for sequences stepping together; give --parallel 1, or "
                                f"--spec auto (it steps plainly while sequences step together)", param="spec")
            if not asked:
                self.parallel_why = f"--spec {spec} drafts for one sequence at a time"
                return 1
        if not asked:
            return fit_parallel(g, preset, ram, prefix_ram, DEFAULT_PARALLEL, self._records)
        if asked > 1:
            plan = memory_plan(g, preset, ram, prefix_ram, asked, records=self._records)
            if not plan.fits:
                where = "--parallel" if self.options.parallel else f"{self.cfg.source}: server.parallel"
                raise Ds4fError(f"{where} {asked}: {asked} sequences plan {format_bytes(plan.total_bytes)} with preset"
                                f" {preset.name} (their KV caches {format_bytes(plan.kv_bytes)}, each sequence"
                                f" {format_bytes(plan.sequence_bytes)}), more than the {format_bytes(ram)} of RAM"
                                f" less 2 GiB for the OS; at most {max(1, min(plan.sequences_fit, MAX_PARALLEL))} fit"
                                f" (`ds4f plan --parallel N` shows the plan)", param="parallel")
        return asked

    def _last_report_from_history(self) -> dict | None:
        try:
            for rec in self.history.list_runs(limit=50):
                if rec.state == "done" and rec.report:
                    return {"run_id": rec.run_id, "finished_at": rec.finished_at, "summary": rec.summary,
                            "state_sha256": rec.state_sha256, "source": "history"}
        except Ds4fError:
            pass
        return None

    def serves(self, name) -> bool:
        """Whether a request's `model` names the model served: one of its names, or its checkpoint
        directory's."""
        return isinstance(name, str) and name in self._model_names

    @property
    def context(self) -> int:
        """The positions a request's prompt and answer share: the preset's context."""
        return self.cfg.get_preset(self.preset).context

    @property
    def _records(self) -> str:
        """What a request's prompt chunks keep per layer, by the requests' state dump (model.records):
        what the memory plans of several sequences count."""
        return RECORDS_OF_DUMP[self.options.dump or self.settings.dump.server]

    # -- the engine and its queue -----------------------------------------------------------------
    @property
    def current_run(self):
        """The run started last (live or finished), or None."""
        return self._current

    @property
    def busy(self) -> bool:
        return self.queue.holder is not None

    @property
    def closing(self) -> bool:
        return self._closing

    def join(self, ticket: Ticket) -> None:
        """Into the queue (the engine at once if it is free); 429 with Retry-After when full, 503
        while draining or shutting down."""
        if self._closing:
            raise HttpError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if self.draining:
            raise self._draining_refusal()
        try:
            self.queue.join(ticket)
        except QueueFull as exc:
            raise self._refusal(exc.message, exc.code) from None
        self._track(ticket)

    def take_now(self, ticket: Ticket) -> None:
        """The engine at once, or 429 (POST /runs does not wait in line); 503 while draining."""
        if self._closing:
            raise HttpError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if self.draining:
            raise self._draining_refusal()
        if not self.queue.take_now(ticket):
            waiting = len(self.queue.waiting)
            held = [t.run_id for t in self.queue.holders if t.run_id]
            who = (f"run {held[0]} holds the engine" if len(held) == 1 else
                   f"runs {', '.join(held)} hold the engine" if held else "the engine is taken")
            limit = "one run at a time" if self.parallel == 1 else f"{self.parallel} runs at a time"
            raise self._refusal("busy: " + who + (f" and {waiting} requests wait for it" if waiting else "")
                                + f"; {limit}" + (f" (a change to preset {self.pending_preset} waits for the"
                                                  f" engine to be idle)" if self.pending_preset else ""), "busy")
        self._track(ticket)

    def _track(self, ticket: Ticket) -> None:
        """A request the queue took: its times from now, and the log's word on it when it waits."""
        if ticket.timing is None:
            ticket.timing = Timing(ticket.joined_at)
        pos = self.queue.position(ticket)
        if pos:
            self.events.log("queued", f"{endpoint_of(ticket)} request from {client_label(ticket)} waits for the "
                                      f"engine, position {pos} of {len(self.queue.waiting)}")

    def _left_queue(self, ticket: Ticket) -> None:
        self.events.log("cancelled", f"{endpoint_of(ticket)} request from {client_label(ticket)} left the queue "
                                     f"before its turn (its client went away)")
        self._check_drained()

    def _draining_refusal(self) -> HttpError:
        live = [r for r in self._live.values() if not r.finished]
        etas = [r.snapshot().eta_s for r in live]
        retry = max([5] + [min(3600, math.ceil(e)) for e in etas if e])
        return HttpError(503, f"the server is draining: it finishes the {len(live)} running and "
                              f"{len(self.queue.waiting)} waiting requests and takes no new ones until an operator"
                              f" resumes it; try again later", code="draining", headers={"Retry-After": str(retry)},
                         extra={"retry_after_s": retry})

    def _refusal(self, message: str, code: str) -> HttpError:
        """429 for a request the engine cannot take now: Retry-After is the active run's ETA."""
        if code == "shutting_down":
            return HttpError(503, "the server is shutting down", code=code, headers={"Retry-After": "5"})
        self.metrics.rejections.labels(code if code in ("queue_full", "client_share") else "busy").inc()
        run = active_run()
        extra, retry = {}, 1
        if run is not None:
            snap = run.snapshot()
            retry = max(1, min(3600, math.ceil(snap.eta_s))) if snap.eta_s else 1
            message += f" (run {run.id} is {snap.state}, step {snap.tokens_done} of {snap.steps})"
            extra = {"run_id": run.id}
        return HttpError(429, message, code=code, headers={"Retry-After": str(retry)},
                         extra={**extra, "retry_after_s": retry})

    async def start(self, config: RunConfig, ticket: Ticket, defaults: tuple[str, ...] = ()) -> tuple[object, RunFeed]:
        """Start the ticket's run (the ticket holds the engine). Shielded: once started, the run
        is watched and the engine handed on when it ends, even if the request is cancelled
        meanwhile (ticket.abandon() then cancels the run). Errors release the engine: the run
        API's Ds4fError (the caller names the parameter), 503 while shutting down.
        defaults: the config's settings (of DEFAULTED) to take from the server's defaults as they
        are when the run starts."""
        ticket.starting = True
        return await asyncio.shield(self._start(config, ticket, defaults))

    async def _start(self, config: RunConfig, ticket: Ticket, defaults: tuple[str, ...] = ()):
        if ticket.timing is None:
            ticket.timing = Timing(ticket.joined_at)
        ticket.timing.granted = ticket.granted_at or time.monotonic()
        feed = RunFeed(asyncio.get_running_loop(), self.metrics, observe=self._observer(ticket))
        try:
            if ticket.abandoned:   # the client left before its turn came
                raise HttpError(503, "the client left", code="client_left")
            run = await run_in_threadpool(self._start_locked, config, feed.on_token, defaults)
        except BaseException:
            self.queue.leave(ticket)
            raise
        finally:
            ticket.starting = False
        ticket.run_id = run.id
        ticket.run = run
        if ticket.max_tokens is None:
            ticket.max_tokens = run.config.gen
        self.events.log("request", f"{endpoint_of(ticket)} request from {client_label(ticket)}: run {run.id} "
                                   f"started, {len(run.prompt)} prompt tokens, at most {run.config.gen} to generate"
                                   f" (preset {run.preset.name})", run_id=run.id)
        feed.attach(run)
        task = asyncio.create_task(self._watch(run, ticket, feed))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        if ticket.abandoned:
            run.cancel()
        return run, feed

    def abandon(self, ticket: Ticket) -> None:
        """The request is over or its client gone: a run it started is cancelled if still going
        (the watcher then hands the engine on), a place in the queue is given up."""
        ticket.abandon()
        if ticket.run is None and not ticket.starting:
            self.queue.leave(ticket)

    def abandon_factory(self, ticket: Ticket):
        return lambda: self.abandon(ticket)

    def _observer(self, ticket: Ticket):
        """What the run's feed tells of each token record: the request's times, the latency ring."""
        timing, latency = ticket.timing, self.events.latency

        def observe(record, generated: bool, t: float) -> None:
            gap = timing.record(generated, t)
            if gap is not None:
                latency.gap(t, gap)
        return observe

    def _defaulted(self, config: RunConfig, defaults: tuple[str, ...]) -> RunConfig:
        """`config` with the settings named in `defaults` taken from the server's defaults now."""
        if not defaults:
            return config
        now = {"preset": self.preset, "backend": self.backend, "kernel_threads": self.kernel_threads,
               "io_threads": self.io_threads}
        return replace(config, **{k: now[k] for k in defaults})

    def _start_locked(self, config: RunConfig, on_token, defaults: tuple[str, ...] = ()):
        with self._lock:
            if self._closing:
                raise HttpError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
            with self._defaults_lock:
                version = self._defaults_version
                config = self._defaulted(config, defaults)
            try:
                run = self._start_run(config, history=self.run_history, engines=self.engines, on_token=on_token)
            except Ds4fError as exc:
                if exc.kind == "busy":   # a run this server did not start
                    raise self._refusal(f"busy: {exc.message}", "busy") from None
                raise
            with self._defaults_lock:
                self._current = run
                self._live[run.id] = run
                if version != self._defaults_version:   # an operator switched while it started
                    now = self._defaulted(config, defaults)
                    switch = {k: getattr(now, k) for k in SWITCHABLE if k in defaults
                              and getattr(now, k) is not None and getattr(now, k) != getattr(config, k)}
                    if switch:
                        run.switch(**switch)
            self.runs_started += 1
            return run

    async def _watch(self, run, ticket: Ticket, feed: RunFeed) -> None:
        """Until the run ends: its evictions for /metrics; then its end, and the engine to the next."""
        loop = asyncio.get_running_loop()
        counted = 0
        seen: set[str] = set()
        next_look = loop.time() + EVICTIONS_EVERY_S
        try:
            while not run.finished:
                await asyncio.sleep(WATCH_S)
                if loop.time() >= next_look:
                    snap = run.snapshot()
                    counted = self._count_evictions(snap, counted)
                    self._kept_state_refusals(run, snap, seen)
                    next_look = loop.time() + EVICTIONS_EVERY_S
            await asyncio.sleep(0)   # the last token's record, handed over just before the run ended
            snap = run.snapshot()
            self._count_evictions(snap, counted)
            self._kept_state_refusals(run, snap, seen)
            self.metrics.run_ended(snap.state, snap.prefetch, snap.prompt_tokens_reused)
            self._run_ended(run, ticket, snap)
        finally:
            self._live.pop(run.id, None)
            self._cancelled_by.pop(run.id, None)
            self.queue.leave(ticket)
            feed.close()

    def _kept_state_refusals(self, run, snap, seen: set) -> None:
        """The prefix cache's refusals of kept-state files, from the run's events, to the log."""
        for line in snap.events:
            message = log_line(line)
            if line not in seen and kept_state_refusal(message):
                seen.add(line)
                self.events.log("kept_state", message, run_id=run.id)

    def _run_ended(self, run, ticket: Ticket, snap) -> None:
        """A run's end: its request's latency, and the log's word on it."""
        timing = ticket.timing
        if timing is not None:
            self.events.latency.request(time.monotonic(), timing)
        what = f"{endpoint_of(ticket)} request from {client_label(ticket)}: run {run.id} {snap.state}"
        ttft = timing.ttft if timing is not None else None
        figures = (f"{snap.generated_tokens} tokens generated" + (f" ({snap.finish_reason})" if snap.finish_reason
                                                                   else "")
                   + f" in {snap.elapsed_s:.2f} s" + (f", first token after {ttft:.3f} s" if ttft is not None else ""))
        if snap.state == "cancelled":
            who = self._cancelled_by.get(run.id)
            why = (f"cancelled by {who}" if who else "its client went away" if ticket.abandoned else
                   "the server is shutting down" if self._closing else "cancelled")
            self.events.log("cancelled", f"{what} ({why}): {figures}", run_id=run.id)
        elif snap.state == "failed":
            self.events.log("failed", f"{what}: {snap.error}", run_id=run.id)
        else:
            self.events.log(snap.state, f"{what}: {figures}", run_id=run.id)

    def _engine_freed(self) -> None:
        """A slot of the engine was given up: a preset change waiting for the engine to be idle
        lands once none is held; a drain may be complete."""
        if self.pending_preset is not None and not self.queue.holders:
            name, self.pending_preset = self.pending_preset, None
            old, self.preset = self.preset, name
            self.queue.release()
            self.events.log("preset", f"preset {name} in effect (was {old}): the engine was idle; the next run "
                                      f"loads it with {name}")
        self._check_drained()

    def _check_drained(self) -> None:
        if self.draining and not self._drained_said and not self.queue.holders and not self.queue.waiting:
            self._drained_said = True
            self.events.log("drain", "drained: no run is live and no request waits; new requests are refused "
                                     "until an operator resumes")

    def _count_evictions(self, snap, counted: int) -> int:
        total = sum(snap.layer_evictions)
        if total > counted:
            self.metrics.evictions.inc(total - counted)
        return max(total, counted)

    def _live_gauges(self) -> dict:
        run = self._current
        return {"busy": self.busy, "queue_waiting": len(self.queue.waiting), "queue_capacity": self.queue.capacity,
                "snapshot": run.snapshot() if run is not None else None,
                "prefix_cache": self.engines.prefix_cache_stats(), "batch": self.batch_view()}

    def batch_view(self) -> dict:
        """The sequences decoded together: how many now, what the steps hold, the cap and why,
        the aggregate rate (the engine's batcher's figures; before the engine loads, the settings)."""
        f = self.engines.batch_figures()
        live = [r for r in self._live.values() if not r.finished]
        view = {"parallel": self.parallel, "active": len(live), "cap": self.parallel, "cap_reason": "",
                "steps": 0, "shared_steps": 0, "rows": 0, "rows_per_step": None, "sequences_per_step": None,
                "union_experts_per_layer": None, "tokens_per_s": None, "step_s_by_sequences": {}}
        if f is not None:
            view.update(cap=f.cap, cap_reason=f.cap_reason, steps=f.steps, shared_steps=f.shared_steps,
                        rows=f.rows_total, rows_per_step=f.last_rows or None,
                        sequences_per_step=f.last_sequences or None,
                        union_experts_per_layer=f.union_per_layer or None, tokens_per_s=f.tokens_per_s,
                        step_s_by_sequences={str(k): v for k, v in f.step_s_by_sequences.items()})
        snaps = [(r, r.snapshot()) for r in live]     # one snapshot each: they are not free
        view["sequences"] = [{"run_id": r.id, "tokens_done": snap.tokens_done, "generated_tokens": snap.generated_tokens,
                              "s_per_token": snap.s_per_token} for r, snap in snaps]
        return view

    # -- runs --------------------------------------------------------------------------------------
    def _find(self, run_id: str):
        run = self._live.get(run_id) or self._current
        return run if run is not None and run.id == run_id else None

    def run_view(self, run) -> dict:
        """A run of this server: its live figures and, once done, its summary report."""
        snap = run.snapshot()
        report = run.summary_report if snap.state == "done" else None
        if report is not None:
            self._note_report(run.id, report)
        return {"id": run.id, "state": snap.state, "error": snap.error, "source": "server",
                "gen": run.config.gen, "steps": snap.steps, "finish_reason": snap.finish_reason,
                "prompt_tokens": snap.prompt_tokens, "generated_tokens": snap.generated_tokens,
                "tokens_done": snap.tokens_done,
                "config": run.config_dict(), "live": snapshot_view(snap, run.config.gen),
                "state_sha256": (report or {}).get("state_sha256"), "report": report,
                "history_error": self.run_history.failures.get(run.id),
                "started_at": run.started_at, "finished_at": run.finished_at,
                "links": self._links(run.id, snap.state)}

    @staticmethod
    def _links(run_id: str, state: str) -> dict:
        links = {"self": f"/runs/{run_id}"}
        if state == "done":
            links["report"] = f"/runs/{run_id}/report"
            links["state"] = f"/runs/{run_id}/state"
        return links

    def _history_get(self, run_id: str):
        """The history's record of a run (None: none); 503 if the history cannot be read."""
        try:
            return self.history.get(run_id)
        except Ds4fError as exc:
            raise HttpError(503, f"the run history cannot be read: {exc.message}", code="history_unavailable",
                            headers={"Retry-After": "5"}) from None

    def _note_report(self, run_id: str, report: dict) -> None:
        last = self._last_report
        if last is None or last.get("run_id") != run_id:
            finished = report.get("finished_at") or 0
            if last is None or last.get("source") == "history" or finished >= (last.get("finished_at") or 0):
                self._last_report = {"run_id": run_id, "finished_at": finished, "summary": report.get("summary"),
                                     "state_sha256": report.get("state_sha256"), "source": "server"}

    def get(self, run_id: str) -> dict:
        run = self._find(run_id)
        if run is not None:
            return self.run_view(run)
        rec = self._history_get(run_id)
        if rec is None:
            raise HttpError(404, f"no run {run_id!r}", code="not_found")
        return {"id": rec.run_id, "state": rec.state, "error": rec.error, "source": "history",
                "gen": rec.gen, "steps": record_steps(rec.config), "finish_reason": rec.config.get("finish_reason"),
                "generated_tokens": rec.config.get("generated_tokens"), "tokens_done": rec.tokens_done,
                "config": rec.config, "live": None, "state_sha256": rec.state_sha256, "report": rec.report,
                "started_at": rec.started_at, "finished_at": rec.finished_at,
                "links": self._links(rec.run_id, rec.state)}

    def live_run(self, run_id: str):
        """This server's run `run_id` while it can still be switched or cancelled; 404 / 409 else."""
        run = self._find(run_id)
        if run is None:
            rec = self._history_get(run_id)
            if rec is None:
                raise HttpError(404, f"no run {run_id!r}", code="not_found")
            raise HttpError(409, f"run {run_id} already ended ({rec.state})", code="run_ended",
                            extra={"state": rec.state})
        if run.finished or run.state not in LIVE_STATES:
            raise HttpError(409, f"run {run_id} already ended ({run.state})", code="run_ended",
                            extra={"state": run.state})
        return run

    def cancel(self, run_id: str) -> tuple[int, dict]:
        run = self.live_run(run_id)
        self._cancelled_by.setdefault(run.id, f"DELETE /runs/{run.id}")
        run.cancel()
        stopped = run.wait(self.options.cancel_wait_s)
        return (200 if stopped else 202), self.run_view(run)

    # -- the operator's actions (ds4f.server.operator checks who and the parameters) ---------------
    def live_runs(self) -> list:
        return [r for r in list(self._live.values()) if not r.finished]

    def switch_all(self, who: str, **settings) -> tuple[dict, str]:
        """Backend and threads (SWITCHABLE, checked): the default of the runs to come, and every
        live run's at its next step (a switch not yet landed is replaced). In the event loop."""
        with self._defaults_lock:
            for name, value in settings.items():
                setattr(self, name, value)
            self._defaults_version += 1
            runs = self.live_runs()
            for run in runs:
                run.switch(**settings, engine_wide=True)
        said = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in settings.items())
        lands = "next step" if runs else "now"
        self.events.log("operator", f"{said}: " + (f"{len(runs)} live run{'s' if len(runs) != 1 else ''} switch"
                                                   f"{'es' if len(runs) == 1 else ''} at the next step"
                                                   f" ({', '.join(r.id for r in runs)}); " if runs else "")
                        + "the runs to come start with it", who=who)
        return {**settings, "runs": [r.id for r in runs]}, lands

    def change_preset(self, name: str, who: str) -> tuple[dict, str]:
        """The preset of the requests to come; now when no run holds the engine, else once none
        does (the queue grants no slot meanwhile, so the moment comes). In the event loop."""
        if name not in self.cfg.presets:
            raise bad("preset", f"no preset named {name!r} (have: {', '.join(self.cfg.presets)})")
        preset = self.cfg.get_preset(name)
        if self.parallel > 1:
            prefix_ram = self.cfg.kv.ram_bytes if self.cfg.kv is not None else 0
            plan = memory_plan(self._geometry, preset, int(psutil.virtual_memory().total), prefix_ram, self.parallel,
                               records=self._records)
            if not plan.fits:
                raise bad("preset", f"{self.parallel} sequences plan {format_bytes(plan.total_bytes)} with preset "
                                    f"{name}, more than this machine's RAM less 2 GiB for the OS; at most "
                                    f"{max(1, plan.sequences_fit)} fit")
        was = self.pending_preset or self.preset
        if self.queue.holders and name != self.preset:
            self.pending_preset = name
            self.queue.hold()
            lands = "next idle"
            said = (f"preset {name} for the requests to come, once no run is live ({len(self.queue.holders)} "
                    f"hold the engine; new requests wait meanwhile)")
        else:
            self.pending_preset = None
            self.preset = name
            if self.queue.held:
                self.queue.release()
            lands = "now"
            said = f"preset {name} for the requests to come" + ("" if name != was else " (unchanged)")
        self.events.log("operator", said + (f" (was {was})" if name != was else ""), who=who)
        return {"preset": name, "was": was, "engine": "loads with the next run" if name != was else "kept"}, lands

    def operator_cancel(self, run_id: str, who: str) -> tuple[dict, str]:
        """Cancel a live run; its client gets the error a cancelled run gives. Waits a little for
        it to stop (not from the event loop)."""
        run = self.live_run(run_id)
        self._cancelled_by[run.id] = who
        self.events.log("operator", f"cancel run {run.id}", run_id=run.id, who=who)
        run.cancel()
        stopped = run.wait(self.options.cancel_wait_s)
        return {"run_id": run.id, "state": run.state}, "now" if stopped else "next step"

    def drain(self, who: str) -> tuple[dict, str]:
        """Take no new generation requests (503); what runs and waits finishes."""
        self.draining = True
        self._drained_said = False
        running, waiting = len(self.queue.holders), len(self.queue.waiting)
        self.events.log("operator", f"drain: {running} running and {waiting} waiting requests finish; new ones are"
                                    f" refused (503) until resume", who=who)
        self._check_drained()
        return {"draining": True, "running": running, "waiting": waiting}, "now"

    def resume(self, who: str) -> tuple[dict, str]:
        was = self.draining
        self.draining = False
        self.events.log("operator", "resume: requests are taken again" if was else "resume: the server was not "
                                    "draining", who=who)
        return {"draining": False, "was_draining": was}, "now"

    # -- GET /events -------------------------------------------------------------------------------
    def _hello(self) -> dict:
        return {"server": "ds4f", "version": __version__, "model": self.model_id,
                "served_model_names": list(self.model_names), "events_version": EVENTS_VERSION}

    def sequences(self) -> list[dict]:
        """Every live sequence: those holding the engine, then those waiting, in order."""
        return sequence_views(list(self.queue.holders) + list(self.queue.waiting), time.monotonic())

    def _events_snapshot(self) -> dict:
        return {**self.status(), "sequences": self.sequences(), "latency": self.events.latency.figures()}

    def full_report(self, run_id: str) -> dict:
        """The whole report of a done run, per-token records included, read from its file."""
        run = self._find(run_id)
        if run is not None:
            if run.state != "done":
                raise HttpError(409, f"run {run_id} is {run.state}: its report exists only once it is done",
                                code="not_done", extra={"state": run.state})
            return run.report
        rec = self._history_get(run_id)
        if rec is None:
            raise HttpError(404, f"no run {run_id!r}", code="not_found")
        if rec.state != "done" or not rec.report:
            raise HttpError(409, f"run {run_id} is {rec.state}: it has no report", code="not_done",
                            extra={"state": rec.state})
        doc, path = None, report_file(rec)
        try:
            if path is not None:
                with open(path, "rb") as f:
                    doc = json.load(f)
        except (OSError, ValueError):
            pass
        if isinstance(doc, dict) and doc.get("run_id") == rec.run_id and doc.get("state_sha256") == rec.state_sha256:
            return doc
        return rec.report   # the file is gone or is another run's: what the history keeps

    def state_file(self, run_id: str) -> tuple[Path, str | None, int | None]:
        """A done run's state dump: its path, the sha256 and (when the report has it) the size
        its run recorded for it."""
        run = self._find(run_id)
        if run is not None:
            state, report = run.state, run.summary_report
        else:
            rec = self._history_get(run_id)
            if rec is None:
                raise HttpError(404, f"no run {run_id!r}", code="not_found")
            state, report = rec.state, rec.report or {}
            if rec.state_path:
                report = {**report, "state_path": rec.state_path, "state_sha256": rec.state_sha256}
        if state == "done" and report and not report.get("state_path"):
            raise HttpError(404, f"run {run_id} wrote no state dump (its dump setting was"
                                 f" {report.get('dump', 'off')!r}: ds4f serve --dump, or [dump] server)",
                            code="no_dump", extra={"state": state})
        if state != "done" or not report or not report.get("state_path"):
            raise HttpError(409, f"run {run_id} is {state}: its state dump exists only once it is done",
                            code="not_done", extra={"state": state})
        path = Path(report["state_path"])
        if not path.is_file():
            raise HttpError(410, f"run {run_id}: the state dump {path} is gone (removed to keep the runs directory"
                                 f" within [runs] budget, by `ds4f history prune`, or by hand); the run's record"
                                 f" stays", code="gone")
        nbytes = report.get("state_nbytes")
        return path, report.get("state_sha256"), nbytes if isinstance(nbytes, int) else None

    def open_state(self, run_id: str):
        """The state dump of a done run, open and checked to be that run's: its bytes hash to
        the sha256 the run recorded. 409 if the file was changed or replaced since."""
        path, sha, nbytes = self.state_file(run_id)
        if not sha:
            raise HttpError(409, f"run {run_id}: no sha256 is recorded for its state dump, so {path} cannot "
                                 f"be checked to be its own; it is not served", code="unverifiable",
                            extra={"state": "done"})
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise HttpError(410, f"run {run_id}: cannot open the state dump {path}: {exc.strerror}",
                            code="gone") from None
        try:
            st = os.fstat(f.fileno())
            if nbytes is not None and st.st_size != nbytes:
                found = f"{st.st_size} bytes, the run's dump has {nbytes}"
            else:
                got = self._sha256_of(f, st)
                found = None if got == sha else f"its sha256 is {got[:16]}…, the run's is {sha[:16]}…"
            if found:
                raise HttpError(409, f"run {run_id}: {path} is not this run's state dump any more ({found}): "
                                     f"it was changed or replaced after the run; not serving it", code="replaced",
                                extra={"state": "done", "state_sha256": sha})
        except BaseException:
            f.close()
            raise
        return f, sha

    def _sha256_of(self, f, st: os.stat_result) -> str:
        """sha256 of an open file from its start, remembered for the same file unchanged (same
        device, inode, size, modification and change times); the file is left at its start."""
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._hashes_lock:
            known = self._dump_hashes.get(key)
        if known is not None:
            return known
        h = hashlib.sha256()
        f.seek(0)
        while chunk := f.read(1 << 20):
            h.update(chunk)
        f.seek(0)
        sha = h.hexdigest()
        after = os.fstat(f.fileno())
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == key[2:]:   # not written while hashed
            with self._hashes_lock:
                self._dump_hashes[key] = sha
                while len(self._dump_hashes) > 64:
                    self._dump_hashes.pop(next(iter(self._dump_hashes)))
        return sha

    def list_runs(self, limit: int) -> tuple[list[dict], str | None]:
        """Recent runs, newest first, and why the history could not be read (None: it could);
        without the history the list holds this server's run alone."""
        seen, out = set(), []
        mine = {**self._live, **({self._current.id: self._current} if self._current is not None else {})}
        for run in mine.values():
            snap = run.snapshot()
            seen.add(run.id)
            out.append({"id": run.id, "state": snap.state, "source": "server", "started_at": run.started_at,
                        "finished_at": run.finished_at, "preset": snap.preset, "gen": run.config.gen,
                        "steps": snap.steps, "tokens_done": snap.tokens_done,
                        "generated_tokens": snap.generated_tokens, "finish_reason": snap.finish_reason,
                        "s_per_token": snap.s_per_token,
                        "state_sha256": (run.summary_report or {}).get("state_sha256")})
        try:
            records, history_error = self.history.list_runs(limit=limit), None
        except Ds4fError as exc:
            records, history_error = [], exc.message
        for rec in records:
            if rec.run_id in seen:
                continue
            out.append({"id": rec.run_id, "state": rec.state, "source": "history", "started_at": rec.started_at,
                        "finished_at": rec.finished_at, "preset": rec.preset, "gen": rec.gen,
                        "steps": record_steps(rec.config), "tokens_done": rec.tokens_done,
                        "generated_tokens": rec.config.get("generated_tokens"),
                        "finish_reason": rec.config.get("finish_reason"),
                        "s_per_token": rec.s_per_token, "state_sha256": rec.state_sha256})
        out.sort(key=lambda r: r["started_at"] or 0, reverse=True)
        return out[:limit], history_error

    # -- status -------------------------------------------------------------------------------------
    def status(self) -> dict:
        run = self._current
        snap = run.snapshot() if run is not None else None
        if run is not None and snap.state == "done" and run.summary_report:
            self._note_report(run.id, run.summary_report)
        preset = self.cfg.get_preset(self.preset)
        return {
            "server": {"version": __version__, "busy": self.busy, "closing": self._closing,
                       "draining": self.draining,
                       "auth": bool(self.options.token), "uptime_s": time.time() - self.started_at,
                       "runs_started": self.runs_started, "config": self.cfg.source,
                       "history": str(self.history.path), "history_error": self.run_history.last_failure},
            "engine": {"state": snap.state if snap is not None and not run.finished else "idle",
                       "current_run": run.id if run is not None else None, "loaded_engines": self.engines.loads},
            "queue": self.queue.view(),
            "batch": self.batch_view(),
            "model": {"id": self.model_id, "names": list(self.model_names), "path": self.model,
                      "kind": self.checkpoint_kind,
                      "io_mode": self.io_mode, "geometry": self.geometry},
            "preset": {"name": preset.name, "detail": preset.describe(), "available": list(self.cfg.presets),
                       "pending": self.pending_preset},
            "backend": {"default": self.backend, "best": self.best_backend, "available": self.backends},
            # the runs to come's threads: the operator's, else the preset's (else ds4f.toml's)
            "threads": {"kernel_threads": self.kernel_threads or self.cfg.effective_kernel_threads(preset),
                        "io_threads": self.io_threads or self.cfg.effective_io_threads(preset)},
            "limits": {"max_gen": MAX_GEN, "context": preset.context, "max_threads": MAX_THREADS,
                       "max_body_bytes": self.options.max_body_bytes, "queue_size": self.options.queue_size,
                       "client_queue_share": self.options.queue_share,
                       "max_client_requests": self.options.max_client_requests,
                       "header_timeout_s": self.options.header_timeout_s,
                       "body_timeout_s": self.options.body_timeout_s},
            "run": snapshot_view(snap, run.config.gen) if snap is not None else None,
            "last_report": self._last_report,
            "dump": self.options.dump or self.settings.dump.server,
            "prefix_cache": self._prefix_cache_view(),
            "runs_dir": self._runs_dir_view(),
            "kv": self._kv_view(),
            "operator": self.operator.view(),
            "events": self.events.view(),
        }

    def _runs_dir_view(self) -> dict | None:
        """The runs directory and the history against [runs] budget: bytes used on disk (counted
        across processes, at most a second old), the budget, and the runs whose files this server
        removed to keep within it; None if it cannot be read."""
        try:
            return runs_budget_for(user_data_dir() / "runs", self.settings.runs_budget, self.history.path,
                                   self.settings.source).figures()
        except (OSError, Ds4fError):
            return None

    def _kv_view(self) -> dict | None:
        """The prefix cache's directory against [kv] budget: the bytes its head and block files hold
        on disk (every process's sharing it, counted at most a few seconds ago) and the budget; None
        with the cache or its disk tier off."""
        kv = self.cfg.kv
        if kv is None or kv.disk_bytes <= 0:
            return None
        where = str(self.options.kv_dir or kv.dir)
        stats = self.engines.prefix_cache_stats()
        used = stats.disk_bytes if stats is not None and stats.disk_budget else kv_directory_usage(where)
        return {"dir": where, "used_bytes": used, "budget_bytes": kv.disk_bytes}

    def _prefix_cache_view(self) -> dict | None:
        """The kept states' figures: bytes in RAM and on disk, what was written (today against the
        write budget), hits; None before a run made the cache or with it off."""
        stats = self.engines.prefix_cache_stats()
        if stats is None:
            return None
        return dict(vars(stats), dir=str(self.options.kv_dir or (self.cfg.kv.dir if self.cfg.kv else "")) or None)

    # -- shutdown -----------------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> bool:
        """Refuse new runs, turn the waiting requests away, cancel the current run and wait for
        it, then release the loaded engine; False if the run did not stop in time (the engine
        stays with it). Not from the event loop's thread (it waits)."""
        with self._lock:
            first = not self._closing
            self._closing = True
            run = self._current
            live = [r for r in self._live.values() if r is not run]
        if first:
            self.events.log("shutdown", "the server is stopping: queued requests are turned away, live runs "
                                        "cancelled")
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.queue.close)
                loop.call_soon_threadsafe(self.events.close)
            except RuntimeError:
                pass
        self.operator.remove_file()
        for other in live:
            other.cancel()
        deadline = time.monotonic() + timeout
        for r in live + ([run] if run is not None else []):
            if not r.finished:
                r.cancel()
                if not r.wait(max(0.0, deadline - time.monotonic())):
                    return False
        self.engines.close()
        return True
