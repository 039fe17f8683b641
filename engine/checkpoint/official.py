"""The official release (safetensors shards + index + config.json), read in place."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ds4f.engine.checkpoint.base import (CONFIG_NAME, Checkpoint, _check_buffer, _dontneed, _views, moe_region_layout,
                                         official_name)
from ds4f.engine.checkpoint.formats import st_numpy_dtype
from ds4f.engine.checkpoint.safetensors_index import (INDEX_NAME, TensorInfo, load_official_index, pread_exact,
                                                      read_json)
from ds4f.engine.checkpoint.tensors import attention_tensors, layer_prefix, mtp_tensors, official_tensors
from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import Geometry

class OfficialCheckpoint(Checkpoint):
    kind = "official"

    def __init__(self, root: Path):
        cfg_path = root / CONFIG_NAME
        cfg = read_json(cfg_path, "config JSON")
        geometry = Geometry.from_config(cfg, str(cfg_path))
        super().__init__(root, geometry)
        self.io_mode = "buffered+fadvise"  # safetensors offsets are not 4 KiB-aligned
        tensors, files = load_official_index(root)
        self.tensors: dict[str, TensorInfo] = tensors
        self.files = files
        problems = check_official_tensors(geometry, tensors, root)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise Ds4fError(problems[0] + more)
        problems = check_mtp_tensors(geometry, tensors, cfg, root)
        self.mtp_layers = 0 if problems else 1
        self.mtp_problem = None if not problems or problems == [NO_MTP] else problems[0]
        self._fd_of: dict[Path, int] = {}
        try:
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                self._fds.append(fd)
                self._fd_of[f] = fd
        except OSError as exc:
            self.close()
            raise Ds4fError(f"{exc.filename}: cannot open: {exc.strerror}") from None
        self._plans = {}  # (layer, expert) -> [(file, offset, length, [(slot offset, nbytes)])]

    def _expert_plan(self, layer: int, expert: int):
        key = (layer, expert)
        plan = self._plans.get(key)
        if plan is None:
            pieces = []
            for name, (slot_off, shape) in self.expert_layout.items():
                t = self.tensors[layer_prefix(self.geometry, layer) + f"ffn.experts.{expert}.{name}"]
                pieces.append((t.file, t.offset, t.nbytes, slot_off))
            pieces.sort(key=lambda p: (str(p[0]), p[1]))
            plan = []
            for f, off, n, slot_off in pieces:
                if plan and plan[-1][0] == f and plan[-1][1] + plan[-1][2] == off:
                    last = plan[-1]
                    plan[-1] = (f, last[1], last[2] + n, last[3] + [(slot_off, n)])
                else:
                    plan.append((f, off, n, [(slot_off, n)]))
            self._plans[key] = plan
        return plan

    def expert_extents(self, layer: int, expert: int) -> list[tuple[str, int, int]]:
        self._check_expert(layer, expert)
        return [(str(f), off, n) for f, off, n, _ in self._expert_plan(layer, expert)]

    def check_expert(self, layer: int, expert: int, buf) -> bool:
        """The release has no checksums to compare with (its NaN scales show up in the run): False."""
        return False

    def read_expert(self, layer: int, expert: int, buf, check: bool = False) -> int:
        """check: nothing to check against (see check_expert)."""
        self._check_expert(layer, expert)
        mv = _check_buffer(buf, self.expert_nbytes, "read_expert")
        total = 0
        for f, off, n, segs in self._expert_plan(layer, expert):
            fd = self._fd_of[f]
            views = [mv[s:s + k] for s, k in segs]
            try:
                got = os.preadv(fd, views, off)
            except OSError as exc:
                raise Ds4fError(f"{f}: read of ({self.expert_name(layer, expert)}) failed: {exc.strerror}") from None
            if got < n:  # redo piecewise: a second short read means the shard is truncated
                pos = off
                for v in views:
                    pread_exact(fd, v, pos, f, f"({self.expert_name(layer, expert)})")
                    pos += len(v)
            _dontneed(fd, off, n)
            total += n
        return total

    # -- trunk
    def _read_tensor_into(self, t: TensorInfo, out: np.ndarray) -> None:
        pread_exact(self._fd_of[t.file], memoryview(out.reshape(-1).view(np.uint8)), t.offset, t.file, t.name)

    def _read_tensor(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        arr = np.empty(t.shape, dtype=st_numpy_dtype(t.dtype))
        self._read_tensor_into(t, arr)
        return arr

    def trunk_layer_nbytes(self, layer: int) -> int:
        self._check_layer(layer)
        return sum(self.tensors[official_name(layer, short)].nbytes
                   for short, *_ in moe_region_layout(self.geometry, layer)[0])

    def read_trunk_layer(self, layer: int, buf) -> dict[str, np.ndarray]:
        """The layer's MoE trunk in its shipped dtypes (FP8 weights with their tile scales)."""
        self._check_layer(layer)
        layout, region = moe_region_layout(self.geometry, layer)
        mv = _check_buffer(buf, region, "read_trunk_layer")
        views = _views(np.frombuffer(mv, dtype=np.uint8), layout)
        for short, _dtype, _shape, _off in layout:
            self._read_tensor_into(self.tensors[official_name(layer, short)], views[short])
        return views

    def global_tensor(self, name: str) -> np.ndarray:
        """A tensor outside the layers, as shipped."""
        if name not in self.tensors:
            raise Ds4fError(f"{self.path}: no tensor {name}")
        return self._read_tensor(name)


def check_official_tensors(g: Geometry, tensors: dict[str, TensorInfo], root: Path) -> list[str]:
    """Every tensor the engine needs is present with the official dtype and shape: the MoE trunk
    and experts, and when config.json describes attention, every layer's attention and
    hyper-connection tensors and the head's hc_head_*."""
    problems = []
    attention = {p.name: p for p in attention_tensors(g)}
    missing_attention = [n for n in attention if n not in tensors]
    if attention and len(missing_attention) == len(attention):
        # a MoE-only release (or one written by an older ds4f synth) under a config that names attention
        problems.append(f"{root / INDEX_NAME}: no attention tensors at all (none of the {len(attention)} that"
                        f" config.json's attention needs: {missing_attention[0]}, ...); config.json describes"
                        f" attention ({_attention_key(g)}) but the shards hold only the MoE part")
    for plan in official_tensors(g):
        t = tensors.get(plan.name)
        if t is None:
            if plan.name in attention:
                if len(missing_attention) < len(attention):
                    problems.append(f"{root / INDEX_NAME}: no tensor {plan.name} (config.json's attention needs"
                                    f" it: {_attention_what(g, plan.name)})")
            else:
                problems.append(f"{root / INDEX_NAME}: no tensor {plan.name} (config.json's geometry needs it)")
            continue
        ok_dtypes = {plan.dtype} | ({"U8"} if plan.dtype == "I8" else set())
        if t.dtype not in ok_dtypes:
            problems.append(f"{t.file}: {plan.name}: dtype {t.dtype}, expected {plan.dtype}")
        if tuple(t.shape) != tuple(plan.shape):
            problems.append(f"{t.file}: {plan.name}: shape {list(t.shape)}, expected {list(plan.shape)}"
                            f" for the geometry in config.json")
    beyond = sorted({int(m.group(1)) for n in tensors if (m := _LAYER_NAME.match(n)) and int(m.group(1)) >= g.n_layers})
    if beyond:   # the MTP layer is mtp.0.*: layers.N past the config's count are layers it would drop
        problems.append(f"{root / 'config.json'}: num_hidden_layers = {g.n_layers}, but the shards hold"
                        f" layers.{beyond[0]}.* tensors (up to layers.{beyond[-1]}): the config is not this"
                        f" checkpoint's, and its layers would be dropped")
    return problems


_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")
NO_MTP = "no MTP layer"


def check_mtp_tensors(g: Geometry, tensors: dict[str, TensorInfo], cfg: dict, root: Path) -> list[str]:
    """Whether the release's mtp.0.* is an MTP layer the engine can draft with: [] if so, [NO_MTP]
    when there is none, else what is wrong (the first problem names the tensor). The 0731
    release's DSpark drafter also lives under mtp.* (stages mtp.0, mtp.1, mtp.2, with dspark_*
    keys in config.json): it is recognised and refused, never read as MTP."""
    stages = sorted({n.split(".")[1] for n in tensors if n.startswith("mtp.")})
    dspark = sorted(k for k in cfg if k.startswith("dspark_"))
    if dspark or len(stages) > 1:
        what = f"config.json has {', '.join(dspark)}" if dspark else f"the shards hold stages mtp.{', mtp.'.join(stages)}"
        return [f"{root}: its mtp.* tensors are a DSpark drafter ({what}), not an MTP layer: speculative"
                f" decoding with it is not supported (plain decoding runs)"]
    if not stages:
        return [NO_MTP]
    if g.attention is None:
        return [f"{root}: mtp.0.* tensors under a config without attention: the MTP layer needs it"]
    if g.attention.n_layers < len(cfg.get("compress_ratios") or []) and cfg["compress_ratios"][g.n_layers] != 0:
        return [f"{root / CONFIG_NAME}: compress_ratios[{g.n_layers}] = {cfg['compress_ratios'][g.n_layers]}:"
                f" the MTP layer has sliding-window attention only (0)"]
    problems = []
    for plan in mtp_tensors(g):
        t = tensors.get(plan.name)
        if t is None:
            problems.append(f"{root / INDEX_NAME}: no tensor {plan.name} (the MTP layer needs it)")
        elif t.dtype not in {plan.dtype} | ({"U8"} if plan.dtype == "I8" else set()):
            problems.append(f"{t.file}: {plan.name}: dtype {t.dtype}, expected {plan.dtype}")
        elif tuple(t.shape) != tuple(plan.shape):
            problems.append(f"{t.file}: {plan.name}: shape {list(t.shape)}, expected {list(plan.shape)}")
    return problems


def _attention_key(g: Geometry) -> str:
    a = g.attention
    return f"num_attention_heads {a.n_heads}, compress_ratios {list(a.layer_ratios)}"


def _attention_what(g: Geometry, name: str) -> str:
    """Which part of the attention a tensor belongs to, for a message."""
    if not name.startswith("layers."):
        return "the head's hyper-connection reduction"
    layer = int(name.split(".")[1])
    kind = g.attention.kind(layer)
    what = {"swa": "sliding window only", "csa": f"CSA, ratio {g.attention.ratio(layer)}",
            "hca": f"HCA, ratio {g.attention.ratio(layer)}"}[kind]
    return f"layer {layer} is {what}"
