"""Engine and Session: a long-lived engine serves many runs, each as a fresh engine would."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.config import load_config
from ds4f.engine.engine import Engine
from ds4f.errors import Ds4fError
from ds4f.engine.model.reference import reference_step
from ds4f.runs.config import RunConfig
from ds4f.runs.host import EngineHost
from ds4f.runs.run import start_run


def _run(model, tmp_path, name, host=None, **kw):
    kw.setdefault("gen", 4)
    kw.setdefault("probe_floor", False)
    kw.setdefault("prompt", (0, 17, 42))
    run = start_run(RunConfig(model=str(model), dump_path=str(tmp_path / f"{name}.bin"), **kw), engines=host)
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_hosted_engine_is_loaded_once_and_each_run_is_as_if_fresh(tiny_model, tmp_path):
    # without prefetch every cache decision is made by the compute thread, so the counters of two
    # runs on the same tokens are equal, not only their states (prefetch reads race the compute)
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text('[presets.nopf]\npinned_layers = "50%"\ncache = "25%"\nprefetch = false\n')
    kw = dict(backend="scalar", preset="nopf", config_path=str(cfg), cold_start=True)
    fresh = _run(tiny_model, tmp_path, "fresh", **kw)
    host = EngineHost()
    try:
        runs = [_run(tiny_model, tmp_path, f"hosted{i}", host, **kw) for i in range(3)]
        assert host.loads == 1
        assert any("engine loaded" in e for e in runs[0].report["events"])
        assert all(any("engine reused" in e for e in r.report["events"]) for r in runs[1:])
        for r in runs:
            assert _sha(r.dump_path) == _sha(fresh.dump_path)
            # an empty cache and zeroed counters at every start: the same figures as a fresh engine
            for key in ("hits", "misses", "evictions", "gb_per_token", "gb_first_token"):
                assert r.report["summary"][key] == fresh.report["summary"][key], key
            assert r.report["layers"] == fresh.report["layers"]
    finally:
        host.close()


def test_a_hosted_engine_keeps_the_expert_cache_warm_unless_a_cold_start_is_asked(tiny_model, tmp_path):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text('[presets.nopf]\npinned_layers = "50%"\ncache = "50%"\nprefetch = false\n')
    kw = dict(backend="scalar", preset="nopf", config_path=str(cfg), gen=6)
    host = EngineHost()
    try:
        first = _run(tiny_model, tmp_path, "first", host, **kw)
        warm = _run(tiny_model, tmp_path, "warm", host, **kw)
        cold = _run(tiny_model, tmp_path, "cold", host, cold_start=True, **kw)
        assert first.report["cache"]["start"] == "cold" and first.report["cache"]["experts_at_start"] == 0
        assert warm.report["cache"]["start"] == "warm" and warm.report["cache"]["experts_at_start"] > 0
        assert cold.report["cache"]["start"] == "cold"
        assert warm.report["summary"]["hit_rate"] > first.report["summary"]["hit_rate"]
        assert warm.report["summary"]["misses"] < first.report["summary"]["misses"]
        # a cold start on the same engine is the first run again, figures and all
        for key in ("hits", "misses", "hit_rate", "gb_per_token"):
            assert cold.report["summary"][key] == first.report["summary"][key], key
        # the cache's warmth changes what is read, never what is computed
        assert _sha(warm.dump_path) == _sha(first.dump_path) == _sha(cold.dump_path)
        assert any("expert cache warm" in e for e in warm.report["events"])
    finally:
        host.close()


def test_a_hosted_engine_follows_the_run_settings_and_reloads_on_change(tiny_model, tmp_path):
    host = EngineHost()
    try:
        a = _run(tiny_model, tmp_path, "a", host, backend="scalar", kernel_threads=1, io_threads=1)
        b = _run(tiny_model, tmp_path, "b", host, backend="scalar", kernel_threads=2, io_threads=3)
        assert host.loads == 1
        assert {t["kernel_threads"] for t in b.report["tokens"]} == {2}
        assert {t["io_threads"] for t in b.report["tokens"]} == {3}
        assert _sha(a.dump_path) == _sha(b.dump_path)  # thread counts never change the state
        _run(tiny_model, tmp_path, "c", host, backend="scalar", preset="server")
        assert host.loads == 2  # another preset: another engine
        # a checkpoint file that changed on disk is not trusted to the old engine
        cfg = tiny_model / "config.json"
        st = cfg.stat()
        os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        _run(tiny_model, tmp_path, "d", host, backend="scalar", preset="server")
        assert host.loads == 3
    finally:
        host.close()


def test_session_eval_follows_the_reference_token_after_token(tiny_moe_only):
    """The MoE-only forward (a geometry without attention) against the float64 MoE reference."""
    preset = load_config().get_preset("minimal")   # nothing pinned: every trunk layer streamed
    with open_checkpoint(tiny_moe_only) as ck:
        eng = Engine(ck, preset, io_threads=2, kernel_threads=2, backend="scalar")
        try:
            session = eng.new_session()
            token = 5
            for _ in range(3):
                logits = session.eval(token).copy()
                nxt, ids, hidden = reference_step(ck, token)
                assert [sorted(r) for r in session.buffers.ids[0].tolist()] == ids
                scale = np.abs(hidden).max(axis=1)
                err = np.abs(session.buffers.hidden[0].astype(np.float64) - hidden).max(axis=1)
                assert (err <= 1e-5 * scale * np.arange(1, len(scale) + 1)).all(), err / scale
                assert int(np.argmax(logits)) == nxt
                token = nxt
            assert session.position == 3
            with pytest.raises(Ds4fError) as info:
                session.eval(ck.geometry.vocab)
            assert info.value.param == "token"
        finally:
            eng.close()


def test_numpy_blas_runs_on_one_thread_while_an_engine_computes(tiny_model):
    """OpenBLAS splits a float64 dot product of more than 10k elements among its threads, and the
    parts' sum changes its last bits with their number. With numpy's BLAS at two threads (as on
    any machine with two cores or more), an engine's session pins it to one: such a product then
    has the one-thread bits."""
    from threadpoolctl import threadpool_info, threadpool_limits

    rng = np.random.default_rng(3)
    x = rng.standard_normal(4 * 4096)
    fn = rng.standard_normal((24, 4 * 4096))
    with threadpool_limits(1, user_api="blas"):
        want = fn @ x
    cfg = load_config()
    with threadpool_limits(2, user_api="blas"):
        engine = Engine(open_checkpoint(tiny_model), cfg.get_preset("laptop"), 1, 1, "scalar")
        try:
            engine.new_session()
            assert [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] == [1]
            got = fn @ x
        finally:
            engine.close()
    assert got.tobytes() == want.tobytes()
