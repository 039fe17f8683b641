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

from ds4f.engine.model.ops import silu_mul
from ds4f.engine.model.weights import SharedExpertWeights


def shared_expert(w: SharedExpertWeights, xs: np.ndarray, gate: np.ndarray, up: np.ndarray, act: np.ndarray,
                  out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """The shared expert on each row of xs [n, hidden] into out [n, hidden], each FP8 weight decoded
    once for all rows (gate, up, act: [n, shared_inter] work space; scratch: kernels.matmul_scratch)."""
    w.w1.matmul(xs, gate, scratch)
    w.w3.matmul(xs, up, scratch)
    silu_mul(gate, up, out=act)
    return w.w2.matmul(act, out, scratch)


def sum_outputs(ys: np.ndarray, shared_out: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y = ys[0] + ys[1] + ... (routing-rank order) + shared_out, in fp32, in that order: ys
    [top_k, hidden] for one token, or [n, top_k, hidden] with shared_out and y [n, hidden] for n
    (element by element, so each token's sums are those it gets alone)."""
    y[...] = ys[..., 0, :]
    for r in range(1, ys.shape[-2]):
        y += ys[..., r, :]
    y += shared_out
    return y
