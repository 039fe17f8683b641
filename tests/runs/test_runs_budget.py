"""The runs directory's disk budget ([runs] budget): runs' files in <data dir>/runs and the history
together stay within it, the oldest finished runs removed first, never a run in progress, counted
across processes; a run whose own files would pass it is refused before it starts."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ds4f.errors import Ds4fError
from ds4f.runs.budget import RESERVATION, disk_usage, runs_budget_for
from ds4f.runs.config import RunConfig
from ds4f.runs.history import History
from ds4f.runs.run import start_run
from ds4f.runs.statedump import read_state
from ds4f.settings import load_settings

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
        load_settings(cfg)
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


# -- measured without walking every run's directory each time ---------------------------------------

def _runs_du(runs: Path) -> int:
    """What du would say of the runs directory and the budget's ledger beside it."""
    from ds4f.runs.budget import LEDGER_NAME

    seen: set = set()
    return disk_usage(runs, seen) + disk_usage(runs.parent / LEDGER_NAME, seen)


def _measured(budget) -> dict:
    """What settle() (a run's check after it) measured: figures of that measurement, no other scan."""
    budget.settle()
    return budget.figures(max_age_s=3600)


@pytest.fixture()
def quick(monkeypatch):
    """A directory changed 50 ms before a scan may be kept (the real margin is 2 s, for coarse
    file systems' timestamps); the kept measurements walked again only where a test says so."""
    import ds4f.runs.budget as budget_mod

    monkeypatch.setattr(budget_mod, "RACY_NS", 50_000_000)
    monkeypatch.setattr(budget_mod, "REWALK_PER_SCAN", 0)
    return budget_mod


def _settled_dirs(runs: Path, n: int, nbytes: int = 20_000) -> list[Path]:
    dirs = [_finished_run(runs, f"2001{i:04d}-000000-ab", nbytes, 978_307_200 + i * 60) for i in range(n)]
    time.sleep(0.1)      # past the (shortened) margin: their directories may be kept
    return dirs


ADDER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from ds4f.runs.budget import runs_budget_for
    b = runs_budget_for(sys.argv[1], int(sys.argv[2]))
    d = Path(sys.argv[3])
    r = b.reserve(d, 500_000)
    with open(d / "state.bin.partial", "wb") as f:      # as a run commits: written, then renamed
        f.write(os.urandom(300_000))
    os.replace(d / "state.bin.partial", d / "state.bin")
    (d / "report.json").write_text('{"state_nbytes": 300000}')
    b.settle(r, keep=d)
    print(b.figures(max_age_s=3600)["runs"], flush=True)
""")


def test_a_run_directory_another_process_adds_between_two_runs_is_counted(tmp_path, quick):
    runs = tmp_path / "data" / "runs"
    _settled_dirs(runs, 30)
    budget = runs_budget_for(runs, 100 * MB)
    first = _measured(budget)
    assert first["runs"] == 30 and first["used_bytes"] == _runs_du(runs)
    walked = budget.walked
    assert _measured(budget)["used_bytes"] == first["used_bytes"] and budget.walked == walked   # nothing walked
    out = subprocess.run([sys.executable, "-c", ADDER, str(runs), str(100 * MB), str(runs / "other")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "31", out.stderr
    after = _measured(budget)
    assert after["runs"] == 31 and after["used_bytes"] == _runs_du(runs) >= first["used_bytes"] + 300_000
    assert budget.walked == walked + 1            # the new directory alone


def test_a_run_directory_removed_by_hand_drops_out_and_a_file_removed_is_counted(tmp_path, quick):
    runs = tmp_path / "data" / "runs"
    dirs = _settled_dirs(runs, 30)
    budget = runs_budget_for(runs, 100 * MB)
    first = _measured(budget)
    walked = budget.walked
    shutil.rmtree(dirs[3])                  # by hand: a whole run
    (dirs[7] / "state.bin").unlink()        # and one file of another
    after = _measured(budget)
    assert after["runs"] == 29 and after["used_bytes"] == _runs_du(runs) < first["used_bytes"] - 2 * 20_000
    assert budget.walked == walked + 1      # dirs[7] only: dirs[3] is gone, the others unchanged
    # over the budget, the one removed by hand is not among what goes (it is not there), the oldest left is
    budget.budget = after["used_bytes"] - 1
    notes = budget.settle()
    assert not dirs[0].exists() and dirs[1].exists() and any(dirs[0].name in n for n in notes), notes
    assert _measured(budget)["used_bytes"] == _runs_du(runs)


def test_a_finished_run_whose_file_changed_is_measured_again(tmp_path, quick):
    runs = tmp_path / "data" / "runs"
    dirs = _settled_dirs(runs, 30)
    budget = runs_budget_for(runs, 100 * MB)
    first = _measured(budget)
    walked = budget.walked
    # a report rewritten the way every writer here does it (a new file renamed into place)
    tmp = dirs[5] / "report.json.new"
    tmp.write_text("x" * 200_000)
    os.replace(tmp, dirs[5] / "report.json")
    after = _measured(budget)
    assert after["used_bytes"] == _runs_du(runs) > first["used_bytes"] + 150_000
    assert budget.walked == walked + 1
    time.sleep(0.1)
    _measured(budget)                           # dirs[5] kept again
    # a state dump grown in place leaves its directory's key as it was: counted when its turn comes
    quick.REWALK_PER_SCAN = 8
    with open(dirs[20] / "state.bin", "ab") as f:
        f.write(os.urandom(500_000))
    truth, scans, walked = _runs_du(runs), 1, budget.walked
    while _measured(budget)["used_bytes"] != truth:
        scans += 1
        assert scans <= 30 // 8 + 1, "the grown file was never measured again"
    assert budget.walked - walked == 8 * scans      # a few directories a scan, not all of them


def test_a_file_linked_into_another_run_directory_is_counted_once(tmp_path, quick):
    runs = tmp_path / "data" / "runs"
    dirs = _settled_dirs(runs, 12, nbytes=400_000)
    budget = runs_budget_for(runs, 100 * MB)
    first = _measured(budget)
    os.link(dirs[2] / "state.bin", dirs[9] / "copy.bin")       # dirs[2] is kept, counting it as its own
    after = _measured(budget)
    assert after["used_bytes"] == _runs_du(runs) < first["used_bytes"] + 400_000


FRESH = textwrap.dedent("""
    import sys
    import ds4f.runs.budget as budget
    budget.REWALK_PER_SCAN = 0          # what changed alone walked
    b = budget.RunsBudget(sys.argv[1], 10**12)
    f = b.figures(max_age_s=0)
    print(b.walked, f["runs"], f["used_bytes"], flush=True)
""")


def _fresh_process(runs: Path) -> tuple[int, int, int]:
    """(directories walked, runs, bytes) of a new process's first measurement."""
    out = subprocess.run([sys.executable, "-c", FRESH, str(runs)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    walked, n, used = map(int, out.stdout.split())
    return walked, n, used


def test_a_new_process_walks_only_what_changed_since_the_ledger(tmp_path, quick):
    from ds4f.runs.budget import LEDGER_EVERY, LEDGER_NAME

    runs = tmp_path / "data" / "runs"
    dirs = _settled_dirs(runs, LEDGER_EVERY + 6)
    budget = runs_budget_for(runs, 100 * MB)
    _measured(budget)                           # every directory walked: the ledger written
    ledger = runs.parent / LEDGER_NAME
    assert ledger.is_file()
    walked, n, used = _fresh_process(runs)
    assert (walked, n, used) == (0, LEDGER_EVERY + 6, _runs_du(runs))
    # by hand since: a run's directory removed, one added, a file replaced in a third
    shutil.rmtree(dirs[0])
    _finished_run(runs, "20990101-000000-new", 70_000, 978_307_200)
    (dirs[9] / "report.json").unlink()
    walked, n, used = _fresh_process(runs)
    assert (walked, n, used) == (2, LEDGER_EVERY + 6, _runs_du(runs))


@pytest.mark.parametrize("bad", ["garbage", "wrong keys", "another runs directory", "deep", "fifo", "symlink"])
def test_a_ledger_that_is_not_the_budget_s_own_is_ignored(tmp_path, quick, bad):
    """Whatever sits in the ledger's place that the budget did not write: every directory walked,
    the figure exact, nothing blocks (a FIFO is not opened for reading until a writer comes)."""
    import json

    from ds4f.runs.budget import LEDGER_EVERY, LEDGER_NAME

    runs = tmp_path / "data" / "runs"
    dirs = _settled_dirs(runs, LEDGER_EVERY + 1)
    _measured(runs_budget_for(runs, 100 * MB))
    ledger = runs.parent / LEDGER_NAME
    doc = json.loads(ledger.read_text())
    ledger.unlink()
    if bad == "garbage":
        ledger.write_bytes(b"\x00{not json" * 100)
    elif bad == "wrong keys":    # rows of the right shape that lie: a size for a key no directory has
        doc["dirs"] = [[r[0], r[1], r[2], r[3] + 1, r[4], 1, r[6], []] for r in doc["dirs"]]
        ledger.write_text(json.dumps(doc))
    elif bad == "another runs directory":
        doc["runs_dir"] = [doc["runs_dir"][0], doc["runs_dir"][1] + 1]
        ledger.write_text(json.dumps(doc))
    elif bad == "deep":
        ledger.write_text("[" * 100_000 + "]" * 100_000)
    elif bad == "fifo":
        os.mkfifo(ledger)
    else:
        (tmp_path / "elsewhere.json").write_text(json.dumps(doc))
        ledger.symlink_to(tmp_path / "elsewhere.json")
    walked, n, used = _fresh_process(runs)
    assert n == len(dirs) and walked == len(dirs) and used == _runs_du(runs)


def test_a_killed_run_s_leftover_is_swept_from_what_the_budget_found(tmp_path, quick):
    from ds4f.runs.statedump import sweep_run_dirs

    runs = tmp_path / "data" / "runs"
    _settled_dirs(runs, 20)
    killed = runs / "20010101-000000-killed"
    killed.mkdir()
    (killed / "state.bin.partial").write_bytes(b"s" * 1000)
    (killed / "report.json").write_text("{}")
    for p in (killed / "state.bin.partial", killed / "report.json", killed):
        os.utime(p, (978_307_200, 978_307_200))
    budget = runs_budget_for(runs, 100 * MB)
    assert budget.leftover_dirs() is None             # no scan yet: the sweep looks at every directory
    _measured(budget)
    assert budget.leftover_dirs() == [killed]
    assert sweep_run_dirs(runs, candidates=[]) == [] and killed.exists()      # only the candidates looked at
    notes = sweep_run_dirs(runs, candidates=budget.leftover_dirs())
    assert not killed.exists() and notes == [f"removed {killed}, what a killed run left"]


def test_a_directory_changed_just_before_a_scan_is_walked_again_at_the_next(tmp_path, quick):
    """Timestamps have a tick: a change in the tick of a walk could leave a directory's key as it
    was, so one changed within RACY_NS of a scan is never kept (here: every one, a minute's margin)."""
    runs = tmp_path / "data" / "runs"
    _settled_dirs(runs, 10)
    quick.RACY_NS = 60_000_000_000
    budget = runs_budget_for(runs, 100 * MB)
    for scan in range(3):
        walked = budget.walked
        assert _measured(budget)["used_bytes"] == _runs_du(runs)
        assert budget.walked - walked == 10, scan


def test_a_directory_within_a_run_s_directory_is_walked_every_time(tmp_path, quick):
    """A run writes no directory of its own; one made there by hand changes without its run's
    directory changing (a file added below it), so such a run's directory is never kept."""
    runs = tmp_path / "data" / "runs"
    dirs = _settled_dirs(runs, 10)
    (dirs[4] / "notes").mkdir()
    time.sleep(0.1)
    budget = runs_budget_for(runs, 100 * MB)
    first = _measured(budget)
    (dirs[4] / "notes" / "big.bin").write_bytes(os.urandom(300_000))
    after = _measured(budget)
    assert after["used_bytes"] == _runs_du(runs) > first["used_bytes"] + 250_000
