"""The official release's tensors for a geometry: names, safetensors dtypes, shapes.

synth writes exactly these, the official reader checks a release against them.

Dtypes of the attention and hyper-connection tensors: FP8 E4M3 with E8M0 128x128 tile scales
for the projections (attn.wq_a, wq_b, wkv, wo_a, wo_b and the CSA indexer's wq_b), BF16 for
the norms, the compressors' wkv / wgate and the indexer's weights_proj, F32 for the
compressors' ape, the sinks and the hyper-connections (ds4f-whole-model.md). The release's
files were not at hand to check each one. What supports it: a published tensor inventory of a
V4-Flash conversion that kept the release's FP8 blocks counts 365 FP8 tensors with 128-blocks
= 43 layers x 8 (these five, the shared expert's three) + the 21 CSA layers' indexer wq_b, and
147 BF16 = embed, head and the compressors' wkv / wgate and weights_proj of every layer; so
wo_a and wkv are FP8 and weights_proj BF16, as planned here. The norms' BF16 follows the
reference doc (that conversion stored them as F32). If a release disagrees, check_official_tensors
says which tensor, its dtype and the one expected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ds4f.engine.checkpoint.formats import st_itemsize
from ds4f.engine.model.geometry import Geometry, fp8_scale_shape


@dataclass(frozen=True)
class TensorPlan:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * st_itemsize(self.dtype)


MTP_PREFIX = "mtp.0."   # the release's one multi-token-prediction layer (num_nextn_predict_layers 1)


def layer_prefix(g: Geometry, layer: int) -> str:
    """Where a block's tensors live: layers.{layer}. for a main layer, mtp.0. for layer n_layers
    (the MTP layer: a block like the main ones, read at the index after the last)."""
    return MTP_PREFIX if layer == g.n_layers else f"layers.{layer}."


def official_tensors(g: Geometry) -> list[TensorPlan]:
    """The tensors of the official release the engine reads, in generation order: per layer the
    norms, the attention and hyper-connections (when the geometry has attention), the MoE trunk
    and the experts; then the global tensors. Without the MTP layer (mtp_tensors)."""
    out: list[TensorPlan] = []
    for layer in range(g.n_layers):
        out += block_tensors(g, layer)
    return out + global_tensors(g)


def block_tensors(g: Geometry, layer: int) -> list[TensorPlan]:
    """One block's tensors (a main layer, or the MTP layer at layer == n_layers): its norms, the
    attention and hyper-connections, the MoE trunk (a learned gate with bias on the MTP layer,
    never hash routing) and the routed experts."""
    p = layer_prefix(g, layer)
    si = g.shared_inter
    out = [TensorPlan(p + "attn_norm.weight", "BF16", (g.hidden,)),
           TensorPlan(p + "ffn_norm.weight", "BF16", (g.hidden,))]
    out += attention_layer_tensors(g, layer)
    out.append(TensorPlan(p + "ffn.gate.weight", "BF16", (g.n_experts, g.hidden)))
    if g.is_hash_layer(layer):
        out.append(TensorPlan(p + "ffn.gate.tid2eid", "I64", (g.vocab, g.top_k)))
    else:
        out.append(TensorPlan(p + "ffn.gate.bias", "F32", (g.n_experts,)))
    for w, shape in (("w1", (si, g.hidden)), ("w3", (si, g.hidden)), ("w2", (g.hidden, si))):
        out.append(TensorPlan(p + f"ffn.shared_experts.{w}.weight", "F8_E4M3", shape))
        out.append(TensorPlan(p + f"ffn.shared_experts.{w}.scale", "F8_E8M0", fp8_scale_shape(shape)))
    for e in range(g.n_experts):
        for part, shape in g.expert_parts().items():
            w, kind = part.split(".")
            out.append(TensorPlan(p + f"ffn.experts.{e}.{part}", "I8" if kind == "weight" else "F8_E8M0", shape))
    return out


def mtp_tensors(g: Geometry) -> list[TensorPlan]:
    """The MTP layer's tensors (ds4f-mtp.md): a block with sliding-window attention under mtp.0.,
    its input projections e_proj / h_proj (FP8 [hidden, hidden]) and norms enorm / hnorm, its own
    final norm and hc_head_*. The embedding and the head are the main model's. Needs attention."""
    if g.attention is None:
        return []
    D, p = g.hidden, MTP_PREFIX
    out = block_tensors(g, g.n_layers)
    out += _fp8(p + "e_proj", (D, D)) + _fp8(p + "h_proj", (D, D))
    out += [TensorPlan(p + f"{n}.weight", "BF16", (D,)) for n in ("enorm", "hnorm", "norm")]
    return out + hc_head_tensors(g, p)


def global_tensors(g: Geometry) -> list[TensorPlan]:
    """The tensors outside the layers the engine reads: embedding, head, final norm, and with
    attention the head's hyper-connection reduction."""
    out = [TensorPlan("embed.weight", "BF16", (g.vocab, g.hidden)),
           TensorPlan("head.weight", "BF16", (g.vocab, g.hidden)),
           TensorPlan("norm.weight", "BF16", (g.hidden,))]
    return out + hc_head_tensors(g)


def hc_head_tensors(g: Geometry, prefix: str = "") -> list[TensorPlan]:
    """hc_head_{fn, base, scale}: the head's reduction of the N streams (none without attention);
    prefix mtp.0.: the MTP layer's own."""
    a = g.attention
    if a is None:
        return []
    n = a.hc_mult
    return [TensorPlan(prefix + "hc_head_fn", "F32", (n, n * g.hidden)),
            TensorPlan(prefix + "hc_head_base", "F32", (n,)),
            TensorPlan(prefix + "hc_head_scale", "F32", (1,))]


def _fp8(name: str, shape: tuple[int, int]) -> list[TensorPlan]:
    """An FP8 linear: E4M3 weight [rows, k] and its E8M0 128x128 tile scales."""
    return [TensorPlan(name + ".weight", "F8_E4M3", shape), TensorPlan(name + ".scale", "F8_E8M0",
                                                                       fp8_scale_shape(shape))]


def _compressor(p: str, width: int, dim: int, ratio: int, hidden: int) -> list[TensorPlan]:
    """A compressor: wkv, wgate [width, D] bf16, ape [ratio, width] f32, norm [dim] bf16
    (width = 2 dim with overlapping windows (CSA and its indexer), dim for HCA)."""
    return [TensorPlan(p + "wkv.weight", "BF16", (width, hidden)),
            TensorPlan(p + "wgate.weight", "BF16", (width, hidden)),
            TensorPlan(p + "ape", "F32", (ratio, width)),
            TensorPlan(p + "norm.weight", "BF16", (dim,))]


def attention_layer_tensors(g: Geometry, layer: int) -> list[TensorPlan]:
    """One layer's attention and hyper-connection tensors (none without attention; layer n_layers:
    the MTP layer's, sliding window only), in model order:
    hc_attn_*, the attention (projections, norms, sink, then the compressor and indexer of a CSA
    or HCA layer), hc_ffn_*."""
    a = g.attention
    if a is None:
        return []
    D, N = g.hidden, a.hc_mult
    H, hd, qr = a.n_heads, a.head_dim, a.q_lora_rank
    p = layer_prefix(g, layer)

    def hc(which: str) -> list[TensorPlan]:
        return [TensorPlan(p + f"hc_{which}_fn", "F32", (a.hc_mix, N * D)),
                TensorPlan(p + f"hc_{which}_base", "F32", (a.hc_mix,)),
                TensorPlan(p + f"hc_{which}_scale", "F32", (3,))]

    q = p + "attn."
    out = hc("attn")
    out += _fp8(q + "wq_a", (qr, D))
    out.append(TensorPlan(q + "q_norm.weight", "BF16", (qr,)))
    out += _fp8(q + "wq_b", (H * hd, qr))
    out += _fp8(q + "wkv", (hd, D))
    out.append(TensorPlan(q + "kv_norm.weight", "BF16", (hd,)))
    out += _fp8(q + "wo_a", (a.o_groups * a.o_lora_rank, a.o_group_in))
    out += _fp8(q + "wo_b", (D, a.o_groups * a.o_lora_rank))
    out.append(TensorPlan(q + "attn_sink", "F32", (H,)))
    kind, ratio = ("swa", 0) if layer == g.n_layers else (a.kind(layer), a.ratio(layer))   # MTP: a window only
    if kind == "csa":
        ih, idim = a.index_n_heads, a.index_head_dim
        out += _compressor(q + "compressor.", 2 * hd, hd, ratio, D)
        out += _fp8(q + "indexer.wq_b", (ih * idim, qr))
        out.append(TensorPlan(q + "indexer.weights_proj.weight", "BF16", (ih, D)))
        out += _compressor(q + "indexer.compressor.", 2 * idim, idim, ratio, D)
    elif kind == "hca":
        out += _compressor(q + "compressor.", hd, hd, ratio, D)
    return out + hc("ffn")


def attention_tensors(g: Geometry) -> list[TensorPlan]:
    """Every attention and hyper-connection tensor of the model: each layer's, then the head's."""
    out: list[TensorPlan] = []
    for layer in range(g.n_layers):
        out += attention_layer_tensors(g, layer)
    return out + hc_head_tensors(g)


def attention_weight_bytes(g: Geometry, layer: int | None = None) -> dict[str, int]:
    """Bytes of the attention + hyper-connection weights as shipped, by safetensors dtype, plus
    "total": of one layer, or (layer None) of the whole model, the head's hc_head_* included.
    All zero without attention."""
    plans = attention_tensors(g) if layer is None else attention_layer_tensors(g, layer)
    out = {"F8_E4M3": 0, "F8_E8M0": 0, "BF16": 0, "F32": 0}
    for t in plans:
        out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
    out["total"] = sum(out.values())
    return out
