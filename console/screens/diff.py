"""The diff of two runs' state dumps: the verdict, where routing first differs, each layer's
largest relative error against the tolerance, and the two runs side by side."""
from __future__ import annotations

import math
from typing import Callable

from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Static

from ds4f.api import LOW_BIT_TOLERANCE, Ds4fError, RunRecord, StateDiff

from ..core import figures as F
from ..core.bindings import DIFF_BINDINGS
from ..widgets.common import KeyBar, Panel, Plot, SizeNotice

VERDICT = {
    "identical": ("IDENTICAL", "fine", "byte-for-byte the same state dump"),
    "low-bit": ("LOW-BIT", "careful", "same routing; states within tolerance"),
    "routing": ("ROUTING DIVERGES", "warning", "expert choices differ from there on"),
    "drift": ("DRIFT", "critical", "same routing; states beyond tolerance"),
}
LOG_FLOOR = -12.0


def log_error(v: float) -> float:
    """log10 of a relative error, shifted so 1e-12 (or exact) is 0 and 1 is 12."""
    if not v or v <= 0 or not math.isfinite(v):
        return 0.0 if not v or v <= 0 else -LOG_FLOOR
    return max(0.0, math.log10(v) - LOG_FLOOR)


class DiffScreen(Screen):
    """Two runs' state dumps compared: the class, where routing first differs, per-layer error."""

    BINDINGS = DIFF_BINDINGS

    def __init__(self, a: RunRecord, b: RunRecord, diff: StateDiff | None = None,
                 diff_fn: Callable[[str, str], StateDiff] | None = None) -> None:
        """Show `diff` of runs a and b, or compute it with diff_fn(a's state dump, b's) in a thread."""
        super().__init__()
        self.a, self.b = a, b
        self.diff = diff
        self.diff_fn = diff_fn

    def compose(self) -> ComposeResult:
        yield Static(id="diff-title")
        yield Static(id="verdict")
        with Horizontal(id="diff-body"):
            with Panel("per-layer max relative error", id="p-layers"):
                yield Static(id="layers-axis-top")
                yield Plot(id="layers-plot", max_col_width=3, mode="fit", above_is_bad=True)
                yield Static(id="layers-axis")
            with Panel("runs side by side", id="p-sides"):
                yield Static(id="sides")
        yield KeyBar()
        yield SizeNotice()

    def on_mount(self) -> None:
        self._title()
        self._sides()
        if self.diff is not None:
            self.show_diff(self.diff)
        else:
            self.query_one("#verdict", Static).update(Text("comparing the state dumps…", style="italic"))
            self._compute()

    @work(thread=True, exclusive=True, exit_on_error=False, group="diff")
    def _compute(self) -> None:
        try:
            for r in (self.a, self.b):
                if not r.state_path:
                    raise Ds4fError(f"run {r.run_id} has no state dump ({r.state})")
            d = self.diff_fn(self.a.state_path, self.b.state_path)
        except Ds4fError as exc:
            self.app.call_from_thread(self.show_error, str(exc))
        except Exception as exc:  # a bug in the diff must not take the console down
            self.app.call_from_thread(self.show_error, f"internal error: {type(exc).__name__}: {exc}")
        else:
            self.app.call_from_thread(self.show_diff, d)

    def _title(self) -> None:
        t = Text()
        t.append(" diff ", "reverse bold")
        t.append(f" A {self.a.run_id} ({self.a.backend or '?'})  vs  B {self.b.run_id} ({self.b.backend or '?'})")
        self.query_one("#diff-title", Static).update(t)

    def show_error(self, message: str) -> None:
        v = self.query_one("#verdict", Static)
        v.update(Text(f"cannot compare: {message}", style="bold red"))
        v.set_class(True, "-critical")

    def show_diff(self, d) -> None:
        self.diff = d
        word, level, meaning = VERDICT.get(d.cls, (d.cls.upper(), "warning", ""))
        t = Text()
        t.append(f" {word} ", "bold reverse")
        if d.cls == "routing":
            t.append(f" at token {d.token}, layer {d.layer}", "bold")
        t.append(f": {meaning}\n")
        tol = float(LOW_BIT_TOLERANCE)  # the engine's bound between low-bit and drift
        rels = [x for x in d.layer_max_rel if x is not None and math.isfinite(x)]
        if rels and max(rels) > 0:
            worst = max(range(len(d.layer_max_rel)), key=lambda i: d.layer_max_rel[i] or 0)
            t.append(f"max rel error {max(rels):.1e} at layer {worst} (tolerance {tol:g})"
                     f" · {d.n_tokens} tokens\n")
        else:
            t.append(f"no difference in any layer · {getattr(d, 'n_tokens', '?')} tokens\n")
        if getattr(d, "attention_token", None) is not None:
            t.append(f"attention first diverges at token {d.attention_token}, layer {d.attention_layer}\n")
        if getattr(d, "state_token", None) is not None:
            t.append(f"exact states first differ at token {d.state_token}, layer {d.state_layer}\n")
        modes = getattr(d, "modes", ("full", "full"))
        if "compact" in modes:
            t.append(f"dumps {modes[0]} / {modes[1]}: compared as compact records (digests and sketches)\n", "dim")
        same = d.sha_a == d.sha_b
        t.append(f"sha256 A {d.sha_a[:12]} B {d.sha_b[:12]} ")
        t.append("equal" if same else "differ", "bold")
        v = self.query_one("#verdict", Static)
        v.update(t)
        for name in VERDICT.values():
            v.set_class(name[1] == level, f"-{name[1]}")
        n = len(d.layer_max_rel)
        self.query_one("#layers-plot", Plot).set_data([log_error(x) for x in d.layer_max_rel],
                                                       floor=log_error(tol), maximum=-LOG_FLOOR,
                                                       marker=d.layer if d.cls == "routing" else None)
        top = Text()
        top.append("log 1e-12…1 ", "dim")
        top.append(f"─ tol {tol:g}")
        self.query_one("#layers-axis-top", Static).update(top)
        axis = Text(f"layer 0…{n - 1}" if n else "no layers", style="dim")
        if d.cls == "routing":
            axis.append(f" · ▲ routing L{d.layer}", "bold")
        if getattr(d, "detail", ""):
            t.append(f"\n{d.detail}", "italic")
            v.update(t)
        self.query_one("#layers-axis", Static).update(axis)
        self.query_one("#p-layers", Panel).set_level(level, word.lower())

    def _sides(self) -> None:
        a, b = self.a, self.b
        table = Table(box=None, show_header=True, pad_edge=False, expand=True, header_style="bold")
        table.add_column("", style="dim", no_wrap=True)
        table.add_column("A", overflow="fold")
        table.add_column("B", overflow="fold")

        def row(label: str, va, vb) -> None:
            sa, sb = str(va), str(vb)
            style = "bold" if sa != sb else ""
            table.add_row(label, Text(sa, style=style), Text(sb, style=style))

        row("run", a.run_id[-11:], b.run_id[-11:])
        row("when", F.fmt_when(a.started_at), F.fmt_when(b.started_at))
        row("kernels", "→".join(a.backends) or F.DASH, "→".join(b.backends) or F.DASH)
        row("preset", a.preset, b.preset)
        row("threads", f"k{a.config.get('kernel_threads', '?')} io{a.config.get('io_threads', '?')}",
            f"k{b.config.get('kernel_threads', '?')} io{b.config.get('io_threads', '?')}")
        row("tokens", a.tokens_done, b.tokens_done)
        row("s/token", F.fmt_s_per_token(a.s_per_token), F.fmt_s_per_token(b.s_per_token))
        row("own hits", F.own_hit_rate_text(a.summary), F.own_hit_rate_text(b.summary))
        row("GB/s", F.fmt_gbps(a.summary.get("eff_read_gbps")), F.fmt_gbps(b.summary.get("eff_read_gbps")))
        row("dump", a.config.get("dump") or "full", b.config.get("dump") or "full")
        row("sha256", (a.state_sha256 or F.DASH)[:12], (b.state_sha256 or F.DASH)[:12])
        self.query_one("#sides", Static).update(table)

    def action_back(self) -> None:
        if self.is_active:   # not gone (a second key of a burst), nor under help or the palette
            self.dismiss()

    def action_swap(self) -> None:
        if self.is_active:   # switch_screen replaces the top screen, whichever it is
            self.app.switch_screen(DiffScreen(self.b, self.a, diff_fn=self.diff_fn))
