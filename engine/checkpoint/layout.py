"""The ds4f layout: one aligned record per (layer, expert), so a miss is one direct read.

The ds4f layout (written by ds4f.engine.checkpoint.convert):

pool-mxfp4.bin   one record per (layer, expert), index layer * n_experts + expert, each
                 at a 4 KiB-aligned offset and padded with zeros to `record_nbytes`
                 (a multiple of 4 KiB): [w1.weight | w3.weight | w2.weight | w1.scale |
                 w3.scale | w2.scale], the official bytes unchanged. A miss is one O_DIRECT pread.
pool-mxfp4.json  {"format": "ds4f-pool-mxfp4", "version": 2, "geometry": config, "file",
                 "alignment", "expert_nbytes", "record_nbytes", "parts": {name: {offset,
                 shape}}, "records": [[offset, crc32], ...]}; crc32 (zlib) of the record's
                 expert_nbytes bytes.
trunk.bin        per layer, a 4 KiB-aligned region with that layer's MoE trunk (norms,
                 gate weight, bias or tid2eid, the shared expert as FP8 E4M3 + E8M0 tile
                 scales), then a region with the layer's other tensors (attention etc.), then
                 one global region (embed, head, final norm, anything else). Every tensor
                 in its shipped dtype, bytes unchanged.
trunk.offsets    text: a "# ds4f-trunk-offsets 1" line, then one line per region:
                 "<region> <offset> <nbytes>" with region "layer.N", "extra.N" or "global".
trunk.json       {"format": "ds4f-trunk", "version": 2, "geometry", "file", "alignment",
                 "regions": [{name, offset, nbytes, crc32}], "tensors": [{name, short, layer,
                 region, dtype, shape, offset, nbytes}]}; official names and dtypes; crc32
                 (zlib) of each region's nbytes bytes, checked whenever a region is read.
Version 1 (FP8 widened to bf16, no region checksums) is refused with a message to re-convert.
config.json      copied from the release.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4f.engine.checkpoint.base import (ALIGN, CONFIG_NAME, LAYOUT_VERSION, OFFSETS_HEADER, POOL_BIN,
                                         POOL_FORMAT, POOL_JSON, TRUNK_BIN, TRUNK_FORMAT, TRUNK_JSON, TRUNK_OFFSETS,
                                         Checkpoint, _address, _check_buffer, _dontneed, _open_direct, _views,
                                         align_up, expert_layout, moe_short_tensors, official_name)
from ds4f.engine.checkpoint.checksum import crc32
from ds4f.engine.checkpoint.formats import st_itemsize, st_numpy_dtype
from ds4f.engine.checkpoint.safetensors_index import pread_exact, read_json
from ds4f.engine.checkpoint.tensors import attention_tensors, global_tensors, mtp_tensors
from ds4f.errors import Ds4fError
from ds4f.safe_read import read_regular
from ds4f.engine.model.geometry import Geometry

class Ds4fCheckpoint(Checkpoint):
    kind = "ds4f"

    def __init__(self, root: Path):
        layout, problems = load_ds4f_layout(root)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise Ds4fError(problems[0] + more)
        super().__init__(root, layout.geometry)
        self.mtp_layers = layout.mtp_layers
        self.pool_path: Path = layout.pool_path
        self.trunk_path: Path = layout.trunk_path
        self.record_offsets: np.ndarray = layout.record_offsets
        self.record_crc32: np.ndarray = layout.record_crc32
        self.record_nbytes: int = layout.record_nbytes
        self.slot_nbytes = self.record_nbytes
        self.regions: dict[str, tuple[int, int]] = layout.regions
        self.region_crc32: dict[str, int] = layout.region_crc32
        self._checked_regions: set[str] = set()   # trunk regions whose crc32 matched (each read once)
        self.trunk_tensors: dict[str, dict] = layout.tensors
        self._layer_layout = layout.layer_layout
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

    def read_expert(self, layer: int, expert: int, buf, check: bool = False) -> int:
        """check: compare the record with its crc32 (see check_expert)."""
        self._check_expert(layer, expert)
        mv = _check_buffer(buf, self.record_nbytes, "read_expert")[: self.record_nbytes]
        off = int(self.record_offsets[layer * self.geometry.n_experts + expert])
        n = self._direct_read(self._pool_fd, self.io_mode, self._pool_buffered, self.pool_path, mv, off,
                              f"({self.expert_name(layer, expert)})")
        if check:
            self.check_expert(layer, expert, buf)
        return n

    def check_expert(self, layer: int, expert: int, buf) -> bool:
        """Compare a record just read into buf with its crc32 (checksum.crc32 releases the GIL, so
        the I/O threads check in parallel with the compute); raise Ds4fError naming the record if
        it differs.
        True: checked."""
        index = layer * self.geometry.n_experts + expert
        mv = _check_buffer(buf, self.expert_nbytes, "check_expert")
        crc = crc32(mv[: self.expert_nbytes])
        if crc != int(self.record_crc32[index]):
            raise Ds4fError(f"{self.pool_path}: the record of {self.expert_name(layer, expert)} (record {index},"
                            f" at byte {int(self.record_offsets[index])}) is corrupt: crc32 {crc:08x}, {POOL_JSON} says"
                            f" {int(self.record_crc32[index]):08x}; `ds4f verify {self.path}` lists every bad record",
                            path=str(self.pool_path))
        return True

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

    def check_trunk_layer(self, layer: int, buf) -> bool:
        """Compare a layer region just read into buf with its crc32; Ds4fError naming it if it differs."""
        off, n = self.regions[f"layer.{layer}"]
        self._check_region(f"layer.{layer}", crc32(_check_buffer(buf, n, "check_trunk_layer")[:n]))
        return True

    def _check_region(self, region: str, crc: int) -> None:
        want = self.region_crc32[region]
        if crc != want:
            off, n = self.regions[region]
            raise Ds4fError(f"{self.trunk_path}: region {region} (bytes {off}..{off + n}) is corrupt: crc32 {crc:08x},"
                            f" {TRUNK_JSON} says {want:08x}; `ds4f verify {self.path}` checks the whole checkpoint",
                            path=str(self.trunk_path), kind="data")

    def _check_region_once(self, region: str) -> None:
        """A region outside the layers' MoE regions (the global one: embed, head, final norm; a
        layer's extra.N: attention, compressors, indexer, hyper-connections) checked against its
        crc32 the first time one of its tensors is read, streamed in chunks."""
        if region in self._checked_regions or region not in self.regions:
            return
        off, n = self.regions[region]
        crc, done = 0, 0
        chunk = bytearray(min(n, 64 << 20) or 1)
        while done < n:
            mv = memoryview(chunk)[: min(len(chunk), n - done)]
            pread_exact(self._trunk_buffered, mv, off + done, self.trunk_path, f"trunk region {region}")
            crc = crc32(mv, crc)
            done += len(mv)
        _dontneed(self._trunk_buffered, off, n)
        self._check_region(region, crc)
        self._checked_regions.add(region)

    def global_tensor(self, name: str) -> np.ndarray:
        """A tensor outside the layers' MoE regions, as stored (its region's crc32 is checked on
        the first read from that region)."""
        t = self.trunk_tensors.get(name)
        if t is None:
            raise Ds4fError(f"{self.path / TRUNK_JSON}: no tensor {name}")
        self._check_region_once(t.get("region") or "global")
        arr = np.empty(t["shape"], dtype=st_numpy_dtype(t["dtype"]))
        pread_exact(self._trunk_buffered, memoryview(arr.reshape(-1).view(np.uint8)), t["offset"],
                    self.trunk_path, name)
        return arr


def _pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass
class Ds4fLayout:
    """The ds4f layout's JSON files, parsed. A field is None when validation stopped before it."""

    geometry: Geometry | None = None
    pool_path: Path | None = None             # pool-mxfp4.bin
    record_nbytes: int | None = None          # bytes per expert record (a multiple of ALIGN)
    record_offsets: np.ndarray | None = None  # int64 [(n_layers + mtp_layers) * n_experts]: byte offset of each
    record_crc32: np.ndarray | None = None    # record, and crc32 of each expert's bytes
    mtp_layers: int = 0                       # 1: the MTP layer's experts follow the main layers' (layer n_layers)
    trunk_path: Path | None = None            # trunk.bin
    regions: dict[str, tuple[int, int]] = field(default_factory=dict)   # region -> (offset, nbytes)
    region_crc32: dict[str, int] = field(default_factory=dict)          # region -> crc32 of its bytes
    tensors: dict[str, dict] = field(default_factory=dict)              # official name -> trunk.json entry
    # layer -> [(short name, dtype code, shape, offset in the layer's region)]
    layer_layout: dict[int, list[tuple[str, str, tuple[int, ...], int]]] = field(default_factory=dict)


def load_ds4f_layout(root: Path, *, check_sizes: bool = True) -> tuple[Ds4fLayout, list[str]]:
    """Parse and validate the ds4f layout's JSON files; (layout, problems). Used by open and verify."""
    problems: list[str] = []
    layout = Ds4fLayout()
    cfg_path, pool_json, trunk_json = root / CONFIG_NAME, root / POOL_JSON, root / TRUNK_JSON
    try:
        g = Geometry.from_config(read_json(cfg_path, "config JSON"), str(cfg_path))
    except Ds4fError as exc:
        return layout, [str(exc)]
    layout.geometry = g
    try:
        pool = read_json(pool_json, "pool JSON")
        trunk = read_json(trunk_json, "trunk JSON")
    except Ds4fError as exc:
        return layout, [str(exc)]
    for path, doc, fmt in ((pool_json, pool, POOL_FORMAT), (trunk_json, trunk, TRUNK_FORMAT)):
        if not isinstance(doc, dict) or doc.get("format") != fmt:
            problems.append(f"{path}: not a {fmt} file (format {doc.get('format') if isinstance(doc, dict) else None!r})")
        elif doc.get("version") != LAYOUT_VERSION:
            problems.append(_version_problem(path, doc.get("version")))
        elif doc.get("geometry") != g.to_config():
            try:
                other = Geometry.from_config(doc.get("geometry"), f"{path} geometry")
                if other != g:
                    problems.append(f"{path}: geometry differs from {cfg_path}")
            except Ds4fError as exc:
                problems.append(str(exc))
    if problems:
        return layout, problems
    problems += _load_pool(root, pool, pool_json, g, layout, check_sizes)
    problems += _load_trunk(root, trunk, trunk_json, cfg_path, g, layout, check_sizes)
    problems += _check_offsets_table(root, trunk_json, layout.regions)
    return layout, problems


MAX_OVERLAPS_LISTED = 20


def _overlapping_records(pool_json: Path, offs: np.ndarray, rec_n: int) -> list[str]:
    """Records whose bytes overlap (two experts aliased onto one record would run the same weights
    for both, their crc32s agreeing): each pair named, the first MAX_OVERLAPS_LISTED."""
    order = np.argsort(offs, kind="stable")
    gaps = np.diff(offs[order])
    return [f"{pool_json}: records {int(order[i])} and {int(order[i + 1])} overlap"
            f" (offsets {int(offs[order[i]])}, {int(offs[order[i + 1]])})"
            for i in np.flatnonzero(gaps < rec_n)[:MAX_OVERLAPS_LISTED]]


def _load_pool(root: Path, pool: dict, pool_json: Path, g: Geometry, layout: Ds4fLayout,
               check_sizes: bool) -> list[str]:
    """pool-mxfp4.json into `layout`: the record size, the canonical parts, each record's offset
    and crc32, and (check_sizes) the pool file long enough for them all; the problems found."""
    problems: list[str] = []

    mtp = pool.get("mtp_layers", 0)
    if mtp not in (0, 1) or isinstance(mtp, bool):
        problems.append(f"{pool_json}: mtp_layers {mtp!r}: 0 or 1 expected")
        mtp = 0
    layout.mtp_layers = mtp
    n_rec = (g.n_layers + mtp) * g.n_experts
    rec_n = pool.get("record_nbytes")
    want_rec = align_up(g.expert_nbytes)
    pool_path = root / str(pool.get("file", POOL_BIN))
    layout.pool_path = pool_path
    if pool.get("expert_nbytes") != g.expert_nbytes:
        problems.append(f"{pool_json}: expert_nbytes {pool.get('expert_nbytes')!r}, the geometry gives {g.expert_nbytes}")
    if not _pos_int(rec_n) or rec_n % ALIGN or rec_n < g.expert_nbytes:
        problems.append(f"{pool_json}: record_nbytes {rec_n!r} is not a multiple of {ALIGN} holding an expert"
                        f" of {g.expert_nbytes} bytes")
        rec_n = want_rec
    layout.record_nbytes = rec_n
    parts = pool.get("parts")
    canon = {k: {"offset": off, "shape": list(shape)} for k, (off, shape) in expert_layout(g).items()}
    if parts != canon:
        problems.append(f"{pool_json}: parts {parts!r} differ from the canonical expert layout {canon!r}")
    records = pool.get("records")
    offs = np.zeros(n_rec, dtype=np.int64)
    crcs = np.zeros(n_rec, dtype=np.int64)
    if not isinstance(records, list) or len(records) != n_rec:
        problems.append(f"{pool_json}: {len(records) if isinstance(records, list) else 'no'} records,"
                        f" expected {n_rec} ({g.n_layers + mtp} layers x {g.n_experts} experts)")
    else:
        for i, r in enumerate(records):
            if not (isinstance(r, list) and len(r) == 2 and _pos_int(r[0]) and _pos_int(r[1]) and r[1] < 2 ** 32):
                problems.append(f"{pool_json}: record {i}: bad entry {r!r} (expected [offset, crc32])")
                continue
            offs[i], crcs[i] = r
            if r[0] % ALIGN:
                problems.append(f"{pool_json}: record {i} (layer {i // g.n_experts}, expert {i % g.n_experts})"
                                f" at offset {r[0]} is not {ALIGN}-aligned")
    layout.record_offsets, layout.record_crc32 = offs, crcs
    if isinstance(records, list) and len(records) == n_rec and n_rec > 1:
        problems += _overlapping_records(pool_json, offs, rec_n)
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

    return problems


def _load_trunk(root: Path, trunk: dict, trunk_json: Path, cfg_path: Path, g: Geometry, layout: Ds4fLayout,
                check_sizes: bool) -> list[str]:
    """trunk.json into `layout`: its regions, its tensors, and each layer's MoE tensors and the
    global and attention tensors as the geometry wants them; the problems found."""
    problems: list[str] = []
    trunk_path = root / str(trunk.get("file", TRUNK_BIN))
    layout.trunk_path = trunk_path
    tsize = trunk_path.stat().st_size if trunk_path.exists() else None
    if check_sizes and tsize is None:
        problems.append(f"{trunk_path}: missing")
    regions: dict[str, tuple[int, int]] = {}
    for r in trunk.get("regions") or []:
        if not (isinstance(r, dict) and isinstance(r.get("name"), str) and _pos_int(r.get("offset"))
                and _pos_int(r.get("nbytes")) and _pos_int(r.get("crc32")) and r["crc32"] < 2 ** 32):
            problems.append(f"{trunk_json}: bad region entry {r!r} (expected name, offset, nbytes, crc32)")
            continue
        regions[r["name"]] = (r["offset"], r["nbytes"])
        layout.region_crc32[r["name"]] = r["crc32"]
        if r["offset"] % ALIGN or r["nbytes"] % ALIGN:
            problems.append(f"{trunk_json}: region {r['name']} ({r['offset']}, {r['nbytes']}) is not {ALIGN}-aligned")
        if check_sizes and tsize is not None and r["offset"] + r["nbytes"] > tsize:
            problems.append(f"{trunk_path}: truncated: region {r['name']} ends at {r['offset'] + r['nbytes']}"
                            f" but the file has {tsize} bytes")
    layout.regions = regions
    problems += _load_trunk_tensors(trunk, trunk_json, trunk_path, tsize, regions, layout, check_sizes)
    problems += _check_trunk_tensors(trunk_json, cfg_path, g, regions, layout)
    return problems


def _load_trunk_tensors(trunk: dict, trunk_json: Path, trunk_path: Path, tsize: int | None,
                        regions: dict[str, tuple[int, int]], layout: Ds4fLayout, check_sizes: bool) -> list[str]:
    """trunk.json's tensor entries into layout.tensors: each well formed, its size its dtype's and
    shape's, inside the file and its region, listed once, overlapping no other."""
    problems: list[str] = []
    tensors: dict[str, dict] = {}
    spans: list[tuple[int, int, str]] = []    # (start, end, name) of every tensor entry
    for t in trunk.get("tensors") or []:
        try:
            name, dtype, shape, off, nb = t["name"], t["dtype"], [int(x) for x in t["shape"]], t["offset"], t["nbytes"]
            if not (_pos_int(off) and _pos_int(nb)):
                raise ValueError
            itemsize = st_itemsize(dtype)
        except (KeyError, TypeError, ValueError):
            problems.append(f"{trunk_json}: bad tensor entry {str(t)[:120]}")
            continue
        size = math.prod(shape) * itemsize    # what a reader of this entry reads
        if size != nb:
            problems.append(f"{trunk_json}: {name}: nbytes {nb} disagrees with its dtype {dtype} and shape {shape}"
                            f" ({size} bytes)")
        end = off + max(nb, size)
        if check_sizes and tsize is not None and end > tsize:
            problems.append(f"{trunk_path}: truncated: {name} ends at {end} but the file has {tsize} bytes")
        if name in tensors:
            problems.append(f"{trunk_json}: {name}: listed twice (at offsets {tensors[name]['offset']} and {off})")
        region = regions.get(t.get("region")) if isinstance(t.get("region"), str) else None
        if region is not None and not str(t["region"]).startswith("layer.") and not (
                region[0] <= off and end <= region[0] + region[1]):
            problems.append(f"{trunk_json}: {name}: bytes {off}..{end} lie outside its region"
                            f" {t['region']} ({region[0]}..{region[0] + region[1]})")
        tensors[name] = t
        spans.append((off, end, name))
    layout.tensors = tensors
    problems += _overlaps(trunk_json, "tensors", spans)
    problems += _overlaps(trunk_json, "regions", [(o, o + n, name) for name, (o, n) in regions.items()])
    return problems


def _check_trunk_tensors(trunk_json: Path, cfg_path: Path, g: Geometry, regions: dict[str, tuple[int, int]],
                         layout: Ds4fLayout) -> list[str]:
    """Every tensor the geometry wants is there with its dtype and shape: each layer's MoE
    tensors inside its region (layout.layer_layout), the global and attention tensors."""
    problems: list[str] = []
    tensors = layout.tensors
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
    mtp = [p for p in mtp_tensors(g) if ".ffn.experts." not in p.name] if layout.mtp_layers else []
    for plan in {p.name: p for p in global_tensors(g) + attention_tensors(g) + mtp}.values():  # hc_head in both
        t = tensors.get(plan.name)
        if t is None:
            problems.append(f"{trunk_json}: no tensor {plan.name}")
        elif t["dtype"] != plan.dtype or list(t["shape"]) != list(plan.shape):
            problems.append(f"{trunk_json}: {plan.name}: {t['dtype']} {list(t['shape'])}, expected {plan.dtype}"
                            f" {list(plan.shape)} for the geometry in {cfg_path.name}")
    layout.layer_layout = layer_layout
    return problems


def _check_offsets_table(root: Path, trunk_json: Path, regions: dict[str, tuple[int, int]]) -> list[str]:
    """trunk.offsets must agree with trunk.json's regions."""
    off_path = root / TRUNK_OFFSETS
    try:
        table = read_trunk_offsets(off_path)
    except Ds4fError as exc:
        return [str(exc)]
    return [f"{off_path}: regions differ from {trunk_json}"] if table != regions else []


def _version_problem(path: Path, version) -> str:
    if isinstance(version, int) and not isinstance(version, bool) and version < LAYOUT_VERSION:
        return (f"{path}: layout version {version}, written by an older ds4f (FP8 tensors widened to bf16, no"
                f" trunk checksums); this ds4f reads version {LAYOUT_VERSION}: convert the official release"
                f" again (`ds4f convert SRC {path.parent} --force`)")
    return (f"{path}: layout version {version!r}, this ds4f reads version {LAYOUT_VERSION}"
            f" (a newer ds4f wrote it, or the file is damaged)")


def _overlaps(where: Path, what: str, spans: list[tuple[int, int, str]], limit: int = 20) -> list[str]:
    """Problems for every span of `spans` (start, end, name) that begins before an earlier one ends."""
    out = []
    end_max, last = -1, ""
    for start, end, name in sorted(s for s in spans if s[1] > s[0]):
        if start < end_max:
            out.append(f"{where}: {what} {last} and {name} overlap: {name} starts at byte {start},"
                       f" before {last} ends at {end_max}")
        if end > end_max:
            end_max, last = end, name
    if len(out) > limit:
        out = out[:limit] + [f"{where}: ... and {len(out) - limit} more overlapping {what}"]
    return out


def read_trunk_offsets(path: Path) -> dict[str, tuple[int, int]]:
    try:
        lines = read_regular(path, "trunk offsets table", 64 << 20, missing=f"{path}: missing").decode().splitlines()
    except UnicodeDecodeError as exc:
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


