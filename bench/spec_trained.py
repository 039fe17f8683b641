"""`ds4f bench spec --trained [MODEL]`: speculation with a trained MTP layer on the conversations
it was trained for, against plain decoding.

MODEL is a checkpoint whose MTP layer was trained beside it and whose script.json holds its
conversations (tests/fixtures/toolcall of a source checkout: tools/make_tool_model.py and
tools/make_mtp_layer.py). Each conversation's first turn (system prompt, tools, the user's
messages) runs greedy to its end (EOS) with spec off, then with each mode, each mode's runs on
one engine of its own kept between them (as the console and the server keep theirs: auto starts
each conversation from what the ones before measured, from nothing at the first); each mode's figures
are over all conversations: decode tokens per second (the generated tokens' seconds, the prompt
apart) and its ratio to off's, the acceptance the drafts really had, tokens per round, rounds by
k, and whether every conversation's tokens are off's (they must be). A tiny model's step is
mostly fixed costs, so its ratios show what kept drafts buy where verifying a row costs little;
the acceptance is what a trained MTP layer gives.
"""
from __future__ import annotations

import json
from pathlib import Path

from ds4f.errors import Ds4fError
from ds4f.bench.engine import Log, _quiet, bench_scratch_dir

MODES = (1, 2, 3, "auto")
GEN = 160          # more than any of the fixture's answers: each ends at EOS


def default_trained_model() -> Path:
    """tests/fixtures/toolcall of a source checkout."""
    return Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "toolcall"


def conversations(model: Path) -> list[tuple[str, dict]]:
    """(name, RunConfig fields) of each case's first turn in model/script.json."""
    path = model / "script.json"
    try:
        script = json.loads(path.read_text(encoding="utf-8"))
        cases = [(c["name"], {"messages": tuple([{"role": "system", "content": script["system"]}] + c["messages"]),
                              "thinking": bool(c.get("thinking")), "tools": tuple(script["tools"])})
                 for c in script["cases"]]
    except FileNotFoundError:
        raise Ds4fError(f"{path}: not found: bench spec --trained needs a trained checkpoint with its"
                        " conversations (tests/fixtures/toolcall of a source checkout)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Ds4fError(f"{path}: not a script of conversations (system, tools, cases): {e}") from None
    if not cases:
        raise Ds4fError(f"{path}: no cases")
    return cases


def _decode(run) -> tuple[list[int], float]:
    """A done run's generated tokens and the seconds of its decode steps (its prompt's apart)."""
    r = run.report
    return list(r["generated"]), sum(t["seconds"] for t in r["tokens"] if not t.get("prefill"))


def bench_spec_trained(model: str | Path | None = None, modes=MODES, *, log: Log | None = None,
                       limit: int | None = None) -> dict:
    """{"records": one per mode (off first): tokens, seconds, tokens_per_s, speedup over off,
    acceptance, tokens_per_round, by_k, same}; limit: the first `limit` conversations only."""
    from ds4f.runs.host import EngineHost

    log = log or _quiet
    model = Path(model) if model else default_trained_model()
    cases = conversations(model)[:limit]
    out_dir = bench_scratch_dir()
    log(f"bench spec --trained: {model} · {len(cases)} conversations, greedy to EOS")
    records, plain = [], {}
    for mode in ("off", *modes):
        host = EngineHost()
        try:
            records.append(_mode(host, model, cases, mode, plain, out_dir, records[0] if records else None))
        finally:
            host.close()
        rec = records[-1]
        log(f"  spec {mode}: {rec['tokens_per_s']:.1f} tok/s ({rec['speedup']:.2f}x off), acceptance "
            + ("—" if rec["acceptance"] is None else f"{rec['acceptance']:.0%}") + ("" if rec["same"] else " · TOKENS DIFFER"))
    return {"records": records, "model": str(model), "conversations": len(cases)}


def _mode(host, model: Path, cases, mode, plain: dict, out_dir: Path, off: dict | None) -> dict:
    """Every conversation with spec `mode` on the host's engine: the mode's record (off's tokens
    kept in `plain` when mode is off)."""
    from ds4f.runs.config import RunConfig
    from ds4f.runs.run import start_run

    tokens = drafted = accepted = rounds = round_tokens = 0
    seconds, by_k, same = 0.0, {}, True
    for name, fields in cases:
        run = start_run(RunConfig(model=str(model), **fields, gen=GEN, stop_at_eos=True, spec=mode,
                                  probe_floor=False, reuse_prefix=False,
                                  dump_path=str(out_dir / f"spec-trained-{name}.bin")), engines=host)
        if not run.wait(600) or run.state != "done":
            raise Ds4fError(f"bench spec --trained: {name} with spec {mode}: {run.state}: {run.error}")
        ids, s = _decode(run)
        tokens, seconds = tokens + len(ids), seconds + s
        if mode == "off":
            plain[name] = ids
        same = same and ids == plain[name]
        sp = run.report["summary"].get("spec") or {}
        drafted, accepted = drafted + sp.get("drafted", 0), accepted + sp.get("accepted", 0)
        rounds, round_tokens = rounds + sp.get("rounds", 0), round_tokens + sp.get("tokens", 0)
        for k, n in (sp.get("by_k") or {}).items():
            by_k[int(k)] = by_k.get(int(k), 0) + n
    rec = {"spec": str(mode), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
           "acceptance": accepted / drafted if drafted else None,
           "tokens_per_round": round_tokens / rounds if rounds else None, "by_k": by_k, "same": same}
    rec["speedup"] = rec["tokens_per_s"] / off["tokens_per_s"] if off else 1.0
    return rec
