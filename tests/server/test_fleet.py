"""A fleet of `ds4f serve` boxes behind a router from PyPI, unchanged: the LiteLLM proxy (`litellm[proxy]`,
the `fleet` extra) with its session-affinity pre-call check, which keeps the requests that carry one
`x-litellm-session-id` on the box that served the first of them, so a conversation's later turns find
their prefix in that box's prefix cache. Two servers on the tiny model (each with its own kv directory
and history), the proxy in front as a subprocess, two agent threads talking through it at once with the
openai client; then the box holding one thread is stopped and the router moves its next requests to the
other one.

The proxy lives in its own environment (it pins its own openai, fastapi, ...): the test runs the
`litellm` found at $DS4F_LITELLM, else on PATH, and skips without one:

    python -m venv /tmp/router-venv && /tmp/router-venv/bin/pip install 'litellm[proxy]'
    DS4F_LITELLM=/tmp/router-venv/bin/litellm pytest tests/server/test_fleet.py
"""
from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import threading
import time

import openai
import pytest

from ds4f.server.app import Server, ServerOptions

LITELLM = os.environ.get("DS4F_LITELLM") or shutil.which("litellm")
pytestmark = pytest.mark.skipif(not LITELLM or not os.access(LITELLM, os.X_OK),
                                reason="the LiteLLM proxy is not installed (pip install 'litellm[proxy]', "
                                       "or point DS4F_LITELLM at its `litellm`)")

MASTER_KEY = "sk-ds4f-fleet-test-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@pytest.fixture()
def boxes(tiny_model, tmp_path):
    servers = []
    for i in range(2):
        home = tmp_path / f"box{i}"
        home.mkdir()
        config = home / "ds4f.toml"
        config.write_text('[engine]\nkernel_threads = 1\nprobe_floor = false\n\n'
                          f'[history]\npath = "{home / "history.sqlite3"}"\n')
        server = Server(ServerOptions(model=str(tiny_model), config_path=str(config), host="127.0.0.1", port=0,
                                      kv_dir=str(home / "kv"), access_log=False, parallel=1,
                                      served_model_names=("tiny",)))
        server.start()
        servers.append(server)
    yield servers
    for server in servers:
        if server.serving:
            server.stop(timeout=60)


@pytest.fixture()
def router(boxes, tmp_path):
    """The LiteLLM proxy on a free loopback port, one deployment per box under the model name `ds4f`."""
    port = _free_port()
    config = tmp_path / "litellm.yaml"
    deployments = "".join(
        f'  - model_name: ds4f\n    litellm_params: {{model: openai/tiny, api_base: "{s.url}/v1", api_key: none}}\n'
        for s in boxes)
    config.write_text("model_list:\n" + deployments +
                      "router_settings:\n"
                      "  routing_strategy: simple-shuffle\n"
                      '  optional_pre_call_checks: ["session_affinity"]\n'
                      "  num_retries: 2\n"
                      "  allowed_fails: 0\n"
                      "  cooldown_time: 300\n"
                      # a refused connection is an InternalServerError; a retry policy retries it even
                      # before the failed box's cooldown is recorded (else the retry may be skipped)
                      "  retry_policy: {InternalServerErrorRetries: 3, ServiceUnavailableErrorRetries: 3,"
                      " TimeoutErrorRetries: 3}\n")
    env = dict(os.environ, LITELLM_MASTER_KEY=MASTER_KEY, LITELLM_LOCAL_MODEL_COST_MAP="True",
               LITELLM_TELEMETRY="False")
    log = open(tmp_path / "litellm.log", "wb")
    proc = subprocess.Popen([LITELLM, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240   # its imports take ~25 s on two shared cores
        while True:
            assert proc.poll() is None, (tmp_path / "litellm.log").read_text()[-4000:]
            try:
                if _get(port, "/health/liveliness")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "litellm.log").read_text()[-4000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _box(boxes: list[Server], completion_id: str) -> int:
    """The box that ran a completion: its id is `chatcmpl-<run id>`, and only that box knows the run."""
    run_id = completion_id.removeprefix("chatcmpl-")
    found = [i for i, s in enumerate(boxes) if s.serving and _get(s.port, f"/runs/{run_id}")[0] == 200]
    assert len(found) == 1, (completion_id, found)
    return found[0]


def _turn(client: openai.OpenAI, boxes: list[Server], session: str, messages: list) -> tuple[int, int]:
    """One turn of a conversation through the router: (the box that ran it, its cached prompt tokens)."""
    r = client.chat.completions.create(model="ds4f", messages=messages, max_tokens=8, temperature=0,
                                       extra_headers={"x-litellm-session-id": session})
    assert r.usage.completion_tokens > 0
    messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                 {"role": "user", "content": f"Go on with step {len(messages) // 2}."}]
    return _box(boxes, r.id), r.usage.prompt_tokens_details.cached_tokens


def test_fleet_keeps_each_conversation_on_its_box_and_fails_over(boxes, router):
    client = openai.OpenAI(base_url=f"{router}/v1", api_key=MASTER_KEY, max_retries=0, timeout=120)
    sessions = {name: [{"role": "system", "content": f"You are the {name} agent. " * 12},
                       {"role": "user", "content": f"Begin the {name} task."}]
                for name in ("agent-alpha-0001", "agent-beta-0002")}
    turns: dict[str, list[tuple[int, int]]] = {name: [] for name in sessions}   # (box, cached tokens)
    errors: list[BaseException] = []

    def converse(name: str, n: int) -> None:
        try:
            for _ in range(n):
                turns[name].append(_turn(client, boxes, name, sessions[name]))
        except BaseException as exc:   # noqa: BLE001 -- reported by the main thread
            errors.append(exc)

    # the two agents talk at once, three turns each: each stays on one box, its later turns cache hits
    threads = [threading.Thread(target=converse, args=(name, 3)) for name in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for name, seen in turns.items():
        assert len(seen) == 3, (name, seen)
        assert len({box for box, _ in seen}) == 1, (name, seen)
        assert all(cached > 0 for _, cached in seen[1:]), (name, seen)

    # stop alpha's box mid-conversation: the router moves both agents' next requests to the other box
    home = turns["agent-alpha-0001"][0][0]
    assert boxes[home].stop(timeout=60)
    after = {name: [_turn(client, boxes, name, sessions[name]) for _ in range(2)] for name in sessions}
    assert all(box == 1 - home for seen in after.values() for box, _ in seen), after
    # the other box holds alpha's prefix now: its second turn there is a prefix-cache hit
    assert after["agent-alpha-0001"][1][1] > 0, after
