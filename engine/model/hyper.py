"""Manifold-constrained hyper-connections (mHC): the residual stream is N streams X [N, hidden].

Around each sublayer (transformers' DeepseekV4HyperConnection, DeepseekV4DecoderLayer):

    xn   = X.flatten() / sqrt(mean(X^2) + rms_norm_eps)          # [N * hidden], no weight
    mix  = fn . xn                                               # fn [(2 + N) N, N * hidden]
    pre  = sigmoid(mix[0:N] * scale[0] + base[0:N]) + hc_eps     # how much of each stream enters
    post = 2 sigmoid(mix[N:2N] * scale[1] + base[N:2N])          # how the output spreads back
    C    = softmax over j of (mix[2N + N i + j] * scale[2] + base[...]) + hc_eps        # [N, N]
    C   /= column sums + hc_eps; then (rows, columns) again, hc_sinkhorn_iters rounds in all
    h    = sum_k pre[k] X[k]                                     # the sublayer's input (before its norm)
    X'[k] = post[k] y + sum_j C[j, k] X[j]                       # after the sublayer's output y

The head reduces the streams with its own pre weights (no post, no Sinkhorn) before the final norm.
All of it is native (kernels.hc_pre, hc_post: one piece of C for every backend, in float64, each sum
in index order, results rounded to fp32): the mix (the norm and the wide products) on the fp32
weights widened as they are read, then pre, post, the Sinkhorn rounds and the streams' sums,
with no float64 copy of a weight or a stream made per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4f.native import kernels
from ds4f.engine.model.ops import in_halves


@dataclass
class HyperWeights:
    """One hyper-connection (around attention, around the MoE, or the head's reduction)."""

    fn_t: np.ndarray                # fp32 [N hidden, (2 + N) N]  (head: [N hidden, N]): fn transposed
    base: np.ndarray                # fp32 [(2 + N) N]            (head: [N])
    scale: np.ndarray               # fp32 [3]                    (head: [1])

    @classmethod
    def of(cls, fn: np.ndarray, base: np.ndarray, scale: np.ndarray) -> "HyperWeights":
        """From the checkpoint's tensors (fn fp32 [(2 + N) N, N hidden]); fn is kept transposed,
        in a copy (the kernel reads one element's weights for every row together)."""
        return cls(np.ascontiguousarray(np.asarray(fn, np.float32).T), base, scale)


HC_BLOCK = 32   # tokens whose float64 streams hc_pre_rows holds at a time (4 MiB at the real width)


def hc_pre(X: np.ndarray, w: HyperWeights, eps: float, hc_eps: float,
           sinkhorn_iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(h fp32 [hidden], post float64 [N], C float64 [N, N]) for the streams X [N, hidden]:
    hc_pre_rows on one token."""
    h, post, comb = hc_pre_rows(X[None], w, eps, hc_eps, sinkhorn_iters)
    return h[0], post[0], comb[0]


def hc_pre_rows(X: np.ndarray, w: HyperWeights, eps: float, hc_eps: float, sinkhorn_iters: int,
                beside=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """hc_pre of n tokens at once, X [n, N, hidden]: (h fp32 [n, hidden], post float64 [n, N],
    C float64 [n, N, N]).
    Each token's mix is its own matrix-vector product, as for a token alone; everything after it
    works element by element or sums N terms in order along one axis, so a token's results do
    not depend on the others in the batch (a prefill chunk's equal decode's, bit for bit).
    beside(fn, *args) (runtime.helper_thread): where the first half of more than HC_BLOCK tokens runs
    while this thread does the second (numpy and BLAS release the GIL for the bulk of it)."""
    parts = in_halves(beside, lambda a, b: _hc_pre_rows(X[a:b], w, eps, hc_eps, sinkhorn_iters), len(X), HC_BLOCK)
    return parts[0] if len(parts) == 1 else tuple(np.concatenate(p) for p in zip(*parts))


def _hc_pre_rows(X: np.ndarray, w: HyperWeights, eps: float, hc_eps: float,
                 sinkhorn_iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return kernels.hc_pre(np.ascontiguousarray(X), w.fn_t, w.base, w.scale, eps, hc_eps, sinkhorn_iters)


def hc_post(X: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """X'[k] = post[k] y + sum_j C[j, k] X[j], fp32 [N, hidden] (X is replaced in place and returned):
    hc_post_rows on one token."""
    hc_post_rows(X[None], y[None], post[None], comb[None])
    return X


def hc_post_rows(X: np.ndarray, Y: np.ndarray, post: np.ndarray, comb: np.ndarray, beside=None) -> np.ndarray:
    """hc_post of n tokens at once: X [n, N, hidden] (replaced in place and returned), their
    sublayer outputs Y [n, hidden], post [n, N], C [n, N, N]. Each token's sum over j is its own
    N x N by N x hidden product (matmul takes the stack one matrix at a time), the rest works
    element by element, so a token's bits do not depend on the others in the batch. HC_BLOCK
    tokens at a time (their float64 copies stay small); beside (runtime.helper_thread): where the first
    half of more than HC_BLOCK tokens runs while this thread does the second."""
    in_halves(beside, lambda a, b: _hc_post_rows(X[a:b], Y[a:b], post[a:b], comb[a:b]), len(X), HC_BLOCK)
    return X


def _hc_post_rows(X: np.ndarray, Y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> None:
    kernels.hc_post(X, np.ascontiguousarray(Y), post, comb)


def hc_head(X: np.ndarray, w: HyperWeights, eps: float, hc_eps: float) -> np.ndarray:
    """The head's reduction of the streams: sum_k pre[k] X[k], fp32 [hidden]."""
    return kernels.hc_pre(np.ascontiguousarray(X)[None], w.fn_t, w.base, w.scale, eps, hc_eps, 1)[0][0]
