"""The attention and hyper-connection configuration (Geometry.attention) and its tensors.

config.json is read in either reader's words: the official release's (compress_ratios,
qk_rope_head_dim, rope_scaling, num_hash_layers) or transformers' (layer_types + compress_rates,
partial_rotary_factor, rope_parameters, mlp_layer_types); to_config() writes both. The synthetic
checkpoints carry every attention tensor with its official name, dtype and shape, and convert
keeps their bytes.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from ds4f.engine.checkpoint import open_checkpoint
from ds4f.engine.checkpoint.formats import dequantize_fp8, st_numpy_dtype
from ds4f.engine.checkpoint.safetensors_index import load_official_index
from ds4f.engine.checkpoint.tensors import (attention_layer_tensors, attention_tensors, attention_weight_bytes,
                                            official_tensors)
from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import (GEOMETRIES, AttentionGeometry, Geometry, Yarn, flash_schedule)

TINY = GEOMETRIES["tiny"]

# The reference doc's tiny transformers model (ds4f-whole-model.md), as transformers 5.24's
# DeepseekV4Config(...).save_pretrained() writes its config.json (generated in /work/fixture-venv;
# transformers is no test dependency): nested rope_parameters, mlp_layer_types, no num_hash_layers.
TRANSFORMERS_SAVED = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "compress_rope_theta": 160000, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "index_head_dim": 16, "index_n_heads": 8,
    "index_topk": 2, "initializer_range": 0.02,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "max_position_embeddings": 1024, "mlp_bias": False,
    "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe", "moe"],
    "model_type": "deepseek_v4", "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 5,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 2, "o_lora_rank": 16,
    "output_router_logits": False, "pad_token_id": None, "partial_rotary_factor": 0.25, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "compress": {"attention_factor": 1.0, "beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 64, "partial_rotary_factor": 0.25, "rope_theta": 160000,
                     "rope_type": "yarn"},
        "main": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"}},
    "rope_theta": 10000.0, "routed_scaling_factor": 1.5, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
    "scoring_func": "sqrtsoftplus", "sliding_window": 8, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "transformers_version": "5.24.0", "use_cache": True, "vocab_size": 256,
}
# The same model as the reference doc's constructor call writes it (flat rope_parameters).
TRANSFORMERS_KWARGS = {
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32,
    "partial_rotary_factor": 0.25, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 2, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "max_position_embeddings": 1024, "rope_theta": 1e4, "compress_rope_theta": 160000,
    "rope_parameters": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                        "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 0, "eos_token_id": 1,
}
# The same model in the official release's words: the trailing compress_ratios entry is the MTP layer's.
RELEASE = {
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 5,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "num_hash_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "o_groups": 2, "o_lora_rank": 16, "compress_ratios": [0, 0, 4, 8, 4, 0], "sliding_window": 8,
    "index_n_heads": 8, "index_head_dim": 16, "index_topk": 2, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "max_position_embeddings": 1024, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1},
    "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
}


def load(cfg: dict) -> Geometry:
    return Geometry.from_config(json.loads(json.dumps(cfg)), "my/config.json")


# ---- one model, three spellings ---------------------------------------------------------------------
def test_release_and_transformers_keys_give_the_same_model():
    g = load(TRANSFORMERS_SAVED)
    a = g.attention
    assert a.layer_kinds == ("swa", "swa", "csa", "hca", "csa") and a.layer_ratios == (0, 0, 4, 8, 4)
    assert [a.kind(i) for i in range(5)] == list(a.layer_kinds) and a.ratio(3) == 8 and a.hca_ratio == 8
    assert (a.n_heads, a.head_dim, a.q_lora_rank, a.o_groups, a.o_lora_rank, a.rope_dim) == (4, 32, 32, 2, 16, 8)
    assert (a.window, a.index_n_heads, a.index_head_dim, a.index_topk) == (8, 8, 16, 2)
    assert (a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.hc_mix) == (4, 20, 1e-6, 24)
    assert (a.rope_theta, a.compress_rope_theta) == (10000.0, 160000.0)
    assert a.yarn == Yarn(factor=16.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0)
    assert g.n_hash_layers == 3  # from mlp_layer_types (transformers writes no num_hash_layers)
    assert load(TRANSFORMERS_KWARGS) == g
    assert load(RELEASE) == g
    # and ds4f's own config.json of it reads back the same, as either reader's keys alone
    cfg = g.to_config()
    assert load(cfg) == g
    release_only = {k: v for k, v in cfg.items() if k not in ("layer_types", "compress_rates", "rope_parameters",
                                                                "partial_rotary_factor", "mlp_layer_types")}
    tf_only = {k: v for k, v in cfg.items() if k not in ("compress_ratios", "rope_scaling", "qk_rope_head_dim",
                                                           "num_hash_layers")}
    assert load(release_only) == g and load(tf_only) == g


def test_mtp_entries_beyond_the_layers_are_ignored():
    flash = GEOMETRIES["flash"]
    cfg = flash.to_config()
    cfg["compress_ratios"] = cfg["compress_ratios"] + [0]           # the release lists 44: the MTP layer last
    cfg["layer_types"] = cfg["layer_types"] + ["sliding_attention"]
    del cfg["mlp_layer_types"]
    assert load(cfg) == flash
    assert flash.attention.n_layers == 43 and flash.attention.layer_ratios[-1] == 4   # layer 42 is CSA


def test_kinds_follow_the_ratios_not_the_layer_numbers():
    """The schedule is read, never assumed: HCA first, CSA later, a sliding-window layer in between."""
    cfg = dict(RELEASE, compress_ratios=[8, 0, 4, 8, 4])
    a = load(cfg).attention
    assert a.layer_kinds == ("hca", "swa", "csa", "hca", "csa") and a.layers_of("csa") == (2, 4)
    cfg = dict(TRANSFORMERS_KWARGS, layer_types=["heavily_compressed_attention"] * 5,
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
    assert load(cfg).attention.layer_ratios == (16,) * 5


def test_transformers_defaults_for_the_constants():
    cfg = {k: v for k, v in RELEASE.items() if k not in ("hc_sinkhorn_iters", "hc_eps", "rope_theta",
                                                           "compress_rope_theta", "rope_scaling")}
    a = load(cfg).attention
    assert (a.hc_sinkhorn_iters, a.hc_eps, a.rope_theta, a.compress_rope_theta, a.yarn) == (20, 1e-6, 1e4, 1.6e5,
                                                                                             None)
    cfg = dict(TRANSFORMERS_KWARGS)
    del cfg["compress_rates"]   # transformers' default: CSA 4, HCA 128
    assert load(cfg).attention.layer_ratios == (0, 0, 4, 128, 4)


# ---- bad configs: one clear error each ----------------------------------------------------------------
def _edit(base: dict, **changes) -> dict:
    cfg = copy.deepcopy(base)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


BAD = [
    ("unknown kind", _edit(TRANSFORMERS_KWARGS, layer_types=["sliding_attention", "sliding_attention",
                                                              "global_attention", "sliding_attention",
                                                              "sliding_attention"]),
     r"layer_types\[2\] = 'global_attention': not one of sliding_attention, compressed_sparse_attention,"),
    ("short layer_types", _edit(TRANSFORMERS_KWARGS, layer_types=["sliding_attention"] * 4),
     r"layer_types has 4 entries, num_hidden_layers is 5"),
    ("short compress_ratios", _edit(RELEASE, compress_ratios=[0, 0, 4]),
     r"compress_ratios has 3 entries, num_hidden_layers is 5"),
    ("negative ratio", _edit(RELEASE, compress_ratios=[0, 0, -4, 8, 4]),
     r"compress_ratios\[2\] = -4: must be a non-negative integer"),
    ("fractional ratio", _edit(RELEASE, compress_ratios=[0, 0, 4, 8.5, 4]),
     r"compress_ratios\[3\] = 8\.5: must be a non-negative integer"),
    ("string ratio", _edit(RELEASE, compress_ratios=[0, 0, "4", 8, 4]),
     r"compress_ratios\[2\] = '4': must be a non-negative integer"),
    ("several HCA ratios", _edit(RELEASE, compress_ratios=[0, 0, 4, 8, 16]),
     r"compress_ratios: HCA layers with ratios \[8, 16\]"),
    ("CSA ratio not 4", _edit(TRANSFORMERS_KWARGS, compress_rates={"compressed_sparse_attention": 8,
                                                                   "heavily_compressed_attention": 8}),
     r"compress_rates\.compressed_sparse_attention = 8: must be 4"),
    ("HCA ratio 4", _edit(TRANSFORMERS_KWARGS, compress_rates={"compressed_sparse_attention": 4,
                                                               "heavily_compressed_attention": 4}),
     r"compress_rates\.heavily_compressed_attention = 4: must be a positive integer other than 4"),
    ("kinds and ratios disagree", _edit(TRANSFORMERS_KWARGS, compress_ratios=[0, 0, 4, 8, 8]),
     r"layer_types and compress_ratios disagree at layer 4: compressed_sparse_attention \(ratio 4\) vs"
     r" compress_ratios\[4\] = 8"),
    ("no schedule", _edit(RELEASE, compress_ratios=None),
     r"missing compress_ratios \(or layer_types\)"),
    ("o_groups not dividing heads", _edit(RELEASE, o_groups=3), r"o_groups = 3: must divide num_attention_heads \(4\)"),
    ("odd rope dim", _edit(RELEASE, qk_rope_head_dim=7), r"qk_rope_head_dim = 7: must be even"),
    ("rope dim > head_dim", _edit(RELEASE, qk_rope_head_dim=64, head_dim=32, index_head_dim=64),
     r"qk_rope_head_dim = 64: more than head_dim \(32\)"),
    ("rope dim > index_head_dim", _edit(RELEASE, qk_rope_head_dim=32, index_head_dim=16),
     r"qk_rope_head_dim = 32: more than index_head_dim \(16\)"),
    ("rope dims not whole", _edit(TRANSFORMERS_KWARGS, partial_rotary_factor=0.3),
     r"partial_rotary_factor = 0\.3: x head_dim \(32\) = 9\.6, not a whole number of dims"),
    ("rope dims disagree", _edit(RELEASE, partial_rotary_factor=0.5),
     r"qk_rope_head_dim = 8 but partial_rotary_factor = 0\.5 gives 16"),
    ("no rope dims", _edit(RELEASE, qk_rope_head_dim=None), r"missing qk_rope_head_dim \(or partial_rotary_factor\)"),
    ("missing heads", _edit(RELEASE, num_attention_heads=None),
     r"missing num_attention_heads \(the config describes attention"),
    ("zero heads", _edit(RELEASE, num_attention_heads=0), r"num_attention_heads = 0: must be a positive integer"),
    ("bool window", _edit(RELEASE, sliding_window=True), r"sliding_window = True: must be a positive integer"),
    ("negative hc_eps", _edit(RELEASE, hc_eps=-1e-6), r"hc_eps = -1e-06: must be a finite positive number"),
    ("other rope type", _edit(RELEASE, rope_scaling={"type": "linear", "factor": 4}),
     r"rope_scaling: rope type 'linear': DeepSeek-V4 uses plain RoPE or YaRN"),
    ("yarn without factor", _edit(RELEASE, rope_scaling={"type": "yarn", "original_max_position_embeddings": 64}),
     r"rope_scaling: missing factor"),
    ("yarn magnitude factor", _edit(TRANSFORMERS_KWARGS, rope_parameters=dict(
        TRANSFORMERS_KWARGS["rope_parameters"], attention_factor=1.277)),
     r"rope_parameters\.attention_factor = 1\.277: DeepSeek-V4 applies no YaRN magnitude factor"),
    ("rope keys disagree", _edit(RELEASE, rope_parameters={"rope_type": "yarn", "factor": 8,
                                                           "original_max_position_embeddings": 64}),
     r"rope_scaling and rope_parameters disagree"),
    ("yarn on the window layers", _edit(TRANSFORMERS_SAVED, rope_parameters={
        "main": TRANSFORMERS_SAVED["rope_parameters"]["compress"],
        "compress": TRANSFORMERS_SAVED["rope_parameters"]["compress"]}),
     r"rope_parameters\.main: YaRN on the sliding-window layers"),
    ("nested theta disagrees", _edit(TRANSFORMERS_SAVED, compress_rope_theta=10000),
     r"rope_parameters\.compress\.rope_theta = 160000 but compress_rope_theta = 10000: they disagree"),
    ("hash after moe", _edit(TRANSFORMERS_KWARGS, mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe", "moe"]),
     r"mlp_layer_types\[2\] = 'hash_moe' after a 'moe' layer"),
    ("hash layers disagree", _edit(TRANSFORMERS_KWARGS, num_hash_layers=1),
     r"num_hash_layers = 1 but mlp_layer_types has 3 hash_moe layers"),
]


@pytest.mark.parametrize("cfg,pattern", [(c, p) for _, c, p in BAD], ids=[n for n, _, _ in BAD])
def test_a_bad_config_is_one_clear_error(cfg, pattern):
    with pytest.raises(Ds4fError) as info:
        load(cfg)
    msg = str(info.value)
    assert msg.startswith("my/config.json: ") and "\n" not in msg
    assert re.search(pattern, msg), msg


def test_a_bad_config_in_a_checkpoint_is_one_line_from_the_cli(tiny_official, tmp_path):
    import subprocess
    import sys

    root = Path(shutil.copytree(tiny_official, tmp_path / "ck"))
    cfg = json.loads((root / "config.json").read_text())
    cfg["layer_types"][2] = "global_attention"
    (root / "config.json").write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, "-m", "ds4f.cli", "verify", str(root)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"{root / 'config.json'}: layer_types[2] = 'global_attention': not one of" in out.stderr


def test_constructed_settings_are_checked_too():
    with pytest.raises(Ds4fError, match=r"^attention geometry: o_groups = 3: must divide num_attention_heads"):
        AttentionGeometry(**{**_fields(TINY.attention), "o_groups": 3})
    with pytest.raises(Ds4fError, match=r"compress_ratios\[2\] = 8: layer 2 is compressed_sparse_attention, whose"
                                        r" ratio is 4"):
        AttentionGeometry(**{**_fields(TINY.attention), "layer_ratios": (0, 0, 8, 8)})
    with pytest.raises(Ds4fError, match=r"^geometry: compress_ratios / layer_types: 4 layers, but"
                                        r" num_hidden_layers = 5"):
        Geometry(**{**_fields(TINY), "n_layers": 5}, attention=TINY.attention)


def _fields(obj) -> dict:
    import dataclasses

    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


# ---- MoE-only configs, round trips, named geometries ---------------------------------------------------
def test_a_moe_only_config_loads_without_attention():
    """The config.json of an earlier ds4f synth (the MoE part only) still loads: attention None."""
    old = TINY.moe_config()
    assert not any(k in old for k in ("num_attention_heads", "compress_ratios", "layer_types", "hc_mult"))
    g = load(old)
    assert g.attention is None and g == TINY.replace(attention=None)
    assert g.to_config() == old                                    # written back exactly as before
    assert attention_tensors(g) == [] and attention_weight_bytes(g)["total"] == 0
    assert [t.name for t in official_tensors(g)] == [t.name for t in official_tensors(TINY)
                                                     if t.name not in {p.name for p in attention_tensors(TINY)}]


def test_to_config_round_trip_and_both_readers_keys():
    for name, g in GEOMETRIES.items():
        cfg = g.to_config()
        assert load(cfg) == g, name
        a = g.attention
        assert cfg["compress_ratios"] == list(a.layer_ratios) and cfg["qk_rope_head_dim"] == a.rope_dim
        assert cfg["layer_types"] == [{"swa": "sliding_attention", "csa": "compressed_sparse_attention",
                                       "hca": "heavily_compressed_attention"}[k] for k in a.layer_kinds]
        assert cfg["compress_rates"]["compressed_sparse_attention"] == 4
        assert cfg["partial_rotary_factor"] * a.head_dim == a.rope_dim
        assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_parameters"]["rope_type"] == "yarn"
        assert cfg["mlp_layer_types"].count("hash_moe") == cfg["num_hash_layers"] == g.n_hash_layers
        for k, v in g.moe_config().items():
            assert cfg[k] == v   # the MoE part is unchanged


def test_the_named_geometries_attention():
    f = GEOMETRIES["flash"].attention
    assert (f.n_heads, f.head_dim, f.q_lora_rank, f.o_groups, f.o_lora_rank, f.rope_dim, f.window) == \
        (64, 512, 1024, 8, 1024, 64, 128)
    assert (f.index_n_heads, f.index_head_dim, f.index_topk, f.hc_mult, f.hc_sinkhorn_iters, f.hc_eps) == \
        (64, 128, 512, 4, 20, 1e-6)
    assert (f.rope_theta, f.compress_rope_theta) == (10000.0, 160000.0)
    assert f.yarn == Yarn(16.0, 65536, 32.0, 1.0)
    assert f.layer_kinds[:2] == ("swa", "swa") and len(f.layers_of("csa")) == 21 and len(f.layers_of("hca")) == 20
    assert f.layers_of("csa") == tuple(range(2, 43, 2)) and f.hca_ratio == 128
    for name, kinds in (("demo", ("swa", "swa", "csa", "hca")),
                        ("bench", ("swa", "swa", "csa", "hca", "csa", "hca", "csa", "hca"))):
        a = GEOMETRIES[name].attention
        assert a.layer_kinds == kinds and a.layer_ratios == flash_schedule(len(kinds))[1]
        assert (a.n_heads, a.head_dim, a.q_lora_rank, a.index_topk, a.yarn) == (64, 512, 1024, 512, f.yarn)
    t = TINY.attention
    assert t.layer_kinds == ("swa", "swa", "csa", "hca") and t.layer_ratios == (0, 0, 4, 8)
    assert (t.n_heads, t.head_dim, t.q_lora_rank, t.o_groups, t.o_lora_rank, t.rope_dim, t.window) == \
        (4, 64, 64, 2, 32, 16, 8)
    assert (t.index_n_heads, t.index_head_dim, t.index_topk) == (4, 32, 2)


def test_replace_keeps_or_extends_the_schedule():
    assert TINY.replace(n_layers=2).attention.layer_kinds == ("swa", "swa")
    assert TINY.replace(n_layers=7).attention.layer_kinds == ("swa", "swa", "csa", "hca", "csa", "hca", "csa")
    assert TINY.replace(n_experts=8, top_k=2).attention == TINY.attention
    assert TINY.replace(attention=None).attention is None


def test_attention_weight_bytes_of_the_real_model():
    """The reference doc: attention + mHC weights 5.5 GB as shipped, 5.1 B parameters."""
    g = GEOMETRIES["flash"]
    total = attention_weight_bytes(g)
    assert total["total"] == pytest.approx(5.5e9, rel=0.02)
    params = sum(int(np.prod(t.shape)) for t in attention_tensors(g) if not t.name.endswith(".scale"))
    assert params == pytest.approx(5.1e9, rel=0.02)
    swa, csa, hca = (attention_weight_bytes(g, L) for L in (0, 2, 3))
    assert swa["F8_E4M3"] == 4096 * 1024 + 32768 * 1024 + 512 * 4096 + 8192 * 4096 + 4096 * 8192
    assert swa["F32"] == 4 * (2 * (24 * 16384 + 24 + 3) + 64)     # hc_attn_*, hc_ffn_*, attn_sink
    assert csa["BF16"] - swa["BF16"] == 2 * (2 * 1024 * 4096 + 512 + 64 * 4096 + 2 * 256 * 4096 + 128)
    assert hca["BF16"] - swa["BF16"] == 2 * (2 * 512 * 4096 + 512)
    assert hca["F32"] - swa["F32"] == 4 * 128 * 512                  # ape [128, 512]
    assert total["total"] == sum(attention_weight_bytes(g, L)["total"] for L in range(43)) + 4 * (4 * 16384 + 4 + 1)


# ---- the tensors of a synthetic checkpoint ---------------------------------------------------------------
def _decode(arr: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(arr).view(st_numpy_dtype(dtype)).astype(np.float64)


def test_synth_writes_every_attention_tensor(tiny_official):
    tensors, _ = load_official_index(Path(tiny_official))
    plans = attention_tensors(TINY)
    # SWA 19 (hc 6, five FP8 linears + scales, q_norm, kv_norm, sink), CSA +11, HCA +4, the head's 3
    assert len(plans) == 2 * 19 + 30 + 23 + 3 and len({p.name for p in plans}) == len(plans)
    with open_checkpoint(tiny_official) as ck:
        for p in plans:
            t = tensors[p.name]
            assert (t.dtype, tuple(t.shape)) == (p.dtype, p.shape), p.name
            arr = ck._read_tensor(p.name)
            if p.dtype == "F8_E4M3":
                w = dequantize_fp8(arr, ck._read_tensor(p.name[:-len(".weight")] + ".scale")).astype(np.float64)
                std = w.std()
                assert np.isfinite(w).all() and abs(std * np.sqrt(p.shape[1]) - 1) < 0.15, (p.name, std)
            elif p.dtype != "F8_E8M0":
                v = _decode(arr, p.dtype)
                assert np.isfinite(v).all() and np.abs(v).max() > 0, p.name
    # magnitudes: norms ~1, ape small, fn ~ 1/sqrt(N D), the comb bias favouring the diagonal
    with open_checkpoint(tiny_official) as ck:
        norm = _decode(ck._read_tensor("layers.2.attn.kv_norm.weight"), "BF16")
        assert abs(norm.mean() - 1) < 0.02
        assert _decode(ck._read_tensor("layers.3.attn.compressor.ape"), "F32").std() < 0.2
        fn = _decode(ck._read_tensor("layers.1.hc_attn_fn"), "F32")
        assert abs(fn.std() * np.sqrt(4 * TINY.hidden) - 1) < 0.1
        base = _decode(ck._read_tensor("layers.1.hc_ffn_base"), "F32")[8:].reshape(4, 4)
        assert (np.diag(base) > base.max(axis=1, initial=-np.inf, where=~np.eye(4, dtype=bool))).all()
        sink = _decode(ck._read_tensor("layers.0.attn.attn_sink"), "F32")
        assert sink.shape == (4,) and sink.std() > 0


def test_synth_attention_is_its_own_stream(tmp_path):
    """The attention tensors do not move the MoE tensors: a MoE-only synth of the same geometry and
    seed writes the same bytes for every tensor they share (tests/test_moe_golden.py's fingerprint
    checks the same against the fixtures)."""
    from ds4f.engine.checkpoint.synth import synth_checkpoint

    g = TINY.replace(n_experts=4, top_k=2, vocab=64)
    a = synth_checkpoint(tmp_path / "a", g, seed=5)
    b = synth_checkpoint(tmp_path / "b", g.replace(attention=None), seed=5)
    with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
        assert set(cb.tensors) < set(ca.tensors)
        assert set(ca.tensors) - set(cb.tensors) == {p.name for p in attention_tensors(g)}
        for name in cb.tensors:
            assert ca._read_tensor(name).tobytes() == cb._read_tensor(name).tobytes(), name
    # and the MoE-only checkpoint still opens, converts and verifies
    from ds4f.engine.checkpoint.convert import convert_checkpoint
    from ds4f.engine.checkpoint.verify import verify_checkpoint

    assert verify_checkpoint(convert_checkpoint(b, tmp_path / "bd", progress=False)) == []


def test_convert_keeps_every_attention_tensors_bytes(tiny_official, tiny_model):
    trunk = {t["name"]: t for t in json.loads((Path(tiny_model) / "trunk.json").read_text())["tensors"]}
    with open_checkpoint(tiny_official) as src, open_checkpoint(tiny_model) as dst:
        assert dst.geometry == src.geometry == TINY
        for L in range(TINY.n_layers):
            for p in attention_layer_tensors(TINY, L):
                t = trunk[p.name]
                assert t["region"] == f"extra.{L}" and (t["dtype"], tuple(t["shape"])) == (p.dtype, p.shape)
                assert dst.global_tensor(p.name).tobytes() == src._read_tensor(p.name).tobytes(), p.name
        for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            assert trunk[name]["region"] == "global"
            assert dst.global_tensor(name).tobytes() == src._read_tensor(name).tobytes()


# ---- the official reader's check ----------------------------------------------------------------------------
def _drop_from_index(root: Path, names: set[str]) -> None:
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in names}
    index_path.write_text(json.dumps(index))


def _without_header_entries(root: Path, names: set[str]) -> None:
    """Remove tensors from the shards' headers too (their bytes stay, unreferenced)."""
    import struct

    for shard in root.glob("model-*.safetensors"):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        if not names & set(header):
            continue
        header = {k: v for k, v in header.items() if k not in names}
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        shard.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def test_a_missing_attention_tensor_is_named(tiny_official, tmp_path):
    root = Path(shutil.copytree(tiny_official, tmp_path / "ck"))
    gone = {"layers.2.attn.indexer.compressor.ape"}
    _drop_from_index(root, gone)
    _without_header_entries(root, gone)
    with pytest.raises(Ds4fError, match=re.escape(f"{root / 'model.safetensors.index.json'}: no tensor"
                                                  f" layers.2.attn.indexer.compressor.ape (config.json's attention"
                                                  f" needs it: layer 2 is CSA, ratio 4)")):
        open_checkpoint(root)


def test_a_moe_only_release_under_an_attention_config(tiny_official, tmp_path):
    """All attention tensors missing: one message saying so, not one per tensor."""
    root = Path(shutil.copytree(tiny_official, tmp_path / "ck"))
    gone = {p.name for p in attention_tensors(TINY)}
    _drop_from_index(root, gone)
    _without_header_entries(root, gone)
    with pytest.raises(Ds4fError) as info:
        open_checkpoint(root)
    msg = str(info.value)
    assert msg.startswith(f"{root / 'model.safetensors.index.json'}: no attention tensors at all (none of the"
                          f" {len(gone)} that config.json's attention needs: layers.0.hc_attn_fn, ...)")
    assert "(and " not in msg


def test_a_wrong_attention_dtype_or_shape_is_named(tiny_official, tmp_path):
    import struct

    root = Path(shutil.copytree(tiny_official, tmp_path / "ck"))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    shard = root / index["weight_map"]["layers.3.attn.compressor.wkv.weight"]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["layers.3.attn.compressor.wkv.weight"]["dtype"] = "F16"   # same bytes, another dtype
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    shard.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    with pytest.raises(Ds4fError, match=re.escape(f"{shard}: layers.3.attn.compressor.wkv.weight: dtype F16,"
                                                  f" expected BF16")):
        open_checkpoint(root)


WHOLE_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "whole"


@pytest.mark.parametrize("case", ["tiny", "ties", "ratios"])
def test_the_transformers_fixtures_match_the_plan(case):
    """tests/fixtures/whole (written from transformers by tools/make_golden_whole.py, independently of
    this code): their config.json reads as the schedule transformers ran, and their safetensors hold
    exactly the tensors official_tensors plans, with its dtypes and shapes."""
    import struct

    d = WHOLE_FIXTURES / case
    if not (d / "config.json").is_file():
        pytest.skip(f"no fixture {d}")
    cfg = json.loads((d / "config.json").read_text())
    g = Geometry.from_config(cfg, str(d / "config.json"))
    kinds = {"sliding_attention": "swa", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    assert g.attention.layer_kinds == tuple(kinds[t] for t in cfg["layer_types"][:g.n_layers])
    raw = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
    plan = {p.name: p for p in official_tensors(g)}
    assert set(header) == set(plan)
    for name, p in plan.items():
        ok = {p.dtype} | ({"U8"} if p.dtype == "I8" else set())   # MXFP4 codes: I8 or U8, as the reader takes
        assert header[name]["dtype"] in ok and tuple(header[name]["shape"]) == p.shape, name
