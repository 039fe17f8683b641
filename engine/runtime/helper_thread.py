"""Work beside the compute thread: one helper thread, made on first use and shared by the
process's engines (one engine computes at a time). model.forward hands it the first half of the
rows of hc_pre_rows, hc_post_rows and the attention's output projection while the compute thread
does the second; the model code itself has no threads, only `beside(fn, *args)`, whose result()
waits for the work and raises its error."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock

_POOL: ThreadPoolExecutor | None = None
_LOCK = Lock()


def beside(fn, *args) -> Future:
    """fn(*args) on the helper thread, in submission order."""
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds4f-beside")
    return _POOL.submit(fn, *args)
