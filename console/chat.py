"""The console's chat: the conversation so far, the prompt mode, and the slash commands of the
prompt line. No Textual here.

Three modes: "chat" (the chat format, the model answers), "think" (the chat format in thinking
mode: the model reasons, writes </think>, then answers) and "text" (plain completion: the typed
text is the prompt and the model continues it; no history). A chat turn enters the history when
its answer ends (done, or stopped: the partial answer stays); a run that fails leaves no turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ds4f.api import Ds4fError, GenerationDefaults, SamplingParams

MODES = ("chat", "think", "text")
MODE_NAMES = {"chat": "chat", "think": "chat, thinking", "text": "plain completion"}
PROMPT_KINDS = {"chat": "chat", "think": "thinking", "text": "completion"}
COMMANDS = ("/reset", "/chat", "/think", "/text", "/seed N")   # clear; the three modes; the sampling seed
COMMANDS_HELP = " ".join(COMMANDS)


@dataclass(frozen=True)
class Command:
    """A slash command typed in the prompt line: its name ("reset", "chat", ...) and argument."""

    name: str
    arg: str = ""


def parse_command(line: str) -> Command | None:
    """The slash command a prompt line holds (None: the line is a prompt). An unknown command is
    a Ds4fError that lists the known ones."""
    line = line.strip()
    if not line.startswith("/"):
        return None
    word, _, arg = line[1:].partition(" ")
    word, arg = word.lower(), arg.strip()
    if word in ("reset", "chat", "think", "text") and not arg:
        return Command(word)
    if word == "seed":
        if not (arg.isascii() and arg.isdigit()):
            raise Ds4fError(f"/seed: a whole number of 0 or more expected, got {arg!r}", param="seed")
        return Command("seed", arg)
    raise Ds4fError(f"{line.split()[0]}: unknown command (known: {COMMANDS_HELP})", param="prompt")


@dataclass
class Chat:
    """The conversation and the prompt settings of this console session."""

    mode: str = "chat"
    seed: int = 0
    messages: list[dict] = field(default_factory=list)   # finished turns, user and assistant

    @property
    def thinking(self) -> bool:
        return self.mode == "think"

    def next_mode(self) -> str:
        """chat -> think -> text -> chat; returns the new mode."""
        self.mode = MODES[(MODES.index(self.mode) + 1) % len(MODES)]
        return self.mode

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise Ds4fError(f"mode: one of {', '.join(MODES)} expected, got {mode!r}", param="mode")
        self.mode = mode

    def set_seed(self, seed: int) -> None:
        SamplingParams(seed=seed)   # its range check
        self.seed = seed

    def reset(self) -> None:
        self.messages.clear()

    def request(self, prompt: str) -> dict:
        """The RunConfig text fields for `prompt` in the current mode: the history and this turn
        as chat messages, or the text alone."""
        if not prompt.strip():
            raise Ds4fError("prompt: the prompt is empty", param="prompt")
        if self.mode == "text":
            return {"text": prompt}
        messages = tuple(dict(m) for m in self.messages) + ({"role": "user", "content": prompt},)
        return {"messages": messages, "thinking": self.thinking}

    def answered(self, request: dict, message: dict | None) -> None:
        """A chat answer ended (done or stopped): its turn (the run's assistant_message: the
        reasoning apart, since the chat format drops it from later prompts, and the ids generated
        for the content, so the next turn's prompt continues this run's state) joins the history.
        Completions leave no history."""
        messages = request.get("messages")
        if not messages or message is None:
            return
        self.messages = [dict(m) for m in messages] + [dict(message)]


@dataclass(frozen=True)
class TextSupport:
    """Whether the checkpoint reads and writes text: its tokenizer and default sampling, or why not."""

    ok: bool
    message: str = ""                          # why the prompt is disabled, in a line ("" when ok)
    detail: str = ""                           # the same with the path and the error
    defaults: GenerationDefaults | None = None
    demo: bool = False                         # the console's demo model: random weights, noise for text

    def sampling(self, seed: int) -> SamplingParams | None:
        return self.defaults.sampling(seed) if self.defaults is not None else None


CHECKING = TextSupport(False, "checking the checkpoint's tokenizer…")
