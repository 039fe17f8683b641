"""`ds4f bench spec`: its rows, and what they rest on: every speculative run's tokens are plain
decoding's, an oracle that is always right is kept on every draft, and a trained MTP layer's
drafts (--trained) are kept as they really are."""
from __future__ import annotations

from pathlib import Path

import pytest

from ds4f.bench.spec import bench_spec
from ds4f.bench.spec_trained import bench_spec_trained
from ds4f.engine.checkpoint.synth import MTP_SHARD, synth_checkpoint
from ds4f.errors import Ds4fError


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("bench-spec") / "official", "tiny", seed=0, mtp=True)


def test_bench_spec_rows_have_plain_tokens_and_the_acceptance_they_were_given(tiny_mtp):
    result = bench_spec(tiny_mtp, gen=6, ps=(0.0, 1.0), ks=(2,), repeat=1)
    records = result["records"]
    names = [(r["cache"], r["drafter"], r["k"]) for r in records]
    assert names == [(c, d, k) for c in ("warm", "cold") for d, k in
                     (("oracle p=0.0", "2"), ("oracle p=1.0", "2"), ("oracle p=0.8", "auto"), ("oracle p=0.0", "auto"),
                      ("control", "off"), ("mtp", "1"), ("mtp", "auto"))]
    assert all(r["same"] for r in records)
    for r in records:
        assert r["tokens_per_s"] > 0 and r["speedup"] == r["tokens_per_s"] / r["plain_tokens_per_s"]
        if r["drafter"] == "oracle p=1.0":
            assert r["acceptance"] == 1.0 and r["tokens_per_round"] > 2     # 3 per round but where gen cuts it
        if r["drafter"] == "oracle p=0.0" and r["k"] == "2":
            assert r["acceptance"] == 0.0 and r["tokens_per_round"] == 1.0
        if r["drafter"] == "mtp":
            assert r["draft_s"] > 0 or r["k"] == "auto"      # (its few experts stay in its slots: few bytes)
    assert result["mtp_bytes"] > 0


def test_bench_spec_auto_rows_alone_and_bad_arguments(tiny_mtp, tiny_official):
    rows = bench_spec(tiny_mtp, gen=3, repeat=1, rows="auto")["records"]
    assert {(r["drafter"], r["k"]) for r in rows} == {("oracle p=0.8", "auto"), ("oracle p=0.0", "auto"),
                                                       ("control", "off"), ("mtp", "auto")}
    control = [r for r in rows if r["drafter"] == "control"]
    assert all(r["rounds"] == 0 and r["acceptance"] is None for r in control)
    with pytest.raises(Ds4fError, match="rows 'some': all or auto"):
        bench_spec(tiny_mtp, rows="some")
    with pytest.raises(Ds4fError, match="at least 1 pair"):
        bench_spec(tiny_mtp, repeat=0)
    with pytest.raises(Ds4fError, match="no MTP layer"):
        bench_spec(tiny_official, gen=2)


TRAINED = Path(__file__).resolve().parents[1] / "fixtures" / "toolcall"


@pytest.mark.skipif(not (TRAINED / MTP_SHARD).is_file(), reason="tests/fixtures/toolcall has no trained MTP layer")
def test_bench_spec_trained_measures_real_acceptance_with_plain_tokens(tmp_path):
    result = bench_spec_trained(TRAINED, modes=(2, "auto"), limit=3)
    off, two, auto = result["records"]
    assert (off["spec"], two["spec"], auto["spec"]) == ("off", "2", "auto") and result["conversations"] == 3
    assert all(r["same"] for r in result["records"]) and off["tokens"] == two["tokens"] == auto["tokens"] > 0
    assert off["acceptance"] is None and two["acceptance"] > 0.45 and two["tokens_per_round"] > 1.5
    assert two["speedup"] == two["tokens_per_s"] / off["tokens_per_s"]
    # auto on one engine: the conversations after the first start from what it measured, and draft
    assert auto["by_k"] and auto["acceptance"] > 0.45
    with pytest.raises(Ds4fError, match="script.json: not found"):
        bench_spec_trained(tmp_path)
    (tmp_path / "script.json").write_text('{"cases": 3}')
    with pytest.raises(Ds4fError, match="not a script of conversations"):
        bench_spec_trained(tmp_path)
