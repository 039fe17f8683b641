"""The run history: every recorded run, newest first, with marks for a diff."""
from __future__ import annotations

from typing import Callable

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Static

from ds4f.api import Ds4fError, RunRecord, hash_groups

from ..core import figures as F
from ..core.bindings import HISTORY_BINDINGS
from ..widgets.common import KeyBar, SizeNotice


def group_letters(records: list[RunRecord]) -> dict[str, str]:
    """sha -> a letter shared by the runs with that hash (A for the newest group, ...)."""
    groups = hash_groups(records)
    letters: dict[str, str] = {}
    for r in records:
        if r.state_sha256 in groups and r.state_sha256 not in letters:
            n = len(letters)
            letters[r.state_sha256] = chr(ord("A") + n) if n < 26 else f"{n}"
    return letters


def cache_line(r: RunRecord) -> str:
    """A run's cache figures on one yardstick: the policy's own hit rate beside Belady's, the
    regret in points and prefetch's share apart; a record from before those were kept has the
    prefetch-inclusive rate alone."""
    s = r.summary
    own = s.get("policy_hit_rate")
    if own is None:
        return f"cache hit {F.fmt_pct(s.get('hit_rate'))}"
    policy = (r.report or {}).get("policy") or "policy"
    out = f"cache {policy} {F.fmt_pct(own)}"
    if s.get("optimum_hit_rate") is not None:
        out += f" · Belady {F.fmt_pct(s['optimum_hit_rate'])}"
        if s.get("regret_pp") is not None:
            out += f" · regret {F.fmt_pts(s['regret_pp'])}"
    if s.get("prefetch_hit_share") is not None and s.get("prefetch"):
        out += f" · +{F.fmt_pts(100 * s['prefetch_hit_share'])} prefetch"
    return out


class HistoryScreen(Screen):
    """Every recorded run, newest first; matching state hashes share a letter.

    `load_runs` returns the records to list; it is called again whenever the screen is shown.
    `known_tokens(run_id)`: the tokens a run decoded as the console saw it (None: unknown), for
    the cancelled and failed runs whose record has no report to say. `disk()`: the runs directory
    against [runs] budget (RunsBudget.figures), shown in the title."""

    BINDINGS = HISTORY_BINDINGS

    class OpenDiff(Message):
        """Diff run `a` (the older) against run `b`."""

        def __init__(self, a: RunRecord, b: RunRecord) -> None:
            super().__init__()
            self.a, self.b = a, b

    class CompareSimdScalar(Message):
        """Diff the newest SIMD run of `records` against the newest comparable scalar run."""

        def __init__(self, records: list[RunRecord]) -> None:
            super().__init__()
            self.records = records

    def __init__(self, load_runs: Callable[[], list[RunRecord]],
                 known_tokens: Callable[[str], int | None] | None = None,
                 disk: Callable[[], dict | None] | None = None) -> None:
        super().__init__()
        self.load_runs = load_runs
        self.known_tokens = known_tokens or (lambda _run_id: None)
        self.disk = disk or (lambda: None)
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
        yield SizeNotice()

    def on_mount(self) -> None:
        self.reload()

    def on_screen_resume(self) -> None:
        self.reload()

    def reload(self) -> None:
        try:
            self.records = self.load_runs()
        except Ds4fError as exc:
            self.records = []
            self.notify(str(exc), severity="error", timeout=8)
        table = self.query_one("#runs", DataTable)
        row = table.cursor_row
        table.clear()
        letters = group_letters(self.records)
        for r in self.records:
            table.add_row(*self._cells(r, letters), key=r.run_id)
        if self.records:
            table.move_cursor(row=min(max(0, row), len(self.records) - 1))
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(" run history ", "reverse bold")
        title.append(f" {len(self.records)} runs")
        disk = F.runs_dir_text(self.disk())
        if disk:
            title.append(f" · {disk}")
        title.append(" · =A, =B…: runs with the same state hash")
        self.query_one("#history-title", Static).update(title)
        self._detail()

    def _cells(self, r: RunRecord, letters: dict[str, str]) -> list:
        mark = Text("●", style="bold") if r.run_id in self.marked else ""
        state = Text(f"{F.state_mark(r.state)} {r.state}",
                     style={"failed": "bold red", "cancelled": "yellow"}.get(r.state, ""))
        sha = Text(r.state_sha256[:10] if r.state_sha256 else F.DASH)
        if r.state_sha256 in letters:
            sha.append(f" ={letters[r.state_sha256]}", "bold")
        spt = F.fmt_s_per_token(r.s_per_token)
        return [mark, r.run_id[-4:], F.fmt_when(r.started_at), state, r.preset, r.backend or F.DASH,
                F.record_tokens_text(r, self._known(r)), spt, sha]

    def _known(self, r: RunRecord) -> int | None:
        return None if r.report else self.known_tokens(r.run_id)

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
            text = F.record_text(r)
            if text is not None:
                width = max(20, self.query_one("#run-detail", Static).content_region.width or 76)
                out.append(f"text {text.settings}\n")
                turns = f"(turn {text.turns}) " if text.turns > 1 else ""
                for line in F.clip_text(F.printable(f"› {turns}{text.prompt}"), width, 1):
                    out.append(line + "\n", "bold")
                for line in F.clip_text(F.printable(f"‹ {text.output}") if text.output else "‹ (no text)", width, 2):
                    out.append(line + "\n")
            if r.state != "done":
                n, gen = F.record_tokens(r, self._known(r)), c.get("gen", "?")
                out.append(f"{r.state} after {n} of {gen} tokens\n" if n is not None else
                           f"{r.state}: {gen} tokens planned; the history has no count of those decoded\n",
                           "" if n is not None else "dim")
            if s:
                bound = f" · {s['bound']}-bound" if s.get("bound") else ""
                out.append(f"{F.fmt_s_per_token(s.get('s_per_token'))} s/token (first {F.fmt_seconds(s.get('s_first_token'))})"
                           f" · {F.fmt_gbps(s.get('eff_read_gbps'))} GB/s{bound}\n")
                out.append(cache_line(r) + "\n")
            if r.state_sha256:
                same = [x.run_id[-4:] for x in self.records if x.state_sha256 == r.state_sha256 and x is not r]
                out.append(f"sha256 {r.state_sha256}\n")
                if same:
                    out.append(f"same state as: {', '.join(same[:8])}\n", "bold")
            if r.error:
                out.append(f"error: {r.error}\n", "bold red")
        self.query_one("#run-detail", Static).update(out)

    # -- actions ------------------------------------------------------------------------------
    def action_back(self) -> None:
        if self.is_active:   # not gone (a second key of a burst), nor under help or the palette
            self.dismiss()

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
                self.notify("Mark two runs with space, then d (or highlight a run that has an older one below).",
                            severity="warning")
                return
            a, b = self.records[i + 1], self.records[i]
        self.post_message(self.OpenDiff(a, b))

    def action_compare_simd_scalar(self) -> None:
        self.post_message(self.CompareSimdScalar(self.records))

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
        self.notify("No other run has this state hash.")
