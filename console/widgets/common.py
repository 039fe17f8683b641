"""Widgets of the console: panels, history plots with a floor line, per-layer strips, meters
and the wrapping key bar. They draw what they are given; the screens decide what that is.
"""
from __future__ import annotations

import math
from typing import Sequence

from rich.style import Style
from rich.text import Text
from textual.containers import Vertical
from textual.geometry import Size
from textual.events import Resize
from textual.widget import Widget
from textual.widgets import Input, RichLog

from ..core.bindings import OWN_KEYS, typed
from ..core.thresholds import LEVELS

BLOCKS = " ▁▂▃▄▅▆▇█"


class EventLog(RichLog):
    """The event log: wraps to its width, and re-wraps everything when the width changes
    (a resized terminal, or a layout switch between narrow and wide)."""

    KEEP = 500

    def __init__(self, *, id: str | None = None, classes: str | None = None):
        super().__init__(id=id, classes=classes, max_lines=self.KEEP, wrap=True, markup=False, highlight=False,
                         min_width=10)
        self.entries: list[Text] = []
        self._wrapped_at = 0

    def add(self, text: Text) -> None:
        self.entries.append(text)
        if len(self.entries) > self.KEEP:
            del self.entries[: len(self.entries) - self.KEEP]
        self._write(text)

    def _write(self, text: Text) -> None:
        width = self.scrollable_content_region.width
        self.write(text, width=width if width > 0 else None, scroll_end=True)

    def on_resize(self, event: Resize) -> None:
        super().on_resize(event)
        width = self.scrollable_content_region.width
        if width and width != self._wrapped_at:
            self._wrapped_at = width
            self.clear()
            for entry in self.entries:
                self._write(entry)


class Panel(Vertical):
    """A bordered dashboard panel whose border colour and subtitle say its threshold level."""

    DEFAULT_CSS = """
    Panel { height: 1fr; }
    """

    def __init__(self, title: str, *children: Widget, id: str | None = None, classes: str | None = None):
        super().__init__(*children, id=id, classes=classes)
        self.border_title = title
        self.level: str | None = None

    def set_level(self, level: str | None, note: str | None = None) -> None:
        subtitle = " · ".join(x for x in (note, level) if x) or None
        if (level, subtitle) == (self.level, self.border_subtitle):
            return
        self.level = level
        for name in LEVELS:
            self.set_class(level == name, f"-{name}")
        self.border_subtitle = subtitle


class _Styled(Widget):
    """Base for widgets that draw with component-class styles from the theme."""

    def style_of(self, name: str) -> Style:
        return self.get_component_rich_style(name, partial=True)


class Plot(_Styled):
    """Values as block-character columns with an optional horizontal reference line (the NVMe
    floor, a tolerance) drawn across the empty cells.

    mode "tail": a history, newest on the right; what does not fit scrolls off the left.
    mode "fit": a fixed series (one value per layer), left-aligned; when there are more values
    than columns, each column shows the largest value of its share. `marker` puts a ▲ under
    the column of one index (e.g. the layer where routing first differs).
    """

    COMPONENT_CLASSES = {"plot--bar", "plot--floor", "plot--axis", "plot--above", "plot--over", "plot--marker"}
    DEFAULT_CSS = """
    Plot { height: 1fr; min-height: 1; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None, max_col_width: int = 3,
                 mode: str = "tail", above_is_bad: bool = False):
        super().__init__(id=id, classes=classes)
        self.above_is_bad = above_is_bad  # colour for values at/over the line: good (floor) or bad (tolerance)
        self.values: list[float] = []
        self.floor: float | None = None
        self.maximum: float | None = None
        self.marker: int | None = None
        self.max_col_width = max_col_width
        self.mode = mode

    def set_data(self, values: Sequence[float], floor: float | None = None, maximum: float | None = None,
                 marker: int | None = None) -> None:
        values = [max(0.0, float(v)) if v is not None and math.isfinite(v) else 0.0 for v in values]
        if (values, floor, maximum, marker) == (self.values, self.floor, self.maximum, self.marker):
            return
        self.values, self.floor, self.maximum, self.marker = values, floor, maximum, marker
        self.refresh()

    def scale(self, values: Sequence[float]) -> float:
        if self.maximum:
            return self.maximum
        top = max([*values, self.floor or 0.0, 0.0])
        return top * 1.15 if top > 0 else 1.0

    def columns(self, width: int) -> tuple[list[float], int, int | None]:
        """(the values shown, the width of each, the column of the marker)."""
        values, n = self.values, len(self.values)
        if not n:
            return [], 1, None
        if self.mode == "fit" and n > width:
            cols = [max(values[i * n // width:max(i * n // width + 1, (i + 1) * n // width)]) for i in range(width)]
            mark = None if self.marker is None else min(width - 1, self.marker * width // n)
            return cols, 1, mark
        col_w = max(1, min(self.max_col_width, width // n))
        shown = values[-(width // col_w):]
        mark = None
        if self.marker is not None and self.mode == "fit":
            mark = self.marker * col_w + col_w // 2
        return shown, col_w, mark

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        if width <= 0 or height <= 0:
            return Text()
        plot_h = height - 1 if self.marker is not None and height > 1 else height
        shown, col_w, mark = self.columns(width)
        scale = self.scale(shown)
        total = plot_h * 8
        levels = [min(total, round(v / scale * total)) for v in shown]
        floor_row = None
        if self.floor is not None and self.floor > 0:
            f = min(total - 1, int(self.floor / scale * total))
            floor_row = plot_h - 1 - f // 8
        bar, floor_st = self.style_of("plot--bar"), self.style_of("plot--floor")
        above = self.style_of("plot--over" if self.above_is_bad else "plot--above")
        pad = width - len(shown) * col_w
        text = Text(no_wrap=True, overflow="crop")
        for row in range(plot_h):
            base = (plot_h - 1 - row) * 8
            line_char = "─" if row == floor_row else " "
            empty_st = floor_st if row == floor_row else bar
            if self.mode != "fit":
                text.append(line_char * pad, empty_st)
            for lv, v in zip(levels, shown):
                fill = max(0, min(8, lv - base))
                if fill == 0:
                    text.append(line_char * col_w, empty_st)
                else:
                    st = above if self.floor is not None and v >= self.floor else bar
                    text.append(BLOCKS[fill] * col_w, st)
            if self.mode == "fit":
                text.append(line_char * pad, empty_st)
            if row < height - 1:
                text.append("\n")
        if plot_h < height:
            line = [" "] * width
            if mark is not None and 0 <= mark < width:
                line[mark] = "▲"
            text.append("".join(line), self.style_of("plot--marker"))
        return text


class LayerStrip(_Styled):
    """Per-layer hit rate: one cell per layer, its height the rate, its colour the level."""

    COMPONENT_CLASSES = {"strip--fine", "strip--careful", "strip--warning", "strip--critical", "strip--none",
                         "strip--label"}
    DEFAULT_CSS = """
    LayerStrip { height: auto; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None,
                 bounds: tuple[float, float, float] = (0.7, 0.5, 0.3)):
        super().__init__(id=id, classes=classes)
        self.rates: list[float | None] = []
        self.bounds = bounds

    def set_rates(self, rates: Sequence[float | None]) -> None:
        rates = list(rates)
        if rates != self.rates:
            self.rates = rates
            self.refresh(layout=True)

    def _per_line(self, width: int) -> int:
        return max(1, width - 4)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        n = len(self.rates)
        return max(1, math.ceil(n / self._per_line(width))) if n else 1

    def _level(self, r: float | None) -> str:
        if r is None:
            return "none"
        fine, careful, warning = self.bounds
        return "fine" if r >= fine else "careful" if r >= careful else "warning" if r >= warning else "critical"

    def render(self) -> Text:
        width = self.size.width or 40
        per = self._per_line(width)
        text = Text(no_wrap=True, overflow="crop")
        label = self.style_of("strip--label")
        if not self.rates:
            text.append("L   no layers yet", label)
            return text
        for start in range(0, len(self.rates), per):
            if start:
                text.append("\n")
            text.append(f"L{start:<3d}"[:4], label)
            for r in self.rates[start:start + per]:
                lv = self._level(r)
                ch = "·" if r is None else BLOCKS[max(1, min(8, round(r * 8)))]
                text.append(ch, self.style_of(f"strip--{lv}"))
        return text


class Meter(_Styled):
    """A one-line bar: label, filled fraction coloured by level, and the figures."""

    COMPONENT_CLASSES = {"meter--fine", "meter--careful", "meter--warning", "meter--critical", "meter--empty",
                         "meter--none"}
    DEFAULT_CSS = """
    Meter { height: 1; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None, bar_width: int = 12):
        super().__init__(id=id, classes=classes)
        self.fraction: float | None = None
        self.level: str | None = None
        self.label = ""
        self.figures = ""
        self.bar_width = bar_width

    def set(self, fraction: float | None, level: str | None, label: str, figures: str) -> None:
        state = (fraction, level, label, figures)
        if state != (self.fraction, self.level, self.label, self.figures):
            self.fraction, self.level, self.label, self.figures = state
            self.refresh()

    def render(self) -> Text:
        width = self.size.width or 40
        text = Text(no_wrap=True, overflow="ellipsis")
        if self.label:
            text.append(self.label + " ")
        bar_w = max(4, min(self.bar_width * 3, width - len(text) - len(self.figures) - 1))
        frac = 0.0 if self.fraction is None else max(0.0, min(1.0, self.fraction))
        full = int(frac * bar_w * 8)
        cells, part = divmod(full, 8)
        fill_st = self.style_of(f"meter--{self.level or 'none'}")
        text.append("█" * cells, fill_st)
        if cells < bar_w:
            text.append(" ▏▎▍▌▋▊▉"[part] if part else "", fill_st)
            text.append("░" * (bar_w - cells - (1 if part else 0)), self.style_of("meter--empty"))
        text.append(" " + self.figures)
        return text


class KeyBar(_Styled):
    """The key footer, htop-style, wrapping onto as many lines as the width needs so that every
    key of the screen stays visible even at 80 columns. Keys in a Binding.Group share one label.
    While a text field has the cursor, the keys it takes as characters (letters, space, :...)
    type rather than act, so the bar shows the console's keys that still act (enter, esc, ctrl+…)."""

    COMPONENT_CLASSES = {"keybar--key", "keybar--label"}
    DEFAULT_CSS = """
    KeyBar { dock: bottom; height: auto; }
    """

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self._bindings_changed)

    def _bindings_changed(self, _screen) -> None:
        self.refresh(layout=True)

    def items(self) -> list[tuple[str, str]]:
        seen: dict[str, int] = {}
        actions: set[str] = set()
        items: list[tuple[str, str]] = []
        try:
            active = self.screen.active_bindings
        except Exception:
            return items
        focused = self.screen.focused
        typing = isinstance(focused, Input) and not focused.disabled
        for key, (_node, binding, enabled, _tooltip) in active.items():
            if typing:
                shown = (binding.show or (binding.action, key) in OWN_KEYS) and binding.action != "command_palette"
                if typed(key) or not shown or binding.action in actions:
                    continue
            elif not binding.show or binding.action in actions:
                continue
            actions.add(binding.action)
            key = self.app.get_key_display(binding)   # one key each: Textual splits "a,b" bindings
            if binding.group is not None:
                label = binding.group.description
                if label in seen:
                    k, lab = items[seen[label]]
                    if key not in k.split("/"):
                        items[seen[label]] = (f"{k}/{key}" if len(key) > 1 or len(k) > 1 else k + key, lab)
                    continue
                seen[label] = len(items)
                items.append((key, label))
            elif binding.description:
                items.append((key, binding.description))
        if self.app.ENABLE_COMMAND_PALETTE and "command_palette" not in actions:
            items.append(("^p", "cmds"))
        return items

    def _lines(self, width: int) -> list[list[tuple[str, str]]]:
        lines: list[list[tuple[str, str]]] = [[]]
        used = 0
        for key, label in self.items():
            w = len(key) + 1 + len(label)
            if lines[-1] and used + 2 + w > width:
                lines.append([])
                used = 0
            used += (2 if lines[-1] else 0) + w
            lines[-1].append((key, label))
        return lines

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._lines(max(10, width)))

    def render(self) -> Text:
        key_st, label_st = self.style_of("keybar--key"), self.style_of("keybar--label")
        text = Text(no_wrap=True, overflow="crop")
        for n, line in enumerate(self._lines(max(10, self.size.width))):
            if n:
                text.append("\n")
            for i, (key, label) in enumerate(line):
                if i:
                    text.append("  ", label_st)
                text.append(key, key_st)
                text.append(" " + label, label_st)
        return text



MIN_SIZE = (80, 24)  # the smallest terminal the console is laid out for


class SizeNotice(Widget):
    """Over a screen smaller than MIN_SIZE (the app's -too-narrow / -too-short breakpoint classes
    make the stylesheet show it): the terminal's size and what the console needs. Keys still
    work underneath (q quits)."""

    DEFAULT_CSS = """
    SizeNotice { display: none; }
    """

    def render(self) -> Text:
        w, h = self.app.size
        need_w, need_h = MIN_SIZE
        t = Text()
        t.append("terminal too small", "bold")
        t.append(f"\n{w}×{h}: ds4f-console needs at least {need_w}×{need_h}")
        t.append("\nenlarge the window, or press q to quit")
        return t
