"""The official release's tensors for a geometry: names, safetensors dtypes, shapes.

synth writes exactly these, the official reader checks a release against them.
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


def official_tensors(g: Geometry) -> list[TensorPlan]:
    """The tensors of the official release's MoE trunk and experts, in generation order."""
    out: list[TensorPlan] = []
    si = g.shared_inter
    for layer in range(g.n_layers):
        p = f"layers.{layer}."
        out += [TensorPlan(p + "attn_norm.weight", "BF16", (g.hidden,)),
                TensorPlan(p + "ffn_norm.weight", "BF16", (g.hidden,)),
                TensorPlan(p + "ffn.gate.weight", "BF16", (g.n_experts, g.hidden))]
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
    return out + global_tensors(g)


def global_tensors(g: Geometry) -> list[TensorPlan]:
    """The tensors outside the layers the engine reads: embedding, head, final norm."""
    return [TensorPlan("embed.weight", "BF16", (g.vocab, g.hidden)),
            TensorPlan("head.weight", "BF16", (g.vocab, g.hidden)),
            TensorPlan("norm.weight", "BF16", (g.hidden,))]
