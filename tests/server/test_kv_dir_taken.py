"""`ds4f serve` and the prefix cache's directory: a --kv-dir or [kv] dir that is a file stops the
server at its start naming the option or key and the file; the startup line says where states are
kept; a file put where the directory was after the server started is said once in its log (a
`kept_state` event) and in the startup line, requests go on and states are kept in RAM only."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from ds4f.cli.serve import _prefix_cache_line
from server_helpers import serve_config, start  # noqa: F401 (fixtures)


def _serve(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "ds4f.cli", "serve", "--port", "0", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_serve_refuses_a_kv_dir_that_is_a_file_and_says_where_states_go(tiny_model, serve_config, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    proc = _serve("-m", tiny_model, "--config", serve_config, "--kv-dir", taken)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and out == "", (proc.returncode, out, err)
    assert err.strip() == (f"ds4f serve: error: --kv-dir: {taken} is a regular file, not a directory; the prefix"
                           f" cache keeps its states in a directory: give one (or kv.budget = 0 to keep them in"
                           f" RAM only)"), err
    cfg = tmp_path / "taken.toml"
    cfg.write_text(serve_config.read_text() + f'\n[kv]\ndir = "{taken}"\n')
    proc = _serve("-m", tiny_model, "--config", cfg)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and f"{cfg}: kv.dir: {taken} is a regular file" in err and "Traceback" not in err
    assert taken.read_text() == "not a directory"
    # a directory: the startup line says it, with the RAM tier and the budget
    kv = tmp_path / "kv"
    proc = _serve("-m", tiny_model, "--config", serve_config, "--kv-dir", kv)
    try:
        assert re.match(r"^ds4f serve: listening on http://127\.0\.0\.1:\d+$", proc.stdout.readline().strip())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert re.search(rf"ds4f serve: prefix cache: [0-9.]+ \w+ of kept states in RAM, [0-9.]+ \w+ in {re.escape(str(kv))}\n",
                     err), err


def test_a_file_put_where_the_kv_dir_was_is_said_once_and_requests_go_on(start, serve_config, tmp_path):
    kv = tmp_path / "kv"                          # not made yet: the config loads
    serve_config.write_text(serve_config.read_text() + f'\n[kv]\ndir = "{kv}"\nram = "64 MiB"\n')
    srv = start()
    kv.write_text("a file where the directory was to be")
    line = _prefix_cache_line(srv.service.cfg, srv.service.options)
    assert line.endswith(f"of kept states in RAM only: {kv} is a regular file, not a directory"), line
    ask = [{"role": "user", "content": "What is an expert cache? " * 4}]
    first = srv.chat(messages=ask, max_tokens=4, temperature=0)
    assert first.status == 200, first.body
    srv.wait_idle()
    again = srv.chat(messages=ask, max_tokens=4, temperature=0)
    assert again.status == 200, again.body
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0     # from RAM
    srv.wait_idle()
    said = f"prefix cache: {kv}: cannot write there ({kv} is a regular file, not a directory); states kept in RAM only"
    deadline = time.monotonic() + 30
    while not (logged := [e for e in list(srv.service.events.recent) if e["kind"] == "kept_state"]):
        assert time.monotonic() < deadline, list(srv.service.events.recent)
        time.sleep(0.05)
    assert [e["message"] for e in logged] == [said], logged
    assert kv.read_text() == "a file where the directory was to be" and not os.path.isdir(kv)
