"""The run API: the one boundary the console, the CLI and the server use.

    run = start_run(RunConfig(model=..., preset="laptop", gen=8), history=History(path))
    run.snapshot()        # live figures, cheap, any thread, any time
    run.switch(backend="scalar", kernel_threads=1, io_threads=8)   # lands at the next token
    run.cancel(); run.wait(); run.state; run.error; run.report

A run executes in a background thread. It writes state.bin and report.json as a pair (the
report carries the state's sha256) under temporary names and commits them when complete, the
report first (see ds4f.runs.statedump); a cancelled or failed run leaves no files, and a run
cleans what a killed one left in its place. A write error (no space, no permission) fails the
run with a message naming the file.
Only one run is active per process at a time: the kernel backend and thread count are
process-wide settings of the native library.
"""
from __future__ import annotations

import collections
import json
import os
import secrets
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import psutil

from ds4f.native import kernels
from ds4f.engine.runtime.disk_floor import cached_floor, replay_reads
from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import (BACKEND_NAMES, Budget, DEFAULT_GEN, MAX_CHUNK, MAX_GEN, MAX_PROMPT, MAX_THREADS, Preset,
                               load_config)
from ds4f.engine.engine import Engine, EngineFigures
from ds4f.errors import Ds4fError
from ds4f.paths import user_data_dir
from ds4f.cachelab.replay import replay
from ds4f.cachelab.trace import Trace
from ds4f.runs.snapshot import Snapshot, TokenLog, TokenRecord, bound_of
from ds4f.engine.model.prefill import Stopped
from ds4f.engine.text.output import OutputText
from ds4f.runs.statedump import StateWriter, read_routing, sweep_run_dirs, write_error
from ds4f.engine.text.chat import chat_prompt_ids
from ds4f.engine.text.sampling import Sampler, SamplingParams
from ds4f.engine.text.tokenizer import find_tokenizer

REPORT_SCHEMA = "ds4f.report/1"

REPLAY_TOKENS = 32    # a done run's I/O efficiency replays the reads of its last REPLAY_TOKENS warm tokens
BELADY_MAX_REQUESTS = 4_000_000   # above this many expert requests a run skips Belady's optimum
BELADY_BYTES_PER_REQUEST = 24     # the routing read back (int32), its int64 codes, the next uses (int32),
                                  # and numpy's temporaries on the way
MAX_STOP = 16              # stop strings a run takes, each of at most MAX_STOP_CHARS characters
MAX_STOP_CHARS = 256
MAX_EVENTS = 1000          # a run's event log keeps its last MAX_EVENTS lines (the report counts the rest)
SNAPSHOT_EVENTS = 200      # the lines a snapshot carries
LIVE_STATES = ("starting", "running")          # a run in these states can be switched or cancelled
END_STATES = ("done", "cancelled", "failed")
_active_lock = threading.Lock()
_active: "Run | None" = None


@dataclass(frozen=True)
class RunConfig:
    model: str                               # checkpoint path (official shards or ds4f layout)
    preset: "str | Preset" = "laptop"        # a preset of ds4f.toml, or a Preset made in code
    gen: int = DEFAULT_GEN                   # tokens to generate
    prompt: tuple[int, ...] | None = None    # prompt token ids; None: (bos,)
    io_threads: int | None = None            # None: the preset's, else ds4f.toml's
    kernel_threads: int | None = None        # None: the preset's, else ds4f.toml's (0 there = all cores)
    backend: str | None = None               # auto | scalar | avx2 | avx512 | neon; None: ds4f.toml's engine.backend
    dump_path: str | None = None             # state.bin; None: <data dir>/runs/<id>/state.bin
    report_path: str | None = None           # report.json; None: next to the state dump (a.bin -> a.report.json)
    config_path: str | None = None           # ds4f.toml to use; None: the usual lookup
    probe_floor: bool | None = None          # measure the NVMe floor; None: ds4f.toml's engine.probe_floor
    moe_only: bool = False                   # allow a checkpoint without attention (the MoE half alone: the cache lab)
    # text: the prompt as text or chat messages (needs the checkpoint's tokenizer), how to pick tokens, when to stop
    text: str | None = None                  # prompt text (BOS prepended); not with `prompt` or `messages`
    messages: tuple | None = None            # chat turns ({"role", "content"}), in the model's chat format
    thinking: bool = False                   # chat: the model reasons first (thinking mode) or answers (chat mode)
    sampling: "SamplingParams | None" = None # None: greedy
    stop: tuple[str, ...] = ()               # stop strings: the output ends before the first one
    stop_at_eos: bool | None = None          # end at the end-of-sentence token; None: when the prompt is text
    prefill_chunk: int | None = None         # prompt tokens per layer-major chunk; 0: token by token;
                                             # None: the preset's


def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def active_run() -> "Run | None":
    return _active if _active is not None and not _active.finished else None


class EngineHost:
    """Keeps one loaded Engine between runs, as a console or a server does: a run on the same
    checkpoint (same files, unchanged) with the same preset reuses it (its pinned trunk, routers,
    expert-cache slots and I/O threads) instead of loading it again. Each run still starts with
    an empty cache and its own counters, so its figures and state dump are those of a fresh
    engine. Kernel backend and threads, and the I/O thread count, are set per run.
    Runs that share a host run one at a time (the process allows one active run)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._key: tuple | None = None
        self.loads = 0              # engines loaded so far (a reuse does not count)
        self.baseline_rss = 0       # the process's RSS before the loaded engine was made

    @staticmethod
    def key(checkpoint, preset: Preset) -> tuple:
        stamps = []
        for f in sorted(checkpoint.path.iterdir()) if checkpoint.path.is_dir() else ():
            try:
                st = f.stat()
                stamps.append((f.name, st.st_size, st.st_mtime_ns))
            except OSError:
                pass
        return (str(checkpoint.path.resolve()), checkpoint.kind, tuple(stamps), preset)

    def engine_for(self, checkpoint, preset: Preset, io_threads: int, kernel_threads: int, backend: str) -> "Engine":
        """The loaded engine if it fits this checkpoint and preset (reset for a new run), else a
        new one (the old one is closed). The checkpoint handed in is closed if the host keeps its own."""
        key = self.key(checkpoint, preset)
        with self._lock:
            if self._engine is not None and self._key == key:
                checkpoint.close()
                self._engine.reset_for_run(io_threads, kernel_threads, backend)
                return self._engine
            old, self._engine, self._key = self._engine, None, None
        if old is not None:
            old.close()
            old.ckpt.close()
        baseline = psutil.Process().memory_info().rss
        engine = Engine(checkpoint, preset, io_threads, kernel_threads, backend)
        with self._lock:
            self.baseline_rss = baseline
            self._engine, self._key = engine, key
            self.loads += 1
        return engine

    def owns(self, engine) -> bool:
        return engine is not None and engine is self._engine

    def close(self) -> None:
        with self._lock:
            old, self._engine, self._key = self._engine, None, None
        if old is not None:
            old.close()
            old.ckpt.close()


def start_run(config: RunConfig, history=None, engines: EngineHost | None = None, on_token=None) -> "Run":
    """Validate, open the checkpoint and start the run's thread; returns at once.

    engines: keep the engine loaded after the run for the next one (see EngineHost).
    on_token: called in the run's thread after each token with its TokenRecord (keep it short)."""
    global _active
    cfg = load_config(config.config_path)
    preset = config.preset if isinstance(config.preset, Preset) else cfg.get_preset(config.preset)
    if isinstance(config.gen, bool) or not isinstance(config.gen, int) or not 1 <= config.gen <= MAX_GEN:
        raise Ds4fError(f"gen: must be a number of tokens from 1 to {MAX_GEN}, got {config.gen!r}", param="gen")
    if config.prompt is not None and len(config.prompt) > MAX_PROMPT:
        raise Ds4fError(f"prompt: at most {MAX_PROMPT} token ids, got {len(config.prompt)}", param="prompt")
    if config.backend is None:
        config = replace(config, backend=cfg.default_backend())
    if config.backend not in BACKEND_NAMES:
        raise Ds4fError(f"backend: unknown backend {config.backend!r} (known: {', '.join(BACKEND_NAMES)})",
                        param="backend")
    if config.backend != "auto" and config.backend not in kernels.available_backends():
        raise Ds4fError(f"backend: {config.backend} is not available on this machine "
                        f"(available: {', '.join(kernels.available_backends())})", param="backend")
    chunk = config.prefill_chunk
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk <= MAX_CHUNK):
        raise Ds4fError(f"prefill_chunk: must be from 0 (token by token) to {MAX_CHUNK} prompt tokens, got {chunk!r}",
                        param="prefill_chunk")
    for name in ("io_threads", "kernel_threads"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or not 1 <= value <= MAX_THREADS):
            raise Ds4fError(f"{name}: must be between 1 and {MAX_THREADS}, got {value!r}", param=name)
    if not config.model:
        raise Ds4fError("model: no checkpoint path given", param="model")
    _check_text_settings(config)
    checkpoint = open_checkpoint(config.model)
    g = checkpoint.geometry
    try:
        prompt, tokenizer = _prompt_of(config, checkpoint)
    except Ds4fError:
        checkpoint.close()
        raise
    if len(prompt) > MAX_PROMPT:
        checkpoint.close()
        raise Ds4fError(f"prompt: at most {MAX_PROMPT} tokens, the text makes {len(prompt)}", param="prompt")
    if g.attention is None and not config.moe_only:
        checkpoint.close()
        raise Ds4fError(f"model: {config.model}: its config.json has no attention settings (num_attention_heads,"
                        f" head_dim, compress_ratios, ...), so only the MoE half of the model could run and its tokens"
                        f" would not be the model's; make the checkpoint again (ds4f synth / convert), or pass"
                        f" --moe-only to run the MoE half for the cache lab", param="model")
    positions = len(prompt) - 1 + config.gen
    if g.attention is not None and positions > preset.context:
        checkpoint.close()
        raise Ds4fError(f"gen: a prompt of {len(prompt)} tokens and {config.gen} generated ones reach {positions}"
                        f" positions, past the context of {preset.context} that preset {preset.name!r} allocates"
                        f" its KV cache for (generate fewer, or raise the preset's `context`)", param="gen")
    with _active_lock:
        if active_run() is not None:
            checkpoint.close()
            raise Ds4fError(f"run {_active.id} is still active; stop it first", kind="busy")
        run = Run(config, cfg, preset, checkpoint, prompt, history, engines, on_token, tokenizer)
        _active = run
    run._thread.start()
    return run


@dataclass
class _Records:
    """One token's arrays for the state dump (a prefill chunk's row)."""
    ids: np.ndarray
    weights: np.ndarray
    hidden: np.ndarray
    attn: np.ndarray
    logits: np.ndarray


def _shares(total: int, n: int) -> list[int]:
    """total split over n tokens in whole units, the remainder to the first ones (they add up)."""
    q, r = divmod(int(total), n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _check_text_settings(config: RunConfig) -> None:
    """The text settings' types and ranges, before any file is opened."""
    given = [name for name in ("prompt", "text", "messages") if getattr(config, name) is not None]
    if len(given) > 1:
        raise Ds4fError(f"{given[1]}: give the prompt one way only (token ids, text or chat messages), "
                        f"not {' and '.join(given)}", param=given[1])
    if config.text is not None and (not isinstance(config.text, str) or not config.text):
        raise Ds4fError("text: the prompt text is empty", param="text")
    if config.messages is not None:
        if not config.messages:
            raise Ds4fError("messages: no chat messages given", param="messages")
        for i, m in enumerate(config.messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) \
                    or m.get("role") not in ("system", "user", "assistant"):
                raise Ds4fError(f"messages[{i}]: each message needs a role (system, user or assistant) and its"
                                f" content as text", param="messages")
    if config.sampling is not None and not isinstance(config.sampling, SamplingParams):
        raise Ds4fError(f"sampling: expected SamplingParams, got {type(config.sampling).__name__}", param="sampling")
    stop = config.stop
    if isinstance(stop, str) or not isinstance(stop, (tuple, list)) or len(stop) > MAX_STOP \
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise Ds4fError(f"stop: at most {MAX_STOP} stop strings, each of 1 to {MAX_STOP_CHARS} characters",
                        param="stop")


def _prompt_of(config: RunConfig, checkpoint) -> tuple[tuple[int, ...], object]:
    """The prompt's token ids, and the tokenizer when the run speaks text (None otherwise)."""
    g = checkpoint.geometry
    wants_text = config.text is not None or config.messages is not None or bool(config.stop)
    tokenizer = find_tokenizer(checkpoint.path) if checkpoint.path.is_dir() else None
    if wants_text and tokenizer is None:
        raise Ds4fError(f"model: {checkpoint.path} has no tokenizer (tokenizer.json), so it cannot read or write"
                        f" text; give the prompt as token ids, or use a checkpoint with its tokenizer files",
                        param="model", path=str(checkpoint.path))
    if config.messages is not None:
        prompt = tuple(chat_prompt_ids(tokenizer, list(config.messages), thinking=config.thinking))
    elif config.text is not None:
        prompt = (tokenizer.bos_id, *tokenizer.encode(config.text))
    else:
        prompt = tuple(config.prompt) if config.prompt else (g.bos_token_id,)
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < g.vocab]
    if bad:
        what = "the tokenizer gives token ids" if wants_text else "token ids"
        raise Ds4fError(f"prompt: {what} {bad[:5]} outside the model's vocabulary (0..{g.vocab - 1})",
                        param="prompt")
    return prompt, tokenizer


class Run:
    def __init__(self, config: RunConfig, cfg, preset, checkpoint, prompt, history, engines=None,
                 on_token=None, tokenizer=None) -> None:
        self.id = _new_run_id()
        self.engines = engines
        self.on_token = on_token
        self._hosted = False    # the engine and its checkpoint belong to `engines` and outlive the run
        self.config = config
        self.preset = preset
        self.checkpoint = checkpoint
        self.prompt = prompt
        self.history = history
        self.n_steps = len(prompt) - 1 + config.gen
        self.tokenizer = tokenizer
        # a prompt of one token has nothing to prefill (and needs no chunk buffers)
        chunk = preset.prefill_chunk if config.prefill_chunk is None else config.prefill_chunk
        self.prefill_chunk = min(chunk, len(prompt)) if len(prompt) > 1 else 0
        self.stop_at_eos = config.stop_at_eos if config.stop_at_eos is not None else tokenizer is not None and (
            config.text is not None or config.messages is not None)
        self.eos_id = tokenizer.eos_id if tokenizer is not None else checkpoint.geometry.eos_token_id
        self._output = OutputText(tokenizer, tuple(config.stop)) if tokenizer is not None else None
        self._finish_reason: str | None = None
        self._generated = 0      # tokens picked after the prompt (an end-of-sentence one included)
        self.io_threads = config.io_threads or cfg.effective_io_threads(preset)
        self.kernel_threads = config.kernel_threads or cfg.effective_kernel_threads(preset)
        self.probe = cfg.probe_floor if config.probe_floor is None else config.probe_floor
        run_dir = user_data_dir() / "runs" / self.id
        self.dump_path = Path(config.dump_path) if config.dump_path else run_dir / "state.bin"
        if config.report_path:
            self.report_path = Path(config.report_path)
        elif config.dump_path:  # next to the dump, named after it: a.bin -> a.report.json
            self.report_path = self.dump_path.with_name(self.dump_path.stem + ".report.json")
        else:
            self.report_path = run_dir / "report.json"

        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._pending: dict = {}
        self._state = "starting"
        self._error: str | None = None
        self._report: dict | None = None
        self._events: collections.deque[str] = collections.deque(maxlen=MAX_EVENTS)
        self._n_events = 0
        self._log_tokens = TokenLog(self.n_steps)    # every token's figures, sized up front
        g = checkpoint.geometry
        requests = self.n_steps * g.n_layers * g.top_k
        # what the end of the run holds for a moment: the routing read back and Belady's next uses
        self._finish_bytes = requests * BELADY_BYTES_PER_REQUEST if requests <= BELADY_MAX_REQUESTS else 0
        self._engine: Engine | None = None          # released when the run ends (its memory goes)
        self._final_figures: EngineFigures | None = None
        self._final_layer_prefetch_hits: tuple[int, ...] = ()   # the streamer's, when the engine is released
        self._session_nbytes = 0                     # the session's buffers and KV cache, counted as resident
        self._kv_bytes, self._context = 0, 0         # the session's KV cache and the positions it holds
        self._optimum: float | None = None
        self._replay: dict | None = None             # the replay of the run's last reads (when done)
        self._baseline_rss = psutil.Process().memory_info().rss  # the process before the engine
        self._rss_at_end = 0
        self._floor = None
        self._backend = config.backend if config.backend != "auto" else kernels.best_backend()
        self.started_at = time.time()
        self.finished_at: float | None = None
        self._t0 = time.perf_counter()
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
        if self._report is None:
            return None
        try:
            with open(self.report_path) as f:
                return json.load(f)
        except (OSError, ValueError):   # moved or deleted since: what is still in memory
            return dict(self._report)

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
    def generated_tokens(self) -> int:
        """Tokens generated so far (the prompt's not counted; an end-of-sentence token counted)."""
        return self._generated

    @property
    def output_text(self) -> str:
        """The text generated so far that is safe to show (complete UTF-8, no pending stop string);
        the whole output once the run has ended. "" when the checkpoint has no tokenizer."""
        out = self._output
        return out.text[:out.emitted] if out is not None else ""

    @property
    def finish_reason(self) -> str | None:
        """Why generation ended: "length" (the token limit), "eos" (the end-of-sentence token),
        "stop" (a stop string); None while running, or when cancelled or failed."""
        return self._finish_reason

    def switch(self, backend: str | None = None, kernel_threads: int | None = None,
               io_threads: int | None = None) -> None:
        """Change settings; they take effect at the next token boundary."""
        if backend is not None:
            if backend != "auto" and backend not in kernels.available_backends():
                raise Ds4fError(f"backend: {backend} is not available here (available: {', '.join(kernels.available_backends())})",
                                param="backend")
        for name, value in (("kernel_threads", kernel_threads), ("io_threads", io_threads)):
            if value is not None and (not isinstance(value, int) or not 1 <= value <= MAX_THREADS):
                raise Ds4fError(f"{name}: must be between 1 and {MAX_THREADS}, got {value!r}", param=name)
        with self._lock:
            for name, value in (("backend", backend), ("kernel_threads", kernel_threads), ("io_threads", io_threads)):
                if value is not None:
                    self._pending[name] = value

    def snapshot(self) -> Snapshot:
        log = self._log_tokens
        with self._lock:
            tokens = tuple(log.recent)
            events = tuple(self._events)[-SNAPSHOT_EVENTS:]
            state, error = self._state, self._error
            backend = self._backend
            kt, it = self.kernel_threads, self.io_threads
            done = log.count
            first = log.first
            gb_tok = log.warm_gb_per_token()
            hits, misses, stall = log.hits, log.misses, log.stall_s
            prefetched = log.prefetch_hits
            s_tok = log.median_seconds()
            disk_busy, read_depth = log.occupancy()
            switches = tuple(log.switches)
            pre_n, pre_s, pre_b = log.prefill_tokens, log.prefill_s, log.prefill_bytes
        eng = self._engine
        if eng is not None:
            # read before the cache's figures: a hit is counted by the cache before the streamer
            # says it was on a prefetched expert, so these never exceed the layer hits read after
            layer_prefetched = tuple(eng.streamer.prefetch_layer_hits)
            fig = eng.figures(self._session_nbytes)
        else:
            layer_prefetched, fig = self._final_layer_prefetch_hits, self._final_figures
        eff = gb_tok / s_tok if gb_tok is not None and s_tok else None
        floor = self._floor.gbps if self._floor else None
        elapsed = (self.finished_at or time.time()) - self.started_at
        remaining = self.n_steps - done
        rss = self._rss_at_end if self.finished_at is not None else self._rss_now()
        requests = hits + misses
        # the tokens' own counts (hits on prefetched experts apart), so that the run's rate is the
        # sum of its tokens' and never mixes a token in progress with the tokens done
        own = (hits - prefetched) / requests if requests else None
        vm = psutil.virtual_memory()
        return Snapshot(
            run_id=self.id, state=state, error=error, model=str(self.config.model), preset=self.preset.name,
            steps=self.n_steps, tokens_done=done, backend=backend, kernel_threads=kt, io_threads=it,
            io_mode=self.checkpoint.io_mode, policy=self.preset.policy,
            s_per_token=s_tok, s_first_token=first.seconds if first else None,
            gb_per_token=gb_tok, eff_read_gbps=eff, floor_gbps=floor,
            io_efficiency=self._replay["efficiency"] if self._replay else None,
            hit_rate=hits / (hits + misses) if hits + misses else None,
            layer_hits=fig.layer_hits if fig else (), layer_misses=fig.layer_misses if fig else (),
            layer_evictions=fig.layer_evictions if fig else (),
            cache_bytes=fig.cache_used_bytes if fig else 0,
            budget_bytes=fig.cache_capacity_bytes if fig else 0,
            rss_bytes=rss, rss_budget_bytes=self._baseline_rss + fig.resident_bytes + self._run_bytes if fig else 0,
            read_latency_ms=fig.read_latency_s / fig.expert_reads * 1e3 if fig and fig.expert_reads else None,
            stall_s_per_token=stall / done if done else None,
            elapsed_s=elapsed, eta_s=s_tok * remaining if s_tok is not None and state == "running" else None,
            tokens=tokens, events=events, prefetch=fig.prefetch if fig else {},
            optimum_hit_rate=self._optimum, disk_busy_fraction=disk_busy, mean_read_depth=read_depth,
            switches=switches, policy_hit_rate=own, prefetch_hit_share=(hits / requests - own) if own is not None else None,
            regret_pp=(self._optimum - own) * 100 if own is not None and self._optimum is not None else None,
            bound=bound_of(disk_busy), floor_ratio=eff / floor if eff is not None and floor else None,
            floor_age_s=time.time() - self._floor.measured_at if self._floor and self._floor.measured_at else None,
            ram_bytes=vm.total, ram_available_bytes=vm.available,
            plan_bytes=fig.resident_bytes + self._run_bytes if fig else 0,
            kv_bytes=self._kv_bytes, context=self._context,
            check_s_per_token=fig.check_s / done if fig and done else None,
            layer_prefetch_hits=layer_prefetched if fig else (),
            phase="prefill" if done < len(self.prompt) - 1 else "decode", prompt_tokens=len(self.prompt),
            generated_tokens=self._generated, output_text=self.output_text, finish_reason=self._finish_reason,
            prefill_tokens=pre_n, prefill_tokens_per_s=pre_n / pre_s if pre_s else None,
            prefill_gb_per_token=pre_b / 1e9 / pre_n if pre_n else None, prefill_chunk=self.prefill_chunk)

    # -- the run's thread ---------------------------------------------------------------------
    def _rss_now(self) -> int:
        try:
            return self._process.memory_info().rss
        except psutil.Error:
            return 0

    def _log(self, message: str) -> None:
        with self._lock:
            self._events.append(f"{time.strftime('%H:%M:%S')} {message}")
            self._n_events += 1

    def _apply_switches(self, eng: Engine, step: int) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        backend = pending.get("backend", self._backend)
        threads = pending.get("kernel_threads", eng.kernel_threads)
        old = (self._backend, eng.kernel_threads, eng.io_threads)
        eng.set_kernels(backend, threads)
        if "io_threads" in pending:
            eng.set_io_threads(pending["io_threads"])
        with self._lock:
            self._backend, self.kernel_threads, self.io_threads = eng.backend, eng.kernel_threads, eng.io_threads
        new = (self._backend, eng.kernel_threads, eng.io_threads)
        for label, a, b in zip(("backend", "kernel threads", "I/O threads"), old, new):
            if a != b:
                self._log(f"token {step}: {label} {a} -> {b}")

    def _main(self) -> None:
        global _active
        writer = None
        try:
            self._log(f"run {self.id}: {self.config.model}, preset {self.preset.describe()}, {self.n_steps} tokens")
            # first, so an unwritable or busy place fails the run before the engine loads; its header holds
            # what determines the numbers: the geometry (attention included), the prompt, the token count
            sampling = self.config.sampling
            writer = StateWriter(self.dump_path, self.checkpoint.geometry.to_config(), list(self.prompt), self.n_steps,
                                 report_path=self.report_path,
                                 sampling=sampling.to_dict() if sampling is not None and not sampling.greedy else None)
            notes = writer.notes
            if not self.config.dump_path:   # the default place: one directory per run, beside killed runs' ones
                notes += sweep_run_dirs(self.dump_path.parent.parent, keep=self.dump_path.parent)
            for note in notes:
                self._log(note)
            if self.engines is not None:
                t0 = time.perf_counter()
                loads = self.engines.loads
                eng = self.engines.engine_for(self.checkpoint, self.preset, self.io_threads, self.kernel_threads,
                                              self._backend)
                self.checkpoint, self._hosted = eng.ckpt, True
                self._baseline_rss = self.engines.baseline_rss  # the budget counts the engine once
                how = "loaded" if self.engines.loads > loads else "reused"
                self._log(f"engine {how} in {time.perf_counter() - t0:.2f} s")
            else:
                eng = Engine(self.checkpoint, self.preset, self.io_threads, self.kernel_threads, self._backend)
            for note in eng.notes:
                self._log(note)
            session = eng.new_session(self.prefill_chunk)
            with self._lock:
                self._engine, self._session_nbytes = eng, session.nbytes
                self._kv_bytes, self._context = session.kv_nbytes, session.context if session.kv else 0
                self._backend = eng.backend
            if self.probe and not self._cancel.is_set():
                self._floor = cached_floor(self.checkpoint, self.io_threads)
                self._log(f"NVMe floor {self._floor.gbps:.2f} GB/s ({self._floor.io_mode}, queue depth {self.io_threads})")
            with self._lock:
                self._state = "running"
            sampling = self.config.sampling
            sampler = Sampler(sampling) if sampling is not None and not sampling.greedy else None
            step, token = self._prefill(eng, session, writer, sampler) if session.prefill_chunk else (0, self.prompt[0])
            while step < self.n_steps and self._finish_reason is None and not self._cancel.is_set():
                self._apply_switches(eng, step)
                generating = step >= len(self.prompt) - 1     # this step picks a generated token
                t0 = time.perf_counter()
                res = session.step(token, pick=sampler.sample if generating and sampler is not None else None)
                seconds = time.perf_counter() - t0
                self._emit(eng, writer, step, token, res.next_token, res, vars(res), seconds, prefill=False)
                step += 1
                token = self.prompt[step] if step < len(self.prompt) else res.next_token
            if self._cancel.is_set():
                writer.abort()
                writer = None
                self._finish("cancelled")
                self._log(f"cancelled after {self._log_tokens.count} tokens; no files written")
                return
            sha = writer.close()
            self._finish("done", sha=sha, writer=writer)
            writer = None
        except Ds4fError as exc:
            self._fail(str(exc), writer)
        except Exception as exc:  # never a silently dead thread: the error is the run's
            self._log(traceback.format_exc(limit=8).rstrip())
            self._fail(f"internal error: {type(exc).__name__}: {exc}", writer)
        finally:
            if self._engine is not None:
                self._final_layer_prefetch_hits = tuple(self._engine.streamer.prefetch_layer_hits)
                self._final_figures = self._engine.figures(self._session_nbytes)
                if not self._hosted:
                    self._engine.close()
                self._engine = None
            if not self._hosted:
                self.checkpoint.close()
            self._done.set()
            with _active_lock:
                if _active is self:
                    _active = None

    def _prefill(self, eng: Engine, session, writer, sampler) -> tuple[int, int]:
        """The prompt, chunk by chunk, layer by layer (Session.prefill); each token's record as a
        step's. Returns (the next step, the token it feeds): past the prompt, unless cancelled."""
        prompt, chunk = self.prompt, session.prefill_chunk
        step, token = 0, prompt[0]
        while step < len(prompt) and self._finish_reason is None and not self._cancel.is_set():
            self._apply_switches(eng, step)
            part = list(prompt[step:step + chunk])
            n = len(part)
            t0 = time.perf_counter()
            try:
                res = session.prefill(part, should_stop=self._cancel.is_set)
            except Stopped:   # cancelled part way through the chunk: the run ends cancelled
                break
            seconds = time.perf_counter() - t0
            costs = {k: v for k, v in vars(res).items() if not isinstance(v, np.ndarray)}   # the chunk's
            shares = {k: _shares(costs[k], n) for k in ("hits", "misses", "bytes_read", "reads", "prefetch_hits")}
            for c in range(n):
                generating = step == len(prompt) - 1
                logits = res.logits[c]
                next_token = int(sampler.sample(logits)) if generating and sampler is not None \
                    else int(np.argmax(logits))
                one = {k: (shares[k][c] if k in shares else v / n) for k, v in costs.items()}
                arrays = _Records(res.ids[c], res.weights[c], res.hidden[c], res.attn[c], logits)
                self._emit(eng, writer, step, part[c], next_token, arrays, one, seconds / n, prefill=True)
                step += 1
                token = prompt[step] if step < len(prompt) else next_token
        return step, token

    def _emit(self, eng: Engine, writer, step: int, token: int, next_token: int, rec, costs: dict, seconds: float,
              prefill: bool) -> None:
        """One step's record: into the state dump, the token log (its costs), on_token; the text
        it adds to the output when it picked a generated token."""
        writer.write(token, next_token, eng.backend, rec.ids, rec.weights, rec.hidden, rec.attn, rec.logits)
        generating = step >= len(self.prompt) - 1
        text = self._take_output(next_token, last=step + 1 == self.n_steps) if generating else ""
        record = TokenRecord(index=step, token_id=token, next_token_id=next_token, seconds=seconds,
                             bytes_read=costs["bytes_read"], hits=costs["hits"], misses=costs["misses"],
                             stall_s=costs["stall_s"], backend=eng.backend, kernel_threads=eng.kernel_threads,
                             io_threads=eng.io_threads, disk_busy_s=costs["disk_busy_s"],
                             disk_depth_s=costs["disk_depth_s"], reads=costs["reads"],
                             prefetch_hits=costs["prefetch_hits"], attention_s=costs["attention_s"],
                             moe_s=costs["moe_s"], head_s=costs["head_s"], prefill=prefill, text=text)
        with self._lock:
            self._log_tokens.add(record)
        if self.on_token is not None:
            self.on_token(record)

    def _take_output(self, token_id: int, last: bool) -> str:
        """Count a generated token and say what text it adds; sets the finish reason when the
        output ends here (the end-of-sentence token, a stop string, the token limit)."""
        with self._lock:
            self._generated += 1
        out, piece = self._output, ""
        if self.stop_at_eos and token_id == self.eos_id:
            reason = "eos"
        else:
            if out is not None:
                piece, stopped = out.push(token_id)
                if stopped is not None:
                    self._finish_reason = "stop"
                    return piece
            reason = "length" if last else None
        if reason is not None:
            if out is not None:
                piece += out.finish()
            self._finish_reason = reason
        return piece

    def _fail(self, message: str, writer) -> None:
        if writer is not None:
            writer.abort()
        with self._lock:
            self._error = message
        self._log(f"error: {message}")
        self._finish("failed")

    def _finish(self, state: str, sha: str | None = None, writer: StateWriter | None = None) -> None:
        """End the run in `state`; a done run's report is written and committed with its state
        dump (`writer`, closed) before the run says it is done."""
        self._rss_at_end = self._rss_now()  # what the run held; the engine's memory goes after this
        self.finished_at = time.time()
        report = None
        if state == "done":
            self._optimum = self._optimum_hit_rate(writer.tmp)
            self._replay = self._replay_reads()
            report = self._build_report(sha)
            report["state_nbytes"] = writer.nbytes
            self._write_report(report, writer.report_tmp)
            writer.commit()
            s = report["summary"]
            self._log(f"done: {s['s_per_token']:.3f} s/token warm, hit rate {s['hit_rate']:.1%}, sha256 {sha[:12]}")
        with self._lock:
            self._report = report
            self._state = state
        if self.history is not None:
            try:
                config = self.config_dict()
                config["tokens_done"] = self._log_tokens.count   # what a cancelled or failed run got to
                config["generated_tokens"], config["finish_reason"] = self._generated, self._finish_reason
                if self.tokenizer is not None:
                    config["output_text"] = self.output_text
                self.history.record(run_id=self.id, config=config, state=state, report=report,
                                    state_path=str(self.dump_path) if report else None,
                                    state_sha256=sha, error=self._error,
                                    started_at=self.started_at, finished_at=self.finished_at)
            except Exception as exc:  # the run itself succeeded; say what went wrong with the record
                self._log(f"could not record the run in the history: {exc}")

    def _optimum_hit_rate(self, state_file: Path) -> float | None:
        """Belady's hit rate on this run's own trace with the same cache: the regret's yardstick."""
        fig = self._engine.figures(self._session_nbytes) if self._engine is not None else self._final_figures
        if not self._log_tokens.count or fig is None:
            return None
        g = self.checkpoint.geometry
        if self._log_tokens.count * g.n_layers * g.top_k > BELADY_MAX_REQUESTS:
            self._log(f"Belady's optimum not computed: more than {BELADY_MAX_REQUESTS:,} expert requests")
            return None
        # the routing trace is in the state dump: read back, not kept in memory during the run
        ids = read_routing(state_file)
        prefilled = int(self._log_tokens.rows["prefill"][:self._log_tokens.count].sum())
        trace = Trace(g, ids, np.zeros(len(ids), np.int32), prefill=prefilled, chunk=self.prefill_chunk)
        try:
            return replay(trace, Budget(nbytes=fig.cache_capacity_bytes), "belady").hit_rate
        except Ds4fError:
            return None

    @property
    def _run_bytes(self) -> int:
        """The run's own memory beyond the engine: its token log and what its end needs."""
        return self._log_tokens.nbytes + self._finish_bytes

    def _replay_reads(self) -> dict | None:
        """Replay the reads of the last warm tokens (same records, order and queue depth, no
        compute) into the idle engine's cache slots; efficiency = replay time / the time those
        tokens had a read in flight. Only when the run measures the disk (probe)."""
        eng, log = self._engine, self._log_tokens
        if not self.probe or eng is None or log.count < 2:
            return None
        k = min(REPLAY_TOKENS, log.count - 1)
        rows = log.rows[log.count - k:log.count]
        n, busy = int(rows["reads"].sum()), float(rows["disk_busy_s"].sum())
        reads = eng.reader.recent_reads(n) if n else None
        if not reads or busy <= 0:
            return None
        threads = int(rows["io_threads"][-1])
        slots = [eng.cache.pool[i] for i in range(threads)] if threads <= eng.cache.n_slots else None
        try:
            r = replay_reads(eng.ckpt, reads, threads, expert_bufs=slots, trunk_bufs=eng.streamer.trunk_buffers)
        except Ds4fError as exc:
            self._log(f"disk replay failed: {exc}")
            return None
        eff = r.seconds / busy
        self._log(f"disk replay of the last {k} tokens' {n} reads: {r.seconds:.3f} s against {busy:.3f} s"
                  f" with reads in flight during the run: I/O efficiency {eff:.2f}")
        return {"tokens": k, "reads": n, "nbytes": r.nbytes, "replay_s": r.seconds, "run_busy_s": busy,
                "efficiency": eff, "io_threads": threads, "io_mode": r.io_mode}

    def _time_split(self) -> dict | None:
        """Where a warm token's time goes, mean seconds per token: attention, MoE compute, waiting
        for expert reads, the head, and the rest (routing bookkeeping, the state record, Python)."""
        warm = self._log_tokens.warm()
        if not len(warm):
            return None
        mean = {name: float(warm[name].mean()) for name in ("seconds", "attention_s", "moe_s", "stall_s", "head_s")}
        split = {"attention_s": mean["attention_s"], "moe_compute_s": mean["moe_s"] - mean["stall_s"],
                 "read_wait_s": mean["stall_s"], "head_s": mean["head_s"]}
        split["other_s"] = mean["seconds"] - sum(split.values())
        split["attention_share"] = mean["attention_s"] / mean["seconds"] if mean["seconds"] else None
        return split

    def _prefill_report(self) -> dict | None:
        """The prompt's figures apart from decode's: layer-major chunks (or token by token)."""
        fig = self._log_tokens.prefill_figures()
        if fig is None:
            return None
        g = self.checkpoint.geometry
        chunks = -(-fig["tokens"] // self.prefill_chunk)
        fig.update(chunk=self.prefill_chunk, chunks=chunks,
                   experts_read_per_layer_chunk=fig["misses"] / (chunks * g.n_layers),
                   experts_used_per_layer_chunk=(fig["hits"] + fig["misses"]) / (chunks * g.n_layers))
        return fig

    def _text_report(self) -> dict:
        sampling = self.config.sampling
        return {"prompt": self.config.text, "messages": list(self.config.messages) if self.config.messages else None,
                "thinking": self.config.thinking, "output": self.output_text if self.tokenizer is not None else None,
                "sampling": sampling.to_dict() if sampling is not None else "greedy",
                "stop": list(self.config.stop), "stop_at_eos": self.stop_at_eos,
                "finish_reason": self._finish_reason, "prompt_tokens": len(self.prompt),
                "generated_tokens": self._generated}

    def config_dict(self) -> dict:
        d = asdict(self.config)
        d.update(preset=self.preset.name, prompt=list(self.prompt), preset_detail=self.preset.describe(),
                 io_threads=self.io_threads, kernel_threads=self.kernel_threads, backend_requested=self.config.backend)
        return d

    def _write_report(self, report: dict, tmp: Path) -> None:
        """`report` plus the per-token records, written one token at a time to `tmp` (the report's
        .partial, flushed to disk; StateWriter.commit renames it). A write error is a Ds4fError
        naming the report, and leaves no `tmp`."""
        head = json.dumps(report, indent=1)
        try:
            with open(tmp, "w") as f:
                f.write(head[:head.rindex("}")].rstrip() + ',\n "tokens": [')
                for i in range(self._log_tokens.count):
                    f.write(("\n  " if i == 0 else ",\n  ") + json.dumps(asdict(self._log_tokens.record(i))))
                f.write("\n ]\n}\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise write_error(self.report_path, exc) from None

    def _build_report(self, sha: str | None) -> dict:
        snap = self.snapshot()
        fig = self._engine.figures(self._session_nbytes)
        log = self._log_tokens
        rows = log.rows[:log.count]
        cold = log.first
        disk_busy, read_depth = snap.disk_busy_fraction, snap.mean_read_depth
        summary = {
            "tokens": snap.tokens_done, "s_per_token": snap.s_per_token, "s_first_token": snap.s_first_token,
            "gb_per_token": snap.gb_per_token, "gb_first_token": cold.bytes_read / 1e9 if cold else None,
            "eff_read_gbps": snap.eff_read_gbps, "floor_gbps": snap.floor_gbps, "io_efficiency": snap.io_efficiency,
            "hit_rate": snap.hit_rate, "hits": sum(snap.layer_hits), "misses": sum(snap.layer_misses),
            "prefetch_hits": log.prefetch_hits,   # of the hits, those on prefetched experts
            "evictions": sum(snap.layer_evictions), "read_latency_ms": snap.read_latency_ms,
            "stall_s_per_token": snap.stall_s_per_token, "rss_bytes": snap.rss_bytes,
            "rss_budget_bytes": snap.rss_budget_bytes, "wall_s": snap.elapsed_s,
            "prefetch": snap.prefetch or None, "optimum_hit_rate": snap.optimum_hit_rate,
            "policy_hit_rate": snap.policy_hit_rate, "prefetch_hit_share": snap.prefetch_hit_share,
            "regret_pp": snap.regret_pp, "bound": snap.bound, "floor_ratio": snap.floor_ratio,
            "disk_replay": self._replay, "ram_bytes": snap.ram_bytes, "plan_bytes": snap.plan_bytes,
            "kv_bytes": snap.kv_bytes, "context": snap.context,
            "check_s_per_token": snap.check_s_per_token,
            "split": self._time_split(),
            "prefill": self._prefill_report(),
            # warm tokens: the share of time the disk had a read in flight, and the mean number in flight
            "disk_busy_fraction": disk_busy, "mean_read_depth": read_depth,
        }
        return {
            "schema": REPORT_SCHEMA, "run_id": self.id, "state": "done",
            "started_at": self.started_at, "finished_at": self.finished_at,
            "model": str(self.config.model), "checkpoint_kind": self.checkpoint.kind,
            "geometry": self.checkpoint.geometry.to_config(), "config": self.config_dict(),
            "io_mode": self.checkpoint.io_mode, "policy": self.preset.policy,
            "cache": {"budget_bytes": fig.cache_budget_bytes, "capacity_bytes": fig.cache_capacity_bytes,
                      "slots": fig.slots, "slot_nbytes": fig.slot_nbytes},
            "pinned_layers": list(fig.pinned_layers), "floor": asdict(self._floor) if self._floor else None,
            "summary": summary,
            "layers": [{"layer": i, "hits": h, "misses": m, "evictions": e, "prefetch_hits": p,
                        "policy_hit_rate": r}
                       for i, (h, m, e, p, r) in enumerate(zip(snap.layer_hits, snap.layer_misses, snap.layer_evictions,
                                                               snap.layer_prefetch_hits,
                                                               snap.layer_policy_hit_rates()))],
            "backend_by_token": log.backends(),
            "prompt": list(self.prompt),
            "generated": [int(t) for t in rows["next_token_id"][len(self.prompt) - 1:]],
            "text": self._text_report(),
            "events": list(self._events), "events_dropped": self._n_events - len(self._events),
            "state_path": str(self.dump_path), "state_sha256": sha,
        }
