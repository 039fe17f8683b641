"""A checkpoint's fingerprint: a sha256 that changes with its weights, so a saved session state is
used only with the checkpoint it was computed on (a copy of the directory keeps it; another
checkpoint of the same geometry, another seed of a synthetic one, does not).

Every regular file of the checkpoint's directory counts (hidden ones aside): by name and size, and
its content, whole up to WHOLE_BYTES, else three SLICE_BYTES slices (start, middle, end). The ds4f
layout's JSON files carry every record's and region's crc32, so its fingerprint covers all its
bytes; official shards are sampled (the first slice holds a shard's safetensors header)."""
from __future__ import annotations

import hashlib
from pathlib import Path

WHOLE_BYTES = 16 << 20
SLICE_BYTES = 1 << 20


_known: dict[tuple, str] = {}    # (path, each file's name, size and mtime) -> fingerprint, this process's


def checkpoint_fingerprint(path: str | Path) -> str:
    """The fingerprint; computed once per process for files that have not changed since (the
    run's prompt and the engine both ask for it, and it reads megabytes of every shard)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")) if path.is_dir() \
        else [path]
    stamps = tuple((f.name, st.st_size, st.st_mtime_ns) for f in files for st in (f.stat(),))
    key = (str(path.resolve()), stamps)
    if key not in _known:
        _known[key] = _compute(files)
    return _known[key]


def _compute(files: list[Path]) -> str:
    h = hashlib.sha256(b"ds4f.checkpoint/1")
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= WHOLE_BYTES:
                h.update(fh.read())
                continue
            for at in (0, (size - SLICE_BYTES) // 2, size - SLICE_BYTES):
                fh.seek(at)
                h.update(fh.read(SLICE_BYTES))
    return h.hexdigest()
