"""The reader: a pool of I/O threads that fill cache slots (and trunk buffers) from disk.

Each request is one call of the checkpoint's thread-safe read (one O_DIRECT pread for the
ds4f layout). Requests for the same expert are coalesced by the cache itself: a key maps
to one slot, and a second request for a key still in flight waits on the same slot.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future


class ReadJob:
    """One expert read. It runs at most once, however often it is queued, and can be
    cancelled while it waits (then it never touches its slot, which may be reused)."""

    def __init__(self, reader: "Reader", slot, layer: int, expert: int, buf, landed: threading.Event) -> None:
        self.reader, self.slot, self.layer, self.expert, self.buf, self.landed = reader, slot, layer, expert, buf, landed
        self._lock = threading.Lock()
        self.started = False
        self.cancelled = False

    def cancel(self) -> bool:
        """Cancel if not started yet; True if it will never read."""
        with self._lock:
            if not self.started:
                self.cancelled = True
            return self.cancelled

    def __call__(self) -> None:
        with self._lock:
            if self.started or self.cancelled:
                return
            self.started = True
        t0 = time.perf_counter()
        try:
            n = self.reader.checkpoint.read_expert(self.layer, self.expert, self.buf)
            self.reader.expert_stats.add(n, time.perf_counter() - t0)
        except BaseException as exc:  # handed to the compute thread, which re-raises it
            self.slot.error = exc
        finally:
            self.slot.ready.set()
            self.landed.set()


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


DEMAND, PREFETCH = 0, 1  # read priorities: what the current layer waits for goes first


class Reader:
    """I/O threads taking read jobs from one priority queue: demand reads (the experts and
    trunk the forward pass is waiting for) always go before prefetch reads."""

    def __init__(self, checkpoint, threads: int) -> None:
        self.checkpoint = checkpoint
        self.expert_stats = ReadStats()
        self.trunk_stats = ReadStats()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._workers: list[threading.Thread] = []
        self._start(threads)

    @property
    def threads(self) -> int:
        return len(self._workers)

    def _start(self, n: int) -> None:
        for i in range(n):
            t = threading.Thread(target=self._work, name=f"ds4f-io-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def _stop(self) -> None:
        for _ in self._workers:
            self._queue.put((99, next(self._seq), None))  # after every queued read
        for t in self._workers:
            t.join()
        self._workers = []

    def _work(self) -> None:
        while True:
            _prio, _seq, job = self._queue.get()
            if job is None:
                return
            job()

    def resize(self, threads: int) -> None:
        """Change the number of I/O threads; queued reads finish first."""
        if threads != self.threads:
            self._stop()
            self._start(threads)

    def read_expert(self, slot, layer: int, expert: int, buf, landed: threading.Event,
                    priority: int = DEMAND) -> "ReadJob":
        """Fill slot from disk in the background; slot.ready (then `landed`) is set when done or failed."""
        job = ReadJob(self, slot, layer, expert, buf, landed)
        self._queue.put((priority, next(self._seq), job))
        return job

    def promote(self, job: "ReadJob") -> None:
        """Queue a waiting prefetch again as a demand read; whichever copy starts first reads."""
        if not job.started:
            self._queue.put((DEMAND, next(self._seq), job))

    def read_trunk_layer(self, layer: int, buf) -> Future:
        """Read one layer's MoE trunk into buf; the future gives its tensors (views into buf)."""
        future: Future = Future()

        def job() -> None:
            t0 = time.perf_counter()
            try:
                tensors = self.checkpoint.read_trunk_layer(layer, buf)
                self.trunk_stats.add(self.checkpoint.trunk_layer_nbytes(layer), time.perf_counter() - t0)
                future.set_result(tensors)
            except BaseException as exc:
                future.set_exception(exc)

        self._queue.put((DEMAND, next(self._seq), job))
        return future

    def close(self) -> None:
        self._stop()
