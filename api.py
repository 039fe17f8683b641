"""The engine's public surface: the one module the console, the server and the CLI import.

    host = EngineHost()                     # keeps one loaded engine across runs
    run = start_run(RunConfig(model=..., preset="laptop", gen=8), history=History(path), engines=host)
    run.snapshot()                          # live figures, cheap, any thread, any time
    run.switch(backend="scalar", kernel_threads=1, io_threads=8)   # lands at the next token
    run.cancel(); run.wait(); run.state; run.error; run.report
    host.close()

Everything a front end needs is re-exported here, so the engine's modules can move without the
front ends noticing, and a front end cannot reach around the run API into the engine's inner
parts (tests/test_layering.py checks that no front-end module imports ds4f.engine directly).
Errors are Ds4fError: `message`, and the `param`, `path` and `kind` it concerns.
"""
from __future__ import annotations

from ds4f.errors import Ds4fError, parse_json
from ds4f.units import format_bytes
from ds4f.paths import check_path_value, directory_problem, user_cache_dir, user_config_path, user_data_dir
from ds4f.safe_read import open_regular, read_regular, read_regular_json, read_regular_text
from ds4f.native.kernels import BACKENDS, available_backends, best_backend
# the engine: checkpoints, config, geometry, text, the disk floor
from ds4f.engine.checkpoint import detect_kind, open_checkpoint
from ds4f.engine.checkpoint.convert import convert_checkpoint
from ds4f.engine.checkpoint.demo import ensure_demo_model, ensure_synthetic
from ds4f.engine.checkpoint.synth import synth_checkpoint
from ds4f.engine.checkpoint.verify import verify_checkpoint
from ds4f.engine.config import (BACKEND_NAMES, DEFAULT_GEN, DEFAULT_PARALLEL, MAX_PARALLEL, MAX_GEN, MAX_THREADS, Budget, Config, Preset,
                                check_kv_dir, parse_budget)
from ds4f.engine.model.geometry import CONFIG_KEYS, GEOMETRIES, Geometry, get_geometry
from ds4f.engine.runtime.disk_floor import FLOOR_CAVEAT, cached_floor, probe_floor
from ds4f.engine.prefix_cache import directory_usage as kv_directory_usage
from ds4f.engine.runtime.policies import DEFAULT_POLICY, ONLINE_POLICIES
from ds4f.engine.speculative import MAX_DRAFTS, parse_spec
from ds4f.engine.text import (GenerationDefaults, Sampler, SamplingParams, TextStream, Tokenizer, chat_prompt_ids,
                              find_tokenizer, render_chat)
from ds4f.engine.text.output import THINK_END
from ds4f.engine.text.constraint import ResponseFormat, check_response_format
from ds4f.engine.text.chat import answer_opening, check_chat, check_choice, check_effort, offered
from ds4f.engine.text.dsml import check_call, check_function, check_tools
from ds4f.engine.text.reply import Reply, ReplyParser, new_call_id, parse_reply
# ds4f.toml whole: the engine's settings and the front ends' ([console], [history], [server], [dump], [runs])
from ds4f.settings import Settings, load_settings
# the cache lab
from ds4f.cachelab.replay import parse_policy, replay
from ds4f.cachelab.sweep import format_table, plot_sweep, sweep
# runs: the run API and its artifacts
from ds4f.runs.budget import RunsBudget, runs_budget_for
from ds4f.runs.config import RunConfig
from ds4f.runs.history import (History, PrunePlan, RunRecord, hash_groups, plan_prune, prune_runs, report_file,
                               run_files)
from ds4f.runs.host import EngineHost
from ds4f.runs.plan import CONVERSATION_TOKENS, MemoryPlan, bookkeeping, fit_parallel, kept_state_nbytes, memory_plan
from ds4f.engine.model.records import RECORDS_OF_DUMP
from ds4f.runs.run import END_STATES, LIVE_STATES, Run, active_run, active_runs, start_run
from ds4f.runs.snapshot import Snapshot, TokenRecord, disk_occupancy
from ds4f.runs.diff import LOW_BIT_TOLERANCE, StateDiff, diff_states
from ds4f.runs.statedump import read_state
from ds4f.runs.traces import export_trace, load_trace

__all__ = [
    "MAX_DRAFTS", "parse_spec",
    "BACKEND_NAMES", "DEFAULT_GEN", "END_STATES", "LIVE_STATES", "LOW_BIT_TOLERANCE", "MAX_GEN",
    "MAX_THREADS", "Budget", "Config", "Ds4fError", "parse_json", "EngineHost", "History", "Preset", "Run", "RunConfig",
    "RunRecord", "Snapshot", "StateDiff", "TokenRecord", "active_run", "active_runs", "available_backends", "best_backend",
    "checkpoint_summary", "detect_kind", "diff_states", "disk_occupancy", "format_bytes", "hash_groups",
    "kv_directory_usage", "open_checkpoint", "parse_budget", "read_state", "start_run", "user_cache_dir",
    "user_config_path", "user_data_dir",
    # ds4f.toml: the engine's settings and the front ends'
    "Settings", "load_settings",
    # files the user names: a regular file only, read within a bound; the paths the user gives
    "read_regular", "read_regular_text", "read_regular_json", "open_regular", "check_path_value",
    "directory_problem", "check_kv_dir",
    # checkpoints, the cache lab, the disk floor
    "convert_checkpoint", "synth_checkpoint", "verify_checkpoint", "ensure_demo_model", "ensure_synthetic",
    "GEOMETRIES", "CONFIG_KEYS", "Geometry", "get_geometry",
    "load_trace", "export_trace", "parse_policy", "replay", "sweep", "format_table", "plot_sweep",
    "ONLINE_POLICIES", "DEFAULT_POLICY",
    "BACKENDS", "probe_floor", "cached_floor", "FLOOR_CAVEAT",
    # pruning the run history
    "PrunePlan", "plan_prune", "prune_runs", "run_files", "report_file",
    # the runs directory's disk budget ([runs] budget)
    "RunsBudget", "runs_budget_for",
    # the memory plan
    "MemoryPlan", "memory_plan", "RECORDS_OF_DUMP", "fit_parallel", "bookkeeping", "kept_state_nbytes", "CONVERSATION_TOKENS", "DEFAULT_PARALLEL", "MAX_PARALLEL",
    # text: tokenizer, streaming, chat format, sampling
    "Tokenizer", "find_tokenizer", "GenerationDefaults", "TextStream", "render_chat", "chat_prompt_ids",
    "SamplingParams", "Sampler", "THINK_END",
    # structured outputs: the answer held to JSON or a JSON Schema
    "ResponseFormat", "check_response_format",
    # tools: DeepSeek-V4's tool calls, and the answer's reader
    "answer_opening", "offered", "check_chat", "check_choice", "check_effort", "check_call", "check_function",
    "check_tools",
    "Reply", "ReplyParser", "new_call_id", "parse_reply",
]

def checkpoint_summary(path: str) -> dict:
    """Open a checkpoint, check it, and say what it is: {kind, path, geometry, io_mode, vocab, synthetic}.
    Raises Ds4fError naming the file and the problem."""
    with open_checkpoint(path) as ck:
        return {"kind": ck.kind, "path": str(ck.path), "geometry": ck.geometry.to_config(), "io_mode": ck.io_mode,
                "vocab": ck.geometry.vocab, "synthetic": _is_synthetic(ck.path)}


def _is_synthetic(path) -> bool:
    """A checkpoint `ds4f synth` made (random weights: its text is noise): config.json says so."""
    from pathlib import Path

    try:   # a regular file within a bound (a FIFO under its name would block the caller)
        config = read_regular_json(Path(path) / "config.json", "config.json", 16 << 20)
    except Ds4fError:
        return False
    return isinstance(config, dict) and "ds4f_synthetic" in config
