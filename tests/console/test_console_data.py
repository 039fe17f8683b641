"""Fixed data for the console's snapshot tests: a Snapshot mid-run, a run history, a StateDiff.

Nothing here reads the clock, the disk layout or the engine, so the screenshots are stable.
(The two tests at the bottom check the fixtures themselves.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ds4f.runs.history import History
from ds4f.runs.snapshot import Snapshot, TokenRecord
from ds4f.settings import load_settings

GiB = 2**30
MODEL = "/srv/models/ds4f-mxfp4"


def builtin_settings():
    return load_settings(Path(str(resources.files("ds4f").joinpath("ds4f.toml"))))


def fixed_tokens(n: int = 24, switch_at: int | None = 14) -> tuple[TokenRecord, ...]:
    out = []
    for i in range(n):
        backend = "avx2" if switch_at is None or i < switch_at else "scalar"
        cold = i == 0
        secs = 0.82 if cold else (0.19 + 0.02 * ((i * 7) % 5) / 4 + (0.35 if backend == "scalar" else 0.0))
        hits = 120 + (i * 13) % 60 if not cold else 10
        misses = 258 - hits
        prefetched = 0 if cold else 8 + (i * 5) % 9     # of the hits, those on prefetched experts
        out.append(TokenRecord(index=i, token_id=1000 + i, next_token_id=1001 + i, seconds=secs,
                               bytes_read=int(misses * 6.37e6 * (0.22 if not cold else 1.0)), hits=hits,
                               misses=misses, stall_s=0.012, backend=backend, kernel_threads=16, io_threads=8,
                               disk_busy_s=0.87 * secs, disk_depth_s=5.2 * secs, prefetch_hits=prefetched))
    return tuple(out)


def fixed_snapshot(state: str = "running", tokens_done: int = 24, gen: int = 32, **changes) -> Snapshot:
    """A run of the server preset on a 128 GiB box; `changes` replace fields (e.g. bound="disk")."""
    toks = fixed_tokens(tokens_done)
    layers = 43
    layer_hits = tuple(600 + (l * 97) % 500 for l in range(layers))
    layer_misses = tuple(200 + (l * 61) % 700 for l in range(layers))
    hits, misses = sum(layer_hits), sum(layer_misses)
    useful = 3_761                              # hits on experts prefetch brought in
    # per layer: none on the 3 hash layers (nothing to guess), the rest spread unevenly; sums to useful
    spread = [0, 0, 0] + [64 + (l * 37) % 60 for l in range(3, layers)]
    layer_prefetch_hits = tuple(spread[:-1]) + (useful - sum(spread[:-1]),)
    done = state == "done"
    policy = (hits - useful) / (hits + misses)
    optimum = 0.703 if done else None
    snap = Snapshot(
        run_id="20261130-015508-a1b2", state=state, error=None, model=MODEL, preset="server", steps=gen,
        tokens_done=tokens_done, backend=toks[-1].backend, kernel_threads=16, io_threads=8, io_mode="O_DIRECT",
        policy="lru", s_per_token=0.19, s_first_token=0.82, gb_per_token=0.37, eff_read_gbps=1.95,
        floor_gbps=2.6, io_efficiency=0.75 if done else None, hit_rate=hits / (hits + misses),
        layer_hits=layer_hits, layer_misses=layer_misses,
        layer_evictions=tuple(0 for _ in range(layers)), cache_bytes=int(61.2 * GiB), budget_bytes=int(96 * GiB),
        rss_bytes=int(101.5 * GiB), rss_budget_bytes=int(120 * GiB), read_latency_ms=3.1,
        stall_s_per_token=0.012, elapsed_s=7.9, eta_s=1.52 if state == "running" else None, tokens=toks,
        events=("01:55:08 run 20261130-015508-a1b2: /srv/models/ds4f-mxfp4, preset server: pinned all, cache 75%, lru, 32 tokens",
                "01:55:08 NVMe floor 2.60 GB/s (O_DIRECT, queue depth 8)",
                "01:55:11 token 14: backend avx2 -> scalar"),
        prefetch={"issued": 5_210, "useful": useful, "late": 269, "wasted": 1_180, "cancelled": 4},
        optimum_hit_rate=optimum,
        disk_busy_fraction=0.87, mean_read_depth=5.2,  # as the tokens' disk_busy_s and disk_depth_s say
        switches=tuple((t.index, t.backend, t.kernel_threads, t.io_threads) for i, t in enumerate(toks)
                       if i == 0 or t.backend != toks[i - 1].backend),
        policy_hit_rate=policy, prefetch_hit_share=hits / (hits + misses) - policy,
        regret_pp=(optimum - policy) * 100 if optimum is not None else None,
        bound="disk",                           # busy 87% >= 80%
        floor_ratio=1.95 / 2.6, floor_age_s=185.0,
        ram_bytes=128 * GiB, ram_available_bytes=int(22.4 * GiB),
        plan_bytes=int(118.6 * GiB),            # rss_budget_bytes - the process before the run (1.4 GiB)
        layer_prefetch_hits=layer_prefetch_hits,
    )
    return dataclasses.replace(snap, **changes) if changes else snap


def _report(backend: str, sha: str, spt: float, n: int = 16, switch: int | None = None) -> dict:
    backends = [backend if switch is None or i < switch else "scalar" for i in range(n)]
    return {"state_sha256": sha, "backend_by_token": backends, "tokens": [{"index": i} for i in range(n)],
            "policy": "lru",
            "summary": {"s_per_token": spt, "s_first_token": 0.8, "eff_read_gbps": 1.9, "hit_rate": 0.78,
                        "gb_per_token": 0.37, "policy_hit_rate": 0.712, "prefetch_hit_share": 0.068,
                        "optimum_hit_rate": 0.853, "regret_pp": 14.1, "bound": "disk",
                        "prefetch": {"issued": 300, "useful": 174}}}


SHA_SIMD = "5f1c0a9e3b7d2c4e6a8b0d1f3e5c7a9b1d3f5e7c9a0b2d4f6e8a1c3e5b7d9f0a"
SHA_SCALAR = "9d2e4f6a8c0b1e3d5f7a9c2b4d6e8f0a1c3e5b7d9f1a3c5e7b9d0f2a4c6e8b1d"
T0 = 1796003708.0  # 2026-11-30 01:55:08 UTC


def fixed_history(path) -> History:
    h = History(path)
    cfg = {"model": MODEL, "gen": 16, "prompt": [0], "preset": "server", "kernel_threads": 16, "io_threads": 8}
    rows = [
        ("20261130-013001-0c11", "done", "avx2", SHA_SIMD, 0.190, None, None),
        ("20261130-013422-77e2", "done", "avx2", SHA_SIMD, 0.188, None, None),
        ("20261130-013900-5a03", "done", "scalar", SHA_SCALAR, 0.520, None, None),
        ("20261130-014300-c9d4", "cancelled", "avx2", None, None, None, None),
        ("20261130-014512-e1f5", "failed", "avx2", None, None, "pool-mxfp4.bin: short read at offset 8388608", None),
        ("20261130-015000-4b06", "done", "avx2", "1111aaaa2222bbbb3333cccc4444dddd5555eeee6666ffff7777000088889999",
         0.205, None, 9),
    ]
    for i, (rid, state, backend, sha, spt, err, switch) in enumerate(rows):
        report = _report(backend, sha, spt, switch=switch) if state == "done" else None
        c = dict(cfg, preset="laptop" if i == 5 else "server")
        h.record(rid, c, state, report, f"/data/runs/{rid}/state.bin" if report else None, sha, err,
                 T0 - 3600 + i * 300, T0 - 3600 + i * 300 + 5.5)
    return h


@dataclass
class FixedDiff:
    """Same fields as ds4f.runs.statedump.StateDiff (the screen only reads them)."""

    cls: str
    token: int | None
    layer: int | None
    layer_max_abs: list[float]
    layer_max_rel: list[float]
    sha_a: str
    sha_b: str
    n_tokens: int = 16
    backends_a: list[str] = field(default_factory=list)
    backends_b: list[str] = field(default_factory=list)
    detail: str = ""

    def summary(self) -> str:
        return self.cls


def fixed_diff(cls: str = "low-bit") -> FixedDiff:
    if cls == "identical":
        return FixedDiff("identical", None, None, [0.0] * 43, [0.0] * 43, SHA_SIMD, SHA_SIMD)
    rel = [10 ** (-7.5 + 1.5 * ((l * 37) % 11) / 10) for l in range(43)]
    if cls == "routing":
        rel = [r if l < 20 else 0.3 for l, r in enumerate(rel)]
        return FixedDiff("routing", 5, 20, [r * 3 for r in rel], rel, SHA_SIMD, SHA_SCALAR)
    return FixedDiff(cls, None, None, [r * 3 for r in rel], rel, SHA_SIMD, SHA_SCALAR)


def test_fixed_snapshot_is_consistent():
    s = fixed_snapshot()
    assert len(s.tokens) == s.tokens_done and len(s.layer_hits) == 43
    # the fields the engine derives, derived as the engine does (engine/runs.py, Run.snapshot)
    from ds4f.runs.snapshot import bound_of

    for s in (fixed_snapshot("running"), fixed_snapshot("done")):
        requests = sum(s.layer_hits) + sum(s.layer_misses)
        assert abs(s.policy_hit_rate - (sum(s.layer_hits) - s.prefetch["useful"]) / requests) < 1e-12
        assert sum(s.layer_prefetch_hits) == s.prefetch["useful"]
        assert all(0 <= p <= h for p, h in zip(s.layer_prefetch_hits, s.layer_hits))
        assert all(0 <= t.prefetch_hits <= t.hits for t in s.tokens)
        assert abs(s.policy_hit_rate + s.prefetch_hit_share - s.hit_rate) < 1e-12
        assert s.bound == bound_of(s.disk_busy_fraction)
        assert abs(s.floor_ratio - s.eff_read_gbps / s.floor_gbps) < 1e-12
        assert s.plan_bytes < s.rss_budget_bytes <= s.ram_bytes and s.ram_available_bytes < s.ram_bytes
    done = fixed_snapshot("done")
    assert abs(done.regret_pp - 100 * (done.optimum_hit_rate - done.policy_hit_rate)) < 1e-9
    assert fixed_snapshot("running").regret_pp is None and fixed_snapshot("running").io_efficiency is None


def test_fixed_history(tmp_path):
    h = fixed_history(tmp_path / "h.db")
    runs = h.list_runs()
    assert len(runs) == 6 and runs[0].run_id.endswith("4b06")
    assert runs[0].kind == "mixed" and runs[3].kind == "scalar"
