"""The weights every token reads whatever the preset: each layer's attention sublayer with its
compressors and indexer, both hyper-connections, and the head's; read once when the engine
loads, in their shipped dtypes (FP8 projections with their tile scales, bf16 compressors, fp32
hyper-connections), and kept in RAM.
"""
from __future__ import annotations

import numpy as np

from ds4f.engine.checkpoint.formats import check_finite
from ds4f.engine.checkpoint.tensors import MTP_PREFIX
from ds4f.engine.model.attention import (AttentionShape, AttentionWeights, CompressorWeights, IndexerWeights,
                                         attention_shapes, layer_ropes)
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.hyper import HyperWeights
from ds4f.engine.model.mtp import MtpWeights
from ds4f.engine.model.weights import Bf16Matrix, Fp8Matrix, LayerAttention, MoeWeights


class _Reader:
    """Tensors of one checkpoint by official name, as the matrices and vectors the model takes."""

    def __init__(self, checkpoint) -> None:
        self.ck = checkpoint

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored, refused when it holds a NaN or an infinity (one in a bias, a norm
        or a hyper-connection parameter would reroute tokens or change what attention reads
        silently; no output check reaches it)."""
        arr = self.ck.global_tensor(name)
        check_finite(arr, name, self.ck.path)
        return arr

    def f32(self, name: str) -> np.ndarray:
        return np.asarray(self.raw(name), dtype=np.float32)

    def fp8(self, name: str) -> Fp8Matrix:
        return Fp8Matrix(self.raw(name + ".weight"), self.raw(name + ".scale"))

    def bf16(self, name: str) -> Bf16Matrix:
        return Bf16Matrix(self.raw(name + ".weight"))

    def compressor(self, prefix: str) -> CompressorWeights:
        return CompressorWeights(self.bf16(prefix + "wkv"), self.bf16(prefix + "wgate"), self.f32(prefix + "ape"),
                                 self.f32(prefix + "norm.weight"))

    def hyper(self, prefix: str) -> HyperWeights:
        return HyperWeights.of(self.f32(prefix + "fn"), self.f32(prefix + "base"), self.f32(prefix + "scale"))


def load_attention(checkpoint, g: Geometry) -> tuple[list[LayerAttention], HyperWeights]:
    """Every layer's LayerAttention and the head's hyper-connection, read from the checkpoint."""
    att = g.attention
    r = _Reader(checkpoint)
    main, compress = layer_ropes(att)
    layers = [_layer_attention(r, att, f"layers.{i}.", shape, main if shape.kind == "swa" else compress)
              for i, shape in enumerate(attention_shapes(att, g.rms_norm_eps))]
    return layers, r.hyper("hc_head_")


def _layer_attention(r: _Reader, att, prefix: str, shape: AttentionShape, rope) -> LayerAttention:
    """One block's attention sublayer and hyper-connections, its tensors under `prefix`."""
    p = prefix + "attn."
    compressor = indexer = None
    if shape.kind != "swa":
        compressor = r.compressor(p + "compressor.")
    if shape.kind == "csa":
        indexer = IndexerWeights(r.fp8(p + "indexer.wq_b"), r.bf16(p + "indexer.weights_proj"),
                                 r.compressor(p + "indexer.compressor."))
    weights = AttentionWeights(r.fp8(p + "wq_a"), r.f32(p + "q_norm.weight"), r.fp8(p + "wq_b"), r.fp8(p + "wkv"),
                               r.f32(p + "kv_norm.weight"), r.fp8(p + "wo_a").row_blocks(att.o_groups),
                               r.fp8(p + "wo_b"), r.f32(p + "attn_sink"), compressor, indexer)
    return LayerAttention(weights, shape, rope, r.f32(prefix + "attn_norm.weight"), r.hyper(prefix + "hc_attn_"),
                          r.hyper(prefix + "hc_ffn_"))


def load_mtp(checkpoint, g: Geometry) -> MtpWeights:
    """The MTP layer's weights (ds4f-mtp.md), all but its routed experts: its block's attention
    (a sliding window, the main RoPE), router and shared expert, e_proj / h_proj with their
    norms, its final norm and hc_head. The routed experts are read as layer n_layers."""
    att, r, p = g.attention, _Reader(checkpoint), MTP_PREFIX
    shape = AttentionShape("swa", 0, att.n_heads, att.head_dim, att.window, eps=g.rms_norm_eps)
    block = _layer_attention(r, att, p, shape, layer_ropes(att)[0])
    trunk = {"ffn_norm.weight": r.raw(p + "ffn_norm.weight"), "gate.weight": r.raw(p + "ffn.gate.weight"),
             "gate.bias": r.raw(p + "ffn.gate.bias")}
    for w in ("w1", "w3", "w2"):
        for part in ("weight", "scale"):
            trunk[f"shared_experts.{w}.{part}"] = r.raw(p + f"ffn.shared_experts.{w}.{part}")
    return MtpWeights(block, MoeWeights.from_tensors(trunk), r.fp8(p + "e_proj"), r.fp8(p + "h_proj"),
                      r.f32(p + "enorm.weight"), r.f32(p + "hnorm.weight"), r.f32(p + "norm.weight"),
                      r.hyper(p + "hc_head_"))
