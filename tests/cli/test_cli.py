"""The `ds4f` command line end to end on real files: bench console, --version, the short options,
MODEL's default, DS4F_KERNELS, refusals to overwrite, -o formats, bench engine, history."""
import argparse
import csv
import io
import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _ds4f(*args):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_bench_console_prints_figures_and_writes_json(tiny_model, tmp_path):
    out = _ds4f("bench", "console", tiny_model, "--json", tmp_path / "console.json")
    assert out.returncode == 0, out.stderr
    assert "key to action" in out.stdout and "bytes/refresh" in out.stdout
    figures = json.loads((tmp_path / "console.json").read_text())
    assert figures["keys"] == len(figures["key_latency_s"]) > 0
    assert figures["key_latency_median_s"] > 0


def test_bench_console_refuses_the_other_benches_flags(tmp_path):
    out = _ds4f("bench", "console", tmp_path, "--gen", "3")
    assert out.returncode == 2 and "--gen" in out.stderr and "Traceback" not in out.stderr
    missing = _ds4f("bench", "console", tmp_path / "nope")
    assert missing.returncode == 2 and "nope" in missing.stderr and "Traceback" not in missing.stderr


# ---- helpers for the tests below -------------------------------------------------------------------
def _cli(*args, env: dict | None = None, cwd=None):
    return subprocess.run([sys.executable, "-m", "ds4f.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})}, cwd=cwd)


def _own_dirs(tmp_path) -> dict:
    """XDG directories of this test's own: its data directory (history, runs) and config."""
    return {"XDG_DATA_HOME": str(tmp_path / "xdg-data"), "XDG_CONFIG_HOME": str(tmp_path / "xdg-config"),
            "XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}


# ---- --version, llama.cpp's short options, MODEL's default, --json - -----------------------------
def test_version():
    from importlib.metadata import version

    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"ds4f {version('ds4f')}"


def test_short_options_and_json_on_stdout(tiny_model, tmp_path):
    out = _cli("run", "-m", tiny_model, "-n", "2", "-t", "1", "-p", "0,5", "--no-probe", "--json", "-",
               env=_own_dirs(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)              # stdout is the report and nothing else
    assert report["config"]["gen"] == 2 and report["config"]["kernel_threads"] == 1
    assert report["prompt"] == [0, 5] and len(report["tokens"]) == 3
    s_per_token = report["summary"]["s_per_token"]
    line = next(l for l in out.stderr.splitlines() if l.startswith("s/token"))
    assert f"{1 / s_per_token:.2f} tokens/s" in line and f"{s_per_token:.3f} warm" in line
    kv = report["summary"]["kv_bytes"]
    assert f"KV cache       {kv / 2**20:.1f} MiB for {report['summary']['context']} positions" in out.stderr
    twice = _cli("run", tiny_model, "-m", tmp_path / "other", "-n", "1")
    assert twice.returncode == 2 and "give the model once" in twice.stderr


def test_run_defaults_to_the_configured_model(tiny_model, tmp_path):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[model]\npath = "{tiny_model}"\n')
    out = _cli("run", "--config", cfg, "-n", "1", "--no-probe", "--json", "-", env=_own_dirs(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"] == str(tiny_model)


def test_run_defaults_to_the_demo_model_announced_with_bars(tiny_official, tmp_path, monkeypatch, capsys):
    """No MODEL, no [model] path: the demo model, made with an announcement and bars (a tiny one here)."""
    from ds4f import api
    from ds4f.cli import options
    from ds4f.engine.checkpoint import demo

    calls = []

    def small_demo(progress=None, announce=None):
        calls.append(progress)
        return demo.ensure_demo_model(progress, announce=announce, root=tmp_path / "cache", geometry="tiny")

    monkeypatch.setattr(api, "ensure_demo_model", small_demo)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(model=None, model_option=None)
    path = options.default_model(args, None)
    err = capsys.readouterr().err
    assert calls == [True] and Path(path) == tmp_path / "cache" / demo.DEMO_DIRNAME
    assert demo.build_message("tiny", Path(path)) in err
    assert err.index("synth shard") > err.index(demo.build_message("tiny", Path(path)))   # then the two bars
    assert "convert layer" in err and "MB" in err
    assert options.default_model(args, None) == path and "making" not in capsys.readouterr().err


# ---- DS4F_KERNELS -----------------------------------------------------------------------------------
def test_ds4f_kernels_picks_the_backend_of_a_run(tiny_model, tmp_path):
    from ds4f.api import best_backend

    def backends(*extra, env):
        out = _cli("run", tiny_model, "-n", "2", "--no-probe", "--json", "-", *extra,
                   env={**_own_dirs(tmp_path), **env}, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return set(json.loads(out.stdout)["backend_by_token"])

    assert backends(env={"DS4F_KERNELS": "scalar"}) == {"scalar"}       # over engine.backend = "auto"
    assert backends(env={"DS4F_KERNELS": "auto"}) == {best_backend()}
    assert backends(env={"DS4F_KERNELS": "bogus"}) == {best_backend()}  # warned about, then auto
    if best_backend() != "scalar":
        assert backends("--backend", best_backend(), env={"DS4F_KERNELS": "scalar"}) == {best_backend()}
        cfg = tmp_path / "ds4f.toml"
        cfg.write_text(f'[engine]\nbackend = "{best_backend()}"\n')
        assert backends("--config", cfg, env={"DS4F_KERNELS": "scalar"}) == {best_backend()}


# ---- nothing is overwritten unasked --------------------------------------------------------------------
def test_run_refuses_to_overwrite_or_to_put_the_report_on_the_dump(tiny_model, tmp_path):
    env = _own_dirs(tmp_path)
    dump = tmp_path / "a.bin"
    for extra in (("--json", dump), ("--json", tmp_path / "x" / ".." / "a.bin"), ("--json", "a.bin", "--force")):
        out = _cli("run", tiny_model, "-n", "1", "--no-probe", "--dump-state", dump, *extra, env=env, cwd=tmp_path)
        assert out.returncode == 2 and "the same file" in out.stderr, out.stderr
        assert "run " not in out.stderr and not dump.exists()   # refused before the run started
    first = _cli("run", tiny_model, "-n", "1", "--no-probe", "--dump-state", dump, env=env)
    assert first.returncode == 0, first.stderr
    state, report = dump.read_bytes(), (tmp_path / "a.report.json").read_bytes()
    (tmp_path / "link.json").symlink_to(dump)
    os.link(dump, tmp_path / "hard.bin")
    for extra in (("--json", tmp_path / "link.json", "--force"), ("--json", tmp_path / "hard.bin", "--force")):
        out = _cli("run", tiny_model, "-n", "1", "--no-probe", "--dump-state", dump, *extra, env=env)
        assert out.returncode == 2 and "the same file" in out.stderr, out.stderr
    again = _cli("run", tiny_model, "-n", "2", "--no-probe", "--dump-state", dump, env=env)
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    dump2 = tmp_path / "b.bin"
    (tmp_path / "b.report.json").write_text("someone's report")   # the report that would go next to b.bin
    beside = _cli("run", tiny_model, "-n", "2", "--no-probe", "--dump-state", dump2, env=env)
    assert beside.returncode == 2 and "b.report.json already exists" in beside.stderr and not dump2.exists()
    assert dump.read_bytes() == state and (tmp_path / "a.report.json").read_bytes() == report
    forced = _cli("run", tiny_model, "-n", "2", "--no-probe", "--dump-state", dump, "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    assert dump.read_bytes() != state and json.loads((tmp_path / "a.report.json").read_text())["config"]["gen"] == 2


# ---- -o md|csv|json -----------------------------------------------------------------------------------
def test_replay_tables_in_every_format(tiny_model, tmp_path):
    dump = tmp_path / "s.bin"
    assert _cli("run", tiny_model, "-n", "6", "--no-probe", "--dump-state", dump,
                env=_own_dirs(tmp_path)).returncode == 0
    args = ("replay", dump, "--sweep", "25%,50%", "--policy", "lru,belady")
    text = _cli(*args)
    assert text.returncode == 0 and "lru" in text.stdout and "cells: hit rate" in text.stdout
    rows = list(csv.DictReader(io.StringIO(_cli(*args, "-o", "csv").stdout)))
    assert [r["budget"] for r in rows] == ["25%", "50%"] and set(rows[0]) == {"budget", "budget_gib", "lru", "belady"}
    assert all(0 <= float(r["lru"]) <= float(r["belady"]) <= 1 for r in rows)
    as_json = json.loads(_cli(*args, "-o", "json").stdout)
    assert [r["budget"] for r in as_json] == ["25%", "50%"]
    assert as_json[0]["lru"] == pytest.approx(float(rows[0]["lru"]))
    md = _cli(*args, "-o", "md")
    lines = md.stdout.strip().splitlines()
    assert lines[0] == "| budget | GiB | lru | belady |" and lines[1] == "|:---|---:|---:|---:|" and len(lines) == 4
    assert f"{as_json[0]['lru']:.1%}" in lines[2]
    assert "tokens" in md.stderr   # the header line about the trace went to stderr


def test_bench_engine_same_workload_no_targets_and_formats(tiny_model, tmp_path):
    out = _cli("bench", "engine", "-m", tiny_model, "-n", "2", "-o", "json", "--json", tmp_path / "b.json",
               env=_own_dirs(tmp_path))
    assert out.returncode == 0, out.stderr
    tables = json.loads(out.stdout)
    table = {row["metric"]: row for row in tables["engine"]}
    result = json.loads((tmp_path / "b.json").read_text())
    best = result["backend"]
    assert [row["position"] for row in tables["attention_depth"]] == [1024, 8192, 32768]
    assert table["s_per_token"][best] == result["simd"]["s_per_token"]
    assert table["tokens_per_s"]["scalar"] == pytest.approx(1 / result["scalar"]["s_per_token"])
    assert result["simd"]["tokens"] == result["scalar"]["tokens"] == len(result["prompt"]) - 1 + 2
    for run in ("simd", "scalar"):   # the parts of a warm token's time: each there, none beyond the whole
        split = result[run]["split"]
        parts = [split[k] for k in ("attention_s", "moe_compute_s", "read_wait_s", "head_s")]
        assert all(p >= 0 for p in parts) and split["attention_s"] > 0 and split["head_s"] > 0
        assert split["other_s"] >= -1e-6 and 0 < split["attention_share"] < 1
        assert table["split.attention_share"][run if run == "scalar" else best] == split["attention_share"]
    depth = result["attention_depth"]
    assert [d["position"] for d in depth] == [1024, 8192, 32768]
    kv = [d["kv_bytes"] for d in depth]
    assert kv[0] < kv[1] < kv[2] and all(d["attention_s_per_token"] > 0 for d in depth)
    text = _cli("bench", "engine", tiny_model, "-n", "2", env=_own_dirs(tmp_path))
    assert text.returncode == 0, text.stderr
    assert "tokens/s (warm)" in text.stdout and "scalar / " in text.stdout
    assert "attention share of s/token" in text.stdout and "KV cache MiB" in text.stdout
    for word in ("target", "NOT met", "MISS"):
        assert word not in text.stdout + text.stderr
    both = _cli("bench", "engine", tiny_model, "--json", "-", "-o", "csv")
    assert both.returncode == 2 and "both write to stdout" in both.stderr


def test_bench_builds_its_checkpoint_with_an_announcement_and_bars(tmp_path, monkeypatch, capsys):
    """`ds4f bench engine` without MODEL makes the bench checkpoint: announced, then the synth and
    convert bars; here the bench geometry is swapped for tiny, in a directory of the test's own."""
    from ds4f.cli import main
    from ds4f.engine.checkpoint import demo

    real = demo.ensure_synthetic
    made = []

    def small(geometry, progress=None, *, announce=None, root=None):
        made.append((geometry, progress))
        return real("tiny", progress, announce=announce, root=tmp_path / "cache")

    monkeypatch.setattr(demo, "ensure_synthetic", small)
    assert main(["bench", "engine", "-n", "2", "-o", "csv"]) == 0
    captured = capsys.readouterr()
    assert made == [("bench", True)]
    path = tmp_path / "cache" / "tiny-ds4f"
    message = demo.build_message("tiny", path)
    assert message in captured.err and captured.err.index(message) < captured.err.index("synth shard")
    assert "convert layer" in captured.err and "NVMe floor now" in captured.err
    assert captured.out.startswith("# ") and "\nmetric," in captured.out   # stdout: the CSV tables only
    assert "\n# attention at depth" in captured.out
    official, converted = demo.build_sizes("tiny")
    assert demo.disk_size(official + converted) in message
    assert sum(f.stat().st_size for f in path.iterdir()) == pytest.approx(converted, rel=0.05)


def test_building_refuses_a_disk_without_room(tmp_path, monkeypatch):
    import shutil as sh

    from ds4f.api import Ds4fError
    from ds4f.engine.checkpoint import demo

    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    said = []
    with pytest.raises(Ds4fError, match=r"1.00 kB free, but making the tiny model needs [\d.]+ MB"):
        demo.ensure_synthetic("tiny", announce=said.append, root=tmp_path)
    assert said == [] and not (tmp_path / "tiny-ds4f").exists()


# ---- ds4f history ---------------------------------------------------------------------------------------
def test_history_delete_and_prune_plan(tmp_path):
    from ds4f.api import Ds4fError
    from ds4f.runs.history import History, plan_prune, prune_runs, run_files

    data = tmp_path / "data"
    h = History(data / "history.sqlite3")
    outside = tmp_path / "mine.bin"
    outside.write_bytes(b"x" * 10)

    def run(run_id, started, state_path=None, write=True, **config):
        if write:
            for f in run_files(h.record(run_id, config, "done", state_path=str(state_path))):
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(b"s" * 100)
        h.record(run_id, config, "done", report={"summary": {}}, state_path=str(state_path) if state_path else None,
                 started_at=started, finished_at=started + 1)

    now = time.time()
    run("old-default", now - 10 * 86400, data / "runs" / "old-default" / "state.bin")
    run("old-outside", now - 9 * 86400, outside, write=False, dump_path=str(outside))
    run("old-relative", now - 8 * 86400, "rel.bin", write=False, dump_path="rel.bin")
    run("old-shared", now - 7 * 86400, data / "shared.bin", dump_path=str(data / "shared.bin"))
    run("old-db", now - 6 * 86400, h.path, write=False, dump_path=str(h.path))
    run("new-shared", now - 60, data / "shared.bin", dump_path=str(data / "shared.bin"))
    assert h.count() == 6
    with pytest.raises(Ds4fError, match="--keep N or --older-than"):
        plan_prune(h, data)
    assert [r.run_id for r in plan_prune(h, data, keep=5).runs] == ["old-default"]
    assert [r.run_id for r in plan_prune(h, data, older_than_s=8.5 * 86400).runs] == ["old-outside", "old-default"]
    plan = plan_prune(h, data, keep=1, older_than_s=3 * 86400)
    assert [r.run_id for r in plan.runs] == ["old-db", "old-shared", "old-relative", "old-outside", "old-default"]
    assert plan.files == [data / "runs" / "old-default" / "state.bin", data / "runs" / "old-default" / "report.json"]
    assert plan.nbytes == 200
    kept = {str(p): why for p, why in plan.kept}
    assert kept[str(outside)] == "outside the data directory"
    assert kept[str(data / "shared.bin")] == kept[str(data / "shared.report.json")] == "also a kept run's"
    assert kept[str(h.path)] == "the history database"
    assert kept["rel.bin"].startswith("a relative path")
    assert h.path.exists() and outside.exists()
    n_runs, n_files, problems = prune_runs(h, plan)
    assert (n_runs, problems) == (5, [])
    assert [r.run_id for r in h.list_runs()] == ["new-shared"]
    assert not (data / "runs" / "old-default").exists()          # emptied, then removed
    assert outside.read_bytes() == b"x" * 10 and (data / "shared.bin").exists() and h.count() == 1
    assert h.delete("new-shared") and not h.delete("new-shared") and h.count() == 0


def test_history_list_show_prune_on_real_runs(tiny_model, tmp_path):
    env = _own_dirs(tmp_path)
    data = tmp_path / "xdg-data" / "ds4f"
    mine = tmp_path / "kept" / "mine.bin"
    ids = []
    for extra in ((), (), ("--dump-state", mine), ()):
        out = _cli("run", tiny_model, "-n", "1", "--no-probe", "--history", "--json", "-", *extra, env=env)
        assert out.returncode == 0, out.stderr
        ids.append(json.loads(out.stdout)["run_id"])
        time.sleep(0.01)
    listing = _cli("history", "list", env=env)
    assert listing.returncode == 0, listing.stderr
    assert [l.split()[0] for l in listing.stdout.splitlines()[1:]] == ids[::-1]
    assert "tokens/s" in listing.stdout.splitlines()[0]
    rows = json.loads(_cli("history", "list", "-o", "json", env=env).stdout)
    assert [r["run_id"] for r in rows] == ids[::-1] and all(r["state"] == "done" for r in rows)
    assert "own hits" in listing.stdout.splitlines()[0]   # the policy's own rate, Belady's yardstick
    assert all(r["policy_hit_rate"] is None or 0 <= r["policy_hit_rate"] <= 1 for r in rows)
    show = _cli("history", "show", ids[2][:-2], env=env)   # a unique prefix will do
    assert show.returncode == 0 and ids[2] in show.stdout and str(mine) in show.stdout, show.stdout
    assert re.search(r"cache +\d+\.\d% own hits · \+\d+\.\d pts prefetch · Belady", show.stdout), show.stdout
    assert _cli("history", "show", "nope", env=env).returncode == 2

    run_dirs = sorted(p.name for p in (data / "runs").iterdir())
    assert run_dirs == sorted([ids[0], ids[1], ids[3]])
    dry = _cli("history", "prune", "--keep", "1", env=env)
    assert dry.returncode == 0 and "nothing removed" in dry.stdout and "--yes" in dry.stdout
    assert f"would remove file {data / 'runs' / ids[0] / 'state.bin'}" in dry.stdout
    assert f"keeping file {mine} (outside the data directory)" in dry.stdout
    assert len(json.loads(_cli("history", "list", "-o", "json", env=env).stdout)) == 4
    assert sorted(p.name for p in (data / "runs").iterdir()) == run_dirs   # the dry run touched nothing

    done = _cli("history", "prune", "--keep", "1", "--yes", env=env)
    assert done.returncode == 0, done.stderr
    assert "removed 3 runs and 4 files" in done.stdout
    assert [r["run_id"] for r in json.loads(_cli("history", "list", "-o", "json", env=env).stdout)] == [ids[3]]
    assert sorted(p.name for p in (data / "runs").iterdir()) == [ids[3]]
    assert mine.exists() and mine.with_name("mine.report.json").exists()   # outside the data directory
    assert (data / "history.sqlite3").exists()
    assert _cli("history", "prune", env=env).returncode == 2
    none = _cli("history", "prune", "--older-than", "1", "--yes", env=env)
    assert none.returncode == 0 and "nothing to prune" in none.stdout


def test_tables_render_raw_in_csv_and_json_formatted_in_md():
    from ds4f.cli.output import Cell, Column, Label, Table, render

    a = Table("sweep", [Column("budget", align="left"), Column("lru", spec=".1%")], title="hit rate")
    a.add("25%", 0.4712)
    a.add("10%", None)
    b = Table("prefetch", [Column("metric", align="left"), Column("on")], title="prefetch")
    b.add(Label("stall_s_per_token", "stall s/token"), Cell(0.000123, ".4f"))
    b.add(Label("wasted_per_useful", "wasted per useful"), float("inf"))
    assert render([a], "csv") == "budget,lru\n25%,0.4712\n10%,"
    assert json.loads(render([a], "json")) == [{"budget": "25%", "lru": 0.4712}, {"budget": "10%", "lru": None}]
    md = render([a, b], "md")
    assert md.startswith("# hit rate\n| budget | lru |\n|:---|---:|\n| 25% | 47.1% |\n| 10% | — |\n\n# prefetch\n")
    assert "| stall s/token | 0.0001 |" in md
    both = render([a, b], "csv").split("\n\n")
    assert both[1].splitlines() == ["# prefetch", "metric,on", "stall_s_per_token,0.000123", "wasted_per_useful,"]
    as_json = json.loads(render([a, b], "json"))
    assert as_json["prefetch"] == [{"metric": "stall_s_per_token", "on": 0.000123},
                                   {"metric": "wasted_per_useful", "on": None}]
    assert a.text().splitlines() == ["budget    lru", "25%     47.1%", "10%         —"]
