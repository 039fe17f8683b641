"""A done run's report (report.json): its figures, the yardsticks measured once it is done
(Belady's hit rate on its own trace, a replay of its last reads), and the file itself, written
with every token's record before the run commits it beside its state dump; and a run's ending
(finish_run, fail_run): the report built and committed with its files, its history record, the
runs directory's budget settled."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ds4f.cachelab.replay import replay
from ds4f.cachelab.trace import Trace
from ds4f.engine.config import Budget
from ds4f.engine.runtime.disk_floor import replay_reads
from ds4f.errors import Ds4fError
from ds4f.runs.prefix import keep_states
from ds4f.runs.snapshot import TokenLog, rss_now
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


def read_report(run) -> dict | None:
    """The whole report of a done run, its per-token records included (read from report.json,
    so a long run's records are not held in memory); summary_report is the same without them."""
    if run._report is None:
        return None
    if run.report_path is None:    # a run without a state dump writes no report file
        return dict(run._report)
    try:
        with open(run.report_path) as f:
            return json.load(f)
    except (OSError, ValueError):   # moved or deleted since: what is still in memory
        return dict(run._report)


# -- a run's ending: its report built and written with its files, its history record, the budget --
def fail_run(run, message: str, writer) -> None:
    """End the run as failed with `message`: its files aborted (none left), its record kept."""
    if writer is not None:
        writer.abort()
    with run._lock:
        run._error = message
    run._log(f"error: {message}")
    finish_run(run, "failed")


def finish_run(run, state: str, sha: str | None = None, writer=None) -> None:
    """End the run in `state`; a done run's report is written and committed with its state
    dump (`writer`, closed) before the run says it is done."""
    run._rss_at_end = rss_now(run)  # what the run held; the engine's memory goes after this
    run.finished_at = time.time()
    report = None
    if state == "done":
        run._optimum = _optimum_hit_rate(run, writer.tmp) if writer.tmp is not None else None
        run._replay = _replay_reads(run)
        report = build_report(run, sha)
        report["state_nbytes"] = writer.nbytes
        report["summary"]["batch"] = _batch_summary(run)
        report["summary"]["spec"] = _spec_summary(run)
        s = report["summary"]
        spt = f"{s['s_per_token']:.3f} s/token warm" if s.get("s_per_token") is not None else "no warm token"
        hit = f"hit rate {s['hit_rate']:.1%}" if s.get("hit_rate") is not None else "no expert read"
        if writer.report_tmp is not None:
            write_report(report, run._steps.log, writer.report_tmp, run.report_path)
        writer.commit()          # the last step that may fail: a run's files appear only when it is done
        keep_states(run)        # best effort from here on: it never fails the run
        run._log(f"done: {spt}, {hit}, " + (f"sha256 {sha[:12]}" if sha else "no state dump"))
    with run._lock:
        run._report = report
        run._state = state
    if run.history is not None:
        try:
            config = run.config_dict()
            config["tokens_done"] = run._steps.log.count   # what a cancelled or failed run got to
            config["generated_tokens"], config["finish_reason"] = run.generated_tokens, run.finish_reason
            config["prompt_tokens_reused"] = run._steps.log.reused_tokens
            if run.tokenizer is not None:
                config["output_text"] = run.output_text
            run.history.record(run_id=run.id, config=config, state=state, report=report,
                                state_path=str(run.dump_path) if report and run.dump_path else None,
                                state_sha256=sha, error=run._error,
                                started_at=run.started_at, finished_at=run.finished_at)
        except Exception as exc:  # the run itself succeeded; say what went wrong with the record
            run.history_error = f"the run's history record was not written: {exc}"
            run._log(run.history_error)
    _settle_budget(run)


def _settle_budget(run) -> None:
    """After the run's files and record: what it wrote counted, older runs removed if the runs
    directory and the history are past [runs] budget. Never fails the run."""
    if run._budget is None:
        return
    try:
        own = run.dump_path.parent if run._reservation is not None else None
        for note in run._budget.settle(run._reservation, keep=own, history=run.history):
            run._log(note)
    except Exception as exc:
        run._log(f"runs directory: not checked against its budget: {exc}")


def _optimum_hit_rate(run, state_file: Path) -> float | None:
    fig = run._lease.figures()
    if fig is None:
        return None
    return optimum_hit_rate(run.checkpoint.geometry, state_file, run._steps.log, run.prefill_chunk,
                            fig.cache_capacity_bytes, run._log)


def _replay_reads(run) -> dict | None:
    """The I/O efficiency's replay, only when the run measures the disk (probe)."""
    if not run.probe or run._lease.engine is None:
        return None
    if run._steps.shared_passes:
        run._log("I/O efficiency: not measured: the run's reads were shared with other sequences")
        return None
    return replay_last_reads(run._lease.engine, run._steps.log, run._log, run._lease.session)


def _text_report(run) -> dict:
    sampling = run.config.sampling
    return {"prompt": run.config.text, "messages": list(run.config.messages) if run.config.messages else None,
            "thinking": run.config.thinking, "tools": list(run.config.tools) if run.config.tools else None,
            "tool_choice": run.config.tool_choice, "reasoning_effort": run.config.reasoning_effort,
            "output": run.output_text if run.tokenizer is not None else None,
            "sampling": sampling.to_dict() if sampling is not None else "greedy",
            "response_format": fmt.to_dict() if (fmt := run.config.response_format) is not None else None,
            "stop": list(run.config.stop), "stop_at_eos": run.stop_at_eos,
            "finish_reason": run.finish_reason, "prompt_tokens": len(run.prompt),
            "prompt_tokens_reused": run._steps.log.reused_tokens,
            "generated_tokens": run.generated_tokens}


def build_report(run, sha: str | None) -> dict:
    """A done run's report (its engine still loaded), without the fields finish_run adds."""
    snap = run.snapshot()
    fig = run._lease.figures()
    log = run._steps.log
    rows = log.rows[:log.count]
    return {
        "schema": REPORT_SCHEMA, "run_id": run.id, "state": "done",
        "started_at": run.started_at, "finished_at": run.finished_at,
        "model": str(run.config.model), "checkpoint_kind": run.checkpoint.kind,
        "geometry": run.checkpoint.geometry.to_config(), "config": run.config_dict(),
        "io_mode": run.checkpoint.io_mode, "policy": run.preset.policy,
        "cache": {"budget_bytes": fig.cache_budget_bytes, "capacity_bytes": fig.cache_capacity_bytes,
                  "slots": fig.slots, "slot_nbytes": fig.slot_nbytes,
                  # cold: empty at the start (Belady's yardstick starts empty too); warm: it held
                  # experts_at_start from the runs before on the same engine
                  "start": "warm" if run._lease.cache_at_start else "cold",
                  "experts_at_start": run._lease.cache_at_start},
        "pinned_layers": list(fig.pinned_layers), "floor": asdict(run._floor) if run._floor else None,
        "summary": summary(snap, log, time_split(log), prefill_report(log, run.prefill_chunk,
                                                                       run.checkpoint.geometry), run._replay),
        "layers": layers(snap),
        "backend_by_token": log.backends(),
        "prompt": list(run.prompt),
        "generated": [int(t) for t in rows["next_token_id"][len(run.prompt) - 1:]],
        "text": _text_report(run),
        "events": list(run._events), "events_dropped": run._n_events - len(run._events),
        "state_path": str(run.dump_path) if run.dump_path else None, "state_sha256": sha,
        "dump": run.dump_mode,
    }


def _spec_summary(run) -> dict | None:
    """The report's account of speculation (None: off)."""
    if run.config.spec == "off":
        return None
    if run._spec is None:
        return {"mode": str(run.config.spec), "active": False}
    with run._lock:
        return dict(run._spec.stats.to_dict(), mode=str(run._spec.mode), active=True)


def _batch_summary(run) -> dict | None:
    """How the run shared its forward passes (None: it ran alone on its engine)."""
    if run.engines is None or run.engines.parallel < 2:
        return None
    with run._lock:
        return {"parallel": run.engines.parallel, "steps": run._steps.passes, "shared_steps": run._steps.shared_passes}
