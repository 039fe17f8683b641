"""A server's figures as the attached dashboard's panels write them: the live sequences, the
queue, the latency percentiles, the prefix cache, the server's log lines. Plain text, no
Textual (the panels style it); the run panels' own text is figures.py's, from the Snapshot
the link rebuilds.
"""
from __future__ import annotations

import time

from .figures import DASH, fmt_seconds, fmt_size, model_name, runs_dir_text

SEQUENCE_MARK = {"waiting": "…", "prefill": "◐", "decode": "●"}
ENDPOINT_NAMES = {"/v1/chat/completions": "chat", "/v1/completions": "compl", "/v1/responses": "resp",
                  "/v1/messages": "msgs", "/runs": "run", "/run": "run", "completions": "compl",
                  "responses": "resp", "messages": "msgs", "runs": "run"}
BAR_CELLS = 10


def endpoint_name(endpoint) -> str:
    """'/v1/chat/completions' -> 'chat' (a name the server already shortened stays)."""
    if not endpoint:
        return "?"
    e = str(endpoint)
    return ENDPOINT_NAMES.get(e, e.rstrip("/").rsplit("/", 1)[-1] or e)


def bar(fraction: float | None, cells: int = BAR_CELLS) -> str:
    """'▕████▍     ▏': a fraction in block characters."""
    f = 0.0 if fraction is None else max(0.0, min(1.0, float(fraction)))
    eighths = round(f * cells * 8)
    full, part = divmod(eighths, 8)
    body = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part and full < cells else "")
    return "▕" + body.ljust(cells) + "▏"


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def prompt_text(seq: dict) -> str:
    """'prompt 600 (512 reused)': the prompt's tokens, and those the prefix cache gave."""
    total = int(_num(seq.get("prompt_tokens")) or 0)
    reused = int(_num(seq.get("prompt_tokens_reused")) or 0)
    return f"prompt {total} ({reused} reused)" if reused else f"prompt {total}"


def sequence_items(seq: dict, now: float | None = None) -> list[tuple[str, int]]:
    """One sequence's items in order, each (text, rank): rank 0 always shows; where the line is
    too narrow, the highest rank gives way first (the last of equals first)."""
    state = str(seq.get("state") or "?")
    address, _, agent = str(seq.get("client") or "-").partition(" ")
    items: list[tuple[str, int]] = [(f"{SEQUENCE_MARK.get(state, '?')} {endpoint_name(seq.get('endpoint')):<5}", 0),
                                    (address[:39], 0)]
    if agent:
        items.append((agent[:24], 3))
    if state == "waiting":
        started = _num(seq.get("started_at"))
        waited = (time.time() if now is None else now) - started if started else None
        items.append((f"waiting {fmt_seconds(waited)}" if waited is not None and waited >= 0 else "waiting", 0))
        return items
    items.append((prompt_text(seq), 0))
    if state == "prefill":
        total = _num(seq.get("prompt_tokens")) or 0
        done = _num(seq.get("prompt_tokens_done")) or 0
        frac = done / total if total else None
        items.append((f"prefill {bar(frac)} {0 if frac is None else frac * 100:.0f}%", 0))
        eta = _num(seq.get("prefill_eta_s"))
        items.append((f"ETA {fmt_seconds(eta)}", 1))
        return items
    tokens = int(_num(seq.get("tokens")) or 0)
    limit = _num(seq.get("max_tokens"))
    items.append((f"{tokens}/{int(limit)} tok" if limit else f"{tokens} tok", 0))
    rate = _num(seq.get("decode_tok_s"))
    items.append((f"{rate:.2f} tok/s" if rate is not None else f"{DASH} tok/s", 1))
    acc = _num(seq.get("spec_acceptance"))
    if acc is not None:
        items.append((f"spec {acc:.0%}", 2))
    share = _num(seq.get("batch_share"))
    if share is not None:
        items.append((f"share {share:.0%}", 2))
    return items


def fit_items(items: list[tuple[str, int]], width: int = 0, sep: str = "  ") -> str:
    """The items on one line of `width` (0: no limit): the highest-ranked left out first (the last
    of equals first) until it fits, then the line cut with '…'."""
    chosen = list(items)
    line = sep.join(t for t, _ in chosen)
    while width and len(line) > width:
        ranks = [rank for _, rank in chosen]
        top = max(ranks)
        if top == 0:
            break
        del chosen[len(ranks) - 1 - ranks[::-1].index(top)]
        line = sep.join(t for t, _ in chosen)
    if width and len(line) > width:
        line = line[:max(1, width - 1)] + "…"
    return line


def sequence_line(seq: dict, width: int = 0, now: float | None = None) -> str:
    return fit_items(sequence_items(seq, now), width)


def queue_text(status: dict | None, sequences=()) -> str:
    """'queue: 2 waiting of 8 places · the oldest 3.1 s' (or empty)."""
    q = (status or {}).get("queue")
    if not isinstance(q, dict):
        return "queue —"
    waiting = int(_num(q.get("waiting")) or 0)
    capacity = q.get("capacity")
    if not waiting:
        return f"queue empty · {capacity} places" if capacity is not None else "queue empty"
    oldest = max((_num(t.get("waited_s")) or 0.0 for t in q.get("queued") or () if isinstance(t, dict)), default=None)
    text = f"queue: {waiting} waiting of {capacity} places" if capacity is not None else f"queue: {waiting} waiting"
    if oldest is not None:
        text += f" · the oldest {fmt_seconds(oldest)}"
    return text


def batch_text(status: dict | None) -> str:
    """'3/4 sequences · 2.41 tok/s in all · capped at 2: union_cost'."""
    b = (status or {}).get("batch")
    if not isinstance(b, dict):
        return ""
    parts = [f"{b.get('active', 0)}/{b.get('parallel', '?')} sequences"]
    rate = _num(b.get("tokens_per_s"))
    if rate is not None:
        parts.append(f"{rate:.2f} tok/s in all")
    cap, parallel = b.get("cap"), b.get("parallel")
    if isinstance(cap, int) and isinstance(parallel, int) and cap < parallel:
        parts.append(f"capped at {cap}: {b.get('cap_reason') or '?'}")
    return " · ".join(parts)


def _secs(v) -> str:
    n = _num(v)
    return fmt_seconds(n)


def latency_lines(latency: dict | None) -> list[str]:
    """'TTFT p50 810 ms · p90 1.2 s · p99 2.0 s', the same for the inter-token latency, then the
    prefill's share of the wait for a first token and the requests counted."""
    if not latency or (not latency.get("requests") and latency.get("ttft_p50") is None):
        return ["no request in the last hour"]
    lines = []
    for name, key in (("TTFT", "ttft"), ("ITL ", "itl")):
        lines.append(f"{name} p50 {_secs(latency.get(key + '_p50'))} · p90 {_secs(latency.get(key + '_p90'))} · "
                     f"p99 {_secs(latency.get(key + '_p99'))}")
    share = _num(latency.get("prefill_share_of_waiting"))
    requests = latency.get("requests")
    tail = [f"prefill {share:.0%} of the wait for a first token" if share is not None else "prefill share —"]
    if requests is not None:
        tail.append(f"{requests} requests")
    lines.append(" · ".join(tail))
    return lines


def prefix_lines(cache: dict | None) -> list[str]:
    """The prefix cache: what it keeps where, its hits, its evictions and writes."""
    if not isinstance(cache, dict):
        return ["none yet, or off"]
    hits, misses = int(_num(cache.get("hits")) or 0), int(_num(cache.get("misses")) or 0)
    rate = f" ({hits / (hits + misses):.0%})" if hits + misses else ""
    lines = [f"{cache.get('states', 0)} states · RAM {fmt_size(_num(cache.get('ram_bytes')) or 0)} · "
             f"disk {fmt_size(_num(cache.get('disk_bytes')) or 0)}",
             f"hits {hits} · misses {misses}{rate} · {int(_num(cache.get('tokens_reused')) or 0):,} tokens reused"]
    written = _num(cache.get("written_today"))
    budget = _num(cache.get("write_budget"))
    third = [f"evictions {cache.get('evictions', 0)}"]
    if written is not None:
        third.append(f"written today {fmt_size(written)}" + (f" of {fmt_size(budget)}" if budget else ""))
    if cache.get("rejected_files"):
        third.append(f"{cache['rejected_files']} files rejected")
    lines.append(" · ".join(third))
    return lines


def runs_dir_line(status: dict | None) -> str:
    """The server's runs directory against [runs] budget (GET /status runs_dir)."""
    return runs_dir_text((status or {}).get("runs_dir")) or "runs dir —"


def kv_dir_line(status: dict | None) -> str:
    """The prefix cache's directory against [kv] budget (GET /status kv): 'kv dir 1.2 GiB of 20 GiB
    (6%)'; '' when it is off or not known."""
    kv = (status or {}).get("kv")
    if not isinstance(kv, dict) or not isinstance(kv.get("budget_bytes"), (int, float)) or not kv["budget_bytes"]:
        return ""
    used = kv.get("used_bytes") if isinstance(kv.get("used_bytes"), (int, float)) else 0
    return f"kv dir {fmt_size(used)} of {fmt_size(kv['budget_bytes'])} ({used / kv['budget_bytes']:.0%})"


def server_title(view) -> str:
    """'host:port · model · ds4f 0.1.0' for the status line."""
    hello = view.hello or {}
    status = view.status or {}
    model = hello.get("model") or (status.get("model") or {}).get("id") or ""
    parts = [view.address.short]
    if model:
        parts.append(model_name(str(model)))
    if hello.get("version"):
        parts.append(f"ds4f {hello['version']}")
    return " · ".join(parts)


def settings_text(settings: dict) -> str:
    """'next: laptop · avx2 · k2 io4' (what the next requests get)."""
    preset = settings.get("preset") or "?"
    if settings.get("pending_preset"):
        preset = f"{preset}→{settings['pending_preset']} when idle"
    parts = [preset, settings.get("backend") or "?"]
    k, io = settings.get("kernel_threads"), settings.get("io_threads")
    if k is not None or io is not None:
        parts.append(f"k{k if k is not None else '?'} io{io if io is not None else '?'}")
    return "next: " + " · ".join(str(p) for p in parts)


def log_text(entry) -> str:
    """An event-log line: '10:15:03 run 20260301-…-3fa2: message (who)'."""
    text = f"{entry.clock()} "
    if entry.run_id and entry.run_id not in entry.message:
        text += f"{entry.run_id}: "
    text += entry.message
    if entry.who:
        text += f" ({entry.who})"
    return text
