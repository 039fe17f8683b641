"""Rotary position embedding as transformers' deepseek_v4 applies it.

- Only the LAST `rope_dim` dims of a vector are rotated, in interleaved pairs (2i, 2i+1) of that
  slice: out[2i] = x[2i] cos t_i - x[2i+1] sin t_i, out[2i+1] = x[2i+1] cos t_i + x[2i] sin t_i,
  t_i = pos * inv_freq[i], i < rope_dim / 2.
- Sliding-window layers use the plain frequencies of rope_theta ("main"); compressed layers
  (CSA, HCA: their queries, keys, outputs, compressed rows and the indexer) use those of
  compress_rope_theta, with YaRN when the config asks for it ("compress"). YaRN's magnitude
  factor is not applied (DeepSeek-V4 forces it to 1).
- The angle is the fp32 product float32(pos) * inv_freq (fp32), its cos and sin fp32, like
  transformers' RotaryEmbedding; the inverse rotation (attention output) uses -sin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def inv_freq_default(theta: float, rope_dim: int) -> np.ndarray:
    """1 / theta^(2i / rope_dim), fp32 [rope_dim / 2] (computed as transformers does: fp32 powers)."""
    exps = np.arange(0, rope_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rope_dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exps)).astype(np.float32)


def inv_freq_yarn(theta: float, rope_dim: int, factor: float, original_max: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> np.ndarray:
    """YaRN's blend of the original and the factor-scaled frequencies (transformers'
    _compute_yarn_parameters with truncate=True; no attention factor), fp32 [rope_dim / 2]."""
    pos_freqs = np.power(np.float32(theta),
                         np.arange(0, rope_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rope_dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = np.float32(1.0) - ramp.astype(np.float32)
    return (interpolation * (np.float32(1.0) - extrapolation_factor)
            + extrapolation * extrapolation_factor).astype(np.float32)


@dataclass(frozen=True)
class Rope:
    """One set of rotary frequencies (fp32 [rope_dim / 2])."""

    inv_freq: np.ndarray

    @property
    def dim(self) -> int:
        return 2 * len(self.inv_freq)

    def cos_sin(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        angle = np.float32(pos) * self.inv_freq
        return np.cos(angle), np.sin(angle)

    def cos_sin_rows(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos_sin of each position in pos [n]: fp32 [n, dim / 2] each, row t the same bits as
        cos_sin(pos[t]) (the same fp32 products, the same elementwise cos and sin)."""
        angle = np.asarray(pos).astype(np.float32)[:, None] * self.inv_freq[None, :]
        return np.cos(angle), np.sin(angle)

    def apply_rows(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate the last `dim` dims of each row of x [n, d] (fp32) in place by row t's cos, sin
        [n, dim / 2] (cos_sin_rows): row t as apply(x[t], pos[t]) would; returns x."""
        tail = x[:, x.shape[-1] - self.dim:]
        even, odd = tail[:, 0::2].copy(), tail[:, 1::2].copy()
        tail[:, 0::2] = even * cos - odd * sin
        tail[:, 1::2] = odd * cos + even * sin
        return x

    def apply(self, x: np.ndarray, pos: int, inverse: bool = False) -> np.ndarray:
        """Rotate the last `dim` dims of x (shape [..., d], fp32) in place at position pos; returns x."""
        cos, sin = self.cos_sin(pos)
        if inverse:
            sin = -sin
        tail = x[..., x.shape[-1] - self.dim:]
        even, odd = tail[..., 0::2].copy(), tail[..., 1::2].copy()
        tail[..., 0::2] = even * cos - odd * sin
        tail[..., 1::2] = odd * cos + even * sin
        return x
