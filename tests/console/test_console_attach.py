"""ds4f-console --attach against a real `ds4f serve` on loopback (the tiny checkpoint), driven by
Pilot: hello and snapshots reach the panels, a streaming request shows in the sequences panel,
each operator key makes its call and the log shows the answer, the error screen of a closed port
(and of something that is not a ds4f server), and a server that stops and comes back.

Runs are held at a step boundary by a gate (Run._apply_switches, where a switch lands), so a
sequence stays live for as long as a test looks at it, without a clock. The tests wait for the
server's GET /events (they skip, saying so, on a server without it)."""
from __future__ import annotations

import http.client
import json
import re
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from textual.widgets import Static

from ds4f.api import Run, best_backend
from ds4f.console.attach import AttachConsole
from ds4f.console.core.remote import LIVE, LOST
from ds4f.console.screens.attached import AttachedScreen, AttachErrorScreen
from ds4f.console.widgets.common import EventLog
from ds4f.native import kernels
from ds4f.server.app import Server, ServerOptions

from console_helpers import async_test, wait_for
from test_console_remote import Fake

SIMD = [b for b in kernels.available_backends() if b != "scalar"]
SIZE = (120, 36)
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


# -- a server, a gate, a streaming request -----------------------------------------------------------
@pytest.fixture()
def serve_config(tmp_path) -> Path:
    path = tmp_path / "ds4f.toml"
    path.write_text('[engine]\nkernel_threads = 1\nprobe_floor = false\n\n'
                    f'[history]\npath = "{tmp_path / "history.sqlite3"}"\n')
    return path


@pytest.fixture()
def serve(tiny_model, serve_config):
    """serve(port=0, **options) -> a started Server; all stopped at the end."""
    servers: list[Server] = []

    def start(port: int = 0, **overrides) -> Server:
        opts = dict(model=str(tiny_model), config_path=str(serve_config), host="127.0.0.1", port=port,
                    access_log=False, parallel=2, cancel_wait_s=2.0)
        opts.update(overrides)
        server = Server(ServerOptions(**opts))
        servers.append(server)
        server.start()
        about = json.loads(get(server.port, "/")[1])
        if not any(e["path"].startswith("/events") for e in about.get("endpoints", [])):
            pytest.skip("this ds4f serve has no GET /events yet (the console's attached mode waits for it)")
        return server

    yield start
    for server in servers:
        if server.serving:
            server.stop(timeout=30)


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Gate:
    """Holds every run at a step boundary (after `after` steps) until opened."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.reached = threading.Event()
        self.after = 0

    def close(self, after: int = 2) -> None:
        self.after = after
        self.reached.clear()
        self.opened.clear()

    def open(self) -> None:
        self.opened.set()

    def wrap(self, apply):
        def gated(run, eng, step):
            if not self.opened.is_set() and step >= self.after:
                self.reached.set()
                self.opened.wait(120)
            return apply(run, eng, step)
        return gated


@pytest.fixture()
def gate(monkeypatch):
    g = Gate()
    monkeypatch.setattr(Run, "_apply_switches", g.wrap(Run._apply_switches))
    yield g
    g.open()


class Stream:
    """A streaming chat completion in a thread: its chunks, and how it ended."""

    def __init__(self, port: int, max_tokens: int = 64) -> None:
        self.port, self.max_tokens = port, max_tokens
        self.status: int | None = None
        self.lines: list[str] = []
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            body = json.dumps({"messages": HELLO, "max_tokens": self.max_tokens, "stream": True}).encode()
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"Content-Type": "application/json", "User-Agent": "attach-test/1.0"})
            resp = conn.getresponse()
            self.status = resp.status
            while line := resp.readline():
                self.lines.append(line.decode())
        except OSError:
            pass
        finally:
            conn.close()
            self.done.set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- reading the screen -----------------------------------------------------------------------------
def text(app, selector: str, index: int = 0) -> str:
    return str(app.dashboard.pane(index).query_one(selector, Static).render())


def status_line(app, index: int = 0) -> str:
    return str(app.dashboard.pane(index).query_one(".a-status", Static).render())


def log_text(app, index: int = 0) -> str:
    return "\n".join(t.plain for t in app.dashboard.pane(index).query_one(EventLog).entries)


async def attached(pilot, index: int = 0):
    app = pilot.app
    await wait_for(pilot, lambda: app.links[index].view().status is not None, 90, "the first snapshot")
    await pilot.pause(0.3)


def make(urls, **kw) -> AttachConsole:
    kw.setdefault("refresh_s", 0.2)
    return AttachConsole(urls, **kw)


# -- the tests -------------------------------------------------------------------------------------
@async_test
async def test_hello_and_snapshots_reach_the_panels(serve, tiny_model):
    server = serve()
    app = make([server.url])
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot)
        assert isinstance(app.screen, AttachedScreen)
        line = status_line(app)
        assert f"127.0.0.1:{server.port}" in line and "● live" in line and tiny_model.name in line
        assert "attached to" in log_text(app) and tiny_model.name in log_text(app)
        assert "no sequence running" in text(app, "#seq-text") and "queue empty" in text(app, "#seq-text")
        assert "no request in the last hour" in text(app, "#lat-text")
        assert not app.query("TabbedContent")          # one server: no tab bar
        # a request: its run's figures come to the run panels, its end to the log and the latency
        stream = Stream(server.port, max_tokens=8)
        assert stream.done.wait(60) and stream.status == 200
        await wait_for(pilot, lambda: "run" in log_text(app) and " done" in log_text(app), 90, "the run's end")
        await wait_for(pilot, lambda: "TTFT p50" in text(app, "#lat-text"), 90, "the latency")
        await wait_for(pilot, lambda: "done" in text(app, "#run-state"), 90, "the run panel")
        assert "1 requests" in text(app, "#lat-text")
        # the server's runs directory against [runs] budget (20 GB by default), beside the prefix cache
        assert re.search(r"runs dir [\d.]+ [KMG]?i?B of 18\.6 GiB \(\d+%\)", text(app, "#prefix-text")), \
            text(app, "#prefix-text")
        # and the kv directory against [kv] budget (20 GB by default)
        assert re.search(r"kv dir [\d.]+ [KMG]?i?B of 18\.6 GiB \(\d+%\)", text(app, "#prefix-text")), \
            text(app, "#prefix-text")


@async_test
async def test_a_streaming_request_shows_and_s_cancels_it(serve, gate):
    server = serve()
    app = make([server.url])
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot)
        gate.close(after=3)
        stream = Stream(server.port, max_tokens=200)
        assert gate.reached.wait(60)
        await wait_for(pilot, lambda: "chat" in text(app, "#seq-text") and "attach-test/1.0" in text(app, "#seq-text"),
                       30, "the sequence")
        seq = text(app, "#seq-text")
        assert "127.0.0.1" in seq and "prompt" in seq and "/200 tok" in seq
        run_id = app.links[0].view().sequences[0]["run_id"]
        await wait_for(pilot, lambda: run_id in text(app, "#run-text"), 90, "the run panels following it")
        # ↓ picks it (the first press picks the one followed), s cancels it
        await pilot.press("down")
        await wait_for(pilot, lambda: app.links[0].view().selected == run_id, 10, "the pick")
        await pilot.press("s")
        await wait_for(pilot, lambda: f"operator cancel (run {run_id})" in log_text(app), 10, "the call")
        gate.open()
        await wait_for(pilot, lambda: "✓ operator cancel" in log_text(app), 90, "the answer")
        await wait_for(pilot, lambda: stream.done.is_set(), 90, "the stream's end")
        await wait_for(pilot, lambda: "cancelled by operator@127.0.0.1" in log_text(app), 90, "the server's word")
        await wait_for(pilot, lambda: "no sequence running" in text(app, "#seq-text"), 90, "no sequence")


@pytest.mark.skipif(not SIMD, reason="no SIMD backend on this CPU")
@async_test
async def test_k_switches_the_servers_kernels(serve, gate):
    server = serve()
    app = make([server.url])
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot)
        best = best_backend()
        await pilot.press("k")
        await wait_for(pilot, lambda: "✓ operator backend" in log_text(app), 90, "the answer")
        assert "→ scalar" in log_text(app)
        await wait_for(pilot, lambda: "scalar" in status_line(app), 10, "the status line")
        assert server.service.backend == "scalar"
        # a live run switches at its next step: the kernels panel shows where it landed
        gate.close(after=2)
        Stream(server.port, max_tokens=40)
        assert gate.reached.wait(60)
        await pilot.press("k")
        await wait_for(pilot, lambda: log_text(app).count("✓ operator backend") == 2, 90, "the second answer")
        assert server.service.backend == best
        gate.open()
        await wait_for(pilot, lambda: "scalar→" in text(app, "#kern-text"), 60, "the switch in the kernels panel")


@async_test
async def test_threads_preset_drain_and_resume(serve):
    server = serve()
    app = make([server.url])
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot)
        stream = Stream(server.port, max_tokens=4)      # the server says its thread counts once a run has run
        assert stream.done.wait(60)
        await wait_for(pilot, lambda: app.links[0].view().status.get("run") is not None, 90, "the run in the status")
        io = app.links[0].view().status["run"]["io_threads"]
        await pilot.press("right_square_bracket")
        await wait_for(pilot, lambda: "✓ operator threads" in log_text(app), 90, "the threads call")
        assert server.service.io_threads == io + 1
        presets = app.links[0].view().status["preset"]["available"]
        before = server.service.preset
        await pilot.press("p")
        await wait_for(pilot, lambda: "✓ operator preset" in log_text(app), 90, "the preset call")
        assert server.service.preset == presets[(presets.index(before) + 1) % len(presets)]
        await pilot.press("d")
        await wait_for(pilot, lambda: "DRAINING" in status_line(app), 90, "draining")
        assert "✓ operator drain" in log_text(app)
        refused = Stream(server.port, max_tokens=4)
        assert refused.done.wait(30) and refused.status == 503
        await pilot.press("u")
        await wait_for(pilot, lambda: "DRAINING" not in status_line(app), 90, "resumed")
        assert "✓ operator resume" in log_text(app)


@async_test
async def test_a_closed_port_gets_the_error_screen_until_a_server_comes(serve):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app = make([url])
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, AttachErrorScreen), 90, "the error screen")
        shown = str(app.screen.query_one("#error-title", Static).render()) + "\n" + str(
            app.screen.query_one("#error-message", Static).render())
        assert url in shown and "connection refused" in shown
        await pilot.press("r")                        # retried now: still nothing there
        await pilot.pause(0.5)
        assert isinstance(app.screen, AttachErrorScreen)
        assert "retrying" in log_text(app)
        serve(port=port)                              # a server there: found by itself, the screen goes
        await wait_for(pilot, lambda: isinstance(app.screen, AttachedScreen), 60, "the dashboard")
        await wait_for(pilot, lambda: "● live" in status_line(app), 10, "live")


@async_test
async def test_not_a_ds4f_server_and_an_older_one():
    other, old = Fake(mode="other"), Fake(mode="old")
    try:
        app = make([other.url, old.url])
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, AttachErrorScreen), 90, "the error screen")
            message = str(app.screen.query_one("#error-message", Static).render())
            assert other.url in str(app.screen.query_one("#error-title", Static).render())
            assert "not a ds4f server" in message
            await pilot.press("escape")                  # back to the tabs; the next one is an older ds4f
            await pilot.press("tab")
            await wait_for(pilot, lambda: isinstance(app.screen, AttachErrorScreen) and app.screen.index == 1, 30,
                           "the second server's error screen")
            message = str(app.screen.query_one("#error-message", Static).render())
            assert "without /events" in message and "0.0.9" in message
    finally:
        other.close()
        old.close()


@async_test
async def test_two_servers_two_tabs(serve):
    a, b = serve(), serve()
    app = make([a.url, b.url])
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot, 0)
        await attached(pilot, 1)
        assert app.query("TabbedContent")
        assert f":{a.port}" in status_line(app, 0) and f":{b.port}" in status_line(app, 1)
        assert app.dashboard.shown_index == 0
        await pilot.press("tab")
        assert app.dashboard.shown_index == 1
        await pilot.press("d")                           # the key acts on the server shown
        await wait_for(pilot, lambda: b.service.draining, 90, "the second server draining")
        assert not a.service.draining


@async_test
async def test_a_server_that_stops_and_comes_back(serve):
    server = serve()
    port = server.port
    app = make([server.url])
    app.links[0].backoff = (0.2, 0.5)
    async with app.run_test(size=SIZE) as pilot:
        await attached(pilot)
        assert server.stop(timeout=30)
        await wait_for(pilot, lambda: app.links[0].connection.state == LOST, 90, "the loss")
        await wait_for(pilot, lambda: "connection lost since" in text(app, "#seq-text"), 10, "the panel saying so")
        assert "✗ lost" in status_line(app)
        assert isinstance(app.screen, AttachedScreen)    # it was attached once: no error screen, the panels say it
        serve(port=port)
        await wait_for(pilot, lambda: app.links[0].connection.state == LIVE, 60, "the reconnection")
        await wait_for(pilot, lambda: "● live" in status_line(app), 10, "live again")
        assert "reconnected" in log_text(app)
