"""The figures a run reports agree with each other, and the memory budget holds when measured
from outside the process."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run
from ds4f.runs.snapshot import DISK_BOUND_BUSY


def _run(model, tmp_path, name, **kw):
    kw.setdefault("probe_floor", False)
    run = start_run(RunConfig(model=str(model), dump_path=str(tmp_path / f"{name}.bin"), **kw))
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


@pytest.mark.parametrize("prefetch", [False, True])
def test_hit_rates_share_one_yardstick(tiny_model, tmp_path, prefetch):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[presets.p]\npinned_layers = "50%"\ncache = "25%"\nprefetch = {str(prefetch).lower()}\n')
    run = _run(tiny_model, tmp_path, "y", gen=12, preset="p", config_path=str(cfg))
    s = run.summary_report["summary"]
    requests = s["hits"] + s["misses"]
    useful = (s["prefetch"] or {}).get("useful", 0)
    assert s["policy_hit_rate"] == pytest.approx((s["hits"] - useful) / requests)
    assert s["policy_hit_rate"] + s["prefetch_hit_share"] == pytest.approx(s["hit_rate"])
    assert s["regret_pp"] == pytest.approx((s["optimum_hit_rate"] - s["policy_hit_rate"]) * 100)
    if not prefetch:
        # the same requests through the same cache: clairvoyance can only do better
        assert s["prefetch_hit_share"] == 0 and s["regret_pp"] >= 0
    snap = run.snapshot()
    assert snap.regret_pp == pytest.approx(s["regret_pp"])


@pytest.mark.parametrize("prefetch", [False, True])
def test_hits_on_prefetched_experts_are_counted_per_token_and_per_layer(tiny_model, tmp_path, prefetch):
    # the per-token history and the per-layer strip draw the policy's own hit rate: their counts
    # of hits on prefetched experts must add up to the run's (the streamer's "useful" guesses)
    from ds4f.engine.checkpoint import open_checkpoint

    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[presets.p]\npinned_layers = "50%"\ncache = "25%"\nprefetch = {str(prefetch).lower()}\n')
    run = _run(tiny_model, tmp_path, "pf", gen=12, preset="p", config_path=str(cfg))
    report = run.report
    s, tokens, layers = report["summary"], report["tokens"], report["layers"]
    useful = (s["prefetch"] or {}).get("useful", 0)
    assert len(tokens) == run.n_steps
    # per token: hits on prefetched experts are some of the token's hits
    assert all(0 <= t["prefetch_hits"] <= t["hits"] for t in tokens)
    # the tokens add up to the run: the totals the policy's own rate is computed from
    hits, misses = sum(t["hits"] for t in tokens), sum(t["misses"] for t in tokens)
    prefetched = sum(t["prefetch_hits"] for t in tokens)
    assert (hits, misses) == (s["hits"], s["misses"])
    assert prefetched == s["prefetch_hits"] == useful
    assert s["policy_hit_rate"] == pytest.approx((hits - prefetched) / (hits + misses))
    # per layer: the same count, never more than the layer's hits, none on the hash layers (no guess)
    with open_checkpoint(tiny_model) as ck:
        n_hash = ck.geometry.n_hash_layers
    assert sum(layer["prefetch_hits"] for layer in layers) == useful
    for layer in layers:
        h, m, p = layer["hits"], layer["misses"], layer["prefetch_hits"]
        assert 0 <= p <= h
        assert layer["policy_hit_rate"] == pytest.approx((h - p) / (h + m))
        if layer["layer"] < n_hash:
            assert p == 0
    if prefetch:
        assert useful > 0, "prefetch helped on this run (else the test checks nothing)"
    else:
        assert prefetched == 0 and all(layer["prefetch_hits"] == 0 for layer in layers)
        assert s["policy_hit_rate"] == pytest.approx(s["hit_rate"])
    # the snapshot says the same as the report, token by token and layer by layer
    snap = run.snapshot()
    assert [t.prefetch_hits for t in snap.tokens] == [t["prefetch_hits"] for t in tokens][-len(snap.tokens):]
    assert list(snap.layer_prefetch_hits) == [layer["prefetch_hits"] for layer in layers]
    assert snap.layer_policy_hit_rates() == pytest.approx([layer["policy_hit_rate"] for layer in layers])
    own = [t.policy_hit_rate for t in snap.tokens]
    assert own == pytest.approx([(t["hits"] - t["prefetch_hits"]) / (t["hits"] + t["misses"]) for t in tokens])


def test_a_done_run_replays_its_own_reads_for_its_io_efficiency(tiny_model, tmp_path):
    run = _run(tiny_model, tmp_path, "replay", gen=8, preset="minimal", probe_floor=True)
    r = run.summary_report
    replay = r["summary"]["disk_replay"]
    tokens = run.report["tokens"]
    last = tokens[-replay["tokens"]:]
    assert replay["tokens"] == min(32, len(tokens) - 1)
    assert replay["reads"] == sum(t["reads"] for t in last) > 0
    assert replay["run_busy_s"] == pytest.approx(sum(t["disk_busy_s"] for t in last))
    assert r["summary"]["io_efficiency"] == pytest.approx(replay["replay_s"] / replay["run_busy_s"])
    # nothing pinned: every token reads every trunk layer, and the replay reads them too
    assert replay["nbytes"] >= replay["tokens"] * sum(1 for _ in range(r["geometry"]["num_hidden_layers"]))
    assert any("disk replay" in e for e in r["events"])
    # the floor's ratio is reported apart, as the lower bound it is
    s = r["summary"]
    assert s["floor_ratio"] == pytest.approx(s["eff_read_gbps"] / s["floor_gbps"])
    assert run.snapshot().floor_age_s is not None and run.snapshot().floor_age_s >= 0


def test_bound_follows_the_disk_occupancy(tiny_model, tmp_path):
    run = _run(tiny_model, tmp_path, "b", gen=6)
    s = run.summary_report["summary"]
    assert s["bound"] == ("disk" if s["disk_busy_fraction"] >= DISK_BOUND_BUSY else "compute")
    snap = run.snapshot()
    assert snap.ram_bytes == psutil.virtual_memory().total
    assert snap.plan_bytes >= run.summary_report["cache"]["capacity_bytes"]
    assert snap.rss_budget_bytes > snap.plan_bytes


def test_the_memory_budget_holds_measured_from_outside(tiny_model, tmp_path):
    """Peak RSS of a long `ds4f run`, sampled from this process, within the budget its report states."""
    report = tmp_path / "r.json"
    err = open(tmp_path / "stderr.txt", "w")   # a file, not a pipe: 3000 progress lines would fill a pipe
    proc = subprocess.Popen([sys.executable, "-m", "ds4f.cli", "run", str(tiny_model), "--gen", "3000",
                             "--no-probe", "--dump-state", str(tmp_path / "s.bin"), "--json", str(report)],
                            stdout=subprocess.DEVNULL, stderr=err)
    watched = psutil.Process(proc.pid)
    peak, samples = 0, 0
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
            samples += 1
        except psutil.Error:
            break
        time.sleep(0.005)
    err.close()
    assert proc.wait(300) == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
    summary = json.loads(report.read_text())["summary"]
    assert samples > 10
    assert peak <= summary["rss_budget_bytes"], (
        f"peak RSS {peak / 2**20:.1f} MiB over the budget {summary['rss_budget_bytes'] / 2**20:.1f} MiB")


def test_the_crc32_checks_are_counted_where_there_are_checksums(tiny_model, tiny_official, tmp_path):
    """The ds4f layout's records are checked as they are read, and what it costs is reported;
    the official shards carry no checksums, so nothing is checked or counted."""
    converted = _run(tiny_model, tmp_path, "c", gen=4, preset="minimal")
    official = _run(tiny_official, tmp_path, "o", gen=4, preset="minimal")
    assert converted.summary_report["summary"]["check_s_per_token"] > 0
    assert official.summary_report["summary"]["check_s_per_token"] == 0


def test_token_log_figures_follow_each_token():
    """The token log's figures over the warm tokens (computed once per token count, as snapshots
    come far more often than tokens) are numpy's over the rows so far after every token, never a
    count behind."""
    import numpy as np

    from ds4f.runs.snapshot import TokenLog, TokenRecord

    rng = np.random.default_rng(3)
    log = TokenLog(40)
    seconds, nbytes, busy = [], [], []
    for i in range(40):
        s, b, d = float(rng.uniform(0.1, 2.0)), int(rng.integers(0, 10**9)), float(rng.uniform(0.0, 0.1))
        log.add(TokenRecord(index=i, token_id=i, next_token_id=i + 1, seconds=s, bytes_read=b, hits=1, misses=1,
                            stall_s=0.0, backend="scalar", kernel_threads=1, io_threads=1, disk_busy_s=d))
        seconds.append(s), nbytes.append(b), busy.append(d)
        for _ in range(2):       # asked twice at one count: the same answer
            warm = slice(1, None) if i else slice(0, 1)      # the first token is the cold one
            assert log.median_seconds() == float(np.median(seconds[warm]))
            assert log.warm_gb_per_token() == float(np.mean(nbytes[warm])) / 1e9
            assert log.occupancy()[0] == float(np.sum(busy[warm])) / float(np.sum(seconds[warm]))
