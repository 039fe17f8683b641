"""`ds4f bench engine|cache|console|prefill|chat|batch|spec|agent|structured|split|llama`: the benchmarks from the shell.

All of them go through ds4f.api (the benchmarks), like the console and the server do; `bench
console` measures the console itself (ds4f.console.bench). MODEL defaults to the bench
checkpoint, made on first use (announced, with progress bars).
"""
from __future__ import annotations

import argparse
import builtins
import functools
import sys

from ds4f.api import Ds4fError, ensure_demo_model, format_bytes
from ds4f.cli.bench_tables import (_cache_tables, _depth_table, _engine_table, _prefill_table, _print_bench_cache,
                                   _print_bench_engine, _print_prefill, _show)
from ds4f.cli.options import (add_backend, add_config, add_dump_option, add_gen, add_json_option, add_model,
                              add_output_option, add_parallel, add_preset, add_repeat, add_threads, announce,
                              model_arg)
from ds4f.cli.output import Column, Inputs, Label, Table, check_streams, command_inputs
from ds4f.cli.runs import _fmt


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["engine", "cache", "console", "prefill", "chat", "batch", "spec", "agent",
                                         "structured", "split", "llama"],
                        help="which benchmark: engine (SIMD against scalar), cache (policies and prefetch), "
                             "console (key-to-action latency and bytes per refresh during a run), "
                             "prefill (the prompt token by token against layer-major chunks), "
                             "chat (a conversation's turns with the prefix cache and without, and a restart), "
                             "batch (1, 2, 4, 8 sequences decoded together against taking turns), "
                             "spec (speculative decoding with the MTP layer against plain decoding), "
                             "agent (an agent's session against ds4f serve: reuse, times and bytes written), "
                             "structured (a JSON Schema's token mask: its cost per token and a request's memory, "
                             "on the demo and flash vocabularies and MODEL's tokenizer when given), "
                             "split (where a decode token's time goes: ds4f's kernels, numpy, the interpreter, "
                             "waits; py-spy's native samples of a run, one kernel thread, the model in RAM after a "
                             "warming prompt unless --preset or --config), "
                             "llama (ds4f against llama.cpp's llama-bench on the bench checkpoint, converted by "
                             "llama.cpp's own converter: decode, pp128, pp512 and peak RSS, rounds alternated; "
                             "needs --llama-build and --llama-src)")
    add_model(parser, "checkpoint (default: the bench geometry, made on demand)")
    add_gen(parser, "bench engine 8, bench cache 24, bench spec 24, per run; bench llama 32, its tg test")
    add_preset(parser, "laptop; bench engine and bench cache; bench llama: server")
    add_config(parser)
    add_json_option(parser)
    add_output_option(parser)
    parser.add_argument("--turns", type=int, default=None,
                        help="bench chat: turns of the conversation (default 3); bench agent: the main thread's (5)")
    parser.add_argument("--prefix-tokens", type=int, default=10_000,
                        help="bench agent: the shared tools and system prompt, in tokens (default 10000)")
    parser.add_argument("--result-tokens", default="200-3000", metavar="MIN-MAX",
                        help="bench agent: a tool result's tokens, drawn per turn (default 200-3000)")
    parser.add_argument("--sub-turns", type=int, default=2, help="bench agent: each subagent's turns (default 2)")
    parser.add_argument("--compare", type=int, default=2,
                        help="bench agent: main-thread requests sent again to a --no-kv server (default 2)")
    add_parallel(parser, 1, note="bench agent: the server's")
    add_dump_option(parser, "server")
    add_repeat(parser, None, "bench spec: (plain, speculative) pairs per row, each figure the faster; bench llama: "
                           "each test per round, as llama-bench -r", "2; bench llama 3")
    parser.add_argument("--rows", choices=["all", "auto"], default="all",
                        help="bench spec: every row, or only spec auto's (default all)")
    parser.add_argument("--trained", action="store_true",
                        help="bench spec: MODEL is a checkpoint with a trained MTP layer and its script.json of "
                             "conversations (default: tests/fixtures/toolcall of a source checkout): the drafts' real "
                             "acceptance and speed, spec 1-3 and auto against off")
    parser.add_argument("--lengths", default=None,
                        help="bench prefill: prompt lengths, comma-separated (default 16,128,512,2048)")
    add_backend(parser, "bench cache: the backend of its prefetch runs (scalar shows what prefetch does when "
                        "the disk has idle time)")
    llama = parser.add_argument_group("bench llama (optional: llama.cpp is needed for this benchmark only)")
    llama.add_argument("--llama-build", metavar="DIR", default=None,
                       help="a llama.cpp build directory holding llama-bench (DIR/bin/llama-bench)")
    llama.add_argument("--llama-src", metavar="DIR", default=None,
                       help="llama.cpp's source tree: its converter convert_hf_to_gguf.py and gguf-py")
    llama.add_argument("--llama-python", metavar="PATH", default=None,
                       help="the Python that runs llama.cpp's converter (torch, transformers, safetensors, "
                            "sentencepiece; default: this one); used once, when the GGUF is made")
    llama.add_argument("--rounds", type=int, default=3, metavar="N",
                       help="rounds of each engine, alternated ds4f first (default 3)")
    add_threads(llama, default=2, help="kernel threads of both engines (default 2)")
    llama.add_argument("--lock", metavar="FILE", default=None,
                       help="hold an flock on FILE during each round (a machine whose benchmarks take turns)")


def run(args) -> int:
    return _bench(args)


def _bench(args) -> int:
    check_streams(args, command_inputs(args.config, model_arg(args)) if args.json not in (None, "-") else Inputs())
    if args.what == "console":
        return _bench_console(args)
    if args.what == "split":
        return _bench_split(args, model_arg(args))
    if args.what == "llama":
        return _bench_llama(args)
    for flag, value in (("--llama-build", args.llama_build), ("--llama-src", args.llama_src),
                        ("--llama-python", args.llama_python), ("--lock", args.lock)):
        if value is not None:
            raise Ds4fError(f"{flag}: only bench llama takes it")
    args.preset = args.preset or "laptop"
    model = model_arg(args)
    if args.what == "structured":
        return _bench_structured(args, model)
    if args.what == "engine":
        from ds4f.bench import bench_engine

        if args.backend is not None:
            raise Ds4fError("--backend: bench engine always compares the best SIMD backend with scalar; "
                            "--backend is for bench cache")
        r = bench_engine(model, args.preset, args.gen, args.config, log=announce, progress=True)
        _show(args, [_engine_table(r), _depth_table(r)], lambda out: _print_bench_engine(r, out), r)
        return 0
    if args.what == "prefill":
        return _bench_prefill(args, model)
    if args.what == "chat":
        return _bench_chat(args, model)
    if args.what == "batch":
        return _bench_batch(args, model)
    if args.what == "spec":
        return _bench_spec(args, model)
    if args.what == "agent":
        return _bench_agent(args, model)
    from ds4f.bench import bench_cache

    r = bench_cache(model, args.preset, args.gen, args.config, args.backend,
                    log=announce, progress=True)
    _show(args, _cache_tables(r), lambda out: _print_bench_cache(r, out), r)
    return 0


def _bench_split(args, model) -> int:
    from ds4f.bench import bench_split

    r = bench_split(model, args.preset, args.gen, args.config, args.backend, log=announce, progress=True)
    parts = Table("split", [Column("part", align="left"), Column("share", "share", ".1%"), Column("samples")],
                  title=f"a decode token's time on the compute thread ({r['samples']} samples of {r['gen']} tokens,"
                        f" preset {r['preset']}" + (f" after a {r['warm_prompt']}-token prompt" if r["warm_prompt"] else "")
                        + f", backend {r['backend']}, {r['threads']} kernel thread)")
    for name, share in r["parts"].items():
        parts.add(name, share, r["counts"][name])
    top = Table("split_top", [Column("part", align="left"), Column("frame", align="left"),
                              Column("share", "share", ".1%")], title="where the time outside the kernels goes")
    for part, frame, share in r["top"]:
        top.add(part, frame, share)
    pieces = Table("split_pieces", [Column("piece", align="left"), Column("share", "share", ".1%")],
                   title="what of the model the samples compute (the rest: embedding, routing, norms, records)")
    for name, share in r["pieces"].items():
        pieces.add(name, share)

    def text(out) -> None:
        for table in (parts, pieces, top):
            builtins.print(file=out)
            builtins.print(table.text(), file=out)
    _show(args, [parts, pieces, top], text, r)
    return 0


def _bench_llama(args) -> int:
    from ds4f.bench.llama import bench_llama

    if model_arg(args):
        raise Ds4fError("MODEL: bench llama runs the bench checkpoint (its official shards are made again for "
                        "llama.cpp's converter); it takes no MODEL")
    if args.backend is not None:
        raise Ds4fError("--backend: bench llama runs ds4f's best backend (ds4f.toml's engine.backend)")
    r = bench_llama(args.llama_build, args.llama_src, rounds=args.rounds, threads=args.threads, gen=args.gen or 32,
                    repeat=args.repeat or 3, preset=args.preset or "server", python=args.llama_python,
                    lock=args.lock, config_path=args.config, log=announce, progress=True)
    rounds, ratio = _llama_tables(r)

    def text(out) -> None:
        print = functools.partial(builtins.print, file=out)
        print()
        print(rounds.text())
        print()
        print(ratio.text())
    _show(args, [rounds, ratio], text, r)
    return 0


def _llama_tables(r: dict) -> tuple[Table, Table]:
    rounds = Table("rounds", [Column("round"), Column("engine", align="left"),
                              Column("decode", "decode tok/s", ".2f"), Column("pp128", "pp128 tok/s", ".2f"),
                              Column("pp512", "pp512 tok/s", ".2f"), Column("peak_rss_gib", "peak RSS GiB", ".2f"),
                              Column("load_before", "load before", align="left"),
                              Column("load_after", "load after", align="left")],
                   title=f"each round ({r['threads']} threads; pp128, pp512 and tg{r['gen']} {r['repeat']} times each, "
                         f"mean tokens/s; ds4f: preset {r['preset']} with the whole expert pool cached; llama.cpp: "
                         f"the GGUF read into memory)")
    for x in r["rounds"]:
        rounds.add(x["round"], x["engine"], x["decode"], x["pp128"], x["pp512"], x["peak_rss"] / 2**30,
                   x["load_before"], x["load_after"])
    ratio = Table("ratios", [Column("metric", align="left"), Column("ds4f", "ds4f", ".2f"),
                             Column("llama", "llama.cpp", ".2f"), Column("ratio", "ds4f/llama.cpp", ".2f"),
                             Column("low", "lowest pair", ".2f"), Column("high", "highest pair", ".2f")],
                  title="medians over the rounds, ds4f over llama.cpp (tokens/s: above 1 ds4f is faster; "
                        "peak RSS: above 1 ds4f holds more)")
    for key, label in (("decode", "decode tok/s"), ("pp128", "pp128 tok/s"), ("pp512", "pp512 tok/s"),
                       ("peak_rss", "peak RSS GiB")):
        m = r["ratios"][key]
        scale = 2**30 if key == "peak_rss" else 1
        ratio.add(Label(key, label), None if m["ds4f"] is None else m["ds4f"] / scale,
                  None if m["llama"] is None else m["llama"] / scale, m["ratio"], m["low"], m["high"])
    return rounds, ratio


def _bench_structured(args, model) -> int:
    from ds4f.bench import bench_structured

    records = bench_structured(model, log=announce)
    table = Table("structured", [Column("vocab", align="left"), Column("ids"),
                                 Column("mask_us_median", "mask µs", ".0f"), Column("mask_us_p90", "p90", ".0f"),
                                 Column("mask_us_max", "max", ".0f"), Column("wait_us_median", "waited µs", ".0f"),
                                 Column("greedy_pick_us", "greedy pick µs", ".0f"),
                                 Column("greedy_plain_us", "unconstrained", ".0f"),
                                 Column("sampled_pick_us", "sampled pick µs", ".0f"),
                                 Column("sampled_plain_us", "unconstrained", ".0f"),
                                 Column("compile_ms", "compile ms", ".1f"), Column("request_ms", "request ms", ".2f"),
                                 Column("request_kib", "KiB/request", ".0f"),
                                 Column("tokenizer_build_s", "tokenizer s", ".2f")],
                  title="a JSON Schema's constraint per token (answers to random logits; the forward pass not included)")
    for r in records:
        table.add(r["vocab"], r["ids"], r["mask_us_median"], r["mask_us_p90"], r["mask_us_max"], r["wait_us_median"],
                  r["greedy_pick_us"], r["greedy_plain_us"], r["sampled_pick_us"], r["sampled_plain_us"],
                  r["compile_ms"], r["request_ms"], r["request_kib"], r["tokenizer_build_s"])

    def text(out) -> None:
        builtins.print(file=out)
        builtins.print(table.text(), file=out)
    _show(args, [table], text, records)
    return 0


def _bench_prefill(args, model) -> int:
    from ds4f.bench import bench_prefill

    lengths = (16, 128, 512, 2048)
    if args.lengths:
        try:
            lengths = tuple(int(v) for v in args.lengths.split(",") if v.strip())
        except ValueError:
            raise Ds4fError(f"--lengths: expected comma-separated prompt lengths, got {args.lengths!r}") from None
    records = bench_prefill(model, args.preset, lengths, args.gen, args.config, log=announce, progress=True)
    table = _prefill_table(records)
    _show(args, [table], lambda out: _print_prefill(records, table, out), records)
    return 0


def _bench_batch(args, model) -> int:
    from ds4f.bench import bench_batch

    result = bench_batch(model, args.preset, args.gen, args.config, log=announce, progress=True)
    records, join = result["records"], result["join"]
    table = Table("batch", [Column("cache", align="left"), Column("sequences", "seqs"),
                            Column("tokens_per_s", "decode tok/s", ".2f"),
                            Column("turns_tokens_per_s", "turns", ".2f"),
                            Column("speedup", "x turns", ".2f"), Column("over_one", "x 1 seq", ".2f"),
                            Column("e2e_tokens_per_s", "e2e tok/s", ".2f"), Column("e2e_speedup", "e2e x turns", ".2f"),
                            Column("sequence_tokens_per_s", "tok/s per seq", ".2f"), Column("ttft_s", "TTFT s", ".2f"),
                            Column("turns_ttft_s", "turns TTFT s", ".2f"), Column("gb_per_token", "GB/tok", ".3f"),
                            Column("turns_gb_per_token", "turns GB/tok", ".3f"),
                            Column("union_experts_per_layer", "union/layer", ".1f")],
                  title="sequences decoded together against taking turns (the same requests, the same run; decode: "
                        "while every sequence decodes; e2e: first start to last end, prompts included)")
    for r in records:
        b, t = r["batched"], r["turns"]
        table.add(r["cache"], r["sequences"], b["tokens_per_s"], t["tokens_per_s"], r["speedup"], r["over_one"],
                  b["e2e_tokens_per_s"], r["e2e_speedup"], b["sequence_tokens_per_s"], b["ttft_s"], t["ttft_s"], b["gb_per_token"], t["gb_per_token"],
                  b["union_experts_per_layer"])

    def text(out):
        print = functools.partial(builtins.print, file=out)
        print()
        print(table.text())
        for key, what in (("speedup", "decode"), ("e2e_speedup", "end to end")):
            worst = min((r[key] for r in records if r["sequences"] > 1 and r[key]), default=None)
            if worst is not None:
                print(f"worst batched/turns, {what}: {worst:.2f}x (taking turns: the same requests one after another)")
        if join:
            print(f"a second request while a first streams: first token after {join['ttft_s']:.2f} s, "
                  f"{'within' if join['within_bound'] else 'BEYOND'} its alone {join['alone_ttft_s']:.2f} s"
                  f" + one decode step {join['step_s']:.2f} s")

    _show(args, [table], text, result)
    return 0


def _bench_spec_trained(args, model) -> int:
    from ds4f.bench import bench_spec_trained

    result = bench_spec_trained(model, log=announce)
    records = result["records"]
    table = Table("spec_trained", [Column("spec", align="left"), Column("tokens"), Column("tokens_per_s", "tok/s", ".1f"),
                                   Column("speedup", "x off", ".2f"), Column("acceptance", "accepted", ".0%"),
                                   Column("tokens_per_round", "tok/round", ".2f"),
                                   Column("by_k", "rounds by k", align="left"), Column("same", "= off's tokens", align="left")],
                  title=f"a trained MTP layer's drafts on {result['conversations']} conversations of {result['model']}"
                        " (greedy to EOS; decode tokens/s)")
    for r in records:
        table.add(r["spec"], r["tokens"], r["tokens_per_s"], r["speedup"], r["acceptance"], r["tokens_per_round"],
                  " ".join(f"{k}:{n}" for k, n in sorted(r["by_k"].items())) or "-", "yes" if r["same"] else "NO")

    def text(out):
        print = functools.partial(builtins.print, file=out)
        print()
        print(table.text())
        if not all(r["same"] for r in records):
            print("TOKENS DIFFER from plain decoding in some rows: a bug")

    _show(args, [table], text, result)
    return 1 if not all(r["same"] for r in records) else 0


def _bench_spec(args, model) -> int:
    from ds4f.bench import bench_spec
    from ds4f.bench.spec import REPEAT

    if args.trained:
        return _bench_spec_trained(args, model)

    result = bench_spec(model, args.preset, args.gen, args.config, log=announce, progress=True,
                        repeat=args.repeat or REPEAT, rows=args.rows)
    records = result["records"]
    table = Table("spec", [Column("cache", align="left"), Column("drafter", align="left"), Column("k", align="left"),
                           Column("tokens_per_s", "tok/s", ".3f"), Column("speedup", "x plain", ".2f"),
                           Column("plain_tokens_per_s", "plain tok/s", ".3f"),
                           Column("gb_per_token", "GB/tok", ".3f"), Column("plain_gb_per_token", "plain GB/tok", ".3f"),
                           Column("acceptance", "accepted", ".0%"), Column("tokens_per_round", "tok/round", ".2f"),
                           Column("by_k", "rounds by k", align="left"), Column("draft_s", "draft s", ".2f"),
                           Column("same", "= plain tokens", align="left")],
                  title=f"speculative decoding against plain decoding ({result['gen']} greedy tokens after a"
                        f" prompt of {result['prompt']}; oracle p: drafts right with probability p)")
    for r in records:
        table.add(r["cache"], r["drafter"], r["k"], r["tokens_per_s"], r["speedup"], r["plain_tokens_per_s"],
                  r["gb_per_token"], r["plain_gb_per_token"], r["acceptance"], r["tokens_per_round"],
                  " ".join(f"{k}:{n}" for k, n in sorted(r["by_k"].items())) or "-", r["draft_s"],
                  "yes" if r["same"] else "NO")

    def text(out):
        print = functools.partial(builtins.print, file=out)
        print()
        print(table.text())
        for cache, pl in result["plain"].items():
            print(f"plain, {cache} cache: {pl['tokens_per_s']:.3f} tok/s, {pl['gb_per_token']:.3f} GB/token")
        for drafter in ("mtp", "oracle p=0.0"):
            auto = [r["speedup"] for r in records if r["k"] == "auto" and r["drafter"] == drafter]
            if auto:
                print(f"auto with {'the MTP layer' if drafter == 'mtp' else drafter}'s drafts: worst {min(auto):.2f}x plain")
        control = [r["speedup"] for r in records if r["drafter"] == "control"]
        if control:
            print(f"control (plain against plain, the machine's noise): {min(control):.2f}x-{max(control):.2f}x")
        if not all(r["same"] for r in records):
            print("TOKENS DIFFER from plain decoding in some rows: a bug")

    _show(args, [table], text, result)
    return 1 if not all(r["same"] for r in records) else 0


def _bench_chat(args, model) -> int:
    from ds4f.bench import bench_chat

    records = bench_chat(model, args.preset, args.turns or 3, args.gen, args.config, log=announce, progress=True)
    table = Table("chat", [Column("turn"), Column("mode", align="left"), Column("prompt_tokens", "prompt"),
                           Column("reused"), Column("computed"), Column("seconds", "s (tokens)", ".2f"),
                           Column("wall_s", "s (run)", ".2f"), Column("gb_read", "GB read", ".3f"),
                           Column("hit_rate", "hit rate", ".1%"), Column("same_dump", "dump = recompute's",
                                                                          align="left")],
                  title="a conversation with the prefix cache (reuse), without it (recompute), and its last turn "
                        "after a restart (from disk)")
    want = {r["turn"]: r["sha256"] for r in records if r["mode"] == "recompute"}
    for r in records:
        same = "" if r["mode"] == "recompute" else ("yes" if r["sha256"] == want.get(r["turn"]) else "NO")
        table.add(r["turn"], r["mode"], r["prompt_tokens"], r["reused"], r["computed"], r["seconds"], r["wall_s"],
                  r["gb_read"], r["hit_rate"], same)

    def text(out):
        print = functools.partial(builtins.print, file=out)
        print()
        print(table.text())
        by = {(r["turn"], r["mode"]): r for r in records}
        for turn in sorted({r["turn"] for r in records}):
            a, b = by.get((turn, "reuse")), by.get((turn, "recompute"))
            if a and b and a["seconds"]:
                print(f"turn {turn}: {b['seconds'] / a['seconds']:.1f}x faster with the prefix cache"
                      f" ({a['computed']} of {a['prompt_tokens']} prompt tokens computed)")

    _show(args, [table], text, records)
    return 0


def _bench_agent(args, model) -> int:
    from ds4f.bench import bench_agent

    try:
        low, high = (int(x) for x in args.result_tokens.split("-"))
    except ValueError:
        raise Ds4fError(f"--result-tokens: MIN-MAX tokens, e.g. 200-3000, got {args.result_tokens!r}") from None
    model = model or str(ensure_demo_model(progress=True))

    def serve(kv_dir, reuse: bool):
        """ds4f serve on loopback, in this process, with the bench's settings."""
        from ds4f.server.app import Server, ServerOptions

        server = Server(ServerOptions(model=model, preset=args.preset, config_path=args.config, host="127.0.0.1",
                                      port=0, access_log=False, kv_dir=str(kv_dir), reuse_prefix=reuse,
                                      parallel=args.parallel, dump=args.dump))
        server.start(timeout=120)
        return server

    r = bench_agent(model, serve, args.prefix_tokens, (low, high), args.turns or 5, args.sub_turns, args.gen or 16,
                    args.compare, log=announce)
    table = Table("agent", [Column("thread", align="left"), Column("turn"), Column("prompt_tokens", "prompt"),
                            Column("reused"), Column("computed"), Column("ttft_s", "TTFT s", ".2f"),
                            Column("total_s", "total s", ".2f"), Column("tokens_s", "tokens s", ".2f"),
                            Column("kept_bytes", "kept MB", ".1f"), Column("dump_bytes", "dump MB", ".2f"),
                            Column("after_restart", "restarted", align="left")],
                  title="an agent's session against ds4f serve with the prefix cache (kept states: heads and blocks"
                        " written to the kv directory)")
    for q in r["requests"]:
        table.add(q["thread"], q["turn"], q["prompt_tokens"], q["reused"], q["computed"], q["ttft_s"], q["total_s"],
                  q["tokens_s"], q["kept_bytes"] / 1e6, q["dump_bytes"] / 1e6, "yes" if q["after_restart"] else "")
    cold = Table("no_kv", [Column("turn"), Column("prompt_tokens", "prompt"), Column("total_s", "no-kv s", ".2f"),
                           Column("kv_total_s", "with kv s", ".2f"), Column("speedup", "x", ".1f"),
                           Column("same_answer", "same answer", align="left")],
                 title="the same main-thread requests against a --no-kv server")
    for c in r["no_kv"]:
        cold.add(c["turn"], c["prompt_tokens"], c["total_s"], c["kv_total_s"], c["speedup"],
                 "yes" if c["same_answer"] else "NO")
    t = r["totals"]

    def text(out):
        print = functools.partial(builtins.print, file=out)
        print()
        print(table.text())
        if r["no_kv"]:
            print()
            print(cold.text())
        print()
        print(f"{t['requests']} requests, {t['prompt_tokens']} prompt tokens: {t['reused']} reused, {t['computed']}"
              f" computed")
        if t["reuse_after_first"] is not None:
            print(f"reuse after each thread's first request: at least {t['reuse_after_first']:.1%} of the prompt,"
                  f" {t['reuse_of_reusable']:.1%} of what its previous request and answer held")
        if t["time_over_work"] is not None:
            print(f"a reusing request's time: at most {t['time_over_work']:.2f}x the time of the tokens it computed"
                  f" and generated")
        print(f"written: {format_bytes(t['written_bytes'])} (kept states and dumps), {t['written_over_full']:.2%} of"
              f" full records of the computed tokens ({format_bytes(t['full_records_bytes'])}),"
              f" {t['written_over_kv']:.2f}x their KV")
        print(f"on DeepSeek-V4-Flash the same session writes {format_bytes(t['flash_written_bytes'])} of kept states"
              f" (heads of {format_bytes(t['flash_head_bytes'])}, blocks of 256 positions), against"
              f" {format_bytes(t['flash_full_records_bytes'])} of full records and"
              f" {format_bytes(t['flash_kv_of_computed'])} of KV for its computed tokens")

    result = dict(r, geometry=r["geometry"].to_config())
    _show(args, [table, cold], text, result)
    return 0


def _bench_model(args) -> str:
    from ds4f.api import ensure_synthetic

    return model_arg(args) or str(ensure_synthetic("bench", progress=True, announce=announce))


def _bench_console(args) -> int:
    from ds4f.api import open_checkpoint
    from ds4f.console.bench import bench_console

    for flag, value in (("--gen", args.gen), ("--preset", args.preset), ("--config", args.config),
                        ("--backend", args.backend)):
        if value is not None:
            raise Ds4fError(f"{flag}: bench console drives the console's own run of MODEL; "
                            f"{flag} is for bench engine and bench cache")
    model = _bench_model(args)
    open_checkpoint(model).close()   # a bad checkpoint is named here, not as a console error screen
    print(f"bench console: {model}, keys and refreshes timed while the console's run decodes", file=sys.stderr)
    r = bench_console(model)
    table = Table("console", [Column("metric", align="left"), Column("value"), Column("unit", align="left")])
    table.add(Label("key_latency_median_ms", "key to action, median"), _ms(r["key_latency_median_s"]), "ms")
    table.add(Label("key_latency_max_ms", "key to action, max"), _ms(r["key_latency_max_s"]), "ms")
    table.add(Label("keys", "keys"), r["keys"], "")
    table.add(Label("bytes_per_refresh", "bytes per refresh"), r["bytes_per_refresh"], "B")
    table.add(Label("refreshes", "refreshes"), r["refreshes"], "")
    table.add(Label("first_screen_bytes", "first screen"), r["first_screen_bytes"], "B")

    def text(out) -> None:
        print = functools.partial(builtins.print, file=out)
        print(f"terminal       {r['terminal']} · refresh every {r['refresh_s']:g} s")
        print(f"key to action  median {_fmt(_ms(r['key_latency_median_s']), '.1f', ' ms')} · "
              f"max {_fmt(_ms(r['key_latency_max_s']), '.1f', ' ms')} over {r['keys']} keys "
              f"({r['tokens_during_keys']} tokens decoded meanwhile)")
        if r["bytes_per_refresh"] is None:
            print("bytes/refresh  — (no pseudo-terminals here)")
        else:
            print(f"bytes/refresh  {r['bytes_per_refresh']:.0f} B over {r['refreshes']} refreshes of a live run · "
                  f"first screen {r['first_screen_bytes']} B")

    _show(args, [table], text, r)
    return 0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
