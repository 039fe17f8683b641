"""The float64 reference forward pass: written from the model's definition (DESIGN.md,
transformers' deepseek_v4), with ml_dtypes decoding the MXFP4 experts, sharing no code with the
engine's fp32 path (it imports nothing from ds4f). Tests, tools and benchmarks judge the engine
against it.

`weights` is any object with the checkpoint's reading methods (geometry, layer_tensors(layer),
global_tensor(name), read_expert(layer, e, buf), expert_layout, slot_nbytes), such as an open
Checkpoint: this module itself opens no file.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


def decode_mxfp4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (official packing: element 2i in the low nibble) -> float64 [rows, k], via ml_dtypes."""
    rows = codes.shape[0]
    nib = np.empty((rows, codes.shape[1] * 2), np.uint8)
    nib[:, 0::2] = codes & 0x0F
    nib[:, 1::2] = codes >> 4
    vals = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sc = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return vals * np.repeat(sc, 32, axis=1)


def decode_fp8(w: np.ndarray, scale: np.ndarray, tile: int = 128) -> np.ndarray:
    """FP8 E4M3 [rows, k] with E8M0 scales per tile x tile block -> float64 [rows, k], via ml_dtypes.
    The tile is the format's 128, written here and not taken from the kernels: this is the
    independent reference they are checked against."""
    vals = np.asarray(w).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sc = np.asarray(scale).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    rows, k = vals.shape
    return vals * np.repeat(np.repeat(sc, tile, axis=0), tile, axis=1)[:rows, :k]


def expert_f64(weights, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(w1, w3, w2) of one routed expert in float64."""
    buf = np.zeros(weights.slot_nbytes + 4096, np.uint8)
    off = (-buf.ctypes.data) % 4096
    slot = buf[off:off + weights.slot_nbytes]
    weights.read_expert(layer, e, slot)
    part = {}
    for name, (o, shape) in weights.expert_layout.items():
        part[name] = slot[o:o + int(np.prod(shape))].reshape(shape)
    return (decode_mxfp4(part["w1.weight"], part["w1.scale"]), decode_mxfp4(part["w3.weight"], part["w3.scale"]),
            decode_mxfp4(part["w2.weight"], part["w2.scale"]))


def _f64(a):
    return np.asarray(a).astype(np.float64)


def reference_step(weights, token: int):
    """(next token, ids [L] sorted per layer, hidden [L, H]) for one token from an empty state, in float64."""
    g = weights.geometry
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    h = _f64(weights.global_tensor("embed.weight")[token])
    ids_all, hid_all = [], []
    for layer in range(g.n_layers):
        t = weights.layer_tensors(layer)
        x = h / np.sqrt(np.mean(h * h) + g.rms_norm_eps) * _f64(t["ffn_norm.weight"])
        scores = np.sqrt(np.logaddexp(0, _f64(t["gate.weight"]) @ x))
        if "gate.tid2eid" in t:
            ids = np.asarray(t["gate.tid2eid"][token])
        else:
            ids = np.argsort(-(scores + _f64(t["gate.bias"])), kind="stable")[: g.top_k]
        w = scores[ids] / scores[ids].sum() * g.routed_scaling_factor
        y = np.zeros(g.hidden)
        for e, we in zip(ids, w):
            w1, w3, w2 = expert_f64(weights, layer, int(e))
            act = silu(np.minimum(w1 @ x, g.swiglu_limit)) * np.clip(w3 @ x, -g.swiglu_limit, g.swiglu_limit)
            y += w2 @ (act * we)
        s1, s3, s2 = (decode_fp8(t[f"shared_experts.{n}.weight"], t[f"shared_experts.{n}.scale"])
                      for n in ("w1", "w3", "w2"))
        y += s2 @ (silu(s1 @ x) * (s3 @ x))
        h = h + y
        ids_all.append(sorted(int(i) for i in ids))
        hid_all.append(h.copy())
    final = h / np.sqrt(np.mean(h * h) + g.rms_norm_eps) * _f64(weights.global_tensor("norm.weight"))
    logits = _f64(weights.global_tensor("head.weight")) @ final
    return int(np.argmax(logits)), ids_all, np.array(hid_all)
