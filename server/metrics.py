"""The live figures as Prometheus text exposition (format 0.0.4), for GET /metrics.

Names are ds4f_-prefixed with their unit in the name and in base units (seconds, bytes,
ratios 0..1; GB/s stays in gigabytes because that is the figure operators compare with the
NVMe floor). Counters end in _total. A figure the run does not have yet (None) is left out
rather than exported as a fake 0. Per-layer cache counters are cumulative over the run and
start again at 0 with the next run, which Prometheus treats as a counter reset.
"""
from __future__ import annotations

import math
from typing import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _format_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


class Exposition:
    """Collects metric families and renders them; families without samples are left out."""

    def __init__(self) -> None:
        self._families: list[tuple[str, str, str, list[tuple[dict, object]]]] = []
        self._index: dict[str, int] = {}

    def add(self, name: str, kind: str, help_text: str, value, labels: dict | None = None) -> None:
        if value is None:
            return
        if name not in self._index:
            self._index[name] = len(self._families)
            self._families.append((name, kind, help_text, []))
        self._families[self._index[name]][3].append((labels or {}, value))

    def add_many(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[dict, object]]) -> None:
        for labels, value in samples:
            self.add(name, kind, help_text, value, labels)

    def render(self) -> str:
        lines: list[str] = []
        for name, kind, help_text, samples in self._families:
            lines.append(f"# HELP {name} {_escape_help(help_text)}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                if labels:
                    body = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
                    lines.append(f"{name}{{{body}}} {_format_value(value)}")
                else:
                    lines.append(f"{name} {_format_value(value)}")
        return "\n".join(lines) + "\n"


def render_metrics(snapshot, server: dict) -> str:
    """The exposition for one Snapshot (or None before the first run) plus server counters.

    `server` holds: busy (bool), runs_started, busy_rejections, requests (dict code -> count),
    gen (the tokens the current or last run generates, as requested; None without a run).
    """
    ex = Exposition()
    ex.add("ds4f_up", "gauge", "1 while the ds4f server answers.", 1)
    ex.add("ds4f_busy", "gauge", "1 while a run is starting or running (new runs get 429).", bool(server["busy"]))
    ex.add("ds4f_runs_started_total", "counter", "Runs this server started.", server["runs_started"])
    ex.add("ds4f_busy_rejections_total", "counter", "Run requests refused with 429 because a run was busy.",
           server["busy_rejections"])
    ex.add_many("ds4f_http_responses_total", "counter", "HTTP responses sent, by status code.",
                (({"code": str(code)}, n) for code, n in sorted(server["requests"].items())))
    s = snapshot
    if s is None:
        return ex.render()
    ex.add("ds4f_run_info", "gauge", "The current or last run: its id, state, preset, backend and model.", 1,
           {"run_id": s.run_id, "state": s.state, "preset": s.preset, "backend": s.backend, "model": s.model,
            "io_mode": s.io_mode, "policy": s.policy})
    ex.add("ds4f_run_active", "gauge", "1 while the current run is starting or running.",
           s.state in ("starting", "running"))
    ex.add("ds4f_tokens_done", "gauge", "Decode steps done so far by the current or last run (of ds4f_run_steps).",
           s.tokens_done)
    ex.add("ds4f_run_gen_tokens", "gauge", "Tokens the current or last run generates, as requested (its gen).",
           server.get("gen"))
    ex.add("ds4f_run_steps", "gauge", "Decode steps of the current or last run: the prompt's tokens after the "
           "first plus the tokens it generates.", s.gen)
    ex.add("ds4f_seconds_per_token", "gauge", "Median wall time per warm token (all but the first), seconds.",
           s.s_per_token)
    ex.add("ds4f_first_token_seconds", "gauge", "Wall time of the cold first token, seconds.", s.s_first_token)
    ex.add("ds4f_read_gigabytes_per_token", "gauge", "Mean disk gigabytes (1e9 B) read per warm token.",
           s.gb_per_token)
    ex.add("ds4f_read_gigabytes_per_second", "gauge", "Effective read rate: GB/token over s/token.", s.eff_read_gbps)
    ex.add("ds4f_floor_gigabytes_per_second", "gauge", "NVMe floor measured by the engine's direct-read probe.",
           s.floor_gbps)
    ex.add("ds4f_io_efficiency_ratio", "gauge", "Effective read rate over the NVMe floor (1 = read-bound at the disk's limit).",
           s.io_efficiency)
    ex.add("ds4f_cache_hit_ratio", "gauge", "Expert-cache hits over routed expert requests, cumulative over the run"
           " (hits on prefetched experts included).", s.hit_rate)
    ex.add("ds4f_cache_policy_hit_ratio", "gauge", "The cache policy's own hits (without prefetch's help) over routed"
           " expert requests: the rate comparable with Belady's.", s.policy_hit_rate)
    ex.add("ds4f_cache_belady_hit_ratio", "gauge", "Belady's optimal hit rate on the run's own requests with the same"
           " cache.", s.optimum_hit_rate)
    ex.add_many("ds4f_cache_layer_prefetch_hits_total", "counter", "Expert-cache hits on prefetched experts per layer"
                " in the current run.", (({"layer": str(i)}, v) for i, v in enumerate(s.layer_prefetch_hits)))
    ex.add_many("ds4f_cache_layer_hits_total", "counter", "Expert-cache hits per layer in the current run.",
                (({"layer": str(i)}, v) for i, v in enumerate(s.layer_hits)))
    ex.add_many("ds4f_cache_layer_misses_total", "counter", "Expert-cache misses per layer in the current run.",
                (({"layer": str(i)}, v) for i, v in enumerate(s.layer_misses)))
    ex.add_many("ds4f_cache_layer_evictions_total", "counter", "Expert-cache evictions per layer in the current run.",
                (({"layer": str(i)}, v) for i, v in enumerate(s.layer_evictions)))
    ex.add("ds4f_cache_bytes", "gauge", "Bytes of expert-cache slots in use.", s.cache_bytes)
    ex.add("ds4f_cache_budget_bytes", "gauge", "Expert-cache capacity from the preset's budget.", s.budget_bytes)
    ex.add("ds4f_rss_bytes", "gauge", "Resident set size of the engine process.", s.rss_bytes)
    ex.add("ds4f_rss_budget_bytes", "gauge", "Memory the preset expects: pinned trunk, cache and buffers.",
           s.rss_budget_bytes)
    ex.add("ds4f_read_latency_seconds", "gauge", "Mean latency of one expert read, seconds.",
           s.read_latency_ms / 1e3 if s.read_latency_ms is not None else None)
    ex.add("ds4f_stall_seconds_per_token", "gauge", "Mean time per token the compute waited for expert reads.",
           s.stall_s_per_token)
    ex.add_many("ds4f_prefetch_experts_total", "counter", "Router-lookahead expert prefetches, by outcome.",
                (({"outcome": str(k)}, v) for k, v in sorted((s.prefetch or {}).items())
                 if isinstance(v, (int, float)) and not isinstance(v, bool)))
    ex.add("ds4f_kernel_threads", "gauge", "Native kernel threads of the current run.", s.kernel_threads)
    ex.add("ds4f_io_threads", "gauge", "Expert-read threads of the current run.", s.io_threads)
    ex.add("ds4f_elapsed_seconds", "gauge", "Wall time of the current or last run so far.", s.elapsed_s)
    ex.add("ds4f_eta_seconds", "gauge", "Estimated time until the current run finishes.", s.eta_s)
    return ex.render()
