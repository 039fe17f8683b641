"""The runs directory's disk budget ([runs] budget): runs' files in <data dir>/runs and the history
together stay within it, the oldest finished runs removed first, never a run in progress, counted
across processes; a run whose own files would pass it is refused before it starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ds4f.engine.config import load_config
from ds4f.errors import Ds4fError
from ds4f.runs.budget import RESERVATION, disk_usage, runs_budget_for
from ds4f.runs.config import RunConfig
from ds4f.runs.history import History
from ds4f.runs.run import start_run
from ds4f.runs.statedump import read_state

MB = 10**6


@pytest.fixture()
def data_dir(tmp_path, monkeypatch) -> Path:
    """A data directory of the test's own (XDG_DATA_HOME), so that removals touch no other test's runs."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    from ds4f.paths import user_data_dir

    return user_data_dir()


def _config(tmp_path, budget: str) -> str:
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[engine]\nprobe_floor = false\nkernel_threads = 1\n[kv]\nenabled = false\n'
                   f'[runs]\nbudget = "{budget}"\n')
    return str(cfg)


def _on_disk(data_dir: Path, history: Path) -> int:
    """What du would say of the runs directory and the history database's files."""
    seen: set = set()
    return disk_usage(data_dir / "runs", seen) + sum(disk_usage(f"{history}{s}", seen)
                                                      for s in ("", "-wal", "-shm", "-journal"))


def _done(run):
    assert run.wait(120) and run.state == "done", run.error
    return run


def test_runs_stay_within_the_budget_oldest_removed_first_records_kept(tiny_model, tmp_path, data_dir):
    cfg = _config(tmp_path, "4 MB")
    history = History(tmp_path / "history.sqlite3")
    runs = []
    for i in range(6):     # each a full dump of 47 tokens: about 1 MB with its report
        run = _done(start_run(RunConfig(model=str(tiny_model), prompt=tuple(range(40 + i % 2)), gen=7, dump="full",
                                        config_path=cfg), history=history))
        runs.append(run)
        used = _on_disk(data_dir, history.path)
        assert used <= 4 * MB, f"after run {i + 1}: {used} bytes on disk"
        assert read_state(run.dump_path).sha256 == run.summary_report["state_sha256"]   # the run's own stays
    kept = {p.name for p in (data_dir / "runs").iterdir()}
    assert kept == {r.id for r in runs[-len(kept):]} and 1 < len(kept) < 6, kept    # the newest, oldest gone first
    assert not runs[0].dump_path.parent.exists()
    assert any("to stay within the [runs] budget" in e for r in runs[-3:] for e in r.snapshot().events)
    # every run's record stays (the history is far from the budget), its dump gone or not
    assert [history.get(r.id).state for r in runs] == ["done"] * 6
    figures = runs_budget_for(data_dir / "runs", 4 * MB, history.path).figures(max_age_s=0)
    assert figures["used_bytes"] == _on_disk(data_dir, history.path) and figures["budget_bytes"] == 4 * MB
    assert figures["removed"] == 6 - len(kept) and figures["in_progress"] == 0


def test_a_run_whose_own_files_pass_the_budget_is_refused_before_it_starts(tiny_model, tmp_path, data_dir):
    cfg = _config(tmp_path, "1 MB")
    with pytest.raises(Ds4fError) as err:
        start_run(RunConfig(model=str(tiny_model), prompt=tuple(range(60)), gen=8, dump="full", config_path=cfg))
    message = str(err.value)
    assert err.value.param == "dump" and "[runs] budget of" in message and cfg in message, message
    assert "67 tokens" in message and "--dump compact" in message
    assert not (data_dir / "runs").exists() or not list((data_dir / "runs").iterdir())
    # the same run with a compact dump fits
    _done(start_run(RunConfig(model=str(tiny_model), prompt=tuple(range(60)), gen=8, dump="compact",
                              config_path=cfg)))


HOLDER = textwrap.dedent("""
    import sys, time
    from ds4f.runs.budget import runs_budget_for
    b = runs_budget_for(sys.argv[1], int(sys.argv[2]))
    r = b.reserve(sys.argv[3], int(sys.argv[4]))
    with open(sys.argv[3] + "/state.bin.partial", "wb") as f:     # what it writes, as a run does
        f.write(b"s" * int(sys.argv[4]))
        f.flush()
        print("held", flush=True)
    time.sleep(600)
""")


def _finished_run(runs: Path, name: str, nbytes: int, age: float) -> Path:
    d = runs / name
    d.mkdir(parents=True)
    (d / "state.bin").write_bytes(os.urandom(nbytes))
    (d / "report.json").write_text("{}")
    for p in (d / "state.bin", d / "report.json", d):
        os.utime(p, (age, age))
    return d


def test_a_run_in_progress_in_another_process_is_counted_and_never_removed(tmp_path):
    runs = tmp_path / "runs"
    old = [_finished_run(runs, f"2000010{i}-000000-aaaa", 400_000, 946_684_800 + i * 86_400) for i in range(3)]
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(runs), str(4 * MB), str(runs / "other"),
                             str(2 * MB)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        budget = runs_budget_for(runs, 4 * MB)
        # the other process's 2 MB in progress and 1.2 MB of finished runs: 1.5 MB more needs the two oldest out
        mine = budget.reserve(runs / "mine", 1_500_000)
        assert [d.exists() for d in old] == [False, False, True]
        assert (runs / "other" / RESERVATION).exists()
        fig = budget.figures(max_age_s=0)
        assert fig["in_progress"] == 2 and fig["removed"] == 2
        # nothing finished is left to remove: the next run is refused (busy), naming the budget
        old[2].joinpath("state.bin").unlink()
        with pytest.raises(Ds4fError) as err:
            budget.reserve(runs / "third", 1_000_000)
        assert err.value.kind == "busy" and "[runs] budget" in str(err.value) and "in progress" in str(err.value)
        assert not (runs / "third").exists() and (runs / "other").exists()
        # the other process is killed: its directory, 2 MB written, is a leftover and goes for the next run
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        third = budget.reserve(runs / "third", 1_000_000)
        assert not (runs / "other").exists() and (runs / "mine").exists()
        third.release()
        mine.release()
        assert not (runs / "mine").exists() and not (runs / "third").exists()   # nothing in them: gone
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_history_past_the_budget_loses_its_oldest_records_and_shrinks(tmp_path):
    history = History(tmp_path / "h.sqlite3")
    blob = "x" * 200_000
    for i in range(20):      # about 4 MB of records
        history.record(run_id=f"r{i:02d}", config={"note": blob + str(i)}, state="done", started_at=1000.0 + i,
                       finished_at=1001.0 + i)
    runs = tmp_path / "runs"
    _finished_run(runs, "19990101-000000-old", 300_000, 915_148_800)
    before = _on_disk_plain(runs, history.path)
    assert before > 3 * MB
    budget = runs_budget_for(runs, 2 * MB, history.path)
    notes = budget.settle(history=history)
    after = _on_disk_plain(runs, history.path)
    assert after <= 2 * MB, (before, after, notes)
    assert not (runs / "19990101-000000-old").exists()         # the runs' files first
    left = [r.run_id for r in history.list_runs(100)]
    assert left and left == [f"r{i:02d}" for i in range(19, 19 - len(left), -1)]      # the newest kept
    assert any("oldest record" in n for n in notes), notes
    assert budget.figures(max_age_s=0)["history_rows_removed"] == 20 - len(left)


def _on_disk_plain(runs: Path, history: Path) -> int:
    seen: set = set()
    return disk_usage(runs, seen) + sum(disk_usage(f"{history}{s}", seen) for s in ("", "-wal", "-shm", "-journal"))


@pytest.mark.parametrize("value, says", [('"10%"', "not a fraction"), ('"100 KB"', "at least 1 MB"),
                                         ('"lots"', "expected a size"), ("true", "runs.budget")])
def test_a_bad_runs_budget_names_the_file_and_key(tmp_path, value, says):
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f"[runs]\nbudget = {value}\n")
    with pytest.raises(Ds4fError) as err:
        load_config(cfg)
    assert str(cfg) in str(err.value) and "runs.budget" in str(err.value) and says in str(err.value), str(err.value)


def test_the_floor_cache_keeps_no_stale_measurements(tiny_model, tmp_path, monkeypatch):
    """floor.json in the cache directory: a checkpoint that changed or went leaves its entry
    behind; refreshing keeps only what cached_floor may still use, the newest at most."""
    import json
    import time

    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.runtime.disk_floor import FLOOR_ENTRIES, FLOOR_MAX_AGE_S, refresh_floor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = tmp_path / "cache" / "ds4f" / "floor.json"
    store.parent.mkdir(parents=True)
    now = time.time()
    known = {f"/gone/pool-{i}.bin:1:{i}|qd4": {"measured_at": now - FLOOR_MAX_AGE_S - 60 - i, "result": {}}
             for i in range(500)}
    known.update({f"/recent/pool-{i}.bin:1:{i}|qd4": {"measured_at": now - i, "result": {}}
                  for i in range(FLOOR_ENTRIES + 10)})
    known["junk"] = "not an entry"
    store.write_text(json.dumps(known))
    with open_checkpoint(tiny_model) as ck:
        refresh_floor(ck, 1, seconds=0.05)
    kept = json.loads(store.read_text())
    assert len(kept) == FLOOR_ENTRIES and not any(k.startswith("/gone/") or k == "junk" for k in kept)
    assert any(k.endswith("|qd1") for k in kept)           # the one just measured
    assert "/recent/pool-0.bin:1:0|qd4" in kept and f"/recent/pool-{FLOOR_ENTRIES + 9}.bin:1:{FLOOR_ENTRIES + 9}|qd4" \
        not in kept
