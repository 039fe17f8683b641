"""`ds4f bench batch`: several sequences decoded together (engine.batch) against taking turns.

For each count of concurrent sequences (1, 2, 4, 8) and each cache state (warm: the cache holds
what an identical workload left; cold: emptied when the first sequence starts), the same k
requests (the bench checkpoint's sample prompts, `gen` tokens each) run twice in the same
invocation: all at once on an engine host made for k sequences, and one after another (taking
turns, as a server of one sequence answers them). The figures: aggregate decode tokens per
second (batched: the tokens of all sequences while all of them decode, over that time; taking
turns: one sequence's), end-to-end tokens per second (generated tokens over the wall time from
the first start to the last end, the prompts' prefill included), per-sequence decode tokens per
second and time to first token from the requests' arrival (medians; taking turns, a request
waits for those before it), disk GB read per decode step's token, and the union of
experts per layer per step; the ratios batched / turns are the ones that hold on a noisy machine.
Then, on the warm engine, a second request while a first streams: its time to first token
against its own alone plus one decode step of the first. Reads use O_DIRECT where the filesystem allows; the cold runs start on
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

    times: dict[int, list[float]] = {i: [] for i in range(len(prompts))}   # each generated token's arrival
    decode_bytes = [0]
    starts: dict[int, float] = {}
    lock = threading.Lock()

    def hook(i, prompt_len):
        def on_token(rec):
            if rec.index >= prompt_len - 1:       # a step that picks a generated token
                with lock:
                    times[i].append(time.monotonic())
                    decode_bytes[0] += rec.bytes_read
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
    tokens = sum(r.generated_tokens for r in runs)
    per_seq = [(len(t) - 1) / (t[-1] - t[0]) for t in times.values() if len(t) > 1 and t[-1] > t[0]]
    if together and len(runs) > 1:
        # the steady state: from when the last sequence got its first token to when the first one
        # got its last, every sequence decoding; the tokens of all that arrived in it
        a, b = max(t[0] for t in times.values()), min(t[-1] for t in times.values())
        inside = sum(1 for t in times.values() for x in t if a < x <= b)
        decode = inside / (b - a) if b > a and inside else None
    else:
        decode = statistics.median(per_seq) if per_seq else None      # one sequence decoding at a time
    eng = host._engine
    union = None
    b = eng.batcher
    if together and b is not None:
        f = b.figures()
        n0 = steps0.steps if steps0 is not None else 0
        u0 = steps0.union_sum if steps0 is not None else 0.0
        union = (f.union_sum - u0) / (f.steps - n0) if f.steps > n0 else None
    elif eng is not None:
        union = float(eng.geometry.top_k)
    return {"wall_s": wall, "tokens": tokens, "e2e_tokens_per_s": tokens / wall if wall else None,
            "tokens_per_s": decode, "sequence_tokens_per_s": statistics.median(per_seq) if per_seq else None,
            # from when the requests arrived (all at t0): taking turns, a request waits for those before it
            "ttft_s": statistics.median(t[0] - t0 for t in times.values() if t) if tokens else None,
            "gb_per_token": decode_bytes[0] / 1e9 / tokens if tokens else None,
            "gb_read": sum(r.bytes_read for r in runs) / 1e9, "union_experts_per_layer": union}


def _join(host, model: Path, preset: str, gen: int, config_path, log: Log) -> dict:
    """A second request while a first streams: its time to first token against its own alone
    (on the same warm engine) plus one decode step of the first."""
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    first_p, second_p = _prompts(model, 2)

    def config(prompt, n, tag):
        return RunConfig(model=str(model), preset=preset, prompt=prompt, gen=n, probe_floor=False,
                         config_path=config_path, reuse_prefix=False,
                         dump_path=str(bench_scratch_dir() / f"batch-join-{tag}.bin"))

    def first_token_after(run_config) -> float:
        got = threading.Event()
        t0 = time.monotonic()
        run = start_run(run_config, engines=host,
                        on_token=lambda rec: rec.index >= len(run_config.prompt) - 1 and got.set())
        got.wait(600)
        seconds = time.monotonic() - t0
        return seconds, run

    host.set_parallel(1)
    alone_ttft, run = first_token_after(config(second_p, 1, "alone"))
    run.wait()
    host.set_parallel(2)
    steps = []
    seen = threading.Event()

    def on_first(rec):
        if rec.index >= len(first_p) - 1:        # the first's decode steps, alone on the engine
            steps.append(rec.seconds)
        if len(steps) >= 4:
            seen.set()
    first = start_run(config(first_p, gen * 4, "first"), engines=host, on_token=on_first)
    seen.wait(600)
    step = statistics.median(steps[-3:])
    join_ttft, second = first_token_after(config(second_p, 1, "second"))
    second.wait()
    first.cancel()
    first.wait()
    bound = alone_ttft + step
    log(f"  a second request while a first streams: first token after {join_ttft:.2f} s; alone {alone_ttft:.2f} s"
        f" + one decode step {step:.2f} s = {bound:.2f} s")
    return {"ttft_s": join_ttft, "alone_ttft_s": alone_ttft, "step_s": step, "bound_s": bound,
            "within_bound": join_ttft <= bound}


def bench_batch(model: str | Path | None = None, preset: str = "laptop", gen: int | None = None,
                config_path: str | None = None, counts=COUNTS, *, log: Log | None = None, progress=None) -> list[dict]:
    """{"records": one per (cache, sequences): the batched figures, the turns' figures, and their
    aggregate ratio ("speedup": batched tokens/s over turns' tokens/s); "join": a second request
    while a first streams (_join)}."""
    from ds4f.runs.host import EngineHost

    log = log or _quiet
    model = bench_model(model, progress, log)
    gen = gen or 8
    records, join = [], None
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
                    log(f"  {cache} cache, {k} sequences, {mode}: {r['tokens_per_s'] or 0:.2f} decode tok/s in all,"
                        f" {r['e2e_tokens_per_s'] or 0:.2f} end to end, {r['wall_s']:.1f} s,"
                        f" {r['gb_per_token'] or 0:.3f} GB/decode token")
                if k == 1:
                    row["batched"] = row["turns"]
                t, b = row["turns"]["tokens_per_s"], row["batched"]["tokens_per_s"]
                row["speedup"] = b / t if t and b else None
                te, be = row["turns"]["e2e_tokens_per_s"], row["batched"]["e2e_tokens_per_s"]
                row["e2e_speedup"] = be / te if te and be else None
                one = next((r["batched"]["tokens_per_s"] for r in records if r["cache"] == cache and r["sequences"] == 1),
                           b)
                row["over_one"] = b / one if b and one else None
                records.append(row)
            if cache == "warm":
                join = _join(host, model, preset, gen, config_path, log)
    finally:
        host.close()
    return {"records": records, "join": join}
