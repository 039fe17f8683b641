"""The chat pane of the dashboard: the transcript as the answer streams in, and the prompt line.

The widgets draw what the app gives them (the prompt, the answer's text so far, how it ended);
the conversation itself lives in chat.Chat, the runs in the controller.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Input, Static

from ds4f.api import ReplyParser, parse_reply

from ..core.bindings import PROMPT_BINDINGS
from ..core.chat import CHECKING, COMMANDS_HELP, MODE_NAMES
from ..core.figures import printable
from .common import Panel


def answer_text(output: str, thinking: bool, done: bool = True, tools=None) -> Text:
    """An answer as the transcript shows it: in thinking mode the reasoning dimmed, then (once
    </think> came) the answer on a line of its own, then each tool call the model made as a call,
    `→ name {arguments}` (read by the engine's answer reader: a call block still being written
    shows once it closes, never as raw DSML; one that does not parse is the answer's text once
    the answer is `done`). `tools`: the function schemas the turn offered; without them DSML is text."""
    if done:
        reply = parse_reply(output, thinking, tools or None, calls=bool(tools))
    else:                  # so far: what may still become a marker or a call waits
        parser = ReplyParser(thinking, tools or None, calls=bool(tools))
        parser.push(output)
        reply = parser.result
    t = Text()
    if reply.reasoning:
        t.append(printable(reply.reasoning), "dim italic")
        if reply.reasoning != output:
            t.append("\n")
    t.append(printable(reply.content))
    for call in reply.calls:
        if t.plain and not t.plain.endswith("\n"):
            t.append("\n")
        t.append("→ ", "bold cyan")
        t.append(printable(call["name"]), "bold cyan")
        t.append(" " + printable(call["arguments"]), "cyan")
    return t


class Transcript(VerticalScroll):
    """The conversation: prompts, answers (the last one growing as it streams), notes. It stays
    scrolled to the end as text arrives and as it is resized, unless the operator scrolls up."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._answer: Static | None = None   # the answer being written
        self._shown: tuple[str, str, bool] | None = None

    def on_mount(self) -> None:
        self.anchor()

    def _add(self, content: Text, classes: str = "") -> Static:
        entry = Static(content, classes=f"entry {classes}".strip())
        self.mount(entry)
        return entry

    def add_note(self, text: str, style: str = "dim") -> None:
        """A line of the console's own (a mode change, an error, what the model is)."""
        self._add(Text(text, style=style), "note")

    def add_prompt(self, prompt: str, mode: str) -> None:
        t = Text()
        t.append(f"{mode} › ", "bold")
        t.append(printable(prompt), "bold")
        self._add(t, "prompt")

    def start_answer(self, status: str = "…") -> None:
        """A new answer: `status` (reading the prompt...) until its first text arrives."""
        self._answer = self._add(Text(status, style="dim italic"), "answer")
        self._shown = None

    def show_answer(self, output: str, thinking: bool, status: str = "", done: bool = True, tools=None) -> None:
        """The answer so far (`status`: what shows before any text, e.g. 'reading the prompt…';
        `done`: the whole answer, else what has come of it; `tools`: the schemas the turn offered)."""
        if self._answer is None or self._shown == (output, status, done):
            return
        self._shown = (output, status, done)
        self._answer.update(answer_text(output, thinking, done, tools) if output else Text(status or "…", style="dim italic"))

    def end_answer(self, line: str, style: str = "dim") -> None:
        """The answer ended: its last line says how (end of answer, stopped, failed)."""
        if self._answer is not None and not (self._shown and self._shown[0]):
            self._answer.update(Text("(no text)", style="dim italic"))
        self._answer = None
        self._shown = None
        self._add(Text(line, style=style), "ending")

    def clear(self) -> None:
        self._answer = None
        self._shown = None
        self.remove_children()

    @property
    def entries(self) -> list[Text]:
        """What the transcript shows, entry by entry."""
        return [e.content if isinstance(e.content, Text) else Text(str(e.content)) for e in self.query(Static)]

    @property
    def plain(self) -> str:
        return "\n".join(t.plain for t in self.entries)


class PromptInput(Input):
    """The prompt line: enter sends, esc leaves it (then the dashboard's letter keys work again)."""

    BINDINGS = PROMPT_BINDINGS

    class Leave(Message):
        """The operator left the prompt line."""

    def action_leave(self) -> None:
        self.post_message(self.Leave())


class ChatPanel(Panel):
    """The transcript and, under it, the prompt line with the mode it sends in."""

    def __init__(self) -> None:
        super().__init__("transcript", id="p-chat")

    def compose(self) -> ComposeResult:
        yield Transcript(id="transcript")
        with Horizontal(id="prompt-line"):
            yield Static(id="prompt-mode")
            yield PromptInput(id="prompt", placeholder=CHECKING.message, disabled=True)

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    def set_prompt(self, mode: str, sampling: str, enabled: bool, reason: str = "") -> None:
        """The prompt line's mode and state, and the panel's subtitle (mode and sampling)."""
        self.query_one("#prompt-mode", Static).update(Text(f"{mode} ›", style="bold" if enabled else "dim"))
        prompt = self.prompt
        prompt.disabled = not enabled
        prompt.placeholder = f"type, enter sends · {COMMANDS_HELP}" if enabled else reason
        self.border_subtitle = f"{MODE_NAMES[mode]} · {sampling}" if enabled else "no text"
