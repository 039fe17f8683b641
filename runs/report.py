"""A done run's report (report.json): its figures, the yardsticks measured once it is done
(Belady's hit rate on its own trace, a replay of its last reads), and the file itself, written
with every token's record before the run commits it beside its state dump."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ds4f.cachelab.replay import replay
from ds4f.cachelab.trace import Trace
from ds4f.engine.config import Budget
from ds4f.engine.runtime.disk_floor import replay_reads
from ds4f.errors import Ds4fError
from ds4f.runs.snapshot import TokenLog
from ds4f.runs.statedump import read_routing, write_error

REPORT_SCHEMA = "ds4f.report/1"

REPLAY_TOKENS = 32    # a done run's I/O efficiency replays the reads of its last REPLAY_TOKENS warm tokens
BELADY_MAX_REQUESTS = 4_000_000   # above this many expert requests a run skips Belady's optimum
BELADY_BYTES_PER_REQUEST = 24     # the routing read back (int32), its int64 codes, the next uses (int32),
                                  # and numpy's temporaries on the way


def finish_bytes(n_steps: int, g) -> int:
    """What the end of a run holds for a moment: the routing read back and Belady's next uses."""
    requests = n_steps * g.n_layers * g.top_k
    return requests * BELADY_BYTES_PER_REQUEST if requests <= BELADY_MAX_REQUESTS else 0


def optimum_hit_rate(g, state_file: Path, log: TokenLog, chunk: int, capacity_bytes: int, note) -> float | None:
    """Belady's hit rate on the run's own trace with the same cache: the regret's yardstick. The
    routing is read back from the state dump, not kept in memory during the run."""
    if not log.count:
        return None
    if log.count * g.n_layers * g.top_k > BELADY_MAX_REQUESTS:
        note(f"Belady's optimum not computed: more than {BELADY_MAX_REQUESTS:,} expert requests")
        return None
    ids = read_routing(state_file)
    prefilled = int(log.rows["prefill"][:log.count].sum())
    trace = Trace(g, ids, np.zeros(len(ids), np.int32), prefill=prefilled, chunk=chunk)
    try:
        return replay(trace, Budget(nbytes=capacity_bytes), "belady").hit_rate
    except Ds4fError:
        return None


def replay_last_reads(eng, log: TokenLog, note, session=None) -> dict | None:
    """Replay the reads of the last warm tokens (same records, order and queue depth, no compute)
    into buffers the idle engine lends (Engine.read_scratch: cache slots taken out of the cache,
    so the experts it serves stay theirs); efficiency = replay time / the time those tokens had a
    read in flight. None (not measured) while sessions other than the run's `session` step on
    the engine."""
    if log.count < 2:
        return None
    k = min(REPLAY_TOKENS, log.count - 1)
    rows = log.rows[log.count - k:log.count]
    n, busy = int(rows["reads"].sum()), float(rows["disk_busy_s"].sum())
    reads = eng.reader.recent_reads(n) if n else None
    if not reads or busy <= 0:
        return None
    threads = int(rows["io_threads"][-1])
    with eng.read_scratch(threads, session) as lent:
        if lent is None:
            note("I/O efficiency: not measured: other sequences step on the engine")
            return None
        slots, trunk = lent
        try:
            r = replay_reads(eng.ckpt, reads, threads, expert_bufs=slots, trunk_bufs=trunk)
        except Ds4fError as exc:
            note(f"disk replay failed: {exc}")
            return None
    eff = r.seconds / busy
    note(f"disk replay of the last {k} tokens' {n} reads: {r.seconds:.3f} s against {busy:.3f} s"
         f" with reads in flight during the run: I/O efficiency {eff:.2f}")
    return {"tokens": k, "reads": n, "nbytes": r.nbytes, "replay_s": r.seconds, "run_busy_s": busy,
            "efficiency": eff, "io_threads": threads, "io_mode": r.io_mode}


def time_split(log: TokenLog) -> dict | None:
    """Where a warm token's time goes, mean seconds per token: attention, MoE compute, waiting
    for expert reads, the head, and the rest (routing bookkeeping, the state record, Python)."""
    warm = log.warm()
    if not len(warm):
        return None
    mean = {name: float(warm[name].mean()) for name in ("seconds", "attention_s", "moe_s", "stall_s", "head_s")}
    split = {"attention_s": mean["attention_s"], "moe_compute_s": mean["moe_s"] - mean["stall_s"],
             "read_wait_s": mean["stall_s"], "head_s": mean["head_s"]}
    split["other_s"] = mean["seconds"] - sum(split.values())
    split["attention_share"] = mean["attention_s"] / mean["seconds"] if mean["seconds"] else None
    return split


def prefill_report(log: TokenLog, chunk: int, g) -> dict | None:
    """The prompt's figures apart from decode's: layer-major chunks (or token by token)."""
    fig = log.prefill_figures()
    if fig is None:
        return None
    chunks = -(-fig["tokens"] // chunk)
    fig.update(chunk=chunk, chunks=chunks,
               experts_read_per_layer_chunk=fig["misses"] / (chunks * g.n_layers),
               experts_used_per_layer_chunk=(fig["hits"] + fig["misses"]) / (chunks * g.n_layers))
    return fig


def summary(snap, log: TokenLog, split: dict | None, prefill: dict | None, disk_replay: dict | None) -> dict:
    """The report's summary: the run's figures at its end (from its last snapshot)."""
    cold = log.first
    return {
        "tokens": snap.tokens_done, "s_per_token": snap.s_per_token, "s_first_token": snap.s_first_token,
        "tokens_s": float(log.rows["seconds"][:log.count].sum()),   # what the computed tokens took, in all
        "prompt_tokens_reused": snap.prompt_tokens_reused,   # from the prefix cache, not computed
        "gb_per_token": snap.gb_per_token, "gb_first_token": cold.bytes_read / 1e9 if cold else None,
        "eff_read_gbps": snap.eff_read_gbps, "floor_gbps": snap.floor_gbps, "io_efficiency": snap.io_efficiency,
        "hit_rate": snap.hit_rate, "hits": sum(snap.layer_hits), "misses": sum(snap.layer_misses),
        "prefetch_hits": log.prefetch_hits,   # of the hits, those on prefetched experts
        "evictions": sum(snap.layer_evictions), "read_latency_ms": snap.read_latency_ms,
        "stall_s_per_token": snap.stall_s_per_token, "rss_bytes": snap.rss_bytes,
        "rss_budget_bytes": snap.rss_budget_bytes, "wall_s": snap.elapsed_s,
        "prefetch": snap.prefetch or None, "optimum_hit_rate": snap.optimum_hit_rate,
        "policy_hit_rate": snap.policy_hit_rate, "prefetch_hit_share": snap.prefetch_hit_share,
        "regret_pp": snap.regret_pp, "bound": snap.bound, "floor_ratio": snap.floor_ratio,
        "disk_replay": disk_replay, "ram_bytes": snap.ram_bytes, "plan_bytes": snap.plan_bytes,
        "kv_bytes": snap.kv_bytes, "context": snap.context,
        "check_s_per_token": snap.check_s_per_token,
        "split": split,
        "prefill": prefill,
        # warm tokens: the share of time the disk had a read in flight, and the mean number in flight
        "disk_busy_fraction": snap.disk_busy_fraction, "mean_read_depth": snap.mean_read_depth,
    }


def layers(snap) -> list[dict]:
    """Each layer's cache figures."""
    return [{"layer": i, "hits": h, "misses": m, "evictions": e, "prefetch_hits": p, "policy_hit_rate": r}
            for i, (h, m, e, p, r) in enumerate(zip(snap.layer_hits, snap.layer_misses, snap.layer_evictions,
                                                    snap.layer_prefetch_hits, snap.layer_policy_hit_rates()))]


def write_report(report: dict, log: TokenLog, tmp: Path, report_path: Path) -> None:
    """`report` plus the per-token records, written one token at a time to `tmp` (the report's
    .partial, flushed to disk; StateWriter.commit renames it). A write error is a Ds4fError
    naming the report, and leaves no `tmp`."""
    head = json.dumps(report, indent=1)
    try:
        with open(tmp, "w") as f:
            f.write(head[:head.rindex("}")].rstrip() + ',\n "tokens": [')
            for i in range(log.count):
                f.write(("\n  " if i == 0 else ",\n  ") + json.dumps(asdict(log.record(i))))
            f.write("\n ]\n}\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(report_path, exc) from None
