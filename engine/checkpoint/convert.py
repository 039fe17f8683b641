"""Official shards -> the ds4f layout (see ds4f.engine.checkpoint for the file formats).

Streaming with bounded memory: one expert record, one layer's MoE trunk, or one chunk
of a big tensor at a time (at most ~64 MiB plus a layer region), whatever the model's size.
Every byte is copied unchanged: experts as MXFP4, FP8 trunk tensors as FP8 with their E8M0
tile scales, bf16 as bf16; each trunk region gets a crc32 of its bytes (padding included).
Everything is written into a hidden sibling directory and renamed into place at the end,
so an interrupted conversion never leaves something that looks like a checkpoint; the next
conversion to the same place removes the hidden directories a killed one left.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

from ds4f.engine.checkpoint import detect_kind
from ds4f.engine.checkpoint.base import (ALIGN, CONFIG_NAME, LAYOUT_VERSION, POOL_BIN, POOL_FORMAT, POOL_JSON,
                                         PROMPTS_NAME, TENSOR_ALIGN, TRUNK_BIN, TRUNK_FORMAT, TRUNK_JSON,
                                         TRUNK_OFFSETS, align_up, aligned_buffer, expert_layout, moe_region_layout,
                                         official_name)
from ds4f.engine.checkpoint.checksum import crc32
from ds4f.engine.checkpoint.layout import write_trunk_offsets
from ds4f.engine.checkpoint.official import OfficialCheckpoint
from ds4f.errors import Ds4fError
from ds4f.engine.checkpoint.formats import st_itemsize
from ds4f.engine.checkpoint.progress import Progress, ProgressArg
from ds4f.engine.checkpoint.safetensors_index import TensorInfo, pread_exact
from ds4f.engine.checkpoint.synth import _commit_dir, _fresh_dir, write_error
from ds4f.engine.checkpoint.tensors import MTP_PREFIX
from ds4f.engine.text.tokenizer import TOKENIZER_FILES

CHUNK_BYTES = 64 * 1024 * 1024
COPY_ALONG = (*TOKENIZER_FILES, PROMPTS_NAME)   # where present; inside the directory renamed into place
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def convert_checkpoint(src: Path | str, dst: Path | str, progress: ProgressArg = None, *, force: bool = False) -> Path:
    root, kind = detect_kind(src)
    if kind != "official":
        raise Ds4fError(f"{root}: already in the ds4f layout; convert reads the official safetensors release")
    dst = Path(dst)
    _check_destination(root, dst, force)
    with OfficialCheckpoint(root) as ck:
        g = ck.geometry
        trunk = sum(t.nbytes for n, t in ck.tensors.items() if not (".experts." in n and ".shared_experts." not in n))
        tmp = _fresh_dir(dst, force, g.n_layers * g.n_experts * ck.slot_nbytes + trunk)
        try:
            _convert(ck, tmp, progress)
            _commit_dir(tmp, dst)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_error(exc, tmp, dst) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dst


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    """Refuse a destination whose replacement would lose data: the source itself, a directory
    holding the source, and with `force` anything but a ds4f layout directory (POOL_JSON in it)
    or an empty directory. Without `force`, an existing non-empty destination is refused later."""
    s, d = src.resolve(), dst.resolve()
    if d == s:
        raise Ds4fError(f"{dst}: the destination must differ from the source")
    if d in s.parents:
        raise Ds4fError(f"{dst}: holds the source {src}; the ds4f layout goes in a directory of its own")
    if not force or not (dst.exists() or dst.is_symlink()):
        return
    if dst.is_dir() and not any(dst.iterdir()):
        return
    if not dst.is_dir() or not (dst / POOL_JSON).is_file():
        what = f"a directory without {POOL_JSON}" if dst.is_dir() else "not a directory"
        raise Ds4fError(f"{dst}: --force replaces only a ds4f layout directory ({POOL_JSON} in it); "
                        f"this is {what}, so it is left as it is")


def _plan_trunk(ck: OfficialCheckpoint):
    """Split the non-expert tensors into layer MoE regions, per-layer extras and the global region."""
    g = ck.geometry
    moe = {official_name(L, s) for L in range(g.n_layers) for s, *_ in moe_region_layout(g, L)[0]}
    extras: dict[int, list[str]] = {L: [] for L in range(g.n_layers)}
    glob: list[str] = []
    skipped: list[str] = []
    for name in sorted(ck.tensors):
        if ".experts." in name and ".shared_experts." not in name:
            m = _LAYER_RE.match(name)
            if not (m and int(m.group(1)) < g.n_layers) and not (ck.mtp_layers and name.startswith(MTP_PREFIX)):
                skipped.append(name)  # routed experts of no layer the engine runs (a DSpark drafter's)
            continue
        if name in moe:
            continue
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) < g.n_layers:
            extras[int(m.group(1))].append(name)
        else:
            glob.append(name)
    first = [n for n in ("embed.weight", "head.weight", "norm.weight") if n in glob]
    glob = first + [n for n in glob if n not in first]
    return extras, glob, skipped


class _RegionWriter:
    """Writes one trunk region's bytes in order (padding included) and keeps their crc32."""

    def __init__(self, out, start: int) -> None:
        self.out, self.start, self.pos, self.crc = out, start, start, 0
        out.seek(start)

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.crc = crc32(mv, self.crc)
        _write_all(self.out, mv)
        self.pos += len(mv)

    def pad_to(self, end: int) -> None:
        if end > self.pos:
            self.write(bytes(end - self.pos))


def _convert(ck: OfficialCheckpoint, tmp: Path, progress: ProgressArg) -> None:
    g = ck.geometry
    extras, glob, skipped = _plan_trunk(ck)
    layers = g.n_layers + ck.mtp_layers          # the MTP layer's experts after the main ones
    n_rec = layers * g.n_experts
    rec_n = ck.slot_nbytes
    trunk_in = sum(t.nbytes for n, t in ck.tensors.items() if not (".experts." in n and ".shared_experts." not in n))
    total = n_rec * g.expert_nbytes + trunk_in

    # -- trunk.bin
    entries, regions = [], []
    with Progress(progress, total, "convert") as bar:
        with open(tmp / TRUNK_BIN, "wb", buffering=0) as out:
            pos = 0
            buf = aligned_buffer(ck.trunk_layer_buf_nbytes)
            for L in range(g.n_layers):
                layout, n = moe_region_layout(g, L)
                buf[:] = 0
                ck.read_trunk_layer(L, buf)
                w = _RegionWriter(out, pos)
                w.write(memoryview(buf)[:n])
                regions.append((f"layer.{L}", pos, n, w.crc))
                for short, dtype, shape, off in layout:
                    entries.append({"name": official_name(L, short), "short": short, "layer": L,
                                    "region": f"layer.{L}", "dtype": dtype, "shape": list(shape),
                                    "offset": pos + off, "nbytes": math.prod(shape) * st_itemsize(dtype)})
                pos += n
                bar.advance(ck.trunk_layer_nbytes(L), f"trunk layer {L}")
                if extras[L]:
                    pos = _write_region(ck, out, pos, f"extra.{L}", extras[L], L, entries, regions, bar)
            del buf
            pos = _write_region(ck, out, pos, "global", glob, None, entries, regions, bar)
            out.truncate(pos)
            os.fsync(out.fileno())
        # -- pool-mxfp4.bin
        records = []
        slot = aligned_buffer(rec_n)  # the padding stays zero: reads fill expert_nbytes only
        with open(tmp / POOL_BIN, "wb", buffering=0) as out:
            for L in range(layers):
                for e in range(g.n_experts):
                    ck.read_expert(L, e, slot)
                    crc = crc32(memoryview(slot)[: g.expert_nbytes])
                    records.append([(L * g.n_experts + e) * rec_n, crc])
                    _write_all(out, memoryview(slot))
                    bar.advance(g.expert_nbytes, f"layer {L} expert {e}")
            os.fsync(out.fileno())
    # -- JSON
    cfg = g.to_config()
    pool = {"format": POOL_FORMAT, "version": LAYOUT_VERSION, "geometry": cfg, "file": POOL_BIN,
            "alignment": ALIGN, "expert_nbytes": g.expert_nbytes, "record_nbytes": rec_n,
            "record_order": "layer * n_experts + expert", "mtp_layers": ck.mtp_layers,
            "crc32": "zlib crc32 of the first expert_nbytes bytes of each record",
            "parts": {k: {"offset": off, "shape": list(shape)} for k, (off, shape) in expert_layout(g).items()},
            "records": records}
    trunk = {"format": TRUNK_FORMAT, "version": LAYOUT_VERSION, "geometry": cfg, "file": TRUNK_BIN,
             "alignment": ALIGN,
             "crc32": "zlib crc32 of each region's nbytes bytes (padding included)",
             "regions": [{"name": n, "offset": o, "nbytes": b, "crc32": c} for n, o, b, c in regions],
             "tensors": entries,
             "skipped": {"count": len(skipped), "why": "routed experts of no layer the engine runs",
                         "names": skipped[:20]}}
    (tmp / POOL_JSON).write_text(json.dumps(pool, separators=(",", ":")) + "\n")
    (tmp / TRUNK_JSON).write_text(json.dumps(trunk, indent=1) + "\n")
    write_trunk_offsets(tmp / TRUNK_OFFSETS, [(n, o, b) for n, o, b, _ in regions])
    shutil.copyfile(ck.path / CONFIG_NAME, tmp / CONFIG_NAME)
    for name in COPY_ALONG:
        if (ck.path / name).is_file():
            shutil.copyfile(ck.path / name, tmp / name)


def _write_region(ck: OfficialCheckpoint, out, pos: int, region: str, names: list[str], layer, entries, regions,
                  bar) -> int:
    w = _RegionWriter(out, pos)
    for name in names:
        t = ck.tensors[name]
        w.pad_to(align_up(w.pos, TENSOR_ALIGN))
        entries.append({"name": name, "layer": layer, "region": region, "dtype": t.dtype, "shape": list(t.shape),
                        "offset": w.pos, "nbytes": t.nbytes})
        _copy_range(ck, t, w)
        bar.advance(t.nbytes, name)
    w.pad_to(align_up(w.pos))
    regions.append((region, pos, w.pos - pos, w.crc))
    return w.pos


def _copy_range(ck: OfficialCheckpoint, t: TensorInfo, w: _RegionWriter) -> None:
    fd = ck._fd_of[t.file]
    buf = bytearray(min(CHUNK_BYTES, max(t.nbytes, 1)))
    done = 0
    while done < t.nbytes:
        n = min(len(buf), t.nbytes - done)
        mv = memoryview(buf)[:n]
        pread_exact(fd, mv, t.offset + done, t.file, t.name)
        w.write(mv)
        done += n


def _write_all(out, data) -> None:
    mv = memoryview(data).cast("B")
    while len(mv):
        n = out.write(mv)
        mv = mv[n:]
