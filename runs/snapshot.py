"""The live figures of a run: an immutable Snapshot any thread can take cheaply at any time.

The console polls it on a timer, the server serves it, the CLI prints it; nobody reaches
into the engine for anything else. Units are in the field names or comments.
"""
from __future__ import annotations

import collections
import sys
import time

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np
import psutil

from ds4f.engine.costs import Costs
from ds4f.native.kernels import BACKENDS

if TYPE_CHECKING:
    from ds4f.engine.engine import EngineFigures

SNAPSHOT_EVENTS = 200      # the lines a snapshot carries


@dataclass(frozen=True)
class TokenRecord:
    """One decoded token, as the report's token-by-token record keeps it."""

    index: int              # 0-based position among the generated tokens
    token_id: int           # the token fed in at this step
    next_token_id: int      # greedy choice produced by this step
    seconds: float          # wall time of this step
    bytes_read: int         # disk bytes this token: expert misses + unpinned trunk layers
    hits: int               # expert-cache hits this token, prefetch_hits included
    misses: int             # expert-cache misses this token
    stall_s: float          # time the compute waited for misses
    backend: str            # kernel backend used for this token
    kernel_threads: int
    io_threads: int
    disk_busy_s: float = 0.0    # time with at least one read in flight (prefetch can use only the rest)
    disk_depth_s: float = 0.0   # time integral of reads in flight; / seconds = mean queue depth
    reads: int = 0              # reads started during the token (experts, prefetch guesses, trunk layers)
    prefetch_hits: int = 0      # of the hits, those on an expert a prefetch guess brought in
    attention_s: float = 0.0    # of `seconds`: attention sublayers (hyper-connection mixing included)
    moe_s: float = 0.0          # of `seconds`: MoE sublayers, stall_s (waiting for reads) included
    head_s: float = 0.0         # of `seconds`: the head (hc reduction, final norm, vocabulary matvec)
    prefill: bool = False       # processed in a layer-major prefill chunk: the chunk's wall time, reads,
                                # hits and misses are shared out evenly over its tokens
    reused: bool = False        # a prompt token not computed: its state came from the prefix cache
    text: str = ""              # the text this token added to the output ("" for prompt tokens, and
                                # while a UTF-8 sequence or a possible stop string is incomplete)

    @classmethod
    def of(cls, costs: Costs, **rest) -> "TokenRecord":
        """The record of a token with its share of what its step cost (engine.costs.Costs: the
        fields both have) and the rest given."""
        return cls(**{name: getattr(costs, name) for name in _COST_FIELDS}, **rest)

    @property
    def policy_hit_rate(self) -> float | None:
        """The cache policy's own hit rate this token (hits without prefetch's help / requests):
        the yardstick Snapshot.policy_hit_rate uses for the whole run."""
        n = self.hits + self.misses
        return (self.hits - self.prefetch_hits) / n if n else None

    @property
    def prefetch_hit_share(self) -> float | None:
        """What prefetch added to this token's hit rate (hits on its guesses / requests)."""
        n = self.hits + self.misses
        return self.prefetch_hits / n if n else None


_COST_FIELDS = tuple(f.name for f in fields(Costs) if f.name in {g.name for g in fields(TokenRecord)})


@dataclass(frozen=True)
class Snapshot:
    run_id: str
    state: str                      # starting | running | done | cancelled | failed
    error: str | None
    model: str                      # checkpoint path
    preset: str
    steps: int                      # decode steps planned: prompt tokens after the first + tokens to generate
    tokens_done: int
    backend: str                    # active kernel backend: avx512 | avx2 | neon | scalar
    kernel_threads: int
    io_threads: int
    io_mode: str                    # "O_DIRECT" or "buffered+fadvise"
    policy: str                     # cache eviction policy name
    s_per_token: float | None       # median over warm tokens (all but the first)
    s_first_token: float | None     # the cold first token, reported apart
    gb_per_token: float | None      # mean disk GB (1e9 B) read per token
    eff_read_gbps: float | None     # gb_per_token / s_per_token
    floor_gbps: float | None        # NVMe floor from the engine's probe (None: not measured)
    io_efficiency: float | None     # the disk's own time for the run's reads (a replay: same records,
                                    # order and queue depth, no compute) / the time the run had reads
                                    # in flight; about 1 at most; None until the run is done
    hit_rate: float | None          # cumulative hits / routed requests
    layer_hits: tuple[int, ...]     # per layer, cumulative
    layer_misses: tuple[int, ...]
    layer_evictions: tuple[int, ...]
    cache_bytes: int                # bytes of expert slots in use
    budget_bytes: int               # the preset's expert-cache budget
    rss_bytes: int                  # resident set of the process
    rss_budget_bytes: int           # memory the preset expects: pinned trunk + cache budget
    read_latency_ms: float | None   # mean latency of one expert read
    stall_s_per_token: float | None # mean time compute waited for misses
    elapsed_s: float
    eta_s: float | None
    tokens: tuple[TokenRecord, ...] = ()   # the most recent tokens (at most TokenLog.RECENT), oldest first
    events: tuple[str, ...] = ()    # human-readable log lines (switches, errors, milestones)
    prefetch: dict = field(default_factory=dict)  # issued/useful/late/wasted/cancelled (empty: prefetch off)
    optimum_hit_rate: float | None = None  # Belady on this run's trace at the same budget (when done)
    disk_busy_fraction: float | None = None  # warm tokens: share of the time with a read in flight
    mean_read_depth: float | None = None     # warm tokens: mean number of reads in flight
    switches: tuple[tuple[int, str, int, int], ...] = ()  # (token, backend, kernel threads, I/O threads)
                                                          # at the run's start and at every change
    # hit rates on one yardstick: the policy's own hits (without prefetch's help) beside Belady's
    # on the same requests; prefetch's contribution apart; regret in percentage points
    policy_hit_rate: float | None = None      # (hits - hits on prefetched experts) / requests
    prefetch_hit_share: float | None = None   # hit_rate - policy_hit_rate
    regret_pp: float | None = None            # (Belady - policy) x 100, when the run is done
    bound: str | None = None        # "disk" (a read in flight most of the time) or "compute"
    floor_ratio: float | None = None          # eff_read_gbps / floor_gbps (a lower bound's yardstick)
    floor_age_s: float | None = None          # age of the floor measurement
    ram_bytes: int = 0                        # the machine's RAM
    ram_available_bytes: int = 0              # what the machine can still give (psutil "available")
    plan_bytes: int = 0                       # what the preset plans for the engine and the run
    kv_bytes: int = 0                         # the KV cache, allocated for `context` positions (in plan_bytes)
    context: int = 0                          # positions the run's KV cache holds (0: a MoE-only model)
    check_s_per_token: float | None = None    # I/O-thread seconds per token checking records' crc32
    layer_prefetch_hits: tuple[int, ...] = () # per layer, cumulative: of layer_hits, those on an expert a
                                              # prefetch guess brought in (all 0 with prefetch off)
    phase: str = "decode"                     # "prefill" while the prompt is read, then "decode"
    prompt_tokens: int = 0                    # tokens of the prompt (BOS included)
    prompt_tokens_reused: int = 0             # of those, taken from the prefix cache (not computed)
    generated_tokens: int = 0                 # tokens generated so far
    output_text: str = ""                     # the generated text so far ("" without a tokenizer)
    finish_reason: str | None = None          # "length" | "eos" | "stop" once generation ended
    prefill_tokens: int = 0                   # prompt tokens processed in layer-major chunks so far
    prefill_tokens_per_s: float | None = None # their rate (the chunks' wall time)
    prefill_gb_per_token: float | None = None # disk GB read per prefilled token
    prefill_chunk: int = 0                    # tokens per chunk (0: the prompt goes token by token)
    # sequences decoded together on the engine (engine.batch; parallel 1: the run is alone)
    batch_parallel: int = 1                   # sequences a step may hold
    batch_sequences: int = 0                  # sequences stepping on the engine now (this one included)
    batch_cap: int = 1                        # sequences a step holds now (below parallel: capped)
    batch_cap_reason: str = ""                # why it is capped
    batch_rows_per_step: int = 0              # rows in the engine's last step
    batch_union_per_layer: float | None = None  # distinct experts per layer in that step
    batch_tokens_per_s: float | None = None   # rows per second over the recent steps, all sequences
    batch_steps: int = 0                      # forward passes this run's tokens went in
    batch_shared_steps: int = 0               # of them, those shared with other sequences
    # speculative decoding with the MTP layer (engine.speculative; spec "off": all empty)
    spec_mode: str = "off"                    # off | auto | a fixed number of drafts
    spec_k: int = 0                           # drafts in the last round (0: it stepped plainly)
    spec_rounds: int = 0                      # rounds with drafts so far
    spec_acceptance: float | None = None      # drafts kept / drafts proposed
    spec_tokens_per_round: float | None = None  # tokens a round with drafts gave (kept + 1)
    spec_draft_gb: float = 0.0                # GB the MTP layer read
    spec_draft_s: float = 0.0                 # seconds in the MTP layer

    def layer_policy_hit_rates(self) -> list[float | None]:
        """Per layer, the policy's own hit rate (hits without prefetch's help / requests), the
        per-layer view of policy_hit_rate; None for a layer without requests yet."""
        pf = self.layer_prefetch_hits or (0,) * len(self.layer_hits)
        return [(h - p) / (h + m) if h + m else None for h, m, p in zip(self.layer_hits, self.layer_misses, pf)]


def disk_occupancy(tokens: "tuple[TokenRecord, ...] | list[TokenRecord]") -> tuple[float | None, float | None]:
    """Over the warm tokens (all, if only one): the share of time the disk had a read in
    flight, and the mean number in flight. (None, None) before any token."""
    warm = tokens[1:] or tokens
    seconds = sum(t.seconds for t in warm)
    if not seconds:
        return None, None
    return sum(t.disk_busy_s for t in warm) / seconds, sum(t.disk_depth_s for t in warm) / seconds


DISK_BOUND_BUSY = 0.8   # a run whose disk has a read in flight this share of the time is disk-bound


def bound_of(disk_busy_fraction: float | None) -> str | None:
    if disk_busy_fraction is None:
        return None
    return "disk" if disk_busy_fraction >= DISK_BOUND_BUSY else "compute"


# One token's figures in a fixed-size record: a run keeps all of them in one array sized up front.
TOKEN_DTYPE = np.dtype([("token_id", "<i4"), ("next_token_id", "<i4"), ("seconds", "<f8"), ("bytes_read", "<i8"),
                        ("hits", "<i4"), ("misses", "<i4"), ("stall_s", "<f8"), ("backend", "u1"),
                        ("kernel_threads", "<i2"), ("io_threads", "<i2"), ("disk_busy_s", "<f8"),
                        ("disk_depth_s", "<f8"), ("reads", "<i4"), ("prefetch_hits", "<i4"),
                        ("attention_s", "<f4"), ("moe_s", "<f4"), ("head_s", "<f4"), ("prefill", "u1"),
                        ("reused", "u1")])


class TokenLog:
    """A run's per-token figures in memory bounded from the start: one fixed-size row per planned
    token (TOKEN_DTYPE, allocated when the run starts and counted in its memory budget), and the
    last RECENT tokens as TokenRecords for snapshots. Not thread-safe: the run holds its lock."""

    RECENT = 256

    def __init__(self, n_tokens: int) -> None:
        self.rows = np.zeros(n_tokens, TOKEN_DTYPE)
        self.count = 0
        self.recent: collections.deque[TokenRecord] = collections.deque(maxlen=self.RECENT)
        self.switches: list[tuple[int, str, int, int]] = []
        self.texts: list[str] = []     # each token's text (TokenRecord.text), in order
        self.text_nbytes = 0           # what they hold (the list's slots and the strings)
        # running totals over all tokens, so a snapshot reads them without scanning the rows
        self.hits = self.misses = self.bytes_read = 0
        self.prefetch_hits = 0     # of the hits, those on prefetched experts: hits - these are the policy's own
        self.stall_s = 0.0
        self.prefill_tokens, self.prefill_s, self.prefill_bytes = 0, 0.0, 0   # the prefilled tokens'
        self.reused_tokens = 0         # leading prompt tokens taken from the prefix cache, not computed
        self._memo: dict[str, tuple[int, object]] = {}   # figure -> (count it was computed at, value)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.text_nbytes

    def _at_count(self, name: str, compute):
        """compute() once per token count: snapshots come far more often than tokens (the CLI
        polls 20 times a second, the console and a server's status too), and the figures over all
        warm rows would otherwise take the compute thread's GIL for a sort each time."""
        hit = self._memo.get(name)
        if hit is None or hit[0] != self.count:
            hit = self._memo[name] = (self.count, compute())
        return hit[1]

    @property
    def first(self) -> TokenRecord | None:
        """The cold first token: the run's first step, when it was a decode step (a prompt read in
        layer-major chunks has its own figures, and warms the cache for the first decode step)."""
        return self.record(0) if self.count and not self.rows["prefill"][0] else None

    def warm_gb_per_token(self) -> float | None:
        """Mean GB (1e9 B) read per warm decode token (the first token alone, if it is the only one)."""
        def compute():
            warm = self.warm()
            return float(warm["bytes_read"].mean()) / 1e9 if len(warm) else None
        return self._at_count("gb_per_token", compute)

    def prefill_figures(self) -> dict | None:
        """The layer-major prefill's figures: prompt tokens, seconds, tokens/s, GB per prompt token
        (None if no token was prefilled)."""
        rows = self.rows[:self.count]
        rows = rows[(rows["prefill"] == 1) & (rows["reused"] == 0)]
        if not len(rows):
            return None
        seconds = float(rows["seconds"].sum())
        return {"tokens": len(rows), "seconds": seconds, "tokens_per_s": len(rows) / seconds if seconds else None,
                "gb_per_token": float(rows["bytes_read"].sum()) / 1e9 / len(rows),
                "hits": int(rows["hits"].sum()), "misses": int(rows["misses"].sum())}

    def add(self, t: TokenRecord) -> None:
        row = self.rows[self.count]
        for name in TOKEN_DTYPE.names:
            row[name] = BACKENDS.index(t.backend) if name == "backend" else getattr(t, name)
        last = self.switches[-1] if self.switches else None
        if last is None or last[1:] != (t.backend, t.kernel_threads, t.io_threads):
            self.switches.append((t.index, t.backend, t.kernel_threads, t.io_threads))
        self.count += 1
        self.texts.append(t.text)
        self.text_nbytes += 8 + (sys.getsizeof(t.text) if t.text else 0)
        self.recent.append(t)
        self.hits += t.hits
        self.misses += t.misses
        self.prefetch_hits += t.prefetch_hits
        self.bytes_read += t.bytes_read
        self.stall_s += t.stall_s
        if t.reused:
            self.reused_tokens += 1
        elif t.prefill:
            self.prefill_tokens += 1
            self.prefill_s += t.seconds
            self.prefill_bytes += t.bytes_read

    def record(self, i: int) -> TokenRecord:
        row = self.rows[i]
        kw = {name: (BACKENDS[int(row[name])] if name == "backend" else row[name].item()) for name in TOKEN_DTYPE.names}
        return TokenRecord(index=i, text=self.texts[i], **kw)

    def backends(self) -> list[str]:
        return [BACKENDS[int(b)] for b in self.rows["backend"][:self.count]]

    def warm(self) -> np.ndarray:
        """The rows of the warm decode tokens: all but the first and the prefilled ones (the first
        alone, if it is the only one). Prefilled tokens are the prompt's, so they lead: a view, no
        copy (snapshots ask for it every refresh)."""
        done = self.rows[:self.count]
        if self.count <= 1:
            return done[done["prefill"] == 0]
        return done[max(1, self.reused_tokens + self.prefill_tokens):]

    def median_seconds(self) -> float | None:
        def compute():
            warm = self.warm()
            return float(np.median(warm["seconds"])) if len(warm) else None
        return self._at_count("median_seconds", compute)

    def occupancy(self) -> tuple[float | None, float | None]:
        """(share of the warm tokens' time with a read in flight, mean number of reads in flight)."""
        def compute():
            warm = self.warm()
            seconds = float(warm["seconds"].sum())
            if not seconds:
                return None, None
            return float(warm["disk_busy_s"].sum()) / seconds, float(warm["disk_depth_s"].sum()) / seconds
        return self._at_count("occupancy", compute)


# -- a run's snapshot, assembled from its fields (runs.run.Run: read, never changed) ------------
def snapshot_of(run) -> Snapshot:
    """The run's live figures: cheap, from any thread, at any time (the token log's read
    under the lock, the cache's from the engine or, once it is released, its last ones)."""
    t = _token_figures(run)
    layer_prefetched, fig = _engine_figures(run)
    return Snapshot(run_id=run.id, state=t["state"], error=t["error"], model=str(run.config.model),
                    preset=run.preset.name, steps=run.n_steps, tokens_done=t["done"], backend=t["backend"],
                    kernel_threads=t["kernel_threads"], io_threads=t["io_threads"],
                    io_mode=run.checkpoint.io_mode, policy=run.preset.policy, tokens=t["tokens"],
                    events=t["events"], switches=t["switches"], elapsed_s=t["elapsed_s"], eta_s=t["eta_s"],
                    **_speed_fields(run, t), **_cache_fields(run, t, fig, layer_prefetched),
                    **_memory_fields(run, fig), **_text_fields(run, t), **_batch_fields(run),
                    **_spec_fields(run))


def _token_figures(run) -> dict:
    """What the snapshot takes from the token log and the run's state, read under the lock."""
    log = run._steps.log
    with run._lock:
        t = {"tokens": tuple(log.recent), "events": tuple(run._events)[-SNAPSHOT_EVENTS:],
             "state": run._state, "error": run._error, "backend": run._backend,
             "kernel_threads": run.kernel_threads, "io_threads": run.io_threads, "done": log.count,
             "first": log.first, "gb_tok": log.warm_gb_per_token(), "hits": log.hits, "misses": log.misses,
             "stall": log.stall_s, "prefetched": log.prefetch_hits, "s_tok": log.median_seconds(),
             "occupancy": log.occupancy(), "switches": tuple(log.switches),
             "prefill": (log.prefill_tokens, log.prefill_s, log.prefill_bytes)}
    elapsed = (run.finished_at or time.time()) - run.started_at
    s_tok, remaining = t["s_tok"], run.n_steps - t["done"]
    t.update(elapsed_s=elapsed, eta_s=s_tok * remaining if s_tok is not None and t["state"] == "running" else None)
    return t


def _engine_figures(run) -> tuple[tuple[int, ...], "EngineFigures | None"]:
    """(each layer's hits on prefetched experts, the engine's figures), live or the last ones."""
    lease = run._lease
    eng = lease.engine
    if eng is None:
        return lease.final_layer_prefetch_hits, lease.final_figures
    # read before the cache's figures: a hit is counted by the cache before the streamer says
    # it was on a prefetched expert, so these never exceed the layer hits read after
    layer_prefetched = tuple(eng.streamer.prefetch_layer_hits)
    return layer_prefetched, eng.figures(lease.session_nbytes, lease.session)


def _speed_fields(run, t: dict) -> dict:
    """s/token, GB/token and the read rate against the disk's floor."""
    s_tok, gb_tok, (disk_busy, read_depth) = t["s_tok"], t["gb_tok"], t["occupancy"]
    eff = gb_tok / s_tok if gb_tok is not None and s_tok else None
    floor = run._floor.gbps if run._floor else None
    pre_n, pre_s, pre_b = t["prefill"]
    return dict(s_per_token=s_tok, s_first_token=t["first"].seconds if t["first"] else None,
                gb_per_token=gb_tok, eff_read_gbps=eff, floor_gbps=floor,
                io_efficiency=run._replay["efficiency"] if run._replay else None,
                stall_s_per_token=t["stall"] / t["done"] if t["done"] else None,
                disk_busy_fraction=disk_busy, mean_read_depth=read_depth, bound=bound_of(disk_busy),
                floor_ratio=eff / floor if eff is not None and floor else None,
                floor_age_s=time.time() - run._floor.measured_at if run._floor and run._floor.measured_at
                else None,
                prefill_tokens=pre_n, prefill_tokens_per_s=pre_n / pre_s if pre_s else None,
                prefill_gb_per_token=pre_b / 1e9 / pre_n if pre_n else None, prefill_chunk=run.prefill_chunk)


def _cache_fields(run, t: dict, fig, layer_prefetched: tuple[int, ...]) -> dict:
    """The expert cache's hit rates: the run's, the policy's own (prefetch apart), Belady's."""
    hits, misses, done = t["hits"], t["misses"], t["done"]
    requests = hits + misses
    # the tokens' own counts (hits on prefetched experts apart), so that the run's rate is the
    # sum of its tokens' and never mixes a token in progress with the tokens done
    own = (hits - t["prefetched"]) / requests if requests else None
    return dict(hit_rate=hits / requests if requests else None,
                layer_hits=fig.layer_hits if fig else (), layer_misses=fig.layer_misses if fig else (),
                layer_evictions=fig.layer_evictions if fig else (),
                cache_bytes=fig.cache_used_bytes if fig else 0, budget_bytes=fig.cache_capacity_bytes if fig else 0,
                read_latency_ms=fig.read_latency_s / fig.expert_reads * 1e3 if fig and fig.expert_reads else None,
                prefetch=fig.prefetch if fig else {}, optimum_hit_rate=run._optimum, policy_hit_rate=own,
                prefetch_hit_share=(hits / requests - own) if own is not None else None,
                regret_pp=(run._optimum - own) * 100 if own is not None and run._optimum is not None else None,
                check_s_per_token=fig.check_s / done if fig and done else None,
                layer_prefetch_hits=layer_prefetched if fig else ())


def _memory_fields(run, fig) -> dict:
    """RSS against the plan, the machine's RAM, the KV cache."""
    rss = run._rss_at_end if run.finished_at is not None else rss_now(run)
    vm = psutil.virtual_memory()
    own = run._steps.log.nbytes + run._finish_bytes     # the run's beyond the engine: its token log, its end's
    return dict(rss_bytes=rss, rss_budget_bytes=run._baseline_rss + fig.resident_bytes + own if fig else 0,
                ram_bytes=vm.total, ram_available_bytes=vm.available,
                plan_bytes=fig.resident_bytes + own if fig else 0,
                kv_bytes=run._lease.kv_bytes, context=run._lease.context)


def rss_now(run) -> int:
    """The process's resident memory now (0 if unreadable)."""
    try:
        return run._process.memory_info().rss
    except psutil.Error:
        return 0


def _spec_fields(run) -> dict:
    """Speculation's figures so far ({} when it is off)."""
    spec = run._spec
    if spec is None:
        return {"spec_mode": str(run.config.spec)} if run.config.spec != "off" else {}
    with run._lock:
        st = spec.stats
        return dict(spec_mode=str(spec.mode), spec_k=spec.last_k, spec_rounds=st.rounds,
                    spec_acceptance=st.acceptance, spec_tokens_per_round=st.tokens_per_round,
                    spec_draft_gb=st.draft_bytes / 1e9, spec_draft_s=st.draft_s)


def _batch_fields(run) -> dict:
    """The engine's batch (engine.batch) as this run sees it; {} when it runs alone."""
    if run.engines is None or run.engines.parallel < 2:
        return {}
    f = run.engines.batch_figures()
    with run._lock:
        own = dict(batch_steps=run._steps.passes, batch_shared_steps=run._steps.shared_passes)
    if f is None:
        return dict(own, batch_parallel=run.engines.parallel, batch_cap=run.engines.parallel)
    return dict(own, batch_parallel=f.parallel, batch_sequences=f.members, batch_cap=f.cap,
                batch_cap_reason=f.cap_reason, batch_rows_per_step=f.last_rows,
                batch_union_per_layer=f.union_per_layer or None, batch_tokens_per_s=f.tokens_per_s)


def _text_fields(run, t: dict) -> dict:
    return dict(phase="prefill" if t["done"] < len(run.prompt) - 1 else "decode", prompt_tokens=len(run.prompt),
                prompt_tokens_reused=run._steps.log.reused_tokens,
                generated_tokens=run.generated_tokens, output_text=run.output_text, finish_reason=run.finish_reason)
