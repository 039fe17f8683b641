"""A run's live switches: the backend, kernel threads and I/O threads asked for while it runs,
checked when asked, landing at the next token boundary, each change said in the run's log."""
from __future__ import annotations

from ds4f.engine.engine import Engine
from ds4f.runs.config import check_backend, check_threads


class Switches:
    """What a run was asked to switch to and has not yet (ask: any thread; apply: its thread)."""

    def __init__(self, run) -> None:
        self._run = run
        self._pending: dict = {}

    def ask(self, backend: str | None, kernel_threads: int | None, io_threads: int | None,
            engine_wide: bool) -> None:
        """Checked now (a Ds4fError if out of range), kept until the next token boundary. Among
        sequences stepping together (EngineHost(parallel=N)) the backend and kernel threads are the
        run's own (its rows go in steps of their own setting); the I/O threads are the engine's
        reader, every sequence's: switched only engine_wide (an operator switching every run), else
        refused where it lands if other runs step on the engine then (said in the run's log)."""
        if backend is not None:
            check_backend(backend)
        check_threads(kernel_threads=kernel_threads, io_threads=io_threads)
        with self._run._lock:
            for name, value in (("backend", backend), ("kernel_threads", kernel_threads),
                                ("io_threads", io_threads)):
                if value is not None:
                    self._pending[name] = value
            if io_threads is not None:
                self._pending["engine_wide"] = engine_wide

    def apply(self, eng: Engine, step: int) -> None:
        """What was asked since the last token boundary, switched before step `step`."""
        run = self._run
        with run._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        session = run._lease.session
        batched = session is not None and session.batcher is not None
        old = (run._backend, run.kernel_threads, eng.io_threads)
        backend = pending.get("backend", run._backend)
        threads = pending.get("kernel_threads", old[1])
        if batched:       # its own: its rows go in steps of their setting (engine.batch), the others' keep theirs
            session.kernels = eng.kernel_settings(backend, threads)
        else:
            eng.set_kernels(backend, threads)
        if "io_threads" in pending:
            others = run.sharing_with() if batched and not pending.get("engine_wide") else []
            if others:
                run._log(f"token {step}: I/O threads {pending['io_threads']} not switched: the engine's reader is"
                         f" shared with run{'s' if len(others) > 1 else ''} {', '.join(others)} stepping together"
                         f" with this one (POST /operator/threads switches every run's)")
            else:
                eng.set_io_threads(pending["io_threads"])
        kernels = session.kernels if session is not None else eng.kernels
        with run._lock:
            run._backend, run.kernel_threads, run.io_threads = kernels.backend, kernels.threads, eng.io_threads
        new = (run._backend, run.kernel_threads, eng.io_threads)
        for label, a, b in zip(("backend", "kernel threads", "I/O threads"), old, new):
            if a != b:
                run._log(f"token {step}: {label} {a} -> {b}")
