"""Runs that step together on one engine (`ds4f serve --parallel 2`) and what one client does to its
own run: a kernel switch (PATCH /runs/{id}), its own backend at the start, a cancel. Each run's
state dump is compared with the same run alone on the same server: a run that nobody touched
has the dump it has alone, and the run that was switched has the dump it has alone with the same
switch at the same step. The operator's switch is the engine's (every run's), and each run's
dump still says which kernels computed each of its tokens: replayed alone with the switch at the
step its record names, it is the same. A gate holds a run at a step boundary (events_helpers);
no clock."""
from __future__ import annotations

import pytest

from ds4f.api import best_backend

from events_helpers import OPERATOR_TOKEN, gate, operator_headers  # noqa: F401 (fixtures)
from server_helpers import serve_config, start  # noqa: F401 (fixtures)

LONG = [0, 5, 9]      # the run nobody touches: long enough to step beside the other one all along
SHORT = [0, 7, 3]
LONG_GEN, SHORT_GEN = 160, 24


def simd_backend() -> str:
    best = best_backend()
    if best == "scalar":
        pytest.skip("this CPU has no SIMD backend: nothing to switch from scalar to")
    return best


def done(srv, run_id: str) -> dict:
    view = srv.wait_state(run_id, timeout=120)
    assert view["state"] == "done", view
    report = srv.get(f"/runs/{run_id}/report").json()
    return {"sha": view["state_sha256"], "backends": report["backend_by_token"], "view": view,
            "settings": {(t["backend"], t["kernel_threads"], t["io_threads"]) for t in report["tokens"]}}


def post(srv, prompt, gen, **kw) -> str:
    r = srv.post_run(gen=gen, prompt=prompt, **kw)
    assert r.status == 202, r.body
    return r.json()["id"]


def held(prompt, after: int):
    """The gate's test: the run of `prompt`, once it has generated `after` tokens."""
    return lambda run, step: tuple(run.prompt) == tuple(prompt) and run.generated_tokens >= after


def alone_switched(srv, gate, prompt, gen, after: int, backend: str) -> dict:
    """The run alone, switched to `backend` by PATCH at the step where it has generated `after` tokens."""
    gate.close(held(prompt, after))
    run_id = post(srv, prompt, gen)
    gate.wait()
    assert srv.request("PATCH", f"/runs/{run_id}", body={"backend": backend}).status == 202
    gate.open()
    out = done(srv, run_id)
    srv.wait_idle()
    return out


@pytest.fixture()
def duo(start):
    return start(parallel=2, reuse_prefix=False, dump="compact", operator_token=OPERATOR_TOKEN)


def test_a_switch_of_one_batched_run_is_that_runs_alone(duo, gate):
    best = simd_backend()
    long_alone = done(duo, post(duo, LONG, LONG_GEN))
    short_alone = alone_switched(duo, gate, SHORT, SHORT_GEN, 3, "scalar")
    assert set(long_alone["backends"]) == {best} and "scalar" in short_alone["backends"]

    gate.close(held(SHORT, 3))
    a = post(duo, LONG, LONG_GEN)
    b = post(duo, SHORT, SHORT_GEN)
    gate.wait()
    assert duo.get(f"/runs/{a}").json()["state"] == "running"     # the other run steps meanwhile
    switched = duo.request("PATCH", f"/runs/{b}", body={"backend": "scalar"})
    assert switched.status == 202, switched.body
    io = duo.request("PATCH", f"/runs/{b}", body={"io_threads": 3})   # the engine's reader: every run's
    assert io.status == 409, io.body
    err = io.error()
    assert err["code"] == "engine_shared" and err["param"] == "io_threads" and a in err["message"]
    assert err["sharing_with"] == [a]
    gate.open()
    long_run, short_run = done(duo, a), done(duo, b)
    assert short_run["view"]["report"]["summary"]["batch"]["shared_steps"] > 0      # they did step together
    assert long_run["view"]["report"]["summary"]["batch"]["shared_steps"] > 0
    assert set(long_run["backends"]) == {best}                          # never switched
    assert long_run["sha"] == long_alone["sha"]
    assert short_run["backends"] == short_alone["backends"]
    assert short_run["sha"] == short_alone["sha"]
    assert long_run["settings"] == long_alone["settings"]              # its settings as they started, all along


def test_a_run_that_asks_for_its_own_backend_or_is_cancelled_leaves_the_other_as_alone(duo, gate):
    best = simd_backend()
    long_alone = done(duo, post(duo, LONG, LONG_GEN))
    short_alone = done(duo, post(duo, SHORT, SHORT_GEN, backend="scalar"))
    assert set(short_alone["backends"]) == {"scalar"}

    a = post(duo, LONG, LONG_GEN)          # on the server's kernels...
    duo.wait_tokens(a, 2)
    b = post(duo, SHORT, SHORT_GEN, backend="scalar")   # ...and one joining with its own
    long_run, short_run = done(duo, a), done(duo, b)
    # on the engine together (their rows in steps of their own kernels: never in one step)
    assert long_run["view"]["started_at"] < short_run["view"]["started_at"] < long_run["view"]["finished_at"]
    assert short_run["view"]["report"]["summary"]["batch"]["steps"] > 0
    assert set(long_run["backends"]) == {best} and long_run["sha"] == long_alone["sha"]
    assert set(short_run["backends"]) == {"scalar"} and short_run["sha"] == short_alone["sha"]
    duo.wait_idle()

    gate.close(held(SHORT, 3))             # a run cancelled while it steps with another
    a = post(duo, LONG, LONG_GEN)
    b = post(duo, SHORT, SHORT_GEN)
    gate.wait()
    gate.open()
    assert duo.request("DELETE", f"/runs/{b}").status in (200, 202)
    assert duo.wait_state(b)["state"] == "cancelled"
    long_run = done(duo, a)
    assert long_run["view"]["report"]["summary"]["batch"]["shared_steps"] > 0
    assert long_run["sha"] == long_alone["sha"]


def test_the_operators_switch_is_every_runs_and_each_dump_says_where(duo, gate):
    best = simd_backend()
    gate.close(held(SHORT, 3))
    a = post(duo, LONG, LONG_GEN)
    b = post(duo, SHORT, SHORT_GEN)
    gate.wait()
    r = duo.request("POST", "/operator/backend", body={"backend": "scalar"}, headers=operator_headers())
    assert r.status == 200 and sorted(r.json()["applied"]["runs"]) == sorted([a, b]), r.body
    gate.open()
    together = {a: done(duo, a), b: done(duo, b)}
    assert together[b]["view"]["report"]["summary"]["batch"]["shared_steps"] > 0
    duo.wait_idle()
    # back to the best kernels for the runs to come, then each run alone, switched where its record says
    assert duo.request("POST", "/operator/backend", body={"backend": best}, headers=operator_headers()).status == 200
    for run_id, prompt, gen in ((a, LONG, LONG_GEN), (b, SHORT, SHORT_GEN)):
        run = together[run_id]
        at = run["backends"].index("scalar")                 # the first token its record says scalar computed
        assert set(run["backends"][:at]) == {best} and set(run["backends"][at:]) == {"scalar"}
        gate.close(lambda r, step, p=prompt, at=at: tuple(r.prompt) == tuple(p) and step >= at)
        replay = post(duo, prompt, gen)
        gate.wait()
        assert duo.request("PATCH", f"/runs/{replay}", body={"backend": "scalar"}).status == 202
        gate.open()
        alone = done(duo, replay)
        duo.wait_idle()
        assert alone["backends"] == run["backends"], run_id
        assert alone["sha"] == run["sha"], run_id
