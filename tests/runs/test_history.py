"""engine/history.py: the SQLite run history the console and the server share."""
import sqlite3
import threading

import pytest

from ds4f.errors import Ds4fError
from ds4f.runs.history import SCHEMA_VERSION, History, hash_groups


def _report(backend="avx2", n=3, sha="a" * 64):
    return {"state_sha256": sha, "summary": {"s_per_token": 0.25, "hit_rate": 0.7},
            "backend_by_token": [backend] * n, "tokens": [{"index": i} for i in range(n)]}


def test_creates_db_and_parent(tmp_path):
    path = tmp_path / "deep" / "dir" / "history.sqlite3"
    h = History(path)
    assert path.is_file()
    assert h.list_runs() == []
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_record_roundtrip_and_order(tmp_path):
    h = History(tmp_path / "h.db")
    h.record("r1", {"model": "/m", "preset": "laptop", "gen": 3}, "done", _report(), "/d/1.bin", "a" * 64,
             None, 100.0, 101.5)
    h.record("r2", {"model": "/m", "preset": "server", "gen": 3}, "failed", None, None, None, "boom", 200.0, 200.5)
    runs = h.list_runs()
    assert [r.run_id for r in runs] == ["r2", "r1"]
    r1 = h.get("r1")
    assert r1.config["preset"] == "laptop" and r1.state == "done"
    assert r1.summary["s_per_token"] == 0.25 and r1.s_per_token == 0.25
    assert r1.state_sha256 == "a" * 64 and r1.short_sha == "a" * 12
    assert r1.duration_s == pytest.approx(1.5)
    assert r1.backend == "avx2" and r1.kind == "simd" and r1.tokens_done == 3
    r2 = h.get("r2")
    assert r2.error == "boom" and r2.report is None and r2.summary == {}
    assert h.get("nope") is None
    assert h.count() == 2


def test_persists_across_instances(tmp_path):
    path = tmp_path / "h.db"
    History(path).record("r1", {"gen": 1}, "done", _report(), None, "b" * 64, None, 1.0, 2.0)
    History(path).set_setting("theme", "ds4f-light")
    again = History(path)
    assert [r.run_id for r in again.list_runs()] == ["r1"]
    assert again.get_setting("theme") == "ds4f-light"
    assert again.get_setting("missing", 42) == 42


def test_backend_kinds(tmp_path):
    h = History(tmp_path / "h.db")
    h.record("s", {}, "done", _report("scalar"), None, None, None, 1, 2)
    h.record("m", {}, "done", {"backend_by_token": ["avx2", "scalar"]}, None, None, None, 3, 4)
    assert h.get("s").kind == "scalar" and h.get("s").backend == "scalar"
    assert h.get("m").kind == "mixed" and h.get("m").backend == "mixed"


def test_hash_groups(tmp_path):
    h = History(tmp_path / "h.db")
    for i, sha in enumerate(["x", "x", "y", None]):
        h.record(f"r{i}", {}, "done", None, None, sha, None, i, i + 1)
    assert hash_groups(h.list_runs()) == {"x": 2}
    assert [r.run_id for r in h.with_sha("x")] == ["r1", "r0"]


def test_threads(tmp_path):
    h = History(tmp_path / "h.db")

    def work(k):
        for i in range(20):
            h.record(f"t{k}-{i}", {"k": k}, "done", None, None, None, None, k * 100 + i, k * 100 + i)
            h.list_runs(5)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.count() == 80


def test_not_a_database(tmp_path):
    path = tmp_path / "h.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(Ds4fError, match=str(path)):
        History(path)


def test_newer_schema_refused(tmp_path):
    path = tmp_path / "h.db"
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(Ds4fError, match="newer"):
        History(path)


def test_a_cancelled_run_keeps_its_token_count_in_the_history(tiny_model, tmp_path):
    from ds4f.runs.history import History
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    import threading

    history = History(tmp_path / "h.sqlite3")
    stop_at = 3
    started = threading.Event()   # the callback may fire before start_run has returned the run
    runs = []

    def on_token(record):
        if record.index + 1 == stop_at:
            started.wait(30)
            runs[0].cancel()

    run = start_run(RunConfig(model=str(tiny_model), gen=500, probe_floor=False,
                              dump_path=str(tmp_path / "s.bin")), history=history, on_token=on_token)
    runs.append(run)
    started.set()
    assert run.wait(120) and run.state == "cancelled"
    rec = history.get(run.id)
    assert rec.state == "cancelled" and rec.tokens_done == stop_at


def test_runs_with_other_sampling_are_not_comparable(tmp_path):
    h = History(tmp_path / "h.db")
    base = {"model": "/m", "gen": 8, "prompt": [0, 5, 9]}
    for i, sampling in enumerate((None, None, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2})):
        h.record(run_id=f"r{i}", config={**base, "sampling": sampling}, state="done", report=None, state_path=None,
                 state_sha256=None, error=None, started_at=1000.0 + i, finished_at=1001.0 + i)
    r = {rec.run_id: rec for rec in h.list_runs()}
    assert r["r0"].comparable_with(r["r1"])                 # both greedy
    assert not r["r0"].comparable_with(r["r2"])             # greedy against a draw
    assert not r["r2"].comparable_with(r["r3"])             # draws with other seeds diverge by design


def test_a_locked_history_is_said_and_the_command_fails(tiny_model, tmp_path):
    """Another process holds the database (an open write transaction): the run is done and its
    files written, but its record cannot be; after a bounded wait the CLI says so on stderr and
    exits non-zero, never 0 with the record quietly gone."""
    import os
    import subprocess
    import sys

    db = tmp_path / "h.sqlite3"
    History(db)                                          # the database exists (WAL: readers go on)
    cfg = tmp_path / "ds4f.toml"
    cfg.write_text(f'[engine]\nprobe_floor = false\n\n[history]\npath = "{db}"\n')
    holder = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys, time\n"
                               "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                               "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(60)", str(db)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = subprocess.run([sys.executable, "-m", "ds4f.cli", "run", str(tiny_model), "--gen", "2", "--no-probe",
                              "--history", "--config", str(cfg), "--dump-state", str(tmp_path / "a.bin")],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ))
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "history record was not written" in out.stderr and "locked" in out.stderr and str(db) in out.stderr
    assert (tmp_path / "a.bin").is_file()                  # the run itself is done, its files kept
    assert History(db).list_runs() == []                   # and indeed not recorded
