"""The streaming engine end to end on the tiny checkpoint: math, determinism, accounting, artifacts.

The reference forward pass is ds4f.engine.model.reference: float64 numpy with ml_dtypes decoding,
written from the model's definition (DESIGN.md, transformers' deepseek_v4), sharing no code with
the engine's fp32 path.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np
import pytest

from ds4f.native import kernels
from ds4f.engine.checkpoint import open_checkpoint
from ds4f.errors import Ds4fError
from ds4f.engine.model.reference import reference_step
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.runs.diff import diff_states
from ds4f.runs.statedump import read_state

SIMD = [b for b in kernels.available_backends() if b != "scalar"]


# ---------------------------------------------------------------- helpers
def _run(model, tmp_path, name, **kw):
    kw.setdefault("gen", 4)
    kw.setdefault("probe_floor", False)
    run = start_run(RunConfig(model=str(model), dump_path=str(tmp_path / f"{name}.bin"),
                              report_path=str(tmp_path / f"{name}.json"), **kw))
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


# ---------------------------------------------------------------- the math
@pytest.mark.parametrize("backend", kernels.available_backends())
def test_forward_matches_float64_reference(tiny_moe_only, tmp_path, backend):
    """The MoE-only forward against the float64 MoE reference (the whole model is checked against
    transformers in tests/test_whole_engine.py)."""
    run = _run(tiny_moe_only, tmp_path, backend, gen=3, backend=backend, moe_only=True)
    state = read_state(run.dump_path)
    with open_checkpoint(tiny_moe_only) as ck:
        for rec in state.records:
            nxt, ids, hidden = reference_step(ck, int(rec["token"]))
            assert [sorted(r) for r in rec["ids"].tolist()] == ids
            scale = np.abs(hidden).max(axis=1)
            err = np.abs(rec["hidden"].astype(np.float64) - hidden).max(axis=1)
            assert (err <= 1e-5 * scale * np.arange(1, len(scale) + 1)).all(), (err / scale)
            assert int(rec["next"]) == nxt


# ---------------------------------------------------------------- determinism
def test_state_is_byte_identical_across_thread_counts(tiny_model, tmp_path):
    a = _run(tiny_model, tmp_path, "t1", kernel_threads=1, io_threads=1)
    b = _run(tiny_model, tmp_path, "t2", kernel_threads=2, io_threads=3)
    assert a.report["state_sha256"] == b.report["state_sha256"]
    assert Path(a.dump_path).read_bytes() == Path(b.dump_path).read_bytes()
    assert diff_states(a.dump_path, b.dump_path).cls == "identical"


def test_state_does_not_depend_on_the_preset(tiny_model, tmp_path):
    """Pinning and cache size change what is read, never the numbers."""
    a = _run(tiny_model, tmp_path, "server", preset="server")
    b = _run(tiny_model, tmp_path, "minimal", preset="minimal")
    assert a.report["summary"]["hit_rate"] != b.report["summary"]["hit_rate"]
    assert a.report["state_sha256"] == b.report["state_sha256"]


@pytest.mark.skipif(not SIMD, reason="no SIMD backend on this CPU")
def test_simd_vs_scalar_is_low_bit(tiny_model, tmp_path):
    a = _run(tiny_model, tmp_path, "scalar", backend="scalar")
    b = _run(tiny_model, tmp_path, "simd", backend=SIMD[-1])
    d = diff_states(a.dump_path, b.dump_path)
    assert d.cls in ("low-bit", "identical")
    assert d.token is None
    sa, sb = read_state(a.dump_path), read_state(b.dump_path)
    assert (sa.records["ids"] == sb.records["ids"]).all()
    assert set(sa.backends) == {"scalar"} and set(sb.backends) == {SIMD[-1]}


# ---------------------------------------------------------------- accounting and the cache
def test_hits_plus_misses_equal_requests(tiny_model, tmp_path):
    run = _run(tiny_model, tmp_path, "acct", gen=6, preset="laptop")
    s = run.report["summary"]
    with open_checkpoint(tiny_model) as ck:
        g = ck.geometry
    steps = run.n_steps
    assert s["hits"] + s["misses"] == g.top_k * g.n_layers * steps
    assert sum(t["hits"] + t["misses"] for t in run.report["tokens"]) == g.top_k * g.n_layers * steps
    layers = run.report["layers"]
    assert all(layer["hits"] + layer["misses"] == g.top_k * steps for layer in layers)
    # the first token is cold: every one of its experts is a miss unless it repeats within the token
    assert run.report["tokens"][0]["misses"] > 0
    # bytes: each miss and each prefetch that was read is one record; unpinned trunk layers
    # are read every token
    pf = s["prefetch"] or {"issued": 0, "cancelled": 0}
    with open_checkpoint(tiny_model) as ck:
        pinned = set(run.report["pinned_layers"])
        trunk = sum(ck.trunk_layer_nbytes(i) for i in range(g.n_layers) if i not in pinned)
        total = sum(t["bytes_read"] for t in run.report["tokens"])
        assert total == (s["misses"] + pf["issued"] - pf["cancelled"]) * ck.slot_nbytes + trunk * steps
        assert all(t["bytes_read"] >= t["misses"] * ck.slot_nbytes + trunk for t in run.report["tokens"])


def test_cache_never_exceeds_budget(tiny_model, tmp_path):
    run = start_run(RunConfig(model=str(tiny_model), preset="laptop", gen=12, probe_floor=False,
                              dump_path=str(tmp_path / "b.bin")))
    seen = []
    while not run.wait(0.001):
        s = run.snapshot()
        seen.append((s.cache_bytes, s.budget_bytes))
    assert run.state == "done", run.error
    cache = run.report["cache"]
    assert cache["capacity_bytes"] <= cache["budget_bytes"]
    assert all(used <= budget for used, budget in seen if budget)
    assert run.report["summary"]["evictions"] > 0, "laptop preset on tiny should have to evict"


def test_budget_too_small_is_a_clear_error(tiny_model, tmp_path):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text('[presets.starved]\npinned_layers = "all"\ncache = "64 KiB"\n')
    run = start_run(RunConfig(model=str(tiny_model), preset="starved", config_path=str(cfg), probe_floor=False,
                              dump_path=str(tmp_path / "s.bin")))
    run.wait(30)
    assert run.state == "failed"
    assert "budget" in run.error and "experts" in run.error
    assert not list(tmp_path.glob("s.bin*"))


# ---------------------------------------------------------------- switches, cancel, errors
@pytest.mark.skipif(not SIMD, reason="no SIMD backend on this CPU")
def test_switch_lands_at_a_token_boundary(tiny_model, tmp_path):
    # The switch is asked for from the run's own thread once token 1 is recorded, so it lands at
    # token 2 whatever the machine's speed; the run need only be long enough to show both sides.
    import threading

    started = threading.Event()
    holder: dict = {}

    def on_token(record):
        if record.index == 1:
            assert started.wait(30), "start_run did not return"
            holder["run"].switch(backend="scalar", kernel_threads=1, io_threads=2)

    holder["run"] = run = start_run(RunConfig(model=str(tiny_model), gen=6, backend=SIMD[-1], probe_floor=False,
                                              dump_path=str(tmp_path / "sw.bin")), on_token=on_token)
    started.set()
    assert run.wait(120) and run.state == "done", run.error
    backends = run.report["backend_by_token"]
    k = 2
    assert backends[:k] == [SIMD[-1]] * k and backends[k:] == ["scalar"] * (len(backends) - k), backends
    assert run.report["tokens"][k]["kernel_threads"] == 1 and run.report["tokens"][k]["io_threads"] == 2
    assert any(f"token {k}: backend {SIMD[-1]} -> scalar" in e for e in run.report["events"])
    assert read_state(run.dump_path).backends == backends


def test_cancel_leaves_no_partial_files(tiny_model, tmp_path):
    run = start_run(RunConfig(model=str(tiny_model), gen=400, probe_floor=False,
                              dump_path=str(tmp_path / "c" / "state.bin")))
    while run.snapshot().tokens_done < 2 and not run.finished:
        time.sleep(0.001)
    run.cancel()
    assert run.wait(60)
    assert run.state == "cancelled"
    assert run.report is None
    assert list((tmp_path / "c").glob("*")) == []


def test_truncated_pool_mid_run_fails_clearly(tiny_model, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    run = start_run(RunConfig(model=str(broken), gen=200, preset="minimal", probe_floor=False,
                              dump_path=str(tmp_path / "x" / "state.bin")))
    while run.snapshot().tokens_done < 1 and not run.finished:
        time.sleep(0.001)
    pool = broken / "pool-mxfp4.bin"
    os.truncate(pool, pool.stat().st_size // 3)
    assert run.wait(60)
    assert run.state == "failed"
    assert "pool-mxfp4.bin" in run.error
    assert list((tmp_path / "x").glob("*")) == []


def test_bad_run_parameters_are_clear(tiny_model, tmp_path):
    with pytest.raises(Ds4fError, match="preset"):
        start_run(RunConfig(model=str(tiny_model), preset="nope"))
    with pytest.raises(Ds4fError, match="backend"):
        start_run(RunConfig(model=str(tiny_model), backend="sse9"))
    with pytest.raises(Ds4fError, match="gen"):
        start_run(RunConfig(model=str(tiny_model), gen=0))
    with pytest.raises(Ds4fError, match="prompt"):
        start_run(RunConfig(model=str(tiny_model), prompt=(10**9,)))
    with pytest.raises(Ds4fError, match=str(tmp_path / "missing")):
        start_run(RunConfig(model=str(tmp_path / "missing")))


def test_official_shards_run_like_the_converted_layout(tiny_official, tiny_model, tmp_path):
    a = _run(tiny_official, tmp_path, "official")
    b = _run(tiny_model, tmp_path, "converted")
    assert a.report["state_sha256"] == b.report["state_sha256"]


def test_lookahead_prefetch_keeps_the_state_and_accounts_every_read(tiny_model, tmp_path):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text('[presets.pf]\npinned_layers = "50%"\ncache = "25%"\nprefetch = true\n'
                   '[presets.nopf]\npinned_layers = "50%"\ncache = "25%"\nprefetch = false\n')
    off = _run(tiny_model, tmp_path, "off", gen=10, preset="nopf", config_path=str(cfg))
    on = _run(tiny_model, tmp_path, "on", gen=10, preset="pf", config_path=str(cfg))
    assert on.report["state_sha256"] == off.report["state_sha256"]
    pf = on.report["summary"]["prefetch"]
    assert pf["issued"] > 0 and pf["useful"] > 0
    # every prediction is resolved within its token: used, read in vain, or dropped unread
    assert pf["issued"] == pf["useful"] + pf["wasted"] + pf["cancelled"]
    assert pf["late"] <= pf["useful"]
    s = on.report["summary"]
    # the disk's occupancy: busy at most all the time, and never more reads in flight than
    # the I/O threads plus the prefetch lane
    for r in (on, off):
        busy, depth = r.report["summary"]["disk_busy_fraction"], r.report["summary"]["mean_read_depth"]
        assert 0 < busy <= 1 and busy <= depth <= (r.io_threads + 1) * busy + 1e-9
    from ds4f.engine.runtime.streamer import Streamer
    with open_checkpoint(tiny_model) as ck:
        g = ck.geometry
        assert s["hits"] + s["misses"] == g.top_k * g.n_layers * on.n_steps
        # disk bytes: demand misses + every prefetch issued + unpinned trunk layers
        pinned = set(on.report["pinned_layers"])
        trunk = sum(ck.trunk_layer_nbytes(i) for i in range(g.n_layers) if i not in pinned)
        total = sum(t["bytes_read"] for t in on.report["tokens"])
        assert total == (s["misses"] + pf["issued"] - pf["cancelled"]) * ck.slot_nbytes + trunk * on.n_steps
        # only the lookahead's confident guesses are read: at most PREFETCH_RANKS per learned layer ahead
        ahead = g.n_layers - max(g.n_hash_layers, 1)
        assert pf["issued"] <= Streamer.PREFETCH_RANKS * ahead * on.n_steps
    assert off.report["summary"]["prefetch"] is None


def test_cli_run_and_diff_exit_codes(tiny_model, tmp_path):
    import subprocess
    import sys

    def ds4f(*args):
        return subprocess.run([sys.executable, "-m", "ds4f.cli", *args], capture_output=True, text=True, timeout=120)

    a = ds4f("run", str(tiny_model), "--gen", "3", "--no-probe", "--dump-state", str(tmp_path / "a.bin"))
    assert a.returncode == 0, a.stderr
    assert "s/token" in a.stdout and "sha256" in a.stdout and "token    1/3" in a.stderr
    assert (tmp_path / "a.report.json").is_file()
    b = ds4f("run", str(tiny_model), "--gen", "3", "--no-probe", "--dump-state", str(tmp_path / "b.bin"))
    assert ds4f("diff", str(tmp_path / "a.bin"), str(tmp_path / "b.bin")).returncode == 0  # identical
    if SIMD:
        c = ds4f("run", str(tiny_model), "--gen", "3", "--no-probe", "--no-simd", "--dump-state", str(tmp_path / "c.bin"))
        assert c.returncode == 0, c.stderr
        d = ds4f("diff", str(tmp_path / "a.bin"), str(tmp_path / "c.bin"))
        assert d.returncode == 1 and d.stdout.startswith("low-bit"), d.stdout
    bad = ds4f("diff", str(tmp_path / "a.bin"), str(tmp_path / "a.report.json"))
    assert bad.returncode == 2 and "bad magic" in bad.stderr and "Traceback" not in bad.stderr
    missing = ds4f("run", str(tmp_path / "nope"), "--gen", "2")
    assert missing.returncode == 2 and "nope" in missing.stderr and "Traceback" not in missing.stderr
    assert b.returncode == 0


def test_a_cache_bigger_than_the_pool_is_clamped_and_said(tiny_model, tmp_path):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text('[presets.huge]\npinned_layers = "all"\ncache = "1 TiB"\n')
    run = _run(tiny_model, tmp_path, "huge", gen=2, preset="huge", config_path=str(cfg))
    with open_checkpoint(tiny_model) as ck:
        g = ck.geometry
        pool = g.n_layers * g.n_experts * ck.slot_nbytes
    assert run.report["cache"]["capacity_bytes"] <= pool
    assert any("more than the whole expert pool" in e for e in run.report["events"])


_LAYER_OF_TEMPORARIES = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from ds4f.engine.runtime.memory import keep_freed_memory
    assert keep_freed_memory()
def layer():
    blocks = [np.ones(4 << 20, np.uint8) for _ in range(50)]   # 200 MiB of numpy temporaries
    del blocks
layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_keep_freed_memory_lets_the_next_temporaries_reuse_freed_pages():
    """runtime.memory.keep_freed_memory (Engine() calls it): a second layer's worth of numpy
    temporaries reuses the first's freed memory, where glibc's defaults return it and the pages
    fault in again (counted as minor page faults, each in a fresh interpreter)."""
    import subprocess
    import sys

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _LAYER_OF_TEMPORARIES, mode], capture_output=True, text=True,
                             check=True)
        return int(out.stdout)

    default, keep = faults("default"), faults("keep")
    assert keep * 10 < default, (keep, default)    # ~25,000 against 0 with 4 KiB pages


def test_a_warm_session_continues_the_cache_policys_clock(tiny_model):
    """The expert cache's policy counts time in tokens: a session on the warm cache goes on from
    the tokens before it, so no key's age runs backwards (a cycle policy's decayed counts would
    overflow after a run past ~4k tokens); a cold one starts the clock and the policy afresh."""
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine

    preset = load_config(None).get_preset(None)
    assert preset.policy == "cycle"
    engine = Engine(open_checkpoint(tiny_model), preset, 1, 1, kernels.best_backend())
    try:
        engine.new_session(64).prefill(list(range(2, 40)))     # one chunk: its tokens are at its first's time
        policy = engine.streamer.cache.policy
        assert engine.streamer.tokens == 38 and policy.token == 0
        engine.new_session(8, cold=False).prefill([5, 6, 7])
        assert engine.streamer.cache.policy is policy and policy.token == 38 and engine.streamer.tokens == 41
        assert (policy.last <= policy.token).all() and np.isfinite(policy.value).all()
        engine.new_session(8, cold=True).prefill([5, 6, 7])
        assert engine.streamer.cache.policy is not policy and engine.streamer.cache.policy.token == 0
    finally:
        engine.close()
        engine.ckpt.close()
