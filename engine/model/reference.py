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


# ---- the MTP layer (ds4f-mtp.md), from the checkpoint's mtp.0.* tensors -------------------------------
def _rms64(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _rope64(x, pos, theta, dim, inverse=False):
    """Rotate the last `dim` dims of x [..., d] by interleaved pairs at position pos (float64)."""
    x = x.copy()
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    ang = pos * inv * (-1.0 if inverse else 1.0)
    c, s = np.cos(ang), np.sin(ang)
    tail = x[..., x.shape[-1] - dim:]
    ev, od = tail[..., 0::2].copy(), tail[..., 1::2].copy()
    tail[..., 0::2] = ev * c - od * s
    tail[..., 1::2] = od * c + ev * s
    return x


class ReferenceMtp:
    """The MTP layer in float64 over one sequence: step(X, token, pos) takes the main model's N
    streams of a row (X [N, hidden]) and the token after it at position pos (that token's), and
    returns (logits [vocab], the block's output streams [N, hidden]); the layer's window of keys
    is its own (the last `sliding_window` steps, this one included). Feeding the output streams
    back with a draft token is a chained draft; `copy()` branches off (the window is copied)."""

    def __init__(self, weights):
        g = self.g = weights.geometry
        self.a = g.attention
        self.w = weights
        t = lambda n: _f64(weights.global_tensor("mtp.0." + n))   # noqa: E731
        fp8 = lambda n: decode_fp8(weights.global_tensor("mtp.0." + n + ".weight"),   # noqa: E731
                                   weights.global_tensor("mtp.0." + n + ".scale"))
        self.embed = _f64(weights.global_tensor("embed.weight"))
        self.head = _f64(weights.global_tensor("head.weight"))
        self.p = {n: t(n) for n in ("enorm.weight", "hnorm.weight", "norm.weight", "attn_norm.weight",
                                    "ffn_norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
                                    "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
                                    "hc_ffn_scale", "attn.q_norm.weight", "attn.kv_norm.weight", "attn.attn_sink",
                                    "ffn.gate.weight", "ffn.gate.bias")}
        for n in ("e_proj", "h_proj", "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b",
                  "ffn.shared_experts.w1", "ffn.shared_experts.w3", "ffn.shared_experts.w2"):
            self.p[n] = fp8(n)
        self.experts: dict[int, tuple] = {}
        self.keys: list[np.ndarray] = []           # the window's keys (RoPE applied), oldest first

    def copy(self) -> "ReferenceMtp":
        other = object.__new__(ReferenceMtp)
        other.__dict__.update(self.__dict__)
        other.keys = list(self.keys)
        return other

    def _hc_pre(self, X, which):
        p, a, eps = self.p, self.a, self.g.rms_norm_eps
        N = a.hc_mult
        x = X.reshape(-1)
        mix = (p[f"hc_{which}_fn"] @ x) / np.sqrt(np.mean(x * x) + eps)
        sc, base = p[f"hc_{which}_scale"], p[f"hc_{which}_base"]
        sig = lambda v: 1 / (1 + np.exp(-v))   # noqa: E731
        pre = sig(mix[:N] * sc[0] + base[:N]) + a.hc_eps
        post = 2 * sig(mix[N:2 * N] * sc[1] + base[N:2 * N])
        lg = (mix[2 * N:] * sc[2] + base[2 * N:]).reshape(N, N)
        comb = np.exp(lg - lg.max(axis=1, keepdims=True))
        comb = comb / comb.sum(axis=1, keepdims=True) + a.hc_eps
        comb = comb / (comb.sum(axis=0, keepdims=True) + a.hc_eps)
        for _ in range(a.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(axis=1, keepdims=True) + a.hc_eps)
            comb = comb / (comb.sum(axis=0, keepdims=True) + a.hc_eps)
        return pre @ X, post, comb

    @staticmethod
    def _hc_post(X, y, post, comb):
        return comb.T @ X + post[:, None] * y[None, :]

    def _attention(self, x, pos):
        p, a, eps = self.p, self.a, self.g.rms_norm_eps
        H, hd = a.n_heads, a.head_dim
        qr = _rms64(p["attn.wq_a"] @ x, p["attn.q_norm.weight"], eps)
        q = _rms64((p["attn.wq_b"] @ qr).reshape(H, hd), None, eps)
        kv = _rms64(p["attn.wkv"] @ x, p["attn.kv_norm.weight"], eps)
        q = _rope64(q, pos, a.rope_theta, a.rope_dim)
        self.keys = (self.keys + [_rope64(kv, pos, a.rope_theta, a.rope_dim)])[-a.window:]
        K = np.array(self.keys)                                   # [n, hd], K == V
        lg = q @ K.T / np.sqrt(hd)                                # [H, n]
        sink = p["attn.attn_sink"][:, None]
        m = np.maximum(lg.max(axis=1, keepdims=True), sink)
        e = np.exp(lg - m)
        o = (e / (e.sum(axis=1, keepdims=True) + np.exp(sink - m))) @ K
        o = _rope64(o, pos, a.rope_theta, a.rope_dim, inverse=True).reshape(a.o_groups, -1)
        wo_a = p["attn.wo_a"].reshape(a.o_groups, a.o_lora_rank, -1)
        lo = np.concatenate([wo_a[gi] @ o[gi] for gi in range(a.o_groups)])
        return p["attn.wo_b"] @ lo

    def _moe(self, x):
        p, g = self.p, self.g
        silu = lambda v: v / (1 + np.exp(-v))   # noqa: E731
        x = _rms64(x, p["ffn_norm.weight"], g.rms_norm_eps)
        scores = np.sqrt(np.logaddexp(0, p["ffn.gate.weight"] @ x))
        ids = np.argsort(-(scores + p["ffn.gate.bias"]), kind="stable")[:g.top_k]
        wts = scores[ids] / scores[ids].sum() * g.routed_scaling_factor
        y = np.zeros(g.hidden)
        for e, we in zip(ids, wts):
            if int(e) not in self.experts:
                self.experts[int(e)] = expert_f64(self.w, g.n_layers, int(e))
            w1, w3, w2 = self.experts[int(e)]
            y += w2 @ (silu(np.minimum(w1 @ x, g.swiglu_limit)) * np.clip(w3 @ x, -g.swiglu_limit, g.swiglu_limit)
                       * we)
        s1, s3, s2 = (p[f"ffn.shared_experts.{n}"] for n in ("w1", "w3", "w2"))
        return y + s2 @ (silu(s1 @ x) * (s3 @ x)), sorted(int(i) for i in ids)

    def step(self, X, token: int, pos: int):
        p, eps = self.p, self.g.rms_norm_eps
        X = _f64(X)
        e = _rms64(self.embed[token], p["enorm.weight"], eps)
        X = p["h_proj"] @ _rms64(X, p["hnorm.weight"], eps).T                 # [hidden, N]
        X = (X + (p["e_proj"] @ e)[:, None]).T                                  # [N, hidden]
        h, post, comb = self._hc_pre(X, "attn")
        X = self._hc_post(X, self._attention(_rms64(h, p["attn_norm.weight"], eps), pos), post, comb)
        h, post, comb = self._hc_pre(X, "ffn")
        y, self.ids = self._moe(h)
        X = self._hc_post(X, y, post, comb)
        x = X.reshape(-1)
        mix = (p["hc_head_fn"] @ x) / np.sqrt(np.mean(x * x) + eps)
        pre = 1 / (1 + np.exp(-(mix * p["hc_head_scale"][0] + p["hc_head_base"]))) + self.a.hc_eps
        final = _rms64(pre @ X, p["norm.weight"], eps)
        return self.head @ final, X
