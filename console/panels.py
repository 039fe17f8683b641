"""The dashboard's panels, one widget each, and the status line above them.

Every panel draws itself from a Snapshot in `update(snapshot)` (None: no run yet this
session); the dashboard calls it on each panel at every refresh. A panel touches a child
widget only when what that child shows has changed, so an unchanged dashboard costs the
terminal (and an SSH link) nothing.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Digits, Static

from ds4f.api import LIVE_STATES, Snapshot

from . import figures as F
from .controller import NextRun
from .thresholds import HIT_RATE, hit_rate_level, io_efficiency_level, rss_level, state_level
from .widgets import EventLog, LayerStrip, Meter, Panel, Plot


class DashboardPanel(Panel):
    """A bordered dashboard panel that redraws itself from a Snapshot."""

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self._shown: dict[str, object] = {}

    def update(self, snap: Snapshot | None) -> None:
        """Draw one Snapshot (None: no run yet this session)."""
        raise NotImplementedError

    def put(self, selector: str, content) -> None:
        """Give a Static new content, only when it differs from what the Static shows."""
        if self._shown.get(selector) == content:
            return
        self._shown[selector] = content
        self.query_one(selector, Static).update(content)


class SpeedPanel(DashboardPanel):
    """s/token: the median over warm tokens as a big number, the first token apart, and the
    per-token history."""

    def __init__(self) -> None:
        super().__init__("s/token", id="p-speed")

    def compose(self) -> ComposeResult:
        with Horizontal(id="speed-top"):
            yield Digits("-.---", id="speed-digits")
            yield Static(id="speed-caption")
        yield Plot(id="speed-plot")

    def _digits(self, value: str) -> None:
        digits = self.query_one("#speed-digits", Digits)
        if digits.value != value:
            digits.update(value)

    def update(self, snap: Snapshot | None) -> None:
        if snap is None:
            self._digits("-.---")
            self.put("#speed-caption", Text("s/token\nno run yet\npress r", style="dim"))
            self.query_one("#speed-plot", Plot).set_data([])
            return
        self._digits(F.fmt_s_per_token(snap.s_per_token).replace(F.DASH, "-.---"))
        cap = Text()
        cap.append("s/token", "bold")
        cap.append(f"\nmedian of {max(0, snap.tokens_done - 1)} warm")
        cap.append(f"\nfirst {F.fmt_seconds(snap.s_first_token)}")
        self.put("#speed-caption", cap)
        self.query_one("#speed-plot", Plot).set_data(F.token_seconds(snap.tokens))


class ReadRatePanel(DashboardPanel):
    """Effective read GB/s against the NVMe floor (drawn as a line), with the I/O efficiency's
    level in the border."""

    def __init__(self) -> None:
        super().__init__("read GB/s · NVMe floor", id="p-io")

    def compose(self) -> ComposeResult:
        yield Static(id="io-text")
        yield Plot(id="io-plot")

    def update(self, snap: Snapshot | None) -> None:
        if snap is None:
            self.query_one("#io-plot", Plot).set_data([])
            self.put("#io-text", Text("effective read — GB/s\nfloor — · efficiency —", style="dim"))
            self.set_level(None)
            return
        io = Text()
        io.append(f"{F.fmt_gbps(snap.eff_read_gbps)} GB/s", "bold")
        io.append(f" of {F.fmt_gbps(snap.floor_gbps)} floor" if snap.floor_gbps else " · floor not measured")
        if snap.disk_busy_fraction:  # the share of time a read was in flight: prefetch can use only the rest
            io.append(f" · busy {F.fmt_pct(snap.disk_busy_fraction, 0)}")
        gbt = F.DASH if snap.gb_per_token is None else f"{snap.gb_per_token:.3g}"
        io.append(f"\n{gbt} GB/tok · {snap.io_mode}")
        if snap.read_latency_ms is not None:
            io.append(f" · {snap.read_latency_ms:.2g} ms/read")
        if snap.prefetch:
            pf = snap.prefetch
            io.append(f"\nprefetch {pf.get('useful', 0)}/{pf.get('issued', 0)} used · {pf.get('wasted', 0)} wasted", "dim")
        self.put("#io-text", io)
        self.query_one("#io-plot", Plot).set_data(F.token_gbps(snap.tokens), floor=snap.floor_gbps)
        self.set_level(io_efficiency_level(snap.io_efficiency),
                       f"eff {F.fmt_pct(snap.io_efficiency, 0)}" if snap.io_efficiency is not None else None)


class HitRatePanel(DashboardPanel):
    """Expert-cache hit rate: the run's, its history, and a strip with one cell per layer."""

    def __init__(self) -> None:
        super().__init__("cache hit rate", id="p-hits")

    def compose(self) -> ComposeResult:
        yield Static(id="hits-text")
        yield Plot(id="hits-plot")
        yield LayerStrip(id="hits-strip", bounds=HIT_RATE)

    def update(self, snap: Snapshot | None) -> None:
        if snap is None:
            self.query_one("#hits-plot", Plot).set_data([])
            self.put("#hits-text", Text("hit rate —", style="dim"))
            self.query_one("#hits-strip", LayerStrip).set_rates([])
            self.set_level(None)
            return
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
        self.put("#hits-text", ht)
        self.query_one("#hits-plot", Plot).set_data(F.token_hit_rates(snap.tokens), maximum=1.0)
        self.query_one("#hits-strip", LayerStrip).set_rates(F.layer_hit_rates(snap))
        self.set_level(hit_rate_level(snap.hit_rate))


class MemoryPanel(DashboardPanel):
    """RSS against the preset's budget, and the expert cache's size against its own."""

    def __init__(self) -> None:
        super().__init__("memory", id="p-mem")

    def compose(self) -> ComposeResult:
        yield Meter(id="rss-meter")
        yield Static(id="mem-text")

    def update(self, snap: Snapshot | None) -> None:
        meter = self.query_one("#rss-meter", Meter)
        if snap is None:
            meter.set(None, None, "RSS", F.DASH)
            self.put("#mem-text", Text("expert cache —", style="dim"))
            self.set_level(None)
            return
        level = rss_level(snap.rss_bytes, snap.rss_budget_bytes)
        frac = snap.rss_bytes / snap.rss_budget_bytes if snap.rss_budget_bytes else None
        meter.set(frac, level, "RSS", f"{F.fmt_bytes(snap.rss_bytes)} / {F.fmt_bytes(snap.rss_budget_bytes)}"
                  if snap.rss_budget_bytes else F.fmt_bytes(snap.rss_bytes))
        self.put("#mem-text", f"expert cache {F.fmt_bytes(snap.cache_bytes)} / {F.fmt_bytes(snap.budget_bytes)}"
                 if snap.budget_bytes else "expert cache —")
        self.set_level(level, F.fmt_pct(frac, 0) if frac is not None else None)


class KernelsPanel(DashboardPanel):
    """Kernel backend and thread counts, and the last live switch with the token it landed at.
    With no run yet, what the next run will use (`next_run`, set by the dashboard)."""

    def __init__(self) -> None:
        super().__init__("kernels", id="p-kern")
        self.next_run: NextRun | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="kern-text")

    def update(self, snap: Snapshot | None) -> None:
        kt = Text()
        if snap is None:
            nxt = self.next_run
            kt.append(nxt.backend if nxt else F.DASH, "bold")
            if nxt:
                kt.append(f" · {nxt.kernel_threads} kernel · {nxt.io_threads} I/O threads")
            kt.append("\nno run yet", "dim")
        else:
            kt.append(snap.backend, "bold")
            kt.append(f" · {snap.kernel_threads} kernel · {snap.io_threads} I/O threads")
            sw = F.run_switches(snap)
            if sw:
                kt.append(f"\n⇄ {sw[-1]}", "bold")
            else:
                kt.append("\nno switch this run", "dim")
        self.put("#kern-text", kt)


class ProgressPanel(DashboardPanel):
    """The run: its state, tokens done of the total, ETA, elapsed time, stalls and its error."""

    def __init__(self) -> None:
        super().__init__("run", id="p-run")

    def compose(self) -> ComposeResult:
        yield Static(id="run-state")
        yield Meter(id="run-meter")
        yield Static(id="run-text")

    def update(self, snap: Snapshot | None) -> None:
        meter = self.query_one("#run-meter", Meter)
        if snap is None:
            self.put("#run-state", Text("idle: r starts a run", style="dim"))
            meter.set(0.0, None, "", "")
            self.put("#run-text", "")
            self.set_level(None)
            return
        st = Text()
        st.append(f"{F.state_mark(snap.state)} {snap.state}", "bold")
        st.append(f"  {F.progress_text(snap)}")
        self.put("#run-state", st)
        meter.set(snap.tokens_done / snap.gen if snap.gen else 0.0,
                  "critical" if snap.state == "failed" else None, "", f"{snap.tokens_done}/{snap.gen}")
        rt = Text()
        if snap.state in LIVE_STATES:
            rt.append(f"ETA {F.fmt_seconds(snap.eta_s)} · ")
        rt.append(f"elapsed {F.fmt_seconds(snap.elapsed_s)}")
        if snap.stall_s_per_token is not None:
            rt.append(f"\nstall {F.fmt_seconds(snap.stall_s_per_token)}/token")
        rt.append(f"\npreset {snap.preset} · run {snap.run_id}")
        if snap.error:
            rt.append(f"\n{snap.error}", "bold red")
        self.put("#run-text", rt)
        self.set_level(state_level(snap.state) if snap.state in ("failed", "cancelled") else None, snap.state)


class EventsPanel(DashboardPanel):
    """The event log: the run's events as they arrive (errors in red, switches in yellow), a
    line when a run fails, and the console's own lines (settings changes, notices)."""

    def __init__(self) -> None:
        super().__init__("events", id="p-log")
        self._run: str | None = None       # the run whose events the log has
        self._last: str | None = None      # the last of its events the log has
        self._failed_reported: set[str] = set()

    def compose(self) -> ComposeResult:
        yield EventLog(id="log")

    def add_line(self, text: str, style: str = "") -> None:
        self.query_one("#log", EventLog).add(Text(text, style=style))

    def update(self, snap: Snapshot | None) -> None:
        if snap is None:
            return
        if snap.run_id != self._run:
            self._run, self._last = snap.run_id, None
        events = snap.events
        start = 0
        if self._last is not None:
            for i in range(len(events) - 1, -1, -1):
                if events[i] == self._last:
                    start = i + 1
                    break
        for line in events[start:]:
            low = line.lower()
            style = "bold red" if ("error" in low or "traceback" in low) else ("yellow" if "->" in line else "")
            self.add_line(line, style)
        if events:
            self._last = events[-1]
        if snap.state == "failed" and snap.run_id not in self._failed_reported:
            self._failed_reported.add(snap.run_id)
            self.add_line(f"run {snap.run_id} failed: {snap.error or 'unknown error'}", "bold red")


class StatusLine(Static):
    """The top line: the model and the next run's settings, the run's state, the refresh period,
    and FROZEN while the display is frozen."""

    def __init__(self) -> None:
        super().__init__(id="status")
        self._shown: Text | None = None

    def show(self, snap: Snapshot | None, next_run: NextRun | None, refresh_s: float, frozen: bool) -> None:
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(" ds4f ", "reverse bold")
        if next_run is not None:
            t.append(f" {F.model_name(next_run.model)} ", "bold")
            t.append(f" next: {next_run.preset} · {next_run.gen} tok · {next_run.backend} · "
                     f"k{next_run.kernel_threads} io{next_run.io_threads}")
        if snap is not None:
            t.append(f"  {F.state_mark(snap.state)} {snap.state}", "bold")
        t.append(f"  ⟳{refresh_s:g}s")
        if frozen:
            t.append(" FROZEN", "reverse bold")
        if t != self._shown:
            self._shown = t
            self.update(t)
