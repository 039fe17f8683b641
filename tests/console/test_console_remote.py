"""The console's client of a running server (console.core.remote), without Textual: the addresses it
takes, the Snapshot it rebuilds from a live view, the event stream it reads, what it says of a
server it cannot use, its reconnections and its operator calls. The server here is a stand-in
(http.server in a thread) that speaks the event stream's contract, so each case is exact and
fast; tests/console/test_console_attach.py drives the console against a real `ds4f serve`."""
from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ds4f.api import Ds4fError
from ds4f.console.core import remote as R
from ds4f.console.core import server_figures as S

from test_console_data import fixed_snapshot


# -- addresses, figures ---------------------------------------------------------------------------
def test_addresses():
    a = R.parse_address("localhost")
    assert (a.scheme, a.host, a.port, a.base) == ("http", "localhost", 8734, "") and a.local
    assert R.parse_address("http://127.0.0.1:9000/").url == "http://127.0.0.1:9000"
    assert R.parse_address("https://gpu-box").port == 443 and not R.parse_address("https://gpu-box").local
    assert R.parse_address("[::1]:8000").short == "[::1]:8000" and R.parse_address("[::1]:8000").local
    for bad in ("", "ftp://x", "http://u:p@h:1", "http://h:1?x=1", "http://h:99999"):
        with pytest.raises(Ds4fError):
            R.parse_address(bad)


def _live_view(snap) -> dict:
    """What the server sends for a run: the Snapshot as JSON, its per-token list replaced by the
    last 8 records (server.service.snapshot_view)."""
    d = dataclasses.asdict(snap)
    tokens = d.pop("tokens")
    d["recent_tokens"] = tokens[-8:]
    d["gen"] = 32
    return json.loads(json.dumps(d))


def test_a_snapshot_is_rebuilt_from_its_live_view():
    snap = fixed_snapshot("running")
    back = R.snapshot_from_view(_live_view(snap))
    assert back == dataclasses.replace(snap, tokens=snap.tokens[-8:])
    # an older server's view without some fields, a newer one's with fields this console does not know
    view = _live_view(snap)
    del view["spec_mode"], view["ram_bytes"], view["io_efficiency"]
    view["something_new"] = 1
    old = R.snapshot_from_view(view)
    assert old.spec_mode == "off" and old.ram_bytes == 0 and old.io_efficiency is None


def test_the_token_history_gathers_polls():
    toks = fixed_snapshot("running").tokens
    h = R.TokenHistory(keep=10)
    dicts = [dataclasses.asdict(t) for t in toks]
    assert [t.index for t in h.add("a", dicts[0:8])] == list(range(8))
    assert [t.index for t in h.add("a", dicts[4:12])] == list(range(2, 12))       # the last 10 kept
    assert [t.index for t in h.add("a", dicts[20:24])][-4:] == list(range(20, 24))  # a gap stays a gap
    assert [t.index for t in h.add("b", dicts[0:2])] == [0, 1]                     # another run starts over


def test_sse_reader():
    lines = iter([b": comment\n", b"event: hello\n", b"data: {\"a\":\n", b"data: 1}\n", b"\n",
                  b"data: x\r\n", b"\r\n", b"event: log\n", b"data:{}\n", b"\n", b""])
    assert list(R.SseReader(lambda: next(lines))) == [("hello", '{"a":\n1}'), ("message", "x"), ("log", "{}")]


def test_sequence_lines_fit_their_width():
    decode = {"run_id": "r1", "endpoint": "chat", "client": "127.0.0.1 OpenAI/Python", "state": "decode",
              "prompt_tokens": 600, "prompt_tokens_reused": 512, "prompt_tokens_done": 600, "prefill_eta_s": 0,
              "tokens": 24, "max_tokens": 256, "decode_tok_s": 4.1, "spec_acceptance": 0.72, "batch_share": 0.33,
              "started_at": 0}
    wide = S.sequence_line(decode)
    for part in ("chat", "127.0.0.1", "prompt 600 (512 reused)", "24/256 tok", "4.10 tok/s", "spec 72%", "share 33%"):
        assert part in wide
    narrow = S.sequence_line(decode, 60)
    assert len(narrow) <= 60 and "24/256 tok" in narrow and "share" not in narrow
    prefill = dict(decode, state="prefill", prompt_tokens_done=300, prefill_eta_s=3.2, tokens=0, endpoint="responses")
    line = S.sequence_line(prefill)
    assert "resp" in line and "50%" in line and "ETA 3.2 s" in line and "▕█████" in line
    waiting = dict(decode, state="waiting", run_id=None, prompt_tokens=None, started_at=time.time() - 3)
    assert "waiting 3.0 s" in S.sequence_line(waiting)
    assert S.latency_lines({"ttft_p50": 0.81, "ttft_p90": 1.2, "ttft_p99": 2.0, "itl_p50": 0.24, "itl_p90": 0.31,
                            "itl_p99": 0.4, "prefill_share_of_waiting": 0.62, "requests": 48}) == [
        "TTFT p50 810 ms · p90 1.2 s · p99 2.0 s", "ITL  p50 240 ms · p90 310 ms · p99 400 ms",
        "prefill 62% of the wait for a first token · 48 requests"]


def test_the_operator_keys_bodies():
    status = {"backend": {"default": "auto", "best": "avx2", "available": ["scalar", "avx2"]},
              "threads": {"kernel_threads": 2, "io_threads": None}, "run": {"io_threads": 4, "kernel_threads": 2},
              "preset": {"name": "laptop", "available": ["laptop", "server", "tiny"], "pending": None},
              "limits": {"max_threads": 256}, "server": {"draining": True}}
    view = R.ServerView(R.parse_address("localhost"), R.Connection(R.LIVE, 0), status=status)
    assert R.server_settings(status) == {"preset": "laptop", "pending_preset": None, "backend": "avx2",
                                         "kernel_threads": 2, "io_threads": 4, "draining": True}
    assert R.backend_toggle(view)[0] == {"backend": "scalar"}
    scalar = dict(status, backend={"default": "scalar", "best": "avx2"})
    assert R.backend_toggle(dataclasses.replace(view, status=scalar))[0] == {"backend": "avx2"}
    with pytest.raises(Ds4fError, match="no SIMD"):
        R.backend_toggle(dataclasses.replace(view, status=dict(status, backend={"default": "scalar", "best": "scalar"})))
    assert R.threads_step(view, kernel=1) == ({"kernel_threads": 3}, "kernel threads 2 → 3")
    assert R.threads_step(view, io=-1)[0] == {"io_threads": 3}
    assert R.next_preset(view)[0] == {"preset": "server"}
    pending = dict(status, preset=dict(status["preset"], pending="server"))
    assert R.next_preset(dataclasses.replace(view, status=pending))[0] == {"preset": "tiny"}


# -- a stand-in server -------------------------------------------------------------------------------
class Fake:
    """A server on a loopback port: `mode` says what it is (ds4f, an older ds4f without /events,
    something else); it records the operator calls it gets."""

    def __init__(self, mode: str = "ds4f", port: int = 0, token: str = "operator-secret-0123456789"):
        self.mode, self.token = mode, token
        self.calls: list[tuple[str, dict, dict]] = []
        self.log = [{"time": 1_700_000_000.0, "kind": "request", "message": "chat request from 127.0.0.1: run r1 "
                     "started", "run_id": "r1"}]
        self.sequences = [{"run_id": "r1", "endpoint": "chat", "client": "127.0.0.1", "state": "decode",
                           "prompt_tokens": 9, "prompt_tokens_reused": 0, "prompt_tokens_done": 9,
                           "prefill_eta_s": 0, "tokens": 3, "max_tokens": 16, "decode_tok_s": 2.0,
                           "spec_acceptance": None, "batch_share": None, "started_at": time.time()}]
        self.live = _live_view(fixed_snapshot("running"))
        self.live["run_id"] = "r1"
        self.streams = 0
        self.stop_streams = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _json(self, code, doc):
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/":
                    if fake.mode == "other":
                        body = b"<html>hello</html>"
                        self.send_response(200)
                        self.send_header("Content-Type", "text/html")
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        return
                    return self._json(200, {"name": "ds4f", "version": "0.0.9", "endpoints": []})
                if self.path.startswith("/events"):
                    if fake.mode != "ds4f":
                        return self._json(404, {"error": {"message": "no such endpoint: /events"}})
                    return self._stream()
                if self.path.startswith("/runs/r1"):
                    return self._json(200, {"id": "r1", "state": "running", "live": fake.live})
                return self._json(404, {"error": {"message": "no"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                fake.calls.append((self.path, body, dict(self.headers)))
                sent = self.headers.get("X-Ds4f-Operator-Token")
                if sent is None:
                    return self._json(401, {"error": {"message": "operator: the operator's token is required"}})
                if sent != fake.token:
                    return self._json(403, {"error": {"message": "operator: the token is not the operator's"}})
                return self._json(200, {"ok": True, "applied": body, "lands": "next step"})

            def _stream(self):
                fake.streams += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def send(name, doc):
                    data = f"event: {name}\ndata: {json.dumps(doc)}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                try:
                    send("hello", {"server": "ds4f", "version": "0.1.0", "model": "tiny",
                                   "served_model_names": ["tiny"], "events_version": 1})
                    for e in fake.log:
                        send("log", e)
                    while not fake.stop_streams.is_set():
                        send("snapshot", fake.status())
                        time.sleep(0.05)
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.token_file = None
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def status(self) -> dict:
        return {"server": {"version": "0.1.0", "draining": False},
                "queue": {"capacity": 8, "waiting": 0, "queued": []},
                "preset": {"name": "laptop", "available": ["laptop", "server"], "pending": None},
                "backend": {"default": "auto", "best": "avx2", "available": ["scalar", "avx2"]},
                "threads": {"kernel_threads": 1, "io_threads": 2}, "limits": {"max_threads": 256},
                "run": None, "prefix_cache": None,
                "operator": {"token_file": self.token_file, "loopback_only": True},
                "sequences": self.sequences,
                "latency": {"ttft_p50": 0.5, "ttft_p90": None, "ttft_p99": None, "itl_p50": None, "itl_p90": None,
                            "itl_p99": None, "prefill_share_of_waiting": None, "requests": 1}}

    def close(self) -> None:
        self.stop_streams.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def make(**kw) -> Fake:
        f = Fake(**kw)
        servers.append(f)
        return f

    yield make
    for f in servers:
        f.close()


def wait(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAST = dict(interval=0.2, backoff=(0.1, 0.2), connect_timeout=2.0, read_timeout=2.0)


def test_a_live_stream(fake, tmp_path):
    f = fake()
    link = R.ServerLink(f.url, **FAST).start()
    try:
        wait(lambda: link.view().status is not None, what="a snapshot")
        view = link.view()
        assert view.connection.live and view.hello["model"] == "tiny"
        assert [s["run_id"] for s in view.sequences] == ["r1"] and view.latency["requests"] == 1
        # the run followed is the most active sequence; its figures come from GET /runs/r1
        assert view.followed == "r1"
        wait(lambda: link.view().snapshot is not None, what="the followed run's snapshot")
        assert link.view().snapshot.tokens_done == 24
        messages = [e.message for e in link.log_after(0)]
        assert any("attached to" in m for m in messages) and any("run r1 started" in m for m in messages)
        # a restart of the stream (r) replays the server's last events: logged once
        link.retry_now()
        wait(lambda: f.streams >= 2, what="a second stream")
        time.sleep(0.3)
        assert sum("run r1 started" in e.message for e in link.log_after(0)) == 1
        assert link.view().connection.live
    finally:
        link.close()


def test_operator_calls_carry_the_token(fake, tmp_path):
    f = fake()
    token_file = tmp_path / "operator-token"
    token_file.write_text(f.token + "\n")
    token_file.chmod(0o600)
    f.token_file = str(token_file)
    link = R.ServerLink(f.url, **FAST).start()
    try:
        wait(lambda: link.view().token_known, what="the token file named")
        link.operator("backend", {"backend": "scalar"}, "kernels avx2 → scalar").join(5)
        path, body, headers = f.calls[-1]
        assert path == "/operator/backend" and body == {"backend": "scalar"}
        assert headers["X-Ds4f-Operator-Token"] == f.token and headers["Authorization"] == f"Bearer {f.token}"
        last = link.log_after(0)[-1]
        assert last.kind == "operator-call" and "✓ operator backend" in last.message and "next step" in last.message
    finally:
        link.close()
    # a wrong token given on the command line: the 403 is in the log; none at all: said before any call
    wrong = R.ServerLink(f.url, operator_token="not-the-operator-token", **FAST).start()
    try:
        wait(lambda: wrong.view().connection.live)
        wrong.operator("drain", {}).join(5)
        assert "✗ operator drain: 403" in wrong.log_after(0)[-1].message
    finally:
        wrong.close()
    f.token_file = None
    none = R.ServerLink(f.url, **FAST).start()
    try:
        wait(lambda: none.view().status is not None)
        calls = len(f.calls)
        none.operator("resume", {}).join(5)
        assert "no operator token" in none.log_after(0)[-1].message and len(f.calls) == calls
    finally:
        none.close()


@pytest.mark.parametrize("mode, state, words", [("old", R.OLD_SERVER, "ds4f 0.0.9 has no /events"),
                                                ("other", R.NOT_DS4F, "not ds4f's answer")])
def test_a_server_it_cannot_use(fake, mode, state, words):
    f = fake(mode=mode)
    link = R.ServerLink(f.url, **FAST).start()
    try:
        wait(lambda: link.connection.state == state, what=state)
        conn = link.connection
        assert conn.problem and words in conn.text() and conn.retry_at is None
        time.sleep(0.3)
        assert link.connection.attempts == 1          # not retried until asked
        link.retry_now()
        wait(lambda: link.connection.attempts == 2, what="the retry")
    finally:
        link.close()


def test_a_closed_port_then_a_server_then_a_loss():
    port = free_port()
    link = R.ServerLink(f"127.0.0.1:{port}", **FAST).start()
    try:
        wait(lambda: link.connection.state == R.REFUSED, what="refused")
        assert "connection refused" in link.connection.text() and link.connection.problem
        f = Fake(port=port)                          # a server comes up there: the link finds it by itself
        try:
            wait(lambda: link.connection.live, what="live")
            assert not link.connection.problem
        finally:
            f.close()
        wait(lambda: link.connection.state == R.LOST, what="lost")
        text = link.connection.text()
        assert text.startswith("connection lost since ") and "retrying in" in text or "reconnecting" in text
        f = Fake(port=port)
        try:
            wait(lambda: link.connection.live, what="live again")
            assert any("reconnected" in e.message for e in link.log_after(0))
        finally:
            f.close()
    finally:
        link.close()
