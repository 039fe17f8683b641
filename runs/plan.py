"""The memory plan of a geometry under a preset on a machine's RAM, without the weights: what stays
resident (by dtype, the prefill chunk's buffers too), the KV cache at the preset's context, the expert cache the preset asks for
and the largest that fits, and the bytes a token reads from disk.

Every figure comes from the same sources the engine uses when it loads: the checkpoint's tensor
plan (shapes and dtypes), the ds4f layout's region sizes, the KV cache's allocation, the expert
cache's slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ds4f.engine.checkpoint.base import align_up, moe_region_layout
from ds4f.engine.checkpoint.tensors import attention_weight_bytes, global_tensors
from ds4f.engine.config import Preset
from ds4f.engine.model.attention import KVCache, attention_shapes
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.prefill import ChunkBuffers, transient_nbytes
from ds4f.engine.runtime.memory import BOOKKEEPING_BYTES

OS_HEADROOM = 2 << 30   # what the plan leaves the OS, the page cache of the checkpoint's metadata, the shell


@dataclass
class MemoryPlan:
    geometry: Geometry
    preset: Preset
    ram_bytes: int
    resident: dict[str, int] = field(default_factory=dict)     # part -> bytes (see memory_plan)
    attention_by_dtype: dict[str, int] = field(default_factory=dict)
    kv_bytes: int = 0
    cache_bytes: int = 0                 # the preset's expert cache, in whole slots
    cache_fit_bytes: int = 0             # the largest expert cache that fits the RAM with the rest
    pool_bytes: int = 0                  # every routed expert, as stored
    routed_bytes_per_token: int = 0      # every routed expert a token selects, read if none were cached
    streamed_trunk_bytes_per_token: int = 0   # the unpinned layers' MoE trunk, read every token

    @property
    def total_bytes(self) -> int:
        return sum(self.resident.values()) + self.kv_bytes + self.cache_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes + OS_HEADROOM <= self.ram_bytes

    def gb_per_token(self, hit_rate: float) -> float:
        """Disk GB (1e9 B) per token if a fraction `hit_rate` of expert requests hit the cache."""
        return ((1 - hit_rate) * self.routed_bytes_per_token + self.streamed_trunk_bytes_per_token) / 1e9


def memory_plan(g: Geometry, preset: Preset, ram_bytes: int, prefix_ram_bytes: int = 0) -> MemoryPlan:
    """What the engine holds for geometry `g` under `preset` on a machine of `ram_bytes`, and
    the prefix cache's RAM bound ([kv] ram) with it."""
    slot = align_up(g.expert_nbytes)
    pool = g.n_layers * g.n_experts * slot
    regions = [moe_region_layout(g, layer)[1] for layer in range(g.n_layers)]
    pinned = preset.pinned_count(g.n_layers)
    routers = sum(2 * g.n_experts * g.hidden + 4 * g.hidden                       # gate bf16, ffn_norm fp32
                  + (8 * g.vocab * g.top_k if g.is_hash_layer(layer) else 4 * g.n_experts)
                  for layer in range(pinned, g.n_layers))                           # pinned layers hold theirs
    att = attention_weight_bytes(g) if g.attention is not None else {}
    plan = MemoryPlan(g, preset, ram_bytes, pool_bytes=pool)
    plan.resident = {
        "globals (embed, head, final norm)": sum(t.nbytes for t in global_tensors(g) if not t.name.startswith("hc_")),
        "attention and hyper-connections": att.get("total", 0),
        f"pinned MoE trunk ({pinned} of {g.n_layers} layers)": sum(regions[:pinned]),
        "routers of the unpinned layers": routers,
        "read-ahead buffers": 2 * max(regions) if pinned < g.n_layers else 0,
        "bookkeeping": BOOKKEEPING_BYTES,
        "prefix cache (session states in RAM)": prefix_ram_bytes,
        f"prefill chunk ({preset.prefill_chunk} tokens' activations, records and temporaries)":
            ChunkBuffers.nbytes_for(g, preset.prefill_chunk) + transient_nbytes(g, preset.prefill_chunk)
            if preset.prefill_chunk else 0,
    }
    plan.attention_by_dtype = {k: v for k, v in att.items() if k != "total" and v}
    if g.attention is not None:
        plan.kv_bytes = KVCache.nbytes_for(attention_shapes(g.attention, g.rms_norm_eps), preset.context)
    plan.cache_bytes = preset.cache_bytes(pool) // slot * slot
    free = ram_bytes - OS_HEADROOM - sum(plan.resident.values()) - plan.kv_bytes
    plan.cache_fit_bytes = max(0, min(free, pool)) // slot * slot
    plan.routed_bytes_per_token = g.n_layers * g.top_k * g.expert_nbytes
    plan.streamed_trunk_bytes_per_token = sum(regions[pinned:])
    return plan
