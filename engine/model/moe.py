"""The MoE sublayer's arithmetic: the routed experts, the shared expert and their sum
(transformers' DeepseekV4SparseMoeBlock after its RMSNorm, computed exactly in fp32).

    y_e = w2_e . (silu(min(w1_e . x, lim)) * clamp(w3_e . x, -lim, lim) * weight_e)   native kernel
    y   = sum over e in routing-rank order of y_e  +  shared(x)
    shared(x) = w2 . (silu(w1 . x) * (w3 . x))          no clamp: the official semantics

The official GPU code rounds activations to FP8 before its FP4 products and to bf16 before w2;
ds4f does not.
"""
from __future__ import annotations

import numpy as np

from ds4f.native import kernels
from ds4f.engine.model.ops import silu_mul
from ds4f.engine.model.weights import SharedExpertWeights


class MoeBuffers:
    """Everything the MoE sublayer writes, allocated once (the forward allocates nothing per token)."""

    def __init__(self, hidden: int, inter: int, shared_inter: int, top_k: int) -> None:
        self.ys = np.empty((top_k, hidden), np.float32)        # each routed expert's output, by rank
        self.each = np.empty((top_k, hidden), np.float32)      # one kernel call's outputs, in call order
        self.y = np.empty(hidden, np.float32)                  # the sublayer's output
        self.scratch = kernels.experts_scratch(min(top_k, kernels.MAX_EXPERTS), hidden, inter)
        self.shared_gate = np.empty(shared_inter, np.float32)
        self.shared_up = np.empty(shared_inter, np.float32)
        self.shared_act = np.empty(shared_inter, np.float32)
        self.shared_out = np.empty(hidden, np.float32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))


def routed_experts(ready: list[tuple[int, kernels.ExpertWeights]], weights: np.ndarray, x: np.ndarray,
                   limit: float, buf: MoeBuffers) -> None:
    """buf.ys[rank] = each ready routed expert's output on x, scaled by its routing weight
    weights[rank]. The experts of one call run together on the native pool; each output is
    the same whichever experts share the call, so the result never depends on I/O timing."""
    for i in range(0, len(ready), kernels.MAX_EXPERTS):
        part = ready[i:i + kernels.MAX_EXPERTS]
        each = buf.each[:len(part)]
        kernels.experts_forward_each([w for _, w in part], [weights[r] for r, _ in part], x, limit, each, buf.scratch)
        for j, (rank, _) in enumerate(part):
            buf.ys[rank] = each[j]


def shared_expert(w: SharedExpertWeights, x: np.ndarray, buf: MoeBuffers) -> np.ndarray:
    """The shared expert on the FP8 matvec kernel, into buf.shared_out."""
    w.w1.matvec(x, buf.shared_gate)
    w.w3.matvec(x, buf.shared_up)
    silu_mul(buf.shared_gate, buf.shared_up, out=buf.shared_act)
    return w.w2.matvec(buf.shared_act, buf.shared_out)


def combine(buf: MoeBuffers) -> np.ndarray:
    """y = the routed outputs summed in routing-rank order, then the shared expert's."""
    return sum_outputs(buf.ys, buf.shared_out, buf.y)


def sum_outputs(ys: np.ndarray, shared_out: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y = ys[0] + ys[1] + ... (routing-rank order) + shared_out, in fp32, in that order: ys
    [top_k, hidden] for one token, or [n, top_k, hidden] with shared_out and y [n, hidden] for n
    (element by element, so each token's sums are those it gets alone)."""
    y[...] = ys[..., 0, :]
    for r in range(1, ys.shape[-2]):
        y += ys[..., r, :]
    y += shared_out
    return y
