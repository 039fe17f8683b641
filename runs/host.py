"""The engine a console or a server keeps loaded between runs."""
from __future__ import annotations

import dataclasses
import threading

import psutil

from ds4f.engine.config import Preset
from ds4f.engine.engine import Engine


class EngineHost:
    """Keeps one loaded Engine between runs, as a console or a server does: a run on the same
    checkpoint (same files, unchanged) with the same preset reuses it (its pinned trunk, routers,
    expert-cache slots and I/O threads, its prefix cache) instead of loading it again. Each run
    starts with its own counters, on the experts the cache holds from the runs before, unless
    it asks for a cold start (RunConfig.cold_start: an empty cache, the figures of a fresh
    engine); its state dump is a fresh engine's either way. Kernel backend and threads, and the
    I/O thread count, are set per run.
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
        return dataclasses.replace(cache.stats) if cache is not None else None

    def close(self) -> None:
        with self._lock:
            old, self._engine, self._key = self._engine, None, None
        if old is not None:
            old.close()
            old.ckpt.close()
