"""The engine's MoE block against golden fixtures from HF transformers' deepseek_v4 code.

tests/fixtures/golden_moe.npz was written by tools/make_golden_moe.py (run by hand with torch
and transformers; see docs/testing.md, "Golden fixtures"): DeepseekV4SparseMoeBlock in float64 on the
exactly dequantized weights of the tiny synthetic checkpoint, shared expert's clamp lifted
(official semantics). This test needs neither torch nor transformers.

Criteria, per fixture row (layer, token id, residual h):
- selected expert ids: equal as sets, exactly (the fixtures only hold rows whose top_k-th and
  next biased scores are at least 1e-3 apart, so fp32 vs float64 cannot flip a selection);
- routing weights, matched by id: |w - ref| <= 1e-5 |ref| (they are positive, sum to
  routed_scaling_factor and are well conditioned, so a per-element relative bound is sound);
- block output y: max_i |y_i - ref_i| <= 1e-5 max_i |ref_i|. The bound is relative to the
  row's largest component, not per element: an element that cancels to near zero has no
  meaningful relative error, while fp32 accumulation error scales with the magnitudes
  summed, i.e. with the vector's scale (DESIGN.md: "within 1e-5 relative of a float64
  reference").
Some rows push a routed expert's gate or up, or the shared expert's, past swiglu_limit, so
the clamps (routed only) change y by >= 1e-2 of its scale there: far beyond the tolerance.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "golden_moe.npz"
REL_TOL = 1e-5
CONFTEST_SEED = 0  # tests/conftest.py's tiny_official / tiny_model


def _load_generator():
    """tools/make_golden_moe.py, for its fingerprint (it imports torch only when run)."""
    spec = importlib.util.spec_from_file_location("make_golden_moe", REPO / "tools" / "make_golden_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def golden():
    with np.load(FIXTURES) as z:
        data = {k: z[k] for k in z.files}
    data["meta"] = json.loads(str(data["meta"]))
    return data


@pytest.fixture(scope="module")
def golden_checkpoint(golden, tiny_official, tiny_model):
    """The converted tiny checkpoint, once the fixtures are known to be computed from it."""
    meta = golden["meta"]
    assert meta["synth_geometry"] == "tiny" and meta["synth_seed"] == CONFTEST_SEED, (
        f"fixtures are for geometry {meta['synth_geometry']!r} seed {meta['synth_seed']}; this test synthesizes"
        f" 'tiny' with seed {CONFTEST_SEED}")
    fp = _load_generator().checkpoint_fingerprint(tiny_official, meta["layers"])
    if fp != meta["fingerprint"]:
        pytest.fail(
            "the synthetic checkpoint generator changed since tests/fixtures/golden_moe.npz was made "
            f"(fingerprint {fp[:16]}... != fixtures' {meta['fingerprint'][:16]}...): the fixtures are stale, "
            "not necessarily the engine wrong. Regenerate them with tools/make_golden_moe.py "
            "(docs/testing.md, 'Golden fixtures') and commit them.", pytrace=False)
    return tiny_model


def test_fixtures_cover_the_block(golden):
    """The fixtures exercise what they must: the hash layer, learned layers and every clamp."""
    meta = golden["meta"]
    g = meta["geometry"]
    layers = set(golden["layer"].tolist())
    assert any(layer < g["num_hash_layers"] for layer in layers)
    assert sum(layer >= g["num_hash_layers"] for layer in layers) >= 2
    kinds = [meta["kinds"][k] for k in golden["kind"]]
    for layer in layers:
        for kind in ("clamp_gate", "clamp_up"):
            rows = [i for i, k in enumerate(kinds) if k == kind and golden["layer"][i] == layer]
            assert rows and all(golden["routed_clamp_effect"][i] >= 1e-2 for i in rows), (layer, kind)
        rows = [i for i, k in enumerate(kinds) if k == "clamp_shared" and golden["layer"][i] == layer]
        assert rows and all(golden["shared_clamp_effect"][i] >= 1e-2 for i in rows), layer
    learned = golden["layer"] >= g["num_hash_layers"]
    assert np.all(golden["margin"][learned] >= meta["min_margin"])
    assert golden["ids"].shape[1] == g["num_experts_per_tok"]
    np.testing.assert_allclose(golden["weights"].sum(axis=1), g["routed_scaling_factor"], rtol=1e-12)


def _backends():
    from ds4f.native import kernels

    return kernels.available_backends()


@pytest.mark.parametrize("backend", _backends())
def test_moe_block_matches_transformers(backend, golden, golden_checkpoint):
    from ds4f.native import kernels
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.config import load_config
    from ds4f.engine.engine import Engine

    meta = golden["meta"]
    preset = load_config().get_preset("server")  # every trunk layer pinned, large cache
    previous = kernels.get_backend()
    ck = open_checkpoint(golden_checkpoint)
    eng = None
    try:
        eng = Engine(ck, preset, io_threads=2, kernel_threads=1, backend=backend)
        assert eng.backend == backend
        session = eng.new_session()
        failures = []
        worst_w = worst_y = 0.0
        for i in range(len(golden["layer"])):
            layer, token = int(golden["layer"][i]), int(golden["token"][i])
            h = golden["h"][i].astype(np.float32)
            ids, weights, y = session.moe_sublayer(layer, h.copy(), token)
            ids = np.asarray(ids).astype(np.int64)
            y = np.array(y, dtype=np.float64)  # a copy: moe_sublayer returns the session's buffer
            ref_ids, ref_w, ref_y = golden["ids"][i], golden["weights"][i], golden["y"][i]
            margin = golden["margin"][i]
            where = (f"row {i}: layer {layer} ({meta['kinds'][golden['kind'][i]]}), token {token}, "
                     + ("hash routing" if np.isinf(margin) else f"biased-score margin {margin:.3g}"))
            if set(ids.tolist()) != set(ref_ids.tolist()):
                failures.append(f"{where}: expert ids {sorted(ids.tolist())} != transformers' {sorted(ref_ids.tolist())}")
                continue
            ours = dict(zip(ids.tolist(), np.asarray(weights, dtype=np.float64).tolist()))
            rel_w = max(abs(ours[e] - w) / abs(w) for e, w in zip(ref_ids.tolist(), ref_w.tolist()))
            rel_y = float(np.abs(y - ref_y).max() / np.abs(ref_y).max())
            worst_w, worst_y = max(worst_w, rel_w), max(worst_y, rel_y)
            if rel_w > REL_TOL:
                failures.append(f"{where}: routing weights off by {rel_w:.3g} relative (> {REL_TOL:g})")
            if not np.all(np.isfinite(y)) or not rel_y <= REL_TOL:
                j = int(np.nanargmax(np.abs(y - ref_y)))
                failures.append(f"{where}: block output off by {rel_y:.3g} of max|ref| (> {REL_TOL:g});"
                                f" worst element {j}: {y[j]:.9g} vs {ref_y[j]:.9g}")
        print(f"[{backend}] worst relative error: weights {worst_w:.2e}, block output {worst_y:.2e}")
        assert not failures, f"[{backend}] engine disagrees with transformers' DeepseekV4SparseMoeBlock:\n" + \
            "\n".join(failures)
    finally:
        if eng is not None:
            eng.close()
        ck.close()
        kernels.set_backend(previous)
