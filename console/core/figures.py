"""Pure helpers that turn a Snapshot or a run record into the strings and series the panels draw.

No Textual here: these are plain functions, tested directly.
"""
from __future__ import annotations

import textwrap
import time
from dataclasses import dataclass

from ds4f.api import LIVE_STATES, RunRecord, Snapshot, TokenRecord

DASH = "—"
STATE_MARK = {"starting": "◌", "running": "●", "done": "✓", "cancelled": "■", "failed": "✗"}


def state_mark(state: str) -> str:
    """A run's state as its one-character mark (? for a state the console does not know)."""
    return STATE_MARK.get(state, "?")


def model_name(path: str) -> str:
    """The checkpoint's directory name, which is what tells models apart in a status line."""
    if not path:
        return "(no model)"
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return name or path


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return DASH
    if s < 0.001:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def fmt_s_per_token(s: float | None) -> str:
    """The big number: seconds per token with three significant figures."""
    if s is None:
        return DASH
    if s >= 100:
        return f"{s:.0f}"
    if s >= 10:
        return f"{s:.1f}"
    if s >= 1:
        return f"{s:.2f}"
    if s >= 0.01:
        return f"{s:.3f}"
    return f"{s:.1e}"


def fmt_gbps(v: float | None) -> str:
    if v is None:
        return DASH
    if v >= 10:
        return f"{v:.1f}"
    if v >= 0.1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def fmt_pct(v: float | None, digits: int = 1) -> str:
    return DASH if v is None else f"{v * 100:.{digits}f}%"


def fmt_size(n: int | float | None) -> str:
    """A size in binary units, short for tight panels: '6.2 GiB', '22.0 GiB', '101 GiB', '512 MiB'."""
    if n is None:
        return DASH
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1000 or unit == "TiB":
            break
        v /= 1024
    if unit == "B":
        return f"{v:.0f} B"
    return f"{v:.0f} {unit}" if abs(v) >= 100 else f"{v:.1f} {unit}"


def fmt_pts(pp: float | None) -> str:
    """Percentage points: '14.0 pts'."""
    return DASH if pp is None else f"{pp:.1f} pts"


def fmt_age(s: float | None) -> str:
    """How old a measurement is: 'just now', '40 s old', '3 min old', '5 h old', '2 d old'."""
    if s is None:
        return "age unknown"
    s = max(0.0, s)
    if s < 5:
        return "just now"
    if s < 90:
        return f"{s:.0f} s old"
    if s < 90 * 60:
        return f"{s / 60:.0f} min old"
    if s < 36 * 3600:
        return f"{s / 3600:.0f} h old"
    return f"{s / 86400:.0f} d old"


def fmt_when(ts: float) -> str:
    """Local date and time of a run, compact: '11-30 01:55'."""
    return time.strftime("%m-%d %H:%M", time.localtime(ts))


def short_path(path: str, width: int = 40) -> str:
    if len(path) <= width:
        return path
    return "…" + path[-(width - 1):]


def token_seconds(tokens: tuple[TokenRecord, ...]) -> list[float]:
    return [t.seconds for t in tokens]


def token_gbps(tokens: tuple[TokenRecord, ...]) -> list[float]:
    return [(t.bytes_read / 1e9) / t.seconds if t.seconds > 0 else 0.0 for t in tokens]


def token_policy_hit_rates(tokens: tuple[TokenRecord, ...]) -> list[float]:
    """Per token, the policy's own hit rate (hits on prefetched experts left out): the yardstick
    of the cache panel's figure beside Belady's (0 for a token without requests)."""
    return [t.policy_hit_rate or 0.0 for t in tokens]


def layer_policy_hit_rates(snap: Snapshot) -> list[float | None]:
    """Per layer, the policy's own hit rate so far (None: no requests yet)."""
    return snap.layer_policy_hit_rates()


def own_hit_rate_text(summary: dict) -> str:
    """A report's policy's own hit rate (the yardstick beside Belady's). A report from before it
    was kept has the hit rate alone: the same without prefetch, else said to include it."""
    own = summary.get("policy_hit_rate")
    if own is not None:
        return fmt_pct(own)
    rate = summary.get("hit_rate")
    if rate is None:
        return DASH
    return f"{fmt_pct(rate)} with prefetch" if summary.get("prefetch") else fmt_pct(rate)


@dataclass(frozen=True)
class Switch:
    token: int          # index of the first token that ran with the new setting
    what: str           # "backend", "kernel threads", "io threads"
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.what} {self.before}→{self.after} at token {self.token}"

    @property
    def short(self) -> str:
        """For a narrow panel: 'avx2→scalar @14', 'k16→8 @22', 'io8→9 @30' (@: the token it landed at)."""
        unit = {"kernel threads": "k", "io threads": "io"}.get(self.what, "")
        return f"{unit}{self.before}→{self.after} @{self.token}"


def run_switches(snap: Snapshot) -> list[Switch]:
    """Every live switch of the run, from its settings at the start and at each change
    (Snapshot.switches: the whole run, where Snapshot.tokens holds only the recent tokens)."""
    out: list[Switch] = []
    for (_, b0, k0, i0), (token, b1, k1, i1) in zip(snap.switches, snap.switches[1:]):
        if b1 != b0:
            out.append(Switch(token, "backend", b0, b1))
        if k1 != k0:
            out.append(Switch(token, "kernel threads", str(k0), str(k1)))
        if i1 != i0:
            out.append(Switch(token, "io threads", str(i0), str(i1)))
    return out


def progress_text(snap: Snapshot) -> str:
    return f"{snap.tokens_done}/{snap.steps} tokens"


def pack_lines(groups: list[list[str]], width: int = 0, height: int = 0) -> list[str]:
    """Items joined by ' · ' into lines: each group on a line of its own (its items wrapped at
    ' · ' where the group is wider than `width`), or, when that takes more than `height` lines,
    every item packed as tightly as `width` allows. 0: not known (no limit)."""

    def lay(groups: list[list[str]]) -> list[str]:
        out: list[str] = []
        for items in groups:
            line = ""
            for item in items:
                if line and width and len(line) + 3 + len(item) > width:
                    out.append(line)
                    line = item
                else:
                    line = f"{line} · {item}" if line else item
            if line:
                out.append(line)
        return out

    lines = lay(groups)
    if height and len(lines) > height:
        lines = lay([[item for items in groups for item in items]])
    return lines


def clip_text(text: str, width: int = 0, lines: int = 0) -> list[str]:
    """`text` wrapped at `width` into at most `lines` lines, the last ending in '…' when some
    is left out (0: not known, no limit)."""
    out = textwrap.wrap(text, width) if width else [text]
    if lines and len(out) > lines:
        out = out[:lines]
        last = out[-1]
        out[-1] = (last[:width - 1] if width and len(last) >= width else last).rstrip() + "…"
    return out


def prefill_items(snap: Snapshot) -> list[str]:
    """The prompt's layer-major prefill: how far, how fast, what it read per prompt token."""
    where = "prefill" if snap.phase == "prefill" else "prefilled"
    items = [f"{where} {snap.prefill_tokens}/{snap.prompt_tokens} prompt tokens (chunks of {snap.prefill_chunk})"]
    if snap.prefill_tokens_per_s is not None:
        items.append(f"{snap.prefill_tokens_per_s:.2f} tok/s")
    if snap.prefill_gb_per_token is not None:
        items.append(f"{snap.prefill_gb_per_token:.3f} GB/prompt token")
    return items


def run_lines(snap: Snapshot, width: int = 0, height: int = 0) -> tuple[list[str], list[str]]:
    """The run panel's lines under its state line, as (figures, error) in `width` x `height`
    (0: not known): ETA and elapsed time, the prompt tokens the prefix cache gave and those
    computed (when it gave some), the prompt's prefill (when it went layer by layer), the
    stall per token, the preset and the run id, then
    the error of a failed run in what room is left (one line at least; the event log has all
    of it). The figures take more than one to a line when the panel is short."""
    groups: list[list[str]] = [[f"ETA {fmt_seconds(snap.eta_s)}"] if snap.state in LIVE_STATES else []]
    groups[0].append(f"elapsed {fmt_seconds(snap.elapsed_s)}")
    if snap.prompt_tokens_reused:
        groups.append([f"prompt {snap.prompt_tokens_reused} reused · {snap.prompt_tokens - snap.prompt_tokens_reused}"
                       f" computed"])
    if snap.prefill_tokens:
        groups.append(prefill_items(snap))
    if snap.stall_s_per_token is not None:
        groups.append([f"stall {fmt_seconds(snap.stall_s_per_token)}/token"])
    groups.append([f"preset {snap.preset}", f"run {snap.run_id}"])
    need_error = 1 if snap.error else 0
    lines = pack_lines(groups, width, max(1, height - need_error) if height else 0)
    if not snap.error:
        return lines, []
    return lines, clip_text(snap.error, width, max(1, height - len(lines)) if height else 0)


def switches_text(switches: list[Switch], width: int = 0, lines: int = 0, keep: int = 12) -> str:
    """Every live switch of a run in short form, newest first, after '⇄ ': at most `keep`, and
    when `width` x `lines` (0: unknown) cannot hold them all, as many of the newest as fit and
    '+N earlier' for the rest. '' when the run has not switched."""
    if not switches:
        return ""
    items = [s.short for s in reversed(switches)]

    def packed(n: int) -> list[str] | None:
        """The first n items and a '+k earlier' note, wrapped at ' · ' into lines; None if too tall."""
        words = items[:n] + ([f"+{len(items) - n} earlier"] if n < len(items) else [])
        out = ["⇄ " + words[0]]
        for w in words[1:]:
            if width and len(out[-1]) + 3 + len(w) > width:
                out[-1] += " ·"
                out.append(w)
            else:
                out[-1] += " · " + w
        if width and any(len(line) > width for line in out) and n > 1:
            return None
        return out if not lines or len(out) <= lines or n == 1 else None

    for n in range(min(keep, len(items)), 0, -1):
        out = packed(n)
        if out is not None:
            return "\n".join(out)
    return "\n".join(packed(1) or [])


def record_tokens(r: RunRecord, known: int | None = None) -> int | None:
    """How many tokens a recorded run decoded. A done run's report says; a cancelled or failed
    run has no report, so: a count the engine put in its record's config or summary if any, else
    what this console saw of the run (`known`, for this session's runs), else None (unknown)."""
    if r.report:
        return r.tokens_done
    for where, keys in ((r.summary, ("tokens_done", "tokens")), (r.config, ("tokens_done",))):
        for key in keys:
            v = where.get(key) if isinstance(where, dict) else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return known


def record_tokens_text(r: RunRecord, known: int | None = None) -> str:
    """The history's token column: '16' for a done run; '412/1000' (decoded of planned) for a
    cancelled or failed one, '?/1000' when the record does not say."""
    n = record_tokens(r, known)
    if r.state == "done":
        return DASH if n is None else str(n)
    gen = r.gen
    return f"{'?' if n is None else n}/{gen if gen is not None else '?'}"


# -- text runs ------------------------------------------------------------------------------
ENDINGS = {"eos": "end of answer", "stop": "stop string", "length": "token limit"}
_CONTROL = {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {127: 0x2421}


def printable(text: str) -> str:
    """Model output made safe for a terminal: control characters as their visible pictures
    (U+2400..), tabs and newlines kept."""
    return text.translate(_CONTROL)


def sampling_text(sampling) -> str:
    """'greedy' or 'T 0.7 · top-p 0.95 · top-k 40 · min-p 0.05 · seed 3' (the settings that limit
    anything); `sampling`: SamplingParams, its dict (as a run's record has it), or None (greedy)."""
    if sampling is None or sampling == "greedy":
        return "greedy"
    d = sampling.to_dict() if hasattr(sampling, "to_dict") else dict(sampling)
    t, k = d.get("temperature", 1.0), d.get("top_k", 0)
    if t == 0 or k == 1:
        return "greedy"
    parts = [f"T {t:g}"]
    if d.get("top_p", 1.0) < 1:
        parts.append(f"top-p {d['top_p']:g}")
    if k:
        parts.append(f"top-k {k}")
    if d.get("min_p", 0.0) > 0:
        parts.append(f"min-p {d['min_p']:g}")
    parts.append(f"seed {d.get('seed', 0)}")
    return " · ".join(parts)


@dataclass(frozen=True)
class RecordText:
    """What a text run was asked and wrote, as its history record has it."""

    mode: str          # "chat", "chat, thinking" or "plain completion"
    prompt: str        # the text, or the chat's last user message
    turns: int         # user turns in the chat (1 for a completion)
    output: str        # the output text ("" when the record has none)
    settings: str      # 'chat · T 1 · seed 0 · end of answer · 9 + 57 tokens'


def record_text(r: RunRecord) -> RecordText | None:
    """A text run's prompt, output and settings from its record; None for a run on token ids."""
    c = r.config
    messages = c.get("messages") or []
    if c.get("text") is None and not messages:
        return None
    if messages:
        mode = "chat, thinking" if c.get("thinking") else "chat"
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        prompt, turns = str(users[-1].get("content", "")) if users else "", len(users)
    else:
        mode, prompt, turns = "plain completion", str(c["text"]), 1
    if r.state == "done":
        ending = ENDINGS.get(c.get("finish_reason"), c.get("finish_reason") or "done")
    else:
        ending = "stopped" if r.state == "cancelled" else r.state
    prompt_ids, generated = c.get("prompt"), c.get("generated_tokens")
    counts = (f"{len(prompt_ids) if isinstance(prompt_ids, list) else '?'} + "
              f"{generated if isinstance(generated, int) else '?'} tokens")
    settings = " · ".join((mode, sampling_text(c.get("sampling")), ending, counts))
    return RecordText(mode, prompt, turns, str(c.get("output_text") or ""), settings)


def spec_text(snap) -> str:
    """Speculative decoding in the speed panel: the mode and the last round's drafts, the
    acceptance and tokens per round so far, what the drafts cost."""
    if not snap.spec_rounds and snap.spec_draft_s == 0:
        return f"spec {snap.spec_mode} · no drafts yet"
    acc = DASH if snap.spec_acceptance is None else f"{snap.spec_acceptance:.0%}"
    tpr = DASH if snap.spec_tokens_per_round is None else f"{snap.spec_tokens_per_round:.2f}"
    return (f"spec {snap.spec_mode} · k={snap.spec_k}\n{acc} kept · {tpr} tok/round\n"
            f"drafts {snap.spec_draft_gb:.2f} GB · {fmt_seconds(snap.spec_draft_s)}")


def runs_dir_text(fig: dict | None) -> str:
    """The runs directory against [runs] budget (its runs' files and the history together):
    'runs dir 3.10 MiB of 18.6 GiB (0%) · 2 runs' files removed'; '' when not known."""
    if not isinstance(fig, dict) or not isinstance(fig.get("budget_bytes"), (int, float)) or not fig["budget_bytes"]:
        return ""
    used = fig.get("used_bytes") if isinstance(fig.get("used_bytes"), (int, float)) else 0
    out = f"runs dir {fmt_size(used)} of {fmt_size(fig['budget_bytes'])} ({used / fig['budget_bytes']:.0%})"
    removed, rows = fig.get("removed"), fig.get("history_rows_removed")
    if isinstance(removed, int) and removed:
        out += f" · {removed} old run{'s' if removed != 1 else ''}' files removed"
    if isinstance(rows, int) and rows:
        out += f" · {rows} old record{'s' if rows != 1 else ''} removed"
    return out
