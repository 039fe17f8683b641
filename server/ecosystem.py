"""What the ecosystem's monitors read, beside ds4f's own series: vLLM's metric names (`vllm:*`) with
vLLM's meaning, types and buckets, and llama-server's `GET /slots`.

vLLM's names (vllm/v1/metrics/loggers.py, PrometheusStatLogger) are the ones dashboards, autoscalers
and terminal monitors (vllmstat, vllmtop, Grafana's vLLM boards) read. Every series carries vLLM's
labels, `model_name` (the served model's name: the first --served-model-name, else the checkpoint
directory's) and `engine` ("0": one engine). A request here is a run the server starts, an operator's
POST /runs included; its figures come from what the server sees of it:

    arrival        its ticket joins the engine queue (Ticket.joined_at)
    scheduled      the ticket holds one of the engine's slots (Ticket.granted_at)
    first token    the record of its first generated token (taken in the run's thread)
    each token     the records of the tokens after it
    end            its run has ended and the answer is released (RunFeed.close)

so, as vLLM defines them: queue time = scheduled - arrival, prefill time = first token - scheduled,
decode time = last token - first token, inference time = last token - scheduled, time to first
token = first token - arrival, inter-token latency = between consecutive generated tokens, end to
end = end - arrival. Prompt tokens are counted when the first token comes (vLLM counts them when
the prefill is done), generated tokens as they come, the prefix cache's queries and hits (tokens,
as vLLM counts them: a prompt's tokens looked up, those found) at a run's first record, when its
prefix cache is on. A run that ends before its first token (cancelled while it reads its prompt)
counts its end, queue and prefill time (to its end), no first token and no prompt tokens.
Finish reasons are vLLM's words: stop (the end-of-sentence token or a stop string), length (the
token limit), abort (cancelled: the client left, an operator cancelled it, shutdown), error (the
run failed); `repetition` is listed, as vLLM lists it, and stays 0.

GET /slots answers llama-server's shape (tools/server/server-context.cpp, server_slot::to_json):
one slot per sequence the server decodes together (--parallel), each running request holding one
from its start to its end; an idle slot shows the last request it held, not processing, as
llama-server's does.

Everything here runs in the server's event loop (the feed hands records over with
call_soon_threadsafe), so it needs no locks.
"""
from __future__ import annotations

import time

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .errors import HttpError, bad, json_response
from .request import parse_query

LABELS = ["model_name", "engine"]
ENGINE = "0"
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")   # vLLM's FinishReason, in its order
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")   # vLLM's PromptTokenStats

# vLLM's buckets, as PrometheusStatLogger sets them
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets, for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def finish_reason(run) -> str:
    """vLLM's finish reason of an ended run (one still going when the server stops: abort)."""
    if run.state == "cancelled" or not run.finished:
        return "abort"
    if run.state == "failed":
        return "error"
    return "length" if run.finish_reason == "length" else "stop"


def prefix_cache_on(run, cfg) -> bool:
    """Whether the run looks its prompt up in the prefix cache (runs.run.kv_of: a text or chat
    prompt, reuse_prefix, no cold start, [kv] enabled)."""
    c = run.config
    return (cfg.kv is not None and c.reuse_prefix and not c.cold_start
            and (c.text is not None or c.messages is not None) and len(run.prompt) >= 2)


class Ecosystem:
    """The vllm: series of one server, and its slots. `server`: the Service (its queue, model_id,
    parallel, context, cfg and options are read)."""

    def __init__(self, registry, server):
        self.server = server
        self.label_values = (server.model_id, ENGINE)
        lv = self.label_values

        def counter(name, doc, extra=()):
            return Counter(name, doc, LABELS + list(extra), registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*lv)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed (a request's "
                                     "prompt tokens, the prefix cache's included, counted when its first token "
                                     "comes).").labels(*lv)
        by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source: local_compute "
                            "(computed), local_cache_hit (from the prefix cache), external_kv_transfer (none "
                            "here).", ["source"])
        self.prompt_by_source = {s: by_source.labels(*lv, s) for s in PROMPT_SOURCES}
        self.prompt_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (taken from "
                                     "the prefix cache, not computed).").labels(*lv)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens "
                                         "processed.").labels(*lv)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine "
                                   "(a sequence here keeps its KV cache until it ends: always 0).").labels(*lv)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens (the prompt tokens of the requests whose prefix cache is "
                                      "on).").labels(*lv)
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens (the prompt tokens a kept state gave).").labels(*lv)
        success = counter("vllm:request_success", "Count of successfully processed requests, by finish reason: "
                          "stop, length, abort (cancelled), error (failed); repetition is not detected here.",
                          ["finished_reason"])
        self.success = {r: success.labels(*lv, r) for r in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds "
                              "(from the request's arrival, its wait in the queue included).", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds "
                             "(between a request's consecutive generated tokens).", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                              "time_per_output_token_seconds per request (decode time over its generated tokens "
                              "after the first; 0 with one).", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING "
                                    "phase for request (in the engine queue, before it held a slot).",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "Histogram of time spent in "
                                        "RUNNING phase for request (from holding a slot to its last token).",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                                      "phase for request (from holding a slot to its first token: the run's start"
                                      " and its prompt).", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE "
                                     "phase for request (from its first token to its last).",
                                     REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(server.context)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed "
                                        "(per request: its prompt).", token_buckets)
        self.request_generation = histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                            "processed (per request).", token_buckets)
        registry.register(_Gauges(self))
        self.slots: list[RequestFigures | None] = [None] * server.parallel   # the request each slot holds
        self.last: list[RequestFigures | None] = [None] * server.parallel    # and the last one it held
        self.tasks = 0                       # requests started: llama-server's task ids

    def request(self, run) -> "RequestFigures":
        """The figures of the request whose run this is (its ticket is among the queue's holders)."""
        ticket = next((t for t in self.server.queue.holders if t.run is run), None)
        return RequestFigures(self, run, ticket)

    # -- what the gauges read -------------------------------------------------------------------------
    def live(self) -> list["RequestFigures"]:
        return [r for r in self.slots if r is not None]

    def kv_usage(self) -> float:
        """The KV positions the running sequences hold (their prompt and generated tokens so far)
        over those their slots allocate (each sequence's KV cache holds its preset's context:
        parallel x context with every slot at the server's preset)."""
        used = held = 0
        for r in self.live():
            used += min(r.positions, r.context)
            held += r.context
        held += (len(self.slots) - len(self.live())) * self.server.context
        return min(1.0, used / held) if held else 0.0

    # -- GET /slots -----------------------------------------------------------------------------------
    def slots_view(self) -> list[dict]:
        spec_default = str(self.server.options.spec) != "off"
        out = []
        for i, held in enumerate(self.slots):
            r = held if held is not None else self.last[i]
            slot = {"id": i, "n_ctx": r.context if r is not None else self.server.context,
                    "speculative": r.speculative if r is not None else spec_default,
                    "is_processing": held is not None}
            if r is not None:
                slot.update(r.slot_fields(processing=held is not None))
            out.append(slot)
        return out


class _Gauges:
    """The gauges read when scraped: requests running and waiting, the KV positions in use."""

    def __init__(self, eco: Ecosystem):
        self.eco = eco

    def describe(self):
        return []

    def collect(self):
        eco, lv = self.eco, list(self.eco.label_values)
        queue = eco.server.queue
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches (holding one of "
                 "the engine's slots: starting, reading their prompt or generating).", len(queue.holders)),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed (in the engine "
                 "queue).", len(queue.waiting)),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. Here: the KV "
                 "positions the running sequences hold (prompt and generated tokens so far) over those the "
                 "slots allocate (parallel x the preset's context).", eco.kv_usage())):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, value)
            yield g


class RequestFigures:
    """One request's way through the engine (see the module docstring): fed by its RunFeed."""

    def __init__(self, eco: Ecosystem, run, ticket):
        """The run has just started (RunFeed.attach): it takes the first free slot. `ticket`: the
        request's place in the engine queue (None: not found; its arrival is now)."""
        now = time.monotonic()
        self.eco = eco
        self.run = run
        self.arrival = ticket.joined_at if ticket is not None else now
        self.scheduled = ticket.granted_at if ticket is not None and ticket.granted_at is not None else now
        self.records = 0              # the run's records so far: one KV position each
        self.generated = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        self._prompt_text: str | None = None
        self.task = eco.tasks
        eco.tasks += 1
        free = [i for i, r in enumerate(eco.slots) if r is None]
        if not free:                     # never with the queue's slots; counted all the same
            eco.slots.append(None)
            eco.last.append(None)
            free = [len(eco.slots) - 1]
        self.slot = free[0]
        eco.slots[self.slot] = self

    # -- fed by the RunFeed ---------------------------------------------------------------------------
    def token(self, generated: bool, at: float) -> None:
        """One record of its run (a generated token, or a prompt token read), handed over at `at`
        (time.monotonic(), in the run's thread)."""
        eco, run = self.eco, self.run
        self.records += 1
        if self.records == 1 and prefix_cache_on(run, eco.server.cfg):   # the lookup is done by now
            eco.prefix_queries.inc(len(run.prompt))
            eco.prefix_hits.inc(run.prompt_tokens_reused)
        if not generated:
            return
        self.generated += 1
        eco.generation_tokens.inc()
        if self.first_at is None:
            self.first_at = at
            prompt, reused = len(run.prompt), run.prompt_tokens_reused
            eco.prompt_tokens.inc(prompt)
            eco.prompt_cached.inc(reused)
            eco.prompt_by_source["local_compute"].inc(prompt - reused)
            eco.prompt_by_source["local_cache_hit"].inc(reused)
            eco.ttft.observe(max(0.0, at - self.arrival))
        else:
            eco.itl.observe(max(0.0, at - self.last_at))
        self.last_at = at

    def finished(self) -> None:
        """Its run has ended (every record taken): the request's figures, its slot freed."""
        eco, run = self.eco, self.run
        end, scheduled = time.monotonic(), self.scheduled
        eco.success[finish_reason(run)].inc()
        eco.e2e.observe(max(0.0, end - self.arrival))
        eco.queue_time.observe(max(0.0, scheduled - self.arrival))
        eco.prefill_time.observe(max(0.0, (self.first_at or end) - scheduled))
        decode = self.last_at - self.first_at if self.first_at is not None else 0.0
        eco.decode_time.observe(max(0.0, decode))
        eco.inference_time.observe(max(0.0, (self.last_at or end) - scheduled))
        eco.tpot.observe(max(0.0, decode / (self.generated - 1)) if self.generated > 1 else 0.0)
        eco.request_prompt.observe(len(run.prompt))
        eco.request_generation.observe(self.generated)
        if self.slot is not None and self.slot < len(eco.slots) and eco.slots[self.slot] is self:
            eco.slots[self.slot] = None
            eco.last[self.slot] = self

    # -- what its slot shows --------------------------------------------------------------------------
    @property
    def positions(self) -> int:
        """The KV positions its sequence holds: the prompt tokens a kept state gave and one per record."""
        return self.run.prompt_tokens_reused + self.records

    @property
    def context(self) -> int:
        return self.run.preset.context

    @property
    def speculative(self) -> bool:
        return str(self.run.config.spec) != "off"

    def prompt_text(self) -> str:
        """The prompt as text (special tokens shown), decoded once; "" for token ids without a tokenizer."""
        if self._prompt_text is None:
            tok = self.run.tokenizer
            self._prompt_text = tok.decode(self.run.prompt) if tok is not None else ""
        return self._prompt_text

    def slot_fields(self, processing: bool) -> dict:
        """llama-server's fields of a slot's task (server_slot::to_json)."""
        run = self.run
        c = run.config
        s = c.sampling
        reused = run.prompt_tokens_reused
        prompt = len(run.prompt)
        # a record of the prompt read per step, and the first generated token's step reads its last token
        computed = min(prompt - reused, self.records)
        text = run.output_text
        return {
            "id_task": self.task,
            "run_id": run.id,
            "n_prompt_tokens": prompt,
            "n_prompt_tokens_processed": computed,
            "n_prompt_tokens_cache": reused,
            "params": {"n_predict": c.gen, "max_tokens": c.gen, "seed": s.seed if s is not None else 0,
                       "temperature": s.temperature if s is not None else 0.0,
                       "top_k": s.top_k if s is not None else 1, "top_p": s.top_p if s is not None else 1.0,
                       "min_p": s.min_p if s is not None else 0.0, "stop": list(c.stop)},
            "next_token": [{"has_next_token": processing and not run.finished,
                            "has_new_line": "\n" in text,
                            "n_remain": max(0, c.gen - self.generated),
                            "n_decoded": self.generated}],
            "prompt": self.prompt_text(),
            "generated": text,
        }


class NoRequest:
    """A request's figures where no server keeps them (a Metrics without a server)."""

    def token(self, generated: bool, at: float) -> None:
        pass

    def finished(self) -> None:
        pass


NO_REQUEST = NoRequest()


async def slots(request):
    """GET /slots: llama-server's slots (`?fail_on_no_slot=1`: 503 when none is free, as it answers)."""
    params = parse_query(request.scope.get("query_string", b"").decode("latin-1"))
    unknown = [k for k in params if k != "fail_on_no_slot"]
    if unknown:
        raise bad(unknown[0], "unknown parameter (known: fail_on_no_slot)", code="unknown_parameter")
    view = request.app.state.service.metrics.ecosystem.slots_view()
    if params.get("fail_on_no_slot") in ("1", "true") and all(s["is_processing"] for s in view):
        raise HttpError(503, "no slot available", code="unavailable_error", headers={"Retry-After": "1"})
    return json_response(200, view)
