"""`ds4f bench prefill`: the prompt token by token against layer-major chunks, on the bench
checkpoint, cold cache each run.

For each prompt length, two runs on the same prompt (seeded random token ids) and the same
number of generated tokens: `token` feeds the prompt one token at a time (as decode does),
`layer` in the preset's prefill chunks. Both are measured the same way, from the runs' own
per-token records: the prompt's tokens/s (its tokens over the wall time they took), GB read
per prompt token (direct I/O) and the rate it was read at, the experts read per layer per
chunk (a token is a chunk of one in `token` mode), and the decode tokens/s of the tokens
generated after it (warm median).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ds4f.bench.engine import Log, _quiet, bench_model, bench_scratch_dir, finished_report
from ds4f.errors import Ds4fError

LENGTHS = (16, 128, 512, 2048)
MODES = ("token", "layer")


def _prompt(vocab: int, n: int, seed: int = 0) -> tuple[int, ...]:
    """n token ids drawn uniformly (seeded) from the vocabulary past the special ids."""
    rng = np.random.default_rng(seed)
    return (0, *(int(t) for t in rng.integers(8, vocab, n - 1)))


def _one(model: Path, preset: str, prompt: tuple[int, ...], mode: str, gen: int, config_path, log: Log) -> dict:
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    run = start_run(RunConfig(model=str(model), preset=preset, gen=gen, prompt=prompt, config_path=config_path,
                              prefill_chunk=0 if mode == "token" else None, probe_floor=False,
                              dump_path=str(bench_scratch_dir() / f"prefill-{mode}.bin")))
    report = finished_report(run, log, lambda snap: f"  [{mode}] {len(prompt)} prompt tokens:"
                                                    f" {min(snap.tokens_done, len(prompt))} done")
    n = len(prompt)
    rows = report["tokens"][:n]           # the prompt's steps (the last one picks the first generated token)
    seconds = sum(t["seconds"] for t in rows)
    misses = sum(t["misses"] for t in rows)
    nbytes, busy = sum(t["bytes_read"] for t in rows), sum(t["disk_busy_s"] for t in rows)
    s = report["summary"]
    g = report["geometry"]
    chunk = run.prefill_chunk if mode == "layer" else 1
    chunks = -(-n // chunk)
    return {"prompt_tokens": n, "mode": mode, "chunk": chunk, "tokens_per_s": n / seconds if seconds else None,
            "seconds": seconds, "gb_per_token": nbytes / 1e9 / n,
            "read_gb_per_s": nbytes / 1e9 / busy if busy else None,
            "experts_read_per_layer_chunk": misses / (chunks * g["num_hidden_layers"]),
            "decode_tokens_per_s": 1 / s["s_per_token"] if s["s_per_token"] else None,
            "decode_gb_per_token": s["gb_per_token"], "backend": report["backend_by_token"][-1]}


def bench_prefill(model: str | Path | None = None, preset: str = "laptop", lengths=LENGTHS, gen: int | None = None,
                  config_path: str | None = None, *, log: Log | None = None, progress=None) -> list[dict]:
    """One record per (prompt length, mode): prompt_tokens, mode ("token" or "layer"), chunk,
    tokens_per_s, gb_per_token, read_gb_per_s (the prompt's bytes over the time a read was in
    flight: token by token is bound by it, so a disk that serves re-read records from a cache of
    its own makes that mode faster), experts_read_per_layer_chunk, decode_tokens_per_s (the same
    run's decode), decode_gb_per_token."""
    from ds4f.engine.checkpoint import open_checkpoint

    log = log or _quiet
    model = bench_model(model, progress, log)
    with open_checkpoint(model) as ck:
        vocab = ck.geometry.vocab
    gen = gen or 8
    out = []
    for n in lengths:
        if n < 2:
            raise Ds4fError(f"--lengths: a prompt needs at least 2 tokens to prefill, got {n}", param="lengths")
        prompt = _prompt(vocab, n)
        for mode in MODES:
            log(f"bench prefill: {n} prompt tokens, {mode} by {mode}" if mode == "token"
                else f"bench prefill: {n} prompt tokens, layer-major chunks")
            out.append(_one(model, preset, prompt, mode, gen, config_path, log))
    return out
