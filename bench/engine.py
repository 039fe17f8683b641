"""`ds4f bench engine`: the streaming engine on the bench checkpoint, SIMD against scalar.

The bench geometry has the real expert shape (4096 x 2048, 12.75 MiB records) and a pool
several times the laptop preset's cache. Expert and trunk reads use O_DIRECT where the
filesystem allows (the report says), and every run starts with an empty expert cache, so
no figure is flattered by the page cache. Both backends decode the same workload (the same
prompt and the same number of generated tokens) in the same invocation, so their ratio holds
even on a noisy shared machine.

bench_engine returns the figures; the CLI prints them. `log(line)` receives progress lines
(the floor, each token); `progress` and `log` are passed on to ensure_synthetic when the
bench checkpoint has to be made.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ds4f.errors import Ds4fError

Log = Callable[[str], None]


def _quiet(_line: str) -> None:
    pass


def _prompt(model: Path) -> tuple[int, ...] | None:
    """The first sample prompt the synthetic generator left with the checkpoint, if any."""
    from ds4f.engine.checkpoint import open_checkpoint

    with open_checkpoint(model) as ck:
        prompts = ck.prompts
    return tuple(prompts[0]) if prompts else None


def _one_run(model: Path, preset: str, gen: int, backend: str, prompt, config_path, log: Log) -> dict:
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    run = start_run(RunConfig(model=str(model), preset=preset, gen=gen, prompt=prompt, backend=backend,
                              config_path=config_path, probe_floor=True,
                              dump_path=str(bench_scratch_dir() / f"bench-{backend}.bin")))
    shown = 0

    def show() -> int:
        snap = run.snapshot()
        done = shown
        for t in (t for t in snap.tokens if t.index >= shown):
            log(f"  [{backend}] token {t.index + 1}/{snap.steps}: {t.seconds:.3f} s, {t.bytes_read / 1e9:.3f} GB, "
                f"{t.hits}/{t.hits + t.misses} hits, stall {t.stall_s:.3f} s")
            done = t.index + 1
        return done

    while not run.wait(0.2):
        shown = show()
    show()
    if run.state != "done":
        raise Ds4fError(run.error or f"bench run ended {run.state}")
    return run.report


DEPTHS = (1024, 8192, 32768)   # positions at which the attention's cost and the KV cache are measured


def attention_at_depth(model: Path, backend: str, depths=DEPTHS, tokens: int = 4, log: Log = _quiet) -> list[dict]:
    """Every layer's attention for `tokens` tokens at each position of `depths`, on a KV cache
    filled to that position: its window full, its compressed rows (and the indexer's keys) there,
    with standard-normal values (the cost of the attention core depends on how many rows there
    are, not on their values). Returns per depth {"position", "kv_bytes", "attention_s_per_token"}:
    the attention sublayers alone, without the MoE, the hyper-connections and the head."""
    import time

    import numpy as np

    from ds4f.native import kernels
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.model.attention import KVCache, attention_step
    from ds4f.engine.resident import load_attention

    with open_checkpoint(model) as ck:
        g = ck.geometry
        if g.attention is None:
            return []
        layers, _ = load_attention(ck, g)
    kernels.set_backend(backend)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(g.hidden).astype(np.float32)
    out = []
    for depth in depths:
        kv = KVCache([la.shape for la in layers], depth + tokens)
        for la, cache in zip(layers, kv.layers):
            cache.window[:] = rng.standard_normal(cache.window.shape)
            cache.tokens = depth
            for state in (cache.compressor, cache.indexer):
                if state is not None:
                    state.n_rows = depth // state.ratio
                    state.rows[:state.n_rows] = rng.standard_normal((state.n_rows, state.dim))
        t0 = time.perf_counter()
        for pos in range(depth, depth + tokens):
            for la, cache in zip(layers, kv.layers):
                attention_step(la.attention, cache, a, pos, la.shape, la.rope)
        s = (time.perf_counter() - t0) / tokens
        log(f"  attention at position {depth:,}: {s:.4f} s/token, KV cache {kv.nbytes / 2**20:.1f} MiB")
        out.append({"position": depth, "kv_bytes": kv.nbytes, "attention_s_per_token": s})
        del kv
    return out


def finished_report(run, log: Log, line) -> dict:
    """Wait for a bench run, logging line(snapshot) every second; its whole report once done (a
    Ds4fError when it ended otherwise)."""
    while not run.wait(1.0):
        log(line(run.snapshot()))
    if run.state != "done":
        raise Ds4fError(run.error or f"bench run ended {run.state}")
    return run.report


def bench_scratch_dir() -> Path:
    """Where the benchmarks keep their runs' dumps and reports (the user's cache directory)."""
    from ds4f.paths import user_cache_dir

    d = user_cache_dir() / "bench-runs"
    d.mkdir(parents=True, exist_ok=True)
    return d


def bench_model(model, progress=None, log: Log | None = None) -> Path:
    """`model`, or the bench checkpoint (made on demand: announced to `log`, with `progress`)."""
    from ds4f.engine.checkpoint.demo import ensure_synthetic

    return Path(model) if model else ensure_synthetic("bench", progress=progress, announce=log)


def bench_engine(model: str | Path | None = None, preset: str = "laptop", gen: int | None = None,
                 config_path: str | None = None, *, log: Log | None = None, progress=None) -> dict:
    """The best SIMD backend and scalar on the same workload, cold cache each; then the attention
    alone at depth (attention_at_depth).

    Returns {"backend", "model", "preset", "prompt", "gen", "floor", "simd", "scalar",
    "scalar_over_simd", "io_mode", "cache", "pinned_layers", "n_layers", "attention_depth"}: "simd" and "scalar"
    are the two runs' report summaries; "scalar_over_simd" the ratio of their warm s/token."""
    from ds4f.native import kernels
    from ds4f.engine.runtime.disk_floor import cached_floor
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.settings import load_settings

    log = log or _quiet
    model = bench_model(model, progress, log)
    prompt = _prompt(model)
    gen = gen or 8
    best = kernels.best_backend()
    # a fresh floor for this invocation: the runs below then read it from the cache
    cfg = load_settings(config_path).engine
    with open_checkpoint(model) as ck:
        floor = cached_floor(ck, cfg.effective_io_threads(cfg.get_preset(preset)), seconds=3.0, max_age_s=0)
    log(f"NVMe floor now: {floor.gbps:.2f} GB/s ({floor.io_mode}, queue depth {floor.io_threads})")
    log(f"bench engine: {model} · preset {preset} · prompt of {len(prompt or (0,))} tokens + {gen} generated, "
        f"on {best} and on scalar")
    simd = _one_run(model, preset, gen, best, prompt, config_path, log)
    scalar = _one_run(model, preset, gen, "scalar", prompt, config_path, log)
    s, c = simd["summary"], scalar["summary"]
    ratio = c["s_per_token"] / s["s_per_token"] if s["s_per_token"] and c["s_per_token"] else None
    log(f"attention at depth ({best}): every layer's attention on a KV cache filled to each position")
    depth = attention_at_depth(model, best, log=log)
    return {"backend": best, "model": str(model), "preset": preset, "prompt": simd["prompt"], "gen": gen,
            "floor": {"gbps": floor.gbps, "io_mode": floor.io_mode, "io_threads": floor.io_threads},
            "simd": s, "scalar": c, "scalar_over_simd": ratio, "io_mode": simd["io_mode"], "cache": simd["cache"],
            "pinned_layers": len(simd["pinned_layers"]), "n_layers": simd["geometry"]["num_hidden_layers"],
            "attention_depth": depth}
