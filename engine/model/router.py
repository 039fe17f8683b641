"""Expert selection for one token at one layer (transformers' DeepseekV4TopKRouter / HashRouter)."""
from __future__ import annotations

import numpy as np

from ds4f.native import kernels
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.ops import rms_norm, sqrt_softplus
from ds4f.engine.model.weights import RouterWeights


def router_scores(router: RouterWeights, x: np.ndarray, logits: np.ndarray,
                  scratch: np.ndarray | None = None) -> np.ndarray:
    """scores = sqrt(softplus(gate . x)), fp32 [n_experts]; `logits` is the buffer for gate . x.
    x may be rows [n, hidden] (a prefill chunk's tokens; logits [n, n_experts], scratch the
    multi-token kernel's): each row's scores are those of the row alone, bit for bit."""
    if x.ndim == 1:
        kernels.bf16_matvec(router.gate, x, out=logits)
    else:
        kernels.matmul(router.gate_native, x, logits, scratch)
    return sqrt_softplus(logits)


def row_scores(router: RouterWeights, H: np.ndarray, eps: float, xs: np.ndarray, logits: np.ndarray,
               scratch: np.ndarray, h64: np.ndarray) -> np.ndarray:
    """The router's scores of several rows at once: each row of H [n, hidden] rms-normed with the
    router's ffn_norm into xs[:n] (row by row, rms_norm's bits), then their logits in one
    multi-token call into logits[:n] (scratch: its kernel's); scores fp32 [n, n_experts], each row's
    bits those of the row alone. h64: float64 [hidden] for the norm."""
    n = len(H)
    for c in range(n):
        rms_norm(H[c], router.ffn_norm, eps, xs[c], h64)
    return router_scores(router, xs[:n], logits[:n], scratch)


def route(scores: np.ndarray, router: RouterWeights, token_id: int, geometry: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """Selected expert ids (int32 [top_k], rank order) and their weights (fp32 [top_k]).

    Hash layers select tid2eid[token_id]; learned layers the top_k of scores + bias (ties to the
    lower expert id). Weights are the unbiased scores at the selected ids, renormalised to sum 1,
    times routed_scaling_factor."""
    if router.tid2eid is not None:
        ids = np.asarray(router.tid2eid[token_id], dtype=np.int32)
    else:
        biased = scores.astype(np.float64) + router.bias
        # stable sort on the negated scores: ties go to the lower expert id, deterministically
        ids = np.argsort(-biased, kind="stable")[: geometry.top_k].astype(np.int32)
    w = scores[ids].astype(np.float64)
    w = w / (w.sum() + 1e-20) * geometry.routed_scaling_factor
    return ids, w.astype(np.float32)
