"""The reader: a pool of I/O threads that fill cache slots (and trunk buffers) from disk.

Each request is one call of the checkpoint's thread-safe read (one O_DIRECT pread for the
ds4f layout). Requests for the same expert are coalesced by the cache itself: a key maps
to one slot, and a second request for a key still in flight waits on the same slot.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor


class ReadStats:
    """Counters updated by the I/O threads; read under the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads = 0
        self.bytes = 0
        self.latency_s = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.reads += 1
            self.bytes += nbytes
            self.latency_s += seconds

    def totals(self) -> tuple[int, int, float]:
        with self.lock:
            return self.reads, self.bytes, self.latency_s


class Reader:
    def __init__(self, checkpoint, threads: int) -> None:
        self.checkpoint = checkpoint
        self.threads = threads
        self.expert_stats = ReadStats()
        self.trunk_stats = ReadStats()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ds4f-io")

    def resize(self, threads: int) -> None:
        """Change the number of I/O threads (between tokens: nothing is in flight)."""
        if threads != self.threads:
            self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ds4f-io")
            self.threads = threads

    def read_expert(self, slot, layer: int, expert: int, buf, landed: threading.Event) -> None:
        """Fill slot from disk in the background; slot.ready (then `landed`) is set when done or failed."""

        def job() -> None:
            t0 = time.perf_counter()
            try:
                n = self.checkpoint.read_expert(layer, expert, buf)
                self.expert_stats.add(n, time.perf_counter() - t0)
            except BaseException as exc:  # handed to the compute thread, which re-raises it
                slot.error = exc
            finally:
                slot.ready.set()
                landed.set()

        self._pool.submit(job)

    def read_trunk_layer(self, layer: int, buf) -> Future:
        """Read one layer's MoE trunk into buf; the future gives its tensors (views into buf)."""

        def job():
            t0 = time.perf_counter()
            tensors = self.checkpoint.read_trunk_layer(layer, buf)
            self.trunk_stats.add(self.checkpoint.trunk_layer_nbytes(layer), time.perf_counter() - t0)
            return tensors

        return self._pool.submit(job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
