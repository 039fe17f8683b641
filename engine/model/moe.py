"""The DeepSeek-V4-Flash MoE forward pass, one token at a time (no attention yet).

    h = embed[token]                                            # [hidden] fp32
    for each layer l:
        x = rmsnorm(h) * ffn_norm                               # [hidden]
        scores = sqrt(softplus(W_gate . x))                     # [n_experts]
        ids = tid2eid[token]            if l < num_hash_layers  # [top_k]
              top_k(scores + bias)      otherwise
        w = scores[ids] / sum(scores[ids]) * routed_scaling_factor
        y_e = w2_e . (silu(min(w1_e.x, lim)) * clamp(w3_e.x, ±lim) * w_e)   # native kernel
        h = h + (sum_e y_e  +  shared(x))                       # shared: no clamp (official)
    next = argmax(head . (rmsnorm(h) * norm))

Semantics follow HF transformers' `deepseek_v4` (DeepseekV4SparseMoeBlock, its TopK/Hash
routers, DeepseekV4Experts, DeepseekV4MLP as the shared expert), computed exactly in fp32;
the official GPU code rounds activations to FP8/bf16, we do not.

Determinism: every reduction here has a fixed order, and the routed experts' outputs are
summed in routing-rank order whatever order their weights arrived from disk in, so a run's
state does not depend on I/O timing or thread counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4f.engine import kernels
from ds4f.engine.model.geometry import Geometry


@dataclass
class LayerTrunk:
    """The MoE part of one layer's trunk, as the forward pass uses it."""

    ffn_norm: np.ndarray            # fp32 [hidden]
    gate: np.ndarray                # bf16 [n_experts, hidden]
    bias: np.ndarray | None         # fp32 [n_experts] (learned layers)
    tid2eid: np.ndarray | None      # int64 [vocab, top_k] (hash layers)
    shared_w1: np.ndarray           # bf16 [inter, hidden]
    shared_w3: np.ndarray           # bf16 [inter, hidden]
    shared_w2: np.ndarray           # bf16 [hidden, inter]

    @classmethod
    def router_only(cls, t: dict[str, np.ndarray]) -> "LayerTrunk":
        """Copies of just the routing tensors (norm, gate, bias/tid2eid), nothing else kept alive."""
        return cls(ffn_norm=np.array(t["ffn_norm.weight"], dtype=np.float32), gate=np.array(t["gate.weight"]),
                   bias=np.array(t["gate.bias"], dtype=np.float32) if "gate.bias" in t else None,
                   tid2eid=np.array(t["gate.tid2eid"]) if "gate.tid2eid" in t else None,
                   shared_w1=None, shared_w3=None, shared_w2=None)  # type: ignore[arg-type]

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray]) -> "LayerTrunk":
        return cls(
            ffn_norm=np.asarray(t["ffn_norm.weight"], dtype=np.float32),
            gate=t["gate.weight"],
            bias=np.asarray(t["gate.bias"], dtype=np.float32) if "gate.bias" in t else None,
            tid2eid=t.get("gate.tid2eid"),
            shared_w1=t["shared_experts.w1.weight"],
            shared_w3=t["shared_experts.w3.weight"],
            shared_w2=t["shared_experts.w2.weight"],
        )


def rms_norm(h: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray,
             scratch64: np.ndarray | None = None) -> np.ndarray:
    """out = h / sqrt(mean(h^2) + eps) * weight, the mean taken in float64 (fixed order).
    scratch64: an optional float64 buffer of h's size, so nothing is allocated per call."""
    h64 = h.astype(np.float64) if scratch64 is None else scratch64
    if scratch64 is not None:
        np.copyto(h64, h)
    inv = np.float32(1.0 / np.sqrt(np.dot(h64, h64) / h.shape[0] + eps))
    np.multiply(h, inv, out=out)
    np.multiply(out, weight, out=out)
    return out


def sqrt_softplus(logits: np.ndarray) -> np.ndarray:
    """DeepSeek-V4's scoring function sqrt(softplus(x)), evaluated in float64, returned fp32."""
    return np.sqrt(np.logaddexp(0.0, logits.astype(np.float64))).astype(np.float32)


def route(scores: np.ndarray, trunk: LayerTrunk, token_id: int, geometry: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """Selected expert ids (int32 [top_k], rank order) and their weights (fp32 [top_k])."""
    if trunk.tid2eid is not None:
        ids = np.asarray(trunk.tid2eid[token_id], dtype=np.int32)
    else:
        biased = scores.astype(np.float64) + trunk.bias
        # stable sort on the negated scores: ties go to the lower expert id, deterministically
        ids = np.argsort(-biased, kind="stable")[: geometry.top_k].astype(np.int32)
    w = scores[ids].astype(np.float64)
    w = w / (w.sum() + 1e-20) * geometry.routed_scaling_factor
    return ids, w.astype(np.float32)


class SharedExpert:
    """The always-on shared expert on the bf16 matvec kernel (no swiglu clamp: official semantics)."""

    def __init__(self, hidden: int, inter: int) -> None:
        self.gate = np.empty(inter, np.float32)
        self.up = np.empty(inter, np.float32)
        self.act = np.empty(inter, np.float32)
        self.out = np.empty(hidden, np.float32)

    def __call__(self, trunk: LayerTrunk, x: np.ndarray) -> np.ndarray:
        kernels.bf16_matvec(trunk.shared_w1, x, out=self.gate)
        kernels.bf16_matvec(trunk.shared_w3, x, out=self.up)
        # act = silu(gate) * up = gate / (1 + exp(-gate)) * up, in place, the same fp32 operations
        act = self.act
        np.negative(self.gate, out=act)
        np.exp(act, out=act)
        act += np.float32(1.0)
        np.divide(self.gate, act, out=act)
        act *= self.up
        return kernels.bf16_matvec(trunk.shared_w2, act, out=self.out)


def expert_weights(slot: np.ndarray, layout: dict[str, tuple[int, tuple[int, ...]]]) -> kernels.ExpertWeights:
    """Views of one expert's six tensors inside its cache slot (a uint8 array)."""

    def view(name: str) -> np.ndarray:
        offset, shape = layout[name]
        n = int(np.prod(shape))
        return slot[offset:offset + n].reshape(shape)

    return kernels.ExpertWeights(view("w1.weight"), view("w1.scale"), view("w3.weight"),
                                 view("w3.scale"), view("w2.weight"), view("w2.scale"))
