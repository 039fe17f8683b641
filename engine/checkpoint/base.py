"""What both checkpoint forms share: aligned buffers, direct I/O, the canonical expert and
MoE-trunk layouts, and the Checkpoint interface (see ds4f.engine.checkpoint)."""
from __future__ import annotations

import math
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from ds4f.engine.checkpoint.formats import st_itemsize, st_numpy_dtype
from ds4f.engine.checkpoint.safetensors_index import read_json
from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import Geometry, fp8_scale_shape

ALIGN = 4096
TENSOR_ALIGN = 64
POOL_JSON, POOL_BIN = "pool-mxfp4.json", "pool-mxfp4.bin"
TRUNK_JSON, TRUNK_BIN, TRUNK_OFFSETS = "trunk.json", "trunk.bin", "trunk.offsets"
POOL_FORMAT, TRUNK_FORMAT = "ds4f-pool-mxfp4", "ds4f-trunk"
# 2: FP8 tensors kept as FP8 + E8M0 tiles (1 kept them widened to bf16); trunk regions carry a crc32
LAYOUT_VERSION = 2
OFFSETS_HEADER = "# ds4f-trunk-offsets 1"
CONFIG_NAME = "config.json"
PROMPTS_NAME = "prompts.json"


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def aligned_buffer(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A zeroed uint8 array of nbytes whose address is a multiple of `align` (page-backed)."""
    m = mmap.mmap(-1, max(align_up(nbytes, align), align))
    return np.frombuffer(m, dtype=np.uint8, count=nbytes)


def _address(buf) -> int:
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    return arr.__array_interface__["data"][0]


# ---- canonical layouts (shared by both forms, by the converter and by verify) ------------
def expert_layout(g: Geometry) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (byte offset in a slot, shape): the six parts back to back, canonical order."""
    out, off = {}, 0
    for name, shape in g.expert_parts().items():
        out[name] = (off, shape)
        off += math.prod(shape)
    return out


def moe_short_tensors(g: Geometry, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(short name, dtype code in RAM, shape) of one layer's MoE trunk, in region order.
    The shared expert stays in its shipped FP8: E4M3 weights with their E8M0 128x128 tile scales."""
    si = g.shared_inter
    out = [("attn_norm.weight", "BF16", (g.hidden,)),
           ("ffn_norm.weight", "BF16", (g.hidden,)),
           ("gate.weight", "BF16", (g.n_experts, g.hidden))]
    if g.is_hash_layer(layer):
        out.append(("gate.tid2eid", "I64", (g.vocab, g.top_k)))
    else:
        out.append(("gate.bias", "F32", (g.n_experts,)))
    for w, shape in (("w1", (si, g.hidden)), ("w3", (si, g.hidden)), ("w2", (g.hidden, si))):
        out += [(f"shared_experts.{w}.weight", "F8_E4M3", shape),
                (f"shared_experts.{w}.scale", "F8_E8M0", fp8_scale_shape(shape))]
    return out


def official_name(layer: int, short: str) -> str:
    if short in ("attn_norm.weight", "ffn_norm.weight"):
        return f"layers.{layer}.{short}"
    return f"layers.{layer}.ffn.{short}"


def moe_region_layout(g: Geometry, layer: int) -> tuple[list[tuple[str, str, tuple[int, ...], int]], int]:
    """[(short, dtype, shape, offset in region)], region bytes (a multiple of 4 KiB)."""
    out, off = [], 0
    for short, dtype, shape in moe_short_tensors(g, layer):
        out.append((short, dtype, shape, off))
        off = align_up(off + math.prod(shape) * st_itemsize(dtype), TENSOR_ALIGN)
    return out, align_up(off)


def _views(buf, layout) -> dict[str, np.ndarray]:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    arr = arr.reshape(-1).view(np.uint8)
    out = {}
    for short, dtype, shape, off in layout:
        dt = st_numpy_dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        out[short] = arr[off:off + n].view(dt).reshape(shape)
    return out


def _check_buffer(buf, need: int, what: str) -> memoryview:
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(buf.reshape(-1).view(np.uint8))
    if mv.readonly:
        raise ValueError(f"{what}: buffer is read-only")
    if mv.nbytes < need:
        raise ValueError(f"{what}: buffer of {mv.nbytes} bytes, need {need}")
    return mv


def _open_direct(path: Path) -> tuple[int, str]:
    """An fd for `path`: O_DIRECT if the filesystem accepts a direct read, else buffered."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            fd = os.open(path, os.O_RDONLY | flag)
        except OSError:
            fd = -1
        if fd >= 0:
            probe = aligned_buffer(ALIGN)
            try:
                os.preadv(fd, [memoryview(probe)], 0)
                return fd, "O_DIRECT"
            except OSError:
                os.close(fd)
    try:
        return os.open(path, os.O_RDONLY), "buffered+fadvise"
    except FileNotFoundError:
        raise Ds4fError(f"{path}: missing") from None
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot open: {exc.strerror or exc}") from None


def _dontneed(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass



def expert_name(n_layers: int, layer: int, expert: int) -> str:
    """"layer 3, expert 5", or "the MTP layer, expert 5" for the record index n_layers."""
    return f"the MTP layer, expert {expert}" if layer == n_layers else f"layer {layer}, expert {expert}"

class Checkpoint:
    """Common interface; see OfficialCheckpoint and Ds4fCheckpoint."""

    path: Path
    kind: str
    geometry: Geometry
    io_mode: str
    slot_nbytes: int
    trunk_layer_buf_nbytes: int
    expert_layout: dict[str, tuple[int, tuple[int, ...]]]
    mtp_layers: int = 0            # 1: the MTP layer's experts are read as layer n_layers
    mtp_problem: str | None = None  # why mtp.* tensors there are not used as an MTP layer

    def __init__(self, path: Path, geometry: Geometry):
        self.path = path
        self.geometry = geometry
        self.expert_layout = expert_layout(geometry)
        self.expert_nbytes = geometry.expert_nbytes
        self.slot_nbytes = align_up(self.expert_nbytes)
        self.trunk_layer_buf_nbytes = max(moe_region_layout(geometry, L)[1] for L in range(geometry.n_layers))
        self._fds: list[int] = []
        self._lock = threading.Lock()

    # -- helpers
    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.geometry.n_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.geometry.n_layers - 1}")

    def expert_name(self, layer: int, expert: int) -> str:
        """How messages name a routed expert: "layer 3, expert 5"; the MTP layer's records (layer
        n_layers) as "the MTP layer, expert 5", not as a layer the model does not have."""
        return expert_name(self.geometry.n_layers, layer, expert)

    def _check_expert(self, layer: int, expert: int) -> None:
        if not (self.mtp_layers and isinstance(layer, (int, np.integer)) and layer == self.geometry.n_layers):
            self._check_layer(layer)
        if not isinstance(expert, (int, np.integer)) or not 0 <= expert < self.geometry.n_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.geometry.n_experts - 1}")

    def layer_tensors(self, layer: int, buf=None) -> dict[str, np.ndarray]:
        """A layer's MoE trunk in `buf` (default: a buffer of its own), checked where the form has
        checksums."""
        buf = aligned_buffer(self.trunk_layer_buf_nbytes) if buf is None else buf
        tensors = self.read_trunk_layer(layer, buf)
        self.check_trunk_layer(layer, buf)
        return tensors

    def check_trunk_layer(self, layer: int, buf) -> bool:
        """Compare a layer's trunk just read into buf with its checksum: True if checked (a
        mismatch raises Ds4fError). The official release has none: False."""
        return False

    @property
    def prompts(self) -> list[list[int]]:
        """Sample prompts (token ids) written by `ds4f synth`, if any."""
        p = self.path / PROMPTS_NAME
        if not p.exists():
            return []
        data = read_json(p, "prompts JSON")
        prompts = data.get("prompts") if isinstance(data, dict) else None
        if not isinstance(prompts, list) or not all(isinstance(x, list) for x in prompts):
            raise Ds4fError(f"{p}: bad prompts JSON: no list of token-id lists under 'prompts'")
        return [[int(t) for t in x] for x in prompts]

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self.path} {self.geometry}>"


