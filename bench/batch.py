"""`ds4f bench batch`: several sequences decoded together (engine.batch) against taking turns.

For each count of concurrent sequences (1, 2, 4, 8) and each cache state (warm: the cache holds
what an identical workload left; cold: emptied when the first sequence starts), the same k
requests (the bench checkpoint's sample prompts, `gen` tokens each) run twice in the same
invocation: all at once on an engine host made for k sequences, and one after another (taking
turns, as a server of one sequence answers them). The figures: aggregate tokens per second
(generated tokens of all sequences over the wall time from the first start to the last end),
per-sequence tokens per second and time to first token (medians), disk GB read per generated
token (prompt tokens' reads included), and the union of experts per layer per step; the ratio batched / turns is the one that
holds on a noisy machine. Reads use O_DIRECT where the filesystem allows; the cold runs start on
an empty cache, so no figure is flattered by the engine's cache (the page cache is bypassed).
"""
from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

from ds4f.errors import Ds4fError
from ds4f.bench.engine import Log, _quiet, bench_model, bench_scratch_dir

COUNTS = (1, 2, 4, 8)


def _prompts(model: Path, k: int) -> list[tuple[int, ...]]:
    from ds4f.engine.checkpoint import open_checkpoint

    with open_checkpoint(model) as ck:
        prompts = [tuple(p) for p in ck.prompts] or [(0, 1, 2, 3)]
    return [prompts[i % len(prompts)] for i in range(k)]


def _workload(host, model: Path, preset: str, prompts, gen: int, together: bool, cold: bool, config_path,
              tag: str, log: Log) -> dict:
    """The requests on `host`, all at once (together) or one after another; their figures."""
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    firsts: dict[int, float] = {}
    lasts: dict[int, float] = {}
    starts: dict[int, float] = {}
    lock = threading.Lock()

    def hook(i, prompt_len):
        def on_token(rec):
            if rec.index >= prompt_len - 1:
                with lock:
                    firsts.setdefault(i, time.monotonic())
                    lasts[i] = time.monotonic()
        return on_token

    def start(i, prompt):
        starts[i] = time.monotonic()
        return start_run(RunConfig(model=str(model), preset=preset, prompt=prompt, gen=gen, probe_floor=False,
                                   config_path=config_path, reuse_prefix=False, cold_start=cold and i == 0,
                                   dump_path=str(bench_scratch_dir() / f"batch-{tag}-{i}.bin")),
                         engines=host, on_token=hook(i, len(prompt)))

    eng = host._engine
    batcher = eng.batcher if eng is not None else None
    steps0 = batcher.figures() if batcher is not None else None
    t0 = time.monotonic()
    runs = []
    if together:
        runs = [start(i, p) for i, p in enumerate(prompts)]
        for r in runs:
            r.wait()
    else:
        for i, p in enumerate(prompts):
            runs.append(start(i, p))
            runs[-1].wait()
    wall = time.monotonic() - t0
    for r in runs:
        if r.state != "done":
            raise Ds4fError(f"bench batch: a run ended {r.state}: {r.error}")
    eng = host._engine
    read = sum(r.bytes_read for r in runs)
    tokens = sum(r.generated_tokens for r in runs)
    per_seq = [(r.generated_tokens - 1) / (lasts[i] - firsts[i]) for i, r in enumerate(runs)
               if r.generated_tokens > 1 and lasts[i] > firsts[i]]
    union = None
    b = eng.batcher
    if together and b is not None:
        f = b.figures()
        n0 = steps0.steps if steps0 is not None else 0
        u0 = steps0.union_sum if steps0 is not None else 0.0
        union = (f.union_sum - u0) / (f.steps - n0) if f.steps > n0 else None
    elif eng is not None:
        union = float(eng.geometry.top_k)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall if wall else None,
            "sequence_tokens_per_s": statistics.median(per_seq) if per_seq else None,
            "ttft_s": statistics.median(firsts[i] - starts[i] for i in firsts) if firsts else None,
            "gb_per_token": read / 1e9 / tokens if tokens else None, "union_experts_per_layer": union}


def bench_batch(model: str | Path | None = None, preset: str = "laptop", gen: int | None = None,
                config_path: str | None = None, counts=COUNTS, *, log: Log | None = None, progress=None) -> list[dict]:
    """One record per (cache, sequences): the batched figures, the turns' figures, and their
    aggregate ratio ("speedup": batched tokens/s over turns' tokens/s)."""
    from ds4f.runs.host import EngineHost

    log = log or _quiet
    model = bench_model(model, progress, log)
    gen = gen or 8
    records = []
    host = EngineHost(parallel=max(counts))
    try:
        for cache in ("warm", "cold"):
            for k in counts:
                prompts = _prompts(model, k)
                cold = cache == "cold"
                if not cold:     # the warm-up: the same workload once, its figures not kept
                    host.set_parallel(1)
                    _workload(host, model, preset, prompts, gen, False, False, config_path, "warmup", log)
                row = {"cache": cache, "sequences": k, "gen": gen}
                for mode in ("turns", "batched") if k > 1 else ("turns",):
                    host.set_parallel(k if mode == "batched" else 1)
                    r = _workload(host, model, preset, prompts, gen, mode == "batched", cold, config_path,
                                  f"{cache}{k}{mode}", log)
                    row[mode] = r
                    log(f"  {cache} cache, {k} sequences, {mode}: {r['tokens_per_s']:.2f} tok/s aggregate,"
                        f" {r['wall_s']:.1f} s, {r['gb_per_token'] or 0:.3f} GB/token")
                if k == 1:
                    row["batched"] = row["turns"]
                t, b = row["turns"]["tokens_per_s"], row["batched"]["tokens_per_s"]
                row["speedup"] = b / t if t and b else None
                one = next((r["batched"]["tokens_per_s"] for r in records if r["cache"] == cache and r["sequences"] == 1),
                           b)
                row["over_one"] = b / one if b and one else None
                records.append(row)
    finally:
        host.close()
    return records
