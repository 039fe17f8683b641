"""ds4f serve: a real server on an ephemeral loopback port, driven by a real HTTP client.

Runs execute on the tiny converted checkpoint with one kernel thread (ds4f.toml below), so a
few tokens take milliseconds and a run of BUSY_GEN tokens stays busy until it is cancelled.
Every test sends traffic to 127.0.0.1 only.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ds4f.api import MAX_GEN, MAX_PROMPT, Ds4fError, History
from ds4f.server.app import ServerOptions, is_loopback, make_server, read_token_file

BUSY_GEN = 8000
TOKEN = "k3Y-for-the-ds4f-tests_0123456789"
TERMINAL = ("done", "cancelled", "failed")


# -- fixtures and helpers -------------------------------------------------------------------------
@pytest.fixture()
def serve_config(tmp_path) -> Path:
    """ds4f.toml for the tests: one kernel thread (see the report: native pool with >1 thread),
    no NVMe probe, and a history database of this test's own."""
    path = tmp_path / "ds4f.toml"
    path.write_text('[engine]\nkernel_threads = 1\nprobe_floor = false\n\n'
                    f'[history]\npath = "{tmp_path / "history.sqlite3"}"\n')
    return path


class Srv:
    def __init__(self, server):
        self.server = server
        self.service = server.service
        self.port = server.server_address[1]
        self.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        assert self.service.close(timeout=60), "the run did not stop"
        self.server.shutdown()
        self.server.server_close()

    def request(self, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None,
                timeout: float = 30.0):
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

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def post_run(self, **params):
        return self.request("POST", "/runs", body=params, headers=params.pop("_headers", None))

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


class Resp:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        assert self.headers.get("content-type", "").startswith("application/json"), self.headers
        return json.loads(self.body)


@pytest.fixture()
def start(tiny_model, serve_config):
    servers = []

    def _start(**overrides) -> Srv:
        opts = dict(model=str(tiny_model), config_path=str(serve_config), host="127.0.0.1", port=0,
                    access_log=False)
        opts.update(overrides)
        srv = Srv(make_server(ServerOptions(**opts)))
        servers.append(srv)
        return srv

    yield _start
    for srv in servers:
        srv.close()


@pytest.fixture()
def srv(start) -> Srv:
    return start()


def run_dir_files(view: dict) -> list[str]:
    """Files in the run's directory under the data dir (the default dump location)."""
    from ds4f.api import user_data_dir

    d = user_data_dir() / "runs" / view["id"]
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# -- endpoints ------------------------------------------------------------------------------------
def test_status_describes_engine_model_preset_and_backend(srv, tiny_model):
    r = srv.get("/status")
    assert r.status == 200
    s = r.json()
    assert s["engine"] == {"state": "idle", "current_run": None}
    assert s["model"]["path"] == str(tiny_model)
    assert s["model"]["geometry"]["num_hidden_layers"] == 4
    assert s["model"]["geometry"]["vocab_size"] > 0
    assert s["preset"]["name"] == "laptop" and "minimal" in s["preset"]["available"]
    assert "scalar" in s["backend"]["available"] and s["backend"]["best"] in s["backend"]["available"]
    assert s["run"] is None and s["last_report"] is None
    assert s["server"]["busy"] is False and s["server"]["auth"] is False


def test_post_run_reports_sha256_of_the_state_file(srv, serve_config):
    r = srv.post_run(gen=6, prompt=[0, 5, 9], preset="minimal", threads=1, io_threads=2, backend="scalar")
    assert r.status == 202, r.body
    started = r.json()
    run_id = started["id"]
    assert r.headers["location"] == f"/runs/{run_id}"
    assert started["gen"] == 6 and started["steps"] == 8 and started["preset"] == "minimal"

    view = srv.wait_state(run_id)
    assert view["state"] == "done", view
    report = view["report"]
    assert report["summary"]["tokens"] == 8
    assert report["prompt"] == [0, 5, 9]
    assert report["config"]["kernel_threads"] == 1 and report["config"]["io_threads"] == 2
    assert set(report["backend_by_token"]) == {"scalar"}
    assert view["state_sha256"] == report["state_sha256"]
    assert len(view["state_sha256"]) == 64

    dump = srv.get(f"/runs/{run_id}/state")
    assert dump.status == 200
    assert dump.headers["content-type"] == "application/octet-stream"
    assert int(dump.headers["content-length"]) == len(dump.body)
    assert hashlib.sha256(dump.body).hexdigest() == view["state_sha256"]
    assert dump.headers["x-ds4f-state-sha256"] == view["state_sha256"]
    on_disk = Path(report["state_path"]).read_bytes()
    assert hashlib.sha256(on_disk).hexdigest() == view["state_sha256"] == hashlib.sha256(dump.body).hexdigest()

    status = srv.get("/status").json()
    assert status["engine"]["state"] == "idle"
    assert status["run"]["run_id"] == run_id and status["run"]["state"] == "done"
    assert status["last_report"]["run_id"] == run_id
    assert status["last_report"]["state_sha256"] == view["state_sha256"]
    assert status["last_report"]["summary"]["tokens"] == 8


def test_get_run_alias_with_query_parameters(srv):
    r = srv.get("/run?gen=3&preset=minimal&threads=1&backend=scalar&prompt=0,3")
    assert r.status == 202, r.body
    view = srv.wait_state(r.json()["id"])
    assert view["state"] == "done"
    assert view["report"]["prompt"] == [0, 3]
    assert view["report"]["config"]["preset"] == "minimal"
    assert view["report"]["summary"]["tokens"] == 4
    # the bare form: defaults for everything else
    r = srv.get("/run?gen=2")
    assert r.status == 202, r.body
    assert srv.wait_state(r.json()["id"])["state"] == "done"


def test_busy_gets_429_with_retry_after_and_delete_cancels(srv):
    r = srv.post_run(gen=BUSY_GEN)
    assert r.status == 202, r.body
    run_id = r.json()["id"]
    srv.wait_tokens(run_id, 3)

    for again in (srv.post_run(gen=2), srv.get("/run?gen=2")):
        assert again.status == 429, again.body
        assert again.headers["retry-after"].isdigit() and int(again.headers["retry-after"]) >= 1
        body = again.json()
        assert body["run_id"] == run_id and "busy" in body["error"]
    status = srv.get("/status").json()
    assert status["server"]["busy"] is True and status["engine"]["state"] == "running"
    assert status["engine"]["current_run"] == run_id and status["run"]["tokens_done"] >= 3
    assert srv.get(f"/runs/{run_id}/state").status == 409   # no dump until done

    d = srv.request("DELETE", f"/runs/{run_id}")
    assert d.status == 200, d.body
    view = d.json()
    assert view["state"] == "cancelled" and view["report"] is None and view["state_sha256"] is None
    assert view["live"]["tokens_done"] < BUSY_GEN
    assert run_dir_files(view) == []                       # the run API left no partial files
    assert srv.get(f"/runs/{run_id}/state").status == 409
    assert srv.request("DELETE", f"/runs/{run_id}").status == 409   # already ended

    srv.service.current_run.wait(10)
    r = srv.post_run(gen=2)                                 # free again
    assert r.status == 202, r.body
    assert srv.wait_state(r.json()["id"])["state"] == "done"
    assert srv.request("DELETE", f"/runs/{r.json()['id']}").status == 409


def test_a_second_run_reuses_the_loaded_engine(srv):
    first = srv.wait_state(srv.post_run(gen=3, prompt=[0, 5]).json()["id"])
    second = srv.wait_state(srv.post_run(gen=3, prompt=[0, 5]).json()["id"])
    assert first["state"] == second["state"] == "done", (first, second)
    assert any("engine loaded" in e for e in first["live"]["events"]), first["live"]["events"]
    assert any("engine reused" in e for e in second["live"]["events"]), second["live"]["events"]
    assert srv.service.engines.loads == 1
    assert second["state_sha256"] == first["state_sha256"]     # each run on the kept engine starts afresh


def test_an_injected_start_run_is_given_the_engine_host_only_if_it_takes_one(tiny_model, serve_config):
    from ds4f.api import start_run

    seen = []

    def plain(config, history=None):                        # no engines parameter: each run loads its own
        seen.append("plain")
        return start_run(config, history=history)

    def hosted(config, history=None, engines=None):
        seen.append(engines)
        return start_run(config, history=history, engines=engines)

    for fn in (plain, hosted):
        srv = Srv(make_server(ServerOptions(model=str(tiny_model), config_path=str(serve_config), host="127.0.0.1",
                                            port=0, access_log=False), start_run=fn))
        try:
            r = srv.post_run(gen=2)
            assert r.status == 202, r.body
            assert srv.wait_state(r.json()["id"])["state"] == "done"
        finally:
            srv.close()
    assert seen[0] == "plain" and seen[1] is srv.service.engines and srv.service.engines.loads == 1


def test_runs_are_recorded_in_the_history_and_served_after_a_restart(start, serve_config, tmp_path):
    first = start()
    r = first.post_run(gen=4)
    run_id = r.json()["id"]
    view = first.wait_state(run_id)
    assert view["state"] == "done"
    c = first.post_run(gen=BUSY_GEN).json()["id"]
    first.wait_tokens(c, 1)
    assert first.request("DELETE", f"/runs/{c}").status == 200
    first.service.current_run.wait(10)

    history = History(tmp_path / "history.sqlite3")    # the path in serve_config: the console's database
    rec = history.get(run_id)
    assert rec is not None and rec.state == "done" and rec.state_sha256 == view["state_sha256"]
    assert history.get(c).state == "cancelled"
    first.close()

    second = start()                                     # a new server: nothing in memory
    old = second.get(f"/runs/{run_id}")
    assert old.status == 200
    v = old.json()
    assert v["source"] == "history" and v["state"] == "done" and v["state_sha256"] == view["state_sha256"]
    assert v["report"]["summary"]["tokens"] == 4
    dump = second.get(f"/runs/{run_id}/state")
    assert dump.status == 200 and hashlib.sha256(dump.body).hexdigest() == view["state_sha256"]
    assert second.get(f"/runs/{c}").json()["state"] == "cancelled"
    assert second.get(f"/runs/{c}/state").status == 409
    assert second.request("DELETE", f"/runs/{run_id}").status == 409
    listed = second.get("/runs?limit=5").json()["runs"]
    assert [x["id"] for x in listed][:2] == [c, run_id]
    assert second.get("/status").json()["last_report"]["run_id"] == run_id


def test_gen_is_the_tokens_to_generate_and_steps_the_decode_steps_in_every_answer(srv):
    """A 3-token prompt and gen 4: 2 prompt tokens after the first + 4 = 6 decode steps."""
    r = srv.post_run(gen=4, prompt=[0, 5, 9])
    assert r.status == 202, r.body
    assert (r.json()["gen"], r.json()["steps"]) == (4, 6)
    run_id = r.json()["id"]
    view = srv.wait_state(run_id)
    assert view["state"] == "done", view
    assert (view["gen"], view["steps"]) == (4, 6)
    assert (view["live"]["gen"], view["live"]["steps"], view["live"]["tokens_done"]) == (4, 6, 6)
    assert view["config"]["gen"] == 4 and view["report"]["config"]["gen"] == 4
    assert view["report"]["summary"]["tokens"] == 6
    run = srv.get("/status").json()["run"]
    assert (run["run_id"], run["gen"], run["steps"], run["tokens_done"]) == (run_id, 4, 6, 6)
    (listed,) = [x for x in srv.get("/runs").json()["runs"] if x["id"] == run_id]
    assert (listed["source"], listed["gen"], listed["steps"], listed["tokens_done"]) == ("server", 4, 6, 6)
    fams = parse_prometheus(srv.get("/metrics").body.decode())
    value = lambda name: fams[name]["samples"][0][1]   # noqa: E731
    assert (value("ds4f_run_gen_tokens"), value("ds4f_run_steps"), value("ds4f_tokens_done")) == (4, 6, 6)

    # the same run once another has replaced it in memory: served from the history
    other = srv.post_run(gen=2).json()["id"]
    assert srv.wait_state(other)["state"] == "done"
    old = srv.get(f"/runs/{run_id}").json()
    assert old["source"] == "history" and (old["gen"], old["steps"], old["config"]["gen"]) == (4, 6, 4)
    (listed,) = [x for x in srv.get("/runs").json()["runs"] if x["id"] == run_id]
    assert (listed["source"], listed["gen"], listed["steps"], listed["tokens_done"]) == ("history", 4, 6, 6)

    # a live run: gen as requested, steps with the prompt
    busy = srv.post_run(gen=BUSY_GEN, prompt=[0, 5, 9]).json()["id"]
    live = srv.wait_tokens(busy, 2)
    assert (live["gen"], live["steps"], live["live"]["gen"], live["live"]["steps"]) == (BUSY_GEN, BUSY_GEN + 2) * 2
    run = srv.get("/status").json()["run"]
    assert (run["gen"], run["steps"]) == (BUSY_GEN, BUSY_GEN + 2)
    refused = srv.post_run(gen=2)
    assert refused.status == 429 and f"of {BUSY_GEN + 2})" in refused.json()["error"]
    assert srv.request("DELETE", f"/runs/{busy}").status == 200


def test_polling_answers_never_read_the_report_file(srv, monkeypatch):
    run_id = srv.post_run(gen=5, prompt=[0, 5]).json()["id"]
    srv.wait_state(run_id)
    run = srv.service.current_run
    reads = []
    whole = type(run).report
    monkeypatch.setattr(type(run), "report", property(lambda self: reads.append(self.id) or whole.fget(self)))

    for _ in range(3):
        view = srv.get(f"/runs/{run_id}").json()
        assert view["state"] == "done" and view["report"]["summary"]["tokens"] == 6
        assert "tokens" not in view["report"] and view["links"]["report"] == f"/runs/{run_id}/report"
        assert srv.get("/status").json()["last_report"]["run_id"] == run_id
        assert srv.get("/runs").status == 200 and srv.get("/metrics").status == 200
    assert srv.request("DELETE", f"/runs/{run_id}").status == 409
    assert srv.get(f"/runs/{run_id}/state").status == 200
    assert reads == []

    full = srv.get(f"/runs/{run_id}/report")
    assert full.status == 200 and reads == [run_id]
    report = full.json()
    assert len(report["tokens"]) == 6 and report["summary"] == view["report"]["summary"]
    assert report["state_sha256"] == view["state_sha256"]

    # a run served from the history: the whole report from its file too
    assert srv.wait_state(srv.post_run(gen=2).json()["id"])["state"] == "done"
    again = srv.get(f"/runs/{run_id}/report").json()
    assert again["run_id"] == run_id and len(again["tokens"]) == 6
    # no report before a run is done, nor for a cancelled one
    busy = srv.post_run(gen=BUSY_GEN).json()["id"]
    srv.wait_tokens(busy, 1)
    assert srv.get(f"/runs/{busy}/report").status == 409
    assert srv.request("DELETE", f"/runs/{busy}").status == 200
    assert srv.get(f"/runs/{busy}/report").status == 409
    assert srv.get("/runs/20990101-000000-abcd/report").status == 404


def _state_refused(srv, run_id: str, path: Path) -> None:
    r = srv.get(f"/runs/{run_id}/state")
    assert r.status == 409, (r.status, r.headers)
    err = r.json()["error"]
    assert str(path) in err and "replaced" in err, err


def test_a_state_dump_changed_after_its_run_is_not_served(srv, monkeypatch):
    a = srv.wait_state(srv.post_run(gen=3, prompt=[0, 5]).json()["id"])
    b = srv.wait_state(srv.post_run(gen=5, prompt=[0, 9]).json()["id"])   # the current run; a is the history's
    path_a, path_b = Path(a["report"]["state_path"]), Path(b["report"]["state_path"])
    bytes_a, bytes_b = path_a.read_bytes(), path_b.read_bytes()
    assert a["state_sha256"] != b["state_sha256"]
    assert hashlib.sha256(srv.get(f"/runs/{a['id']}/state").body).hexdigest() == a["state_sha256"]

    # another run's dump copied over it (in place), or renamed over it
    shutil.copyfile(path_b, path_a)
    _state_refused(srv, a["id"], path_a)
    path_a.write_bytes(bytes_a)
    assert hashlib.sha256(srv.get(f"/runs/{a['id']}/state").body).hexdigest() == a["state_sha256"]
    shutil.copyfile(path_b, path_a.with_name("other.bin"))
    os.replace(path_a.with_name("other.bin"), path_a)
    _state_refused(srv, a["id"], path_a)
    # the same size, one byte different
    path_a.write_bytes(bytes_a[:-1] + bytes([bytes_a[-1] ^ 1]))
    _state_refused(srv, a["id"], path_a)
    # the current run's own dump
    path_b.write_bytes(bytes_a)
    _state_refused(srv, b["id"], path_b)
    path_b.write_bytes(bytes_b)
    dump = srv.get(f"/runs/{b['id']}/state")
    assert dump.status == 200 and hashlib.sha256(dump.body).hexdigest() == b["state_sha256"]

    # changed after it was checked and before it was sent: the body stops short of its length
    path_a.write_bytes(bytes_a)
    checked = srv.service.open_state

    def open_then_change(run_id):
        answer = checked(run_id)
        path_a.write_bytes(bytes_a[:-1] + bytes([bytes_a[-1] ^ 1]))   # in place: the open file sees it
        return answer

    monkeypatch.setattr(srv.service, "open_state", open_then_change)
    with pytest.raises(http.client.IncompleteRead):
        srv.get(f"/runs/{a['id']}/state")
    monkeypatch.undo()
    assert srv.get("/status").status == 200


@pytest.mark.parametrize("how", ["directory-removed", "read-only"])
def test_a_run_whose_history_record_fails_still_ends(tiny_model, tmp_path, capsys, how):
    from ds4f.api import start_run as api_start_run

    hist_dir = tmp_path / "hist"
    hist = hist_dir / "history.sqlite3"
    config = tmp_path / "ds4f.toml"
    config.write_text('[engine]\nkernel_threads = 1\nprobe_floor = false\n\n'f'[history]\npath = "{hist}"\n')
    broken = threading.Event()

    def break_history() -> None:
        if broken.is_set():
            return
        if how == "directory-removed":
            shutil.rmtree(hist_dir)
        else:
            hist.chmod(0o444)
        broken.set()

    def start_run(config, history=None, engines=None):   # the history breaks while the run decodes
        return api_start_run(config, history=history, engines=engines,
                             on_token=lambda rec: break_history() if rec.index == 1 else None)

    srv = Srv(make_server(ServerOptions(model=str(tiny_model), config_path=str(config), host="127.0.0.1", port=0,
                                        access_log=False), start_run=start_run))
    try:
        if how == "read-only":
            hist.chmod(0o444)
            writable = os.access(hist, os.W_OK)
            hist.chmod(0o644)
            if writable:
                pytest.skip("a read-only file stays writable for this user (root)")
        run_id = srv.post_run(gen=6).json()["id"]
        view = srv.wait_state(run_id)
        assert broken.is_set()
        assert view["state"] == "done" and view["error"] is None, view
        assert view["history_error"], view
        assert any("could not record the run in the history" in e for e in view["live"]["events"])
        assert f"run {run_id} ended done but is not in the run history" in capsys.readouterr().err

        status = srv.get("/status").json()
        assert status["engine"] == {"state": "idle", "current_run": run_id}
        assert status["server"]["busy"] is False and status["run"]["state"] == "done"
        assert status["server"]["history_error"] == view["history_error"]
        listed = srv.get("/runs").json()
        assert [(x["id"], x["state"]) for x in listed["runs"] if x["id"] == run_id] == [(run_id, "done")]
        assert (listed["history_error"] is not None) == (how == "directory-removed")
        info = parse_prometheus(srv.get("/metrics").body.decode())["ds4f_run_info"]["samples"][0][0]
        assert info["state"] == "done"
        assert srv.request("DELETE", f"/runs/{run_id}").status == 409
        assert srv.get(f"/runs/{run_id}/state").status == 200
        if how == "directory-removed":
            r = srv.get("/runs/20990101-000000-abcd")
            assert r.status == 503 and "history" in r.json()["error"]
        nxt = srv.post_run(gen=2)                             # and the server takes the next run
        assert nxt.status == 202, nxt.body
        assert srv.wait_state(nxt.json()["id"])["state"] == "done"
    finally:
        srv.close()
        if hist.exists():
            hist.chmod(0o644)


# -- /metrics -------------------------------------------------------------------------------------
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\\\|\\"|\\n)*)"')
_SAMPLE_RE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})? (\S+)(?: (-?[0-9]+))?$")
_FLOAT_RE = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$|^(?:NaN|[+-]Inf)$")


def parse_prometheus(text: str) -> dict:
    """A strict parser of the text exposition format 0.0.4 (what the tests rely on of it)."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    families: dict[str, dict] = {}
    current = None
    seen_series = set()
    for n, line in enumerate(text[:-1].split("\n"), 1):
        assert line, f"line {n}: empty line"
        if line.startswith("#"):
            m = re.match(rf"^# (HELP|TYPE) ({_NAME}) (.*)$", line)
            assert m, f"line {n}: bad comment line {line!r}"
            kind, name, rest = m.groups()
            fam = families.setdefault(name, {"help": None, "type": None, "samples": []})
            if kind == "HELP":
                assert fam["help"] is None, f"line {n}: second HELP for {name}"
                assert not fam["samples"], f"line {n}: HELP after samples of {name}"
                fam["help"] = rest
            else:
                assert fam["type"] is None, f"line {n}: second TYPE for {name}"
                assert not fam["samples"], f"line {n}: TYPE after samples of {name}"
                assert rest in ("counter", "gauge", "summary", "histogram", "untyped"), f"line {n}: type {rest!r}"
                fam["type"] = rest
            current = name
            continue
        m = _SAMPLE_RE.match(line)
        assert m, f"line {n}: bad sample line {line!r}"
        name, label_text, value, _ts = m.groups()
        assert name == current, f"line {n}: sample {name} outside its family ({current})"
        labels = {}
        if label_text:
            pos = 0
            while pos < len(label_text):
                lm = _LABEL_RE.match(label_text, pos)
                assert lm, f"line {n}: bad labels {label_text!r}"
                assert lm.group(1) not in labels, f"line {n}: label {lm.group(1)} twice"
                labels[lm.group(1)] = lm.group(2)
                pos = lm.end()
                if pos < len(label_text):
                    assert label_text[pos] == ",", f"line {n}: bad labels {label_text!r}"
                    pos += 1
        assert _FLOAT_RE.match(value), f"line {n}: bad value {value!r}"
        key = (name, tuple(sorted(labels.items())))
        assert key not in seen_series, f"line {n}: series {key} twice"
        seen_series.add(key)
        families[name]["samples"].append((labels, float(value)))
    for name, fam in families.items():
        assert fam["type"], f"{name}: no TYPE"
        assert fam["help"], f"{name}: no HELP"
        assert name.startswith("ds4f_"), name
        if fam["type"] == "counter":
            assert name.endswith("_total"), name
            assert all(v >= 0 for _, v in fam["samples"]), name
    return families


def test_metrics_parse_as_prometheus_text(srv):
    r = srv.get("/metrics")
    assert r.status == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    fams = parse_prometheus(r.body.decode())
    assert fams["ds4f_up"]["samples"] == [({}, 1.0)]
    assert "ds4f_run_info" not in fams                       # no run yet: no figures invented

    run_id = srv.post_run(gen=5).json()["id"]
    view = srv.wait_state(run_id)
    text = srv.get("/metrics").body.decode()
    fams = parse_prometheus(text)
    info = fams["ds4f_run_info"]["samples"]
    assert len(info) == 1 and info[0][1] == 1.0
    assert info[0][0]["run_id"] == run_id and info[0][0]["state"] == "done"
    assert info[0][0]["backend"] == view["live"]["backend"] and info[0][0]["preset"] == "laptop"
    value = lambda name: fams[name]["samples"][0][1]   # noqa: E731
    assert value("ds4f_tokens_done") == 5
    assert value("ds4f_seconds_per_token") == pytest.approx(view["live"]["s_per_token"])
    assert value("ds4f_read_gigabytes_per_second") == pytest.approx(view["live"]["eff_read_gbps"])
    assert value("ds4f_cache_hit_ratio") == pytest.approx(view["live"]["hit_rate"])
    assert value("ds4f_cache_policy_hit_ratio") == pytest.approx(view["live"]["policy_hit_rate"])
    assert value("ds4f_cache_policy_hit_ratio") <= value("ds4f_cache_hit_ratio")
    pf = {lab["layer"]: v for lab, v in fams["ds4f_cache_layer_prefetch_hits_total"]["samples"]}
    assert pf == {str(i): float(h) for i, h in enumerate(view["live"]["layer_prefetch_hits"])}
    assert value("ds4f_rss_bytes") > 0
    hits = {lab["layer"]: v for lab, v in fams["ds4f_cache_layer_hits_total"]["samples"]}
    assert hits == {str(i): float(h) for i, h in enumerate(view["live"]["layer_hits"])}
    assert "3" in hits
    assert fams["ds4f_cache_layer_hits_total"]["type"] == "counter"
    assert fams["ds4f_seconds_per_token"]["type"] == "gauge"
    assert value("ds4f_runs_started_total") == 1
    codes = {lab["code"] for lab, _ in fams["ds4f_http_responses_total"]["samples"]}
    assert {"200", "202"} <= codes

    try:   # the reference parser too, when it is installed
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "ds4f_seconds_per_token" in names


def test_metrics_follow_a_live_run(srv):
    run_id = srv.post_run(gen=BUSY_GEN).json()["id"]
    srv.wait_tokens(run_id, 5)
    fams = parse_prometheus(srv.get("/metrics").body.decode())
    assert fams["ds4f_busy"]["samples"][0][1] == 1
    assert fams["ds4f_run_active"]["samples"][0][1] == 1
    assert fams["ds4f_tokens_done"]["samples"][0][1] >= 5
    assert fams["ds4f_eta_seconds"]["samples"][0][1] > 0
    assert srv.request("DELETE", f"/runs/{run_id}").status == 200


def test_web_pages_cannot_drive_a_loopback_server(srv):
    # a form or fetch from a page: not JSON, so a browser could send it without a CORS preflight
    for ctype in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = srv.request("POST", "/runs", raw=b'{"gen": 2}', headers=headers)
        assert r.status == 415 and r.json()["parameter"] == "Content-Type", (ctype, r.body)
    assert srv.request("POST", "/runs", raw=b'{"gen": 2}',
                       headers={"Content-Type": "application/json; charset=utf-8"}).status == 202
    srv.service.current_run.wait(30)
    # DNS rebinding: a foreign name that resolves to 127.0.0.1
    for host in ("evil.example", "evil.example:8734", "127.0.0.1.evil.example", "[::2]:80"):
        r = srv.get("/status", headers={"Host": host})
        assert r.status == 403 and "loopback" in r.json()["error"], host
        assert srv.get("/run?gen=2", headers={"Host": host}).status == 403
    for host in ("localhost", "localhost:8734", "127.0.0.1", f"127.0.0.1:{srv.port}", "[::1]:8734", "[::1]"):
        assert srv.get("/status", headers={"Host": host}).status == 200, host
    # <img src="http://127.0.0.1:8734/run?gen=100000"> on some page
    for site in ("cross-site", "same-site"):
        r = srv.get("/run?gen=2", headers={"Sec-Fetch-Site": site})
        assert r.status == 403, site
    assert srv.get("/status", headers={"Sec-Fetch-Site": "none"}).status == 200
    assert srv.service.runs_started == 1


def test_a_foreign_origin_or_referer_cannot_start_or_cancel_runs(srv):
    port = srv.port
    other = port - 1 if port > 1024 else port + 1
    foreign = [("Origin", "http://evil.example"), ("Origin", f"http://evil.example:{port}"),
               ("Origin", f"http://127.0.0.1:{other}"), ("Origin", f"http://localhost:{other}"),
               ("Origin", f"http://127.0.0.2:{port}"), ("Origin", f"http://[::1]:{port}"), ("Origin", "null"),
               ("Origin", "garbage"), ("Referer", "http://evil.example/page.html"),
               ("Referer", f"http://127.0.0.1:{other}/"), ("Referer", f"http://127.0.0.1:{port}@evil.example/"),
               ("Referer", "/relative")]

    def refused(r, header):
        assert r.status == 403, (header, r.status, r.body)
        err = r.json()
        assert err["parameter"] == header and err["error"].startswith(f"{header}: "), err

    for header, value in foreign:
        refused(srv.post_run(gen=2, _headers={header: value}), header)
        refused(srv.get("/run?gen=2", headers={header: value}), header)
        # a foreign Origin beside a Referer of our own (and the other way round) is still refused
        own = f"http://127.0.0.1:{port}" + ("/" if header == "Origin" else "")
        refused(srv.post_run(gen=2, _headers={header: value, ("Referer" if header == "Origin" else "Origin"): own}),
                header)
    assert srv.service.runs_started == 0

    run_id = srv.post_run(gen=BUSY_GEN).json()["id"]          # neither header: curl, scripts
    srv.wait_tokens(run_id, 2)
    for header, value in foreign[:3] + foreign[-4:]:
        for method in ("DELETE", "PATCH", "PUT", "POST"):
            refused(srv.request(method, f"/runs/{run_id}", headers={header: value}), header)
    # reading is not acting: a page may not read the answers (no CORS headers), and nothing changes
    assert srv.get("/status", headers={"Origin": "http://evil.example"}).status == 200
    assert srv.get(f"/runs/{run_id}", headers={"Referer": "http://evil.example/"}).json()["state"] == "running"

    # this server's own address, or the Host the request was addressed to
    d = srv.request("DELETE", f"/runs/{run_id}", headers={"Origin": f"http://127.0.0.1:{port}"})
    assert d.status == 200 and d.json()["state"] == "cancelled", d.body
    srv.service.current_run.wait(10)
    own = [{"Origin": f"http://localhost:{port}"}, {"Referer": f"http://127.0.0.1:{port}/status"},
           {"Origin": f"http://127.0.0.1:{port}", "Referer": f"http://localhost:{port}/x?y=1"},
           {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
           {"Host": "[::1]", "Origin": "http://[::1]"}]
    for headers in own:
        r = srv.get("/run?gen=2", headers=headers)
        assert r.status == 202, (headers, r.body)
        assert srv.wait_state(r.json()["id"])["state"] == "done"
    r = srv.post_run(gen=2, _headers={"Origin": f"http://127.0.0.1:{port}"})
    assert r.status == 202, r.body
    assert srv.wait_state(r.json()["id"])["state"] == "done"
    assert srv.service.runs_started == 2 + len(own)


# -- the token ------------------------------------------------------------------------------------
def test_token_is_required_on_every_endpoint_when_configured(start):
    srv = start(token=TOKEN)
    good = {"Authorization": f"Bearer {TOKEN}"}
    bad_headers = [{}, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Basic {TOKEN}"},
                   {"Authorization": "Bearer"}, {"Authorization": "Bearer " + TOKEN[:-1]},
                   {"Authorization": "Bearer \u00e9\u00e9"}]
    endpoints = [("GET", "/status"), ("GET", "/metrics"), ("GET", "/runs"), ("POST", "/runs"),
                 ("GET", "/run?gen=1"), ("GET", "/runs/x"), ("DELETE", "/runs/x"), ("GET", "/runs/x/state"),
                 ("GET", "/nope")]
    for method, path in endpoints:
        for headers in bad_headers:
            r = srv.request(method, path, headers=headers, raw=b"{}" if method == "POST" else None)
            assert r.status == 401, (method, path, headers, r.body)
            assert r.headers["www-authenticate"].startswith("Bearer")
    assert srv.service.runs_started == 0                     # nothing ran without the token
    assert srv.get("/status", headers=good).status == 200
    assert srv.get("/metrics", headers=good).status == 200
    r = srv.request("POST", "/runs", body={"gen": 2}, headers=good)
    assert r.status == 202, r.body
    run_id = r.json()["id"]
    assert srv.wait_state(run_id, headers=good)["state"] == "done"
    assert srv.get(f"/runs/{run_id}/state", headers=good).status == 200
    assert srv.get(f"/runs/{run_id}/state").status == 401


def test_binding_beyond_loopback_without_a_token_is_refused(tiny_model, serve_config):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert is_loopback("127.8.9.10") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("")
    assert not is_loopback("192.168.1.5") and not is_loopback("example.org")
    for host in ("0.0.0.0", "::", "192.0.2.1", "example.org"):
        with pytest.raises(Ds4fError, match="token"):   # refused before binding: no socket, no traffic
            make_server(ServerOptions(model=str(tiny_model), config_path=str(serve_config), host=host, port=0))


def test_token_file_is_checked(tmp_path):
    good = tmp_path / "token"
    good.write_text(TOKEN + "\n")
    assert read_token_file(good) == TOKEN
    cases = {"": "empty", "   \n": "empty", "short": "at least", "two words here and more": "only",
             "line1-aaaaaaaaaaaa\nline2-bbbbbbbbbb": "only"}
    for text, match in cases.items():
        good.write_text(text)
        with pytest.raises(Ds4fError, match=match):
            read_token_file(good)
    with pytest.raises(Ds4fError, match="cannot read"):
        read_token_file(tmp_path / "missing")
    with pytest.raises(Ds4fError, match="cannot read"):
        read_token_file(tmp_path)


def _cli(*args: str, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4f.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cli_refuses_unsafe_setups(tiny_model, serve_config, tmp_path):
    base = ["--model", str(tiny_model), "--config", str(serve_config), "--port", "0"]
    r = _cli(*base, "--host", "0.0.0.0")
    assert r.returncode == 2 and "requires a bearer token" in r.stderr and "--token-file" in r.stderr
    r = _cli(*base, "--token", TOKEN)
    assert r.returncode == 2 and "never from the command line" in r.stderr and TOKEN not in r.stderr
    empty = tmp_path / "empty-token"
    empty.write_text("")
    r = _cli(*base, "--host", "0.0.0.0", "--token-file", str(empty))
    assert r.returncode == 2 and "empty" in r.stderr
    r = _cli(*base, "--token-file", str(tmp_path / "nope"))
    assert r.returncode == 2 and "cannot read" in r.stderr
    r = _cli("--model", str(tmp_path / "no-model"), "--config", str(serve_config), "--port", "0")
    assert r.returncode == 2 and "error" in r.stderr and "Traceback" not in r.stderr
    r = _cli(*base, "--preset", "nope")
    assert r.returncode == 2 and "nope" in r.stderr


# -- bad input ------------------------------------------------------------------------------------
BAD_BODIES = [
    ({"gen": 0}, "gen"), ({"gen": -3}, "gen"), ({"gen": MAX_GEN + 1}, "gen"), ({"gen": "8"}, "gen"),
    ({"gen": 2.5}, "gen"), ({"gen": True}, "gen"), ({"gen": None}, "gen"),
    ({"preset": "nope"}, "preset"), ({"preset": 3}, "preset"),
    ({"threads": 0}, "threads"), ({"threads": 257}, "threads"), ({"threads": "2"}, "threads"),
    ({"threads": 1, "kernel_threads": 1}, "threads"), ({"kernel_threads": -1}, "kernel_threads"),
    ({"io_threads": 0}, "io_threads"), ({"io_threads": 1000}, "io_threads"), ({"io_threads": [4]}, "io_threads"),
    ({"backend": "gpu"}, "backend"), ({"backend": 1}, "backend"), ({"backend": None}, "backend"),
    ({"prompt": "0,5"}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": [0, 10**9]}, "prompt"), ({"prompt": [0, "5"]}, "prompt"), ({"prompt": [0, 1.0]}, "prompt"),
    ({"prompt": [True]}, "prompt"), ({"prompt": [0] * (MAX_PROMPT + 1)}, "prompt"),
    ({"gen": 2, "temperature": 0.7}, "temperature"), ({"dump_path": "/etc/passwd"}, "dump_path"),
    ({"model": "/tmp/other"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_BODIES)])
def test_bad_run_parameters_get_400_naming_them(srv, body, param):
    r = srv.post_run(**body)
    assert r.status == 400, r.body
    err = r.json()
    assert err["parameter"] == param and err["error"].startswith(param + ":"), err
    assert srv.service.runs_started == 0


def test_unavailable_backend_is_a_400_from_the_run_api(srv):
    from ds4f.api import available_backends

    missing = [b for b in ("avx2", "avx512", "neon") if b not in available_backends()]
    if not missing:
        pytest.skip("every backend is available here")
    r = srv.post_run(gen=2, backend=missing[0])
    assert r.status == 400 and r.json()["parameter"] == "backend", r.body


BAD_QUERIES = [("gen=abc", "gen"), ("gen=", "gen"), ("gen=-1", "gen"), ("gen=+5", "gen"), ("gen=1e3", "gen"),
               ("gen=0", "gen"), ("gen=2&gen=3", "gen"), ("prompt=a,b", "prompt"), ("prompt=1,,2", "prompt"),
               ("prompt=", "prompt"), ("threads=x", "threads"), ("backend=cuda", "backend"),
               ("preset=", "preset"), ("bogus=1", "bogus"), ("gen", "query"), ("a=1&&b", "query")]


@pytest.mark.parametrize("query,param", BAD_QUERIES, ids=[q for q, _ in BAD_QUERIES])
def test_bad_query_parameters_get_400_naming_them(srv, query, param):
    r = srv.get(f"/run?{query}")
    assert r.status == 400, (query, r.body)
    assert r.json()["parameter"] == param


@pytest.mark.parametrize("raw,param", [
    (b'{"gen": 2', "body"), (b"[1, 2]", "body"), (b'"gen"', "body"), (b"\xff\xfe{}", "body"),
    (b"gen=2", "body"), (b'{"gen": NaN}', "gen"), (b'{"gen": 2} trailing', "body"),
])
def test_malformed_json_gets_400(srv, raw, param):
    r = srv.request("POST", "/runs", raw=raw, headers={"Content-Type": "application/json"})
    assert r.status == 400, r.body
    assert r.json()["parameter"] == param


def test_paths_methods_and_sizes(srv):
    for path in ("/", "/statuses", "/runs/", "/runs/x/y", "/runs/x/state/more", "/run/", "/metrics/x",
                 "/runs/..%2F..%2Fetc", "/runs/" + "a" * 100, "/%00"):
        r = srv.get(path)
        assert r.status == 404, (path, r.status, r.body)
        assert "error" in r.json()
    for path in ("/runs/20990101-000000-abcd", "/runs/20990101-000000-abcd/state"):
        assert srv.get(path).status == 404
    assert srv.request("DELETE", "/runs/20990101-000000-abcd").status == 404

    for method, path, allowed in (("POST", "/status", "GET"), ("DELETE", "/status", "GET"),
                                  ("PUT", "/runs", "GET, POST"), ("POST", "/run", "GET"),
                                  ("PATCH", "/runs/x", "GET, DELETE"), ("DELETE", "/runs/x/state", "GET"),
                                  ("POST", "/metrics", "GET"), ("OPTIONS", "/status", "GET")):
        r = srv.request(method, path)
        assert r.status == 405, (method, path, r.body)
        assert r.headers["allow"] == allowed
    assert srv.request("HEAD", "/status").status == 501
    assert srv.request("BREW", "/status").status == 501

    big = b'{"gen": 2, "prompt": [' + b"0, " * 30_000 + b"0]}"
    r = srv.request("POST", "/runs", raw=big, headers={"Content-Type": "application/json"})
    assert r.status == 413 and r.headers.get("connection") == "close"
    assert srv.get("/runs?limit=0").status == 400
    assert srv.get("/runs?limit=3").status == 200
    assert srv.get("/runs?color=red").json()["parameter"] == "color"
    r = srv.request("POST", "/runs?gen=2", raw=b"{}", headers={"Content-Type": "application/json"})
    assert r.status == 400 and r.json()["parameter"] == "query"
    assert srv.service.runs_started == 0


def _raw(port: int, data: bytes, timeout: float = 10.0, shut: bool = False) -> bytes:
    """Send raw bytes, read until the server closes (or timeout); the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except socket.timeout:
            pass
        return b"".join(chunks)


def _status_of(answer: bytes) -> int:
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", answer)
    assert m, answer[:200]
    return int(m.group(1))


def _protocol_abuse(port: int) -> list[int]:
    """Malformed and oversized requests at the HTTP level; the status of each answer."""
    out = []
    out.append(_status_of(_raw(port, b"GARBAGE\r\n\r\n")))
    out.append(_status_of(_raw(port, b"GET /status\r\n\r\n")))   # HTTP/0.9
    out.append(_status_of(_raw(port, b"GET /status HTTP/9.9\r\n\r\n")))
    out.append(_status_of(_raw(port, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n")))
    out.append(_status_of(_raw(port, b"GET /status HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n")))
    out.append(_status_of(_raw(port, b"GET /status HTTP/1.1\r\n" + b"X-H: 1\r\n" * 150 + b"\r\n")))
    out.append(_status_of(_raw(port, b"POST /runs HTTP/1.1\r\nContent-Length: nine\r\n\r\n{}")))
    out.append(_status_of(_raw(port, b"POST /runs HTTP/1.1\r\nContent-Length: -5\r\n\r\n{}")))
    out.append(_status_of(_raw(port, b"POST /runs HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")))
    out.append(_status_of(_raw(port, b"POST /runs HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n{}")))
    out.append(_status_of(_raw(port, b"POST /runs HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"gen\"", shut=True)))
    out.append(_status_of(_raw(port, b"\x00\x01\x02\xff" * 100, shut=True)))   # binary junk
    assert _raw(port, b"", shut=True) == b""                # connect and leave: nothing to answer
    return out


def test_protocol_level_abuse_is_refused(srv):
    codes = _protocol_abuse(srv.port)
    assert codes == [400, 400, 505, 414, 431, 431, 400, 400, 411, 413, 400, 400], codes
    assert srv.get("/status").status == 200


def test_a_slow_client_cannot_pin_a_thread(start):
    srv = start(request_timeout_s=0.5, max_connections=2)
    t0 = time.monotonic()
    # a request line that never ends: the server hangs up after its socket timeout
    assert _raw(srv.port, b"GET /sta", timeout=10) == b""
    # a body that never arrives: 408 and the connection closed
    answer = _raw(srv.port, b"POST /runs HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"ge", timeout=10)
    assert _status_of(answer) == 408
    assert time.monotonic() - t0 < 8
    assert srv.get("/status").status == 200
    assert srv.service.runs_started == 0


def test_connections_beyond_the_cap_get_503(start):
    srv = start(max_connections=2, request_timeout_s=5)
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
    try:
        time.sleep(0.3)                        # both accepted, both holding a handler thread
        r = srv.get("/status")
        assert r.status == 503 and r.headers["retry-after"] == "1"
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while srv.get("/status").status != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_bad_requests_do_not_harm_a_run_in_progress(start):
    srv = start(request_timeout_s=0.5)
    run_id = srv.post_run(gen=BUSY_GEN).json()["id"]
    before = srv.wait_tokens(run_id, 3)["live"]["tokens_done"]
    for body, _param in BAD_BODIES[:12]:
        assert srv.post_run(**body).status in (400, 429)
    for query, _param in BAD_QUERIES:
        assert srv.get(f"/run?{query}").status in (400, 429)
    _protocol_abuse(srv.port)
    _raw(srv.port, b"GET /sta", timeout=5)                 # slow client
    big = b'{"prompt": [' + b"1," * 40_000 + b"1]}"
    assert srv.request("POST", "/runs", raw=big).status == 413
    assert srv.request("DELETE", "/runs/../status").status == 404
    view = srv.get(f"/runs/{run_id}").json()
    assert view["state"] == "running" and view["error"] is None
    srv.wait_tokens(run_id, before + 5)                    # still decoding
    assert srv.service.runs_started == 1
    assert srv.request("DELETE", f"/runs/{run_id}").status == 200


def _threads_besides_the_engine() -> int:
    """Live threads, leaving out the I/O threads of the engine the server keeps loaded between runs."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith("ds4f-io-"))


def test_a_burst_of_concurrent_requests_leaves_the_server_healthy(srv):
    baseline = _threads_besides_the_engine()

    def call(i: int) -> tuple[str, int]:
        if i % 7 == 3:
            return "post", srv.post_run(gen=BUSY_GEN).status
        if i % 7 == 5:
            return "metrics", srv.get("/metrics").status
        if i % 7 == 6:
            return "bad", srv.post_run(gen=0).status
        return "status", srv.get("/status").status

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(call, range(80)))
    by_kind: dict[str, list[int]] = {}
    for kind, status in results:
        by_kind.setdefault(kind, []).append(status)
    assert set(by_kind["status"]) == {200} and set(by_kind["metrics"]) == {200}
    assert set(by_kind["bad"]) == {400}
    assert sorted(set(by_kind["post"])) in ([202, 429], [202]) and by_kind["post"].count(202) == 1
    assert srv.service.runs_started == 1

    status = srv.get("/status").json()
    assert status["server"]["busy"] is True
    run_id = status["engine"]["current_run"]
    srv.wait_tokens(run_id, 2)
    assert srv.request("DELETE", f"/runs/{run_id}").status == 200
    fams = parse_prometheus(srv.get("/metrics").body.decode())
    rejections = fams["ds4f_busy_rejections_total"]["samples"][0][1]
    assert rejections == by_kind["post"].count(429)
    r = srv.post_run(gen=2)                                # healthy: takes a new run
    assert r.status == 202
    assert srv.wait_state(r.json()["id"])["state"] == "done"
    deadline = time.monotonic() + 10
    while _threads_besides_the_engine() > baseline + 1:    # the handler threads went away
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.05)


def test_no_new_runs_once_shutting_down(srv):
    assert srv.service.close(timeout=5)
    r = srv.post_run(gen=2)
    assert r.status == 503 and r.headers["retry-after"]
    assert srv.get("/status").json()["server"]["closing"] is True
    assert srv.service.runs_started == 0


# -- signals --------------------------------------------------------------------------------------
def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            ch = os.read(proc.stdout.fileno(), 1)
            if not ch:
                break
            buf += ch
            if ch == b"\n":
                return buf.decode()
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no line from the server: {buf!r} {proc.stderr.read().decode() if proc.poll() is not None else ''}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_cancels_the_run_and_leaves_no_partial_files(tiny_model, serve_config, tmp_path, sig):
    data_home = tmp_path / "xdg-data"
    env = dict(os.environ, XDG_DATA_HOME=str(data_home))
    proc = subprocess.Popen([sys.executable, "-m", "ds4f.cli", "serve", "--model", str(tiny_model),
                             "--config", str(serve_config), "--port", "0", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        line = _read_line(proc, 60)
        m = re.match(r"^ds4f serve: listening on http://127\.0\.0\.1:(\d+)\n$", line)
        assert m, line
        port = int(m.group(1))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/runs", body=json.dumps({"gen": BUSY_GEN}), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 202
        run_id = json.loads(resp.read())["id"]
        deadline = time.monotonic() + 60
        while True:
            conn.request("GET", f"/runs/{run_id}")
            view = json.loads(conn.getresponse().read())
            if view["state"] == "running" and view["live"]["tokens_done"] >= 3:
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.05)
        conn.close()
        run_dir = data_home / "ds4f" / "runs" / run_id
        assert (run_dir / "state.bin.partial").exists()   # the dump is being written...
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read().decode()
        assert f"cancelling run {run_id}" in err and "stopped" in err
        assert list(run_dir.iterdir()) == []              # ...and is gone: no partial files, no state
        rec = History(tmp_path / "history.sqlite3").get(run_id)
        assert rec is not None and rec.state == "cancelled"
        with pytest.raises(OSError):                      # no longer listening
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
