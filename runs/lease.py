"""The engine a run computes on: taken at its start (its host's, loaded or reused, else one of its
own) with the run's session opened on it, and given back at its end with its last figures kept."""
from __future__ import annotations

import time

from ds4f.engine.engine import Engine
from ds4f.engine.runtime.memory import release_freed_memory


def take_engine(run):
    """The run's engine and its session on it, the run's figures of both recorded."""
    eng = load_engine(run)
    sharing = eng.sharing
    run._cache_at_start = 0 if run.config.cold_start and not sharing else eng.cache.resident
    session = eng.new_session(run.prefill_chunk, cold=run.config.cold_start)
    run._session = session
    if run.engines is not None and run.engines.parallel > 1:
        # its own kernels beside the others' (engine.batch: a step computes with one setting)
        session.kernels = eng.kernel_settings(run._backend, run.kernel_threads)
        if sharing and eng.io_threads != run.io_threads:
            run._log(f"I/O threads: the engine's {eng.io_threads} (the sequences stepping on it share"
                     f" its reader), not {run.io_threads}")
    if sharing and run.config.cold_start:
        run._log("cold start: not while other sequences step on the engine; on the cache as it is")
    run._log(f"expert cache warm: {run._cache_at_start} experts from earlier runs" if run._cache_at_start
             else "expert cache cold: empty at the start")
    with run._lock:
        run._engine, run._session_nbytes = eng, session.nbytes
        run._kv_bytes, run._context = session.kv_nbytes, session.context if session.kv else 0
        run._backend, run.kernel_threads = session.kernels.backend, session.kernels.threads
    return eng, session


def load_engine(run) -> Engine:
    """The host's engine (loaded or reused), else one of the run's own."""
    if run.engines is not None:
        t0 = time.perf_counter()
        loads = run.engines.loads
        eng = run.engines.engine_for(run.checkpoint, run.preset, run.io_threads, run.kernel_threads,
                                     run._backend)
        run.checkpoint, run._hosted = eng.ckpt, True
        run._baseline_rss = run.engines.baseline_rss  # the budget counts the engine once
        how = "loaded" if run.engines.loads > loads else "reused"
        run._log(f"engine {how} in {time.perf_counter() - t0:.2f} s")
    else:
        eng = Engine(run.checkpoint, run.preset, run.io_threads, run.kernel_threads, run._backend)
    for note in eng.notes:
        run._log(note)
    return eng


def release_engine(run) -> None:
    """The run's end, whatever it was: the engine's last figures kept, the engine and the
    checkpoint closed unless a host keeps them, its place in the runs directory given up."""
    if run._reservation is not None:
        run._reservation.release()
    if run._session is not None:
        run._session.leave()
    if run._engine is not None:
        run._final_layer_prefetch_hits = tuple(run._engine.streamer.prefetch_layer_hits)
        run._final_figures = run._engine.figures(run._session_nbytes, run._session)
        if not run._hosted:
            run._engine.close()
        run._engine = None
    # the run's record stays (status, reports) but not what it computed with: its session's
    # buffers and KV cache, and the states it marked for the prefix cache, go now
    if run._session is not None:
        run._session.close()
    if run._generation is not None:
        run._generation.release()
    release_freed_memory()
    if not run._hosted:
        run.checkpoint.close()
