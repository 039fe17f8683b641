"""A checkpoint whose reads can be held: every read is the real one (real files, the I/O threads'
own calls), logged in the order reads start and end, and a read of a held key waits until the test
lets it go. What the reader and the streamer do in between is then seen, not timed."""
from __future__ import annotations

import threading

import numpy as np

WAIT_S = 30.0    # a bound on what must happen (a read starting, a slot landing); never reached when all is well
QUIET_S = 0.3    # how long a test gives what must NOT happen (a guess starting on a busy disk) to show itself


class HeldReads:
    def __init__(self, checkpoint) -> None:
        self.ck = checkpoint
        self.log: list[tuple[str, tuple]] = []     # ("start" | "end", key), in the order they happened
        self._lock = threading.Lock()
        self._gates: dict[tuple, threading.Event] = {}
        self._started: dict[tuple, threading.Event] = {}

    def hold(self, *keys: tuple) -> None:
        for key in keys:
            self._gates[key] = threading.Event()

    def release(self, key: tuple) -> None:
        self._gates[key].set()

    def started(self, key: tuple, timeout: float = WAIT_S) -> bool:
        return self._event(key).wait(timeout)

    def reads_of(self, key: tuple) -> int:
        with self._lock:
            return sum(1 for what, k in self.log if what == "start" and k == key)

    def index(self, what: str, key: tuple) -> int:
        with self._lock:
            return self.log.index((what, key))

    def _event(self, key: tuple) -> threading.Event:
        with self._lock:
            return self._started.setdefault(key, threading.Event())

    def _read(self, key: tuple, read):
        with self._lock:
            self.log.append(("start", key))
        self._event(key).set()
        gate = self._gates.get(key)
        if gate is not None:
            gate.wait(WAIT_S)
        try:
            return read()
        finally:
            with self._lock:
                self.log.append(("end", key))

    # what the reader calls
    def read_expert(self, layer: int, expert: int, buf, check: bool = False) -> int:
        return self._read((layer, expert), lambda: self.ck.read_expert(layer, expert, buf, check))

    def read_trunk_layer(self, layer: int, buf):
        return self._read(("trunk", layer), lambda: self.ck.read_trunk_layer(layer, buf))

    def __getattr__(self, name):
        return getattr(self.ck, name)


def record(ck, layer: int, expert: int) -> np.ndarray:
    """An expert's record as the checkpoint reads it, into a buffer of its own."""
    buf = np.zeros(ck.slot_nbytes, np.uint8)
    ck.read_expert(layer, expert, buf)
    return buf[:ck.expert_nbytes]
