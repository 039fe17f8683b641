"""The runs active in this process, oldest first: started and not yet ended. One at a time (the
kernel backend and thread count are process-wide settings of the native library), unless the
runs share an EngineHost made for several sequences (EngineHost(parallel=N)): up to N runs then
step together on its engine (engine.batch), each with its own session, files and figures."""
from __future__ import annotations

import threading

from ds4f.errors import Ds4fError

_lock = threading.Lock()
_runs: list = []            # the runs started and not yet ended, oldest first


def active_run():
    """The oldest run still active (None: none)."""
    live = active_runs()
    return live[0] if live else None


def active_runs() -> list:
    with _lock:
        return [r for r in _runs if not r.finished]


def admit(engines, make):
    """The run make() makes, now active; a Ds4fError (kind busy, make() not called) when another
    run is active, unless they step together on `engines` and it has room for one more."""
    with _lock:
        live = [r for r in _runs if not r.finished]
        parallel = engines.parallel if engines is not None else 1
        if live and (parallel < 2 or len(live) >= parallel or any(r.engines is not engines for r in live)):
            more = f" (and {len(live) - 1} more)" if len(live) > 1 else ""
            raise Ds4fError(f"run {live[0].id}{more} is still active; stop it first"
                            + (f": {parallel} sequences step together at most" if parallel > 1 else ""), kind="busy")
        run = make()
        _runs[:] = live + [run]
    return run


def forget(run) -> None:
    """The run no longer active (ended, or refused before its thread started)."""
    with _lock:
        if run in _runs:
            _runs.remove(run)


def sharing(run) -> list[str]:
    """The ids of the other active runs stepping on `run`'s engine (EngineHost(parallel=N)), or
    starting to; [] when it steps alone."""
    if run.engines is None or run.engines.parallel < 2:
        return []
    with _lock:
        return [r.id for r in _runs if r is not run and r.engines is run.engines and not r.finished]
