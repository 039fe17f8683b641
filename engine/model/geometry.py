"""Model geometry: the handful of numbers that fix every tensor's shape and size.

A Geometry is read from (and written as) a DeepSeek-V4-Flash style config.json. The
named geometries are the synthetic models (`tiny` for tests, `demo` for the console's
out-of-the-box model, `bench` for benchmarks) and `flash`, the real model's numbers.

`Geometry.attention` (an AttentionGeometry, or None) holds the attention and
hyper-connection settings: the heads and their widths, RoPE, the sliding window, the
Lightning indexer, the hc streams and, per layer, its kind ("swa" sliding window only,
"csa" compressed sparse attention with the indexer, "hca" heavily compressed attention) and
compression ratio. A config.json without any attention key (the MoE-only synthetic
checkpoints of earlier ds4f versions) loads with `attention = None`. Both the official
release's keys (compress_ratios, qk_rope_head_dim, rope_scaling) and transformers' keys
(layer_types + compress_rates, partial_rotary_factor, rope_parameters) are read; when a
config has both, they must describe the same model. `to_config()` writes both.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass
from typing import Any

from ds4f.errors import Ds4fError
from ds4f.native.kernels import FP8_TILE  # FP8 linears: one E8M0 scale per FP8_TILE x FP8_TILE tile

MX_BLOCK = 32  # MXFP4: one E8M0 scale per 32 elements along K


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of the E8M0 scale tiles of a 2-D FP8 weight [rows, k]: [ceil(rows/128), ceil(k/128)]."""
    r, c = shape
    return (-(-r // FP8_TILE), -(-c // FP8_TILE))


# Geometry field -> config.json key (the official names).
CONFIG_KEYS: dict[str, str] = {
    "hidden": "hidden_size",
    "inter": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_experts": "n_routed_experts",
    "top_k": "num_experts_per_tok",
    "n_hash_layers": "num_hash_layers",
    "vocab": "vocab_size",
    "routed_scaling_factor": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit",
    "rms_norm_eps": "rms_norm_eps",
    "n_shared_experts": "n_shared_experts",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
}
# Keys a config.json may omit (the value then is the real model's).
CONFIG_DEFAULTS: dict[str, Any] = {
    "num_hash_layers": 0,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "n_shared_experts": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# transformers' per-layer MoE kinds (mlp_layer_types): the hash-routed layers come first
MLP_LAYER_TYPES = ("hash_moe", "moe")


# ---- attention --------------------------------------------------------------------------------
LAYER_KINDS = ("swa", "csa", "hca")
# transformers' layer_types -> ds4f's layer kinds, and back
LAYER_TYPES: dict[str, str] = {"sliding_attention": "swa", "compressed_sparse_attention": "csa",
                               "heavily_compressed_attention": "hca"}
KIND_LAYER_TYPES: dict[str, str] = {v: k for k, v in LAYER_TYPES.items()}
# The release's compress_ratios: 0 = sliding window only; the official code gives a layer the
# Lightning indexer (and overlapping compression windows) iff its ratio is 4: CSA; any other
# positive ratio is HCA. So a CSA layer's ratio is 4, and an HCA layer's is not.
CSA_RATIO = 4
# transformers' defaults (configuration_deepseek_v4.py) for the keys a config may omit
COMPRESS_RATES_DEFAULT = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
ATTENTION_DEFAULTS: dict[str, Any] = {"rope_theta": 10000.0, "compress_rope_theta": 160000.0,
                                      "hc_sinkhorn_iters": 20, "hc_eps": 1e-6}

# AttentionGeometry field -> config.json key
ATTENTION_CONFIG_KEYS: dict[str, str] = {
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "rope_dim": "qk_rope_head_dim",
    "window": "sliding_window",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "yarn": "rope_scaling",
    "layer_kinds": "layer_types",
    "layer_ratios": "compress_ratios",
    "max_position_embeddings": "max_position_embeddings",
}
# The keys whose presence means a config describes attention (rope_theta and
# max_position_embeddings alone do not: generic configs carry them).
ATTENTION_KEYS = ("num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "qk_rope_head_dim",
                  "partial_rotary_factor", "sliding_window", "compress_ratios", "layer_types", "compress_rates",
                  "compress_rope_theta", "rope_scaling", "rope_parameters", "index_n_heads", "index_head_dim",
                  "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps")
# Upper bounds of the config values, each far past DeepSeek-V4-Flash's own (in brackets): what is
# beyond one is a typo or an attack, refused naming its key rather than run for hours, out of
# memory, or with numbers near the float limit. Both readers (the run and verify) go by them.
MAX_DIM = 1 << 16                      # any width, head count or rank not listed below
GEOMETRY_MAXIMA = {"hidden": 1 << 16,            # [4096]
                   "inter": 1 << 16,             # [2048]
                   "n_layers": 1024,             # [43]
                   "n_experts": 1 << 14,         # [256]
                   "top_k": 256,                 # [6]
                   "vocab": 1 << 22,             # [129280]
                   "n_shared_experts": 64}       # [1]
ATTENTION_MAXIMA = {"window": 1 << 20,           # [128]
                    "hc_sinkhorn_iters": 1000,   # [20]
                    "hc_mult": 64,               # [4]
                    "index_topk": 1 << 20}       # [512]
FLOAT_MAXIMA = {"routed_scaling_factor": 1e3,    # [1.5]
                "swiglu_limit": 1e6,             # [10]
                "rms_norm_eps": 1.0,             # [1e-6]
                "hc_eps": 1.0,                   # [1e-6]
                "rope_theta": 1e12,              # [10000]
                "compress_rope_theta": 1e12}     # [160000]

_REQUIRED_INTS = ("n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window", "index_n_heads",
                  "index_head_dim", "index_topk", "hc_mult")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _as_float(v: Any) -> Any:
    return float(v) if _is_int(v) else v


@dataclass(frozen=True)
class Yarn:
    """YaRN frequency scaling of the "compress" RoPE (CSA and HCA layers; sliding-window layers
    use plain RoPE of rope_theta). No magnitude (mscale) factor: DeepSeek-V4 applies none, and
    transformers forces its attention_factor to 1."""

    factor: float                           # interpolated frequencies = original / factor
    original_max_position_embeddings: int   # the correction range's context length
    beta_fast: float = 32.0                 # rotations bounding the extrapolated dims
    beta_slow: float = 1.0                  # rotations bounding the interpolated dims

    def to_config(self, release: bool) -> dict:
        """The release's rope_scaling ({"type": "yarn", ...}) or transformers' flat rope_parameters."""
        return {("type" if release else "rope_type"): "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}


@dataclass(frozen=True)
class AttentionGeometry:
    """Attention and hyper-connection settings (D = hidden_size; official tensor names in brackets).

    Every layer: hc_attn_fn / hc_ffn_fn [(2+N) N, N D], hc_*_base [(2+N) N], hc_*_scale [3];
    attn.wq_a [q_lora, D], attn.q_norm [q_lora], attn.wq_b [H hd, q_lora], attn.wkv [hd, D],
    attn.kv_norm [hd], attn.wo_a [G R, H hd / G], attn.wo_b [D, G R], attn.attn_sink [H].
    CSA layers add attn.compressor.{wkv, wgate} [2 hd, D], .ape [4, 2 hd], .norm [hd] and the
    indexer: attn.indexer.wq_b [ih id, q_lora], .weights_proj [ih, D], attn.indexer.compressor.
    {wkv, wgate} [2 id, D], .ape [4, 2 id], .norm [id]. HCA layers add attn.compressor.{wkv,
    wgate} [hd, D], .ape [ratio, hd], .norm [hd]. The head: hc_head_fn [N, N D], hc_head_base
    [N], hc_head_scale [1]. (engine/checkpoint/tensors.py lists them with their dtypes.)
    """

    n_heads: int            # H   num_attention_heads: query heads; ONE K = V head is shared by all (MQA)
    head_dim: int           # hd  head_dim: a query head's width = the K = V row's (window and compressed rows)
    q_lora_rank: int        # wq_a's rows = q_norm's width = wq_b's and the indexer wq_b's input
    o_groups: int           # G   wo_a is G blocks of [R, H hd / G]: group g takes heads g H/G .. (g+1) H/G - 1
    o_lora_rank: int        # R   one group's output width; wo_b's input is G R
    rope_dim: int           # rd  qk_rope_head_dim: RoPE on the LAST rd dims (interleaved pairs) of q, kv,
    #                             the output, compressed rows and the indexer's query and keys
    window: int             # W   sliding_window: window rows a query sees, itself included
    index_n_heads: int      # ih  the Lightning indexer's heads (CSA layers)
    index_head_dim: int     # id  its width (its compressor's rows)
    index_topk: int         # K   compressed rows a CSA query attends to: the indexer's top K
    hc_mult: int            # N   hyper-connection streams of D each
    hc_sinkhorn_iters: int  # Sinkhorn normalisations of comb: 1 column + (iters - 1) x (row, column)
    hc_eps: float           # added to pre, to comb after its softmax, and to every Sinkhorn denominator
    rope_theta: float       # "main" RoPE base: sliding-window layers, no scaling
    compress_rope_theta: float  # "compress" RoPE base: CSA / HCA layers (attention, compressors, indexer)
    yarn: Yarn | None       # YaRN of the compress RoPE (None: plain RoPE)
    layer_kinds: tuple[str, ...]    # per layer: "swa" | "csa" | "hca"
    layer_ratios: tuple[int, ...]   # per layer: 0 (swa), 4 (csa), the HCA ratio (hca): tokens per compressed row
    max_position_embeddings: int | None = None  # written for transformers; ds4f's math does not use it

    def __post_init__(self) -> None:
        self.check("attention geometry")

    # ---- per layer --------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)

    def kind(self, layer: int) -> str:
        """The layer's kind: "swa", "csa" or "hca"."""
        return self.layer_kinds[layer]

    def ratio(self, layer: int) -> int:
        """Tokens per compressed row (0: a sliding-window layer)."""
        return self.layer_ratios[layer]

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    @property
    def hca_ratio(self) -> int | None:
        """The HCA layers' ratio (one for all of them), None without HCA layers."""
        return next((r for k, r in zip(self.layer_kinds, self.layer_ratios) if k == "hca"), None)

    # ---- derived widths ---------------------------------------------------------------------
    @property
    def hc_mix(self) -> int:
        """(2 + N) N: rows of hc_*_fn (pre N, post N, comb N x N)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def o_group_in(self) -> int:
        """H hd / G: the input width of one wo_a group."""
        return self.n_heads * self.head_dim // self.o_groups

    # ---- validation -------------------------------------------------------------------------
    def check(self, source: str) -> None:
        """Raise Ds4fError naming `source` and the config key if the settings are impossible."""
        def bad(f: str, why: str, value: Any = None) -> Ds4fError:
            v = getattr(self, f) if value is None else value
            return Ds4fError(f"{source}: {ATTENTION_CONFIG_KEYS[f]} = {v!r}: {why}")

        for f in _REQUIRED_INTS + ("rope_dim", "hc_sinkhorn_iters"):
            v = getattr(self, f)
            if not _is_int(v) or v < 1:
                raise bad(f, "must be a positive integer")
            if v > ATTENTION_MAXIMA.get(f, MAX_DIM):
                raise bad(f, f"more than {ATTENTION_MAXIMA.get(f, MAX_DIM)}, far past any DeepSeek-V4")
        for f in ("hc_eps", "rope_theta", "compress_rope_theta"):
            v = getattr(self, f)
            if not _is_num(v) or v <= 0:
                raise bad(f, "must be a finite positive number")
            if v > FLOAT_MAXIMA[f]:
                raise bad(f, f"more than {FLOAT_MAXIMA[f]:g}, far past any DeepSeek-V4")
        if self.rope_dim % 2:
            raise bad("rope_dim", "must be even (RoPE turns pairs of dims)")
        if self.rope_dim > self.head_dim:
            raise bad("rope_dim", f"more than head_dim ({self.head_dim})")
        if self.rope_dim > self.index_head_dim:
            raise bad("rope_dim", f"more than index_head_dim ({self.index_head_dim}): the indexer rotates as many dims")
        if self.n_heads % self.o_groups:
            raise bad("o_groups", f"must divide num_attention_heads ({self.n_heads})")
        y = self.yarn
        if y is not None:
            if not isinstance(y, Yarn):
                raise bad("yarn", "expected YaRN settings")
            if not _is_num(y.factor) or y.factor <= 0:
                raise bad("yarn", "factor must be a finite positive number", y.factor)
            if not _is_int(y.original_max_position_embeddings) or y.original_max_position_embeddings < 1:
                raise bad("yarn", "original_max_position_embeddings must be a positive integer",
                          y.original_max_position_embeddings)
            for v in (y.beta_fast, y.beta_slow):
                if not _is_num(v) or v <= 0:
                    raise bad("yarn", "beta_fast and beta_slow must be finite positive numbers", v)
        m = self.max_position_embeddings
        if m is not None and (not _is_int(m) or m < 1):
            raise bad("max_position_embeddings", "must be a positive integer")
        kinds, ratios = self.layer_kinds, self.layer_ratios
        if not isinstance(kinds, tuple) or not isinstance(ratios, tuple) or len(kinds) != len(ratios):
            raise Ds4fError(f"{source}: layer_types / compress_ratios: one kind and one ratio per layer needed")
        hca = set()
        for i, (k, r) in enumerate(zip(kinds, ratios)):
            if k not in LAYER_KINDS:
                raise Ds4fError(f"{source}: layer_types[{i}] = {KIND_LAYER_TYPES.get(k, k)!r}: not one of "
                                + ", ".join(LAYER_TYPES))
            if not _is_int(r) or r < 0:
                raise Ds4fError(f"{source}: compress_ratios[{i}] = {r!r}: must be a non-negative integer")
            want = {"swa": "0", "csa": str(CSA_RATIO), "hca": f"positive and not {CSA_RATIO}"}[k]
            if (k == "swa" and r != 0) or (k == "csa" and r != CSA_RATIO) or (k == "hca" and r in (0, CSA_RATIO)):
                raise Ds4fError(f"{source}: compress_ratios[{i}] = {r}: layer {i} is {KIND_LAYER_TYPES[k]},"
                                f" whose ratio is {want}")
            if k == "hca":
                hca.add(r)
        if len(hca) > 1:
            raise Ds4fError(f"{source}: compress_ratios: HCA layers with ratios {sorted(hca)}: transformers'"
                            f" compress_rates holds one HCA ratio, so ds4f takes one")

    # ---- config.json ------------------------------------------------------------------------
    def to_config(self, n_hash_layers: int | None = None) -> dict:
        """The release's keys and transformers' keys, both (one config.json serves both readers)."""
        cfg: dict[str, Any] = {
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "qk_rope_head_dim": self.rope_dim,
            "partial_rotary_factor": self.rope_dim / self.head_dim,
            "sliding_window": self.window,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
        }
        if self.yarn is not None:
            cfg["rope_scaling"] = self.yarn.to_config(release=True)
            cfg["rope_parameters"] = self.yarn.to_config(release=False)
        if self.max_position_embeddings is not None:
            cfg["max_position_embeddings"] = self.max_position_embeddings
        cfg.update({
            "compress_ratios": list(self.layer_ratios),
            "layer_types": [KIND_LAYER_TYPES[k] for k in self.layer_kinds],
            "compress_rates": {"compressed_sparse_attention": CSA_RATIO,
                               "heavily_compressed_attention": self.hca_ratio or
                               COMPRESS_RATES_DEFAULT["heavily_compressed_attention"]},
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
        })
        if n_hash_layers is not None:
            cfg["mlp_layer_types"] = [MLP_LAYER_TYPES[0]] * n_hash_layers + \
                [MLP_LAYER_TYPES[1]] * (self.n_layers - n_hash_layers)
        return cfg

    @classmethod
    def from_config(cls, cfg: dict, source: str, n_layers: int) -> "AttentionGeometry | None":
        """The attention settings of a config.json (either reader's keys), None if it has none."""
        present = [k for k in ATTENTION_KEYS if k in cfg]
        if not present:
            return None

        def need(key: str) -> Any:
            if key not in cfg:
                raise Ds4fError(f"{source}: missing {key} (the config describes attention: it has {present[0]})")
            return cfg[key]

        kw: dict[str, Any] = {}
        for f in _REQUIRED_INTS:
            key = ATTENTION_CONFIG_KEYS[f]
            v = kw[f] = need(key)
            if not _is_int(v) or v < 1:
                raise Ds4fError(f"{source}: {key} = {v!r}: must be a positive integer")
        for f in ("hc_sinkhorn_iters", "hc_eps"):
            key = ATTENTION_CONFIG_KEYS[f]
            kw[f] = _as_float(cfg.get(key, ATTENTION_DEFAULTS[key])) if f == "hc_eps" else \
                cfg.get(key, ATTENTION_DEFAULTS[key])
        kw["max_position_embeddings"] = cfg.get("max_position_embeddings")
        kw["rope_dim"] = _rope_dim(cfg, source, kw["head_dim"])
        kw["yarn"], kw["rope_theta"], kw["compress_rope_theta"] = _rope(cfg, source, kw["rope_dim"], kw["head_dim"])
        kw["layer_kinds"], kw["layer_ratios"] = _schedule(cfg, source, n_layers)
        att = cls.__new__(cls)
        for k, v in kw.items():
            object.__setattr__(att, k, v)
        att.check(source)
        return att

    def with_layers(self, n_layers: int) -> "AttentionGeometry":
        """The same settings for n_layers: the first n layers' kinds, or the schedule extended by
        repeating its last two layers' kinds (the Flash alternation of CSA and HCA)."""
        kinds, ratios = list(self.layer_kinds[:n_layers]), list(self.layer_ratios[:n_layers])
        while len(kinds) < n_layers:
            j = len(kinds) - 2 if len(kinds) >= 2 else len(kinds) - 1
            kinds.append(kinds[j])
            ratios.append(ratios[j])
        return dataclasses.replace(self, layer_kinds=tuple(kinds), layer_ratios=tuple(ratios))


def _rope_dim(cfg: dict, source: str, head_dim: int) -> int:
    """qk_rope_head_dim (release) or partial_rotary_factor x head_dim (transformers); both must agree."""
    rd = cfg.get("qk_rope_head_dim")
    f = cfg.get("partial_rotary_factor")
    if rd is None and f is None:
        raise Ds4fError(f"{source}: missing qk_rope_head_dim (or partial_rotary_factor): the RoPE dims of a head")
    if f is None:
        return rd
    if not _is_num(f) or not 0 < f <= 1:
        raise Ds4fError(f"{source}: partial_rotary_factor = {f!r}: must be a number in (0, 1]")
    x = head_dim * f
    rd_f = round(x)
    if abs(x - rd_f) > 1e-6:
        raise Ds4fError(f"{source}: partial_rotary_factor = {f!r}: x head_dim ({head_dim}) = {x:g}, not a whole"
                        f" number of dims")
    if rd is not None and rd != rd_f:
        raise Ds4fError(f"{source}: qk_rope_head_dim = {rd!r} but partial_rotary_factor = {f!r} gives {rd_f}"
                        f" (x head_dim {head_dim}): they disagree")
    return rd_f


def _yarn_from(d: Any, key: str, source: str) -> Yarn | None:
    """A RoPE parameter dict (release: {"type": "yarn", ...}; transformers: {"rope_type": ...})."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise Ds4fError(f"{source}: {key} = {d!r}: expected an object")
    typ = d.get("rope_type", d.get("type", "default"))
    if typ == "default":
        return None
    if typ != "yarn":
        raise Ds4fError(f"{source}: {key}: rope type {typ!r}: DeepSeek-V4 uses plain RoPE or YaRN (\"yarn\")")
    for k in ("factor", "original_max_position_embeddings"):
        if d.get(k) is None:
            raise Ds4fError(f"{source}: {key}: missing {k} (YaRN needs it)")
    af = d.get("attention_factor")
    if af is not None and af != 1:
        raise Ds4fError(f"{source}: {key}.attention_factor = {af!r}: DeepSeek-V4 applies no YaRN magnitude factor"
                        f" (transformers sets it to 1.0); ds4f computes no other")
    factor, orig = d["factor"], d["original_max_position_embeddings"]
    if not _is_num(factor) or factor <= 0:
        raise Ds4fError(f"{source}: {key}.factor = {factor!r}: must be a finite positive number")
    if not _is_int(orig) or orig < 1:
        raise Ds4fError(f"{source}: {key}.original_max_position_embeddings = {orig!r}: must be a positive integer")
    betas = []
    for k, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        v = d.get(k) or default   # transformers: `get(k) or default`
        if not _is_num(v) or v <= 0:
            raise Ds4fError(f"{source}: {key}.{k} = {v!r}: must be a finite positive number")
        betas.append(float(v))
    return Yarn(float(factor), orig, *betas)


def _rope(cfg: dict, source: str, rope_dim: int, head_dim: int) -> tuple[Yarn | None, float, float]:
    """(compress YaRN, rope_theta, compress_rope_theta) from rope_scaling (release) and/or
    rope_parameters (transformers: flat, or nested {"main", "compress"})."""
    theta = cfg.get("rope_theta", ATTENTION_DEFAULTS["rope_theta"])
    ctheta = cfg.get("compress_rope_theta", ATTENTION_DEFAULTS["compress_rope_theta"])
    yarn_release = _yarn_from(cfg.get("rope_scaling"), "rope_scaling", source)
    rp = cfg.get("rope_parameters")
    yarn_tf = None
    if rp is not None:
        if not isinstance(rp, dict):
            raise Ds4fError(f"{source}: rope_parameters = {rp!r}: expected an object")
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            # nested (what transformers' save_pretrained writes): the thetas live inside
            main, comp = rp["main"], rp["compress"]
            if _yarn_from(main, "rope_parameters.main", source) is not None:
                raise Ds4fError(f"{source}: rope_parameters.main: YaRN on the sliding-window layers; DeepSeek-V4"
                                f" uses plain RoPE there")
            yarn_tf = _yarn_from(comp, "rope_parameters.compress", source)
            for sub, d, top in (("main", main, "rope_theta"), ("compress", comp, "compress_rope_theta")):
                t = d.get("rope_theta")
                if t is not None and top in cfg and t != cfg[top]:
                    raise Ds4fError(f"{source}: rope_parameters.{sub}.rope_theta = {t!r} but {top} = {cfg[top]!r}:"
                                    f" they disagree")
                if t is not None:
                    if sub == "main":
                        theta = t
                    else:
                        ctheta = t
                f = d.get("partial_rotary_factor")
                if f is not None and (not _is_num(f) or abs(head_dim * f - rope_dim) > 1e-6):
                    raise Ds4fError(f"{source}: rope_parameters.{sub}.partial_rotary_factor = {f!r}: gives"
                                    f" {head_dim * f if _is_num(f) else f} RoPE dims, the config says {rope_dim}")
        else:
            flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            yarn_tf = _yarn_from(flat, "rope_parameters", source)
    # transformers takes rope_scaling when it is set (`rope_scaling or rope_parameters`)
    if cfg.get("rope_scaling") and rp is not None and yarn_release != yarn_tf:
        raise Ds4fError(f"{source}: rope_scaling and rope_parameters disagree ({yarn_release} vs {yarn_tf})")
    yarn = yarn_release if cfg.get("rope_scaling") else yarn_tf
    return yarn, _as_float(theta), _as_float(ctheta)


def _schedule(cfg: dict, source: str, n_layers: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Per layer (kind, ratio) from layer_types + compress_rates (transformers) and/or the
    release's compress_ratios; entries beyond num_hidden_layers (the MTP layer) are ignored."""
    lt, cr = cfg.get("layer_types"), cfg.get("compress_ratios")
    if lt is None and cr is None:
        raise Ds4fError(f"{source}: missing compress_ratios (or layer_types): which attention each layer has"
                        f" (ds4f does not guess a schedule)")
    from_types = from_ratios = None
    if lt is not None:
        if not isinstance(lt, list) or len(lt) < n_layers:
            n = len(lt) if isinstance(lt, list) else "no"
            raise Ds4fError(f"{source}: layer_types has {n} entries, num_hidden_layers is {n_layers}:"
                            f" one per layer needed")
        rates = dict(COMPRESS_RATES_DEFAULT)
        given = cfg.get("compress_rates")
        if given is not None:
            if not isinstance(given, dict):
                raise Ds4fError(f"{source}: compress_rates = {given!r}: expected an object"
                                f" {{\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": ratio}}")
            rates.update(given)
        for legacy, name in (("compress_rate_csa", "compressed_sparse_attention"),
                             ("compress_rate_hca", "heavily_compressed_attention")):
            if cfg.get(legacy) is not None:
                rates[name] = cfg[legacy]
        kinds, ratios = [], []
        for i, t in enumerate(lt[:n_layers]):
            if t not in LAYER_TYPES:
                raise Ds4fError(f"{source}: layer_types[{i}] = {t!r}: not one of {', '.join(LAYER_TYPES)}")
            kinds.append(LAYER_TYPES[t])
            ratios.append(0 if t == "sliding_attention" else rates[t])
        for t, want in (("compressed_sparse_attention", "4 (the release's compress_ratios names CSA by ratio 4)"),
                        ("heavily_compressed_attention", "a positive integer other than 4 (4 would read as CSA in"
                                                         " the release's compress_ratios)")):
            r = rates.get(t)
            if t in lt[:n_layers] and (not _is_int(r) or r < 1 or (r == CSA_RATIO) != (t.startswith("compressed"))):
                raise Ds4fError(f"{source}: compress_rates.{t} = {r!r}: must be {want}")
        from_types = (tuple(kinds), tuple(ratios))
    if cr is not None:
        if not isinstance(cr, list) or len(cr) < n_layers:
            n = len(cr) if isinstance(cr, list) else "no"
            raise Ds4fError(f"{source}: compress_ratios has {n} entries, num_hidden_layers is {n_layers}:"
                            f" one per layer needed")
        kinds, ratios = [], []
        for i, r in enumerate(cr[:n_layers]):
            if not _is_int(r) or r < 0:
                raise Ds4fError(f"{source}: compress_ratios[{i}] = {r!r}: must be a non-negative integer"
                                f" (0 = sliding window only, 4 = CSA, another ratio = HCA)")
            kinds.append("swa" if r == 0 else "csa" if r == CSA_RATIO else "hca")
            ratios.append(r)
        from_ratios = (tuple(kinds), tuple(ratios))
    if from_types is not None and from_ratios is not None and from_types != from_ratios:
        i = next(i for i in range(n_layers) if (from_types[0][i], from_types[1][i]) !=
                 (from_ratios[0][i], from_ratios[1][i]))
        raise Ds4fError(f"{source}: layer_types and compress_ratios disagree at layer {i}: {lt[i]}"
                        f" (ratio {from_types[1][i]}) vs compress_ratios[{i}] = {cr[i]}")
    return from_types or from_ratios


def _mlp_hash_layers(cfg: dict, source: str, n_layers: int) -> int | None:
    """transformers' mlp_layer_types: the number of leading hash_moe layers (None if absent)."""
    mlt = cfg.get("mlp_layer_types")
    if mlt is None:
        return None
    if not isinstance(mlt, list) or len(mlt) < n_layers:
        n = len(mlt) if isinstance(mlt, list) else "no"
        raise Ds4fError(f"{source}: mlp_layer_types has {n} entries, num_hidden_layers is {n_layers}:"
                        f" one per layer needed")
    n_hash = 0
    for i, t in enumerate(mlt[:n_layers]):
        if t not in MLP_LAYER_TYPES:
            raise Ds4fError(f"{source}: mlp_layer_types[{i}] = {t!r}: not one of {', '.join(MLP_LAYER_TYPES)}")
        if t == "hash_moe":
            if n_hash != i:
                raise Ds4fError(f"{source}: mlp_layer_types[{i}] = 'hash_moe' after a 'moe' layer: only the first"
                                f" layers route by hash (num_hash_layers)")
            n_hash += 1
    return n_hash


# ---- the geometry -----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False, repr=False)
class Geometry:
    """The MoE numbers (its dataclass fields: one config.json key each, see CONFIG_KEYS) and
    `attention` (an AttentionGeometry, or None for a MoE-only config). `attention` is an
    init-only argument kept as an attribute, so that dataclasses.fields(Geometry) stays the
    scalar config keys (the CLI's override flags); equality, hashing and replace() include it."""

    hidden: int
    inter: int
    n_layers: int
    n_experts: int
    top_k: int
    n_hash_layers: int
    vocab: int
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    n_shared_experts: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    attention: InitVar[AttentionGeometry | None] = None

    # ---- validation -------------------------------------------------------------------------
    def __post_init__(self, attention: AttentionGeometry | None) -> None:
        object.__setattr__(self, "attention", attention)
        self.check("geometry")

    def check(self, source: str) -> None:
        """Raise Ds4fError naming `source` and the field if the geometry is impossible."""
        def bad(field: str, why: str) -> Ds4fError:
            key = CONFIG_KEYS.get(field, field)
            return Ds4fError(f"{source}: {key} = {getattr(self, field)!r}: {why}")

        for f in ("hidden", "inter", "n_layers", "n_experts", "top_k", "vocab", "n_shared_experts"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f, "must be a positive integer")
            if v > GEOMETRY_MAXIMA[f]:
                raise bad(f, f"more than {GEOMETRY_MAXIMA[f]}, far past any DeepSeek-V4")
        for f in ("hidden", "inter"):
            if getattr(self, f) % MX_BLOCK:
                raise bad(f, f"must be a multiple of {MX_BLOCK} (the MXFP4 block)")
        if self.top_k > self.n_experts:
            raise bad("top_k", f"more than n_routed_experts ({self.n_experts})")
        v = self.n_hash_layers
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self.n_layers:
            raise bad("n_hash_layers", f"must be an integer in 0..num_hidden_layers ({self.n_layers})")
        for f in ("bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab:
                raise bad(f, f"must be a token id in 0..{self.vocab - 1}")
        for f in ("routed_scaling_factor", "swiglu_limit", "rms_norm_eps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(f, "must be a finite positive number")
            if v > FLOAT_MAXIMA[f]:
                raise bad(f, f"more than {FLOAT_MAXIMA[f]:g}, far past any DeepSeek-V4")
        att = self.attention
        if att is not None:
            if not isinstance(att, AttentionGeometry):
                raise Ds4fError(f"{source}: attention: expected an AttentionGeometry, got {type(att).__name__}")
            att.check(source)
            if att.n_layers != self.n_layers:
                raise Ds4fError(f"{source}: compress_ratios / layer_types: {att.n_layers} layers, but"
                                f" num_hidden_layers = {self.n_layers}")

    # ---- equality (the dataclass fields and attention) ----------------------------------------
    def _key(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)) + (self.attention,)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"Geometry({fields}, attention={self.attention!r})"

    # ---- config.json ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict, source: str) -> "Geometry":
        if not isinstance(cfg, dict):
            raise Ds4fError(f"{source}: expected a JSON object, found {type(cfg).__name__}")
        kwargs: dict[str, Any] = {}
        for field, key in CONFIG_KEYS.items():
            if key in cfg:
                kwargs[field] = cfg[key]
            elif key in CONFIG_DEFAULTS:
                kwargs[field] = CONFIG_DEFAULTS[key]
            else:
                raise Ds4fError(f"{source}: missing {key}")
        for field in ("routed_scaling_factor", "swiglu_limit", "rms_norm_eps"):
            if isinstance(kwargs[field], int) and not isinstance(kwargs[field], bool):
                kwargs[field] = float(kwargs[field])
        g = cls.__new__(cls)
        for k, v in kwargs.items():
            object.__setattr__(g, k, v)
        object.__setattr__(g, "attention", None)
        g.check(source)
        n_hash = _mlp_hash_layers(cfg, source, g.n_layers)
        if n_hash is not None:
            if "num_hash_layers" not in cfg:
                object.__setattr__(g, "n_hash_layers", n_hash)
            elif n_hash != g.n_hash_layers:
                raise Ds4fError(f"{source}: num_hash_layers = {g.n_hash_layers!r} but mlp_layer_types has {n_hash}"
                                f" hash_moe layers: they disagree")
        object.__setattr__(g, "attention", AttentionGeometry.from_config(cfg, source, g.n_layers))
        return g

    def moe_config(self) -> dict:
        """config.json's MoE part: what ds4f wrote before it knew attention."""
        cfg: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
        }
        for field, key in CONFIG_KEYS.items():
            cfg[key] = getattr(self, field)
        cfg.update({
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "expert_dtype": "fp4",
            "torch_dtype": "bfloat16",
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "scale_fmt": "ue8m0",
                "activation_scheme": "dynamic",
                "weight_block_size": [FP8_TILE, FP8_TILE],
            },
        })
        return cfg

    def to_config(self) -> dict:
        """config.json: the MoE part, and with attention both readers' attention keys (the release's
        compress_ratios, qk_rope_head_dim, rope_scaling; transformers' layer_types, compress_rates,
        partial_rotary_factor, rope_parameters, mlp_layer_types). A MoE-only geometry writes
        exactly moe_config()."""
        cfg = self.moe_config()
        if self.attention is not None:
            cfg.update(self.attention.to_config(self.n_hash_layers))
        return cfg

    def replace(self, **overrides: Any) -> "Geometry":
        """A copy with some fields changed. The attention is kept (or replaced with `attention=`);
        a new n_layers takes the first layers' kinds, or extends the schedule (with_layers)."""
        if "attention" in overrides:
            att = overrides.pop("attention")
        else:
            att, n = self.attention, overrides.get("n_layers", self.n_layers)
            if att is not None and _is_int(n) and n >= 1 and att.n_layers != n:
                att = att.with_layers(n)
        return dataclasses.replace(self, attention=att, **overrides)

    # ---- sizes ------------------------------------------------------------------------------
    def expert_parts(self) -> dict[str, tuple[int, ...]]:
        """Shapes (bytes = elements, uint8) of one routed expert's six tensors, canonical order."""
        h, i = self.hidden, self.inter
        return {
            "w1.weight": (i, h // 2),
            "w3.weight": (i, h // 2),
            "w2.weight": (h, i // 2),
            "w1.scale": (i, h // MX_BLOCK),
            "w3.scale": (i, h // MX_BLOCK),
            "w2.scale": (h, i // MX_BLOCK),
        }

    @property
    def expert_nbytes(self) -> int:
        return sum(math.prod(s) for s in self.expert_parts().values())

    @property
    def shared_inter(self) -> int:
        return self.inter * self.n_shared_experts

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    @property
    def pool_nbytes(self) -> int:
        return self.expert_nbytes * self.n_layers * self.n_experts


# ---- the named geometries ---------------------------------------------------------------------
def flash_schedule(n_layers: int, hca_ratio: int = 128, n_swa: int = 2) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """DeepSeek-V4-Flash's layer kinds for n_layers: n_swa sliding-window layers, then CSA (ratio 4)
    and HCA alternating, starting with CSA. (The real config.json lists them: ds4f reads it.)"""
    kinds = tuple("swa" if i < n_swa else ("csa" if (i - n_swa) % 2 == 0 else "hca") for i in range(n_layers))
    ratios = tuple({"swa": 0, "csa": CSA_RATIO, "hca": hca_ratio}[k] for k in kinds)
    return kinds, ratios


def _flash_attention(n_layers: int) -> AttentionGeometry:
    """The real model's attention (the Flash config.json's numbers) for n_layers layers."""
    kinds, ratios = flash_schedule(n_layers)
    return AttentionGeometry(n_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, rope_dim=64,
                             window=128, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
                             hc_sinkhorn_iters=20, hc_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
                             yarn=Yarn(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0,
                                       beta_slow=1.0),
                             layer_kinds=kinds, layer_ratios=ratios, max_position_embeddings=1048576)


def _tiny_attention(n_layers: int) -> AttentionGeometry:
    """Small widths, a window of 8, CSA 4 / HCA 8 and a top-2 indexer, so that a test's positions
    cross every boundary (window full, compressed rows emitted, the indexer choosing) in a few tokens."""
    kinds, ratios = flash_schedule(n_layers, hca_ratio=8)
    return AttentionGeometry(n_heads=4, head_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=32, rope_dim=16,
                             window=8, index_n_heads=4, index_head_dim=32, index_topk=2, hc_mult=4,
                             hc_sinkhorn_iters=20, hc_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
                             yarn=Yarn(factor=16.0, original_max_position_embeddings=64, beta_fast=32.0,
                                       beta_slow=1.0),
                             layer_kinds=kinds, layer_ratios=ratios, max_position_embeddings=1024)


GEOMETRIES: dict[str, Geometry] = {
    # Tests: generated in well under a second. Layers: SWA, SWA, CSA, HCA.
    "tiny": Geometry(hidden=256, inter=128, n_layers=4, n_experts=16, top_k=4, n_hash_layers=1, vocab=512,
                     attention=_tiny_attention(4)),
    # The console's out-of-the-box model: the real expert and attention shapes, 128 experts = 1.6 GiB pool.
    # Layers: SWA, SWA, CSA, HCA.
    "demo": Geometry(hidden=4096, inter=2048, n_layers=4, n_experts=32, top_k=6, n_hash_layers=1, vocab=8192,
                     attention=_flash_attention(4)),
    # Benchmarks: 512 experts = 6.4 GiB pool. Layers: SWA, SWA, then CSA / HCA alternating.
    "bench": Geometry(hidden=4096, inter=2048, n_layers=8, n_experts=64, top_k=6, n_hash_layers=2, vocab=8192,
                      attention=_flash_attention(8)),
    # The real DeepSeek-V4-Flash (for sizes; never synthesized in tests).
    "flash": Geometry(hidden=4096, inter=2048, n_layers=43, n_experts=256, top_k=6, n_hash_layers=3, vocab=129280,
                      attention=_flash_attention(43)),
}


def get_geometry(name: str) -> Geometry:
    try:
        return GEOMETRIES[name]
    except KeyError:
        raise Ds4fError(f"unknown geometry {name!r}; known: {', '.join(GEOMETRIES)}") from None
