"""The memory plan of a geometry under a preset on a machine's RAM, without the weights: what stays
resident (by dtype, the prefill chunk's buffers too), the KV cache at the preset's context, the expert cache the preset asks for
and the largest that fits, and the bytes a token reads from disk.

Every figure comes from the same sources the engine uses when it loads: the checkpoint's tensor
plan (shapes and dtypes), the ds4f layout's region sizes, the KV cache's allocation, the expert
cache's slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ds4f.engine.checkpoint.base import align_up, moe_region_layout
from ds4f.engine.checkpoint.tensors import attention_weight_bytes, global_tensors, mtp_tensors
from ds4f.engine.batch import batched_chunk, step_rows
from ds4f.engine.config import AUTO_CHUNK, DEFAULT_PARALLEL, MAX_CHUNK, MAX_PARALLEL, Preset
from ds4f.engine.model.attention import KVCache, attention_shapes
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.mtp import mtp_geometry
from ds4f.engine.model.forward import ChunkBuffers, transient_nbytes
from ds4f.engine.runtime.memory import BOOKKEEPING_BYTES
from ds4f.engine.runtime.mtp_source import round_slots

OS_HEADROOM = 2 << 30   # what the plan leaves the OS, the page cache of the checkpoint's metadata, the shell
# the chunks prefill_chunk = "auto" tries, largest first: a chunk reads each expert it routes to once
# per layer, so a long prompt's reads are the pool's over its chunks; the smallest is the fallback
AUTO_CHUNKS = tuple(c for c in (4096, 2048, 1024, 512, 256, 128, 64) if c <= MAX_CHUNK)
# ... but where nothing is read (every layer pinned, an expert cache of the whole pool) a larger
# chunk saves nothing, and past this size its intermediates (a token's queries alone: heads x
# head_dim fp32, 128 KiB on flash) outgrow the core's caches: on the bench model in RAM a
# 512-token prompt went 1.15x faster in chunks of 128 or 256 than in one of 512
RESIDENT_CHUNK = 256


@dataclass
class MemoryPlan:
    geometry: Geometry
    preset: Preset
    ram_bytes: int
    resident: dict[str, int] = field(default_factory=dict)     # part -> bytes (see memory_plan)
    attention_by_dtype: dict[str, int] = field(default_factory=dict)   # of the attention's row, by dtype
    chunk_records_bytes: int = 0         # of the prompt chunks' row, the tokens' layer records
    kv_bytes: int = 0                    # every sequence's KV cache (parallel of them)
    parallel: int = 1                    # sequences stepping together
    sequence_bytes: int = 0              # what one more sequence holds: its KV cache and prompt chunk
    cache_bytes: int = 0                 # the preset's expert cache, in whole slots
    cache_fit_bytes: int = 0             # the largest expert cache that fits the RAM with the rest
    pool_bytes: int = 0                  # every routed expert, as stored
    routed_bytes_per_token: int = 0      # every routed expert a token selects, read if none were cached
    streamed_trunk_bytes_per_token: int = 0   # the unpinned layers' MoE trunk, read every token
    prefix_ram_bytes: int = 0            # memory_plan's: the prefix cache's RAM bound, counted in
    spec: bool = False                   # memory_plan's: with the MTP layer loaded
    records: str = "full"                # memory_plan's: what a prompt chunk keeps per layer (model.records)
    auto_chunk: bool = False             # the preset's prefill_chunk is "auto" (preset holds the chunk chosen)

    @property
    def total_bytes(self) -> int:
        return sum(self.resident.values()) + self.kv_bytes + self.cache_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes + OS_HEADROOM <= self.ram_bytes

    @property
    def sequences_fit(self) -> int:
        """The most sequences, up to MAX_PARALLEL, that fit the RAM stepping together with the rest
        of the plan (the preset's cache): each its KV cache and prompt chunk, and a row of the
        batched step, whose buffers grow with them; 1 when only one alone fits, 0 when none does."""
        def fits(n: int) -> bool:
            return memory_plan(self.geometry, self.preset, self.ram_bytes, self.prefix_ram_bytes, n, self.spec,
                               self.records).fits

        if not fits(2):                  # one alone takes a larger prompt chunk than batched ones
            return 1 if fits(1) else 0
        lo, hi = 2, MAX_PARALLEL         # fits(lo); more sequences never plan less
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def gb_per_token(self, hit_rate: float) -> float:
        """Disk GB (1e9 B) per token if a fraction `hit_rate` of expert requests hit the cache."""
        return ((1 - hit_rate) * self.routed_bytes_per_token + self.streamed_trunk_bytes_per_token) / 1e9


def memory_plan(g: Geometry, preset: Preset, ram_bytes: int, prefix_ram_bytes: int = 0,
                parallel: int = 1, spec: bool = False, records: str = "full") -> MemoryPlan:
    """What the engine holds for geometry `g` under `preset` on a machine of `ram_bytes`, the
    prefix cache's RAM bound ([kv] ram) with it, for `parallel` sequences stepping together
    (engine.batch: each its KV cache and prompt chunk's records, and the batched step's buffers);
    spec: with the MTP layer loaded for speculative decoding (mtp_nbytes); records: what a prompt
    chunk keeps per layer, by the runs' state dump (model.records: full, compact, none). A
    prefill_chunk of "auto" is planned as the chunk chunk_that_fits chooses (the plan's preset holds it)."""
    auto = preset.prefill_chunk == AUTO_CHUNK
    if auto:
        preset = chunk_that_fits(g, preset, ram_bytes, prefix_ram_bytes, parallel, spec, records)
    slot, pool = expert_pool(g)
    regions = [moe_region_layout(g, layer)[1] for layer in range(g.n_layers)]
    pinned = preset.pinned_count(g.n_layers)
    routers = sum(2 * g.n_experts * g.hidden + 4 * g.hidden                       # gate bf16, ffn_norm fp32
                  + (8 * g.vocab * g.top_k if g.is_hash_layer(layer) else 4 * g.n_experts)
                  for layer in range(pinned, g.n_layers))                           # pinned layers hold theirs
    att = attention_weight_bytes(g) if g.attention is not None else {}
    plan = MemoryPlan(g, preset, ram_bytes, pool_bytes=pool, parallel=parallel, prefix_ram_bytes=prefix_ram_bytes,
                      spec=spec, records=records, auto_chunk=auto)
    chunk = batched_chunk(preset.prefill_chunk) if parallel > 1 and preset.prefill_chunk else preset.prefill_chunk
    chunk_bytes = ChunkBuffers.nbytes_for(g, chunk, records) + transient_nbytes(g, chunk) if chunk else 0
    plan.resident = {
        "globals (embed, head, final norm)": sum(t.nbytes for t in global_tensors(g) if not t.name.startswith("hc_")),
        "attention and hyper-connections": att.get("total", 0),
        f"pinned MoE trunk ({pinned} of {g.n_layers} layers)": sum(regions[:pinned]),
        "routers of the unpinned layers": routers,
        "read-ahead buffers": 2 * max(regions) if pinned < g.n_layers else 0,
        "bookkeeping": BOOKKEEPING_BYTES,
        "prefix cache (session states in RAM)": prefix_ram_bytes,
        ((f"prefill chunk ({chunk} tokens, the largest that fits: activations, records and temporaries)" if auto else
          f"prefill chunk ({chunk} tokens' activations, records and temporaries)") if parallel == 1 else
         f"prefill chunks ({parallel} sequences' of {chunk} tokens: activations, records, temporaries)"):
            parallel * chunk_bytes,
    }
    if parallel > 1:
        rows = step_rows(parallel, preset.prefill_chunk)
        plan.resident[f"batched step ({rows} rows: {parallel} decode rows and a prompt chunk)"] = \
            ChunkBuffers.nbytes_for(g, rows) + transient_nbytes(g, rows)
    if spec and g.attention is not None:
        plan.resident["MTP layer (speculative decoding: its block, slots for its experts, buffers)"] = \
            mtp_nbytes(g, preset.context)
    plan.attention_by_dtype = {k: v for k, v in att.items() if k != "total" and v}
    plan.chunk_records_bytes = parallel * ChunkBuffers.records_nbytes_for(g, chunk, records) if chunk else 0
    one_kv = KVCache.nbytes_for(attention_shapes(g.attention, g.rms_norm_eps), preset.context) \
        if g.attention is not None else 0
    plan.kv_bytes = parallel * one_kv
    plan.sequence_bytes = one_kv + chunk_bytes
    plan.cache_bytes = preset.cache_bytes(pool) // slot * slot
    free = ram_bytes - OS_HEADROOM - sum(plan.resident.values()) - plan.kv_bytes
    plan.cache_fit_bytes = max(0, min(free, pool)) // slot * slot
    plan.routed_bytes_per_token = g.n_layers * g.top_k * g.expert_nbytes
    plan.streamed_trunk_bytes_per_token = sum(regions[pinned:])
    return plan


def expert_pool(g: Geometry) -> tuple[int, int]:
    """(slot, pool): the bytes of an expert's cache slot (4 KiB-aligned) and of every expert's."""
    slot = align_up(g.expert_nbytes)
    return slot, g.n_layers * g.n_experts * slot


def chunk_that_fits(g: Geometry, preset: Preset, ram_bytes: int, prefix_ram_bytes: int = 0, parallel: int = 1,
                    spec: bool = False, records: str = "full") -> Preset:
    """preset itself, or where its prefill_chunk is "auto" (AUTO_CHUNK) a copy with the largest of
    AUTO_CHUNKS whose memory plan fits the RAM with everything else the preset asks for (its
    expert cache as it is: the chunk takes what is left), the smallest when none does (its plan
    then says it does not fit). A long prompt reads each routed expert once per layer per chunk,
    so the larger the chunk, the fewer its reads per prompt token; where the preset reads nothing
    (every layer pinned, the cache the whole pool) at most RESIDENT_CHUNK."""
    if preset.prefill_chunk != AUTO_CHUNK:
        return preset
    slot, pool = expert_pool(g)
    reads = preset.pinned_count(g.n_layers) < g.n_layers or preset.cache_bytes(pool) // slot * slot < pool
    for chunk in AUTO_CHUNKS if reads else [c for c in AUTO_CHUNKS if c <= RESIDENT_CHUNK]:
        sized = replace(preset, prefill_chunk=chunk)
        if memory_plan(g, sized, ram_bytes, prefix_ram_bytes, parallel, spec, records).fits:
            return sized
    return replace(preset, prefill_chunk=AUTO_CHUNKS[-1])


def mtp_nbytes(g: Geometry, context: int) -> int:
    """What the MTP layer holds once loaded (Engine.mtp_layer, speculative.MtpDrafter): its
    tensors but the routed experts, as shipped; the slots its drafts' experts are read into (a
    round's worth, as runtime.mtp_source sizes them); its row buffers; and one sequence's drafter:
    the main streams of a window of rows and the layer's own KV window."""
    a = g.attention
    weights = sum(t.nbytes for t in mtp_tensors(g) if ".ffn.experts." not in t.name)
    slots = round_slots(g.top_k) * align_up(g.expert_nbytes)
    buffers = ChunkBuffers.nbytes_for(mtp_geometry(g), 1)    # its temporaries: the prefill chunk's cover them
    drafter = a.window * a.hc_mult * g.hidden * 4 + a.window * (8 + a.head_dim * 4)
    return weights + slots + buffers + drafter


def fit_parallel(g: Geometry, preset: Preset, ram_bytes: int, prefix_ram_bytes: int = 0,
                 most: int = DEFAULT_PARALLEL, records: str = "full") -> int:
    """The most sequences, up to `most`, whose memory plan fits the RAM (1 when none does: one
    sequence alone is the plan `ds4f plan` shows)."""
    for n in range(most, 1, -1):
        if memory_plan(g, preset, ram_bytes, prefix_ram_bytes, n, records=records).fits:
            return n
    return 1


CONVERSATION_TOKENS = 30_000    # an agent's conversation, for the bookkeeping table


def kept_state_nbytes(g: Geometry, tokens: int) -> int:
    """A kept state at `tokens` positions (engine.session_state): every layer's window and compressor
    groups, the compressed rows so far, and the last logits (no records)."""
    if g.attention is None:
        return 0
    return KVCache.nbytes_for(attention_shapes(g.attention, g.rms_norm_eps), tokens) + 4 * g.vocab


def bookkeeping(g: Geometry, tokens: int = CONVERSATION_TOKENS) -> list[tuple[str, float, int]]:
    """What a run writes and keeps beside the math, per token and for `tokens` of a conversation:
    (what, bytes per token, bytes at `tokens`). A kept state's per-token bytes are its KV's growth."""
    from ds4f.runs.statedump import record_nbytes

    config = g.to_config()
    full, compact = record_nbytes(config, "full"), record_nbytes(config, "compact")
    fixed, at = kept_state_nbytes(g, 0), kept_state_nbytes(g, tokens)
    return [("state dump, full records", full, full * tokens),
            ("state dump, compact records", compact, compact * tokens),
            ("state dump, off", 0, 0),
            ("kept state (KV, windows, last logits)", (at - fixed) / tokens if tokens else 0, at),
            ("  of it fixed (windows, open groups, logits)", 0, fixed),
            ("kept state's compact records (runs with a dump)", compact, compact * tokens)]

