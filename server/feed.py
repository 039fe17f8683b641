"""A run's tokens, handed from the run's thread to the server's event loop.

The run API calls on_token(record) in the run's thread after each token; the feed passes the
record to the loop (call_soon_threadsafe), where it is counted for /metrics and its text is
queued for whoever streams the answer; `observe` (when given) sees each record with the
time.monotonic() its thread handed it over, and whether it was a generated token (the server's
latency figures, ds4f.server.events); the request's figures for vLLM's metric names
(ds4f.server.ecosystem) see them too. Records that arrive before the feed knows its run (the
run's thread can be faster than start_run's return) wait until attach().
"""
from __future__ import annotations

import asyncio
import time

END = None   # what `pieces` yields once the run has ended


class RunFeed:
    def __init__(self, loop: asyncio.AbstractEventLoop, metrics, observe=None):
        self.loop = loop
        self.metrics = metrics
        self.observe = observe      # observe(record, generated: bool, monotonic time), in the loop
        self.request = metrics.figures(None)   # the request's figures for the vllm: series, from attach()
        self.run = None
        self._early: list = []
        self._prefill_steps = 0
        self.pieces: asyncio.Queue = asyncio.Queue()   # text pieces, in order, then END
        self.ended = asyncio.Event()

    def on_token(self, record) -> None:
        """The run's thread, after each token."""
        try:
            self.loop.call_soon_threadsafe(self._take, record, time.monotonic())
        except RuntimeError:   # the loop is closed: the server is gone, nobody to tell
            pass

    def attach(self, run) -> None:
        self.run = run
        self._prefill_steps = len(run.prompt) - 1   # steps that read the prompt; the rest generate
        self.request = self.metrics.figures(run)
        early, self._early = self._early, []
        for record, t in early:
            self._take(record, t)

    def _take(self, record, t: float) -> None:
        if self.run is None:
            self._early.append((record, t))
            return
        generated = record.index >= self._prefill_steps
        self.metrics.token(record, "decode" if generated else "prefill")
        self.request.token(generated, t)
        if self.observe is not None:
            self.observe(record, generated, t)
        if record.text:
            self.pieces.put_nowait(record.text)

    def close(self) -> None:
        """The run has ended and every record it handed over is taken."""
        if not self.ended.is_set():
            self.request.finished()
            self.ended.set()
            self.pieces.put_nowait(END)
