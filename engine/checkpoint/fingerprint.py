"""A checkpoint's fingerprint: a sha256 that changes with its weights, so a saved session state is
used only with the checkpoint it was computed on (a copy of the directory keeps it; another
checkpoint of the same geometry, another seed of a synthetic one, a byte changed in place anywhere
does not).

Every regular file of the checkpoint's directory counts (hidden ones aside), by name and size, and
every byte of its content counts, in one of two ways:

- the ds4f layout's two data files (pool-mxfp4.bin, trunk.bin) through the crc32 of every expert
  record and trunk region that its JSON files carry (hashed whole): the engine checks every record
  and region it reads against them, so a byte changed there either changes the JSON or is refused
  as corrupt when read; nothing of these files is read for the fingerprint;
- every other file (an official release's safetensors shards, config.json, tokenizer.json, ...)
  by the sha256 of all its bytes.

Hashing a large file is paid once: its sha256 is kept in the user's cache directory
(`fingerprints.json`) under its identity, (device, inode, size, mtime_ns, ctime_ns); a file
written in place changes its ctime even when its mtime is put back, so a kept sum is never used
for changed content. The cost, once per shard: the official DeepSeek-V4-Flash release (156 GB) is
read whole at the disk's speed (52-78 s at 2-3 GB/s; the sums run in several threads, so the
sha256 at ~1-2 GB/s a core is not the bound); its ds4f layout (the 147 GB pool) reads only its JSON
files (a few MB), as before."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ds4f.engine.checkpoint.base import POOL_BIN, POOL_JSON, TRUNK_BIN, TRUNK_JSON
from ds4f.errors import Ds4fError
from ds4f.partials import sweep_partials, written_whole
from ds4f.paths import user_cache_dir
from ds4f.safe_read import read_regular_json

FORMAT = b"ds4f.checkpoint/2"
KEPT_BYTES = 16 << 20        # files larger than this have their sum kept in the store
CHUNK = 8 << 20
STORE_NAME = "fingerprints.json"
STORE_MAX_BYTES = 8 << 20    # a store larger than this (not ds4f's) is ignored and rewritten
STORE_MAX_ENTRIES = 4096     # the oldest go past this
THREADS = 4

_known: dict[tuple, str] = {}    # (path, each file's identity) -> fingerprint, this process's
_lock = threading.Lock()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _files(path: Path) -> list[tuple[Path, os.stat_result]]:
    if not path.is_dir():
        return [(path, path.stat())]
    out = []
    for p in sorted(path.iterdir()):
        if p.name.startswith("."):
            continue
        try:
            st = p.stat()
        except OSError:
            continue
        if os.path.isfile(p):          # regular files only (a FIFO or a device is no part of it)
            out.append((p, st))
    return out


def crc_checked(files: list[tuple[Path, os.stat_result]]) -> set[str]:
    """The names of the files whose every byte the engine checks against crc32s its JSON files
    carry (the ds4f layout's data files, when its JSON files are there)."""
    names = {p.name for p, _ in files}
    return {POOL_BIN, TRUNK_BIN} & names if {POOL_JSON, TRUNK_JSON} <= names else set()


def checkpoint_fingerprint(path: str | Path, log=None, store: str | Path | None = None) -> str:
    """The fingerprint (computed once per process for files whose identity has not changed since).
    log: told, before a long hash, how many bytes are read and why; store: the file the sums of
    large files are kept in (default: the user's cache directory)."""
    path = Path(path)
    files = _files(path)
    key = (str(path.resolve()), tuple((p.name, *_identity(st)) for p, st in files))
    with _lock:
        if key in _known:
            return _known[key]
    fp = _compute(files, log, Path(store) if store is not None else _default_store())
    with _lock:
        _known[key] = fp
    return fp


def _default_store() -> Path:
    return user_cache_dir() / STORE_NAME


def _compute(files: list[tuple[Path, os.stat_result]], log, store: Path) -> str:
    checked = crc_checked(files)
    kept = _load_store(store)
    sums: dict[str, str] = {}
    todo = []
    for p, st in files:
        if p.name in checked:
            continue
        entry = kept.get(str(p.resolve())) if st.st_size > KEPT_BYTES else None
        if isinstance(entry, dict) and entry.get("identity") == _identity(st) and isinstance(entry.get("sha256"), str):
            sums[p.name] = entry["sha256"]
        else:
            todo.append((p, st))
    big = [(p, st) for p, st in todo if st.st_size > KEPT_BYTES]
    if big and log is not None:
        total = sum(st.st_size for _, st in big)
        log(f"fingerprint: reading {total / 1e9:.1f} GB of {len(big)} files of {big[0][0].parent} once, to know"
            f" its weights by every byte (kept in {store} for the next start)")
    with ThreadPoolExecutor(max_workers=max(1, min(THREADS, len(todo)))) as pool:
        for (p, st), digest in zip(todo, pool.map(lambda f: _sha256(f[0]), todo)):
            sums[p.name] = digest
    if big:
        now = time.time()
        for p, st in big:
            kept[str(p.resolve())] = {"identity": _identity(st), "sha256": sums[p.name], "at": now}
        _save_store(store, kept, log)
    h = hashlib.sha256(FORMAT)
    for p, st in files:
        h.update(f"{p.name}\0{st.st_size}\0".encode())
        h.update(b"crc32-checked" if p.name in checked else bytes.fromhex(sums[p.name]))
    return h.hexdigest()


def _sha256(path: Path) -> str:
    """The sha256 of every byte of a file, read in chunks (dropped from the page cache behind)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
            done += n
            if done >= 256 << 20:
                _dontneed(f.fileno())
                done = 0
        _dontneed(f.fileno())
    return h.hexdigest()


def _dontneed(fd: int) -> None:
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def _load_store(store: Path) -> dict:
    try:
        data = read_regular_json(store, "fingerprint store", STORE_MAX_BYTES)
    except Ds4fError:
        return {}
    return data if isinstance(data, dict) else {}


def _save_store(store: Path, kept: dict, log=None) -> None:
    """The sums, the newest STORE_MAX_ENTRIES, written whole (ds4f.partials: a `.partial` of this
    process and thread, locked while it is written); the `.partial` files of earlier writers that
    were killed (nobody holds their lock) are removed first. A store that cannot be written only
    costs the next start the hash again."""
    entries = sorted(((k, v) for k, v in kept.items() if isinstance(v, dict)),
                     key=lambda kv: kv[1].get("at", 0) if isinstance(kv[1].get("at", 0), (int, float)) else 0)
    doc = dict(entries[-STORE_MAX_ENTRIES:])
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        sweep_partials(store.parent, log, pattern=f"{store.name}.*.partial", label="fingerprint store")
        with written_whole(store) as f:
            f.write(json.dumps(doc, indent=0).encode())
    except OSError:
        pass
