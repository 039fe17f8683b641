"""`ds4f verify`: check a checkpoint (either form) and list every problem found.

ds4f layout: JSON structure and versions, geometry against config.json, sizes, every
offset inside its file and 4 KiB-aligned, record overlap, tensor dtypes and shapes, the
trunk.offsets table, then every record read back (one at a time, page cache dropped):
crc32, zero padding, NaN scale bytes (0xFF); every trunk region against its crc32; NaN in
the trunk's FP8 tensors (E8M0 scale bytes 0xFF, E4M3 codes 0x7F / 0xFF); tid2eid ids in range. trunk.json's own lies
(an entry whose nbytes disagrees with its dtype and shape, or whose dtype and shape disagree
with the geometry; tensors or regions that overlap) come from load_ds4f_layout.
Official release: index and shard headers, every tensor the geometry needs with its
official dtype and shape (when config.json describes attention, every layer's attention and
hyper-connection tensors and hc_head_* too), NaN scale bytes in every expert and in every FP8
weight's scale tiles (`*.scale` of an F8_E4M3 weight: the shared experts' and the attention's
alike), tid2eid ids in range. In the ds4f layout the attention's FP8 tensors sit in the
layers' extra.N regions, covered by the trunk's region checksums and FP8 NaN checks.
Both: a hash layer's tid2eid row (one token) naming the same expert twice; the tokenizer files
where present: tokenizer.json loads with HF `tokenizers`, has BOS and EOS and no more tokens than
the model's vocab_size, tokenizer_config.json and generation_config.json parse (a checkpoint
without a tokenizer is fine: it runs on token ids; info["tokenizer"] says which).
Every problem names the file and, where there is one, the tensor.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ds4f.engine.checkpoint import detect_kind
from ds4f.engine.checkpoint.checksum import crc32
from ds4f.engine.checkpoint.base import _views, aligned_buffer, expert_name
from ds4f.engine.checkpoint.layout import load_ds4f_layout
from ds4f.engine.checkpoint.official import NO_MTP, check_mtp_tensors, check_official_tensors
from ds4f.engine.checkpoint.tensors import layer_prefix
from ds4f.errors import Ds4fError
from ds4f.engine.checkpoint.formats import E8M0_NAN, non_finite, st_numpy_dtype
from ds4f.engine.model.geometry import Geometry
from ds4f.engine.checkpoint.progress import Progress, ProgressArg
from ds4f.engine.checkpoint.safetensors_index import read_json, load_official_index
from ds4f.engine.text.tokenizer import TOKENIZER_NAME, GenerationDefaults, Tokenizer

MAX_LISTED = 50  # per kind of problem; the rest are counted


def verify_checkpoint(path: Path | str, progress: ProgressArg = None, info: dict | None = None) -> list[str]:
    """Problems found (empty = OK). `info`, if given, receives counts (records, bytes, NaN scales)."""
    info = {} if info is None else info
    try:
        root, kind = detect_kind(path)
    except Ds4fError as exc:
        return [str(exc)]
    info["kind"] = kind
    info["path"] = str(root)
    problems = _verify_ds4f(root, progress, info) if kind == "ds4f" else _verify_official(root, progress, info)
    return problems + _tokenizer_problems(root, info)


def _tokenizer_problems(root: Path, info: dict) -> list[str]:
    """The tokenizer files load; info["tokenizer"]: "no tokenizer" or "tokenizer: N tokens"."""
    problems = []
    try:
        GenerationDefaults.load(root)
    except Ds4fError as exc:
        problems.append(str(exc))
    if not (root / TOKENIZER_NAME).is_file():
        info["tokenizer"] = "no tokenizer"
        return problems
    try:
        tok = Tokenizer.load(root)
    except Ds4fError as exc:
        info["tokenizer"] = "tokenizer unreadable"
        return problems + [str(exc)]
    info["tokenizer"] = f"tokenizer: {tok.vocab_size} tokens"
    g = info.get("geometry")
    if g is not None and tok.vocab_size > g.vocab:
        problems.append(f"{tok.path}: {tok.vocab_size} tokens, more than the model's vocab_size {g.vocab}")
    for what, tid in (("BOS", tok.bos_id), ("EOS", tok.eos_id)):
        if tid is None:
            problems.append(f"{tok.path}: no {what} token (looked up by tokenizer_config.json's {what.lower()}_token"
                            f" and DeepSeek's)")
    return problems


def _verify_ds4f(root: Path, progress: ProgressArg, info: dict) -> list[str]:
    layout, problems = load_ds4f_layout(root)
    g: Geometry | None = layout.geometry
    if g is None or layout.record_offsets is None or layout.pool_path is None:
        return problems
    info["geometry"] = g
    info["mtp_layers"] = layout.mtp_layers
    problems += _pool_record_problems(layout, g, progress, info, problems)
    trunk_path: Path = layout.trunk_path
    if trunk_path.exists():
        problems += _trunk_problems(layout, trunk_path, progress)
        problems += _hash_table_problems(layout, g, trunk_path)
    return problems


def _pool_record_problems(layout, g: Geometry, progress: ProgressArg, info: dict, earlier: list[str]) -> list[str]:
    """Every pool record read back (each dropped from the page cache once read): its crc32
    against pool-mxfp4.json's, NaN scale bytes, nonzero padding; the counts go into `info`."""
    pool_path: Path = layout.pool_path
    offs, crcs, rec_n = layout.record_offsets, layout.record_crc32, layout.record_nbytes
    size = pool_path.stat().st_size if pool_path.exists() else 0
    n_rec = len(offs)
    bad_crc, nan_total, nan_records, bad_pad, skipped = [], 0, [], [], 0
    scale_lo = g.expert_nbytes - sum(int(np.prod(s)) for k, s in g.expert_parts().items() if k.endswith(".scale"))
    buf = aligned_buffer(rec_n)
    checked = 0
    if pool_path.exists():
        fd = os.open(pool_path, os.O_RDONLY)
        try:
            with Progress(progress, n_rec * rec_n, "verify") as bar:
                for i in range(n_rec):
                    off = int(offs[i])
                    L, e = divmod(i, g.n_experts)
                    if off + rec_n > size:
                        skipped += 1
                        bar.advance(rec_n)
                        continue
                    got = os.preadv(fd, [memoryview(buf)], off)
                    try:
                        os.posix_fadvise(fd, off, rec_n, os.POSIX_FADV_DONTNEED)
                    except (AttributeError, OSError):
                        pass
                    if got < rec_n:
                        skipped += 1
                        continue
                    checked += 1
                    crc = crc32(memoryview(buf)[: g.expert_nbytes])
                    if crc != int(crcs[i]):
                        bad_crc.append(f"{pool_path}: record {i} ({expert_name(g.n_layers, L, e)}) at offset {off}:"
                                       f" crc32"
                                       f" {crc:08x}, pool-mxfp4.json says {int(crcs[i]):08x}")
                    nan = int(np.count_nonzero(buf[scale_lo: g.expert_nbytes] == E8M0_NAN))
                    if nan:
                        nan_total += nan
                        nan_records.append((L, e, nan))
                    if buf[g.expert_nbytes:].any():
                        bad_pad.append(f"{pool_path}: record {i} ({expert_name(g.n_layers, L, e)}): nonzero padding")
                    bar.advance(rec_n, f"layer {L}")
        finally:
            os.close(fd)
    info.update(records=n_rec, records_checked=checked, bytes_checked=checked * rec_n, nan_scale_bytes=nan_total)
    problems = _capped(bad_crc, "crc32 mismatches") + _capped(bad_pad, "records with nonzero padding")
    if skipped and not any("truncated" in p for p in earlier + problems):
        problems.append(f"{pool_path}: {skipped} records could not be read in full")
    if nan_total:
        where = ", ".join(f"({expert_name(g.n_layers, L, e)}): {n}" for L, e, n in nan_records[:10])
        problems.append(f"{pool_path}: {nan_total} NaN scale bytes (0xFF) in {len(nan_records)} records: {where}"
                        + (" ..." if len(nan_records) > 10 else ""))
    return problems


def _hash_table_problems(layout, g: Geometry, trunk_path: Path) -> list[str]:
    """The hash layers' tid2eid tables hold expert ids in range."""
    problems: list[str] = []
    tsize = trunk_path.stat().st_size
    for L in range(g.n_hash_layers):
        reg = layout.regions.get(f"layer.{L}")
        lay = layout.layer_layout.get(L)
        if not reg or not lay or reg[0] + reg[1] > tsize:
            continue
        rbuf = aligned_buffer(reg[1])
        with open(trunk_path, "rb") as f:
            f.seek(reg[0])
            f.readinto(memoryview(rbuf))
        views = _views(rbuf, lay)
        problems += tid2eid_problems(views.get("gate.tid2eid"), g, f"{trunk_path}: layers.{L}.ffn.gate.tid2eid")
    return problems


def _trunk_problems(layout, trunk_path: Path, progress: ProgressArg) -> list[str]:
    """Every region against its crc32, and NaN in every FP8 tensor (scale bytes 0xFF, E4M3 codes
    0x7F / 0xFF), reading trunk.bin once, a chunk at a time."""
    tsize = trunk_path.stat().st_size
    regions = {name: r for name, r in layout.regions.items() if r[0] + r[1] <= tsize}  # the rest: "truncated"
    floats = sorted((t["offset"], t["nbytes"], t["name"], t["dtype"]) for t in layout.tensors.values()
                    if t["dtype"] in FLOAT_DTYPES and t["offset"] + t["nbytes"] <= tsize)
    bad_crc, nan = [], []
    chunk = 64 << 20
    fd = os.open(trunk_path, os.O_RDONLY)
    try:
        with Progress(progress, sum(n for _, n in regions.values()), "verify trunk") as bar:
            for name, (off, n) in sorted(regions.items(), key=lambda r: r[1][0]):
                crc = 0
                for pos in range(off, off + n, chunk):
                    data = os.pread(fd, min(chunk, off + n - pos), pos)
                    crc = crc32(data, crc)
                    bar.advance(len(data), name)
                if crc != layout.region_crc32[name]:
                    bad_crc.append(f"{trunk_path}: region {name} (bytes {off}..{off + n}): crc32 {crc:08x},"
                                   f" trunk.json says {layout.region_crc32[name]:08x}")
            for off, n, name, dtype in floats:
                bad = non_finite(np.frombuffer(os.pread(fd, n, off), st_numpy_dtype(dtype)))
                if bad:
                    nan.append(f"{trunk_path}: {name}: {bad} {_NON_FINITE.get(dtype, 'non-finite values (NaN or inf)')}")
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
    finally:
        os.close(fd)
    return _capped(bad_crc, "trunk regions with a bad crc32") + _capped(nan, "tensors with non-finite values")


def _verify_official(root: Path, progress: ProgressArg, info: dict) -> list[str]:
    cfg_path = root / "config.json"
    try:
        g = Geometry.from_config(read_json(cfg_path, "config JSON"), str(cfg_path))
        tensors, files = load_official_index(root)
    except Ds4fError as exc:
        return [str(exc)]
    info["geometry"] = g
    problems = check_official_tensors(g, tensors, root)
    if problems:
        return problems
    mtp = check_mtp_tensors(g, tensors, read_json(cfg_path, "config JSON"), root)
    if mtp and mtp != [NO_MTP] and "DSpark" not in mtp[0]:
        return mtp                  # a DSpark drafter is not a fault: plain decoding runs
    info["mtp_layers"] = 0 if mtp else 1
    layers = g.n_layers + info["mtp_layers"]
    names = [layer_prefix(g, L) + f"ffn.experts.{e}.{p}" for L in range(layers) for e in range(g.n_experts)
             for p in ("w1.scale", "w3.scale", "w2.scale")]
    fp8_scales = _fp8_scale_names(tensors)
    total = sum(tensors[n].nbytes for n in names) + sum(tensors[n].nbytes for n in fp8_scales)
    nan_total, nan_where, fp8_nan, value_problems = 0, [], 0, []
    fds: dict[Path, int] = {}

    def read(n: str) -> bytes | None:
        t = tensors[n]
        fd = fds.get(t.file)
        if fd is None:
            fd = fds[t.file] = os.open(t.file, os.O_RDONLY)
        data = os.pread(fd, t.nbytes, t.offset)
        if len(data) < t.nbytes:
            problems.append(f"{t.file}: truncated: short read of {n}")
            return None
        return data

    try:
        with Progress(progress, total, "verify") as bar:
            for n in names:
                t, data = tensors[n], read(n)
                c = data.count(bytes([E8M0_NAN])) if data is not None else 0
                if c:
                    nan_total += c
                    nan_where.append(f"{t.file.name}: {n}: {c}")
                bar.advance(t.nbytes)
            for n in fp8_scales:
                t, data = tensors[n], read(n)
                c = _nan_scales(data, t.dtype) if data is not None else 0
                if c:
                    fp8_nan += c
                    what = "NaN scale bytes (0xFF)" if t.dtype in ("F8_E8M0", "U8") else "NaN scales"
                    value_problems.append(f"{t.file}: {n}: {c} {what} in the FP8 scale tiles of"
                                        f" {n[:-len('.scale')]}.weight")
                bar.advance(t.nbytes)
        for n in sorted(n for n, t in tensors.items() if t.dtype in FLOAT_DTYPES and ".experts." not in n
                        and n not in fp8_scales):
            data = read(n)
            bad = non_finite(np.frombuffer(data, st_numpy_dtype(tensors[n].dtype))) if data is not None else 0
            if bad:
                value_problems.append(f"{tensors[n].file}: {n}: {bad} "
                                    f"{_NON_FINITE.get(tensors[n].dtype, 'non-finite values (NaN or inf)')}")
        for L in range(g.n_hash_layers):
            t = tensors[f"layers.{L}.ffn.gate.tid2eid"]
            arr = np.frombuffer(os.pread(fds.get(t.file) or fds.setdefault(t.file, os.open(t.file, os.O_RDONLY)),
                                         t.nbytes, t.offset), dtype="<i8").reshape(t.shape)
            problems += tid2eid_problems(arr, g, f"{t.file}: {t.name}")
    finally:
        for fd in fds.values():
            os.close(fd)
    info.update(records=layers * g.n_experts, records_checked=layers * g.n_experts,
                bytes_checked=total, nan_scale_bytes=nan_total + fp8_nan)
    if nan_total:
        problems.append(f"{root}: {nan_total} NaN scale bytes (0xFF) in expert scales: "
                        + "; ".join(nan_where[:10]) + (" ..." if len(nan_where) > 10 else ""))
    problems += _capped(value_problems, "tensors with non-finite values")
    return problems


# every float dtype a tensor may be stored in, and how its non-finite values are named
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0")
_NON_FINITE = {"F8_E8M0": "NaN scale bytes (0xFF)", "F8_E4M3": "NaN E4M3 codes (0x7F/0xFF)"}


def _fp8_scale_names(tensors: dict) -> list[str]:
    """The `*.scale` tensors of the release's F8_E4M3 weights, in name order."""
    out = []
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dtype == "F8_E4M3":
            scale = name[: -len(".weight")] + ".scale"
            if scale in tensors:
                out.append(scale)
    return sorted(out)


def _nan_scales(data: bytes, dtype: str) -> int:
    """NaN scales in a scale tensor's bytes: E8M0 0xFF, or a float NaN."""
    if dtype in ("F32", "BF16", "F16"):
        return int(np.count_nonzero(np.isnan(np.frombuffer(data, dtype=st_numpy_dtype(dtype)).astype(np.float32))))
    return data.count(bytes([E8M0_NAN]))


def tid2eid_problems(arr, g: Geometry, what: str) -> list[str]:
    """Ids out of range, and rows (one token's experts) naming the same expert twice."""
    if arr is None:
        return []
    out = []
    bad = (arr < 0) | (arr >= g.n_experts)
    if bad.any():
        out.append(f"{what}: {int(bad.sum())} expert ids outside 0..{g.n_experts - 1}")
    srt = np.sort(np.asarray(arr).reshape(len(arr), -1), axis=1)
    dup = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
    if len(dup):
        first = ", ".join(f"token {int(t)}: {np.asarray(arr[t]).tolist()}" for t in dup[:5])
        out.append(f"{what}: {len(dup)} token{'s' if len(dup) != 1 else ''} routed to the same expert twice"
                   f" (duplicate expert ids in a row): {first}" + (" ..." if len(dup) > 5 else ""))
    return out


def _capped(items: list[str], what: str) -> list[str]:
    if len(items) <= MAX_LISTED:
        return items
    return items[:MAX_LISTED] + [f"... and {len(items) - MAX_LISTED} more {what}"]
