"""Reading the official release's layout: safetensors shard headers and the index.

Only headers are parsed here (the first 8 + N bytes of each shard); tensor bytes are
then read by absolute byte range, so an expert is two preads and nothing is mmap'd.
Every problem is a Ds4fError naming the file and what is wrong with it.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ds4f.errors import Ds4fError, parse_json
from ds4f.safe_read import open_regular, read_regular
from ds4f.engine.checkpoint.formats import ST_DTYPES, st_itemsize

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors code: "I8", "F8_E8M0", "BF16", ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in `file`
    nbytes: int


MAX_JSON = 256 << 20   # a checkpoint's JSON file (the index, pool.json, trunk.json: MBs on the real model)


def read_json(path: Path, what: str = "JSON") -> object:
    """A checkpoint's JSON file: a regular file (a FIFO or a device under its name is refused, never
    opened for a read that would block) of at most MAX_JSON bytes, parsed."""
    try:
        text = read_regular(path, what, MAX_JSON, missing=f"{path}: missing").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Ds4fError(f"{path}: cannot read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise Ds4fError(f"{path}: bad {what}: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise Ds4fError(f"{path}: bad {what}: nested too deeply to read") from None


def read_shard_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one shard's header: every tensor inside the file, sizes consistent."""
    path = Path(path)
    try:
        with open_regular(path, "safetensors shard", missing=f"{path}: missing shard") as (f, st):
            size = st.st_size
            head = f.read(8)
            if len(head) < 8:
                raise Ds4fError(f"{path}: truncated: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise Ds4fError(f"{path}: truncated or not safetensors: header length {n} but file has {size} bytes")
            raw = f.read(n)
    except OSError as exc:
        raise Ds4fError(f"{path}: cannot read: {exc.strerror or exc}") from None
    header = parse_json(raw, f"{path}: bad safetensors header")
    if not isinstance(header, dict):
        raise Ds4fError(f"{path}: bad safetensors header: not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    data_end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = meta["dtype"]
            shape = tuple(int(x) for x in meta["shape"])
            start, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise Ds4fError(f"{path}: bad safetensors header entry for {name!r}") from None
        if dtype not in ST_DTYPES:
            raise Ds4fError(f"{path}: {name}: unsupported dtype {dtype}")
        if any(s < 0 for s in shape) or not 0 <= start <= end:
            raise Ds4fError(f"{path}: {name}: bad shape {list(shape)} or data offsets [{start}, {end}]")
        want = math.prod(shape) * st_itemsize(dtype)
        if end - start != want:
            raise Ds4fError(f"{path}: {name}: {end - start} bytes of data for {dtype} {list(shape)} (expected {want})")
        if base + end > size:
            raise Ds4fError(f"{path}: truncated: {name} ends at byte {base + end} but the file has {size} bytes")
        data_end = max(data_end, end)
        out[name] = TensorInfo(name, path, dtype, shape, base + start, end - start)
    # no two tensors share bytes (the safetensors library refuses such a file too)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out.values() if t.nbytes)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise Ds4fError(f"{path}: tensors {a} and {b} overlap (bytes {start_b - base}..{end_a - base} of the data)")
    return out


def load_official_index(root: Path) -> tuple[dict[str, TensorInfo], list[Path]]:
    """All tensors of an official checkpoint directory, by name; and the shard files.

    Uses model.safetensors.index.json when present (every tensor it names must be in the
    shard it names), else a single model.safetensors, else all *.safetensors files.
    """
    root = Path(root)
    index_path = root / INDEX_NAME
    if index_path.exists():
        index = read_json(index_path, "index JSON")
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise Ds4fError(f"{index_path}: bad index: no weight_map of tensor name -> shard file")
        shards: dict[str, list[str]] = {}
        for tname, fname in wm.items():
            if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
                raise Ds4fError(f"{index_path}: bad shard name {fname!r} for {tname}")
            shards.setdefault(fname, []).append(tname)
        tensors: dict[str, TensorInfo] = {}
        files = []
        for fname in sorted(shards):
            spath = root / fname
            if not spath.exists():
                raise Ds4fError(f"{spath}: missing shard (named by {INDEX_NAME} for {len(shards[fname])} tensors)")
            header = read_shard_header(spath)
            files.append(spath)
            for tname in shards[fname]:
                if tname not in header:
                    raise Ds4fError(f"{spath}: lacks tensor {tname} (named by {INDEX_NAME})")
                tensors[tname] = header[tname]
        return tensors, files
    candidates = [root / SINGLE_NAME] if (root / SINGLE_NAME).exists() else sorted(root.glob("*.safetensors"))
    if not candidates:
        raise Ds4fError(f"{root}: no {INDEX_NAME} and no .safetensors shards")
    tensors = {}
    for spath in candidates:
        for tname, info in read_shard_header(spath).items():
            if tname in tensors:
                raise Ds4fError(f"{spath}: tensor {tname} also in {tensors[tname].file.name}")
            tensors[tname] = info
    return tensors, candidates


def pread_exact(fd: int, buf, offset: int, path: Path | str, what: str) -> int:
    """Fill `buf` (a writable buffer) from `offset`; a short read is a Ds4fError naming `what`."""
    mv = memoryview(buf).cast("B")
    done = 0
    total = len(mv)
    while done < total:
        try:
            n = os.preadv(fd, [mv[done:]], offset + done)
        except OSError as exc:
            raise Ds4fError(f"{path}: read of {what} failed: {exc.strerror or exc}") from None
        if n <= 0:
            raise Ds4fError(f"{path}: truncated: short read of {what} at byte {offset + done}"
                            f" ({done} of {total} bytes)")
        done += n
    return done
