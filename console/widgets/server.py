"""The attached dashboard's widgets: one ServerPane per server, with the panels a server has (its
live sequences and queue, latency, prefix cache, event log, a status line) beside the run
panels of panels.py, which draw the followed run's Snapshot as they do a local run's.

Each draws from a ServerView (console.core.remote) that the app hands it at each refresh; nothing
here talks to the server.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Container, Vertical
from textual.widgets import Static

from ds4f.api import Snapshot

from ..core import server_figures as S
from ..core.controller import NextRun
from ..core.remote import LIVE, LOST, LogEntry, ServerView, server_settings
from ..core.thresholds import CAREFUL, WARNING
from .common import EventLog
from .panels import (DashboardPanel, HitRatePanel, KernelsPanel, MemoryPanel, ProgressPanel, ReadRatePanel,
                     SpeedPanel)


class ServerPanel(DashboardPanel):
    """A panel that draws a ServerView (the run panels draw the followed run's Snapshot)."""

    def update(self, snap: Snapshot | None) -> None:
        pass

    def show_view(self, view: ServerView) -> None:
        raise NotImplementedError


class Relayout:
    """A run panel that a small terminal hides: what it was given meanwhile is laid out again
    when it shows (a Static's auto size is measured while it is displayed)."""

    def on_show(self) -> None:
        for child in self.query(Static):
            child.refresh(layout=True)


class AttachedReadRatePanel(Relayout, ReadRatePanel):
    pass


class AttachedHitRatePanel(Relayout, HitRatePanel):
    pass


class AttachedMemoryPanel(Relayout, MemoryPanel):
    pass


class AttachedKernelsPanel(Relayout, KernelsPanel):
    pass


class AttachedSpeedPanel(Relayout, SpeedPanel):
    """s/token of the followed run; with none yet, says so (there is no run to start here)."""

    def update(self, snap: Snapshot | None) -> None:
        super().update(snap)
        if snap is None:
            self.put("#speed-caption", Text("s/token\nno request yet", style="dim"))


class AttachedProgressPanel(Relayout, ProgressPanel):
    """The followed run's progress; with none yet, says so."""

    def update(self, snap: Snapshot | None) -> None:
        super().update(snap)
        if snap is None:
            self.put("#run-state", Text("no request yet", style="dim"))


class SequencesPanel(ServerPanel):
    """The live sequences, one line each (endpoint, client, prompt tokens reused of all, a prefill
    bar with its ETA or the tokens so far, decode tok/s, spec acceptance, batch share), the picked
    or followed one marked; then the batch and the queue. While the connection is down, says so."""

    def __init__(self) -> None:
        super().__init__("sequences", id="a-seq")
        self.view: ServerView | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="seq-text")

    def on_resize(self, _event) -> None:
        if self.view is not None:
            self.show_view(self.view)

    def show_view(self, view: ServerView) -> None:
        self.view = view
        width = max(20, self.content_region.width or 76)
        t = Text(no_wrap=True, overflow="ellipsis")
        conn = view.connection
        if conn.state != LIVE:
            t.append(conn.text(), "bold")
            t.append("\n")
        picked = view.selected or view.followed
        for seq in view.sequences:
            run_id = seq.get("run_id")
            mine = run_id is not None and run_id == picked
            style = "reverse" if mine and view.selected else ("bold" if mine else "")
            t.append(("▸ " if mine else "  ") + S.sequence_line(seq, width - 2), style)
            t.append("\n")
        if not view.sequences and conn.state == LIVE:
            t.append("no sequence running\n", "dim")
        tail = [x for x in (S.batch_text(view.status), S.queue_text(view.status)) if x]
        t.append(" · ".join(tail) if view.status else "", "dim")
        self.put("#seq-text", t)
        n = len(view.sequences)
        note = f"{n} running" if n else None
        if view.selected:
            note = f"{note} · picked {view.selected[-4:]}" if note else f"picked {view.selected[-4:]}"
        if conn.state == LOST:
            self.set_level(WARNING, "connection lost")
        elif conn.state != LIVE:
            self.set_level(CAREFUL, conn.state.replace("_", " "))
        elif server_settings(view.status)["draining"]:
            self.set_level(CAREFUL, "draining" + (f" · {note}" if note else ""))
        else:
            self.set_level(None, note)


class LatencyPanel(ServerPanel):
    """Time to first token and between tokens at p50/p90/p99, and the prefill's share of the wait."""

    def __init__(self) -> None:
        super().__init__("latency", id="a-lat")

    def compose(self) -> ComposeResult:
        yield Static(id="lat-text")

    def show_view(self, view: ServerView) -> None:
        lines = S.latency_lines(view.latency)
        measured = bool(view.latency) and not lines[0].startswith("no request")
        self.put("#lat-text", Text("\n".join(lines), style="" if measured else "dim", no_wrap=True,
                                   overflow="ellipsis"))


class PrefixCachePanel(ServerPanel):
    """The server's prefix cache (GET /status prefix_cache): states, bytes, hits, writes."""

    def __init__(self) -> None:
        super().__init__("prefix cache", id="a-prefix")

    def compose(self) -> ComposeResult:
        yield Static(id="prefix-text")

    def show_view(self, view: ServerView) -> None:
        cache = (view.status or {}).get("prefix_cache")
        text = Text("\n".join(S.prefix_lines(cache)), style="" if cache else "dim", no_wrap=True, overflow="ellipsis")
        text.append("\n" + S.runs_dir_line(view.status), style="")     # and the runs directory's budget
        if S.kv_dir_line(view.status):
            text.append("\n" + S.kv_dir_line(view.status), style="")  # and the kv directory's
        self.put("#prefix-text", text)


class ServerLogPanel(ServerPanel):
    """The server's event log (GET /events `log`), and the console's own lines: the connection's
    changes, the operator calls and their answers."""

    def __init__(self) -> None:
        super().__init__("server events", id="a-log")
        self.last_seq = 0

    def compose(self) -> ComposeResult:
        log = EventLog(id="log")
        log.can_focus = False      # the arrows pick sequences
        yield log

    def show_view(self, view: ServerView) -> None:
        pass

    def add_entries(self, entries: list[LogEntry]) -> None:
        log = self.query_one("#log", EventLog)
        for e in entries:
            self.last_seq = max(self.last_seq, e.seq)
            low = e.message.lower()
            if e.message.startswith("✗") or "error" in low or "failed" in low or e.kind == "error":
                style = "bold red"
            elif e.kind == "operator-call" or e.kind == "operator":
                style = "yellow"
            elif e.kind == "connection":
                style = "italic"
            else:
                style = ""
            log.add(Text(S.log_text(e), style=style))

    def add_line(self, text: str, style: str = "") -> None:
        self.query_one("#log", EventLog).add(Text(text, style=style))


class ServerStatusLine(Static):
    """The top line of a server's pane: its address, model and version, what its next requests
    get, the connection, the refresh period, FROZEN / DRAINING."""

    def __init__(self) -> None:
        super().__init__(classes="a-status")
        self._shown: Text | None = None

    def show(self, view: ServerView, refresh_s: float, frozen: bool) -> None:
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(" ds4f ", "reverse bold")
        t.append(f" {S.server_title(view)} ", "bold")
        settings = server_settings(view.status)
        conn = view.connection
        t.append(" ● live" if conn.live else f" ✗ {conn.state.replace('_', ' ')}", "bold")
        if settings["draining"]:
            t.append(" DRAINING", "reverse bold")
        t.append(f"  ⟳{refresh_s:g}s")
        if frozen:
            t.append(" FROZEN", "reverse bold")
        if view.status is not None:
            t.append(f"  {S.settings_text(settings)}")
        if t != self._shown:
            self._shown = t
            self.update(t)


class ServerPane(Vertical):
    """One server's dashboard: the status line over the panels."""

    def __init__(self, index: int, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="a-pane")
        self.index = index
        self.view: ServerView | None = None

    def compose(self) -> ComposeResult:
        yield ServerStatusLine()
        with Container(classes="a-panels"):
            yield SequencesPanel()
            yield AttachedSpeedPanel()
            yield AttachedReadRatePanel()
            yield AttachedHitRatePanel()
            with Container(classes="a-memkern"):
                yield AttachedMemoryPanel()
                yield AttachedKernelsPanel()
            yield AttachedProgressPanel()
            with Container(classes="a-latprefix"):
                yield LatencyPanel()
                yield PrefixCachePanel()
            yield ServerLogPanel()

    @property
    def log_panel(self) -> ServerLogPanel:
        return self.query_one(ServerLogPanel)

    def show(self, view: ServerView, entries: list[LogEntry], refresh_s: float, frozen: bool) -> None:
        """One refresh: the log always (nothing is lost while frozen), the rest unless frozen."""
        self.query_one(ServerStatusLine).show(view, refresh_s, frozen)
        if entries:
            self.log_panel.add_entries(entries)
        if frozen:
            return
        self.view = view
        settings = server_settings(view.status)
        kernels = self.query_one(KernelsPanel)
        if view.status is not None:
            kernels.next_run = NextRun(model=str((view.status.get("model") or {}).get("path") or ""),
                                       preset=str(settings["preset"] or "?"), gen=0,
                                       backend=str(settings["backend"] or "?"),
                                       kernel_threads=settings["kernel_threads"] or 0,
                                       io_threads=settings["io_threads"] or 0)
        snap = view.snapshot
        for panel in self.query(DashboardPanel):
            if isinstance(panel, ServerPanel):
                panel.show_view(view)
            else:
                panel.update(snap)
