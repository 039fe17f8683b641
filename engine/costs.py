"""What computing rows cost: the expert reads, the cache, the waits for the disk and the compute's
time by part. One value for a decode step, a prompt chunk, a round of drafts and each row's share
of them (engine.session's results, engine.batch's shares, engine.generate's rows)."""
from __future__ import annotations

from dataclasses import dataclass, fields

COUNTS = ("hits", "misses", "bytes_read", "reads", "prefetch_hits")   # whole units: split by rows, whole
WAITS = ("stall_s", "disk_busy_s", "disk_depth_s")                   # seconds: split by rows, evenly


@dataclass
class Costs:
    hits: int = 0              # expert-cache hits, prefetch_hits included
    misses: int = 0
    bytes_read: int = 0        # disk bytes: expert misses, prefetch guesses, unpinned trunk layers
    reads: int = 0             # reads started (experts, prefetch guesses, trunk layers)
    prefetch_hits: int = 0     # of the hits, those on an expert a prefetch guess brought in
                               # (hits - prefetch_hits: the cache policy's own hits)
    stall_s: float = 0.0       # time the compute waited for expert reads
    disk_busy_s: float = 0.0   # time with at least one read in flight
    disk_depth_s: float = 0.0  # time integral of reads in flight (/ the time: the mean queue depth)
    attention_s: float = 0.0   # attention sublayers (hyper-connection mixing included)
    moe_s: float = 0.0         # MoE sublayers, waiting for expert reads (stall_s) included
    head_s: float = 0.0        # the head (hc reduction, final norm, vocabulary product)
    batch_steps: int = 1       # the forward passes the rows went in (engine.batch; 1 alone)
    batch_shared: int = 0      # of those, the ones shared with another sequence

    @classmethod
    def between(cls, before: list, after: list, times) -> "Costs":
        """The costs from two readings of the engine's totals (engine.batch.engine_counters: COUNTS
        then WAITS) and the time by part (attention, MoE, head: model.forward's times)."""
        delta = dict(zip(COUNTS + WAITS, [a - b for a, b in zip(after, before)]))
        return cls(**delta, attention_s=float(times[0]), moe_s=float(times[1]), head_s=float(times[2]))

    def split(self, n: int) -> list["Costs"]:
        """The costs shared out over n rows: counts whole (the remainder to the first rows), the
        rest evenly; the shares add up to the whole."""
        whole = {k: split_whole(getattr(self, k), n) for k in COUNTS}
        rest = {f.name: getattr(self, f.name) / n for f in fields(self) if f.name not in whole}
        return [Costs(**{k: v[c] for k, v in whole.items()}, **rest) for c in range(n)]


def split_whole(total: int, n: int) -> list[int]:
    """total split over n rows in whole units, the remainder to the first ones (they add up)."""
    q, r = divmod(int(total), n)
    return [q + (1 if i < r else 0) for i in range(n)]
