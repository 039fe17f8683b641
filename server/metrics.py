"""GET /metrics: Prometheus metrics, by prometheus_client, in base units (bytes, seconds).

Counters grow across runs for the life of the server, so `rate()` works on them: tokens, bytes
and reads, expert-cache hits, misses and evictions, prefetch guesses by outcome, runs by how they
ended, HTTP requests by endpoint and status class. Per-token figures are counted as each token
is computed (from the run's on_token records); evictions as the run goes (from its snapshots);
prefetch guesses when the run ends, when every guess it issued has an outcome, so the outcomes
always add up to the issued total. No label takes a value that changes from run to run: labels
are a fixed handful of words (phase, outcome, state, endpoint, method, status class).
Gauges say what the engine is doing now (busy, queue, threads, cache); process_* come from
prometheus_client's ProcessCollector. Beside them, once the server is bound (serve()), vLLM's
metric names with vLLM's meaning (ds4f.server.ecosystem), which the ecosystem's monitors read.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from ds4f import __version__
from ds4f.api import END_STATES

from .ecosystem import NO_REQUEST, Ecosystem

TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
READ_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
PHASES = ("prefill", "decode")
PREFETCH_OUTCOMES = ("useful", "wasted", "cancelled", "unresolved")
REJECTIONS = ("queue_full", "client_share", "busy", "client_requests")
METHODS = ("GET", "HEAD", "POST", "PATCH", "DELETE")


class Metrics:
    """One server's registry and the counters its runs and requests feed."""

    def __init__(self, live=None):
        """live: a callable returning the gauges' values now (see LiveGauges)."""
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self.tokens = Counter("ds4f_tokens", "Tokens the engine computed: prefill (a prompt token read) or decode "
                              "(a token generated).", ["phase"], registry=r)
        self.token_latency = Histogram("ds4f_token_latency_seconds", "Wall time of one token.", ["phase"],
                                       buckets=TOKEN_BUCKETS, registry=r)
        self.read_bytes = Counter("ds4f_read_bytes", "Bytes read from disk: expert records and unpinned trunk "
                                  "layers.", registry=r)
        self.reads = Counter("ds4f_reads", "Disk reads started: expert records, prefetch guesses, trunk layers.",
                             registry=r)
        self.read_seconds = Counter("ds4f_read_seconds", "Reads in flight integrated over time: the sum of the "
                                    "reads' latencies (over ds4f_reads_total: the mean read latency).", registry=r)
        self.read_latency = Histogram("ds4f_read_latency_seconds", "Mean latency of a token's disk reads (reads in "
                                      "flight integrated over the token, over the reads it started); one "
                                      "observation per token that read.", buckets=READ_BUCKETS, registry=r)
        self.hits = Counter("ds4f_expert_hits", "Expert-cache hits (hits on prefetched experts included).",
                            registry=r)
        self.prefetch_hits = Counter("ds4f_expert_prefetch_hits", "Of the expert-cache hits, those on an expert a "
                                     "prefetch guess brought in.", registry=r)
        self.misses = Counter("ds4f_expert_misses", "Expert-cache misses (each one a read).", registry=r)
        self.evictions = Counter("ds4f_expert_evictions", "Experts evicted from the cache.", registry=r)
        self.prefetch_issued = Counter("ds4f_prefetch_issued", "Prefetch guesses issued; counted when their run "
                                       "ends.", registry=r)
        self.prefetch_outcomes = Counter("ds4f_prefetch_outcomes", "Prefetch guesses by outcome (useful: hit; "
                                         "wasted: read, not used; cancelled: dropped before its read; unresolved:"
                                         " pending when the run ended); they add up to ds4f_prefetch_issued_total.",
                                         ["outcome"], registry=r)
        self.prefetch_late = Counter("ds4f_prefetch_late", "Of the useful guesses, those still being read when the "
                                     "expert was needed.", registry=r)
        self.runs = Counter("ds4f_runs", "Runs ended, by how: done, cancelled, failed.", ["state"], registry=r)
        self.prompt_reused = Counter("ds4f_prompt_tokens_reused", "Prompt tokens taken from the prefix cache, not "
                                     "computed (those computed are ds4f_tokens{phase=\"prefill\"}).", registry=r)
        self.requests = Counter("ds4f_http_requests", "HTTP requests answered, by endpoint (the route, or "
                                "`other`), method and status class (2xx, 4xx...).", ["endpoint", "method", "code"],
                                registry=r)
        self.rejections = Counter("ds4f_rejections", "Requests refused with 429: the engine queue full, the "
                                  "client's share of it taken, a run busy, or too many requests from the client.",
                                  ["reason"], registry=r)
        self.tool_calls = Counter("ds4f_tool_calls", "Tool calls answered, by endpoint (chat, responses, "
                                  "messages).", ["endpoint"], registry=r)
        self.tool_call_errors = Counter("ds4f_tool_call_errors", "Answers whose tool calls were refused (a block "
                                        "that does not parse, an unknown function, arguments the schema refuses):"
                                        " their text was sent as content, finish reason tool_call_error.",
                                        ["endpoint"], registry=r)
        self.tool_call_repairs = Counter("ds4f_tool_call_repairs", "Repairs made to answers' tool calls and "
                                         "reasoning (unclosed_think, misspelt_dsml, unclosed_block, value_type, "
                                         "string_attribute, text_after_calls, parallel_calls_dropped).",
                                         ["repair"], registry=r)
        self.queue_wait = Histogram("ds4f_queue_wait_seconds", "Time a request waited for the engine.",
                                    buckets=WAIT_BUCKETS, registry=r)
        for phase in PHASES:
            self.tokens.labels(phase)
            self.token_latency.labels(phase)
        for values, family in ((PREFETCH_OUTCOMES, self.prefetch_outcomes), (END_STATES, self.runs),
                               (REJECTIONS, self.rejections)):
            for v in values:
                family.labels(v)
        if live is not None:
            r.register(LiveGauges(live))
        self.ecosystem: Ecosystem | None = None   # the vllm: series and the slots, once serve() binds a server

    def serve(self, server) -> None:
        """Add vLLM's series, read from the server (a Service: its queue, model, parallel, context)."""
        if self.ecosystem is None:
            self.ecosystem = Ecosystem(self.registry, server)

    def figures(self, run):
        """The figures of the request whose run has just started (RunFeed.attach), for the vllm:
        series; a stand-in that keeps nothing before a run, or without a server."""
        if run is None or self.ecosystem is None:
            return NO_REQUEST
        return self.ecosystem.request(run)

    # -- feeding --------------------------------------------------------------------------------
    def token(self, record, phase: str) -> None:
        """One computed token (a TokenRecord)."""
        self.tokens.labels(phase).inc()
        self.token_latency.labels(phase).observe(record.seconds)
        self.read_bytes.inc(max(0, record.bytes_read))
        self.reads.inc(max(0, record.reads))
        self.read_seconds.inc(max(0.0, record.disk_depth_s))
        if record.reads > 0:
            self.read_latency.observe(max(0.0, record.disk_depth_s) / record.reads)
        self.hits.inc(max(0, record.hits))
        self.prefetch_hits.inc(max(0, record.prefetch_hits))
        self.misses.inc(max(0, record.misses))

    def run_ended(self, state: str, prefetch: dict, prompt_reused: int = 0) -> None:
        """A run's end: its state, its prefetch counts (Snapshot.prefetch; empty: prefetch off) and
        the prompt tokens it took from the prefix cache."""
        if state in END_STATES:
            self.runs.labels(state).inc()
        self.prompt_reused.inc(max(0, prompt_reused))
        if not prefetch:
            return
        issued = int(prefetch.get("issued", 0))
        useful, wasted, cancelled = (int(prefetch.get(k, 0)) for k in ("useful", "wasted", "cancelled"))
        self.prefetch_issued.inc(max(0, issued))
        for outcome, n in (("useful", useful), ("wasted", wasted), ("cancelled", cancelled),
                           ("unresolved", issued - useful - wasted - cancelled)):
            self.prefetch_outcomes.labels(outcome).inc(max(0, n))
        self.prefetch_late.inc(max(0, int(prefetch.get("late", 0))))

    def tool_reply(self, endpoint: str, reply) -> None:
        """A chat answer read (engine.text.reply.Reply): its calls, a refusal, its repairs."""
        if reply.calls:
            self.tool_calls.labels(endpoint).inc(len(reply.calls))
        if reply.error is not None:
            self.tool_call_errors.labels(endpoint).inc()
        for repair in reply.repairs:
            self.tool_call_repairs.labels(repair).inc()

    def request(self, endpoint: str, method: str, status: int) -> None:
        code = f"{status // 100}xx" if status else "none"   # none: the client left before an answer
        self.requests.labels(endpoint, method if method in METHODS else "other", code).inc()

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition the scraper asked for (text format, or OpenMetrics) and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class LiveGauges:
    """Gauges read when scraped: what the engine does now. `read()` returns a dict with busy,
    queue_waiting, queue_capacity and, with a run, that run's snapshot (or None)."""

    def __init__(self, read):
        self.read = read

    def describe(self):
        return []

    def collect(self):
        d = self.read()
        yield _info()
        yield GaugeMetricFamily("ds4f_engine_busy", "1 while a run holds the engine.", value=int(d["busy"]))
        yield GaugeMetricFamily("ds4f_queue_waiting", "Requests waiting for the engine.", value=d["queue_waiting"])
        yield GaugeMetricFamily("ds4f_queue_capacity", "Requests the engine queue holds.", value=d["queue_capacity"])
        pc = d.get("prefix_cache")
        if pc is not None:
            for name, what, value in (
                    ("ram_bytes", "Bytes of session states the prefix cache holds in RAM.", pc.ram_bytes),
                    ("disk_bytes", "Bytes of kept states in the prefix cache's directory (every process's).",
                     pc.disk_bytes),
                    ("disk_budget_bytes", "The directory's bound ([kv] budget).", pc.disk_budget),
                    ("hits", "Prompts that found a kept prefix, since the engine loaded.", pc.hits),
                    ("misses", "Prompts that found none, since the engine loaded.", pc.misses),
                    ("evictions", "States the prefix cache dropped for its bounds, since the engine loaded.",
                     pc.evictions),
                    ("rejected_files", "State files refused (damaged, foreign) and removed.", pc.rejected_files),
                    ("states", "Session states kept (RAM or disk).", pc.states),
                    ("blocks_disk", "Blocks of kept compressed rows on disk, each shared by the states of its"
                                    " prefix.", pc.blocks_disk),
                    ("written_today_bytes", "Bytes the prefix cache wrote to its directory today.", pc.written_today),
                    ("write_budget_bytes", "Bytes a day it may write ([kv] write_budget; 0: no bound).",
                     pc.write_budget)):
                yield GaugeMetricFamily(f"ds4f_prefix_cache_{name}", what, value=value)
            written = CounterMetricFamily("ds4f_prefix_cache_written_bytes", "Bytes the prefix cache wrote to its"
                                          " directory, by what: a state's head or a block of rows.",
                                          labels=["what"])
            written.add_metric(["head"], pc.written_heads)
            written.add_metric(["block"], pc.written_blocks)
            yield written
        b = d.get("batch")
        if b is not None:
            yield from _batch_gauges(b)
        s = d.get("snapshot")
        if s is None:
            return
        yield GaugeMetricFamily("ds4f_kernel_threads", "Native kernel threads of the current or last run.",
                                value=s.kernel_threads)
        yield GaugeMetricFamily("ds4f_io_threads", "Disk-read threads of the current or last run.", value=s.io_threads)
        yield GaugeMetricFamily("ds4f_cache_bytes", "Bytes of expert-cache slots in use.", value=s.cache_bytes)
        yield GaugeMetricFamily("ds4f_cache_capacity_bytes", "Expert-cache capacity from the preset's budget.",
                                value=s.budget_bytes)
        yield GaugeMetricFamily("ds4f_plan_bytes", "Memory the preset plans for the engine and the run.",
                                value=s.plan_bytes)
        if s.spec_mode != "off":
            yield from _spec_gauges(s)


def _spec_gauges(s):
    """Speculative decoding in the current or last run (its snapshot's spec_* figures)."""
    mode = GaugeMetricFamily("ds4f_spec_mode", "1 for the run's speculative-decoding mode (auto, or a fixed"
                             " number of drafts per round).", labels=["mode"])
    mode.add_metric([s.spec_mode], 1)
    yield mode
    yield GaugeMetricFamily("ds4f_spec_rounds", "Rounds with drafts in the run so far.", value=s.spec_rounds)
    if s.spec_acceptance is not None:
        yield GaugeMetricFamily("ds4f_spec_acceptance_ratio", "Drafts kept over drafts proposed.",
                                value=s.spec_acceptance)
    if s.spec_tokens_per_round is not None:
        yield GaugeMetricFamily("ds4f_spec_tokens_per_round", "Tokens a round with drafts gave (kept drafts + 1).",
                                value=s.spec_tokens_per_round)
    yield GaugeMetricFamily("ds4f_spec_draft_bytes", "Bytes the MTP layer read for drafts.",
                            value=s.spec_draft_gb * 1e9)
    yield GaugeMetricFamily("ds4f_spec_draft_seconds", "Seconds spent drafting in the MTP layer.",
                            value=s.spec_draft_s)
    yield GaugeMetricFamily("ds4f_spec_drafts_last_round", "Drafts in the last round (0: a plain step).",
                            value=s.spec_k)


CAP_REASONS = ("none", "union_cost")


def _batch_gauges(b: dict):
    """The sequences decoded together (Service.batch_view): what a step holds, what it costs."""
    yield GaugeMetricFamily("ds4f_batch_parallel", "Sequences the server decodes together at most (--parallel).",
                            value=b["parallel"])
    yield GaugeMetricFamily("ds4f_batch_active_sequences", "Sequences running now (each holds a slot).",
                            value=b["active"])
    yield GaugeMetricFamily("ds4f_batch_cap", "Sequences a step holds now: parallel, or less where batching more "
                            "read more than it saved (see ds4f_batch_capped).", value=b["cap"])
    capped = GaugeMetricFamily("ds4f_batch_capped", "1 for the reason the batch is capped below parallel now "
                               "(union_cost: a step of more sequences took longer than that many steps of one); "
                               "none: not capped.", labels=["reason"])
    reason = "union_cost" if b["cap_reason"] else "none"
    for r in CAP_REASONS:
        capped.add_metric([r], int(r == reason))
    yield capped
    for name, what, key in (
            ("rows_per_step", "Rows (tokens) in the last step: a decode row per sequence, and prompt rows.",
             "rows_per_step"),
            ("sequences_per_step", "Sequences in the last step.", "sequences_per_step"),
            ("union_experts_per_layer", "Distinct routed experts per layer in the last step (mean over layers): "
             "each read once for every row that chose it.", "union_experts_per_layer"),
            ("tokens_per_second", "Tokens per second over the recent steps, all sequences together.",
             "tokens_per_s")):
        if b[key] is not None:
            yield GaugeMetricFamily(f"ds4f_batch_{name}", what, value=b[key])
    if b["tokens_per_s"] is not None and b["active"]:
        yield GaugeMetricFamily("ds4f_batch_sequence_tokens_per_second", "Tokens per second per running sequence "
                                "(the aggregate over the sequences running).", value=b["tokens_per_s"] / b["active"])
    for name, what, key in (("steps", "Forward passes the engine's batcher ran.", "steps"),
                            ("shared_steps", "Of them, passes shared by more than one sequence.", "shared_steps"),
                            ("rows", "Rows those passes computed.", "rows")):
        yield CounterMetricFamily(f"ds4f_batch_{name}", what, value=b[key])
    seconds = GaugeMetricFamily("ds4f_batch_step_seconds", "Running mean wall time of a decode step, by the "
                                "sequences in it (what the cap compares).", labels=["sequences"])
    for k, v in b["step_s_by_sequences"].items():
        seconds.add_metric([str(k)], v)
    yield seconds


def _info() -> GaugeMetricFamily:
    g = GaugeMetricFamily("ds4f_build_info", "This server's version (always 1).", labels=["version"])
    g.add_metric([__version__], 1)
    return g
