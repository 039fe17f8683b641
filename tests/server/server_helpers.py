"""The server tests' fixtures and helpers (imported by each test module): a real `ds4f serve` (uvicorn on an ephemeral loopback port, in a
thread) on the tiny converted checkpoint, and a small HTTP client for it (Srv)."""
from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

import openai
import pytest

from ds4f.server.app import Server, ServerOptions

TERMINAL = ("done", "cancelled", "failed")
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


# -- sockets of their own (clients from a given loopback address) ----------------------------------
def connect_from(address: str, port: int, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to the server from a given loopback address (a client of its own)."""
    s = socket.socket()
    s.settimeout(timeout)
    s.bind((address, 0))
    s.connect(("127.0.0.1", port))
    return s


def read_all(s: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except (socket.timeout, ConnectionResetError):
        pass
    return b"".join(chunks)



# -- fixtures and helpers -------------------------------------------------------------------------
@pytest.fixture()
def serve_config(tmp_path) -> Path:
    """ds4f.toml for the tests: one kernel thread, no NVMe probe, a history database of its own."""
    path = tmp_path / "ds4f.toml"
    path.write_text('[engine]\nkernel_threads = 1\nprobe_floor = false\n\n'
                    f'[history]\npath = "{tmp_path / "history.sqlite3"}"\n')
    return path


class Resp:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        assert self.headers.get("content-type", "").startswith("application/json"), (self.headers, self.body)
        return json.loads(self.body)

    def error(self) -> dict:
        """OpenAI's error shape, checked."""
        err = self.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err), err
        return err


class Srv:
    def __init__(self, server: Server):
        self.server = server
        self.service = server.service
        server.start()
        self.port = server.port
        self.url = server.url

    def close(self) -> None:
        assert self.server.stop(timeout=60), "the run did not stop"

    def request(self, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None,
                timeout: float = 30.0) -> Resp:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            hdrs = dict(headers or {})
            data = raw
            if body is not None:
                data = json.dumps(body).encode()
                hdrs.setdefault("Content-Type", "application/json")
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return Resp(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def get(self, path: str, **kw) -> Resp:
        return self.request("GET", path, **kw)

    def post_run(self, **params) -> Resp:
        return self.request("POST", "/runs", body=params, headers=params.pop("_headers", None))

    def chat(self, headers=None, **body) -> Resp:
        body.setdefault("messages", HELLO)
        return self.request("POST", "/v1/chat/completions", body=body, headers=headers)

    def openai(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)

    def wait_state(self, run_id: str, states=TERMINAL, timeout: float = 60.0, **kw) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.get(f"/runs/{run_id}", **kw)
            assert r.status == 200, r.body
            view = r.json()
            if view["state"] in states:
                run = self.service.current_run
                if view["state"] in TERMINAL and run is not None and run.id == run_id:
                    run.wait(10)   # its thread records it in the history right after
                return view
            time.sleep(0.02)
        raise AssertionError(f"run {run_id} not in {states} after {timeout} s")

    def wait_tokens(self, run_id: str, n: int, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = self.get(f"/runs/{run_id}").json()
            if view["state"] == "running" and view["live"]["tokens_done"] >= n:
                return view
            assert view["state"] not in TERMINAL, view
            time.sleep(0.02)
        raise AssertionError(f"run {run_id} did not reach {n} tokens")

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine is free (the last run ended and its watcher handed the engine on)."""
        deadline = time.monotonic() + timeout
        while self.service.busy:
            assert time.monotonic() < deadline, "the engine stayed busy"
            time.sleep(0.01)


@pytest.fixture()
def start(tiny_model, serve_config):
    servers = []

    def _start(**overrides) -> Srv:
        opts = dict(model=str(tiny_model), config_path=str(serve_config), host="127.0.0.1", port=0,
                    access_log=False, parallel=1)   # one sequence at a time unless a test asks for more
        opts.update(overrides)
        srv = Srv(Server(ServerOptions(**opts)))
        servers.append(srv)
        return srv

    yield _start
    for srv in servers:
        if srv.server.serving:
            srv.close()


@pytest.fixture()
def srv(start) -> Srv:
    return start()


@pytest.fixture(scope="module")
def idle(tiny_model, tmp_path_factory) -> Srv:
    """One server for the tests that only send requests it refuses: it never runs anything."""
    root = tmp_path_factory.mktemp("idle")
    config = root / "ds4f.toml"
    config.write_text(f'[engine]\nkernel_threads = 1\nprobe_floor = false\n\n[history]\npath = "{root / "h.sqlite3"}"\n')
    # bodies up to 256 KiB: a body past it is refused while the client still sends (small enough
    # for the socket buffers to take the rest, so the client reads the 413)
    srv = Srv(Server(ServerOptions(model=str(tiny_model), config_path=str(config), port=0, access_log=False,
                                   max_body_bytes=256 * 1024)))
    yield srv
    assert srv.service.runs_started == 0
    srv.close()


