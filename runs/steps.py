"""What each token's record does: its row into the state dump, its figures into the token log,
the text it adds to the output, on_token; and the forward passes counted."""
from __future__ import annotations

from ds4f.engine.engine import Engine
from ds4f.runs.snapshot import TokenRecord


def emit(run, eng: Engine, writer, step: int, token: int, next_token: int, rec, costs: dict, seconds: float,
         prefill: bool) -> None:
    """One step's record: into the state dump, the token log (its costs), on_token; the text
    it adds to the output when it picked a generated token."""
    kernels = run._session.kernels      # what computed the row (in a batch: its own, not the last step's)
    writer.write(token, next_token, kernels.backend, rec.ids, rec.weights, rec.hidden, rec.attn, rec.logits)
    generating = step >= len(run.prompt) - 1
    text = run._output.take(next_token, last=step + 1 == run.n_steps) if generating else ""
    record = TokenRecord(index=step, token_id=token, next_token_id=next_token, seconds=seconds,
                         bytes_read=costs["bytes_read"], hits=costs["hits"], misses=costs["misses"],
                         stall_s=costs["stall_s"], backend=kernels.backend, kernel_threads=kernels.threads,
                         io_threads=eng.io_threads, disk_busy_s=costs["disk_busy_s"],
                         disk_depth_s=costs["disk_depth_s"], reads=costs["reads"],
                         prefetch_hits=costs["prefetch_hits"], attention_s=costs["attention_s"],
                         moe_s=costs["moe_s"], head_s=costs["head_s"], prefill=prefill, text=text)
    with run._lock:
        run._log_tokens.add(record)
    if run.on_token is not None:
        run.on_token(record)


def count_steps(run, res) -> None:
    """The forward passes a step or chunk went in, and those shared with other sequences."""
    with run._lock:
        run._passes += res.batch_steps
        run._shared_passes += res.batch_shared
