"""The NVMe floor: GB/s of random expert-record reads through the engine's own read path.

`io_threads` threads each read random (layer, expert) records into their own aligned buffer
for a bounded time, through Checkpoint.read_expert (O_DIRECT for the ds4f layout, else
buffered reads dropped from the page cache), so the figure is what the engine can get from
this disk at its queue depth, not what the page cache can.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from ds4f.errors import Ds4fError
from ds4f.partials import sweep_partials, written_whole
from ds4f.paths import user_cache_dir
from ds4f.safe_read import read_regular_json
from ds4f.engine.runtime.memory import warm_buffer


FLOOR_CAVEAT = ("note: read / floor above 1 means the run read faster than the probe's uniformly random reads: "
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
    measured_at: float = 0.0   # time.time() of the measurement


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
                       io_threads=io_threads, io_mode=checkpoint.io_mode, record_nbytes=checkpoint.slot_nbytes,
                       measured_at=time.time())


def _cache_key(checkpoint, io_threads: int) -> str:
    files = sorted({path for path, _off, _len in checkpoint.expert_extents(0, 0)})
    parts = []
    for path in files:
        st = os.stat(path)
        parts.append(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts) + f"|qd{io_threads}"


FLOOR_MAX_AGE_S = 900.0  # a shared or thermally throttled disk drifts: re-measure after this
FLOOR_ENTRIES = 64       # floor.json keeps at most this many (checkpoint, queue depth) measurements, none stale
FLOOR_STORE_BYTES = 1 << 20   # a floor.json larger than this is not ds4f's: measured again and rewritten


def _load_floors(store) -> dict:
    """floor.json's measurements; {} for none, or for a file that is not ds4f's (not a regular file,
    larger than FLOOR_STORE_BYTES, not a JSON object)."""
    try:
        known = read_regular_json(store, "disk floor store", FLOOR_STORE_BYTES)
    except Ds4fError:
        return {}
    return known if isinstance(known, dict) else {}


def cached_floor(checkpoint, io_threads: int, seconds: float = 2.0, max_age_s: float = FLOOR_MAX_AGE_S) -> FloorResult:
    """The floor for this checkpoint's pool at this queue depth, remembered for max_age_s."""
    store = user_cache_dir() / "floor.json"
    key = _cache_key(checkpoint, io_threads)
    known = _load_floors(store)
    entry = known.get(key)
    if isinstance(entry, dict) and time.time() - entry.get("measured_at", 0) < max_age_s:
        try:
            return FloorResult(**{"measured_at": entry["measured_at"], **entry["result"]})
        except (TypeError, KeyError):
            pass
    return refresh_floor(checkpoint, io_threads, seconds, known)


def refresh_floor(checkpoint, io_threads: int, seconds: float = 2.0, known: dict | None = None) -> FloorResult:
    """Measure the floor now and remember it for cached_floor (what `ds4f probe-disk` does)."""
    store = user_cache_dir() / "floor.json"
    key = _cache_key(checkpoint, io_threads)
    if known is None:
        known = _load_floors(store)
    result = probe_floor(checkpoint, io_threads, seconds)
    known[key] = {"measured_at": result.measured_at, "result": asdict(result)}
    # only what cached_floor may still use: a checkpoint's entry stays behind when it changes or goes
    fresh = sorted(((v.get("measured_at", 0), k) for k, v in known.items() if isinstance(v, dict)
                    and isinstance(v.get("measured_at", 0), (int, float))
                    and result.measured_at - v.get("measured_at", 0) < FLOOR_MAX_AGE_S), reverse=True)
    known = {k: known[k] for _, k in fresh[:FLOOR_ENTRIES]}
    store.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(store.parent, pattern=f"{store.name}.*.partial")   # of writers killed before
    with written_whole(store) as f:    # two processes measuring at once each write a whole file
        f.write(json.dumps(known, indent=1).encode())
    return result


@dataclass(frozen=True)
class ReplayResult:
    seconds: float         # wall time of the replay
    reads: int
    nbytes: int
    io_threads: int
    io_mode: str


def replay_reads(checkpoint, reads: list[tuple[str, int, int]], io_threads: int,
                 expert_bufs: list | None = None, trunk_bufs: list | None = None) -> ReplayResult:
    """Read `reads` (("expert", layer, expert) or ("trunk", layer, -1)) again in the same order at
    the same queue depth, with the engine's read path (direct I/O where the layout allows) and no
    compute: the time the disk itself needs for a run's reads.
    expert_bufs: aligned buffers to read into, one per thread (slots an idle engine lends,
    Engine.read_scratch), so the replay costs no memory; a thread beyond them allocates its own;
    trunk_bufs: buffers the trunk reads share (a run keeps two, so at most two trunk reads are in
    flight, as in the run). By default each thread allocates its own."""
    shared_trunk: queue.Queue | None = None
    if trunk_bufs:
        shared_trunk = queue.Queue()
        for b in trunk_bufs:
            shared_trunk.put(b)
    lock = threading.Lock()
    next_i = [0]
    nbytes = [0]

    def worker(i: int) -> None:
        expert_buf = expert_bufs[i] if expert_bufs and i < len(expert_bufs) else warm_buffer(checkpoint.slot_nbytes)
        trunk_buf = None
        while True:
            with lock:
                i = next_i[0]
                if i >= len(reads):
                    return
                next_i[0] += 1
            kind, layer, expert = reads[i]
            if kind == "expert":
                n = checkpoint.read_expert(layer, expert, expert_buf)
            elif shared_trunk is not None:
                buf = shared_trunk.get()
                try:
                    checkpoint.read_trunk_layer(layer, buf)
                finally:
                    shared_trunk.put(buf)
                n = checkpoint.trunk_layer_nbytes(layer)
            else:
                if trunk_buf is None:
                    trunk_buf = warm_buffer(checkpoint.trunk_layer_buf_nbytes)
                checkpoint.read_trunk_layer(layer, trunk_buf)
                n = checkpoint.trunk_layer_nbytes(layer)
            with lock:
                nbytes[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,), name=f"ds4f-replay-{i}") for i in range(io_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ReplayResult(time.perf_counter() - t0, len(reads), nbytes[0], io_threads, checkpoint.io_mode)
