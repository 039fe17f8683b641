"""The console's screens: dashboard, history, diff, help, token count, error and first-launch setup.

Screens render what the app hands them (a Snapshot, RunRecords, a StateDiff) and turn keys
into calls on the app; they hold no engine state of their own.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.css.query import NoMatches
from textual.containers import Container, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Digits, Input, Label, ProgressBar, Static

from ds4f.engine.errors import Ds4fError
from ds4f.engine.history import RunRecord, hash_groups
from ds4f.engine.snapshot import Snapshot, disk_occupancy

from . import figures as F
from .bindings import (DASHBOARD_BINDINGS, DIFF_BINDINGS, HISTORY_BINDINGS, SCREENS_FOR_HELP, keys_of)
from .controller import simd_scalar_pair
from .thresholds import (HIT_RATE, hit_rate_level, io_efficiency_level, rss_level, state_level)
from .widgets import EventLog, KeyBar, LayerStrip, Meter, Panel, Plot

if TYPE_CHECKING:
    from .app import Ds4fConsole

def model_name(path: str) -> str:
    """The checkpoint's directory name, which is what tells models apart in a status line."""
    if not path:
        return "(no model)"
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return name or path


STATE_MARK = {"starting": "◌", "running": "●", "done": "✓", "cancelled": "■", "failed": "✗"}


# ---------------------------------------------------------------------------------------------
# Dashboard
# ---------------------------------------------------------------------------------------------
class DashboardScreen(Screen):
    """Live panels over the current (or last) run's Snapshot, refreshed by the app's timer."""

    BINDINGS = DASHBOARD_BINDINGS
    app: "Ds4fConsole"

    def __init__(self) -> None:
        super().__init__(id="dashboard")
        self._log_run: str | None = None
        self._log_last: str | None = None
        self._notes_shown = 0
        self._failed_reported: set[str] = set()
        self.shown: Snapshot | None = None  # the snapshot the panels show (kept while frozen)
        self._shown_content: dict[str, object] = {}

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with Container(id="panels"):
            with Panel("s/token", id="p-speed"):
                with Horizontal(id="speed-top"):
                    yield Digits("-.---", id="speed-digits")
                    yield Static(id="speed-caption")
                yield Plot(id="speed-plot")
            with Panel("read GB/s · NVMe floor", id="p-io"):
                yield Static(id="io-text")
                yield Plot(id="io-plot")
            with Panel("cache hit rate", id="p-hits"):
                yield Static(id="hits-text")
                yield Plot(id="hits-plot")
                yield LayerStrip(id="hits-strip", bounds=HIT_RATE)
            with Container(id="memkern"):
                with Panel("memory", id="p-mem"):
                    yield Meter(id="rss-meter")
                    yield Static(id="mem-text")
                with Panel("kernels", id="p-kern"):
                    yield Static(id="kern-text")
            with Panel("run", id="p-run"):
                yield Static(id="run-state")
                yield Meter(id="run-meter")
                yield Static(id="run-text")
            with Panel("events", id="p-log"):
                yield EventLog(id="log")
        yield KeyBar()

    def on_mount(self) -> None:
        self.log_line("ds4f-console ready: r runs, ? lists every key, ctrl+p or : opens the command palette",
                      "dim")
        self.show(None)

    def on_screen_resume(self) -> None:
        self.app.tick(force=True)

    def _put(self, selector: str, content) -> None:
        """Update a Static only when its content changed: an unchanged panel costs the SSH link nothing."""
        if self._shown_content.get(selector) == content:
            return
        self._shown_content[selector] = content
        self.query_one(selector, Static).update(content)

    def _digits(self, value: str) -> None:
        digits = self.query_one("#speed-digits", Digits)
        if digits.value != value:
            digits.update(value)

    # -- the event log ----------------------------------------------------------------------
    def log_line(self, text: str, style: str = "") -> None:
        try:
            self.query_one("#log", EventLog).add(Text(text, style=style))
        except NoMatches:  # not composed yet, or already torn down
            pass

    def _sync_events(self, snap: Snapshot) -> None:
        if snap.run_id != self._log_run:
            self._log_run, self._log_last = snap.run_id, None
        events = snap.events
        start = 0
        if self._log_last is not None:
            for i in range(len(events) - 1, -1, -1):
                if events[i] == self._log_last:
                    start = i + 1
                    break
        for line in events[start:]:
            low = line.lower()
            style = "bold red" if ("error" in low or "traceback" in low) else ("yellow" if "->" in line else "")
            self.log_line(line, style)
        if events:
            self._log_last = events[-1]
        if snap.state == "failed" and snap.run_id not in self._failed_reported:
            self._failed_reported.add(snap.run_id)
            self.log_line(f"run {snap.run_id} failed: {snap.error or 'unknown error'}", "bold red")

    def sync_notes(self, notes: list[str]) -> None:
        for note in notes[self._notes_shown:]:
            self.log_line(f"· {note}", "italic")
        self._notes_shown = len(notes)

    # -- panels ----------------------------------------------------------------------------
    def show(self, snap: Snapshot | None) -> None:
        """Draw one Snapshot (None: no run yet this session)."""
        app = self.app
        ctl = getattr(app, "controller", None)
        self.shown = snap
        self._status(snap)
        if ctl is not None:
            self.sync_notes(ctl.notes)
        q = self.query_one
        if snap is None:
            self._digits("-.---")
            self._put("#speed-caption", Text("s/token\nno run yet\npress r", style="dim"))
            for pid in ("#speed-plot", "#io-plot", "#hits-plot"):
                q(pid, Plot).set_data([])
            self._put("#io-text", Text("effective read — GB/s\nfloor — · efficiency —", style="dim"))
            self._put("#hits-text", Text("hit rate —", style="dim"))
            q("#hits-strip", LayerStrip).set_rates([])
            q("#rss-meter", Meter).set(None, None, "RSS", F.DASH)
            self._put("#mem-text", Text("expert cache —", style="dim"))
            self._kernels(None)
            self._put("#run-state", Text("idle: r starts a run", style="dim"))
            q("#run-meter", Meter).set(0.0, None, "", "")
            self._put("#run-text", "")
            for pid in ("#p-io", "#p-hits", "#p-mem", "#p-run"):
                q(pid, Panel).set_level(None)
            return
        self._sync_events(snap)
        # s/token: big number (median over warm tokens) and the per-token history
        self._digits(F.fmt_s_per_token(snap.s_per_token).replace(F.DASH, "-.---"))
        cap = Text()
        cap.append("s/token", "bold")
        cap.append(f"\nmedian of {max(0, snap.tokens_done - 1)} warm")
        cap.append(f"\nfirst {F.fmt_seconds(snap.s_first_token)}")
        self._put("#speed-caption", cap)
        q("#speed-plot", Plot).set_data(F.token_seconds(snap.tokens))
        # read GB/s against the floor
        eff_level = io_efficiency_level(snap.io_efficiency)
        io = Text()
        io.append(f"{F.fmt_gbps(snap.eff_read_gbps)} GB/s", "bold")
        io.append(f" of {F.fmt_gbps(snap.floor_gbps)} floor" if snap.floor_gbps else " · floor not measured")
        busy, _depth = disk_occupancy(snap.tokens)
        if busy:  # the share of time a read was in flight: prefetch can use only the rest
            io.append(f" · busy {F.fmt_pct(busy, 0)}")
        # (the efficiency is in the panel's border, with its level)
        gbt = F.DASH if snap.gb_per_token is None else f"{snap.gb_per_token:.3g}"
        io.append(f"\n{gbt} GB/tok · {snap.io_mode}")
        if snap.read_latency_ms is not None:
            io.append(f" · {snap.read_latency_ms:.2g} ms/read")
        if snap.prefetch:
            pf = snap.prefetch
            io.append(f"\nprefetch {pf.get('useful', 0)}/{pf.get('issued', 0)} used · {pf.get('wasted', 0)} wasted", "dim")
        self._put("#io-text", io)
        q("#io-plot", Plot).set_data(F.token_gbps(snap.tokens), floor=snap.floor_gbps)
        q("#p-io", Panel).set_level(eff_level, f"eff {F.fmt_pct(snap.io_efficiency, 0)}"
                                    if snap.io_efficiency is not None else None)
        # hit rate
        hl = hit_rate_level(snap.hit_rate)
        hits, misses = sum(snap.layer_hits), sum(snap.layer_misses)
        ht = Text()
        ht.append(F.fmt_pct(snap.hit_rate), "bold")
        ht.append(f" · {hits:,} hits · {misses:,} misses")
        if snap.optimum_hit_rate is not None and hits + misses:  # Belady on this run's trace, when done
            # regret: points of hit rate the policy left to the optimum (hits prefetch made are not the policy's)
            own = (hits - snap.prefetch.get("useful", 0)) / (hits + misses)
            ht.append(f"\n{snap.policy} · Belady {F.fmt_pct(snap.optimum_hit_rate)}, "
                      f"regret {100 * (snap.optimum_hit_rate - own):.1f}", "dim")
        else:
            ht.append(f"\npolicy {snap.policy}", "dim")
        self._put("#hits-text", ht)
        q("#hits-plot", Plot).set_data(F.token_hit_rates(snap.tokens), maximum=1.0)
        q("#hits-strip", LayerStrip).set_rates(F.layer_hit_rates(snap))
        q("#p-hits", Panel).set_level(hl)
        # memory
        rl = rss_level(snap.rss_bytes, snap.rss_budget_bytes)
        frac = snap.rss_bytes / snap.rss_budget_bytes if snap.rss_budget_bytes else None
        q("#rss-meter", Meter).set(frac, rl, "RSS",
                                   f"{F.fmt_bytes(snap.rss_bytes)} / {F.fmt_bytes(snap.rss_budget_bytes)}"
                                   if snap.rss_budget_bytes else F.fmt_bytes(snap.rss_bytes))
        cache = (f"expert cache {F.fmt_bytes(snap.cache_bytes)} / {F.fmt_bytes(snap.budget_bytes)}"
                 if snap.budget_bytes else "expert cache —")
        self._put("#mem-text", cache)
        q("#p-mem", Panel).set_level(rl, F.fmt_pct(frac, 0) if frac is not None else None)
        # kernels and the run
        self._kernels(snap)
        sl = state_level(snap.state)
        st = Text()
        st.append(f"{STATE_MARK.get(snap.state, '?')} {snap.state}", "bold")
        st.append(f"  {F.progress_text(snap)}")
        self._put("#run-state", st)
        q("#run-meter", Meter).set(snap.tokens_done / snap.gen if snap.gen else 0.0,
                                   "critical" if snap.state == "failed" else None, "", f"{snap.tokens_done}/{snap.gen}")
        rt = Text()
        if snap.state in ("starting", "running"):
            rt.append(f"ETA {F.fmt_seconds(snap.eta_s)} · ")
        rt.append(f"elapsed {F.fmt_seconds(snap.elapsed_s)}")
        if snap.stall_s_per_token is not None:
            rt.append(f"\nstall {F.fmt_seconds(snap.stall_s_per_token)}/token")
        rt.append(f"\npreset {snap.preset} · run {snap.run_id}")
        if snap.error:
            rt.append(f"\n{snap.error}", "bold red")
        self._put("#run-text", rt)
        q("#p-run", Panel).set_level(sl if snap.state in ("failed", "cancelled") else None, snap.state)

    def _kernels(self, snap: Snapshot | None) -> None:
        ctl = self.app.controller
        kt = Text()
        if snap is None:
            kt.append(ctl.next_backend() if ctl else F.DASH, "bold")
            if ctl:
                kt.append(f" · {ctl.effective_kernel_threads()} kernel · {ctl.effective_io_threads()} I/O threads")
            kt.append("\nno run yet", "dim")
        else:
            kt.append(snap.backend, "bold")
            kt.append(f" · {snap.kernel_threads} kernel · {snap.io_threads} I/O threads")
            sw = F.switches(snap.tokens)
            if sw:
                last = sw[-1]
                kt.append(f"\n⇄ {last}", "bold")
            else:
                kt.append("\nno switch this run", "dim")
        self._put("#kern-text", kt)

    def _status(self, snap: Snapshot | None) -> None:
        app = self.app
        ctl = app.controller
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(" ds4f ", "reverse bold")
        if ctl is not None:
            t.append(f" {model_name(ctl.model)} ", "bold")
            t.append(f" next: {ctl.preset} · {ctl.gen} tok · {ctl.next_backend()} · "
                     f"k{ctl.effective_kernel_threads()} io{ctl.effective_io_threads()}")
        if snap is not None:
            t.append(f"  {STATE_MARK.get(snap.state, '?')} {snap.state}", "bold")
        t.append(f"  ⟳{app.refresh_s:g}s")
        if app.frozen:
            t.append(" FROZEN", "reverse bold")
        self._put("#status", t)

    # -- actions: the app does the work ----------------------------------------------------
    def action_run(self) -> None:
        self.app.start_run()

    def action_stop(self) -> None:
        self.app.stop_run()

    def action_cycle_preset(self) -> None:
        self.app.settings_action(lambda c: c.cycle_preset())

    def action_io_threads(self, delta: int) -> None:
        self.app.settings_action(lambda c: c.adjust_io_threads(delta))

    def action_kernel_threads(self, delta: int) -> None:
        self.app.settings_action(lambda c: c.adjust_kernel_threads(delta))

    def action_toggle_simd(self) -> None:
        self.app.settings_action(lambda c: c.toggle_backend())

    def action_set_tokens(self) -> None:
        ctl = self.app.controller
        if ctl is None:
            return

        def done(n: int | None) -> None:
            if n is not None:
                self.app.settings_action(lambda c: c.set_gen(n))

        self.app.push_screen(TokenCountScreen(ctl.gen), done)

    def action_history(self) -> None:
        self.app.open_history()

    def action_diff_last(self) -> None:
        self.app.diff_last()

    def action_compare_simd_scalar(self) -> None:
        self.app.compare_simd_scalar()

    def action_refresh_period(self, step: int) -> None:
        self.app.change_refresh(step)

    def action_freeze(self) -> None:
        self.app.toggle_freeze()


# ---------------------------------------------------------------------------------------------
# History
# ---------------------------------------------------------------------------------------------
def _group_letters(records: list[RunRecord]) -> dict[str, str]:
    """sha -> a letter shared by the runs with that hash (A for the newest group, ...)."""
    groups = hash_groups(records)
    letters: dict[str, str] = {}
    for r in records:
        if r.state_sha256 in groups and r.state_sha256 not in letters:
            n = len(letters)
            letters[r.state_sha256] = chr(ord("A") + n) if n < 26 else f"{n}"
    return letters


class HistoryScreen(Screen):
    """Every recorded run, newest first; matching state hashes share a letter."""

    BINDINGS = HISTORY_BINDINGS
    app: "Ds4fConsole"

    def __init__(self, records: list[RunRecord] | None = None) -> None:
        super().__init__()
        self._fixed = records
        self.records: list[RunRecord] = []
        self.marked: list[str] = []

    def compose(self) -> ComposeResult:
        yield Static(id="history-title")
        table = DataTable(id="runs", cursor_type="row", zebra_stripes=False)
        table.add_column("", key="mark", width=1)
        table.add_column("run", key="run")
        table.add_column("when", key="when")
        table.add_column("state", key="state")
        table.add_column("preset", key="preset")
        table.add_column("kernels", key="kernels")
        table.add_column("tok", key="tok")
        table.add_column("s/tok", key="spt")
        table.add_column("state sha256", key="sha")
        yield table
        yield Static(id="run-detail")
        yield KeyBar()

    def on_mount(self) -> None:
        self.reload()

    def on_screen_resume(self) -> None:
        self.reload()

    def reload(self) -> None:
        try:
            self.records = self._fixed if self._fixed is not None else self.app.controller.runs(500)
        except Ds4fError as exc:
            self.records = []
            self.app.notify(str(exc), severity="error", timeout=8)
        table = self.query_one("#runs", DataTable)
        row = table.cursor_row
        table.clear()
        letters = _group_letters(self.records)
        for r in self.records:
            table.add_row(*self._cells(r, letters), key=r.run_id)
        if self.records:
            table.move_cursor(row=min(max(0, row), len(self.records) - 1))
        title = Text()
        title.append(" run history ", "reverse bold")
        title.append(f" {len(self.records)} runs · =A, =B…: runs with the same state hash")
        self.query_one("#history-title", Static).update(title)
        self._detail()

    def _cells(self, r: RunRecord, letters: dict[str, str]) -> list:
        mark = Text("●", style="bold") if r.run_id in self.marked else ""
        state = Text(f"{STATE_MARK.get(r.state, '?')} {r.state}",
                     style={"failed": "bold red", "cancelled": "yellow"}.get(r.state, ""))
        sha = Text(r.state_sha256[:10] if r.state_sha256 else F.DASH)
        if r.state_sha256 in letters:
            sha.append(f" ={letters[r.state_sha256]}", "bold")
        spt = F.fmt_s_per_token(r.s_per_token)
        return [mark, r.run_id[-4:], F.fmt_when(r.started_at), state, r.preset, r.backend or F.DASH,
                str(r.tokens_done), spt, sha]

    def _current(self) -> RunRecord | None:
        table = self.query_one("#runs", DataTable)
        if not self.records or table.cursor_row < 0 or table.cursor_row >= len(self.records):
            return None
        return self.records[table.cursor_row]

    @on(DataTable.RowHighlighted, "#runs")
    def _highlighted(self) -> None:
        self._detail()

    def _detail(self) -> None:
        r = self._current()
        out = Text()
        if r is None:
            out.append("No runs recorded yet: go back (esc) and press r.", "dim")
        else:
            c, s = r.config, r.summary
            out.append(f"run {r.run_id}", "bold")
            out.append(f" · {r.state} · {F.fmt_when(r.started_at)} · took {F.fmt_seconds(r.duration_s)}\n")
            out.append(f"model {F.short_path(r.model, 60)}\n")
            out.append(f"preset {r.preset} · gen {c.get('gen', F.DASH)} · kernels {'→'.join(r.backends) or F.DASH}"
                       f" · k{c.get('kernel_threads', '?')} io{c.get('io_threads', '?')}\n")
            if s:
                out.append(f"{F.fmt_s_per_token(s.get('s_per_token'))} s/token (first {F.fmt_seconds(s.get('s_first_token'))})"
                           f" · {F.fmt_gbps(s.get('eff_read_gbps'))} GB/s · hit {F.fmt_pct(s.get('hit_rate'))}\n")
            if r.state_sha256:
                same = [x.run_id[-4:] for x in self.records if x.state_sha256 == r.state_sha256 and x is not r]
                out.append(f"sha256 {r.state_sha256}\n")
                if same:
                    out.append(f"same state as: {', '.join(same[:8])}\n", "bold")
            if r.error:
                out.append(f"error: {r.error}\n", "bold red")
        self.query_one("#run-detail", Static).update(out)

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_mark(self) -> None:
        r = self._current()
        if r is None:
            return
        if r.run_id in self.marked:
            self.marked.remove(r.run_id)
        else:
            self.marked.append(r.run_id)
            if len(self.marked) > 2:
                self.marked.pop(0)
        table = self.query_one("#runs", DataTable)
        for rec in self.records:
            table.update_cell(rec.run_id, "mark", Text("●", style="bold") if rec.run_id in self.marked else "")

    def action_diff_marked(self) -> None:
        by_id = {r.run_id: r for r in self.records}
        if len(self.marked) == 2:
            a, b = sorted((by_id[m] for m in self.marked if m in by_id), key=lambda r: r.started_at)
        else:
            table = self.query_one("#runs", DataTable)
            i = table.cursor_row
            if not 0 <= i < len(self.records) - 1:
                self.app.notify("Mark two runs with space, then d (or highlight a run that has an older one below).",
                                severity="warning")
                return
            a, b = self.records[i + 1], self.records[i]
        self.app.open_diff(a, b)

    def action_compare_simd_scalar(self) -> None:
        pair = simd_scalar_pair(self.records)
        if pair is None:
            self.app.notify_no_pair()
            return
        self.app.open_diff(*pair)

    def action_same_hash(self) -> None:
        r = self._current()
        if r is None or not r.state_sha256:
            return
        n = len(self.records)
        table = self.query_one("#runs", DataTable)
        for k in range(1, n):
            j = (table.cursor_row + k) % n
            if self.records[j].state_sha256 == r.state_sha256:
                table.move_cursor(row=j)
                return
        self.app.notify("No other run has this state hash.")


# ---------------------------------------------------------------------------------------------
# Diff
# ---------------------------------------------------------------------------------------------
VERDICT = {
    "identical": ("IDENTICAL", "fine", "byte-for-byte the same state dump"),
    "low-bit": ("LOW-BIT", "careful", "same routing; states within tolerance"),
    "routing": ("ROUTING DIVERGES", "warning", "expert choices differ from there on"),
    "drift": ("DRIFT", "critical", "same routing; states beyond tolerance"),
}
LOG_FLOOR = -12.0


def low_bit_tolerance() -> float:
    """The engine's bound between low-bit and drift (relative error of a layer's hidden state)."""
    try:
        from ds4f.engine.statedump import LOW_BIT_TOLERANCE
    except ImportError:
        return 1e-4
    return float(LOW_BIT_TOLERANCE)


def log_error(v: float) -> float:
    """log10 of a relative error, shifted so 1e-12 (or exact) is 0 and 1 is 12."""
    if not v or v <= 0 or not math.isfinite(v):
        return 0.0 if not v or v <= 0 else -LOG_FLOOR
    return max(0.0, math.log10(v) - LOG_FLOOR)


class DiffScreen(Screen):
    """Two runs' state dumps compared: the class, where routing first differs, per-layer error."""

    BINDINGS = DIFF_BINDINGS
    app: "Ds4fConsole"

    def __init__(self, a: RunRecord, b: RunRecord, diff=None, diff_fn: Callable | None = None) -> None:
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
        tol = low_bit_tolerance()
        rels = [x for x in d.layer_max_rel if x is not None and math.isfinite(x)]
        if rels and max(rels) > 0:
            worst = max(range(len(d.layer_max_rel)), key=lambda i: d.layer_max_rel[i] or 0)
            t.append(f"max rel error {max(rels):.1e} at layer {worst} (tolerance {tol:g})"
                     f" · {d.n_tokens} tokens\n")
        else:
            t.append(f"no difference in any layer · {getattr(d, 'n_tokens', '?')} tokens\n")
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
        row("hit rate", F.fmt_pct(a.summary.get("hit_rate")), F.fmt_pct(b.summary.get("hit_rate")))
        row("GB/s", F.fmt_gbps(a.summary.get("eff_read_gbps")), F.fmt_gbps(b.summary.get("eff_read_gbps")))
        row("sha256", (a.state_sha256 or F.DASH)[:12], (b.state_sha256 or F.DASH)[:12])
        self.query_one("#sides", Static).update(table)

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_swap(self) -> None:
        self.app.switch_screen(DiffScreen(self.b, self.a, diff_fn=self.diff_fn))


# ---------------------------------------------------------------------------------------------
# Modals and full-screen notices
# ---------------------------------------------------------------------------------------------
class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape,question_mark,q,f1", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "keys"
            box.border_subtitle = "esc closes · every key is also in the command palette (ctrl+p or :)"
            for title, bindings in SCREENS_FOR_HELP:
                table = Table(box=None, show_header=False, pad_edge=False, expand=True, title=title,
                              title_justify="left", title_style="bold")
                table.add_column(style="bold", no_wrap=True, width=12)
                table.add_column()
                seen = set()
                for b in bindings:
                    if b.action in seen:
                        continue
                    seen.add(b.action)
                    table.add_row(keys_of(b), b.tooltip or b.description)
                if title == "Everywhere":
                    table.add_row("ctrl+p", "Command palette: every action by name")
                yield Static(table)
            app = self.app
            files = Table(box=None, show_header=False, pad_edge=False, expand=True, title="Files",
                          title_justify="left", title_style="bold")
            files.add_column(style="bold", no_wrap=True, width=12)
            files.add_column(overflow="fold")
            config = getattr(app, "config", None)
            ctl = getattr(app, "controller", None)
            files.add_row("config", config.source if config else "—")
            files.add_row("history", str(ctl.history.path) if ctl and ctl.history else "—")
            files.add_row("model", (ctl.model or "—") if ctl else "—")
            yield Static(files)

    def action_dismiss(self, result=None) -> None:
        self.dismiss(None)


class TokenCountScreen(ModalScreen[int | None]):
    BINDINGS = [("escape", "cancel", "cancel")]

    def __init__(self, current: int) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="tokens-box") as box:
            box.border_title = "tokens to decode"
            yield Static("Tokens for the next run to decode (enter accepts, esc cancels):")
            yield Input(value=str(self.current), type="integer", id="tokens-input")
            yield Label("", id="tokens-error")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        try:
            n = int(event.value)
        except ValueError:
            n = 0
        if not 1 <= n <= 100_000:
            self.query_one("#tokens-error", Label).update("Enter a whole number between 1 and 100000.")
            return
        self.dismiss(n)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ErrorScreen(Screen[str]):
    """What went wrong and where, with a way out: the demo model, retry, or quit."""

    BINDINGS = [("d", "choose('demo')", "open the demo model"), ("r", "choose('retry')", "retry"),
                ("escape", "choose('back')", "back"), ("q", "app.quit", "quit")]

    def __init__(self, title: str, message: str, offer_demo: bool = True, can_go_back: bool = False) -> None:
        super().__init__()
        self.title_text, self.message = title, message
        self.offer_demo, self.can_go_back = offer_demo, can_go_back

    def compose(self) -> ComposeResult:
        with Vertical(id="error-box") as box:
            box.border_title = "ds4f-console"
            yield Static(Text(self.title_text, style="bold"), id="error-title")
            yield Static(Text(self.message), id="error-message")
            opts = Text()
            if self.offer_demo:
                opts.append("d", "bold reverse")
                opts.append(" open the demo model instead   ")
            opts.append("r", "bold reverse")
            opts.append(" retry   ")
            if self.can_go_back:
                opts.append("esc", "bold reverse")
                opts.append(" back   ")
            opts.append("q", "bold reverse")
            opts.append(" quit")
            yield Static(opts, id="error-options")

    def action_choose(self, choice: str) -> None:
        if choice == "demo" and not self.offer_demo:
            return
        if choice == "back" and not self.can_go_back:
            return
        self.dismiss(choice)


class SetupScreen(Screen[None]):
    """First launch: the demo checkpoint is being made (synthesised, converted) in the cache dir."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def compose(self) -> ComposeResult:
        with Vertical(id="setup-box") as box:
            box.border_title = "ds4f-console · first launch"
            yield Static(Text("Making the demo model (a small synthetic DeepSeek-V4-Flash-shaped checkpoint, "
                              "written in the official format and converted to the ds4f layout). "
                              "This happens once; later launches reuse it.", style=""), id="setup-text")
            yield Static(Text(self.where, style="dim"), id="setup-where")
            yield ProgressBar(total=100, show_eta=False, id="setup-bar")
            yield Static("starting…", id="setup-stage")

    def progress(self, done: float, total: float, label: str) -> None:
        bar = self.query_one("#setup-bar", ProgressBar)
        bar.update(total=max(1.0, float(total)), progress=float(done))
        self.query_one("#setup-stage", Static).update(label)
