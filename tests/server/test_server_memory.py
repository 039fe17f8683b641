"""A serving process stays within the memory its own reports state.

Each run's report says what the process should hold (`rss_budget_bytes`: the process before the
engine, the engine's resident bytes with the prefix cache's RAM tier, the run's own); a server
answering request after request must not pass it. What passed it: a finished run's session (its
KV cache and prefill buffers) and the states it marked for the prefix cache, held by the run's
record in reference cycles until Python's cyclic collector ran, and freed heap pages malloc kept
after the run. The server here is a real `ds4f serve` process whose cyclic collector is off, as
on a busy server where the oldest generation is seldom collected: anything freed only by that
collector piles up, request after request.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from server_helpers import serve_config  # noqa: F401 (fixture)

REQUESTS = 10
CHARS = 1500          # each system prompt: a few hundred tokens, so a prefill chunk's buffers are written

SERVE = "import gc, sys; gc.disable(); from ds4f.cli import main; sys.exit(main())"


def _listening_port(proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline:
        ch = proc.stdout.read(1)
        if not ch:
            break
        line += ch
        if ch == b"\n":
            m = re.match(rb"^ds4f serve: listening on http://127\.0\.0\.1:(\d+)\n$", line)
            if m:
                return int(m.group(1))
            line = b""
    raise AssertionError(f"the server did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else b''}")


def _find(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            got = _find(v, key)
            if got is not None:
                return got
    return None


def _idle(client: httpx.Client) -> None:
    """Until the engine has no run going: the last one's end (its release) is behind it."""
    deadline = time.monotonic() + 60
    while (engine := client.get("/status").json()["engine"])["state"] != "idle":
        assert time.monotonic() < deadline, f"the engine is still busy: {engine}"
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS read from /proc")
def test_rss_stays_within_the_reported_budget_request_after_request(tiny_model, serve_config, tmp_path):
    config = tmp_path / "ds4f-memory.toml"
    config.write_text(serve_config.read_text() + f'\n[kv]\nram = "1 MiB"\ndir = "{tmp_path / "kv"}"\n')
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "xdg-data"))
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "-m", str(tiny_model), "--config", str(config),
                             "--port", "0", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        port = _listening_port(proc)
        server = psutil.Process(proc.pid)
        samples = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            for i in range(REQUESTS):
                system = f"Agent {i}. " + " ".join(f"rule {i}-{k}: answer briefly." for k in range(CHARS // 24))
                r = client.post("/v1/chat/completions", json={
                    "model": "ds4f", "max_tokens": 8,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Hello {i}"}]})
                assert r.status_code == 200, r.text
                run_id = r.json()["id"].removeprefix("chatcmpl-")
                _idle(client)
                view = client.get(f"/runs/{run_id}").json()
                budget, prompt = _find(view, "rss_budget_bytes"), _find(view, "prompt_tokens")
                assert budget and prompt and prompt > 300, (budget, prompt)
                samples.append((server.memory_info().rss, budget))
        shown = [(round(r / 2**20), round(b / 2**20)) for r, b in samples]
        over = [(i, round(rss / budget, 3)) for i, (rss, budget) in enumerate(samples) if rss > 1.2 * budget]
        assert not over, f"the server's RSS passed the budget its runs report (request, RSS / budget): {over}; {shown} MiB"
        # and it does not climb request after request: what a finished run held is gone before the next
        grown = samples[-1][0] - samples[1][0]
        assert grown <= 0.1 * samples[-1][1], f"RSS grew {grown / 2**20:.1f} MiB over {REQUESTS - 2} requests: {shown} MiB"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
