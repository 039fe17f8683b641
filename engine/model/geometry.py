"""Model geometry: the handful of numbers that fix every tensor's shape and size.

A Geometry is read from (and written as) a DeepSeek-V4-Flash style config.json. The
named geometries are the synthetic models (`tiny` for tests, `demo` for the console's
out-of-the-box model, `bench` for benchmarks) and `flash`, the real model's numbers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ds4f.engine.errors import Ds4fError

MX_BLOCK = 32  # MXFP4: one E8M0 scale per 32 elements along K
FP8_TILE = 128  # FP8 linears: one E8M0 scale per 128x128 tile


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


@dataclass(frozen=True)
class Geometry:
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

    # ---- validation -------------------------------------------------------------
    def __post_init__(self) -> None:
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

    # ---- config.json ------------------------------------------------------------
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
        g.check(source)
        return g

    def to_config(self) -> dict:
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

    def replace(self, **overrides: Any) -> "Geometry":
        return dataclasses.replace(self, **overrides)

    # ---- sizes ------------------------------------------------------------------
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


GEOMETRIES: dict[str, Geometry] = {
    # Tests: generated in well under a second.
    "tiny": Geometry(hidden=256, inter=128, n_layers=4, n_experts=16, top_k=4, n_hash_layers=1, vocab=512),
    # The console's out-of-the-box model: the real expert shape, 128 experts = 1.6 GiB pool.
    "demo": Geometry(hidden=4096, inter=2048, n_layers=4, n_experts=32, top_k=6, n_hash_layers=1, vocab=8192),
    # Benchmarks: 512 experts = 6.4 GiB pool.
    "bench": Geometry(hidden=4096, inter=2048, n_layers=8, n_experts=64, top_k=6, n_hash_layers=2, vocab=8192),
    # The real DeepSeek-V4-Flash (for sizes; never synthesized in tests).
    "flash": Geometry(hidden=4096, inter=2048, n_layers=43, n_experts=256, top_k=6, n_hash_layers=3, vocab=129280),
}


def get_geometry(name: str) -> Geometry:
    try:
        return GEOMETRIES[name]
    except KeyError:
        raise Ds4fError(f"unknown geometry {name!r}; known: {', '.join(GEOMETRIES)}") from None
