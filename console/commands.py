"""The command palette provider: every key action of the screen the palette was opened on.

It is built from the screen's active bindings that are the console's own (bindings.OWN_KEYS),
so a key and its palette entry can never drift apart, and a focused widget's scroll and cursor
keys stay out. The palette shows each action's keys next to its name. ConsolePalette is Textual's
palette made safe against key bursts; both the local console and the attached one open it.
"""
from __future__ import annotations

from functools import partial

from textual import work
from textual.await_complete import AwaitComplete
from textual.command import CommandPalette, DiscoveryHit, Hit, Hits, Provider
from textual.css.query import NoMatches

from .core.bindings import OWN_KEYS, TITLES, keys_of

SKIP_ACTIONS = {"command_palette"}


class ActionCommands(Provider):
    def _entries(self) -> list[tuple[str, str, object]]:
        screen = self.screen
        entries: list[tuple[str, str, object]] = []
        seen: set[str] = set()
        try:
            active = screen.active_bindings
        except Exception:
            return entries
        for key, (node, binding, _enabled, _tooltip) in active.items():
            own = OWN_KEYS.get((binding.action, key))
            if own is None or binding.action in seen or binding.action in SKIP_ACTIONS:
                continue
            seen.add(binding.action)
            binding = own
            name = TITLES.get(binding.action) or binding.description or binding.action
            title = f"{name[:1].upper()}{name[1:]}  ({keys_of(binding)})"
            help_text = binding.tooltip or name
            entries.append((title, help_text, partial(self.app.run_action, binding.action, node)))
        return entries

    async def discover(self) -> Hits:
        for title, help_text, callback in self._entries():
            yield DiscoveryHit(title, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, callback in self._entries():
            score = max(matcher.match(title), matcher.match(help_text) * 0.5)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, text=title, help=help_text)


def open_palette(app) -> None:
    """Open the console's command palette, at most one at a time: nothing when a palette is
    anywhere on the screen stack already (pushed by an earlier key of the same burst, mounted or
    not, or under a screen it opened). Each palette gets no fixed id, so one still being removed
    after it closed (its removal runs after the key that closed it) cannot clash with the next."""
    if not app.use_command_palette:
        return
    if any(isinstance(screen, CommandPalette) for screen in app.screen_stack):
        return
    app.push_screen(ConsolePalette())


class ConsolePalette(CommandPalette):
    """Textual's command palette, made safe against key bursts:

    - its search worker ends quietly when the palette was closed under it (typed letters, then
      Escape, before the search ran; or the console closing), instead of failing the worker, and
      the console with it, on the palette's vanished option list;
    - it closes only while it is the top screen: an Enter or Escape of a burst handled after it
      closed (Textual's palette dismisses itself once more then) would close the screen on top
      instead, a later palette or the help."""

    @work(exclusive=True, group=CommandPalette._GATHER_COMMANDS_GROUP)
    async def _gather_commands(self, search_value: str) -> None:
        try:
            await CommandPalette._gather_commands.__wrapped__(self, search_value)
        except NoMatches:
            if self.app.is_running and self.is_attached and self.is_current:
                raise      # the palette is still there: a real problem

    def dismiss(self, result=None) -> AwaitComplete:
        if not self.is_active:
            return AwaitComplete.nothing()
        return super().dismiss(result)
