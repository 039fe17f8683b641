"""Expert selection for one token at one layer (transformers' DeepseekV4TopKRouter / HashRouter)."""
from __future__ import annotations

import numpy as np

from ds4f.native import kernels
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.model.ops import sqrt_softplus
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
