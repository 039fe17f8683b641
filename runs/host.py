"""The engine a console or a server keeps loaded between runs."""
from __future__ import annotations

import threading

import psutil

from ds4f.engine.config import Preset
from ds4f.engine.engine import Engine
from ds4f.engine.batch import step_rows
from ds4f.errors import Ds4fError


class EngineHost:
    """Keeps one loaded Engine between runs, as a console or a server does: a run on the same
    checkpoint (same files, unchanged) with the same preset reuses it (its pinned trunk, routers,
    expert-cache slots and I/O threads, its prefix cache) instead of loading it again. Each run
    starts with its own counters, on the experts the cache holds from the runs before, unless
    it asks for a cold start (RunConfig.cold_start: an empty cache, the figures of a fresh
    engine); its state dump is a fresh engine's either way. Kernel backend and threads, and the
    I/O thread count, are set per run.
    Runs that share a host run one at a time (the process allows one active run), unless the host
    is made for `parallel` sequences: up to that many runs then step together on its engine
    (engine.batch), which keeps the settings of the first while others join."""

    def __init__(self, parallel: int = 1) -> None:
        if parallel < 1:
            raise Ds4fError(f"parallel: at least 1 sequence, got {parallel}", param="parallel")
        self.parallel = parallel
        self._lock = threading.Lock()
        self._loading = threading.Lock()   # one run at a time finds, reuses or loads the engine
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
        new one (the old one is closed). The checkpoint handed in is closed if the host keeps its own.
        Runs starting together (a host for several sequences) wait for one another here, so that
        they load one engine and share it."""
        with self._loading:
            return self._engine_for(checkpoint, preset, io_threads, kernel_threads, backend)

    def _engine_for(self, checkpoint, preset: Preset, io_threads: int, kernel_threads: int, backend: str) -> "Engine":
        key = self.key(checkpoint, preset)
        with self._lock:
            if self._engine is not None and self._key == key:
                checkpoint.close()
                self._engine.reset_for_run(io_threads, kernel_threads, backend)
                return self._batched(self._engine, preset)
            if self._engine is not None and self._engine.sharing:
                checkpoint.close()
                raise Ds4fError(f"{self._engine.batcher.members} sequences step on the loaded engine"
                                f" ({self._key[0]}, preset {self._key[-1].name}); a run on another model or"
                                f" preset waits until they end", kind="busy")
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
            return self._batched(engine, preset)

    def _batched(self, engine: Engine, preset: Preset) -> Engine:
        """The engine with its batcher when the host is made for several sequences: steps of
        `parallel` decode rows and a prompt chunk."""
        if self.parallel > 1:
            engine.use_batcher(self.parallel, step_rows(self.parallel, preset.prefill_chunk))
        return engine

    def kept_tokens(self, checkpoint) -> list[tuple[int, ...]] | None:
        """The token ids of the states the loaded engine's prefix cache keeps, when that engine is
        this checkpoint's and has one; None otherwise."""
        with self._lock:
            engine = self._engine
            same = engine is not None and self._key is not None and self._key[0] == str(checkpoint.path.resolve())
        cache = engine.prefix_cache if same else None
        return cache.kept_tokens() if cache is not None else None

    def prefix_cache_stats(self):
        """The loaded engine's prefix cache figures (engine.prefix_cache.CacheStats), or None."""
        with self._lock:
            cache = self._engine.prefix_cache if self._engine is not None else None
        return cache.figures() if cache is not None else None

    def set_parallel(self, parallel: int) -> None:
        """Sequences the next runs step together (the benchmarks change it between workloads);
        refused while runs share the loaded engine."""
        if parallel < 1:
            raise Ds4fError(f"parallel: at least 1 sequence, got {parallel}", param="parallel")
        with self._lock:
            if self._engine is not None and self._engine.sharing:
                raise Ds4fError("parallel: not while sequences step on the loaded engine", kind="busy")
            self.parallel = parallel
            if self._engine is not None and parallel > 1:
                self._batched(self._engine, self._key[-1])

    def batch_figures(self):
        """The loaded engine's batcher's figures (engine.batch.BatchFigures), or None."""
        with self._lock:
            b = self._engine.batcher if self._engine is not None else None
        return b.figures() if b is not None else None

    def close(self) -> None:
        with self._lock:
            old, self._engine, self._key = self._engine, None, None
        if old is not None:
            old.close()
            old.ckpt.close()
