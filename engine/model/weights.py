"""The weights the forward pass reads, one record per sublayer, with dtype and shape per field.

Shapes use the geometry's names: hidden (model width), n_experts (routed experts per layer),
top_k (experts per token), vocab, shared_inter (the shared expert's width), inter (a routed
expert's width). The arrays may be views into a pinned trunk buffer, a read-ahead buffer or a
cache slot: these records never own or copy memory they are given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ds4f.native import kernels
from ds4f.engine.model.attention import AttentionShape, AttentionWeights
from ds4f.engine.model.geometry import FP8_TILE
from ds4f.engine.model.hyper import HyperWeights
from ds4f.engine.model.rope import Rope


@dataclass
class RouterWeights:
    """What routing one layer needs: resident for every layer, whatever is pinned."""

    ffn_norm: np.ndarray            # fp32 [hidden]          RMSNorm weight before the MoE block
    gate: np.ndarray                # bf16 [n_experts, hidden] router logits = gate . x
    bias: np.ndarray | None         # fp32 [n_experts]       selection bias (learned layers)
    tid2eid: np.ndarray | None      # int64 [vocab, top_k]   token id -> experts (hash layers)

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray], copy: bool = False) -> "RouterWeights":
        """From a layer's trunk tensors (short names); copy=True keeps nothing else of `t` alive."""
        take = np.array if copy else np.asarray
        return cls(ffn_norm=np.array(t["ffn_norm.weight"], dtype=np.float32), gate=take(t["gate.weight"]),
                   bias=np.array(t["gate.bias"], dtype=np.float32) if "gate.bias" in t else None,
                   tid2eid=take(t["gate.tid2eid"]) if "gate.tid2eid" in t else None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.ffn_norm, self.gate, self.bias, self.tid2eid) if a is not None)

    @cached_property
    def gate_native(self) -> kernels.PreparedMatrix:
        """gate checked once, for the router's every product."""
        return kernels.prepare_bf16(self.gate)


@dataclass
class Fp8Matrix:
    """A linear's weight as shipped: E4M3 values with one E8M0 scale per 128x128 tile."""

    w: np.ndarray                   # float8_e4m3fn [rows, k]
    scale: np.ndarray               # float8_e8m0fnu [ceil(rows/128), ceil(k/128)]

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray], name: str) -> "Fp8Matrix":
        """name: the weight's name without ".weight" / ".scale"."""
        return cls(t[name + ".weight"], t[name + ".scale"])

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    def matvec(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        return kernels.fp8_matvec(self.w, self.scale, x, out=out)

    @cached_property
    def native(self) -> kernels.PreparedMatrix:
        """The weight checked once, for every product it takes part in."""
        return kernels.prepare_fp8(self.w, self.scale)

    def matmul(self, x: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """out[t] = matvec(x[t]) for each row of x [n, k], bit for bit, the weights decoded once."""
        return kernels.matmul(self.native, x, out, scratch)

    def row_blocks(self, n: int) -> list:
        """The matrix cut into n equal row blocks (a grouped projection's groups): FP8 views where
        a block is whole tiles, else each block exactly decoded to fp32 once."""
        rows = self.w.shape[0] // n
        if rows % FP8_TILE == 0:
            t = rows // FP8_TILE
            return [Fp8Matrix(self.w[g * rows:(g + 1) * rows], self.scale[g * t:(g + 1) * t]) for g in range(n)]
        dense = kernels.fp8_decode(self.w, self.scale)
        return [F32Matrix(np.ascontiguousarray(dense[g * rows:(g + 1) * rows])) for g in range(n)]


@dataclass
class Bf16Matrix:
    """A bf16 linear's weight [rows, k] (k a multiple of 32) on the bf16 matvec kernel."""

    w: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    def matvec(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        return kernels.bf16_matvec(self.w, x, out=out)

    @cached_property
    def native(self) -> kernels.PreparedMatrix:
        """The weight checked once, for every product it takes part in."""
        return kernels.prepare_bf16(self.w)

    def matmul(self, x: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """out[t] = matvec(x[t]) for each row of x [n, k], bit for bit, the weights read once."""
        return kernels.matmul(self.native, x, out, scratch)


@dataclass
class F32Matrix:
    """An fp32 weight [rows, k]: the product in float64, rounded once to fp32 (fixed order)."""

    w: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    def matvec(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        np.copyto(out, self.w.astype(np.float64) @ x.astype(np.float64))
        return out

    def matmul(self, x: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """out[t] = matvec(x[t]) for each row of x [n, k]: one float64 product per row (a product
        of matrices would sum in another order)."""
        for t in range(len(x)):
            self.matvec(x[t], out[t])
        return out


@dataclass
class SharedExpertWeights:
    """The always-on shared expert (a SwiGLU MLP without the routed experts' clamp), in FP8."""

    w1: Fp8Matrix                   # [shared_inter, hidden]  gate projection
    w3: Fp8Matrix                   # [shared_inter, hidden]  up projection
    w2: Fp8Matrix                   # [hidden, shared_inter]  down projection

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray]) -> "SharedExpertWeights":
        w1, w3, w2 = (Fp8Matrix.from_tensors(t, f"shared_experts.{w}") for w in ("w1", "w3", "w2"))
        return cls(w1=w1, w3=w3, w2=w2)


@dataclass
class MoeWeights:
    """One layer's MoE sublayer apart from its routed experts: the router and the shared expert."""

    router: RouterWeights
    shared: SharedExpertWeights

    @classmethod
    def from_tensors(cls, t: dict[str, np.ndarray]) -> "MoeWeights":
        return cls(RouterWeights.from_tensors(t), SharedExpertWeights.from_tensors(t))


@dataclass
class GlobalWeights:
    """The weights outside the layers."""

    embed: np.ndarray               # bf16 [vocab, hidden]   token embeddings
    final_norm: np.ndarray          # fp32 [hidden]          RMSNorm weight before the head
    head: np.ndarray                # bf16 [vocab, hidden]   logits = head . norm(h)
    hc_head: HyperWeights | None = None   # the head's reduction of the hyper-connection streams

    @property
    def nbytes(self) -> int:
        return nbytes_of(self)

    @cached_property
    def head_native(self) -> kernels.PreparedMatrix:
        """head checked once, for every step's logits."""
        return kernels.prepare_bf16(self.head)


@dataclass
class LayerAttention:
    """One layer's attention sublayer and both hyper-connections: resident, read every token."""

    attention: AttentionWeights     # the projections, norms, sinks, compressor and indexer
    shape: AttentionShape           # kind (swa | csa | hca), ratio and widths
    rope: Rope                      # main (swa) or compress (csa, hca) frequencies
    attn_norm: np.ndarray           # fp32 [hidden]  RMSNorm weight before the attention
    hc_attn: HyperWeights           # the hyper-connection around the attention
    hc_ffn: HyperWeights            # and around the MoE

    @property
    def nbytes(self) -> int:
        return nbytes_of(self)


def nbytes_of(obj) -> int:
    """Bytes of every array a weight record holds, however nested (matrices, lists of them)."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(o) for o in obj)
    if hasattr(obj, "__dict__"):
        return sum(nbytes_of(v) for v in vars(obj).values())
    return 0


def expert_weights(slot: np.ndarray, layout: dict[str, tuple[int, tuple[int, ...]]]) -> kernels.ExpertWeights:
    """Views of one routed expert's six MXFP4 tensors inside its cache slot (a uint8 array):
    w1, w3 [inter, hidden/2] codes with [inter, hidden/32] scales; w2 [hidden, inter/2], [hidden, inter/32]."""

    def view(name: str) -> np.ndarray:
        offset, shape = layout[name]
        n = math.prod(shape)
        return slot[offset:offset + n].reshape(shape)

    return kernels.ExpertWeights(view("w1.weight"), view("w1.scale"), view("w3.weight"),
                                 view("w3.scale"), view("w2.weight"), view("w2.scale"))
