"""What the server's routes act on: the model, one loaded engine, the current run, the history.

The Service starts runs through ds4f.api.start_run with one EngineHost, so a run after the
first reuses the loaded engine (pinned trunk, routers, cache slots, I/O threads). One run at a
time: the run API refuses a second one while one is active, and the Service answers that with
429 and the active run's ETA. Finished runs older than the current one are served from the
history database, which the console and `ds4f run` share.

In every answer `gen` is the number of tokens a run generates (as requested) and `steps` its
decode steps: the prompt's tokens after the first plus `gen` (the engine's Snapshot.gen and
tokens_done count steps). Polling answers use a run's summary report, kept in memory; only
GET /runs/{id}/report reads the whole report, per-token records included, from its file.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from ds4f import __version__
from ds4f.api import (DEFAULT_GEN, LIVE_STATES, MAX_GEN, MAX_PROMPT, MAX_THREADS, Ds4fError, EngineHost, History,
                      RunConfig, active_run, available_backends, best_backend, checkpoint_summary,
                      ensure_demo_model, load_config)
from ds4f.api import start_run as api_start_run

from .metrics import render_metrics
from .transport import HttpError, ServerOptions


@dataclass(frozen=True)
class RunParams:
    """A run as a request asked for it; None: the server's default (its preset, ds4f.toml's)."""
    gen: int = DEFAULT_GEN
    preset: str | None = None
    kernel_threads: int | None = None
    io_threads: int | None = None
    backend: str | None = None
    prompt: tuple[int, ...] | None = None


def resolve_model(explicit: str | None, cfg) -> str:
    """--model, else ds4f.toml's [model] path, else the demo model (made on first use)."""
    if explicit:
        return str(Path(explicit).expanduser())
    if cfg.model_path:
        return cfg.model_path
    return str(ensure_demo_model())


def snapshot_view(snap, gen: int) -> dict:
    """The live figures without the per-token list (its last few records are kept); `gen` is
    the tokens the run generates and `steps` its decode steps (the Snapshot's gen)."""
    d = asdict(snap)
    d["steps"] = d.pop("gen")
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


def _accepts_engines(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "engines" or p.kind is p.VAR_KEYWORD for p in params)


class Service:
    """The model, the engine host, the current and recent runs, the history and the counters.

    start_run: ds4f.api.start_run, or a stand-in with its contract (tests): it validates the
    config (Ds4fError with `param`) and refuses while a run is active (Ds4fError, kind "busy").
    It is given `engines=` when its signature takes it.
    """

    def __init__(self, options: ServerOptions, start_run=None):
        self.options = options
        self.cfg = load_config(options.config_path)
        self.preset = self.cfg.get_preset(options.preset).name
        self.model = resolve_model(options.model, self.cfg)
        summary = checkpoint_summary(self.model)
        self.geometry = summary["geometry"]
        self.checkpoint_kind = summary["kind"]
        self.io_mode = summary["io_mode"]
        self.history = History(self.cfg.history_path)
        self.run_history = RecordingHistory(self.history)   # what runs record themselves in
        self.backends = list(available_backends())
        self.best_backend = best_backend()
        self.engines = EngineHost()            # one loaded engine, kept between runs; closed by close()
        self._start_run = start_run or api_start_run
        self._run_kwargs = {"engines": self.engines} if _accepts_engines(self._start_run) else {}
        self._lock = threading.Lock()          # guards starting a run and _current
        self._counts_lock = threading.Lock()   # response counters: never waits behind a run's start
        self._hashes_lock = threading.Lock()
        self._dump_hashes: dict[tuple, str] = {}   # state dumps hashed: (dev, inode, size, mtime, ctime) -> sha256
        # Only the current (or last) Run stays in memory; older runs are served from the history.
        self._current = None
        self._closing = False
        self.started_at = time.time()
        self.runs_started = 0
        self.busy_rejections = 0
        self._responses: Counter = Counter()
        self._last_report = self._last_report_from_history()

    # -- counters ---------------------------------------------------------------------------------
    def count_response(self, code: int) -> None:
        with self._counts_lock:
            self._responses[int(code)] += 1

    def _last_report_from_history(self) -> dict | None:
        try:
            for rec in self.history.list_runs(limit=50):
                if rec.state == "done" and rec.report:
                    return {"run_id": rec.run_id, "finished_at": rec.finished_at, "summary": rec.summary,
                            "state_sha256": rec.state_sha256, "source": "history"}
        except Ds4fError:
            pass
        return None

    # -- runs --------------------------------------------------------------------------------------
    @property
    def current_run(self):
        """The run started last (live or finished), or None."""
        return self._current

    @property
    def busy(self) -> bool:
        run = self._current
        return run is not None and not run.finished

    def _busy_error(self, exc: Ds4fError) -> HttpError:
        """429 for a start refused because a run is active: Retry-After is that run's ETA."""
        self.busy_rejections += 1
        run = active_run()
        if run is None:   # it ended after refusing this one
            return HttpError(429, f"busy: {exc.message}", headers={"Retry-After": "1"})
        snap = run.snapshot()
        retry = max(1, min(3600, math.ceil(snap.eta_s))) if snap.eta_s else 1
        return HttpError(429, f"busy: run {run.id} is {snap.state} (step {snap.tokens_done} of {snap.gen}); "
                              f"one run at a time", headers={"Retry-After": str(retry)},
                         extra={"run_id": run.id, "retry_after_s": retry})

    def start(self, params: RunParams):
        """Start a run; HttpError 503 while shutting down, 429 while a run is active, and the
        run API's Ds4fError for a run it refuses (the caller names the parameter)."""
        with self._lock:
            if self._closing:
                raise HttpError(503, "the server is shutting down", headers={"Retry-After": "5"})
            cur = self._current
            if cur is not None and not cur.finished and cur.state not in LIVE_STATES:
                cur.wait(5.0)   # ended a moment ago; its thread is recording it in the history
            config = RunConfig(model=self.model, preset=params.preset or self.preset, gen=params.gen,
                               prompt=params.prompt, io_threads=params.io_threads,
                               kernel_threads=params.kernel_threads, backend=params.backend or self.cfg.backend,
                               config_path=self.options.config_path)
            try:
                run = self._start_run(config, history=self.run_history, **self._run_kwargs)
            except Ds4fError as exc:
                if exc.kind == "busy":
                    raise self._busy_error(exc) from None
                raise
            self._current = run
            self.runs_started += 1
            return run

    def _find(self, run_id: str):
        run = self._current
        return run if run is not None and run.id == run_id else None

    def run_view(self, run) -> dict:
        """A run of this server: its live figures and, once done, its summary report."""
        snap = run.snapshot()
        report = run.summary_report if snap.state == "done" else None
        if report is not None:
            self._note_report(run.id, report)
        return {"id": run.id, "state": snap.state, "error": snap.error, "source": "server",
                "gen": run.config.gen, "steps": snap.gen,
                "config": run.config_dict(), "live": snapshot_view(snap, run.config.gen),
                "state_sha256": (report or {}).get("state_sha256"), "report": report,
                "history_error": self.run_history.failures.get(run.id),
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
            raise HttpError(503, f"the run history cannot be read: {exc.message}",
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
            raise HttpError(404, f"no run {run_id!r}")
        return {"id": rec.run_id, "state": rec.state, "error": rec.error, "source": "history",
                "gen": rec.gen, "steps": record_steps(rec.config),
                "config": rec.config, "live": None, "state_sha256": rec.state_sha256, "report": rec.report,
                "started_at": rec.started_at, "finished_at": rec.finished_at,
                "links": self._links(rec.run_id, rec.state)}

    def cancel(self, run_id: str) -> tuple[int, dict]:
        run = self._find(run_id)
        if run is None:
            rec = self._history_get(run_id)
            if rec is None:
                raise HttpError(404, f"no run {run_id!r}")
            raise HttpError(409, f"run {run_id} already ended ({rec.state})", extra={"state": rec.state})
        if run.finished or run.state not in LIVE_STATES:
            raise HttpError(409, f"run {run_id} already ended ({run.state})", extra={"state": run.state})
        run.cancel()
        stopped = run.wait(self.options.cancel_wait_s)
        return (200 if stopped else 202), self.run_view(run)

    def full_report(self, run_id: str) -> dict:
        """The whole report of a done run, per-token records included, read from its file."""
        run = self._find(run_id)
        if run is not None:
            if run.state != "done":
                raise HttpError(409, f"run {run_id} is {run.state}: its report exists only once it is done",
                                extra={"state": run.state})
            return run.report
        rec = self._history_get(run_id)
        if rec is None:
            raise HttpError(404, f"no run {run_id!r}")
        if rec.state != "done" or not rec.report:
            raise HttpError(409, f"run {run_id} is {rec.state}: it has no report", extra={"state": rec.state})
        for path in self._report_files(rec):
            try:
                with open(path, "rb") as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            if (isinstance(doc, dict) and doc.get("run_id") == rec.run_id
                    and doc.get("state_sha256") == rec.state_sha256):
                return doc
        return rec.report   # the file is gone or is another run's: what the history keeps

    @staticmethod
    def _report_files(rec) -> list[Path]:
        """Where a run's report.json may be: the run's report_path, else next to its state dump
        (a.bin -> a.report.json, or report.json in the run's own directory)."""
        out = []
        if rec.config.get("report_path"):
            out.append(Path(rec.config["report_path"]))
        if rec.state_path:
            state = Path(rec.state_path)
            out += [state.with_name(state.stem + ".report.json"), state.with_name("report.json")]
        return out

    def state_file(self, run_id: str) -> tuple[Path, str | None, int | None]:
        """A done run's state dump: its path, the sha256 and (when the report has it) the size
        its run recorded for it."""
        run = self._find(run_id)
        if run is not None:
            state, report = run.state, run.summary_report
        else:
            rec = self._history_get(run_id)
            if rec is None:
                raise HttpError(404, f"no run {run_id!r}")
            state, report = rec.state, rec.report or {}
            if rec.state_path:
                report = {**report, "state_path": rec.state_path, "state_sha256": rec.state_sha256}
        if state != "done" or not report or not report.get("state_path"):
            raise HttpError(409, f"run {run_id} is {state}: its state dump exists only once it is done",
                            extra={"state": state})
        path = Path(report["state_path"])
        if not path.is_file():
            raise HttpError(410, f"run {run_id}: the state dump {path} is gone")
        nbytes = report.get("state_nbytes")
        return path, report.get("state_sha256"), nbytes if isinstance(nbytes, int) else None

    def open_state(self, run_id: str):
        """The state dump of a done run, open and checked to be that run's: its bytes hash to
        the sha256 the run recorded. 409 if the file was changed or replaced since."""
        path, sha, nbytes = self.state_file(run_id)
        if not sha:
            raise HttpError(409, f"run {run_id}: no sha256 is recorded for its state dump, so {path} cannot "
                                 f"be checked to be its own; it is not served", extra={"state": "done"})
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise HttpError(410, f"run {run_id}: cannot open the state dump {path}: {exc.strerror}") from None
        try:
            st = os.fstat(f.fileno())
            if nbytes is not None and st.st_size != nbytes:
                found = f"{st.st_size} bytes, the run's dump has {nbytes}"
            else:
                got = self._sha256_of(f, st)
                found = None if got == sha else f"its sha256 is {got[:16]}…, the run's is {sha[:16]}…"
            if found:
                raise HttpError(409, f"run {run_id}: {path} is not this run's state dump any more ({found}): "
                                     f"it was changed or replaced after the run; not serving it",
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
        run = self._current
        for run in ([run] if run is not None else []):
            snap = run.snapshot()
            seen.add(run.id)
            out.append({"id": run.id, "state": snap.state, "source": "server", "started_at": run.started_at,
                        "finished_at": run.finished_at, "preset": snap.preset, "gen": run.config.gen,
                        "steps": snap.gen, "tokens_done": snap.tokens_done, "s_per_token": snap.s_per_token,
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
                        "s_per_token": rec.s_per_token, "state_sha256": rec.state_sha256})
        out.sort(key=lambda r: r["started_at"] or 0, reverse=True)
        return out[:limit], history_error

    # -- status and metrics ------------------------------------------------------------------------
    def status(self) -> dict:
        run = self._current
        snap = run.snapshot() if run is not None else None
        if run is not None and snap.state == "done" and run.summary_report:
            self._note_report(run.id, run.summary_report)
        preset = self.cfg.get_preset(self.preset)
        return {
            "server": {"version": __version__, "busy": self.busy, "closing": self._closing,
                       "auth": bool(self.options.token), "uptime_s": time.time() - self.started_at,
                       "runs_started": self.runs_started, "config": self.cfg.source,
                       "history": str(self.history.path), "history_error": self.run_history.last_failure},
            "engine": {"state": snap.state if snap is not None and run is not None and not run.finished else "idle",
                       "current_run": run.id if run is not None else None},
            "model": {"path": self.model, "kind": self.checkpoint_kind, "io_mode": self.io_mode,
                      "geometry": self.geometry},
            "preset": {"name": preset.name, "detail": preset.describe(), "available": list(self.cfg.presets)},
            "backend": {"default": self.cfg.backend, "best": self.best_backend, "available": self.backends},
            "limits": {"max_gen": MAX_GEN, "max_prompt": MAX_PROMPT, "max_threads": MAX_THREADS,
                       "max_body_bytes": self.options.max_body_bytes},
            "run": snapshot_view(snap, run.config.gen) if snap is not None else None,
            "last_report": self._last_report,
        }

    def metrics(self) -> str:
        run = self._current
        with self._counts_lock:
            responses = dict(self._responses)
        snap = run.snapshot() if run is not None else None
        return render_metrics(snap, {"busy": self.busy, "runs_started": self.runs_started,
                                     "busy_rejections": self.busy_rejections, "requests": responses,
                                     "gen": run.config.gen if run is not None else None})

    # -- shutdown -----------------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> bool:
        """Refuse new runs, cancel the current one and wait for it, then release the loaded
        engine; False if the run did not stop in time (the engine stays with it)."""
        with self._lock:
            self._closing = True
            run = self._current
        if run is not None and not run.finished:
            run.cancel()
            if not run.wait(timeout):
                return False
        self.engines.close()
        return True
