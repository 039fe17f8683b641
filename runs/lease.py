"""The engine a run computes on: taken at its start (its host's, loaded or reused, else one of its
own) with the run's session opened on it, and given back at its end with its last figures kept."""
from __future__ import annotations

import time

from ds4f.engine.engine import Engine, EngineFigures
from ds4f.engine.model.records import RECORDS_OF_DUMP
from ds4f.engine.runtime.memory import release_freed_memory


class Lease:
    """A run's engine and session (take, release: its thread) and their figures (any thread)."""

    def __init__(self, run) -> None:
        self._run = run
        self.engine: Engine | None = None          # released when the run ends (its memory goes)
        self.session = None
        self.hosted = False    # the engine and its checkpoint belong to the run's host and outlive the run
        self.session_nbytes = 0                     # the session's buffers and KV cache, counted as resident
        self.kv_bytes, self.context = 0, 0          # the session's KV cache and the positions it holds
        self.cache_at_start = 0                     # experts the cache held when the run began (warm start)
        self.final_figures: EngineFigures | None = None
        self.final_layer_prefetch_hits: tuple[int, ...] = ()   # the streamer's, when the engine is released

    def figures(self) -> EngineFigures | None:
        """The engine's figures: live while the run holds it, else its last ones (None: none yet)."""
        eng = self.engine
        return eng.figures(self.session_nbytes, self.session) if eng is not None else self.final_figures

    def take(self):
        """The run's engine and its session on it, the run's figures of both recorded."""
        run = self._run
        eng = self._load()
        sharing = eng.sharing
        self.cache_at_start = 0 if run.config.cold_start and not sharing else eng.cache.resident
        session = eng.new_session(run.prefill_chunk, cold=run.config.cold_start, records=RECORDS_OF_DUMP[run.dump_mode])
        self.session = session
        if run.engines is not None and run.engines.parallel > 1:
            # its own kernels beside the others' (engine.batch: a step computes with one setting)
            session.kernels = eng.kernel_settings(run._backend, run.kernel_threads)
            if sharing and eng.io_threads != run.io_threads:
                run._log(f"I/O threads: the engine's {eng.io_threads} (the sequences stepping on it share"
                         f" its reader), not {run.io_threads}")
        if sharing and run.config.cold_start:
            run._log("cold start: not while other sequences step on the engine; on the cache as it is")
        run._log(f"expert cache warm: {self.cache_at_start} experts from earlier runs" if self.cache_at_start
                 else "expert cache cold: empty at the start")
        with run._lock:
            self.engine, self.session_nbytes = eng, session.nbytes
            self.kv_bytes, self.context = session.kv_nbytes, session.context if session.kv else 0
            run._backend, run.kernel_threads = session.kernels.backend, session.kernels.threads
        return eng, session

    def _load(self) -> Engine:
        """The host's engine (loaded or reused), else one of the run's own."""
        run = self._run
        if run.engines is not None:
            t0 = time.perf_counter()
            loads = run.engines.loads
            eng = run.engines.engine_for(run.checkpoint, run.preset, run.io_threads, run.kernel_threads,
                                         run._backend)
            run.checkpoint, self.hosted = eng.ckpt, True
            run._baseline_rss = run.engines.baseline_rss  # the budget counts the engine once
            how = "loaded" if run.engines.loads > loads else "reused"
            run._log(f"engine {how} in {time.perf_counter() - t0:.2f} s")
        else:
            eng = Engine(run.checkpoint, run.preset, run.io_threads, run.kernel_threads, run._backend)
        for note in eng.notes:
            run._log(note)
        return eng

    def release(self) -> None:
        """The run's end, whatever it was: the engine's last figures kept, the engine and the
        checkpoint closed unless a host keeps them, its place in the runs directory given up."""
        run = self._run
        if run._reservation is not None:
            run._reservation.release()
        if self.session is not None:
            self.session.leave()
        if self.engine is not None:
            self.final_layer_prefetch_hits = tuple(self.engine.streamer.prefetch_layer_hits)
            self.final_figures = self.engine.figures(self.session_nbytes, self.session)
            if not self.hosted:
                self.engine.close()
            self.engine = None
        # the run's record stays (status, reports) but not what it computed with: its session's
        # buffers and KV cache, and the states it marked for the prefix cache, go now
        if self.session is not None:
            self.session.close()
        if run._generation is not None:
            run._generation.release()
        release_freed_memory()
        if not self.hosted:
            run.checkpoint.close()
