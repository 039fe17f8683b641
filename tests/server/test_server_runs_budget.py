"""`ds4f serve --dump full` on a small [runs] budget: every request writes a full state dump in
its own directory under the data directory, and the directory (with the history) stays within the
budget request after request, measured on disk; the oldest runs' dumps go first (410, their
records stay), the budget is in GET /status, and a request whose own dump would pass it is
refused before it runs."""
from __future__ import annotations

from pathlib import Path

import pytest

from ds4f.runs.budget import disk_usage
from server_helpers import serve_config, start  # noqa: F401 (fixtures)

MB = 10**6
BUDGET = 4 * MB


@pytest.fixture()
def data_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    from ds4f.paths import user_data_dir

    return user_data_dir()


def _on_disk(data_dir: Path, history: Path) -> int:
    seen: set = set()
    return disk_usage(data_dir / "runs", seen) + sum(disk_usage(f"{history}{s}", seen)
                                                      for s in ("", "-wal", "-shm", "-journal"))


def test_full_dumps_of_five_requests_stay_within_the_runs_budget(start, serve_config, tmp_path, data_dir):
    serve_config.write_text(serve_config.read_text() + '\n[runs]\nbudget = "4 MB"\n[kv]\nenabled = false\n')
    history = tmp_path / "history.sqlite3"
    srv = start(dump="full")
    ids, used = [], []
    for i in range(5):      # each about 1 MB: a full record is 20 KB a token on the tiny model
        r = srv.chat(messages=[{"role": "user", "content": f"Question {i}: " + "tell me more " * 5}],
                     max_tokens=8)
        assert r.status == 200, r.body
        ids.append(r.json()["id"].removeprefix("chatcmpl-"))
        srv.wait_idle()
        used.append(_on_disk(data_dir, history))
        assert used[-1] <= BUDGET, f"after request {i + 1}: {used[-1]} bytes on disk, past {BUDGET}"
        status = srv.get("/status").json()["runs_dir"]
        assert status["budget_bytes"] == BUDGET and 0 < status["used_bytes"] <= BUDGET, status
        assert status["dir"] == str(data_dir / "runs")
    assert max(used) > BUDGET // 2, used           # the requests did fill it
    status = srv.get("/status").json()["runs_dir"]
    assert status["removed"] >= 1 and status["in_progress"] == 0, status
    # the oldest request's dump went first; its record stays and says so
    gone = srv.get(f"/runs/{ids[0]}/state")
    assert gone.status == 410 and gone.json()["error"]["code"] == "gone", gone.body
    assert "[runs] budget" in gone.json()["error"]["message"]
    assert srv.get(f"/runs/{ids[0]}").json()["state"] == "done"
    last = srv.get(f"/runs/{ids[-1]}/state")
    assert last.status == 200 and last.body.startswith(b"DS4FSTAT")
    kept = {p.name for p in (data_dir / "runs").iterdir()}
    assert ids[-1] in kept and ids[0] not in kept and len(kept) < 5, kept
    # a request whose own dump would pass the budget is refused before it runs, naming it
    before = set((data_dir / "runs").iterdir())
    big = srv.chat(messages=[{"role": "user", "content": "tell me more " * 80}], max_tokens=8)
    assert big.status == 400, big.body
    err = big.error()
    assert err["param"] == "dump" and "[runs] budget of" in err["message"], err
    assert set((data_dir / "runs").iterdir()) == before
