"""The NVMe floor: GB/s of random expert-record reads through the engine's own read path.

`io_threads` threads each read random (layer, expert) records into their own aligned buffer
for a bounded time, through Checkpoint.read_expert (O_DIRECT for the ds4f layout, else
buffered reads dropped from the page cache), so the figure is what the engine can get from
this disk at its queue depth, not what the page cache can.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from ds4f.engine.config import user_cache_dir
from ds4f.engine.runtime.memory import warm_buffer


FLOOR_CAVEAT = ("note: efficiency above 1 means the run read faster than the probe's uniformly random reads: "
                "something below O_DIRECT (a host or controller cache) favours the experts the run re-reads; "
                "the floor is then a lower bound, not this disk's limit")


@dataclass(frozen=True)
class FloorResult:
    gbps: float            # 1e9 bytes per second
    reads: int
    nbytes: int
    seconds: float
    io_threads: int
    io_mode: str
    record_nbytes: int


def probe_floor(checkpoint, io_threads: int = 4, seconds: float = 2.0, max_reads: int = 4096,
                seed: int = 0) -> FloorResult:
    g = checkpoint.geometry
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, [g.n_layers, g.n_experts], size=(max_reads, 2))
    lock = threading.Lock()
    next_i = [0]
    totals = [0, 0]  # reads, bytes
    deadline = time.perf_counter() + seconds

    def worker() -> None:
        buf = warm_buffer(checkpoint.slot_nbytes)
        while time.perf_counter() < deadline:
            with lock:
                i = next_i[0]
                if i >= max_reads:
                    return
                next_i[0] += 1
            n = checkpoint.read_expert(int(keys[i, 0]), int(keys[i, 1]), buf)
            with lock:
                totals[0] += 1
                totals[1] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"ds4f-probe-{i}") for i in range(io_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return FloorResult(gbps=totals[1] / elapsed / 1e9, reads=totals[0], nbytes=totals[1], seconds=elapsed,
                       io_threads=io_threads, io_mode=checkpoint.io_mode, record_nbytes=checkpoint.slot_nbytes)


def _cache_key(checkpoint, io_threads: int) -> str:
    files = sorted({path for path, _off, _len in checkpoint.expert_extents(0, 0)})
    parts = []
    for path in files:
        st = os.stat(path)
        parts.append(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts) + f"|qd{io_threads}"


FLOOR_MAX_AGE_S = 900.0  # a shared or thermally throttled disk drifts: re-measure after this


def cached_floor(checkpoint, io_threads: int, seconds: float = 2.0, max_age_s: float = FLOOR_MAX_AGE_S) -> FloorResult:
    """The floor for this checkpoint's pool at this queue depth, remembered for max_age_s."""
    store = user_cache_dir() / "floor.json"
    key = _cache_key(checkpoint, io_threads)
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and time.time() - entry.get("measured_at", 0) < max_age_s:
        try:
            return FloorResult(**entry["result"])
        except (TypeError, KeyError):
            pass
    result = probe_floor(checkpoint, io_threads, seconds)
    known[key] = {"measured_at": time.time(), "result": asdict(result)}
    store.parent.mkdir(parents=True, exist_ok=True)
    tmp = store.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, store)
    return result
