"""What each token's record does: its row into the state dump, its figures into the token log,
the text it adds to the output, on_token; and the forward passes its step went in, counted."""
from __future__ import annotations

import threading

from ds4f.engine.costs import Costs
from ds4f.engine.engine import Engine
from ds4f.runs.output import RunOutput
from ds4f.runs.snapshot import TokenLog, TokenRecord


class Steps:
    """A run's token log (every token's figures, sized up front) and its forward passes, written
    by its thread (emit, count), read from any thread under the run's lock."""

    def __init__(self, n_steps: int, prompt_tokens: int, output: RunOutput, lock: threading.Lock,
                 on_token=None) -> None:
        self.log = TokenLog(n_steps)
        self.passes = self.shared_passes = 0          # forward passes, and those shared (engine.batch)
        self._n_steps, self._prompt_tokens = n_steps, prompt_tokens
        self._output, self._lock, self._on_token = output, lock, on_token

    def emit(self, eng: Engine, session, writer, step: int, token: int, next_token: int, rec, costs: Costs,
             seconds: float, prefill: bool) -> None:
        """One step's record: into the state dump, the token log (its costs), on_token; the text
        it adds to the output when it picked a generated token."""
        kernels = session.kernels      # what computed the row (in a batch: its own, not the last step's)
        writer.write(token, next_token, kernels.backend, rec.ids, rec.weights, rec.hidden, rec.attn, rec.logits,
                     compact=rec.compact, top=rec.top)
        generating = step >= self._prompt_tokens - 1
        text = self._output.take(next_token, last=step + 1 == self._n_steps) if generating else ""
        record = TokenRecord.of(costs, index=step, token_id=token, next_token_id=next_token, seconds=seconds,
                                backend=kernels.backend, kernel_threads=kernels.threads, io_threads=eng.io_threads,
                                prefill=prefill, text=text)
        with self._lock:
            self.log.add(record)
        if self._on_token is not None:
            self._on_token(record)

    def count(self, costs: Costs) -> None:
        """The forward passes a step or chunk went in, and those shared with other sequences."""
        with self._lock:
            self.passes += costs.batch_steps
            self.shared_passes += costs.batch_shared
