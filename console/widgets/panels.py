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
from textual.events import Resize
from textual.widgets import Digits, Static

from ds4f.api import LIVE_STATES, Snapshot

from ..core import figures as F
from ..core.controller import NextRun
from ..core.thresholds import (FINE, HIT_RATE, WARNING, hit_rate_level, io_efficiency_level, ram_level, rss_level,
                         state_level, worst)
from .common import EventLog, LayerStrip, Meter, Panel, Plot


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
        if snap.spec_mode != "off":
            cap.append("\n" + F.spec_text(snap))
        self.put("#speed-caption", cap)
        self.query_one("#speed-plot", Plot).set_data(F.token_seconds(snap.tokens))


class ReadRatePanel(DashboardPanel):
    """Effective read GB/s against the NVMe floor (drawn as a line): the floor's ratio as the
    lower bound it is, the floor's age, and what bounds the run. A compute-bound run says so at
    a calm level; a disk-bound one is judged by its I/O efficiency (a replay of its own reads)
    once known, else shows the disk's busy share."""

    def __init__(self) -> None:
        super().__init__("read GB/s · NVMe floor", id="p-io")

    def compose(self) -> ComposeResult:
        yield Static(id="io-text")
        yield Plot(id="io-plot")

    def update(self, snap: Snapshot | None) -> None:
        if snap is None:
            self.query_one("#io-plot", Plot).set_data([])
            self.put("#io-text", Text("effective read — GB/s\nfloor —", style="dim"))
            self.set_level(None)
            return
        io = Text()
        io.append(f"{F.fmt_gbps(snap.eff_read_gbps)} GB/s", "bold")
        if snap.floor_ratio is not None:
            # the effective rate counts compute time too, so its ratio to the floor is a lower bound
            io.append(f": at least {F.fmt_pct(snap.floor_ratio, 0)} of floor")
        io.append("\n")
        io.append_text(bound_text(snap))
        if snap.floor_gbps:
            io.append(f"\nfloor {F.fmt_gbps(snap.floor_gbps)} GB/s, {F.fmt_age(snap.floor_age_s)}")
        else:
            io.append("\nfloor not measured", "dim")
        gbt = F.DASH if snap.gb_per_token is None else f"{snap.gb_per_token:.3g}"
        io.append(f"\n{gbt} GB/tok · {snap.io_mode}")
        if snap.read_latency_ms is not None:
            io.append(f" · {snap.read_latency_ms:.2g} ms/read")
        if snap.prefetch:
            pf = snap.prefetch
            io.append(f"\nprefetch {pf.get('useful', 0)}/{pf.get('issued', 0)} used, {pf.get('wasted', 0)} wasted", "dim")
        self.put("#io-text", io)
        self.query_one("#io-plot", Plot).set_data(F.token_gbps(snap.tokens), floor=snap.floor_gbps)
        self.set_level(*io_level(snap))


def bound_text(snap: Snapshot) -> Text:
    """What bounds the run, in words: 'compute-bound, disk busy 52%' (calm), 'disk-bound, I/O
    efficiency 75%' (a replay of the run's reads, when done), 'disk-bound, disk busy 87%'."""
    busy = F.fmt_pct(snap.disk_busy_fraction, 0)
    if snap.bound == "compute":
        return Text(f"compute-bound, disk busy {busy}")
    if snap.bound == "disk":
        if snap.io_efficiency is not None:
            return Text(f"disk-bound, I/O efficiency {F.fmt_pct(snap.io_efficiency, 0)}")
        return Text(f"disk-bound, disk busy {busy}")
    return Text("disk busy —", style="dim")


def io_level(snap: Snapshot) -> tuple[str | None, str | None]:
    """The read panel's (level, note). A compute-bound run is fine as far as the disk goes
    (whatever its efficiency, the disk is not what it waits for); a disk-bound one is judged
    by its I/O efficiency once the replay has measured it."""
    if snap.bound == "compute":
        return FINE, "compute-bound"
    if snap.bound == "disk":
        if snap.io_efficiency is not None:
            return io_efficiency_level(snap.io_efficiency), f"disk-bound · eff {F.fmt_pct(snap.io_efficiency, 0)}"
        return None, "disk-bound"
    return None, None


class HitRatePanel(DashboardPanel):
    """Expert-cache hit rate on one yardstick: the policy's own hits (without prefetch's help)
    beside Belady's on the same requests, prefetch's contribution apart, the regret in
    percentage points; the per-token history and a strip with one cell per layer, both of the
    policy's own rate too (the yardstick of the figure beside Belady's)."""

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
        self.put("#hits-text", hits_text(snap))
        self.query_one("#hits-plot", Plot).set_data(F.token_policy_hit_rates(snap.tokens), maximum=1.0)
        self.query_one("#hits-strip", LayerStrip).set_rates(F.layer_policy_hit_rates(snap))
        own = snap.policy_hit_rate if snap.policy_hit_rate is not None else snap.hit_rate
        self.set_level(hit_rate_level(own))


def hits_text(snap: Snapshot) -> Text:
    """'lru 72.1% · Belady 86.1%' / 'regret 14.0 pts · +6.4 pts prefetch' / the request counts.
    The policy's own rate is the one beside Belady's: the prefetch-inclusive rate is not
    comparable with it (Belady has no prefetch), so prefetch's share is shown apart."""
    t = Text()
    t.append(f"{snap.policy} {F.fmt_pct(snap.policy_hit_rate)}", "bold")
    if snap.optimum_hit_rate is not None:
        t.append(f" · Belady {F.fmt_pct(snap.optimum_hit_rate)}", "bold")
    elif snap.state in LIVE_STATES:
        t.append(" · Belady when done", "dim")
    else:
        t.append(" · no Belady", "dim")
    t.append("\n")
    parts: list[str] = []
    if snap.regret_pp is not None:
        parts.append(f"regret {F.fmt_pts(snap.regret_pp)}")
    if not snap.prefetch:
        parts.append("prefetch off")
    elif snap.prefetch_hit_share is not None:
        parts.append(f"+{F.fmt_pts(100 * snap.prefetch_hit_share)} prefetch")
    t.append(" · ".join(parts))
    requests = sum(snap.layer_hits) + sum(snap.layer_misses)
    t.append(f"\n{requests:,} requests · {sum(snap.layer_misses):,} misses", "dim")
    return t


class MemoryPanel(DashboardPanel):
    """RSS against the plan (the process before the run plus what the preset plans), and the
    machine's RAM with what it can still give, apart; the expert cache against its budget.
    Warns when RSS exceeds the plan, when the RAM still free gets low, and when a live run's
    plan needs more than the machine has free: before the box runs out."""

    def __init__(self) -> None:
        super().__init__("memory", id="p-mem")

    def compose(self) -> ComposeResult:
        yield Meter(id="rss-meter")
        yield Meter(id="ram-meter")
        yield Static(id="mem-text")

    def update(self, snap: Snapshot | None) -> None:
        rss_meter = self.query_one("#rss-meter", Meter)
        ram_meter = self.query_one("#ram-meter", Meter)
        if snap is None:
            rss_meter.set(None, None, "RSS", F.DASH)
            ram_meter.set(None, None, "RAM", F.DASH)
            self.put("#mem-text", Text("expert cache —", style="dim"))
            self.set_level(None)
            return
        rss_lv = rss_level(snap.rss_bytes, snap.rss_budget_bytes)
        plan = snap.rss_budget_bytes
        rss_meter.set(snap.rss_bytes / plan if plan else None, rss_lv, "RSS",
                      f"{F.fmt_size(snap.rss_bytes)} · plan {F.fmt_size(plan)}" if plan else F.fmt_size(snap.rss_bytes))
        ram_lv = ram_level(snap.ram_available_bytes, snap.ram_bytes)
        if snap.ram_bytes:
            used = 1 - snap.ram_available_bytes / snap.ram_bytes
            ram_meter.set(used, ram_lv, "RAM",
                          f"{F.fmt_size(snap.ram_bytes)}, {F.fmt_size(snap.ram_available_bytes)} free")
        else:
            ram_meter.set(None, None, "RAM", F.DASH)
        mt = Text()
        if plan and snap.plan_bytes:
            mt.append(f"= process {F.fmt_size(plan - snap.plan_bytes)} + preset {F.fmt_size(snap.plan_bytes)}\n")
        mt.append(f"expert cache {F.fmt_size(snap.cache_bytes)} / {F.fmt_size(snap.budget_bytes)}"
                  if snap.budget_bytes else "expert cache —")
        if snap.kv_bytes:
            mt.append(f" · KV {F.fmt_size(snap.kv_bytes)} for {snap.context} positions")
        if snap.batch_parallel > 1:
            mt.append("\n" + batch_line(snap))
        self.put("#mem-text", mt)
        self.set_level(*memory_level(snap))


def batch_line(snap: Snapshot) -> str:
    """The sequences decoded together: how many step now, what a step holds, the cap and why."""
    parts = [f"batch {snap.batch_sequences}/{snap.batch_parallel} sequences"]
    if snap.batch_rows_per_step:
        parts.append(f"{snap.batch_rows_per_step} rows/step")
    if snap.batch_union_per_layer is not None:
        parts.append(f"union {snap.batch_union_per_layer:.1f} experts/layer")
    if snap.batch_tokens_per_s is not None:
        parts.append(f"{snap.batch_tokens_per_s:.2f} tok/s in all")
    parts.append(f"this run shared {snap.batch_shared_steps} of {snap.batch_steps} steps")
    if snap.batch_cap < snap.batch_parallel:
        parts.append(f"capped at {snap.batch_cap}: {snap.batch_cap_reason}")
    return " · ".join(parts)


def memory_level(snap: Snapshot) -> tuple[str | None, str | None]:
    """The memory panel's (level, note): the worst of RSS against the plan, the RAM still free,
    and (while the run is live) whether what the plan has yet to take fits in what is free."""
    plan = snap.rss_budget_bytes
    rss_lv = rss_level(snap.rss_bytes, plan)
    ram_lv = ram_level(snap.ram_available_bytes, snap.ram_bytes)
    to_come = plan - snap.rss_bytes if plan and snap.state in LIVE_STATES else 0
    short = WARNING if snap.ram_bytes and to_come > snap.ram_available_bytes else None
    level = worst(rss_lv, ram_lv, short)
    if level is None:
        return None, None
    if ram_lv == level and ram_lv != FINE:
        note = f"{F.fmt_pct(snap.ram_available_bytes / snap.ram_bytes, 0)} RAM free"
    elif short == level and rss_lv != level:
        note = "plan > free RAM"
    elif plan:
        note = f"{F.fmt_pct(snap.rss_bytes / plan, 0)} of plan"
    else:
        note = None
    return level, note


class KernelsPanel(DashboardPanel):
    """Kernel backend and thread counts, and every live switch of the run with the token it
    landed at (newest first; the oldest give way when there are many). With no run yet, what
    the next run will use (`next_run`, set by the dashboard)."""

    def __init__(self) -> None:
        super().__init__("kernels", id="p-kern")
        self.next_run: NextRun | None = None
        self._snap: Snapshot | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="kern-text")

    def on_resize(self, _event: Resize) -> None:
        self.update(self._snap)  # what fits of the switches changes with the size

    def update(self, snap: Snapshot | None) -> None:
        self._snap = snap
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
                # as many of the newest as the panel holds below the first line (its size is 0x0
                # before the first layout: then the first KEEP_SWITCHES)
                room = self.content_region
                kt.append("\n" + F.switches_text(sw, room.width, room.height - 1 if room.height > 1 else 0,
                                                  KEEP_SWITCHES), "bold")
            else:
                kt.append("\nno switch this run", "dim")
        self.put("#kern-text", kt)


KEEP_SWITCHES = 12  # the kernels panel lists at most this many switches (newest first), then a count


class ProgressPanel(DashboardPanel):
    """The run: its state and tokens done of the total with the progress bar beside them, then
    ETA, elapsed time, stalls, preset and run id, and a failed run's error. At 80x24 the panel
    has four lines under its state line: the figures share lines when the panel is short, and
    the error gets what room is left (the event log has all of it)."""

    def __init__(self) -> None:
        super().__init__("run", id="p-run")
        self._snap: Snapshot | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="run-top"):
            yield Static(id="run-state")
            yield Meter(id="run-meter")
        yield Static(id="run-text")

    def on_resize(self, _event: Resize) -> None:
        self.update(self._snap)  # how the lines pack depends on the size

    def update(self, snap: Snapshot | None) -> None:
        self._snap = snap
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
        meter.set(snap.tokens_done / snap.steps if snap.steps else 0.0,
                  "critical" if snap.state == "failed" else None, "", "")
        # the room under the state line (0x0 before the first layout: no limit, then on_resize)
        room = self.content_region
        lines, error = F.run_lines(snap, room.width, room.height - 1 if room.height > 1 else 0)
        rt = Text("\n".join(lines))
        if error:
            rt.append("\n" + "\n".join(error), "bold red")
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
                     f"k{next_run.kernel_threads} io{next_run.io_threads}"
                     + (f" · spec {next_run.spec}" if next_run.spec != "off" else ""))
        if snap is not None:
            t.append(f"  {F.state_mark(snap.state)} {snap.state}", "bold")
        t.append(f"  ⟳{refresh_s:g}s")
        if frozen:
            t.append(" FROZEN", "reverse bold")
        if t != self._shown:
            self._shown = t
            self.update(t)
