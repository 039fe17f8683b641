#!/usr/bin/env python3
"""Whole-model golden fixtures from HF transformers' `DeepseekV4ForCausalLM` (fp32, eager).

Run by hand, in a venv with torch and transformers (not a ds4f or CI dependency), e.g. the one
of tools/make_golden_moe.py (torch==2.13.0 CPU, transformers==5.24.0, safetensors, ml_dtypes):

    REF=/tmp/venv-ref/bin/python                        # the reference venv (see make_golden_moe.py)
    $REF tools/make_golden_whole.py                     # every case
    $REF tools/make_golden_whole.py --case ties
    $REF tools/make_golden_whole.py --crosscheck DECODER.py   # also run an independent float64 numpy
                                                        # decoder of your own (see crosscheck())

It writes, per case, tests/fixtures/whole/<case>/:

- config.json: ONE file for both readers. The DeepseekV4Config fields the model is built from
  (layer_types, mlp_layer_types, compress_rates, rope_parameters, head_dim, ...) and the keys
  of the official release that ds4f reads (num_hash_layers, compress_ratios, qk_rope_head_dim,
  rope_scaling, hc_*, index_*, sliding_window, ...). The model used here is built FROM this
  file (`DeepseekV4Config.from_pretrained(case_dir)`); the script asserts that it equals the
  config built from the transformers fields alone (the release keys change nothing: with
  `layer_types` present the legacy `compress_ratios` list is ignored, `mlp_layer_types` wins
  over `num_hash_layers`, `partial_rotary_factor` over `qk_rope_head_dim`; `rope_scaling`
  REPLACES `rope_parameters` in transformers' loader, so both carry the same yarn numbers) and
  that every rotary table and the state_dict shapes are the same.
  Like the release, `num_nextn_predict_layers` = 1 and `compress_ratios` has one trailing
  entry (0) for the MTP layer: read its first num_hidden_layers entries. No mtp.* tensors
  are written (transformers ignores them, ds4f does not compute MTP), and no
  `quantization_config` (transformers would then build FP8 modules; the safetensors header
  carries the dtypes).
- model.safetensors: one shard (ds4f's reader takes a single model.safetensors without an
  index), every tensor under its OFFICIAL name (no `model.` prefix), in the official dtypes:
    routed experts  ffn.experts.E.w{1,3,2}.weight I8 (two E2M1 codes per byte, element 2i in
                    the low nibble) + .scale F8_E8M0 (one per 32 along K); OCP rule: a block's
                    exponent is floor(log2(amax)) - 2, codes round to the nearest E2M1 value
    FP8 linears     attn.{wq_a,wq_b,wkv,wo_a,wo_b}, attn.indexer.wq_b, ffn.shared_experts.w{1,2,3}:
                    .weight F8_E4M3 + .scale F8_E8M0 per 128x128 tile, scale 2^ceil(log2(amax/448))
                    (ds4f.engine.checkpoint.formats.quantize_fp8; this file keeps a copy, which
                    tests/test_whole_fixtures.py checks equals ds4f's)
    BF16            embed, head, norm, attn_norm, ffn_norm, attn.q_norm, attn.kv_norm,
                    attn.compressor.{wkv,wgate,norm}, attn.indexer.compressor.{wkv,wgate,norm},
                    attn.indexer.weights_proj, ffn.gate.weight
    F32             hc_attn_*, hc_ffn_*, hc_head_*, attn.attn_sink, attn.compressor.ape,
                    attn.indexer.compressor.ape, ffn.gate.bias
    I64             ffn.gate.tid2eid
  Sources for the attention dtypes: transformers' modeling_deepseek_v4.py
  (`_keep_in_fp32_modules`: "DeepSeek-V4-Flash checkpoints mix FP8 and BF16 in the attention
  compressor / indexer branch: these projections ship in BF16 with no companion scale_inv" =
  compressor and indexer-compressor kv_proj/gate_proj and indexer weights_proj; every other
  Linear, including indexer.wq_b, is FP8), and several independent ports' tables of the
  release's header (F8_E4M3 [8192, 1024] indexer.wq_b, F32 [4, 1024] / [128, 512]
  compressor.ape, F32 attn_sink, BF16 q_norm / kv_norm / compressor norms, F32 hc_*).
  Not verified against the release's own header here (no access): the BF16 of the main
  compressor's norm and the F32 of the main compressor's ape rest on those ports.
  antirez/ds4's GGUF stores indexer.wq_b as F16 and ape as F16: its own choice, not evidence.
- expected.npz: the reference run, byte-reproducible (see `ARRAYS_DOC` and the `meta` JSON):
  a prompt, 16 greedy tokens, token-by-token decode with transformers' DynamicCache (logits,
  hc state after every layer, attention sublayer output, routing, the indexer's scores and
  choice per CSA layer), and the logits of one full cache-less forward over the sequence.
  The `long` case runs 400 positions with a window of 8 and ratios 4 and 16 (the window wraps 50
  times, the indexer takes 4 of up to 100 compressed rows): it keeps the per-step float arrays
  (logits, hc state, attention output, indexer scores) at every 16th step and over the whole
  generation (`steps` says which), the tokens, routing and the indexer's choices at every step.

The SAME weights go into transformers: every tensor is drawn (numpy, seeded), quantised to its
official dtype, and the exact dequantised values (float32) are loaded into the model.

The shared expert's clamp: the official DeepSeek inference code clamps only the routed experts'
SwiGLU activations; transformers' DeepseekV4MLP (the shared expert) clamps too. ds4f follows the
official semantics, so every layer's `mlp.shared_experts.limit = inf` (as tools/make_golden_moe.py
does); the meta records how much the clamp would have changed the logits.

The indexer's tie rule: torch.topk's order among equal scores is undocumented (and a full
forward calls it on a longer, -inf padded row than decode does). ds4f's rule: among equal
scores the LOWER compressed-row index first. This script makes transformers follow it: while a
DeepseekV4Indexer runs, Tensor.topk is a stable descending sort (lower index first among
equals), for every case. The `ties` case zeroes all but one head of indexer.weights_proj, so a
row's score is exactly 0 whenever relu(q . k) is 0 for that head: exact ties at the top-k
boundary, asserted to occur in several steps, to matter (the reversed rule changes the
logits), and to be robust (|q . k| far from 0 for the active head).

Weights are large enough that mistakes show (std 0.3 matrices, like the notes' build_model(std
=0.3); routed experts 0.5 and the shared expert 0.6, so that both clamps change the logits): the
meta records how much the logits move under deliberate mistakes (Sinkhorn starting with rows, no
hc_eps on pre, the shared expert clamped, the routed experts unclamped), those of the case's
`must_show` asserted > 1e-2. A missing hc_eps on pre moves the logits by only ~1e-4 with eps 1e-6
(tiny, ties), so the `ratios` case uses hc_eps 1e-2 and rms_norm_eps 1e-3.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import math
import re
import struct
import sys
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "whole"
GENERATOR_VERSION = 1

# ---- the cases --------------------------------------------------------------------------------
# transformers DeepseekV4Config fields; the release keys are derived from them (release_keys).
TINY = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32,
    "partial_rotary_factor": 0.25, "o_groups": 2, "o_lora_rank": 16,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 2,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                        "beta_fast": 32.0, "beta_slow": 1.0},
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}
# other small ratios and sizes: HCA 16, an odd window, top-k 3, 8 heads (wq_b and indexer.wq_b
# span two 128-row FP8 tiles), o_groups 4, one hash layer, a different YaRN factor and original length
RATIOS = dict(TINY, **{
    "num_hidden_layers": 4, "num_attention_heads": 8, "o_groups": 4, "o_lora_rank": 16,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 5, "index_n_heads": 16, "index_topk": 3, "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                        "beta_fast": 32.0, "beta_slow": 1.0},
    # large, distinct epsilons: an engine that hard-codes 1e-6, drops hc_eps from pre, or uses one
    # eps for the other (the hc input norm takes rms_norm_eps) gets visibly different logits
    "hc_eps": 1e-2, "rms_norm_eps": 1e-3,
})

# long positions: a window of 8 and ratios 4 and 16 over 400 positions, so the window wraps 50 times,
# the CSA layers hold 100 compressed rows and the indexer picks its 4 among up to 100 of them, the
# HCA layer 25 rows, and the compressed layers' YaRN runs far past its original length of 64
LONG = dict(TINY, **{
    "vocab_size": 128, "num_hidden_layers": 3,
    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 8, "index_topk": 4, "max_position_embeddings": 1024,
})

CASES: dict[str, dict] = {
    "tiny": {"config": TINY, "seed": 100, "prompt_len": 13, "gen": 16, "ties": None,
             "must_show": ["sinkhorn_rows_first", "shared_expert_clamped", "routed_experts_unclamped"],
             "note": "the reference doc's tiny config; no exact tie at the indexer's top-k boundary"},
    "ties": {"config": TINY, "seed": 200, "prompt_len": 13, "gen": 16, "ties": {"active_head": 3, "min_ties": 4},
             "must_show": ["sinkhorn_rows_first", "shared_expert_clamped", "routed_experts_unclamped"],
             "note": "tiny config, indexer.weights_proj zero except one head: exact ties at the top-k boundary"},
    "ratios": {"config": RATIOS, "seed": 300, "prompt_len": 20, "gen": 16, "ties": None,
               "must_show": ["sinkhorn_rows_first", "no_pre_eps", "shared_expert_clamped", "routed_experts_unclamped"],
               "note": "HCA ratio 16, window 5, index_topk 3, 8 heads / 16 indexer heads (two FP8 row tiles), "
                       "hc_eps 1e-2 and rms_norm_eps 1e-3"},
    # keep_every: the per-step float arrays (STEP_ARRAYS) are kept at every keep_every-th step and at
    # every step from the last prompt token on (`steps`), so the files stay small; the rest at every step
    "long": {"config": LONG, "seed": 400, "prompt_len": 384, "gen": 16, "ties": None, "keep_every": 16,
             "must_show": ["sinkhorn_rows_first", "shared_expert_clamped", "routed_experts_unclamped"],
             "note": "long positions: 400 steps with window 8, CSA ratio 4 (index_topk 4 of up to 100 rows), "
                     "HCA ratio 16, YaRN original length 64"},
}
MAX_ATTEMPTS = 40  # seeds tried per case (seed, seed+1, ...) until every quality criterion holds

# quality criteria of a fixture (fp32 engines must not be asked to break near-ties)
MIN_GREEDY_GAP = 1e-2       # top-1 minus top-2 logit at every generating step
MIN_ROUTE_GAP = 1e-3        # learned layers: k-th minus (k+1)-th biased router score
MIN_INDEX_GAP_REL = 1e-4    # indexer: k-th minus (k+1)-th score / max|score|, where they differ
MIN_RELU_MARGIN = 1e-3      # ties case: min |q_h . k_t| of the active head (exact zeros are robust)
DECODE_VS_FULL_REL = 1e-4   # decode logits vs full-forward logits, relative to max|logit|
MAX_ABS_LOGIT = 60.0
MIN_MISTAKE_EFFECT = 1e-2   # a case's "must_show" mistakes move some logit by at least this

# weight distribution (numpy, per tensor seeded by (seed, crc32(name)))
STD = 0.3          # every matrix, except:
EXPERT_STD = 0.5   # routed experts (gate_up_proj, down_proj): some gate/up pre-activations pass swiglu_limit
SHARED_STD = 0.6   # the shared expert: its (lifted) clamp would change the logits
EMBED_STD = 1.0    # the token embedding
NORM_SPREAD = 0.25 # RMSNorm weights: 1 + this x N(0, 1)
SINK_STD = 1.0
APE_STD = 0.5
HC_BASE_STD = 0.5
HC_SCALE_SPREAD = 0.5  # hc scale: 1 + this x N(0, 1)
ROUTER_BIAS_STD = 0.2

ARRAYS_DOC = {
    "tokens": "int64 [S]: the prompt (tokens[:prompt_len], BOS first) then the greedy tokens",
    "prompt_len": "int64 scalar P",
    "steps": "int64 [N]: the steps the per-step float arrays hold, in order (row i is step steps[i]): "
             "every step (N = S), or for a case with keep_every every keep_every-th step and every step from "
             "P-1 on. Files without it hold every step",
    "logits_decode": "float32 [N, V]: logits after feeding tokens[t] at position t, token by token with "
                     "transformers' DynamicCache (row t predicts token t+1)",
    "logits_full": "float32 [N, V]: one cache-less forward over all S tokens",
    "greedy": "int64 [S]: argmax of logits_decode (lowest id among equal logits); tokens[t+1] == greedy[t] "
              "for t >= P-1",
    "hc_state": "float32 [N, L, hc_mult, hidden]: the hyper-connection state after each decoder layer "
                "(both sublayers), at each step",
    "attn_out": "float32 [N, L, hidden]: the attention sublayer's output (o_b projection, before the hc post "
                "mix), at each step",
    "route_ids": "int64 [S, L, k]: selected experts, rank order: hash layers as tid2eid[token], learned "
                 "layers by biased score (sqrtsoftplus(logit) + bias) descending",
    "route_weights": "float32 [S, L, k]: routing weights aligned with route_ids (sum = routed_scaling_factor)",
    "route_gap": "float64 [S, L]: learned layers: k-th minus (k+1)-th biased score; hash layers: inf",
    "n_compressed": "int64 [S, L]: compressed rows the layer's attention can see at step t: "
                    "(t+1)//ratio (CSA, HCA), 0 (sliding)",
    "index_layers": "int64 [C]: the CSA layers, in order (the index_* arrays' second axis)",
    "index_scores": "float32 [N, C, S//4]: the indexer's score of every compressed row at step t "
                    "(NaN past n_compressed)",
    "index_selected": "int64 [S, C, index_topk]: the rows attended to, in selection order (score descending, "
                      "lower row index first among equal scores); -1 padding when fewer rows exist",
    "index_boundary_tie": "bool [S, C]: index_topk < rows and the k-th and (k+1)-th scores are equal",
    "index_boundary_gap": "float64 [S, C]: (k-th minus (k+1)-th score) / max|score| when index_topk < rows, "
                          "else NaN",
    "index_relu_margin": "float64 [S, C]: min over rows and over heads with a nonzero weight of |q_h . k_t| "
                         "(how far the relu is from flipping); NaN without rows",
}

STEP_ARRAYS = ("logits_decode", "logits_full", "hc_state", "attn_out", "index_scores")


def kept_steps(case: dict, prompt_len: int, total: int) -> np.ndarray:
    """The steps whose STEP_ARRAYS rows a case keeps (see `keep_every`)."""
    every = case.get("keep_every")
    if every is None:
        return np.arange(total, dtype=np.int64)
    return np.array(sorted(set(range(every - 1, total, every)) | set(range(prompt_len - 1, total))), np.int64)


def keep_steps(arrays: dict, case: dict) -> dict:
    """The arrays with STEP_ARRAYS cut to the kept steps, and `steps` saying which they are."""
    steps = kept_steps(case, int(arrays["prompt_len"]), len(arrays["tokens"]))
    return dict(arrays, steps=steps, **{name: arrays[name][steps] for name in STEP_ARRAYS})


# ---- official names -------------------------------------------------------------------------
TO_OFFICIAL = [  # transformers name (regex) -> official name (verified by the notes' check_name_mapping.py)
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"layers.\1.attn_norm.weight"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"layers.\1.ffn_norm.weight"),
    (r"^model\.layers\.(\d+)\.attn_hc\.(fn|base|scale)$", r"layers.\1.hc_attn_\2"),
    (r"^model\.layers\.(\d+)\.ffn_hc\.(fn|base|scale)$", r"layers.\1.hc_ffn_\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_a_proj\.weight$", r"layers.\1.attn.wq_a.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_a_norm\.weight$", r"layers.\1.attn.q_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_b_proj\.weight$", r"layers.\1.attn.wq_b.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_proj\.weight$", r"layers.\1.attn.wkv.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_norm\.weight$", r"layers.\1.attn.kv_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_a_proj\.weight$", r"layers.\1.attn.wo_a.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_b_proj\.weight$", r"layers.\1.attn.wo_b.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.sinks$", r"layers.\1.attn.attn_sink"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.q_b_proj\.weight$", r"layers.\1.attn.indexer.wq_b.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight$",
     r"layers.\1.attn.indexer.weights_proj.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.kv_proj\.weight$", r"layers.\1.attn.indexer.compressor.wkv.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.gate_proj\.weight$",
     r"layers.\1.attn.indexer.compressor.wgate.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.kv_norm\.weight$",
     r"layers.\1.attn.indexer.compressor.norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.position_bias$", r"layers.\1.attn.indexer.compressor.ape"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.kv_proj\.weight$", r"layers.\1.attn.compressor.wkv.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.gate_proj\.weight$", r"layers.\1.attn.compressor.wgate.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.kv_norm\.weight$", r"layers.\1.attn.compressor.norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.position_bias$", r"layers.\1.attn.compressor.ape"),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.weight$", r"layers.\1.ffn.gate.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"layers.\1.ffn.gate.bias"),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.tid2eid$", r"layers.\1.ffn.gate.tid2eid"),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.weight$", r"layers.\1.ffn.shared_experts.w1.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.weight$", r"layers.\1.ffn.shared_experts.w3.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.weight$", r"layers.\1.ffn.shared_experts.w2.weight"),
]
FP8_LINEARS = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
F32_NAMES = re.compile(r"^(hc_head_(fn|base|scale)|layers\.\d+\.(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|"
                       r"attn\.(indexer\.)?compressor\.ape|ffn\.gate\.bias))$")


def official_name(tname: str) -> str:
    for pat, rep in TO_OFFICIAL:
        if re.match(pat, tname):
            return re.sub(pat, rep, tname)
    raise KeyError(f"no official name for {tname}")


def official_dtype(oname: str) -> str:
    """The shipped dtype of a non-expert tensor, by official name (the docstring's table)."""
    if FP8_LINEARS.match(oname):
        return "F8_E4M3"
    if F32_NAMES.match(oname):
        return "F32"
    if oname.endswith(".tid2eid"):
        return "I64"
    return "BF16"


# ---- the config file --------------------------------------------------------------------------
RATIO_OF = {"sliding_attention": 0}


def release_keys(cfg: dict) -> dict:
    """The official release's keys, derived from the transformers fields."""
    rates = cfg["compress_rates"]
    ratios = [0 if t == "sliding_attention" else rates[t] for t in cfg["layer_types"]]
    ratios += [0] * cfg["num_nextn_predict_layers"]  # the release lists the MTP layer too (0)
    n_hash = sum(t == "hash_moe" for t in cfg["mlp_layer_types"])
    assert cfg["mlp_layer_types"][:n_hash] == ["hash_moe"] * n_hash, "hash layers must come first"
    rp = cfg["rope_parameters"]
    return {
        "num_hash_layers": n_hash,
        "compress_ratios": ratios,
        "qk_rope_head_dim": int(cfg["head_dim"] * cfg["partial_rotary_factor"]),
        "rope_scaling": {"type": rp["rope_type"], "factor": rp["factor"],
                         "original_max_position_embeddings": rp["original_max_position_embeddings"],
                         "beta_fast": rp["beta_fast"], "beta_slow": rp["beta_slow"]},
        "topk_method": "noaux_tc",
        "expert_dtype": "fp4",
    }


def config_json(case: dict) -> dict:
    cfg = copy.deepcopy(case["config"])
    cfg.update(release_keys(cfg))
    return cfg


# ---- number formats (numpy) -----------------------------------------------------------------
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E2M1_MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_fp8(w: np.ndarray, tile: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """float32 [r, c] -> (E4M3 [r, c], E8M0 tiles): per tile scale 2^ceil(log2(amax/448)).
    A copy of ds4f.engine.checkpoint.formats.quantize_fp8 (ds4f is not importable here); the
    test checks the two agree."""
    r, c = w.shape
    R, C = -(-r // tile), -(-c // tile)
    pad = np.zeros((R * tile, C * tile), np.float32)
    pad[:r, :c] = w
    amax = np.abs(pad.reshape(R, tile, C, tile)).max(axis=(1, 3))
    amax = np.maximum(amax, np.float32(2.0 ** -100))
    e = np.ceil(np.log2(amax / 448.0)).astype(np.int32)
    e = np.clip(e, -127, 127)
    scale_bytes = (e + 127).astype(np.uint8)
    inv = np.ldexp(np.float32(1.0), -e).astype(np.float32)
    inv_full = np.repeat(np.repeat(inv, tile, axis=0), tile, axis=1)[:r, :c]
    q = (w * inv_full).astype(E4M3)
    return q, scale_bytes.view(E8M0)


def dequantize_fp8(q: np.ndarray, s: np.ndarray, tile: int = 128) -> np.ndarray:
    v = np.asarray(q).view(E4M3).astype(np.float64)
    sc = np.asarray(s).view(E8M0).astype(np.float64)
    r, c = v.shape
    return (v * np.repeat(np.repeat(sc, tile, axis=0), tile, axis=1)[:r, :c]).astype(np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, k] -> (I8 [rows, k/2] codes, element 2i in the low nibble; E8M0 [rows, k/32]).
    OCP: block exponent floor(log2(amax)) - 2; each element the nearest E2M1 value (lower
    magnitude on a tie, 6 at most); amax 0 -> scale 1, codes 0."""
    rows, k = w.shape
    assert k % 32 == 0
    b = w.astype(np.float64).reshape(rows, k // 32, 32)
    amax = np.abs(b).max(axis=-1)
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, 0).astype(np.int64)
    e = np.clip(e, -126, 127)
    y = np.abs(b) / np.exp2(e)[..., None]
    mag = np.abs(y[..., None] - E2M1_MAGS).argmin(axis=-1).astype(np.uint8)
    codes = np.where((b < 0) & (mag > 0), mag | 8, mag).astype(np.uint8).reshape(rows, k)
    packed = (codes[:, 0::2] & 0x0F) | ((codes[:, 1::2] & 0x0F) << 4)
    return packed.astype(np.uint8).view(np.int8), (e + 127).astype(np.uint8).view(E8M0)


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Decoded with ml_dtypes' float4_e2m1fn (independent of the table used to quantise)."""
    bts = np.asarray(packed).view(np.uint8)
    rows, half = bts.shape
    codes = np.empty((rows, 2 * half), np.uint8)
    codes[:, 0::2] = bts & 0x0F
    codes[:, 1::2] = bts >> 4
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = np.asarray(scales).view(E8M0).astype(np.float64)
    return (vals.reshape(rows, -1, 32) * s[:, :, None]).reshape(rows, 2 * half).astype(np.float32)


def to_bf16(w: np.ndarray) -> np.ndarray:
    return np.asarray(w, np.float32).astype(ml_dtypes.bfloat16)


# ---- fingerprints ------------------------------------------------------------------------------
ST_NUMPY = {"BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"), "I64": np.dtype("<i8"),
            "I8": np.dtype(np.int8), "F8_E4M3": E4M3, "F8_E8M0": E8M0}


def read_safetensors(path: Path) -> dict[str, tuple[str, tuple, bytes]]:
    """name -> (dtype code, shape, raw bytes), with a minimal header parser (no library)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b0, b1 = info["data_offsets"]
        out[name] = (info["dtype"], tuple(info["shape"]), data[8 + n + b0:8 + n + b1])
    return out


def fixture_fingerprint(case_dir: Path) -> str:
    """sha256 over config.json (canonical JSON) and every tensor's (name, dtype, shape, bytes),
    by name: independent of the safetensors header layout and of JSON formatting."""
    case_dir = Path(case_dir)
    h = hashlib.sha256()
    h.update(f"ds4f-golden-whole-fingerprint/{GENERATOR_VERSION}\n".encode())
    h.update(json.dumps(json.loads((case_dir / "config.json").read_text()), sort_keys=True).encode() + b"\n")
    for name, (dtype, shape, raw) in sorted(read_safetensors(case_dir / "model.safetensors").items()):
        h.update(f"{name} {dtype} {list(shape)} {len(raw)}\n".encode())
        h.update(raw)
    return h.hexdigest()


def recipe_hash(case_name: str) -> str:
    """sha256 of what a case is made from: the case spec, the weight distribution, the criteria.
    The test compares it with the fixture's meta: a changed recipe means stale fixtures."""
    recipe = {
        "version": GENERATOR_VERSION, "case": case_name, "spec": CASES[case_name], "max_attempts": MAX_ATTEMPTS,
        "dist": [STD, EXPERT_STD, SHARED_STD, EMBED_STD, NORM_SPREAD, SINK_STD, APE_STD, HC_BASE_STD,
                 HC_SCALE_SPREAD, ROUTER_BIAS_STD],
        "criteria": [MIN_MISTAKE_EFFECT, MIN_GREEDY_GAP, MIN_ROUTE_GAP, MIN_INDEX_GAP_REL, MIN_RELU_MARGIN,
                     DECODE_VS_FULL_REL, MAX_ABS_LOGIT],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed, but byte-reproducible (fixed zip timestamps, sorted members)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


# ---- the weights ------------------------------------------------------------------------------
def draw_weights(shapes: dict[str, tuple], cfg: dict, seed: int, ties: dict | None) -> dict[str, np.ndarray]:
    """transformers name -> float32 (or int64) array, drawn from the distribution above."""
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("tid2eid"):
            v = np.stack([rng.permutation(cfg["n_routed_experts"])[:cfg["num_experts_per_tok"]]
                          for _ in range(shape[0])]).astype(np.int64)
        elif name == "model.embed_tokens.weight":
            v = EMBED_STD * rng.standard_normal(shape)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            v = 1.0 + NORM_SPREAD * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            v = ROUTER_BIAS_STD * rng.standard_normal(shape)
        elif name.endswith("self_attn.sinks"):
            v = SINK_STD * rng.standard_normal(shape)
        elif name.endswith("position_bias"):
            v = APE_STD * rng.standard_normal(shape)
        elif leaf in ("base", "hc_base"):
            v = HC_BASE_STD * rng.standard_normal(shape)
        elif leaf in ("scale", "hc_scale"):
            v = 1.0 + HC_SCALE_SPREAD * rng.standard_normal(shape)
        elif ".mlp.experts." in name:
            v = EXPERT_STD * rng.standard_normal(shape)
        elif ".mlp.shared_experts." in name:
            v = SHARED_STD * rng.standard_normal(shape)
        else:
            assert len(shape) >= 2, name
            v = STD * rng.standard_normal(shape)
        if ties is not None and name.endswith("scorer.weights_proj.weight"):
            keep = np.zeros(shape[0], bool)
            keep[ties["active_head"]] = True
            v = np.where(keep[:, None], v, 0.0)
        out[name] = v if v.dtype == np.int64 else v.astype(np.float32)
    return out


def quantise_all(w: dict[str, np.ndarray], cfg: dict) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(official name -> array in its shipped dtype, transformers name -> exact dequantised float32)."""
    official: dict[str, np.ndarray] = {}
    deq: dict[str, np.ndarray] = {}
    inter = cfg["moe_intermediate_size"]
    for name, v in w.items():
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m:
            layer, what = m.groups()
            out = np.empty_like(v)
            for e in range(v.shape[0]):
                parts = ([("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter))] if what == "gate_up_proj"
                         else [("w2", slice(None))])
                for wname, rows in parts:
                    q, s = quantize_mxfp4(v[e, rows])
                    official[f"layers.{layer}.ffn.experts.{e}.{wname}.weight"] = q
                    official[f"layers.{layer}.ffn.experts.{e}.{wname}.scale"] = s
                    out[e, rows] = dequantize_mxfp4(q, s)
            deq[name] = out
            continue
        oname = official_name(name)
        dt = official_dtype(oname)
        if dt == "F8_E4M3":
            q, s = quantize_fp8(v)
            official[oname] = q
            official[oname[:-len(".weight")] + ".scale"] = s
            d = dequantize_fp8(q, s)
        elif dt == "BF16":
            official[oname] = to_bf16(v)
            d = official[oname].astype(np.float32)
        elif dt == "F32":
            official[oname] = v.astype(np.float32)
            d = official[oname]
        else:
            official[oname] = v.astype(np.int64)
            d = official[oname]
        if d.dtype != np.int64:
            assert np.all(np.isfinite(d)), name
        deq[name] = d
    return official, deq


def save_official(official: dict[str, np.ndarray], path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    views = {np.dtype(ml_dtypes.bfloat16): (np.uint16, torch.bfloat16), E4M3: (np.uint8, torch.float8_e4m3fn),
             E8M0: (np.uint8, torch.float8_e8m0fnu)}
    tensors = {}
    for name, a in official.items():
        a = np.ascontiguousarray(a)
        if a.dtype in views:
            raw, tdt = views[a.dtype]
            tensors[name] = torch.from_numpy(a.view(raw).copy()).view(tdt)
        else:
            tensors[name] = torch.from_numpy(a.copy())
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


# ---- transformers: the model and its patches ---------------------------------------------------
class TieRule:
    """While a DeepseekV4Indexer runs, Tensor.topk is a stable descending sort: among equal
    scores the lower row index first ("lower"), or the higher one ("higher", to show that the
    rule matters), or torch's own topk (None)."""
    rule: str | None = "lower"


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    import torch

    assert largest and dim in (-1, self.dim() - 1)
    if TieRule.rule == "higher":
        flipped = self.flip(-1)
        vals, idx = torch.sort(flipped, dim=-1, descending=True, stable=True)
        idx = self.shape[-1] - 1 - idx
    else:
        vals, idx = torch.sort(self, dim=-1, descending=True, stable=True)
    return torch.return_types.topk((vals[..., :k], idx[..., :k]))


def install_patches():
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

    if getattr(mdl.DeepseekV4Indexer, "_ds4f_patched", False):
        return
    orig = mdl.DeepseekV4Indexer.forward

    def forward(self, *args, **kwargs):
        if TieRule.rule is None:
            return orig(self, *args, **kwargs)
        saved = torch.Tensor.topk
        torch.Tensor.topk = _stable_topk
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = saved

    mdl.DeepseekV4Indexer.forward = forward
    mdl.DeepseekV4Indexer._ds4f_patched = True


class Mutation:
    """Deliberate mistakes in the hyper-connection, to measure that the fixture notices them."""
    name: str | None = None


def install_hc_mutations():
    import torch
    import torch.nn.functional as F
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

    if getattr(mdl.DeepseekV4HyperConnection, "_ds4f_patched", False):
        return
    orig = mdl.DeepseekV4HyperConnection.forward

    def forward(self, hidden_streams):
        if Mutation.name is None:
            return orig(self, hidden_streams)
        b, s = hidden_streams.shape[:2]
        hc = self.hc_mult
        x = F.linear(self.input_norm(hidden_streams.view(b, s, -1).float()), self.fn.float())
        pre_w, post_w, comb_w = x.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        ps, qs, cs = self.scale.unbind(0)
        eps_pre = 0.0 if Mutation.name == "no_pre_eps" else self.hc_eps
        pre = torch.sigmoid(pre_w * ps + pre_b) + eps_pre
        post = 2 * torch.sigmoid(post_w * qs + post_b)
        comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], hc, hc) * cs + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        a0, a1 = (-1, -2) if Mutation.name == "sinkhorn_rows_first" else (-2, -1)
        comb = comb / (comb.sum(dim=a0, keepdim=True) + self.hc_eps)
        for _ in range(self.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=a1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=a0, keepdim=True) + self.hc_eps)
        return post, comb, (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)

    mdl.DeepseekV4HyperConnection.forward = forward
    mdl.DeepseekV4HyperConnection._ds4f_patched = True


def load_config(case_dir: Path, fields: dict):
    """DeepseekV4Config from the case's config.json; asserted equal to the one from the transformers
    fields alone (the release keys must change nothing)."""
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config.from_pretrained(str(case_dir))
    same = DeepseekV4Config.from_dict(json.loads((case_dir / "config.json").read_text()))
    strip = lambda d: {k: v for k, v in d.items() if k not in ("_name_or_path", "transformers_version")}  # noqa: E731
    assert strip(same.to_dict()) == strip(cfg.to_dict()), "from_dict and from_pretrained disagree"
    # a deep copy: transformers' rope standardisation writes into the nested rope_parameters dict
    ref = DeepseekV4Config(**{k: copy.deepcopy(v) for k, v in fields.items() if k not in ("architectures", "model_type")})
    a, b = ref.to_dict(), cfg.to_dict()

    def norm_rope(rp):
        return {k: {kk: vv for kk, vv in v.items() if kk != "type"} for k, v in rp.items()}

    diffs = []
    for k in sorted(set(a) | set(b)):
        if k in ("transformers_version", "_name_or_path", "architectures"):
            continue
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if k == "rope_parameters":
            va, vb = norm_rope(va), norm_rope(vb)
        if va != vb and not (k in release_keys(fields) and va == "<absent>"):
            diffs.append(f"{k}: {va!r} != {vb!r}")
    assert not diffs, "config.json builds a different DeepseekV4Config:\n" + "\n".join(diffs)
    for c in (cfg, ref):
        c._attn_implementation = "eager"
        c._experts_implementation = "eager"
    return cfg, ref


def build_model(cfg, deq: dict[str, np.ndarray]):
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).to(torch.float32).eval()
    sd = model.state_dict()
    assert set(sd) == set(deq), (sorted(set(sd) ^ set(deq)))
    with torch.no_grad():
        for name, t in sd.items():
            src = torch.from_numpy(np.ascontiguousarray(deq[name]))
            assert tuple(src.shape) == tuple(t.shape), name
            t.copy_(src.to(t.dtype))
    # Official semantics: only the routed experts clamp; transformers' DeepseekV4MLP (the shared
    # expert) would clamp too. Lift its limit so both sides compute the same function.
    for layer in model.model.layers:
        layer.mlp.shared_experts.limit = math.inf
        assert layer.mlp.experts.limit == cfg.swiglu_limit
    return model


def same_model(cfg, ref) -> None:
    """The two configs build identical modules: state_dict shapes and every rotary table."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    ma, mb = DeepseekV4ForCausalLM(cfg), DeepseekV4ForCausalLM(ref)
    sa, sb = ma.state_dict(), mb.state_dict()
    assert {k: tuple(v.shape) for k, v in sa.items()} == {k: tuple(v.shape) for k, v in sb.items()}
    ba = {n: b for n, b in ma.named_buffers() if "inv_freq" in n}
    bb = {n: b for n, b in mb.named_buffers() if "inv_freq" in n}
    assert ba.keys() == bb.keys() and ba
    for n in ba:
        assert torch.equal(ba[n], bb[n]), n
    for (na, a), (nb, b) in zip(ma.named_modules(), mb.named_modules()):
        if type(a).__name__ == "DeepseekV4RotaryEmbedding":
            for attr in dir(a):
                if attr.endswith("attention_scaling"):
                    assert getattr(a, attr) == getattr(b, attr), (na, attr)


class Recorder:
    def __init__(self, model, cfg):
        self.on = False
        self.cfg = cfg
        L = cfg.num_hidden_layers
        self.csa = [i for i, t in enumerate(cfg.layer_types) if t == "compressed_sparse_attention"]
        self.step: dict = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.register_forward_hook(self._hook("hc", i)))
            self.handles.append(layer.self_attn.register_forward_hook(self._hook("attn", i)))
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook("gate", i)))
            if i in self.csa:
                ix = layer.self_attn.compressor.indexer
                self.handles.append(ix.scorer.register_forward_hook(self._hook("scorer", i)))
                self.handles.append(ix.register_forward_hook(self._hook("indexer", i)))
        assert L == len(model.model.layers)

    def _hook(self, kind, i):
        def hook(mod, args, out):
            if self.on:
                self.step[(kind, i)] = (mod, args, out)
        return hook


def sqrtsoftplus(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.logaddexp(0.0, x))


def run_case(name: str, case: dict, case_dir: Path, seed: int) -> tuple[dict, dict]:
    """Writes config.json and model.safetensors; returns (arrays, facts) of the reference run."""
    import torch

    fields = case["config"]
    cfgj = config_json(case)
    case_dir.mkdir(parents=True, exist_ok=True)
    (case_dir / "config.json").write_text(json.dumps(cfgj, indent=2, sort_keys=True) + "\n")
    cfg, ref = load_config(case_dir, fields)
    same_model(cfg, ref)

    # shapes from a throwaway model, then our own weights
    torch.manual_seed(0)
    from transformers import DeepseekV4ForCausalLM
    shapes = {k: tuple(v.shape) for k, v in DeepseekV4ForCausalLM(cfg).state_dict().items()}
    w = draw_weights(shapes, fields, seed, case["ties"])
    official, deq = quantise_all(w, fields)
    save_official(official, case_dir / "model.safetensors")
    model = build_model(cfg, deq)
    assert model.config._experts_implementation == "eager" and model.config._attn_implementation == "eager"

    V, L, hc, D = cfg.vocab_size, cfg.num_hidden_layers, cfg.hc_mult, cfg.hidden_size
    K, k_exp = cfg.index_topk, cfg.num_experts_per_tok
    P, G = case["prompt_len"], case["gen"]
    S = P + G
    rng = np.random.default_rng([seed, 7])
    prompt = [cfg.bos_token_id] + [int(t) for t in rng.integers(2, V, P - 1)]
    rec = Recorder(model, cfg)
    ratio = {i: (0 if t == "sliding_attention" else cfg.compress_rates[t]) for i, t in enumerate(cfg.layer_types)}
    csa = rec.csa
    csa_ratio = cfg.compress_rates["compressed_sparse_attention"]
    Tmax = S // csa_ratio

    def decode(record: bool, tokens_in=None):
        """Token by token with a DynamicCache; greedy after the prompt unless tokens_in is given."""
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        toks = list(prompt) if tokens_in is None else list(tokens_in)
        logits, recs = [], []
        with torch.no_grad():
            for t in range(S):
                rec.on, rec.step = record, {}
                out = model(torch.tensor([[toks[t]]]), cache=cache, use_cache=True).logits[0, -1]
                rec.on = False
                lg = out.numpy().astype(np.float32).copy()
                logits.append(lg)
                recs.append(rec.step)
                if tokens_in is None and t >= P - 1 and len(toks) < S:
                    toks.append(int(np.argmax(lg)))
        return toks, np.stack(logits), recs

    TieRule.rule = "lower"
    tokens, logits_dec, recs = decode(True)
    with torch.no_grad():
        logits_full = model(torch.tensor([tokens]), use_cache=False).logits[0].numpy().astype(np.float32)

    # ---- unpack the per-step records
    hc_state = np.zeros((S, L, hc, D), np.float32)
    attn_out = np.zeros((S, L, D), np.float32)
    route_ids = np.zeros((S, L, k_exp), np.int64)
    route_w = np.zeros((S, L, k_exp), np.float32)
    route_gap = np.full((S, L), np.inf)
    n_comp = np.zeros((S, L), np.int64)
    C = len(csa)
    ix_scores = np.full((S, C, Tmax), np.nan, np.float32)
    ix_sel = np.full((S, C, K), -1, np.int64)
    ix_tie = np.zeros((S, C), bool)
    ix_gap = np.full((S, C), np.nan)
    ix_relu = np.full((S, C), np.nan)
    for t, st in enumerate(recs):
        for i in range(L):
            hc_state[t, i] = st[("hc", i)][2][0, -1].numpy()
            attn_out[t, i] = st[("attn", i)][2][0][0, -1].numpy()
            n_comp[t, i] = (t + 1) // ratio[i] if ratio[i] else 0
            gmod, _, (glogits, gw, gidx) = st[("gate", i)]
            ids, wts = gidx[0].numpy().astype(np.int64), gw[0].numpy()
            if cfg.mlp_layer_types[i] == "hash_moe":
                assert np.array_equal(ids, gmod.tid2eid[tokens[t]].numpy())
            else:
                biased = sqrtsoftplus(glogits[0].double().numpy()) + gmod.e_score_correction_bias.double().numpy()
                order = np.argsort(-biased[ids], kind="stable")
                ids, wts = ids[order], wts[order]
                srt = np.sort(biased)[::-1]
                route_gap[t, i] = srt[k_exp - 1] - srt[k_exp]
                assert set(ids.tolist()) == set(np.argsort(-biased, kind="stable")[:k_exp].tolist())
            route_ids[t, i], route_w[t, i] = ids, wts
        for c, i in enumerate(csa):
            smod, (q, ckv, hs), sc = st[("scorer", i)]
            sel = st[("indexer", i)][2][0, -1].numpy().astype(np.int64)
            T = sc.shape[-1]
            assert T == n_comp[t, i], (t, i, T)
            s = sc[0, -1].numpy().astype(np.float32)
            ix_scores[t, c, :T] = s
            k = min(K, T)
            assert len(sel) == k and np.all(sel >= 0)
            ix_sel[t, c, :k] = sel
            order = np.argsort(-s.astype(np.float64), kind="stable")  # lower index first among equals
            assert np.array_equal(sel, order[:k]), (t, i, sel, order[:k], s)
            if T:
                wts_h = smod.weights_proj(hs).float()[0, -1].detach().numpy()
                dots = torch.matmul(q.double(), ckv.transpose(-1, -2).double().unsqueeze(1))[0, -1].numpy()  # [H, T]
                active = wts_h != 0
                ix_relu[t, c] = float(np.abs(dots[active]).min()) if active.any() else np.nan
            if k < T:
                ix_tie[t, c] = s[order[k - 1]] == s[order[k]]
                scale = float(np.abs(s).max())
                ix_gap[t, c] = (float(s[order[k - 1]]) - float(s[order[k]])) / scale if scale > 0 else 0.0

    greedy = logits_dec.argmax(-1).astype(np.int64)
    arrays = {
        "tokens": np.array(tokens, np.int64), "prompt_len": np.array(P, np.int64),
        "logits_decode": logits_dec, "logits_full": logits_full, "greedy": greedy,
        "hc_state": hc_state, "attn_out": attn_out,
        "route_ids": route_ids, "route_weights": route_w, "route_gap": route_gap, "n_compressed": n_comp,
        "index_layers": np.array(csa, np.int64), "index_scores": ix_scores, "index_selected": ix_sel,
        "index_boundary_tie": ix_tie, "index_boundary_gap": ix_gap, "index_relu_margin": ix_relu,
    }

    # ---- facts and quality criteria
    scale = float(np.abs(logits_full).max())
    dec_vs_full = float(np.abs(logits_dec - logits_full).max())
    srt = np.sort(logits_dec[P - 1:S - 1], axis=-1)
    greedy_gap = float((srt[:, -1] - srt[:, -2]).min())
    learned = [i for i in range(L) if cfg.mlp_layer_types[i] == "moe"]
    facts = {
        "seed": seed, "max_abs_logit": scale, "decode_vs_full_max_abs": dec_vs_full,
        "decode_vs_full_rel": dec_vs_full / scale,
        "argmax_decode_equals_full": bool(np.array_equal(greedy, logits_full.argmax(-1))),
        "min_greedy_gap": greedy_gap,
        "min_route_gap": float(route_gap[:, learned].min()) if learned else None,
        "experts_used_per_layer": [int(len(np.unique(route_ids[:, i]))) for i in range(L)],
        "index_topk_events": int(np.sum(n_comp[:, csa] > K)),
        "index_boundary_ties": int(ix_tie.sum()),
        "index_boundary_ties_per_layer": {str(i): int(ix_tie[:, c].sum()) for c, i in enumerate(csa)},
        "min_index_gap_rel_where_distinct": float(np.nanmin(np.where(ix_tie, np.nan, ix_gap)))
        if np.any(~np.isnan(np.where(ix_tie, np.nan, ix_gap))) else None,
        "min_index_relu_margin": float(np.nanmin(ix_relu)),
        "eos_generated": bool(cfg.eos_token_id in tokens[P:]),
    }
    problems = []
    if not (np.all(np.isfinite(logits_dec)) and scale < MAX_ABS_LOGIT):
        problems.append(f"max |logit| {scale:.3g}")
    if facts["decode_vs_full_rel"] > DECODE_VS_FULL_REL or not facts["argmax_decode_equals_full"]:
        problems.append(f"decode vs full {facts['decode_vs_full_rel']:.3g}")
    if greedy_gap < MIN_GREEDY_GAP:
        problems.append(f"greedy gap {greedy_gap:.3g}")
    if learned and facts["min_route_gap"] < MIN_ROUTE_GAP:
        problems.append(f"route gap {facts['min_route_gap']:.3g}")
    if any(n < cfg.n_routed_experts // 2 for n in facts["experts_used_per_layer"]):
        problems.append(f"degenerate routing {facts['experts_used_per_layer']}")
    gap = facts["min_index_gap_rel_where_distinct"]
    if gap is not None and gap < MIN_INDEX_GAP_REL:
        problems.append(f"indexer near-tie {gap:.3g}")
    if facts["eos_generated"]:
        problems.append("EOS generated")
    if case["ties"] is None:
        if facts["index_boundary_ties"]:
            problems.append(f"{facts['index_boundary_ties']} boundary ties")
    else:
        if facts["index_boundary_ties"] < case["ties"]["min_ties"]:
            problems.append(f"only {facts['index_boundary_ties']} boundary ties")
        if facts["min_index_relu_margin"] < MIN_RELU_MARGIN:
            problems.append(f"relu margin {facts['min_index_relu_margin']:.3g}")
    facts["problems"] = problems
    if problems:
        return arrays, facts

    # ---- the tie rule: torch's own topk, and the reversed rule
    TieRule.rule = None
    _, lg_torch, _ = decode(False, tokens)
    TieRule.rule = "higher"
    _, lg_rev, _ = decode(False, tokens)
    TieRule.rule = "lower"
    d_torch = np.abs(lg_torch - logits_dec).max(-1)
    d_rev = np.abs(lg_rev - logits_dec).max(-1)
    facts["torch_topk_vs_rule_max_abs"] = float(d_torch.max())
    facts["reversed_rule_steps_changed"] = int(np.sum(d_rev > 1e-3 * scale))
    facts["reversed_rule_max_abs"] = float(d_rev.max())
    if case["ties"] is None:
        if d_torch.max() != 0 or d_rev.max() != 0:
            problems.append("without ties the tie rule changed the logits")
    elif facts["reversed_rule_steps_changed"] < 1:
        problems.append("the ties do not matter (reversed rule gives the same logits)")

    # ---- deliberate mistakes, on the full forward
    sens = {}
    with torch.no_grad():
        for mut in ("sinkhorn_rows_first", "no_pre_eps"):
            Mutation.name = mut
            lg = model(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
            Mutation.name = None
            sens[mut] = float(np.abs(lg - logits_full).max())
        for layer in model.model.layers:
            layer.mlp.shared_experts.limit = cfg.swiglu_limit
        lg = model(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
        for layer in model.model.layers:
            layer.mlp.shared_experts.limit = math.inf
        sens["shared_expert_clamped"] = float(np.abs(lg - logits_full).max())
        for layer in model.model.layers:
            layer.mlp.experts.limit = math.inf
        lg = model(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
        for layer in model.model.layers:
            layer.mlp.experts.limit = cfg.swiglu_limit
        sens["routed_experts_unclamped"] = float(np.abs(lg - logits_full).max())
    facts["mistake_max_abs_logit_change"] = sens
    for mut in case["must_show"]:
        v = sens[mut]
        if v < MIN_MISTAKE_EFFECT:
            problems.append(f"mistake {mut} moves the logits by only {v:.3g}")
    for h in rec.handles:
        h.remove()
    facts["model"] = model  # for --crosscheck; removed before meta
    return arrays, facts


def crosscheck(path: Path, model, arrays: dict) -> float:
    """An independent float64 numpy decoder on the same weights, max |logits - fixture|. `path` is
    a Python file with a class Decoder(state_dict, config) whose step(token_id, window) returns the
    logits of one step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("v4_decode_numpy", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).parent))
    spec.loader.exec_module(mod)
    dec = mod.Decoder(model.state_dict(), model.config)
    out = np.stack([dec.step(int(t), math.inf) for t in arrays["tokens"]])
    return float(np.abs(out - arrays["logits_decode"]).max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="default: every case")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--crosscheck", type=Path, default=None,
                    help="a Python file with an independent float64 decoder (see crosscheck()): compare its logits with the fixture")
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(1)
    install_patches()
    install_hc_mutations()
    for name in args.case or list(CASES):
        case = CASES[name]
        case_dir = args.out / name
        recipe = recipe_hash(name)
        for attempt in range(MAX_ATTEMPTS):
            seed = case["seed"] + attempt
            arrays, facts = run_case(name, case, case_dir, seed)
            if not facts["problems"]:
                break
            print(f"{name}: seed {seed} rejected: {'; '.join(facts['problems'])}")
        else:
            raise SystemExit(f"{name}: no seed in {MAX_ATTEMPTS} attempts meets the criteria")
        model = facts.pop("model")
        facts.pop("problems")
        assert recipe_hash(name) == recipe, "the run changed the case spec (a dict shared with transformers?)"
        if args.crosscheck:
            d = crosscheck(args.crosscheck, model, arrays)
            print(f"{name}: numpy float64 decoder vs fixture logits: max abs diff {d:.3e}")
            assert d <= DECODE_VS_FULL_REL * facts["max_abs_logit"], d
        meta = {
            "format": "ds4f-golden-whole", "version": GENERATOR_VERSION, "case": name, "note": case["note"],
            "generator": "tools/make_golden_whole.py", "recipe_hash": recipe,
            "fingerprint": fixture_fingerprint(case_dir),
            "reference": f"transformers {transformers.__version__} DeepseekV4ForCausalLM, fp32, eager attention, "
                         f"eager experts; torch {torch.__version__}; numpy {np.__version__}; "
                         f"ml_dtypes {ml_dtypes.__version__}",
            "seed": facts["seed"], "attempt": facts["seed"] - case["seed"],
            "config": config_json(case),
            "prompt_len": case["prompt_len"], "generated": case["gen"],
            "decode": "token by token from an empty DynamicCache(config), position t = index t; greedy from step "
                      "prompt_len-1 on, no stop at EOS; the last row's argmax is not fed back",
            "greedy_tie_rule": "argmax: the lowest token id among equal logits (none occur: min_greedy_gap)",
            "indexer_tie_rule": "among equal scores the LOWER compressed-row index first; transformers was made to "
                                "follow it (Tensor.topk is a stable descending sort inside DeepseekV4Indexer, every "
                                "case, decode and full forward)",
            "shared_expert_clamp": "lifted (limit = inf on every layer's shared expert): the official code clamps "
                                   "the routed experts only",
            "weights": {"std": STD, "routed_expert_std": EXPERT_STD, "shared_expert_std": SHARED_STD,
                        "embed_std": EMBED_STD, "norm": f"1 + {NORM_SPREAD} N(0,1)",
                        "sinks_std": SINK_STD, "ape_std": APE_STD, "hc_base_std": HC_BASE_STD,
                        "hc_scale": f"1 + {HC_SCALE_SPREAD} N(0,1)", "router_bias_std": ROUTER_BIAS_STD,
                        "tid2eid": "distinct experts per token",
                        "ties": case["ties"] and f"indexer.weights_proj zero except head {case['ties']['active_head']}",
                        "loaded": "quantised to the official dtypes, the exact dequantised values in float32"},
            "criteria": {"min_greedy_gap": MIN_GREEDY_GAP, "min_route_gap": MIN_ROUTE_GAP,
                         "min_index_gap_rel": MIN_INDEX_GAP_REL, "min_relu_margin": MIN_RELU_MARGIN,
                         "decode_vs_full_rel": DECODE_VS_FULL_REL},
            "facts": facts,
            "arrays": ARRAYS_DOC,
        }
        arrays = keep_steps(arrays, case)
        arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
        write_npz(case_dir / "expected.npz", arrays)
        sizes = {p.name: p.stat().st_size for p in sorted(case_dir.iterdir())}
        print(f"{name}: seed {facts['seed']}, tokens {arrays['tokens'].tolist()}")
        print(f"  {json.dumps({k: v for k, v in facts.items() if k != 'seed'})}")
        print(f"  files {sizes} (total {sum(sizes.values())} bytes), fingerprint {meta['fingerprint'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
