"""`ds4f bench chat`: an N-turn conversation on the bench checkpoint (a system prompt of a few
hundred tokens, as clients send, then a short question a turn; each answer kept as the ids it was
generated as, as the console and `ds4f chat` keep it), each turn with the prefix cache and without
it, and the last turn again after a restart (a new engine: the states from disk, where a request
puts its end state: the turn reuses the previous turn's prompt and answer).

Per turn and mode, from the runs' own reports: the prompt tokens reused and computed, the time
its tokens took (and the run's wall time: an engine load, a state read from disk), the GB read
from disk (every token's direct reads), the expert-cache hit rate, and the
state dump's sha256 (a reused prefix must give the cold run's dump). `recompute` runs the same
turns, with the answers the `reuse` pass gave, on an engine of its own with no prefix reuse;
`restart` is the last turn on a new engine with an empty RAM tier. Both modes run in this
invocation, interleaved turn by turn, so a disk that drifts during the bench favours neither.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from ds4f.bench.engine import Log, _quiet, bench_model, bench_scratch_dir, finished_report
from ds4f.errors import Ds4fError

# what an assistant client sends first on every request (a few hundred tokens, as agent and chat
# clients do): the part of each turn's prompt a prefix cache saves whatever the turn
SYSTEM = ("You are the assistant of an operator who runs a large language model on one machine with a fast "
          "disk and too little memory for the whole model. Answer in plain English, briefly and exactly. "
          "When a question is about speed, say what limits it: the disk's read rate, the memory's bandwidth, "
          "or the arithmetic of the kernels, and which of them a change would move. When a figure is asked "
          "for, give the figure, its unit, and how it was measured; never guess a number, and say so when "
          "you do not know one. Prefer a short list to a long paragraph. Do not repeat the question. "
          "If the operator asks for a command, give the whole command line, and say what it changes before "
          "they run it. If two settings trade one cost for another, name both costs. Keep the conversation's "
          "earlier answers in mind: do not contradict them without saying why. The machine has a few cores, "
          "a solid state disk that reads about one gigabyte per second at random, and memory that reads "
          "tens of gigabytes per second; the model's experts live on the disk and stream into a cache of "
          "slots in memory, layer by layer, as each token chooses them. The operator cares about seconds "
          "per token, the hit rate of the expert cache, the bytes read per token, and whether two runs "
          "computed the same numbers. Be honest about what a measurement can and cannot show.")
QUESTIONS = ("What is an expert cache, and why does it matter for a model this size?",
             "How does a disk-streaming engine decide what to read next?",
             "Why keep a conversation's state instead of recomputing it?",
             "What would you measure first on a new machine?",
             "Summarise the answers so far in one line.")
MODES = ("reuse", "recompute", "restart")


def bench_chat(model: str | Path | None = None, preset: str = "laptop", turns: int = 3, gen: int | None = None,
               config_path: str | None = None, *, log: Log | None = None, progress=None) -> list[dict]:
    """One record per turn and mode (see the module docstring)."""
    from ds4f.runs.host import EngineHost

    if not 1 <= turns <= len(QUESTIONS):
        raise Ds4fError(f"turns: from 1 to {len(QUESTIONS)}, got {turns}", param="turns")
    log = log or _quiet
    model = bench_model(model, progress, log)
    gen = gen or 16
    kv = bench_scratch_dir() / f"chat-kv-{time.strftime('%Y%m%d-%H%M%S')}"
    hosts = {"reuse": EngineHost(), "recompute": EngineHost()}
    records, messages = [], [{"role": "system", "content": SYSTEM}]
    try:
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[turn]})
            first = None
            for mode in (("reuse", "recompute") if turn % 2 == 0 else ("recompute", "reuse")):
                r = _turn(model, preset, messages, gen, config_path, kv, hosts[mode], mode, turn, log)
                records.append(r)
                first = r if mode == "reuse" else first
            messages.append(first["message"])
        hosts["reuse"].close()
        restart = EngineHost()      # a new process would do the same: the RAM tier empty, the files kept
        try:
            records.append(_turn(model, preset, messages[:-1], gen, config_path, kv, restart, "restart", turns - 1,
                                 log))
        finally:
            restart.close()
    finally:
        for host in hosts.values():
            host.close()
        shutil.rmtree(kv, ignore_errors=True)
    return records


def _turn(model, preset, messages, gen, config_path, kv: Path, host, mode: str, turn: int, log: Log) -> dict:
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    config = RunConfig(model=str(model), preset=preset, gen=gen, messages=tuple(messages), config_path=config_path,
                       probe_floor=False, kv_dir=str(kv), reuse_prefix=mode != "recompute", stop_at_eos=False,
                       dump_path=str(bench_scratch_dir() / f"chat-{mode}-{turn}.bin"))
    run = start_run(config, engines=host)
    report = finished_report(run, log,
                             lambda snap: f"  turn {turn + 1} [{mode}]: {snap.tokens_done}/{snap.steps} tokens")
    s = report["summary"]
    return {"turn": turn + 1, "mode": mode, "prompt_tokens": run.prompt_tokens,
            "reused": run.prompt_tokens_reused, "computed": run.prompt_tokens - run.prompt_tokens_reused,
            "seconds": sum(t["seconds"] for t in report["tokens"]), "wall_s": s["wall_s"],
            "gb_read": sum(t["bytes_read"] for t in report["tokens"]) / 1e9,
            "hit_rate": s["hit_rate"], "cache_start": report["cache"]["start"],
            "sha256": report["state_sha256"], "output": run.output_text, "message": run.assistant_message,
            "backend": report["backend_by_token"][-1]}
