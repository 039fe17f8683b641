"""GET /events: a real `ds4f serve` on loopback, on the tiny model, watched with httpx's streaming:
hello, the recent log, snapshots with the live sequences while an OpenAI client streams, the
latency figures after requests, a watcher that never reads (the runs go on, it is dropped), the
bound on watchers, the token. Runs are held at a step boundary by a gate (events_helpers), never
timed."""
from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ds4f.api import Tokenizer, chat_prompt_ids

from events_helpers import Events, gate  # noqa: F401 (fixtures)
from server_helpers import HELLO, idle, serve_config, srv, start  # noqa: F401 (fixtures)

TOKEN = "k3Y-for-the-ds4f-tests_0123456789"
STATUS_KEYS = {"server", "engine", "queue", "batch", "model", "preset", "backend", "limits", "run", "last_report",
               "prefix_cache", "operator", "events"}
SEQUENCE_KEYS = {"run_id", "endpoint", "client", "state", "prompt_tokens", "prompt_tokens_reused", "prompt_tokens_done",
                 "prefill_eta_s", "tokens", "max_tokens", "decode_tok_s", "spec_acceptance", "batch_share",
                 "started_at"}
LATENCY_KEYS = {"ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99", "prefill_share_of_waiting",
                "requests"}


def watch(srv, interval: float = 0.2, headers=None):
    return httpx.stream("GET", f"{srv.url}/events?interval={interval}", headers=headers, timeout=30)


def streamed_chat(srv, max_tokens: int) -> tuple[str, str]:
    """An OpenAI client's streamed chat: (its completion id, its text)."""
    text, cid = [], None
    for chunk in srv.openai().chat.completions.create(model=_model(srv), messages=HELLO,
                                                      max_tokens=max_tokens, temperature=0, stream=True):
        cid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return cid, "".join(text)


def _model(srv) -> str:
    return srv.service.model_id


def test_hello_then_snapshots_of_an_idle_server(idle):
    with watch(idle, interval=0.5) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = Events(r)
        name, hello = events.next()
        assert name == "hello"
        assert hello == {"server": "ds4f", "version": idle.service.status()["server"]["version"],
                         "model": idle.service.model_id, "served_model_names": list(idle.service.model_names),
                         "events_version": 1}
        snap = events.snapshot()
        assert STATUS_KEYS <= set(snap) and snap["sequences"] == []
        assert snap["latency"] == {k: (0 if k == "requests" else None) for k in LATENCY_KEYS}
        assert snap["events"]["watchers"] == 1 and snap["operator"]["loopback_only"] is True
        assert events.snapshot()["sequences"] == []          # and again, every interval
    deadline = time.monotonic() + 10                         # closing the stream frees its place
    while idle.service.events.watchers:
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("query, param", [("interval=0.1", "interval"), ("interval=11", "interval"),
                                          ("interval=soon", "interval"), ("interval=nan", "interval"),
                                          ("every=1", "every")])
def test_bad_query_parameters_get_400_naming_them(idle, query, param):
    r = idle.get(f"/events?{query}")
    assert r.status == 400 and r.error()["param"] == param, r.body


def test_a_watcher_sees_the_recent_log_and_the_sequences_of_a_streaming_run(srv, gate, tiny_model):
    first = srv.chat(max_tokens=2, temperature=0)            # before the watcher: in the recent log
    assert first.status == 200, first.body
    first_run = first.json()["id"].removeprefix("chatcmpl-")
    assert srv.get("/runs/no-such-run").status == 404          # a refusal, logged with its reason
    with watch(srv) as r, ThreadPoolExecutor(1) as pool:
        events = Events(r)
        assert events.next()[0] == "hello"
        before = []
        while (event := events.next())[0] == "log":
            before.append(event[1])
        assert event[0] == "snapshot"
        assert all({"time", "kind", "message"} <= set(e) for e in before)
        started = [e for e in before if e["kind"] == "request" and e.get("run_id") == first_run]
        done = [e for e in before if e["kind"] == "done" and e.get("run_id") == first_run]
        assert len(started) == len(done) == 1 and "127.0.0.1" in started[0]["message"]
        assert started[0]["time"] <= done[0]["time"]
        refused = [e for e in before if e["kind"] == "refused" and "/runs/no-such-run" in e["message"]]
        assert len(refused) == 1 and "404" in refused[0]["message"] and "no run" in refused[0]["message"]

        # a streaming OpenAI client's run, held once it generated two tokens
        gate.close(lambda run, step: run.generated_tokens >= 2)
        sent_at = time.time()
        future = pool.submit(streamed_chat, srv, 24)
        run_id, _step = gate.wait()
        # (snapshots taken before it was held may still be on their way)
        snap = events.snapshot(lambda d: any(s["run_id"] == run_id and s["tokens"] == 2 for s in d["sequences"]))
        (seq,) = snap["sequences"]
        assert set(seq) == SEQUENCE_KEYS
        prompt = len(chat_prompt_ids(Tokenizer.load(tiny_model), HELLO))
        assert seq["endpoint"] == "chat" and seq["client"].startswith("127.0.0.1 OpenAI/")
        assert seq["state"] == "decode" and seq["tokens"] == 2 and seq["max_tokens"] == 24
        assert seq["prompt_tokens"] == seq["prompt_tokens_done"] == prompt and seq["prefill_eta_s"] == 0
        assert seq["decode_tok_s"] > 0 and seq["spec_acceptance"] is None and seq["batch_share"] is None
        assert seq["started_at"] >= sent_at and seq["prompt_tokens_reused"] >= 0   # the request's arrival, after sending
        assert snap["engine"]["current_run"] == run_id and snap["run"]["run_id"] == run_id
        gate.open()
        cid, text = future.result(timeout=60)
        assert cid == f"chatcmpl-{run_id}" and text
        log = events.log(lambda e: e["kind"] == "done" and e.get("run_id") == run_id)
        assert "24 tokens generated" in log["message"] or "generated" in log["message"]
        snap = events.snapshot(lambda d: d["latency"]["requests"] >= 2)
        lat = snap["latency"]
        assert set(lat) == LATENCY_KEYS and snap["sequences"] == []
        assert 0 < lat["ttft_p50"] <= lat["ttft_p90"] <= lat["ttft_p99"]
        assert 0 <= lat["itl_p50"] <= lat["itl_p90"] <= lat["itl_p99"]
        assert 0 < lat["prefill_share_of_waiting"] <= 1


def test_a_waiting_request_is_a_sequence_too(start, gate):
    srv = start(queue_size=2)
    with watch(srv) as r, ThreadPoolExecutor(2) as pool:
        events = Events(r)
        gate.close(lambda run, step: run.generated_tokens >= 1)
        a = pool.submit(streamed_chat, srv, 8)
        run_id, _ = gate.wait()
        b = pool.submit(streamed_chat, srv, 4)
        snap = events.snapshot(lambda d: len(d["sequences"]) == 2)
        running, waiting = snap["sequences"]
        assert running["run_id"] == run_id and running["state"] == "decode"
        assert waiting["run_id"] is None and waiting["state"] == "waiting" and waiting["max_tokens"] == 4
        assert waiting["prompt_tokens"] is None and waiting["tokens"] == 0 and waiting["prefill_eta_s"] is None
        assert waiting["started_at"] >= running["started_at"]
        (queued,) = events.logged(lambda e: e["kind"] == "queued")     # said when it joined, before
        assert queued["message"].endswith("position 1 of 1") and "127.0.0.1 OpenAI/" in queued["message"]
        gate.open()
        assert a.result(timeout=60)[1] and b.result(timeout=60)[1]


def test_a_watcher_that_never_reads_is_dropped_and_never_holds_a_run(start):
    srv = start(watcher_queue=8)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # a small window: the server's buffers fill
    stalled.connect(("127.0.0.1", srv.port))
    stalled.sendall(f"GET /events?interval=0.2 HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode())
    hub = srv.service.events
    deadline = time.monotonic() + 120

    def pump() -> None:
        """Log events for the watcher's queue (each refusal is one)."""
        for _ in range(20):
            assert srv.get("/runs/" + "x" * 60).status == 404
        assert time.monotonic() < deadline, hub.view()

    while not any(w.in_send for w in hub.watchers):           # its sends are stuck: nobody reads
        assert hub.dropped == 0
        pump()
    r = srv.chat(max_tokens=16, temperature=0)                 # a run while it stalls
    assert r.status == 200, r.body
    assert srv.wait_state(r.json()["id"].removeprefix("chatcmpl-"))["state"] == "done"
    while hub.dropped == 0:
        pump()
    while hub.watchers:
        time.sleep(0.02)
        assert time.monotonic() < deadline
    stalled.settimeout(10)
    with pytest.raises((ConnectionResetError, BrokenPipeError, socket.timeout, OSError)):
        while stalled.recv(1 << 20):                           # what was sent, then the reset
            pass
        raise ConnectionResetError("closed")
    stalled.close()
    with watch(srv) as r:                                      # and it says so to the next watcher
        events = Events(r)
        log = events.log(lambda e: e["kind"] == "watcher")
        assert "fell 8 events behind" in log["message"] and "127.0.0.1" in log["message"]
    assert srv.get("/status").json()["events"]["dropped"] == 1


def test_watchers_are_bounded_and_a_closed_stream_frees_its_place(start):
    srv = start(max_watchers=2)
    with watch(srv) as one, watch(srv) as two:
        assert one.status_code == two.status_code == 200
        third = srv.get("/events")
        assert third.status == 503 and int(third.headers["retry-after"]) >= 1
        assert third.error()["code"] == "too_many_watchers"
    deadline = time.monotonic() + 10
    while srv.service.events.watchers:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with watch(srv) as again:
        assert again.status_code == 200 and Events(again).next()[0] == "hello"


def test_events_need_the_api_token_when_one_is_set(start):
    srv = start(token=TOKEN)
    assert srv.get("/events").status == 401
    with watch(srv, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status_code == 200 and Events(r).next()[0] == "hello"


def test_a_kept_state_file_the_prefix_cache_refuses_is_logged(start, tmp_path):
    kv = tmp_path / "kv"
    srv = start(kv_dir=str(kv))
    ask = [{"role": "user", "content": "Hello, keeper."}]
    assert srv.chat(messages=ask, max_tokens=4, temperature=0).status == 200
    srv.close()
    files = sorted(kv.glob("*.kv"))
    assert files
    for f in files:                                            # another version's files
        data = bytearray(f.read_bytes())
        data[8:12] = (99).to_bytes(4, "little")
        f.write_bytes(bytes(data))
    srv = start(kv_dir=str(kv))
    with watch(srv) as r:
        events = Events(r)
        again = srv.chat(messages=ask, max_tokens=4, temperature=0)
        assert again.status == 200, again.body
        run_id = again.json()["id"].removeprefix("chatcmpl-")
        refused = []
        while len(refused) < len(files):
            refused.append(events.log(lambda e: e["kind"] == "kept_state"))
        assert {e["run_id"] for e in refused} == {run_id}
        assert {f for f in files if any(str(f) in e["message"] for e in refused)} == set(files)
        assert all("not used" in e["message"] for e in refused)


def test_sequences_stepping_together_have_their_share_of_the_batch(start, monkeypatch):
    """Two streaming clients on a server that steps two sequences together: each its own sequence,
    with its share of the rows the steps compute; an operator's cancel ends them (the test's way of
    ending two long answers)."""
    from ds4f.api import Run

    from events_helpers import OPERATOR_TOKEN, operator_headers

    apply = Run._apply_switches

    def slower(run, eng, step):      # steps a little slower, so the snapshots catch both decoding
        time.sleep(0.002)
        return apply(run, eng, step)

    monkeypatch.setattr(Run, "_apply_switches", slower)
    srv = start(parallel=2, reuse_prefix=False, operator_token=OPERATOR_TOKEN)
    with watch(srv) as r, ThreadPoolExecutor(2) as pool:
        events = Events(r)
        futures = [pool.submit(streamed_chat, srv, 4000) for _ in range(2)]

        def both_shared(d) -> bool:
            seqs = d["sequences"]
            return len(seqs) == 2 and all(s["state"] == "decode" and s["batch_share"] is not None for s in seqs)

        snap = events.snapshot(both_shared)
        assert snap["batch"]["active"] == 2
        assert all(0 <= s["batch_share"] <= 1 and s["endpoint"] == "chat" for s in snap["sequences"])
        assert sum(s["batch_share"] for s in snap["sequences"]) == pytest.approx(1.0)
        runs = [s["run_id"] for s in snap["sequences"]]
        switched = srv.request("POST", "/operator/backend", body={"backend": "scalar"}, headers=operator_headers())
        assert sorted(switched.json()["applied"]["runs"]) == sorted(runs)
        for run_id in runs:
            assert srv.request("POST", "/operator/cancel", body={"run_id": run_id},
                               headers=operator_headers()).status == 200
        for f in futures:
            with pytest.raises(Exception, match="cancelled"):
                f.result(timeout=60)


def test_a_stopping_server_ends_the_streams(start):
    srv = start()
    with watch(srv) as r:
        events = Events(r)
        assert events.next()[0] == "hello"
        srv.close()
        with pytest.raises((EOFError, httpx.RemoteProtocolError)):
            while True:
                events.next()
        assert events.logged(lambda e: e["kind"] == "shutdown")
