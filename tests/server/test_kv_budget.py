"""`ds4f serve` on a small [kv] budget, its directory shared with another process's kept states:
request after request the directory holds at most the budget on disk (every file counted, the
other process's too), the least recently used go first, and GET /status `kv` says the directory,
the bytes it holds and the budget."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from ds4f.engine.prefix_cache import directory_usage
from ds4f.engine.session_state import read_header
from server_helpers import serve_config, start  # noqa: F401 (fixtures)

BUDGET = 250_000      # the tiny model's heads are ~37 KB: the other's three and six requests' pass it


def test_requests_keep_the_shared_kv_directory_within_its_budget(start, serve_config, tmp_path, tiny_model):
    kv = tmp_path / "kv"
    serve_config.write_text(serve_config.read_text() + f'\n[kv]\ndir = "{kv}"\nbudget = "{BUDGET} B"\n')
    # another process (another server on the same directory) kept states there first
    other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from ds4f.engine.checkpoint import open_checkpoint
        from ds4f.engine.config import load_config
        from ds4f.engine.engine import Engine
        from ds4f.engine.prefix_cache import PrefixCache
        eng = Engine(open_checkpoint({str(tiny_model)!r}), load_config(None).get_preset("laptop"), 1, 1, "scalar")
        cache = PrefixCache(eng.fingerprint, eng.geometry.to_config(), 0, {str(kv)!r}, {BUDGET})
        for k in range(3):
            s = eng.new_session()
            for t in range(40):
                s.eval(300 + k + t)
            cache.keep(s.snapshot())
        print(cache.figures().disk_bytes)""")], capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr
    theirs = {p.name for p in kv.glob("*.kv")}
    assert len(theirs) == 3 and int(other.stdout) == directory_usage(kv) <= BUDGET
    srv = start()
    status = srv.get("/status").json()["kv"]
    assert status == {"dir": str(kv), "used_bytes": directory_usage(kv), "budget_bytes": BUDGET}, status
    for i in range(6):
        r = srv.chat(messages=[{"role": "user", "content": f"Question {i}: " + "tell me more " * 6}], max_tokens=6)
        assert r.status == 200, r.body
        srv.wait_idle()
        used = directory_usage(kv)
        assert used <= BUDGET, f"after request {i + 1}: {used} bytes in {kv}, past {BUDGET}"
        status = srv.get("/status").json()["kv"]
        assert status == {"dir": str(kv), "used_bytes": used, "budget_bytes": BUDGET}, status
    # the other process's states were the least recently used: they went first, the requests' stay
    left = {p.name for p in kv.glob("*.kv")}
    assert not theirs & left and len(left) == 6, sorted(left)
    assert all(read_header(p)["tokens"][:1] != [300] for p in kv.glob("*.kv"))
    assert json.loads(json.dumps(srv.get("/status").json()["prefix_cache"]))["disk_budget"] == BUDGET
