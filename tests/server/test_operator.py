"""POST /operator/{action}: a real `ds4f serve` on loopback, on the tiny model. The operator's
token (given, from ds4f.toml, or a random one in a 0600 file), its refusals (401, 403, loopback
only), and the actions: backend and threads switched in a live run at a step boundary (a gate
holds the run there, events_helpers) and for the runs to come, a second switch replacing one not
yet landed, cancel (the client gets the cancelled run's error), drain and resume, preset. No
clock: runs are held by the gate, or waited for."""
from __future__ import annotations

import json
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from starlette.requests import Request

from ds4f.api import available_backends, best_backend
from ds4f.server.errors import HttpError
from ds4f.server.operator import OperatorAuth

from events_helpers import OPERATOR_TOKEN, Events, gate, operator_headers  # noqa: F401 (fixtures)
from server_helpers import HELLO, serve_config, srv, start  # noqa: F401 (fixtures)

API_TOKEN = "k3Y-for-the-ds4f-tests_0123456789"
BUSY_GEN = 4000


def act(srv, action: str, body=None, headers=None):
    return srv.request("POST", f"/operator/{action}", body={} if body is None else body,
                       headers=operator_headers() if headers is None else headers)


@pytest.fixture()
def ops(start):
    """A server with a known operator token."""
    return start(operator_token=OPERATOR_TOKEN)


def simd_backend() -> str:
    best = best_backend()
    if best == "scalar":
        pytest.skip("this CPU has no SIMD backend: nothing to switch from scalar to")
    return best


def chat_stream(srv, max_tokens: int) -> str:
    text = []
    for chunk in srv.openai().chat.completions.create(model=srv.service.model_id, messages=HELLO, stream=True,
                                                      max_tokens=max_tokens, temperature=0):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return "".join(text)


def report_of(srv, run_id: str) -> dict:
    srv.wait_state(run_id)
    r = srv.get(f"/runs/{run_id}/report")
    assert r.status == 200, r.body
    return r.json()


# -- the token ------------------------------------------------------------------------------------
def test_a_random_token_is_written_0600_and_required(start, tmp_path):
    srv = start(operator_token_dir=str(tmp_path / "run"))
    status = srv.get("/status").json()["operator"]
    path = Path(status["token_file"])
    assert status["loopback_only"] is True and path == tmp_path / "run" / f"operator-token-{srv.port}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text().strip()
    assert len(token) >= 32

    missing = srv.request("POST", "/operator/drain", body={})
    assert missing.status == 401 and missing.headers["www-authenticate"].startswith("Bearer")
    assert missing.error()["code"] == "operator_token_required" and "operator.token_file" in missing.error()["message"]
    wrong = act(srv, "drain", headers=operator_headers("not-the-operator-token-000000"))
    assert wrong.status == 403 and wrong.error()["code"] == "operator_token_invalid"
    assert srv.get("/health").status == 200                    # nothing was done
    assert act(srv, "resume", headers={"X-Ds4f-Operator-Token": token}).json() == {
        "ok": True, "applied": {"draining": False, "was_draining": False}, "lands": "now"}
    srv.close()
    assert not path.exists()                                   # removed when the server stops


def test_a_given_token_and_the_api_token_together(start):
    srv = start(operator_token=OPERATOR_TOKEN, token=API_TOKEN)
    assert srv.get("/status", headers={"Authorization": f"Bearer {API_TOKEN}"}).json()["operator"]["token_file"] is None
    # on the operator's paths its token stands in for the API token; the API token is not the operator's
    assert act(srv, "resume").status == 200
    assert act(srv, "resume", headers={"Authorization": f"Bearer {API_TOKEN}"}).status == 403
    both = {"Authorization": f"Bearer {API_TOKEN}", "X-Ds4f-Operator-Token": OPERATOR_TOKEN}
    assert act(srv, "resume", headers=both).status == 200
    assert srv.get("/events").status == 401                    # elsewhere, the API token as before


def test_the_token_from_ds4f_toml(start, serve_config):
    serve_config.write_text(serve_config.read_text() + f'\n[server]\noperator_token = "{OPERATOR_TOKEN}"\n')
    srv = start()
    assert srv.get("/status").json()["operator"]["token_file"] is None
    assert act(srv, "resume").status == 200


def _request_from(address: str, headers: dict) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/operator/drain", "headers": raw,
                    "client": (address, 40000), "query_string": b""})


def test_peers_beyond_loopback_only_when_allowed():
    good = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    local = OperatorAuth(OPERATOR_TOKEN, remote=False)
    assert local.check(_request_from("127.0.0.2", good)) == "operator@127.0.0.2"
    assert local.check(_request_from("::1", good)) == "operator@::1"
    with pytest.raises(HttpError) as refused:
        local.check(_request_from("192.0.2.7", good))
    assert refused.value.status == 403 and "loopback" in refused.value.message
    remote = OperatorAuth(OPERATOR_TOKEN, remote=True)
    assert remote.check(_request_from("192.0.2.7", good)) == "operator@192.0.2.7"
    with pytest.raises(HttpError) as no_token:
        remote.check(_request_from("192.0.2.7", {}))
    assert no_token.value.status == 401


def test_bad_actions_and_parameters_change_nothing(ops):
    before = ops.get("/status").json()
    for action, body, status, param in (
            ("reboot", {}, 404, None), ("backend", {"backend": "gpu"}, 400, "backend"),
            ("backend", {}, 400, "backend"), ("backend", {"backend": "scalar", "threads": 2}, 400, "threads"),
            ("threads", {}, 400, "body"), ("threads", {"kernel_threads": 0}, 400, "kernel_threads"),
            ("threads", {"io_threads": "2"}, 400, "io_threads"), ("threads", {"kernel_threads": 10**6}, 400,
                                                                   "kernel_threads"),
            ("preset", {"preset": "nope"}, 400, "preset"), ("cancel", {}, 400, "run_id"),
            ("cancel", {"run_id": "20990101-000000-beef"}, 404, None), ("drain", {"now": True}, 400, "now")):
        r = act(ops, action, body)
        assert r.status == status, (action, body, r.body)
        if param:
            assert r.error()["param"] == param, (action, body, r.body)
    for lacking in [b for b in ("avx2", "avx512", "neon") if b not in available_backends()]:
        r = act(ops, "backend", {"backend": lacking})
        assert r.status == 400 and "not available" in r.error()["message"]
    assert ops.request("POST", "/operator/drain", raw=b"{}", headers={
        **operator_headers(), "Content-Type": "text/plain"}).status == 415
    after = ops.get("/status").json()
    for key in ("backend", "threads", "preset"):
        assert after[key] == before[key]
    assert after["server"]["draining"] is False


# -- backend and threads ----------------------------------------------------------------------------
def test_a_backend_switch_lands_at_a_step_boundary_and_a_second_replaces_one_not_landed(ops, gate):
    best = simd_backend()
    gate.close(lambda run, step: run.generated_tokens >= 2)
    r = ops.post_run(gen=16, prompt=[0, 5, 9])
    assert r.status == 202, r.body
    run_id, _ = gate.wait()
    first = act(ops, "backend", {"backend": "scalar"})
    assert first.json() == {"ok": True, "applied": {"backend": "scalar", "runs": [run_id]}, "lands": "next step"}
    again = act(ops, "backend", {"backend": best})            # before the first landed: it replaces it
    assert again.status == 200 and again.json()["lands"] == "next step"
    gate.close(lambda run, step: run.generated_tokens >= 6)   # the next hold, after the one now released
    gate.release()
    _, step = gate.wait()
    assert act(ops, "backend", {"backend": "scalar"}).status == 200
    gate.open()
    report = report_of(ops, run_id)
    by_token = report["backend_by_token"]
    assert by_token == [best] * step + ["scalar"] * (len(by_token) - step), by_token   # never scalar before
    live = ops.get(f"/runs/{run_id}").json()["live"]
    assert [sw[:2] for sw in live["switches"]] == [[0, best], [step, "scalar"]]
    assert ops.get("/status").json()["backend"]["default"] == "scalar"   # and the runs to come
    nxt = ops.chat(max_tokens=2, temperature=0)
    assert set(report_of(ops, nxt.json()["id"].removeprefix("chatcmpl-"))["backend_by_token"]) == {"scalar"}
    assert act(ops, "backend", {"backend": "auto"}).json()["lands"] == "now"   # no live run
    r = ops.post_run(gen=2)
    assert set(report_of(ops, r.json()["id"])["backend_by_token"]) == {best}


def test_threads_switch_live_runs_and_the_runs_to_come(ops, gate):
    gate.close(lambda run, step: run.generated_tokens >= 2)
    r = ops.post_run(gen=12, prompt=[0, 5, 9])
    run_id, step = gate.wait()
    answer = act(ops, "threads", {"kernel_threads": 2, "io_threads": 3})
    assert answer.json() == {"ok": True, "applied": {"kernel_threads": 2, "io_threads": 3, "runs": [run_id]},
                             "lands": "next step"}
    gate.open()
    tokens = report_of(ops, r.json()["id"])["tokens"]
    assert [(t["kernel_threads"], t["io_threads"]) for t in tokens[step:]] == [(2, 3)] * (len(tokens) - step)
    assert all(t["kernel_threads"] == 1 for t in tokens[:step])          # ds4f.toml's, before
    assert ops.get("/status").json()["threads"] == {"kernel_threads": 2, "io_threads": 3}
    nxt = ops.chat(max_tokens=2, temperature=0).json()["id"].removeprefix("chatcmpl-")
    ops.wait_state(nxt)
    live = ops.get(f"/runs/{nxt}").json()["live"]           # (a chat keeps no per-token report here)
    assert [sw[2:] for sw in live["switches"]] == [[2, 3]]
    assert act(ops, "threads", {"io_threads": 2}).json() == {"ok": True, "applied": {"io_threads": 2, "runs": []},
                                                             "lands": "now"}


# -- cancel ---------------------------------------------------------------------------------------
def test_cancel_gives_the_client_the_cancelled_runs_error(ops):
    with ThreadPoolExecutor(1) as pool, httpx.stream("GET", f"{ops.url}/events?interval=0.2", timeout=30) as w:
        events = Events(w)
        stream = pool.submit(chat_stream, ops, BUSY_GEN)
        deadline = time.monotonic() + 30
        while (run := ops.service.current_run) is None or run.snapshot().generated_tokens < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        answer = act(ops, "cancel", {"run_id": run.id})
        assert answer.status == 200, answer.body
        body = answer.json()
        assert body["ok"] is True and body["applied"] == {"run_id": run.id, "state": "cancelled"}
        assert body["lands"] in ("now", "next step")
        with pytest.raises(openai.APIError) as error:          # a streaming client: an error event
            stream.result(timeout=60)
        assert "cancelled" in str(error.value)
        op = events.log(lambda e: e["kind"] == "operator")
        assert op["who"] == "operator@127.0.0.1" and op["run_id"] == run.id and "cancel" in op["message"]
        end = events.log(lambda e: e["kind"] == "cancelled" and e.get("run_id") == run.id)
        assert "by operator@127.0.0.1" in end["message"]

        plain = pool.submit(ops.chat, max_tokens=BUSY_GEN)     # a client that does not stream: a 503 body
        while (run2 := ops.service.current_run) is run or run2.snapshot().generated_tokens < 2:
            assert time.monotonic() < deadline + 30
            time.sleep(0.02)
        assert act(ops, "cancel", {"run_id": run2.id}).status == 200
        r = plain.result(timeout=60)
        assert r.status == 503 and r.error()["code"] == "cancelled" and r.error()["run_id"] == run2.id
    assert act(ops, "cancel", {"run_id": run2.id}).status == 409    # already ended


# -- drain and resume -----------------------------------------------------------------------------
def test_drain_finishes_what_runs_and_waits_and_refuses_new_requests(start, gate):
    srv = start(operator_token=OPERATOR_TOKEN, queue_size=2)
    with ThreadPoolExecutor(2) as pool, httpx.stream("GET", f"{srv.url}/events?interval=0.2", timeout=30) as w:
        events = Events(w)
        gate.close(lambda run, step: run.generated_tokens >= 2)
        running = pool.submit(chat_stream, srv, 8)
        gate.wait()
        waiting = pool.submit(chat_stream, srv, 3)
        deadline = time.monotonic() + 30
        while srv.get("/status").json()["queue"]["waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        answer = act(srv, "drain")
        assert answer.json() == {"ok": True, "applied": {"draining": True, "running": 1, "waiting": 1}, "lands": "now"}
        refused = srv.chat(max_tokens=2)
        assert refused.status == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.error()["code"] == "draining" and "draining" in refused.error()["message"]
        assert srv.post_run(gen=2).status == 503
        health = srv.get("/health")
        assert health.status == 503 and health.json()["status"] == "draining"
        assert srv.get("/status").json()["server"]["draining"] is True
        gate.open()
        assert running.result(timeout=60) and waiting.result(timeout=60)    # both finish
        drained = events.log(lambda e: e["kind"] == "drain")
        assert "drained" in drained["message"]
        assert events.logged(lambda e: e["kind"] == "refused" and "503 draining" in e["message"])
        op = events.logged(lambda e: e["kind"] == "operator")
        assert op[0]["who"] == "operator@127.0.0.1" and op[0]["message"].startswith("drain")
    assert act(srv, "resume").json() == {"ok": True, "applied": {"draining": False, "was_draining": True},
                                         "lands": "now"}
    assert srv.get("/health").status == 200
    assert srv.chat(max_tokens=2).status == 200


# -- preset ---------------------------------------------------------------------------------------
def test_preset_now_when_idle_else_at_the_next_idle_moment(start, gate):
    srv = start(operator_token=OPERATOR_TOKEN, queue_size=2)
    status = srv.get("/status").json()["preset"]
    first, other = status["name"], next(p for p in status["available"] if p != status["name"])
    assert srv.chat(max_tokens=2, temperature=0).status == 200           # an engine loaded with the first
    loads = srv.get("/status").json()["engine"]["loaded_engines"]
    answer = act(srv, "preset", {"preset": other})
    assert answer.json() == {"ok": True, "lands": "now",
                             "applied": {"preset": other, "was": first, "engine": "loads with the next run"}}
    r = srv.chat(max_tokens=2, temperature=0)
    assert r.status == 200 and srv.get(f"/runs/{r.json()['id'].removeprefix('chatcmpl-')}").json()["live"]["preset"] \
        == other
    assert srv.get("/status").json()["engine"]["loaded_engines"] == loads + 1    # the engine loaded anew

    with ThreadPoolExecutor(2) as pool:
        gate.close(lambda run, step: run.generated_tokens >= 1)
        live = pool.submit(chat_stream, srv, 6)
        live_id, _ = gate.wait()
        answer = act(srv, "preset", {"preset": first})
        assert answer.json()["lands"] == "next idle" and answer.json()["applied"]["was"] == other
        status = srv.get("/status").json()
        assert status["preset"] == {**status["preset"], "name": other, "pending": first}
        later = pool.submit(srv.chat, max_tokens=2, temperature=0)       # waits for the change
        assert srv.get(f"/runs/{live_id}").json()["live"]["preset"] == other           # the live run keeps its own
        deadline = time.monotonic() + 30
        while srv.get("/status").json()["queue"]["waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        gate.open()
        assert live.result(timeout=60)
        after = later.result(timeout=60)
    assert after.status == 200, after.body
    assert srv.get(f"/runs/{after.json()['id'].removeprefix('chatcmpl-')}").json()["live"]["preset"] == first
    status = srv.get("/status").json()["preset"]
    assert status["name"] == first and status["pending"] is None
    with httpx.stream("GET", f"{srv.url}/events", timeout=30) as w:
        logged = Events(w)
        landed = logged.log(lambda e: e["kind"] == "preset")
        assert f"preset {first} in effect" in landed["message"]


def test_operator_actions_answer_json_and_are_logged_with_who(ops):
    with httpx.stream("GET", f"{ops.url}/events?interval=5", timeout=30) as w:
        events = Events(w)
        assert act(ops, "drain").status == 200
        assert act(ops, "resume").status == 200
        ops_log = [events.log(lambda e: e["kind"] == "operator") for _ in range(2)]
    assert [e["message"].split(":")[0] for e in ops_log] == ["drain", "resume"]
    assert all(e["who"] == "operator@127.0.0.1" and isinstance(e["time"], float) for e in ops_log)
    assert json.loads(ops.request("POST", "/operator/resume", body={}, headers=operator_headers()).body)["ok"] is True
