"""Speculative decoding through the server: `ds4f serve --spec`, POST /runs' `spec`, and the
ds4f_spec_* gauges of /metrics."""
from __future__ import annotations

import pytest

from ds4f.server.app import Server, ServerOptions
from ds4f.errors import Ds4fError
from server_helpers import Srv, serve_config  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from ds4f.engine.checkpoint.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("tiny-mtp") / "official", "tiny", seed=0, mtp=True)


@pytest.fixture()
def mtp_srv(tiny_mtp, serve_config):
    srv = Srv(Server(ServerOptions(model=str(tiny_mtp), config_path=str(serve_config), port=0, access_log=False,
                                   parallel=1, spec="auto")))
    yield srv
    srv.close()


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("ds4f_spec_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_post_runs_takes_spec_and_metrics_show_what_the_drafts_did(mtp_srv):
    r = mtp_srv.post_run(gen=10, prompt=[3, 17, 42], spec=2)
    assert r.status == 202, r.body
    view = mtp_srv.wait_state(r.json()["id"])
    assert view["state"] == "done", view
    run = mtp_srv.service.current_run
    spec = run.report["summary"]["spec"]
    assert spec["mode"] == "2" and spec["rounds"] > 0
    g = _gauges(mtp_srv.get("/metrics").body.decode())
    assert g['ds4f_spec_mode{mode="2"}'] == 1
    assert g["ds4f_spec_rounds"] == spec["rounds"]
    assert g["ds4f_spec_draft_bytes"] == pytest.approx(spec["draft_bytes"], rel=1e-9)
    assert g["ds4f_spec_tokens_per_round"] == pytest.approx(spec["tokens_per_round"])


def test_the_servers_spec_is_the_runs_default(mtp_srv):
    r = mtp_srv.post_run(gen=3, prompt=[3, 17])
    assert r.status == 202, r.body
    assert mtp_srv.wait_state(r.json()["id"])["state"] == "done"
    assert mtp_srv.service.current_run.report["summary"]["spec"]["mode"] == "auto"


@pytest.mark.parametrize("value", ["soon", 7, -1, True])
def test_a_bad_spec_is_refused_by_name(mtp_srv, value):
    r = mtp_srv.post_run(gen=2, spec=value)
    assert r.status == 400
    assert r.error()["param"] == "spec"


def test_a_fixed_spec_without_an_mtp_layer_is_refused_before_anything_runs(tiny_model, serve_config):
    srv = Srv(Server(ServerOptions(model=str(tiny_model), config_path=str(serve_config), port=0, access_log=False,
                                   parallel=1)))
    try:
        r = srv.post_run(gen=2, spec=1)
        assert r.status == 400 and "no MTP layer" in r.error()["message"], r.body
        assert srv.service.runs_started == 0
    finally:
        srv.close()


def test_serve_refuses_a_bad_spec_option():
    with pytest.raises(Ds4fError, match="--spec"):
        ServerOptions(spec="sometimes").check()
