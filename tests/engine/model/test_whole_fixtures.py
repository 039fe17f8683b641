"""The whole-model golden fixtures (tests/fixtures/whole/<case>/) are self-consistent and cover
what they must.

They were written by tools/make_golden_whole.py (run by hand with torch and transformers):
transformers' DeepseekV4ForCausalLM, fp32, eager, on weights quantised to the official dtypes
and loaded exactly dequantised, shared expert's clamp lifted, the indexer's ties broken to the
lower compressed-row index. This test needs neither torch nor transformers, and it does NOT
implement the model: it checks the files against each other, against the config, against
ds4f's readers, and that the recorded run exercises the window, the compressors, the indexer's
selection, (case `ties`) its tie rule and (case `long`) positions far past the window and past
many compressions, where the per-step float arrays are kept at some steps only (`steps`).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
WHOLE = REPO / "tests" / "fixtures" / "whole"
GENERATOR = REPO / "tools" / "make_golden_whole.py"
CASES = ("tiny", "ties", "ratios", "long")
STEP_ARRAYS = ("logits_decode", "logits_full", "hc_state", "attn_out", "index_scores")   # rows at `steps`
REL_TOL = 1e-4  # decode vs full forward, relative to the row's max |logit|
MAX_DIR_BYTES = 1_000_000

# config.json keys ds4f reads (the official release's names) and the transformers fields the
# model was built from
RELEASE_KEYS = ("hidden_size", "moe_intermediate_size", "num_hidden_layers", "n_routed_experts",
                "num_experts_per_tok", "num_hash_layers", "vocab_size", "routed_scaling_factor", "swiglu_limit",
                "rms_norm_eps", "n_shared_experts", "bos_token_id", "eos_token_id", "num_attention_heads",
                "compress_ratios", "qk_rope_head_dim", "rope_scaling", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
                "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "num_nextn_predict_layers")
TRANSFORMERS_KEYS = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "partial_rotary_factor", "rope_theta",
                     "compress_rope_theta", "max_position_embeddings", "model_type", "scoring_func",
                     "norm_topk_prob", "hidden_act", "tie_word_embeddings")
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def _generator():
    """tools/make_golden_whole.py (it imports torch only when run)."""
    spec = importlib.util.spec_from_file_location("make_golden_whole", GENERATOR)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Case:
    def __init__(self, name: str):
        from ds4f.engine.checkpoint.safetensors_index import read_shard_header

        self.name = name
        self.dir = WHOLE / name
        self.config = json.loads((self.dir / "config.json").read_text())
        self.header = read_shard_header(self.dir / "model.safetensors")  # ds4f's own validating parser
        with np.load(self.dir / "expected.npz", allow_pickle=False) as z:
            self.a = {k: z[k] for k in z.files}
        self.meta = json.loads(str(self.a.pop("meta")))
        c = self.config
        self.L = c["num_hidden_layers"]
        self.P = int(self.a["prompt_len"])
        self.S = len(self.a["tokens"])
        self.steps = self.a.pop("steps", np.arange(self.S))   # the steps STEP_ARRAYS' rows are
        self.ratio = [0 if t == SWA else c["compress_rates"][t] for t in c["layer_types"]]
        self.csa = [i for i, t in enumerate(c["layer_types"]) if t == CSA]

    def tensor(self, name: str) -> np.ndarray:
        from ds4f.engine.checkpoint.formats import st_numpy_dtype

        t = self.header[name]
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            raw = f.read(t.nbytes)
        return np.frombuffer(raw, dtype=st_numpy_dtype(t.dtype)).reshape(t.shape)


_CACHE: dict[str, Case] = {}


@pytest.fixture(scope="module", params=CASES)
def case(request) -> Case:
    if request.param not in _CACHE:
        _CACHE[request.param] = Case(request.param)
    return _CACHE[request.param]


# ---- provenance ------------------------------------------------------------------------------
def test_fixtures_are_fresh(case):
    """Made by the current generator's recipe, and the files are the ones the run was made from."""
    gen = _generator()
    meta = case.meta
    assert meta["format"] == "ds4f-golden-whole" and meta["case"] == case.name
    if meta["version"] != gen.GENERATOR_VERSION or meta["recipe_hash"] != gen.recipe_hash(case.name):
        pytest.fail(f"tools/make_golden_whole.py's recipe for {case.name!r} changed since tests/fixtures/whole/"
                    f"{case.name} was made: the fixtures are stale. Regenerate them (the tool's docstring) and "
                    "commit them.", pytrace=False)
    fp = gen.fixture_fingerprint(case.dir)
    assert fp == meta["fingerprint"], (
        f"{case.dir}: config.json / model.safetensors are not the files expected.npz was computed from "
        f"({fp[:16]}... != {meta['fingerprint'][:16]}...)")
    assert meta["config"] == case.config


def test_fixture_directories_are_small(case):
    files = {p.name: p.stat().st_size for p in case.dir.iterdir()}
    assert set(files) == {"config.json", "model.safetensors", "expected.npz"}
    assert sum(files.values()) < MAX_DIR_BYTES, files


# ---- config.json -------------------------------------------------------------------------------
def test_config_has_both_namings_and_they_agree(case):
    c = case.config
    missing = [k for k in RELEASE_KEYS + TRANSFORMERS_KEYS if k not in c]
    assert not missing, f"config.json lacks {missing}"
    L = case.L
    assert len(c["layer_types"]) == L and len(c["mlp_layer_types"]) == L
    assert set(c["layer_types"]) <= {SWA, CSA, HCA}
    # the release's compress_ratios: one per layer (0 = sliding), then the MTP layer's entries
    assert len(c["compress_ratios"]) == L + c["num_nextn_predict_layers"]
    assert c["compress_ratios"][:L] == case.ratio
    assert all(r == 0 for r in c["compress_ratios"][L:])
    assert all(isinstance(r, int) and r > 0 for r in c["compress_rates"].values())
    # hash layers: counted, and first
    n_hash = c["num_hash_layers"]
    assert c["mlp_layer_types"] == ["hash_moe"] * n_hash + ["moe"] * (L - n_hash)
    assert c["qk_rope_head_dim"] == int(c["head_dim"] * c["partial_rotary_factor"])
    assert c["qk_rope_head_dim"] % 2 == 0 and c["index_head_dim"] >= c["qk_rope_head_dim"]
    rp, rs = c["rope_parameters"], c["rope_scaling"]
    assert rp["rope_type"] == rs["type"] == "yarn"
    for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        assert rp[k] == rs[k], k  # transformers' loader lets rope_scaling replace rope_parameters
    assert set(rp) == {"rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
    assert c["num_attention_heads"] % c["o_groups"] == 0
    assert c["hidden_size"] % 32 == 0 and c["moe_intermediate_size"] % 32 == 0  # MXFP4 blocks


def test_config_is_read_by_ds4f(case):
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.model.geometry import Geometry

    c = case.config
    g = Geometry.from_config(c, str(case.dir / "config.json"))
    assert (g.hidden, g.inter, g.n_layers, g.n_experts, g.top_k, g.n_hash_layers, g.vocab) == (
        c["hidden_size"], c["moe_intermediate_size"], c["num_hidden_layers"], c["n_routed_experts"],
        c["num_experts_per_tok"], c["num_hash_layers"], c["vocab_size"])
    ck = open_checkpoint(case.dir)  # the official reader: single shard, MoE tensors in official dtypes
    try:
        assert ck.kind == "official" and ck.geometry == g
    finally:
        ck.close()


# ---- model.safetensors ---------------------------------------------------------------------------
def expected_tensors(c: dict) -> dict[str, tuple[str, tuple]]:
    """Every official name with its shipped dtype and shape, for this config."""
    D, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    I, E, k = c["moe_intermediate_size"], c["n_routed_experts"], c["num_experts_per_tok"]
    H, hd, qr, G, R = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    ih, idim, hc = c["index_n_heads"], c["index_head_dim"], c["hc_mult"]
    mix = (2 + hc) * hc
    out: dict[str, tuple[str, tuple]] = {}

    def fp8(name, rows, cols):
        out[name + ".weight"] = ("F8_E4M3", (rows, cols))
        out[name + ".scale"] = ("F8_E8M0", (-(-rows // 128), -(-cols // 128)))

    out.update({"embed.weight": ("BF16", (V, D)), "head.weight": ("BF16", (V, D)), "norm.weight": ("BF16", (D,)),
                "hc_head_fn": ("F32", (hc, hc * D)), "hc_head_base": ("F32", (hc,)), "hc_head_scale": ("F32", (1,))})
    for i in range(L):
        p = f"layers.{i}."
        out[p + "attn_norm.weight"] = ("BF16", (D,))
        out[p + "ffn_norm.weight"] = ("BF16", (D,))
        for s in ("attn", "ffn"):
            out[p + f"hc_{s}_fn"] = ("F32", (mix, hc * D))
            out[p + f"hc_{s}_base"] = ("F32", (mix,))
            out[p + f"hc_{s}_scale"] = ("F32", (3,))
        fp8(p + "attn.wq_a", qr, D)
        out[p + "attn.q_norm.weight"] = ("BF16", (qr,))
        fp8(p + "attn.wq_b", H * hd, qr)
        fp8(p + "attn.wkv", hd, D)
        out[p + "attn.kv_norm.weight"] = ("BF16", (hd,))
        fp8(p + "attn.wo_a", G * R, H * hd // G)
        fp8(p + "attn.wo_b", D, G * R)
        out[p + "attn.attn_sink"] = ("F32", (H,))
        kind = c["layer_types"][i]
        if kind != SWA:
            r = c["compress_rates"][kind]
            width = 2 * hd if kind == CSA else hd
            out[p + "attn.compressor.wkv.weight"] = ("BF16", (width, D))
            out[p + "attn.compressor.wgate.weight"] = ("BF16", (width, D))
            out[p + "attn.compressor.ape"] = ("F32", (r, width))
            out[p + "attn.compressor.norm.weight"] = ("BF16", (hd,))
        if kind == CSA:
            fp8(p + "attn.indexer.wq_b", ih * idim, qr)
            out[p + "attn.indexer.weights_proj.weight"] = ("BF16", (ih, D))
            out[p + "attn.indexer.compressor.wkv.weight"] = ("BF16", (2 * idim, D))
            out[p + "attn.indexer.compressor.wgate.weight"] = ("BF16", (2 * idim, D))
            out[p + "attn.indexer.compressor.ape"] = ("F32", (c["compress_rates"][CSA], 2 * idim))
            out[p + "attn.indexer.compressor.norm.weight"] = ("BF16", (idim,))
        out[p + "ffn.gate.weight"] = ("BF16", (E, D))
        if c["mlp_layer_types"][i] == "hash_moe":
            out[p + "ffn.gate.tid2eid"] = ("I64", (V, k))
        else:
            out[p + "ffn.gate.bias"] = ("F32", (E,))
        fp8(p + "ffn.shared_experts.w1", I, D)
        fp8(p + "ffn.shared_experts.w3", I, D)
        fp8(p + "ffn.shared_experts.w2", D, I)
        for e in range(E):
            q = p + f"ffn.experts.{e}."
            for w, (rows, kk) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
                out[q + f"{w}.weight"] = ("I8", (rows, kk // 2))
                out[q + f"{w}.scale"] = ("F8_E8M0", (rows, kk // 32))
    return out


def test_safetensors_has_every_official_tensor(case):
    want = expected_tensors(case.config)
    got = {n: (t.dtype, tuple(t.shape)) for n, t in case.header.items()}
    assert sorted(set(want) - set(got)) == [], "missing tensors"
    assert sorted(set(got) - set(want)) == [], "unexpected tensors"
    bad = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
    assert not bad, f"(dtype, shape) found vs expected: {bad}"


def test_quantised_weights_decode_with_ds4f(case):
    """Every FP8 and MXFP4 tensor decodes with ds4f's reference decoders (the FP8 ones exactly in bf16),
    the generator's MXFP4 decode (ml_dtypes) agrees with ds4f's, and no scale is NaN."""
    from ds4f.engine.checkpoint.formats import dequantize_fp8, dequantize_mxfp4

    gen = _generator()
    n_fp8 = n_fp4 = 0
    for name, t in case.header.items():
        if t.dtype == "F8_E8M0":
            assert not np.any(case.tensor(name).view(np.uint8) == 255), f"{name}: NaN scale"
        if t.dtype == "F8_E4M3":
            base = name[:-len(".weight")]
            w, s = case.tensor(name), case.tensor(base + ".scale")
            d = dequantize_fp8(w, s, name=name).astype(np.float32)
            assert np.array_equal(d, gen.dequantize_fp8(w, s)) and np.all(np.isfinite(d)) and np.any(d != 0)
            n_fp8 += 1
        elif t.dtype == "I8":
            base = name[:-len(".weight")]
            w, s = case.tensor(name), case.tensor(base + ".scale")
            d = dequantize_mxfp4(w, s)
            assert np.array_equal(d, gen.dequantize_mxfp4(w, s)) and np.all(np.isfinite(d)) and np.any(d != 0)
            n_fp4 += 1
        elif t.dtype in ("BF16", "F32"):
            assert np.all(np.isfinite(case.tensor(name).astype(np.float32))), name
    c = case.config
    assert n_fp4 == 3 * c["n_routed_experts"] * case.L
    assert n_fp8 == case.L * 8 + len(case.csa)


def test_fp8_quantiser_is_ds4fs():
    """The generator's copy of quantize_fp8 is byte-identical to ds4f's, ragged and multi-tile shapes."""
    from ds4f.engine.checkpoint.formats import quantize_fp8

    gen = _generator()
    rng = np.random.default_rng(5)
    for shape in ((32, 64), (128, 32), (256, 32), (200, 300), (1, 129)):
        for std in (0.3, 1e-3, 40.0):
            w = (std * rng.standard_normal(shape)).astype(np.float32)
            q1, s1 = quantize_fp8(w)
            q2, s2 = gen.quantize_fp8(w)
            assert q1.view(np.uint8).tobytes() == q2.view(np.uint8).tobytes(), (shape, std)
            assert s1.view(np.uint8).tobytes() == s2.view(np.uint8).tobytes(), (shape, std)


def test_routing_tables_and_ties_construction(case):
    c = case.config
    for i in range(c["num_hash_layers"]):
        t = case.tensor(f"layers.{i}.ffn.gate.tid2eid")
        assert t.min() >= 0 and t.max() < c["n_routed_experts"]
        assert all(len(set(row)) == len(row) for row in t.tolist()), "duplicate experts for a token"
    if case.name == "ties":  # every indexer head but one has zero weight: scores are exact zeros
        for i in case.csa:
            w = case.tensor(f"layers.{i}.attn.indexer.weights_proj.weight").astype(np.float32)
            assert np.count_nonzero(np.any(w != 0, axis=1)) == 1


# ---- expected.npz --------------------------------------------------------------------------------
def test_arrays_have_the_documented_shapes(case):
    a, c, S, L = case.a, case.config, case.S, case.L
    V, D, hc, k, K = c["vocab_size"], c["hidden_size"], c["hc_mult"], c["num_experts_per_tok"], c["index_topk"]
    C, N, steps = len(case.csa), len(case.steps), case.steps
    shapes = {"tokens": (S,), "logits_decode": (N, V), "logits_full": (N, V), "greedy": (S,),
              "hc_state": (N, L, hc, D), "attn_out": (N, L, D), "route_ids": (S, L, k), "route_weights": (S, L, k),
              "route_gap": (S, L), "n_compressed": (S, L), "index_layers": (C,),
              "index_scores": (N, C, S // c["compress_rates"][CSA]), "index_selected": (S, C, K),
              "index_boundary_tie": (S, C), "index_boundary_gap": (S, C), "index_relu_margin": (S, C)}
    assert {n: a[n].shape for n in shapes} == shapes
    assert set(a) == set(shapes) | {"prompt_len"}
    assert set(case.meta["arrays"]) - {"steps"} == set(a)
    # the steps kept: every one, or the generator's choice for the case (every step from the last
    # prompt token on among them, so the generation is checked whole)
    want = _generator().kept_steps(_generator().CASES[case.name], case.P, S)
    assert steps.dtype == np.int64 and steps.tolist() == want.tolist()
    assert set(range(case.P - 1, S)) <= set(steps.tolist())
    for n in ("logits_decode", "logits_full", "hc_state", "attn_out", "route_weights"):
        assert a[n].dtype == np.float32 and np.all(np.isfinite(a[n])), n
    assert a["index_layers"].tolist() == case.csa


def test_decode_equals_full_forward(case):
    dec, full = case.a["logits_decode"], case.a["logits_full"]
    rel = np.abs(dec - full).max(axis=1) / np.abs(full).max(axis=1)
    assert rel.max() <= REL_TOL, f"step {int(rel.argmax())}: decode vs full forward {rel.max():.3g} relative"


def test_greedy_tokens(case):
    a, c, P, S = case.a, case.config, case.P, case.S
    assert P >= 13 and S - P == 16 == case.meta["generated"]
    tokens = a["tokens"]
    assert tokens[0] == c["bos_token_id"] and np.all((tokens >= 0) & (tokens < c["vocab_size"]))
    assert np.array_equal(a["greedy"][case.steps], a["logits_decode"].argmax(axis=1))
    assert np.array_equal(a["greedy"][case.steps], a["logits_full"].argmax(axis=1))
    assert np.array_equal(tokens[P:], a["greedy"][P - 1:S - 1])
    assert c["eos_token_id"] not in tokens[P:].tolist()
    top2 = np.sort(a["logits_decode"][case.steps >= P - 1], axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() >= case.meta["criteria"]["min_greedy_gap"]


def test_routing(case):
    a, c = case.a, case.config
    ids, w = a["route_ids"], a["route_weights"]
    assert ids.shape[-1] == c["num_experts_per_tok"]
    assert ids.min() >= 0 and ids.max() < c["n_routed_experts"]
    assert np.all(np.sort(ids, axis=-1)[..., 1:] != np.sort(ids, axis=-1)[..., :-1]), "duplicate experts"
    assert np.all(w > 0)
    np.testing.assert_allclose(w.sum(axis=-1), c["routed_scaling_factor"], rtol=1e-5)
    for i in range(case.L):
        if c["mlp_layer_types"][i] == "hash_moe":
            t = case.tensor(f"layers.{i}.ffn.gate.tid2eid")
            assert np.array_equal(ids[:, i], t[a["tokens"]]), f"layer {i}: hash routing != tid2eid[token]"
            assert np.all(np.isinf(a["route_gap"][:, i]))
        else:
            assert a["route_gap"][:, i].min() >= case.meta["criteria"]["min_route_gap"]
    learned = [i for i in range(case.L) if c["mlp_layer_types"][i] == "moe"]
    assert learned and all(len(np.unique(ids[:, i])) >= c["n_routed_experts"] // 2 for i in learned)


def test_covers_window_wrap_and_compression_boundaries(case):
    c, P, S = case.config, case.P, case.S
    W = c["sliding_window"]
    assert P > W and S - P > W, "the window must wrap during the prompt and again during the generation"
    pos = np.arange(S)
    for i, r in enumerate(case.ratio):
        want = (pos + 1) // r if r else np.zeros(S, np.int64)
        assert np.array_equal(case.a["n_compressed"][:, i], want), i
    for kind in (CSA, HCA):
        if kind in c["layer_types"]:
            r = c["compress_rates"][kind]
            closes = [t for t in range(S) if (t + 1) % r == 0]
            assert any(t < P for t in closes) and any(t >= P for t in closes), (kind, r, closes)
            assert len(closes) >= 2


def test_indexer_selection_follows_the_tie_rule(case):
    """The recorded choice is the top index_topk by score, lower row index first among equal scores;
    index_topk < rows at many steps; the tie flags and counts are what the scores say."""
    a, K = case.a, case.config["index_topk"]
    ties = 0
    for row, t in enumerate(case.steps):
        for ci, i in enumerate(case.csa):
            T = int(a["n_compressed"][t, i])
            s = a["index_scores"][row, ci]
            assert np.all(np.isfinite(s[:T])) and np.all(np.isnan(s[T:]))
            order = np.argsort(-s[:T].astype(np.float64), kind="stable")
            k = min(K, T)
            sel = a["index_selected"][t, ci]
            assert sel[:k].tolist() == order[:k].tolist() and np.all(sel[k:] == -1), (t, i, sel, s[:T])
            tie = bool(k < T and s[order[k - 1]] == s[order[k]])
            assert tie == bool(a["index_boundary_tie"][t, ci]), (t, i)
            ties += tie
    for t in range(case.S):      # every step, scores kept or not: index_topk distinct rows among those there are
        for ci, i in enumerate(case.csa):
            T = int(a["n_compressed"][t, i])
            sel = a["index_selected"][t, ci]
            k = min(K, T)
            assert sorted(set(sel[:k].tolist())) == sorted(sel[:k].tolist()), (t, i, sel)
            assert all(0 <= r < T for r in sel[:k].tolist()) and np.all(sel[k:] == -1), (t, i, sel)
    assert int(a["index_boundary_tie"].sum()) == case.meta["facts"]["index_boundary_ties"]
    if len(case.steps) == case.S:
        assert ties == case.meta["facts"]["index_boundary_ties"]
    events = int(np.sum(a["n_compressed"][:, case.csa] > K))
    assert events == case.meta["facts"]["index_topk_events"] >= 10, "index_topk must be < compressed rows often"
    assert any(a["n_compressed"][t, i] > K for t in range(case.P) for i in case.csa), "... already in the prompt"
    gaps = np.where(a["index_boundary_tie"], np.nan, a["index_boundary_gap"])
    assert np.nanmin(gaps) >= case.meta["criteria"]["min_index_gap_rel"], "a near-tie an fp32 engine could flip"
    if case.name == "ties":
        spec = _generator().CASES["ties"]["ties"]
        assert ties >= spec["min_ties"]
        tie_steps = a["index_boundary_tie"]
        assert a["index_relu_margin"][tie_steps].min() >= case.meta["criteria"]["min_relu_margin"]
        # the ties matter: the other tie order changes the logits (measured by the generator)
        assert case.meta["facts"]["reversed_rule_steps_changed"] >= 1
        assert case.meta["facts"]["reversed_rule_max_abs"] > 1e-2
    else:
        assert ties == 0
        assert case.meta["facts"]["torch_topk_vs_rule_max_abs"] == 0.0


def test_mistakes_would_show(case):
    """The generator measured how far deliberate mistakes move the logits; those the case is for are
    far beyond REL_TOL (std 0.3 weights: see the generator's docstring)."""
    gen = _generator()
    eff = case.meta["facts"]["mistake_max_abs_logit_change"]
    scale = case.meta["facts"]["max_abs_logit"]
    for mut in gen.CASES[case.name]["must_show"]:
        assert eff[mut] >= max(gen.MIN_MISTAKE_EFFECT, 10 * REL_TOL * scale), (mut, eff[mut])
    assert "lifted" in case.meta["shared_expert_clamp"]
    assert "LOWER" in case.meta["indexer_tie_rule"]


def test_case_tiny_has_no_tie_at_the_boundary():
    """Recorded in meta: how many decode steps had a tie at the indexer's top-k boundary in case tiny."""
    facts = (_CACHE.get("tiny") or Case("tiny")).meta["facts"]
    assert facts["index_boundary_ties"] == 0 and facts["index_topk_events"] > 0


def test_case_long_reaches_far_past_the_window_and_many_compressions():
    """Case `long`: the window wraps dozens of times, each compressed layer closes dozens of rows,
    the indexer chooses among many times more rows than it takes, and the rotary positions run far
    past YaRN's original length; floats are kept along the way and over the whole generation."""
    case = _CACHE.get("long") or Case("long")
    c, S, P = case.config, case.S, case.P
    assert S >= 384 and S >= 40 * c["sliding_window"] and S > 4 * c["rope_scaling"]["original_max_position_embeddings"]
    for kind in (CSA, HCA):
        rows = S // c["compress_rates"][kind]
        assert kind in c["layer_types"] and rows >= 24, (kind, rows)
    rows = case.a["n_compressed"][-1, case.csa]
    assert np.all(rows >= 20 * c["index_topk"])
    chosen = case.a["index_selected"][P:, :, :].ravel()
    assert chosen.max() >= 80, "the generation attends to recent compressed rows"
    assert len(np.unique(chosen)) >= 8 * c["index_topk"], "and to rows from all along the sequence"
    gaps = np.diff(case.steps)
    assert len(case.steps) < S and gaps.max() <= _generator().CASES["long"]["keep_every"]
