"""`ds4f bench agent`: an agent-shaped session replayed against `ds4f serve` through the openai client.

The session is what a coding agent sends: a shared prefix of tool schemas and a system prompt
(`prefix_tokens` long, made of the checkpoint tokenizer's words), a main thread whose turns each add
the model's answer with a tool call and the tool's result (`result_tokens`, drawn per turn), and two
subagents with system prompts of their own that share the tools, interleaved with the main thread,
and one restart of the server half-way (a new server on the same kv directory: the RAM tier empty).
Each answer goes back as the agent sends it: the text the server returned, plus the tool call. The
first `compare` requests of the main thread after its first are sent again to a `--no-kv` server.

Per request: the prompt's tokens, those reused from the prefix cache and those computed, the time to
the first token and to the end, the time its computed and generated tokens took (the run's own
token log: `tokens_s`), and the bytes it wrote: its state dump (the server's [dump] setting) and its
kept states (heads and blocks, from /status). From the same counts, the flash geometry's bytes: the
kept states a request writes there (its heads and blocks at DeepSeek-V4-Flash's sizes), and what full
state-dump records of its computed tokens would be.
"""
from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

from ds4f.bench.engine import Log, _quiet, bench_scratch_dir
from ds4f.errors import Ds4fError

TOOLS = ("read_file", "write_file", "run_command", "search_code", "list_directory", "apply_patch", "web_fetch",
         "ask_user")


def _words() -> list[str]:
    """The words of the text corpus ds4f ships (any text would do): what the prompts are made of."""
    from importlib import resources

    text = resources.files("ds4f.engine.text").joinpath("corpus.txt").read_text()
    return [w for w in text.split() if w.isascii()]


class _Text:
    """Texts of about n tokens of the checkpoint's tokenizer, from seeded draws of the corpus's words."""

    def __init__(self, tokenizer, words: list[str], seed: int) -> None:
        self.tok, self.words, self.rng = tokenizer, words, random.Random(seed)

    def __call__(self, n: int) -> str:
        """About n tokens: the sentences' own counts added up (a sentence is tokenized once, not the
        text so far again at each one; the requests report the exact counts)."""
        parts: list[str] = []
        count = 0
        while count < n:
            sentence = " ".join(self.rng.choice(self.words) for _ in range(self.rng.randint(8, 20))).capitalize() + "."
            parts.append(sentence)
            count += len(self.tok.encode_text(" " + sentence))
        return " ".join(parts)


def script(tokenizer, prefix_tokens: int, result_tokens: tuple[int, int], seed: int = 0) -> dict:
    """The session's fixed parts: tools, the three threads' system prompts and tasks, and a result
    size per turn."""
    text = _Text(tokenizer, _words(), seed)
    per_tool = max(20, (prefix_tokens * 9 // 10) // len(TOOLS))
    tools = [{"type": "function", "function": {
        "name": name, "description": text(per_tool),
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "where"},
                                                        "text": {"type": "string", "description": "what"}},
                       "required": ["path"]}}} for name in TOOLS]
    system = {"main": text(max(20, prefix_tokens // 10)), "sub1": text(300), "sub2": text(300)}
    tasks = {name: text(60) for name in system}
    rng = random.Random(seed + 1)
    return {"tools": tools, "system": system, "tasks": tasks, "text": text,
            "result_size": lambda: rng.randint(*result_tokens)}


def schedule(main_turns: int, sub_turns: int) -> list[str]:
    """The order of the requests: the main thread's first two, then each subagent's turns between
    the main thread's; "restart" half-way."""
    order = ["main", "main"][:main_turns]
    subs = [s for k in range(sub_turns) for s in ("sub1", "sub2")]
    mains = main_turns - len(order)
    while subs or mains:
        if subs:
            order.append(subs.pop(0))
        if mains:
            order.append("main")
            mains -= 1
    order.insert(len(order) // 2 + 1, "restart")
    return order


class _Serve:
    """A server the caller started (`serve(kv_dir, reuse)`: a running `ds4f serve` on loopback, with
    `.url` and `.stop(timeout)`), spoken to over HTTP as an agent does."""

    def __init__(self, serve, kv_dir: Path, reuse: bool) -> None:
        self.server = serve(kv_dir, reuse)
        self.url = self.server.url

    def client(self):
        try:
            import openai
        except ImportError:
            raise Ds4fError("ds4f bench agent talks to the server through the openai package: pip install openai"
                            ) from None
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=3600)

    def get(self, path: str) -> dict:
        import json
        import urllib.request

        with urllib.request.urlopen(f"{self.url}{path}", timeout=60) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.server.stop(timeout=120)


def _written(status: dict) -> tuple[int, int, int, int]:
    pc = status.get("prefix_cache") or {}
    return (pc.get("written_heads", 0), pc.get("written_blocks", 0), pc.get("heads_saved", 0),
            pc.get("blocks_saved", 0))


def _request(srv: _Serve, model_id: str, messages: list, tools: list, gen: int) -> dict:
    """One streamed request: its answer, usage, times and what it wrote."""
    before = _written(srv.get("/status"))
    client = srv.client()
    t0 = time.perf_counter()
    first = None
    text, rid, usage = [], None, None
    stream = client.chat.completions.create(model=model_id, messages=messages, tools=tools, max_tokens=gen,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        rid = rid or chunk.id
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls):
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    run_id = rid.split("-", 1)[1]
    view = srv.get(f"/runs/{run_id}")
    summary = (view.get("report") or {}).get("summary") or {}
    after = _written(srv.get("/status"))
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"run_id": run_id, "text": "".join(text), "prompt_tokens": usage.prompt_tokens, "reused": cached,
            "computed": usage.prompt_tokens - cached, "generated": usage.completion_tokens,
            "ttft_s": (first or time.perf_counter()) - t0, "total_s": total, "tokens_s": summary.get("tokens_s"),
            "dump_bytes": (view.get("report") or {}).get("state_nbytes") or 0,
            "kept_bytes": (after[0] - before[0]) + (after[1] - before[1]),
            "heads": after[2] - before[2], "blocks": after[3] - before[3]}


def bench_agent(model: str | Path, serve, prefix_tokens: int = 10_000, result_tokens: tuple[int, int] = (200, 3000),
                main_turns: int = 5, sub_turns: int = 2, gen: int = 16, compare: int = 2, *,
                log: Log | None = None) -> dict:
    """The session's requests (see the module docstring), the no-kv server's on the compared ones,
    and the totals with the flash geometry's projection. serve(kv_dir, reuse): a running `ds4f serve`
    on the checkpoint `model` with that kv directory, reusing prefixes or not (the caller's
    settings: preset, dump, parallel)."""
    from ds4f.engine.checkpoint import open_checkpoint
    from ds4f.engine.model.geometry import get_geometry
    from ds4f.engine.text.tokenizer import find_tokenizer
    from ds4f.runs.plan import bookkeeping as books
    from ds4f.runs.plan import kept_state_nbytes

    log = log or _quiet
    model = Path(model)
    tokenizer = find_tokenizer(model)
    if tokenizer is None:
        raise Ds4fError(f"{model}: no tokenizer: the agent bench speaks text", param="model")
    if main_turns < 2 or sub_turns < 0 or not 0 <= compare < main_turns:
        raise Ds4fError("bench agent: at least 2 main turns, and fewer compared requests than main turns")
    parts = script(tokenizer, prefix_tokens, result_tokens)
    kv = bench_scratch_dir() / f"agent-kv-{time.strftime('%Y%m%d-%H%M%S')}"
    threads = {name: [{"role": "system", "content": parts["system"][name]},
                      {"role": "user", "content": parts["tasks"][name]}] for name in ("main", "sub1", "sub2")}
    records, turn_of, restarted, last = [], dict.fromkeys(threads, 0), False, {}
    srv = _Serve(serve, kv, True)
    model_id = srv.get("/v1/models")["data"][0]["id"]
    try:
        for step in schedule(main_turns, sub_turns):
            if step == "restart":
                srv.close()
                srv = _Serve(serve, kv, True)
                restarted = True
                log("  restart: a new server on the same kv directory")
                continue
            messages = threads[step]
            r = _request(srv, model_id, messages, parts["tools"], gen)
            before = last.get(step)     # what the thread's previous request and its answer were: reusable now
            r.update(thread=step, turn=turn_of[step], after_restart=restarted,
                     reusable=before["prompt_tokens"] + before["generated"] if before else 0)
            last[step] = r
            records.append(r)
            log(f"  {step} turn {turn_of[step]}: {r['prompt_tokens']} prompt tokens, {r['reused']} reused,"
                f" {r['total_s']:.1f} s, {r['kept_bytes'] / 1e6:.1f} MB kept")
            r["messages"] = list(messages) if step == "main" else None
            call_id = f"call_{step}_{turn_of[step]}"
            messages.append({"role": "assistant", "content": r["text"], "tool_calls": [{
                "id": call_id, "type": "function", "function": {
                    "name": TOOLS[turn_of[step] % len(TOOLS)],
                    "arguments": f'{{"path": "src/{step}/part{turn_of[step]}.py"}}'}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": parts["text"](parts["result_size"]())})
            turn_of[step] += 1
    finally:
        srv.close()
    compared = []
    mains = [r for r in records if r["thread"] == "main"][1:1 + compare]
    if mains:
        cold = _Serve(serve, kv.parent / (kv.name + "-nokv"), False)
        try:
            for r in mains:
                c = _request(cold, model_id, r["messages"], parts["tools"], gen)
                compared.append({"thread": "main", "turn": r["turn"], "prompt_tokens": c["prompt_tokens"],
                                 "total_s": c["total_s"], "ttft_s": c["ttft_s"], "tokens_s": c["tokens_s"],
                                 "kv_total_s": r["total_s"], "speedup": c["total_s"] / r["total_s"],
                                 "same_answer": c["text"] == r["text"]})
                log(f"  no-kv main turn {r['turn']}: {c['total_s']:.1f} s against {r['total_s']:.1f} s")
        finally:
            cold.close()
    shutil.rmtree(kv, ignore_errors=True)
    shutil.rmtree(kv.parent / (kv.name + "-nokv"), ignore_errors=True)
    for r in records:
        r.pop("messages", None)
    ckpt = open_checkpoint(model)
    g = ckpt.geometry
    ckpt.close()
    return {"model": str(model), "geometry": g, "requests": records, "no_kv": compared,
            "totals": _totals(records, g, get_geometry("flash"), kept_state_nbytes, books)}


def _totals(records: list[dict], g, flash, kept_state_nbytes, books) -> dict:
    """The session's sums and its checks against the targets, on this model and projected to flash."""
    def per_token(geometry) -> dict:      # averaged over a long conversation (rows come one per ratio tokens)
        return {what: per for what, per, _ in books(geometry)}

    here, there = per_token(g), per_token(flash)
    kv_here, kv_there = here["kept state (KV, windows, last logits)"], there["kept state (KV, windows, last logits)"]
    full_here, full_there = here["state dump, full records"], there["state dump, full records"]
    head_there = kept_state_nbytes(flash, 0)
    span = 256
    later = [r for r in records if r["turn"] > 0]
    computed = sum(r["computed"] for r in records)
    written = sum(r["kept_bytes"] + r["dump_bytes"] for r in records)
    flash_written = sum(r["heads"] * head_there + r["blocks"] * span * kv_there for r in records)
    return {
        "requests": len(records), "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "reused": sum(r["reused"] for r in records), "computed": computed,
        "reuse_after_first": min((r["reused"] / r["prompt_tokens"] for r in later), default=None),
        # of what the thread's previous request and answer held (all a cache can give), the least reused
        "reuse_of_reusable": min((r["reused"] / r["reusable"] for r in later if r["reusable"]), default=None),
        "time_over_work": max((r["total_s"] / (r["tokens_s"] or 1e-9) for r in later if r["tokens_s"]), default=None),
        "written_bytes": written, "full_records_bytes": computed * full_here,
        "written_over_full": written / (computed * full_here) if computed else None,
        "written_over_kv": written / (computed * kv_here) if computed else None,
        "flash_written_bytes": flash_written, "flash_full_records_bytes": computed * full_there,
        "flash_kv_of_computed": computed * kv_there, "flash_head_bytes": head_there,
    }
