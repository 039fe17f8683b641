"""The cache lab: Belady on hand-made traces, budgets, and replay == engine, exactly."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ds4f.engine.runtime.policies import ONLINE_POLICIES
from ds4f.cachelab.replay import replay
from ds4f.cachelab.trace import Trace
from ds4f.runs.traces import export_trace, load_trace
from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import Geometry
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run

ONE_LAYER = Geometry(hidden=64, inter=32, n_layers=1, n_experts=8, top_k=1, n_hash_layers=0, vocab=16)


def _trace(seq, geometry=ONE_LAYER) -> Trace:
    ids = np.array(seq, dtype=np.int32).reshape(len(seq), geometry.n_layers, geometry.top_k)
    return Trace(geometry, ids, np.zeros(len(seq), np.int32))


def test_belady_by_hand():
    # capacity 2, one request per token: 1 2 3 1 2 4 1 2
    # Belady: misses 1 2 3(evicts 2: next use farthest) hit 1, miss 2 (evicts 3: never used
    # again), miss 4 (evicts 2: next use at 7 vs 1 at 6), hit 1, miss 2  -> 2 hits, 6 misses
    t = _trace([1, 2, 3, 1, 2, 4, 1, 2])
    budget = 2 * t.slot_nbytes
    r = replay(t, budget, "belady")
    assert (r.hits, r.misses) == (2, 6)
    # LRU on the same trace thrashes: every request misses
    assert (replay(t, budget, "lru").hits) == 0


def test_belady_keeps_the_loop_lru_thrashes():
    # a loop one longer than the cache (3 slots, keys 0-3, 20 requests): LRU never hits.
    # Belady: 4 cold misses, then one miss every third request (positions 6, 9, 12, 15, 18),
    # each evicting the resident key whose next use is farthest -> 11 hits, 9 misses
    t = _trace([0, 1, 2, 3] * 5)
    budget = 3 * t.slot_nbytes
    assert replay(t, budget, "lru").hits == 0
    r = replay(t, budget, "belady")
    assert (r.hits, r.misses) == (11, 9)


def test_belady_with_a_horizon():
    # The loop of 4 keys through 3 slots: at each eviction the resident keys are next needed
    # 1, 2 and 3 requests ahead. Seeing 2 tokens (= 2 requests here) ahead, the one key beyond
    # the horizon is always the farthest, so belady@2 makes Belady's choices: 11 hits.
    t = _trace([0, 1, 2, 3] * 5)
    budget = 3 * t.slot_nbytes
    assert (replay(t, budget, "belady@2").hits, replay(t, budget, "belady@3").hits) == (11, 11)
    # a horizon longer than the trace is Belady itself
    t = _trace([1, 2, 3, 1, 2, 4, 1, 2, 5, 3, 1, 4])
    for budget in (2, 3):
        full = replay(t, budget * t.slot_nbytes, "belady")
        long = replay(t, budget * t.slot_nbytes, f"belady@{len(t.ids)}")
        assert (long.hits, long.misses) == (full.hits, full.misses)
    for bad in ("belady@0", "belady@x", "belady@"):
        with pytest.raises(Ds4fError, match="belady@N"):
            replay(t, "50%", bad)


def test_belady_is_an_upper_bound_for_every_online_policy():
    rng = np.random.default_rng(1)
    g = Geometry(hidden=64, inter=32, n_layers=3, n_experts=8, top_k=2, n_hash_layers=1, vocab=16)
    seq = np.stack([rng.choice(8, size=(3, 2), replace=False, p=[.3, .2, .15, .1, .1, .05, .05, .05])
                    for _ in range(60)])
    t = Trace(g, seq.astype(np.int32), np.zeros(60, np.int32))
    for budget in ("40%", "60%", "80%"):
        opt = replay(t, budget, "belady").hits
        for policy in [*ONLINE_POLICIES, "belady@1", "belady@4"]:
            r = replay(t, budget, policy)
            assert r.hits <= opt, (policy, budget)
            assert r.hits + r.misses == 60 * 3 * 2


@pytest.mark.parametrize("policy", list(ONLINE_POLICIES))
def test_replay_reproduces_the_engine_exactly(tiny_model, tmp_path, policy):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[presets.p]\npinned_layers = "50%"\ncache = "25%"\npolicy = "{policy}"\n')
    run = start_run(RunConfig(model=str(tiny_model), preset="p", gen=24, config_path=str(cfg), probe_floor=False,
                              dump_path=str(tmp_path / "s.bin")))
    assert run.wait(120) and run.state == "done", run.error
    s = run.report["summary"]
    assert s["evictions"] > 0
    assert run.report["cache"]["capacity_bytes"] <= run.report["cache"]["budget_bytes"]
    r = replay(load_trace(tmp_path / "s.bin"), "25%", policy)
    assert (r.hits, r.misses) == (s["hits"], s["misses"])
    # the run reports the optimum for its own trace and budget: Belady's
    assert s["optimum_hit_rate"] == replay(load_trace(tmp_path / "s.bin"), "25%", "belady").hit_rate
    assert s["optimum_hit_rate"] >= s["hit_rate"]
    assert r.layer_hits == [layer["hits"] for layer in run.report["layers"]]
    # the exported trace replays the same
    out = export_trace(tmp_path / "s.bin", tmp_path / "t.npz")
    assert out.stat().st_size < (tmp_path / "s.bin").stat().st_size
    r2 = replay(load_trace(out), "25%", policy)
    assert (r2.hits, r2.misses) == (r.hits, r.misses)


def test_budgets_are_respected_and_too_small_ones_refused():
    t = _trace([0, 1, 2, 3, 4, 5, 6, 7] * 3)
    for slots in (1, 2, 5):
        for policy in [*ONLINE_POLICIES, "belady"]:
            r = replay(t, slots * t.slot_nbytes + t.slot_nbytes // 2, policy)
            assert r.slots == slots
    g = Geometry(hidden=64, inter=32, n_layers=2, n_experts=8, top_k=2, n_hash_layers=1, vocab=16)
    with pytest.raises(Ds4fError, match="at least 4"):
        replay(Trace(g, np.zeros((3, 2, 2), np.int32), np.zeros(3, np.int32)), 3 * t.slot_nbytes, "lru")


def test_bad_traces_are_clear(tmp_path):
    with pytest.raises(Ds4fError, match="not found"):
        load_trace(tmp_path / "nope.bin")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(Ds4fError, match="junk.npz"):
        load_trace(junk)
    with pytest.raises(Ds4fError, match="unknown cache policy"):
        replay(_trace([1, 2]), "50%", "random")


def test_cli_replay_sweep_and_plot(tiny_model, tmp_path):
    run = start_run(RunConfig(model=str(tiny_model), gen=12, probe_floor=False, dump_path=str(tmp_path / "s.bin")))
    assert run.wait(60) and run.state == "done"
    png = tmp_path / "sweep.png"
    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "replay", str(tmp_path / "s.bin"), "--sweep",
                          "20%,50%", "--plot", str(png)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for word in ("lru", "belady", "20%", "50%"):
        assert word in out.stdout
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, "-m", "ds4f.cli", "replay", str(tmp_path / "s.bin"), "--policy", "mru"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "mru" in bad.stderr and "Traceback" not in bad.stderr
    # a budget that is not one is refused, not tabulated as "too small"
    for budget, says in (("nan", "expected a size"), ("0.25", "no unit"), ("-1 GiB", "expected a size"),
                         ("20%,300%", "at most 100%")):
        bad = subprocess.run([sys.executable, "-m", "ds4f.cli", "replay", str(tmp_path / "s.bin"),
                              f"--sweep={budget}"], capture_output=True, text=True)
        assert bad.returncode == 2 and says in bad.stderr and "too small" not in bad.stdout, (budget, bad.stderr)


def test_bench_cache_runs_end_to_end_on_the_tiny_model(tiny_model, tmp_path):
    """A smoke test of the benchmark's plumbing (its figures are measured by hand, not here)."""
    import json

    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "bench", "cache", str(tiny_model), "--gen", "3",
                          "--backend", "scalar", "--json", str(tmp_path / "b.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "scalar kernels" in out.stdout  # the prefetch runs used the backend asked for
    for words in ("belady", ">= lru at every budget", "stall s/token", "wasted per useful", "foresight: belady seeing",
                  "a read in flight"):
        assert words in out.stdout
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["default_policy"] == "cycle" and result["prefetch"]["issued"] > 0
    assert all(v is None or 0 <= v <= 1 for v in result["sweep"].values())
    assert all(0 < result["disk_busy"][k] <= 1 for k in ("off", "on"))


def test_bench_engine_refuses_a_backend():
    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "bench", "engine", "--backend", "scalar"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--backend is for bench cache" in out.stderr and "Traceback" not in out.stderr
