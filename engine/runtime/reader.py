"""The reader: a pool of I/O threads that fill cache slots (and trunk buffers) from disk.

Each request is one call of the checkpoint's thread-safe read (one O_DIRECT pread for the
ds4f layout). Requests for the same expert are coalesced by the cache itself: a key maps
to one slot, and a second request for a key still in flight waits on the same slot.
Prefetch guesses have a lane of their own that reads only while the disk is otherwise idle,
and an Occupancy records how busy the disk was kept (what prefetch could still use).
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from concurrent.futures import Future

import numpy as np


class _Job:
    """A read that runs at most once, however often it is queued (promotion queues it again),
    and can be cancelled while it waits. `landed` is set when it completes or fails."""

    def __init__(self, reader: "Reader", landed: threading.Event) -> None:
        self.reader, self.landed = reader, landed
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
        self.reader.note_start(self)
        self.reader.occupancy.began()
        try:
            self.run()
        finally:
            self.reader.occupancy.ended()
            self.landed.set()

    def run(self) -> None:
        raise NotImplementedError


class ReadJob(_Job):
    """One expert read into its cache slot (slot.ready is set when done or failed)."""

    def __init__(self, reader: "Reader", slot, layer: int, expert: int, buf, landed: threading.Event) -> None:
        super().__init__(reader, landed)
        self.slot, self.layer, self.expert, self.buf = slot, layer, expert, buf

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            ck = self.reader.checkpoint
            n = ck.read_expert(self.layer, self.expert, self.buf)
            t1 = time.perf_counter()
            self.reader.expert_stats.add(n, t1 - t0)
            if ck.check_expert(self.layer, self.expert, self.buf):
                self.reader.check_stats.add(n, time.perf_counter() - t1)
        except BaseException as exc:  # handed to the compute thread, which re-raises it
            self.slot.error = exc
        finally:
            self.slot.ready.set()


class TrunkJob(_Job):
    """One layer's MoE trunk read into a buffer; result() gives its tensors (views into buf)."""

    def __init__(self, reader: "Reader", layer: int, buf, landed: threading.Event) -> None:
        super().__init__(reader, landed)
        self.layer, self.buf = layer, buf
        self.future: Future = Future()

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            ck = self.reader.checkpoint
            tensors = ck.read_trunk_layer(self.layer, self.buf)
            n = ck.trunk_layer_nbytes(self.layer)
            t1 = time.perf_counter()
            self.reader.trunk_stats.add(n, t1 - t0)
            if ck.check_trunk_layer(self.layer, self.buf):
                self.reader.check_stats.add(n, time.perf_counter() - t1)
            self.future.set_result(tensors)
        except BaseException as exc:
            self.future.set_exception(exc)

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> dict:
        return self.future.result()


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


class Occupancy:
    """How busy the disk was kept: time with at least one read in flight (busy_s) and the
    time integral of the number in flight (depth_s; depth_s / wall = mean queue depth).
    Prefetch can only use the time the disk is idle or shallow, so these bound its gain."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.busy_s = 0.0
        self.depth_s = 0.0
        self._since = time.perf_counter()

    def _advance(self, now: float) -> None:
        dt = now - self._since
        if self.in_flight:
            self.busy_s += dt
            self.depth_s += self.in_flight * dt
        self._since = now

    def began(self) -> None:
        with self.lock:
            self._advance(time.perf_counter())
            self.in_flight += 1

    def ended(self) -> None:
        with self.lock:
            self._advance(time.perf_counter())
            self.in_flight -= 1

    def totals(self) -> tuple[float, float]:
        """(busy_s, depth_s) up to now."""
        with self.lock:
            self._advance(time.perf_counter())
            return self.busy_s, self.depth_s


# Read priorities: what the forward pass waits for now, then the next unpinned trunk
# layer's read-ahead (needed a layer later). Router-lookahead guesses (PREFETCH) never enter
# that queue: they wait for the prefetch lane.
DEMAND, AHEAD, PREFETCH = 0, 1, 2


class Reader:
    """I/O threads taking read jobs from one priority queue (demand reads, then trunk
    read-ahead), and one prefetch lane that starts a guess only while the disk is otherwise
    idle: nothing queued and fewer than PREFETCH_GATE reads in flight. A started read cannot
    be interrupted, so a guess started on a busy disk delays the demand reads behind it;
    a guess the lane never started costs no read (it is promoted if needed, else cancelled)."""

    PREFETCH_GATE = 1

    def __init__(self, checkpoint, threads: int) -> None:
        self.checkpoint = checkpoint
        self.expert_stats = ReadStats()
        self.trunk_stats = ReadStats()
        self.check_stats = ReadStats()      # crc32 checks of expert records and trunk layers, in the I/O threads
        self._trace_lock = threading.Lock()
        # a ring of the last TRACE_READS reads: (0 expert | 1 trunk, layer, expert or -1), fixed size
        self._trace = np.zeros((self.TRACE_READS, 3), np.int32)
        self.started_reads = 0
        self._guesses: collections.deque = collections.deque()
        self._lane_cv = threading.Condition()
        self._closing = False
        self.occupancy = Occupancy()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._workers: list[threading.Thread] = []
        self._start(threads)
        self._lane = threading.Thread(target=self._prefetch_lane, name="ds4f-io-prefetch", daemon=True)
        self._lane.start()

    # The most recent reads, in the order they started: ("expert", layer, expert) or ("trunk", layer, -1).
    # A run's disk figures replay them (same records, order and queue depth, no compute).
    TRACE_READS = 1 << 16

    def note_start(self, job: "_Job") -> None:
        expert = isinstance(job, ReadJob)
        with self._trace_lock:
            self._trace[self.started_reads % self.TRACE_READS] = (0 if expert else 1, job.layer,
                                                                  job.expert if expert else -1)
            self.started_reads += 1

    @property
    def trace_nbytes(self) -> int:
        return self._trace.nbytes

    def recent_reads(self, n: int) -> list[tuple[str, int, int]] | None:
        """The last n reads started, oldest first, as ("expert", layer, expert) or ("trunk", layer,
        -1); None if the trace no longer holds n."""
        with self._trace_lock:
            if n > min(self.started_reads, self.TRACE_READS):
                return None
            idx = np.arange(self.started_reads - n, self.started_reads) % self.TRACE_READS
            rows = self._trace[idx].tolist()
        return [("expert" if kind == 0 else "trunk", layer, expert) for kind, layer, expert in rows]

    def reset_stats(self) -> None:
        """Zero the read counters and the occupancy (a new run on the same reader)."""
        self.expert_stats = ReadStats()
        self.trunk_stats = ReadStats()
        self.check_stats = ReadStats()
        with self._trace_lock:
            self.started_reads = 0
        with self.occupancy.lock:
            self.occupancy.busy_s = self.occupancy.depth_s = 0.0

    def _wake_lane(self) -> None:
        with self._lane_cv:
            self._lane_cv.notify()

    def _prefetch_lane(self) -> None:
        while True:
            with self._lane_cv:
                while True:
                    if self._closing:
                        return
                    while self._guesses and (self._guesses[0].started or self._guesses[0].cancelled):
                        self._guesses.popleft()  # promoted and read by a worker, or cancelled
                    # unfinished_tasks, not empty(): a read a worker has taken but not begun counts
                    if (self._guesses and self.occupancy.in_flight < self.PREFETCH_GATE
                            and self._queue.unfinished_tasks == 0):
                        job = self._guesses.popleft()
                        break
                    self._lane_cv.wait(0.05)  # woken when a worker's read is done or a guess arrives; the timeout is a safety net
            job()

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
            try:
                if job is None:
                    return
                job()
            finally:
                self._queue.task_done()
            self._wake_lane()

    def resize(self, threads: int) -> None:
        """Change the number of I/O threads; queued reads finish first."""
        if threads != self.threads:
            self._stop()
            self._start(threads)

    def read_expert(self, slot, layer: int, expert: int, buf, landed: threading.Event,
                    priority: int = DEMAND) -> "ReadJob":
        """Fill slot from disk in the background; slot.ready (then `landed`) is set when done or failed."""
        job = ReadJob(self, slot, layer, expert, buf, landed)
        if priority == PREFETCH:
            with self._lane_cv:
                self._guesses.append(job)
                self._lane_cv.notify()
        else:
            self._queue.put((priority, next(self._seq), job))
        return job

    def promote(self, job: _Job) -> None:
        """Queue a waiting read again as a demand read; whichever copy starts first reads."""
        if not job.started:
            self._queue.put((DEMAND, next(self._seq), job))

    def read_trunk_layer(self, layer: int, buf, landed: threading.Event, priority: int = AHEAD) -> TrunkJob:
        """Read one layer's MoE trunk into buf in the background (`landed` is set when done)."""
        job = TrunkJob(self, layer, buf, landed)
        self._queue.put((priority, next(self._seq), job))
        return job

    def close(self) -> None:
        with self._lane_cv:
            self._closing = True
            self._lane_cv.notify()
        self._lane.join()
        self._stop()
