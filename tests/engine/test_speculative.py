"""Speculative decoding with the MTP layer: the layer in the checkpoint (synth, convert, verify,
DSpark refused), its forward against an independent float64 reference (engine.model.reference,
from ds4f-mtp.md), verification rows whose rejected part is undone exactly, greedy output equal
to plain decoding's byte for byte on every backend, rejection sampling's distribution, and the
controller that picks k."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.checkpoint.convert import convert_checkpoint
from ds4f.engine.checkpoint.synth import add_mtp_layer, synth_checkpoint
from ds4f.engine.checkpoint.tensors import mtp_tensors, official_tensors
from ds4f.engine.checkpoint.verify import verify_checkpoint
from ds4f.engine.config import load_config
from ds4f.engine.engine import Engine
from ds4f.engine.model.reference import ReferenceMtp
from ds4f.engine.session_state import take_layers
from ds4f.engine.speculative import (MtpDrafter, OracleDrafter, SpecController, accept_draft, finish_round,
                                     parse_spec, speculate)
from ds4f.engine.text.sampling import Sampler, SamplingParams
from ds4f.errors import Ds4fError
from ds4f.native import kernels
from ds4f.runs.config import RunConfig
from ds4f.runs.run import start_run

WHOLE = Path(__file__).resolve().parents[1] / "fixtures" / "whole"
BACKENDS = kernels.available_backends()


@pytest.fixture(scope="module")
def ratios_mtp(tmp_path_factory):
    """The transformers fixture with CSA and HCA layers (window 5, ratios 4 and 16) and a
    synthetic MTP layer beside it; (official, ds4f layout)."""
    root = tmp_path_factory.mktemp("ratios-mtp")
    src = root / "official"
    shutil.copytree(WHOLE / "ratios", src, ignore=shutil.ignore_patterns("expected.npz"))
    add_mtp_layer(src, seed=5)
    return src, convert_checkpoint(src, root / "ds4f", progress=False)


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("tiny-mtp") / "official", "tiny", seed=0, mtp=True)


def _engine(path, backend="scalar"):
    return Engine(open_checkpoint(path), load_config(None).get_preset("laptop"), 2, 1, backend)


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _run(model, tmp_path, name, **kw):
    kw.setdefault("probe_floor", False)
    run = start_run(RunConfig(model=str(model), dump_path=str(tmp_path / f"{name}.bin"), **kw))
    assert run.wait(120), "run did not finish"
    assert run.state == "done", run.error
    return run


# ---- the layer in the checkpoint ------------------------------------------------------------------
def test_synth_writes_the_mtp_layer_in_the_official_dtypes_and_leaves_the_main_tensors(tiny_mtp, tiny_official):
    g = open_checkpoint(tiny_mtp).geometry
    index = json.loads((tiny_mtp / "model.safetensors.index.json").read_text())["weight_map"]
    plan = {p.name: p for p in mtp_tensors(g)}
    assert {n for n in index if n.startswith("mtp.")} == set(plan)
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.scale", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
            "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.0.w1.weight",
            "mtp.0.attn.wkv.weight", "mtp.0.hc_attn_fn"} <= set(plan)
    assert not any("compressor" in n or "indexer" in n or "tid2eid" in n for n in plan)   # a window, a learned gate
    cfg = json.loads((tiny_mtp / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["compress_ratios"][-1] == 0
    assert len(cfg["compress_ratios"]) == g.n_layers + 1
    header = _headers(tiny_mtp)
    for name, p in plan.items():
        assert header[name][0] == p.dtype and tuple(header[name][1]) == p.shape, name
    # the main tensors are those of the same seed without the MTP layer, byte for byte
    plain = _headers(tiny_official)
    for p in official_tensors(g):
        assert _tensor_bytes(tiny_mtp, header, p.name) == _tensor_bytes(tiny_official, plain, p.name), p.name


def _headers(root: Path) -> dict:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        data = f.read_bytes()
        n = int.from_bytes(data[:8], "little")
        for name, t in json.loads(data[8:8 + n]).items():
            if name != "__metadata__":
                out[name] = (t["dtype"], t["shape"], f, 8 + n + t["data_offsets"][0], 8 + n + t["data_offsets"][1])
    return out


def _tensor_bytes(root, header, name) -> bytes:
    _, _, f, a, b = header[name]
    with open(f, "rb") as fh:
        fh.seek(a)
        return fh.read(b - a)


def test_convert_carries_the_mtp_layer_and_verify_checks_it(tiny_mtp, tmp_path):
    info: dict = {}
    assert verify_checkpoint(tiny_mtp, info=info) == [] and info["mtp_layers"] == 1
    off = open_checkpoint(tiny_mtp)
    g = off.geometry
    conv = convert_checkpoint(tiny_mtp, tmp_path / "ds4f", progress=False)
    ck = open_checkpoint(conv)
    assert ck.mtp_layers == 1 and off.mtp_layers == 1
    pool = json.loads((conv / "pool-mxfp4.json").read_text())
    assert pool["mtp_layers"] == 1 and len(pool["records"]) == (g.n_layers + 1) * g.n_experts
    a, b = np.zeros(ck.slot_nbytes, np.uint8), np.zeros(off.slot_nbytes, np.uint8)
    for e in (0, g.n_experts - 1):
        ck.read_expert(g.n_layers, e, a, check=True)
        off.read_expert(g.n_layers, e, b)
        assert a[:g.expert_nbytes].tobytes() == b[:g.expert_nbytes].tobytes()
    for name in ("mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.gate.bias"):
        assert ck.global_tensor(name).tobytes() == off.global_tensor(name).tobytes()
    info = {}
    assert verify_checkpoint(conv, info=info) == [] and info["mtp_layers"] == 1
    # one flipped byte in an MTP expert's record: verify names that record
    off_rec = pool["records"][g.n_layers * g.n_experts + 2][0]
    with open(conv / "pool-mxfp4.bin", "r+b") as f:
        f.seek(off_rec + 10)
        byte = f.read(1)
        f.seek(off_rec + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    problems = verify_checkpoint(conv)
    assert any("the MTP layer, expert 2" in p and "crc32" in p for p in problems), problems


def test_verify_finds_a_nan_scale_in_an_mtp_expert(tiny_mtp, tmp_path):
    root = tmp_path / "nan"
    shutil.copytree(tiny_mtp, root)
    header = _headers(root)
    _, _, f, a, _ = header["mtp.0.ffn.experts.3.w2.scale"]
    with open(f, "r+b") as fh:
        fh.seek(a)
        fh.write(b"\xff")
    problems = verify_checkpoint(root)
    assert any("NaN scale" in p and "mtp.0.ffn.experts.3.w2.scale" in p for p in problems), problems


def test_dspark_stages_are_recognised_and_refused_while_plain_runs_work(tiny_mtp, tmp_path):
    root = tmp_path / "dspark"
    shutil.copytree(tiny_mtp, root)
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(dspark_block_size=5, dspark_noise_token_id=3, dspark_target_layer_ids=[1, 2, 3])
    (root / "config.json").write_text(json.dumps(cfg))
    ck = open_checkpoint(root)
    assert ck.mtp_layers == 0 and "DSpark" in ck.mtp_problem
    assert verify_checkpoint(root) == []
    with pytest.raises(Ds4fError, match="DSpark"):
        start_run(RunConfig(model=str(root), gen=2, spec=2, probe_floor=False, dump_path=str(tmp_path / "a.bin")))
    assert not (tmp_path / "a.bin").exists()
    run = _run(root, tmp_path, "auto", gen=3, spec="auto")
    assert any("speculation: off" in e and "DSpark" in e for e in run.report["events"])
    assert run.report["summary"]["spec"] == {"mode": "auto", "active": False}


def test_a_checkpoint_without_an_mtp_layer_runs_as_before_and_refuses_fixed_drafts(tiny_model, tmp_path):
    assert open_checkpoint(tiny_model).mtp_layers == 0
    with pytest.raises(Ds4fError, match="no MTP layer"):
        start_run(RunConfig(model=str(tiny_model), gen=2, spec=1, probe_floor=False))
    run = _run(tiny_model, tmp_path, "plain", gen=3, spec="auto")
    assert run.report["summary"]["spec"]["active"] is False


@pytest.mark.parametrize("value", ["fast", 4, -1, True, "2.5"])
def test_bad_spec_values_are_refused_by_name(value):
    with pytest.raises(Ds4fError) as err:
        parse_spec(value)
    assert err.value.param == "spec"


def test_spec_values():
    assert [parse_spec(v) for v in ("auto", "OFF", "0", 0, "3", 2)] == ["auto", "off", "off", "off", 3, 2]


# ---- the layer's forward --------------------------------------------------------------------------
PROMPT = [3, 17, 42, 5, 9, 11, 60, 2, 33, 8, 19, 7, 101, 44]


def _main_streams(eng, tokens):
    """The main model's last-layer streams of each row of a plain greedy pass over `tokens`."""
    g, s = eng.geometry, eng.new_session()
    return [s.step(t).hidden[-1].reshape(g.attention.hc_mult, g.hidden).copy() for t in tokens]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_mtp_layer_matches_the_float64_reference_row_by_row(ratios_mtp, backend):
    """Teacher-forced rows past the window (5): logits and output streams within fp32 of float64,
    and the routing the same experts."""
    eng = _engine(ratios_mtp[1], backend)
    layer = eng.mtp_layer()
    X = _main_streams(eng, PROMPT)
    state, ref = layer.new_state(64), ReferenceMtp(open_checkpoint(ratios_mtp[0]))
    for j in range(len(PROMPT) - 1):
        logits, out = layer.rows(state, X[j][None], [PROMPT[j + 1]], j)
        want, want_x = ref.step(X[j], PROMPT[j + 1], j + 1)
        assert np.abs(logits[0] - want).max() <= 2e-5 * np.abs(want).max(), j
        assert np.abs(out[0] - want_x).max() <= 2e-5 * np.abs(want_x).max(), j
        assert sorted(layer.buffers.ids[0, 0].tolist()) == ref.ids


def test_drafts_catch_up_from_the_main_rows_and_chain_their_own_streams(ratios_mtp):
    """The drafter at the end of the prompt: its window brought up from the main rows (keys alone),
    the first draft from the last row, the next ones from the block's own streams; each the
    reference's argmax where the reference's top two are apart; the chained rows leave its window
    as the main rows made it."""
    eng = _engine(ratios_mtp[1])
    s = eng.new_session()
    drafter = MtpDrafter(eng.mtp_layer(), s.context)
    s.enable_drafts(drafter)
    for t in PROMPT[:-1]:
        s.step(t)
    ref = ReferenceMtp(open_checkpoint(ratios_mtp[0]))
    X = _main_streams(eng, PROMPT)
    for j in range(len(PROMPT) - 2):
        ref.step(X[j], PROMPT[j + 1], j + 1)
    drafts = drafter.draft(3, s.position, PROMPT[-1])
    assert len(drafts) == 3
    r = ref.copy()
    logits, streams = r.step(X[len(PROMPT) - 2], PROMPT[-1], len(PROMPT) - 1)
    checked = 0
    for i, d in enumerate(drafts):
        top = np.sort(logits)[-2:]
        if top[1] - top[0] > 1e-3 * abs(top[1]):
            assert d == int(np.argmax(logits)), i
            checked += 1
        logits, streams = r.step(streams, d, len(PROMPT) + i)
    assert checked >= 2
    # the chained rows were undone: the window is the one a single draft leaves
    one = MtpDrafter(eng.mtp_layer(), s.context)
    for j, t in enumerate(PROMPT[:-1]):
        one.observe(j, X[j].reshape(1, -1), [t])
    assert one.draft(1, s.position, PROMPT[-1]) == drafts[:1]
    assert np.array_equal(one.state.cache.window, drafter.state.cache.window)
    assert drafter.state.exact == len(PROMPT) - 1


# ---- verification and rollback -------------------------------------------------------------------
def _state_bytes(session) -> list[bytes]:
    out = []
    for layer in take_layers(session.kv):
        out += [a.tobytes() if isinstance(a, np.ndarray) else repr(a).encode() for a in vars(layer).values()]
    return out


@pytest.mark.parametrize("keep", [1, 2, 3, 4])
def test_a_verify_commits_the_kept_rows_and_undoes_the_rest_exactly(ratios_mtp, keep):
    """Rows 14..17 cross a compressed window's end at 15 (ratios 4 and 16) and wrap the window (5):
    after commit(keep) the KV cache, position, logits and tokens are those of `keep` plain steps."""
    eng = _engine(ratios_mtp[1])
    a, b = eng.new_session(), eng.new_session()
    for t in PROMPT[:14]:
        a.step(t)
        b.step(t)
    rows = PROMPT[14:] + [21, 22, 23, 24][:4 - len(PROMPT[14:])]
    res = a.verify(rows)
    logits = res.logits.copy()
    a.commit(keep)
    for c, t in enumerate(rows[:keep]):
        r = b.step(t)
        assert np.array_equal(r.logits, logits[c])
    assert _state_bytes(a) == _state_bytes(b)
    assert a.position == b.position and a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
    # both go on alike
    assert np.array_equal(a.step(50).logits, b.step(50).logits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [1, 2, 3, "auto"])
def test_greedy_speculation_gives_plain_decodings_state_dump(ratios_mtp, tmp_path, backend, spec):
    kw = dict(gen=20, prompt=tuple(PROMPT[:6]), backend=backend, cold_start=True)
    plain = _run(ratios_mtp[1], tmp_path, "plain", **kw)
    fast = _run(ratios_mtp[1], tmp_path, f"spec{spec}", spec=spec, **kw)
    assert _sha(fast.dump_path) == _sha(plain.dump_path)
    sp = fast.report["summary"]["spec"]
    assert sp["active"] is True and sp["mode"] == str(spec)
    if spec != "auto":
        assert sp["rounds"] > 0 and sp["drafted"] == sum(int(k) * n for k, n in sp["by_k"].items())
        assert sp["tokens"] == sp["accepted"] + sp["rounds"]
        assert sp["draft_bytes"] > 0 and sp["draft_s"] > 0


@pytest.mark.parametrize("p", [0.5, 1.0])
def test_accepted_drafts_give_plain_records_and_state(ratios_mtp, p):
    """Drafts that are often right (an oracle from the plain output): every accepted row's
    records are the plain step's, and the session ends in the plain session's state."""
    eng = _engine(ratios_mtp[1])
    plain = eng.new_session()
    feed, recs = [PROMPT[0]], []
    for i in range(24):
        r = plain.step(feed[-1])
        recs.append((r.ids.copy(), r.hidden.copy(), r.logits.copy()))
        feed.append(PROMPT[i + 1] if i + 1 < 6 else r.next_token)
    s = eng.new_session()
    s.enable_drafts(OracleDrafter(feed, p, eng.geometry.vocab, seed=2))
    for t in feed[:5]:
        s.step(t)
    got = []
    token, accepted = feed[5], 0
    while s.position < 24:
        k = min(3, 24 - s.position - 1, s.max_verify_rows - 1)
        rnd = speculate(s, s.drafter, k, token)
        for c in range(len(rnd.picks)):
            got.append((rnd.result.ids[c].copy(), rnd.result.hidden[c].copy(), rnd.result.logits[c].copy()))
        accepted += rnd.kept
        finish_round(s, None, rnd, len(rnd.picks), 1.0)
        token = rnd.picks[-1]
    assert accepted > 0 if p < 1 else accepted >= 24 - 6 - 5
    for (ia, ha, la), (ib, hb, lb) in zip(got, recs[5:]):
        assert np.array_equal(ia, ib) and np.array_equal(ha, hb) and np.array_equal(la, lb)
    assert len(got) == 24 - 5
    assert _state_bytes(s) == _state_bytes(plain) and s.tokens == plain.tokens


# ---- sampling -------------------------------------------------------------------------------------
def test_a_sampled_draft_is_kept_with_its_probability_and_the_token_is_a_draw_of_the_distribution():
    """accept_draft with a sampler over many draws: the tokens' frequencies are the sampler's
    distribution (softmax at the temperature over the top-k, computed here in float64) and a
    draft is kept as often as that distribution gives it, whichever token is drafted (one
    outside the top-k never)."""
    logits = np.array([2.0, 1.5, 0.3, -0.4, 1.0, -2.0, 0.0, 0.7], np.float32)
    temp, top_k = 0.8, 5
    z = logits.astype(np.float64) / temp
    keep = np.argsort(-z, kind="stable")[:top_k]
    want = np.zeros(len(z))
    want[keep] = np.exp(z[keep] - z[keep].max())
    want /= want.sum()
    n = 40000
    tol = 4 * np.sqrt(want.max() / n) + 1e-3
    for draft in (0, 2, 5):
        sampler = Sampler(SamplingParams(temperature=temp, top_k=top_k, seed=11))
        judged = [accept_draft(sampler, logits, draft) for _ in range(n)]
        counts = np.bincount([t for _, t in judged], minlength=len(z)) / n
        assert np.abs(counts - want).max() < tol, (draft, counts, want)
        assert abs(np.mean([k for k, _ in judged]) - want[draft]) < tol
        assert all(k == (t == draft) for k, t in judged)
        assert sampler.draws == n                  # one uniform per judged row, as a plain step


@pytest.mark.parametrize("spec", [2, "auto"])
def test_sampled_speculation_gives_plain_samplings_state_dump_for_the_seed(ratios_mtp, tmp_path, spec):
    """The same seed, with and without drafts: the same tokens and records, byte for byte
    (whatever k the rounds had); a second seed differs."""
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    kw = dict(gen=16, prompt=tuple(PROMPT[:4]))
    plain = _run(ratios_mtp[1], tmp_path, "plain", sampling=sampling, **kw)
    fast = _run(ratios_mtp[1], tmp_path, f"spec{spec}", sampling=sampling, spec=spec, **kw)
    assert _sha(fast.dump_path) == _sha(plain.dump_path)
    assert fast.report["summary"]["spec"]["active"]
    other = _run(ratios_mtp[1], tmp_path, "other", spec=spec, sampling=SamplingParams(temperature=1.0, top_p=0.95,
                                                                                      seed=8), **kw)
    assert _sha(other.dump_path) != _sha(plain.dump_path)


# ---- choosing k -----------------------------------------------------------------------------------
def _simulate(controller, steps, agree: bool, row_cost: float):
    """Drive a controller as a run does: plain steps (1 s, a shadow draft now and then that the
    step agrees with or not) and rounds (each draft kept if `agree`; a round of k costs 1 + k
    row_cost s and 0.05 s per draft). The k of each step."""
    chosen = []
    for _ in range(steps):
        k = controller.choose(3)
        chosen.append(k)
        if k == 0:
            if controller.wants_shadow():
                controller.record_shadow(agree, 0.05, 10)
            controller.record_plain(1.0, 100)
        else:
            kept = k if agree else 0
            controller.record_round(k, kept, kept + 1, 1.0 + k * (row_cost + 0.05), 100 + 50 * k, 10 * k, 0.05 * k)
    return chosen


def test_auto_steps_plainly_while_drafts_would_not_be_kept_and_only_shadows_them():
    c = SpecController("auto")
    assert c.choose(3) == 0                          # nothing measured yet
    chosen = _simulate(c, 600, agree=False, row_cost=0.5)
    assert sum(1 for k in chosen if k) <= 1          # at most one round while the prior still hoped
    from ds4f.engine import speculative as sp
    plain = chosen.count(0)
    assert sp.SHADOW_FIRST <= c.stats.shadows <= sp.SHADOW_FIRST + plain // sp.SHADOW_LATER + 1
    assert c.stats.draft_s == pytest.approx(0.05 * (c.stats.shadows + sum(chosen)))


def test_auto_keeps_costly_shadow_drafts_within_their_budget_of_the_plain_steps():
    """Shadow drafts that cost 0.3 of a step (a streamed draft layer on a cold cache): after the
    first, all of them together stay within SHADOW_BUDGET of the plain steps' seconds."""
    from ds4f.engine import speculative as sp

    c = SpecController("auto")
    for _ in range(400):
        assert c.choose(3) == 0
        if c.wants_shadow():
            c.record_shadow(False, 0.3, 10)
        c.record_plain(1.0, 100)
        assert c.shadow_s - 0.3 <= sp.SHADOW_BUDGET * c.plain_total
    assert c.stats.shadows >= 400 // sp.SHADOW_LATER                  # and it does keep measuring


def test_acceptance_follows_drafts_that_stop_being_kept():
    """Past JUDGED_MEMORY judgements the older ones count half: after a long run of kept drafts
    (or the earlier runs' on the engine), as many rejections bring the estimate down, and auto
    back to plain steps."""
    from ds4f.engine import speculative as sp

    c = SpecController("auto")
    c.record_plain(1.0, 100)
    for _ in range(500):
        c.record_round(1, 1, 2, 1.3, 200, 10, 0.05)
    assert c.acceptance(1) > 0.95 and c.choose(3) >= 1
    for _ in range(sp.JUDGED_MEMORY):
        c.record_round(1, 0, 1, 1.3, 200, 10, 0.05)
    assert c.acceptance(1) < 0.4 and c.choose(3) == 0
    assert c.stats.by_depth[1] == [500 + sp.JUDGED_MEMORY, 500]        # the run's own counts stay exact


def test_one_slow_measurement_does_not_decide():
    """Costs are medians of the recent measurements: a stalled step among fast ones moves nothing."""
    c = SpecController("auto")
    for s in (1.0, 1.0, 9.0, 1.0, 1.0):
        c.record_plain(s, 100)
    assert c.plain_s == 1.0
    c.record_round(2, 2, 3, 8.0, 300, 20, 0.1)          # a first round that stalled
    c.record_round(2, 2, 3, 1.4, 300, 20, 0.1)
    c.record_round(2, 2, 3, 1.4, 300, 20, 0.1)
    assert c.round_s[2] == 1.4 and c.choose(3) >= 2


def test_auto_drafts_when_acceptance_pays_and_goes_deeper_while_it_pays_more():
    c = SpecController("auto")
    chosen = _simulate(c, 300, agree=True, row_cost=0.1)
    assert chosen[-50:] == [3] * 50
    # rows that cost a whole step each: even always-kept drafts do not pay for verifying 4 rows
    c = SpecController("auto")
    chosen = _simulate(c, 300, agree=True, row_cost=1.0)
    assert set(chosen[-50:]) == {0}
    assert SpecController(2).choose(3) == 2 and SpecController(2).choose(1) == 1
    assert SpecController("off").choose(3) == 0
