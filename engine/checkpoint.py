"""One reading interface for both checkpoint forms.

    ck = open_checkpoint(path)      # official shards (read in place) or the ds4f layout
    ck.geometry, ck.kind, ck.io_mode
    ck.layer_tensors(layer)         # MoE trunk of a layer, short names, bf16/f32/i64 arrays
    ck.read_trunk_layer(layer, buf) # the same as views into `buf`, one read (ds4f layout)
    ck.global_tensor("embed.weight")
    ck.expert_extents(layer, e)     # byte ranges on disk: ds4f one, official two
    ck.read_expert(layer, e, buf)   # into a 4096-aligned slot, canonical layout, thread-safe

The ds4f layout (written by ds4f.engine.convert):

pool-mxfp4.bin   one record per (layer, expert), index layer * n_experts + expert, each
                 at a 4 KiB-aligned offset and padded with zeros to `record_nbytes`
                 (a multiple of 4 KiB): [w1.weight | w3.weight | w2.weight | w1.scale |
                 w3.scale | w2.scale], the official bytes unchanged. A miss is one O_DIRECT pread.
pool-mxfp4.json  {"format": "ds4f-pool-mxfp4", "version": 1, "geometry": config, "file",
                 "alignment", "expert_nbytes", "record_nbytes", "parts": {name: {offset,
                 shape}}, "records": [[offset, crc32], ...]}; crc32 (zlib) of the record's
                 expert_nbytes bytes.
trunk.bin        per layer, a 4 KiB-aligned region with that layer's MoE trunk (norms,
                 gate weight, bias or tid2eid, shared expert in bf16), then a region with
                 the layer's other tensors (attention etc., real release only), then one
                 global region (embed, head, final norm, anything else).
trunk.offsets    text: a "# ds4f-trunk-offsets 1" line, then one line per region:
                 "<region> <offset> <nbytes>" with region "layer.N", "extra.N" or "global".
trunk.json       {"format": "ds4f-trunk", "version": 1, "geometry", "file", "alignment",
                 "regions": [{name, offset, nbytes}], "tensors": [{name, short, layer,
                 region, dtype, shape, offset, nbytes}]}; official names, FP8 now BF16.
config.json      copied from the release.
"""
from __future__ import annotations

import math
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from ds4f.engine.errors import Ds4fError
from ds4f.engine.formats import dequantize_fp8, st_itemsize, st_numpy_dtype
from ds4f.engine.geometry import Geometry
from ds4f.engine.safetensors_index import INDEX_NAME, TensorInfo, load_official_index, pread_exact, read_json

ALIGN = 4096
TENSOR_ALIGN = 64
POOL_JSON, POOL_BIN = "pool-mxfp4.json", "pool-mxfp4.bin"
TRUNK_JSON, TRUNK_BIN, TRUNK_OFFSETS = "trunk.json", "trunk.bin", "trunk.offsets"
POOL_FORMAT, TRUNK_FORMAT, LAYOUT_VERSION = "ds4f-pool-mxfp4", "ds4f-trunk", 1
OFFSETS_HEADER = "# ds4f-trunk-offsets 1"
CONFIG_NAME = "config.json"
PROMPTS_NAME = "prompts.json"
GLOBAL_NAMES = ("embed.weight", "head.weight", "norm.weight")


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
    """(short name, dtype code in RAM, shape) of one layer's MoE trunk, in region order."""
    si = g.shared_inter
    out = [("attn_norm.weight", "BF16", (g.hidden,)),
           ("ffn_norm.weight", "BF16", (g.hidden,)),
           ("gate.weight", "BF16", (g.n_experts, g.hidden))]
    if g.is_hash_layer(layer):
        out.append(("gate.tid2eid", "I64", (g.vocab, g.top_k)))
    else:
        out.append(("gate.bias", "F32", (g.n_experts,)))
    out += [("shared_experts.w1.weight", "BF16", (si, g.hidden)),
            ("shared_experts.w3.weight", "BF16", (si, g.hidden)),
            ("shared_experts.w2.weight", "BF16", (g.hidden, si))]
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


class Checkpoint:
    """Common interface; see OfficialCheckpoint and Ds4fCheckpoint."""

    path: Path
    kind: str
    geometry: Geometry
    io_mode: str
    slot_nbytes: int
    trunk_layer_buf_nbytes: int
    expert_layout: dict[str, tuple[int, tuple[int, ...]]]

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

    def _check_expert(self, layer: int, expert: int) -> None:
        self._check_layer(layer)
        if not isinstance(expert, (int, np.integer)) or not 0 <= expert < self.geometry.n_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.geometry.n_experts - 1}")

    def layer_tensors(self, layer: int) -> dict[str, np.ndarray]:
        buf = aligned_buffer(self.trunk_layer_buf_nbytes)
        return self.read_trunk_layer(layer, buf)

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


# ---- the official release, read in place --------------------------------------------------
class OfficialCheckpoint(Checkpoint):
    kind = "official"

    def __init__(self, root: Path):
        cfg_path = root / CONFIG_NAME
        geometry = Geometry.from_config(read_json(cfg_path, "config JSON"), str(cfg_path))
        super().__init__(root, geometry)
        self.io_mode = "buffered+fadvise"  # safetensors offsets are not 4 KiB-aligned
        tensors, files = load_official_index(root)
        self.tensors: dict[str, TensorInfo] = tensors
        self.files = files
        problems = check_official_tensors(geometry, tensors, root)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise Ds4fError(problems[0] + more)
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
                t = self.tensors[f"layers.{layer}.ffn.experts.{expert}.{name}"]
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

    def read_expert(self, layer: int, expert: int, buf) -> int:
        self._check_expert(layer, expert)
        mv = _check_buffer(buf, self.expert_nbytes, "read_expert")
        total = 0
        for f, off, n, segs in self._expert_plan(layer, expert):
            fd = self._fd_of[f]
            views = [mv[s:s + k] for s, k in segs]
            try:
                got = os.preadv(fd, views, off)
            except OSError as exc:
                raise Ds4fError(f"{f}: read of (layer {layer}, expert {expert}) failed: {exc.strerror}") from None
            if got < n:  # redo piecewise: a second short read means the shard is truncated
                pos = off
                for v in views:
                    pread_exact(fd, v, pos, f, f"(layer {layer}, expert {expert})")
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
        n = 0
        for short, _dt, _shape, _off in moe_region_layout(self.geometry, layer)[0]:
            name = official_name(layer, short)
            n += self.tensors[name].nbytes
            sc = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
            if sc in self.tensors and self.tensors[name].dtype.startswith("F8"):
                n += self.tensors[sc].nbytes
        return n

    def read_trunk_layer(self, layer: int, buf) -> dict[str, np.ndarray]:
        self._check_layer(layer)
        layout, region = moe_region_layout(self.geometry, layer)
        mv = _check_buffer(buf, region, "read_trunk_layer")
        views = _views(np.frombuffer(mv, dtype=np.uint8), layout)
        for short, dtype, shape, _off in layout:
            name = official_name(layer, short)
            t = self.tensors[name]
            if t.dtype == "F8_E4M3":
                w = self._read_tensor(name)
                s = self._read_tensor(name[: -len(".weight")] + ".scale")
                dequantize_fp8(w, s, name=f"{t.file}: {name}", out=views[short])
            else:
                self._read_tensor_into(t, views[short])
        return views

    def global_tensor(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise Ds4fError(f"{self.path}: no tensor {name}")
        t = self.tensors[name]
        arr = self._read_tensor(name)
        scale = name[: -len(".weight")] + ".scale"
        if t.dtype == "F8_E4M3" and scale in self.tensors:
            arr = dequantize_fp8(arr, self._read_tensor(scale), name=f"{t.file}: {name}")
        return arr


def check_official_tensors(g: Geometry, tensors: dict[str, TensorInfo], root: Path) -> list[str]:
    """Every tensor the engine needs is present with the official dtype and shape."""
    from ds4f.engine.geometry import official_tensors

    problems = []
    for plan in official_tensors(g):
        t = tensors.get(plan.name)
        if t is None:
            problems.append(f"{root / INDEX_NAME}: no tensor {plan.name} (config.json's geometry needs it)")
            continue
        ok_dtypes = {plan.dtype} | ({"U8"} if plan.dtype == "I8" else set())
        if t.dtype not in ok_dtypes:
            problems.append(f"{t.file}: {plan.name}: dtype {t.dtype}, expected {plan.dtype}")
        if tuple(t.shape) != tuple(plan.shape):
            problems.append(f"{t.file}: {plan.name}: shape {list(t.shape)}, expected {list(plan.shape)}"
                            f" for the geometry in config.json")
    return problems


# ---- the ds4f layout ---------------------------------------------------------------------
class Ds4fCheckpoint(Checkpoint):
    kind = "ds4f"

    def __init__(self, root: Path):
        state, problems = load_ds4f_layout(root)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise Ds4fError(problems[0] + more)
        super().__init__(root, state["geometry"])
        self.pool_path: Path = state["pool_path"]
        self.trunk_path: Path = state["trunk_path"]
        self.record_offsets: np.ndarray = state["record_offsets"]
        self.record_crc32: np.ndarray = state["record_crc32"]
        self.record_nbytes: int = state["record_nbytes"]
        self.slot_nbytes = self.record_nbytes
        self.regions: dict[str, tuple[int, int]] = state["regions"]
        self.trunk_tensors: dict[str, dict] = state["tensors"]
        self._layer_layout = state["layer_layout"]
        self.trunk_layer_buf_nbytes = max(self.regions[f"layer.{L}"][1] for L in range(self.geometry.n_layers))
        self._pool_fd, self.io_mode = _open_direct(self.pool_path)
        self._fds.append(self._pool_fd)
        self._trunk_fd, self._trunk_mode = _open_direct(self.trunk_path)
        self._fds.append(self._trunk_fd)
        self._pool_buffered = os.open(self.pool_path, os.O_RDONLY)
        self._fds.append(self._pool_buffered)
        self._trunk_buffered = os.open(self.trunk_path, os.O_RDONLY)
        self._fds.append(self._trunk_buffered)

    def expert_extents(self, layer: int, expert: int) -> list[tuple[str, int, int]]:
        self._check_expert(layer, expert)
        off = int(self.record_offsets[layer * self.geometry.n_experts + expert])
        return [(str(self.pool_path), off, self.record_nbytes)]

    def _direct_read(self, direct_fd: int, mode: str, buffered_fd: int, path: Path, mv: memoryview,
                     offset: int, what: str) -> int:
        n = len(mv)
        use_direct = mode == "O_DIRECT" and _address(mv) % ALIGN == 0 and n % ALIGN == 0
        fd = direct_fd if use_direct else buffered_fd
        try:
            got = os.preadv(fd, [mv], offset)
        except OSError as exc:
            raise Ds4fError(f"{path}: read of {what} failed: {exc.strerror or exc}") from None
        if got < n:
            if use_direct or got == 0:
                raise Ds4fError(f"{path}: truncated: short read of {what} at byte {offset}"
                                f" ({got} of {n} bytes)")
            pread_exact(fd, mv[got:], offset + got, path, what)
        if not use_direct:
            _dontneed(fd, offset, n)
        return n

    def read_expert(self, layer: int, expert: int, buf) -> int:
        self._check_expert(layer, expert)
        mv = _check_buffer(buf, self.record_nbytes, "read_expert")[: self.record_nbytes]
        off = int(self.record_offsets[layer * self.geometry.n_experts + expert])
        return self._direct_read(self._pool_fd, self.io_mode, self._pool_buffered, self.pool_path, mv, off,
                                 f"(layer {layer}, expert {expert})")

    def trunk_layer_nbytes(self, layer: int) -> int:
        self._check_layer(layer)
        return self.regions[f"layer.{layer}"][1]

    def read_trunk_layer(self, layer: int, buf) -> dict[str, np.ndarray]:
        self._check_layer(layer)
        off, n = self.regions[f"layer.{layer}"]
        mv = _check_buffer(buf, n, "read_trunk_layer")[:n]
        self._direct_read(self._trunk_fd, self._trunk_mode, self._trunk_buffered, self.trunk_path, mv, off,
                          f"trunk layer {layer}")
        return _views(np.frombuffer(mv, dtype=np.uint8), self._layer_layout[layer])

    def global_tensor(self, name: str) -> np.ndarray:
        t = self.trunk_tensors.get(name)
        if t is None:
            raise Ds4fError(f"{self.path / TRUNK_JSON}: no tensor {name}")
        arr = np.empty(t["shape"], dtype=st_numpy_dtype(t["dtype"]))
        pread_exact(self._trunk_buffered, memoryview(arr.reshape(-1).view(np.uint8)), t["offset"],
                    self.trunk_path, name)
        return arr


def _pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def load_ds4f_layout(root: Path, *, check_sizes: bool = True) -> tuple[dict, list[str]]:
    """Parse and validate the ds4f layout's JSON files; (state, problems). Used by open and verify."""
    problems: list[str] = []
    state: dict = {}
    cfg_path, pool_json, trunk_json = root / CONFIG_NAME, root / POOL_JSON, root / TRUNK_JSON
    try:
        g = Geometry.from_config(read_json(cfg_path, "config JSON"), str(cfg_path))
    except Ds4fError as exc:
        return state, [str(exc)]
    state["geometry"] = g
    try:
        pool = read_json(pool_json, "pool JSON")
        trunk = read_json(trunk_json, "trunk JSON")
    except Ds4fError as exc:
        return state, [str(exc)]
    for path, doc, fmt in ((pool_json, pool, POOL_FORMAT), (trunk_json, trunk, TRUNK_FORMAT)):
        if not isinstance(doc, dict) or doc.get("format") != fmt:
            problems.append(f"{path}: not a {fmt} file (format {doc.get('format') if isinstance(doc, dict) else None!r})")
        elif doc.get("version") != LAYOUT_VERSION:
            problems.append(f"{path}: version {doc.get('version')!r}, this ds4f reads version {LAYOUT_VERSION}")
        elif doc.get("geometry") != g.to_config():
            try:
                other = Geometry.from_config(doc.get("geometry"), f"{path} geometry")
                if other != g:
                    problems.append(f"{path}: geometry differs from {cfg_path}")
            except Ds4fError as exc:
                problems.append(str(exc))
    if problems:
        return state, problems

    # -- pool
    n_rec = g.n_layers * g.n_experts
    rec_n = pool.get("record_nbytes")
    want_rec = align_up(g.expert_nbytes)
    pool_path = root / str(pool.get("file", POOL_BIN))
    state["pool_path"] = pool_path
    if pool.get("expert_nbytes") != g.expert_nbytes:
        problems.append(f"{pool_json}: expert_nbytes {pool.get('expert_nbytes')!r}, the geometry gives {g.expert_nbytes}")
    if not _pos_int(rec_n) or rec_n % ALIGN or rec_n < g.expert_nbytes:
        problems.append(f"{pool_json}: record_nbytes {rec_n!r} is not a multiple of {ALIGN} holding an expert"
                        f" of {g.expert_nbytes} bytes")
        rec_n = want_rec
    state["record_nbytes"] = rec_n
    parts = pool.get("parts")
    canon = {k: {"offset": off, "shape": list(shape)} for k, (off, shape) in expert_layout(g).items()}
    if parts != canon:
        problems.append(f"{pool_json}: parts {parts!r} differ from the canonical expert layout {canon!r}")
    records = pool.get("records")
    offs = np.zeros(n_rec, dtype=np.int64)
    crcs = np.zeros(n_rec, dtype=np.int64)
    if not isinstance(records, list) or len(records) != n_rec:
        problems.append(f"{pool_json}: {len(records) if isinstance(records, list) else 'no'} records,"
                        f" expected {n_rec} ({g.n_layers} layers x {g.n_experts} experts)")
    else:
        for i, r in enumerate(records):
            if not (isinstance(r, list) and len(r) == 2 and _pos_int(r[0]) and _pos_int(r[1]) and r[1] < 2 ** 32):
                problems.append(f"{pool_json}: record {i}: bad entry {r!r} (expected [offset, crc32])")
                continue
            offs[i], crcs[i] = r
            if r[0] % ALIGN:
                problems.append(f"{pool_json}: record {i} (layer {i // g.n_experts}, expert {i % g.n_experts})"
                                f" at offset {r[0]} is not {ALIGN}-aligned")
    state["record_offsets"], state["record_crc32"] = offs, crcs
    if check_sizes:
        if not pool_path.exists():
            problems.append(f"{pool_path}: missing")
        elif n_rec and isinstance(records, list) and len(records) == n_rec:
            size = pool_path.stat().st_size
            end = int(offs.max()) + rec_n
            if size < end:
                bad = int(np.count_nonzero(offs + rec_n > size))
                problems.append(f"{pool_path}: truncated: {size} bytes, records need {end}"
                                f" ({bad} records reach past the end)")

    # -- trunk
    trunk_path = root / str(trunk.get("file", TRUNK_BIN))
    state["trunk_path"] = trunk_path
    tsize = trunk_path.stat().st_size if trunk_path.exists() else None
    if check_sizes and tsize is None:
        problems.append(f"{trunk_path}: missing")
    regions: dict[str, tuple[int, int]] = {}
    for r in trunk.get("regions") or []:
        if not (isinstance(r, dict) and isinstance(r.get("name"), str) and _pos_int(r.get("offset"))
                and _pos_int(r.get("nbytes"))):
            problems.append(f"{trunk_json}: bad region entry {r!r}")
            continue
        regions[r["name"]] = (r["offset"], r["nbytes"])
        if r["offset"] % ALIGN or r["nbytes"] % ALIGN:
            problems.append(f"{trunk_json}: region {r['name']} ({r['offset']}, {r['nbytes']}) is not {ALIGN}-aligned")
        if check_sizes and tsize is not None and r["offset"] + r["nbytes"] > tsize:
            problems.append(f"{trunk_path}: truncated: region {r['name']} ends at {r['offset'] + r['nbytes']}"
                            f" but the file has {tsize} bytes")
    state["regions"] = regions
    tensors: dict[str, dict] = {}
    for t in trunk.get("tensors") or []:
        try:
            name, dtype, shape, off, nb = t["name"], t["dtype"], [int(x) for x in t["shape"]], t["offset"], t["nbytes"]
            if not (_pos_int(off) and _pos_int(nb)):
                raise ValueError
            itemsize = st_itemsize(dtype)
        except (KeyError, TypeError, ValueError):
            problems.append(f"{trunk_json}: bad tensor entry {str(t)[:120]}")
            continue
        if math.prod(shape) * itemsize != nb:
            problems.append(f"{trunk_json}: {name}: {nb} bytes for {dtype} {shape}")
        if check_sizes and tsize is not None and off + nb > tsize:
            problems.append(f"{trunk_path}: truncated: {name} ends at {off + nb} but the file has {tsize} bytes")
        tensors[name] = t
    state["tensors"] = tensors
    layer_layout = {}
    for L in range(g.n_layers):
        reg = regions.get(f"layer.{L}")
        if reg is None:
            problems.append(f"{trunk_json}: no region layer.{L}")
            continue
        lay = []
        for short, dtype, shape in moe_short_tensors(g, L):
            name = official_name(L, short)
            t = tensors.get(name)
            if t is None:
                problems.append(f"{trunk_json}: no tensor {name}")
                continue
            if t["dtype"] != dtype or list(t["shape"]) != list(shape):
                problems.append(f"{trunk_json}: {name}: {t['dtype']} {list(t['shape'])}, expected {dtype} {list(shape)}")
                continue
            if not (reg[0] <= t["offset"] and t["offset"] + t["nbytes"] <= reg[0] + reg[1]):
                problems.append(f"{trunk_json}: {name} at {t['offset']} lies outside region layer.{L}")
                continue
            lay.append((short, dtype, tuple(shape), t["offset"] - reg[0]))
        layer_layout[L] = lay
    for name in GLOBAL_NAMES:
        if name not in tensors:
            problems.append(f"{trunk_json}: no tensor {name}")
    state["layer_layout"] = layer_layout
    # trunk.offsets must agree with trunk.json's regions
    off_path = root / TRUNK_OFFSETS
    try:
        table = read_trunk_offsets(off_path)
        if table != regions:
            problems.append(f"{off_path}: regions differ from {trunk_json}")
    except Ds4fError as exc:
        problems.append(str(exc))
    return state, problems


def read_trunk_offsets(path: Path) -> dict[str, tuple[int, int]]:
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise Ds4fError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Ds4fError(f"{path}: cannot read: {exc}") from None
    if not lines or lines[0].strip() != OFFSETS_HEADER:
        raise Ds4fError(f"{path}: not a trunk offsets table (first line should be {OFFSETS_HEADER!r})")
    out = {}
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        try:
            name, off, n = parts[0], int(parts[1]), int(parts[2])
            if len(parts) != 3 or off < 0 or n < 0:
                raise ValueError
        except (IndexError, ValueError):
            raise Ds4fError(f"{path}: line {i}: expected '<region> <offset> <nbytes>', got {line!r}") from None
        out[name] = (off, n)
    return out


def write_trunk_offsets(path: Path, regions: list[tuple[str, int, int]]) -> None:
    lines = [OFFSETS_HEADER, "# <region> <offset> <nbytes>  (bytes in trunk.bin; region layer.N is layer N's MoE trunk)"]
    lines += [f"{name} {off} {n}" for name, off, n in regions]
    Path(path).write_text("\n".join(lines) + "\n")


# ---- entry point ---------------------------------------------------------------------------
def detect_kind(path: Path | str) -> tuple[Path, str]:
    p = Path(path)
    if p.is_file():
        if p.name in (POOL_JSON, TRUNK_JSON, POOL_BIN, TRUNK_BIN, TRUNK_OFFSETS):
            return p.parent, "ds4f"
        if p.name == INDEX_NAME or p.name == CONFIG_NAME or p.suffix == ".safetensors":
            return p.parent, "official"
        raise Ds4fError(f"{p}: not a checkpoint directory")
    if not p.exists():
        raise Ds4fError(f"{p}: no such checkpoint (missing)")
    if not p.is_dir():
        raise Ds4fError(f"{p}: not a checkpoint directory")
    if (p / POOL_JSON).exists():
        return p, "ds4f"
    if (p / INDEX_NAME).exists() or any(p.glob("*.safetensors")):
        return p, "official"
    raise Ds4fError(f"{p}: not a checkpoint: no {POOL_JSON} (ds4f layout) and no {INDEX_NAME} or"
                    f" .safetensors shards (official release)")


def open_checkpoint(path: Path | str) -> Checkpoint:
    root, kind = detect_kind(path)
    return Ds4fCheckpoint(root) if kind == "ds4f" else OfficialCheckpoint(root)
