"""The console's chat: the conversation so far, the prompt mode, and the slash commands of the
prompt line. No Textual here.

Three modes: "chat" (the chat format, the model answers), "think" (the chat format in thinking
mode: the model reasons, writes </think>, then answers) and "text" (plain completion: the typed
text is the prompt and the model continues it; no history). A chat turn enters the history when
its answer ends (done, or stopped: the partial answer stays); a run that fails leaves no turn.

Tools: `/system TEXT` sets the system prompt, `/tools FILE` offers the function schemas of a JSON
file (a list, in OpenAI's tool shape or bare {name, description, parameters}); a call the model
makes shows as a call, and `/result TEXT` answers it, as the tool would (one /result per call, in
the order they were made); the last one sends the results to the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ds4f.api import Ds4fError, GenerationDefaults, SamplingParams, check_tools, read_regular_json

MODES = ("chat", "think", "text")
MODE_NAMES = {"chat": "chat", "think": "chat, thinking", "text": "plain completion"}
PROMPT_KINDS = {"chat": "chat", "think": "thinking", "text": "completion"}
COMMANDS = ("/reset", "/chat", "/think", "/text", "/seed N",   # clear; the three modes; the sampling seed
            "/system TEXT", "/tools FILE", "/result TEXT")     # the system prompt; tools; a call's result
MAX_TOOLS_FILE = 1 << 20
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
    if word in ("system", "tools"):             # no argument: none
        return Command(word, arg)
    if word == "result":
        if not arg:
            raise Ds4fError("/result: the tool's result expected, e.g. /result {\"sky\": \"sunny\"}", param="prompt")
        return Command(word, arg)
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
    messages: list[dict] = field(default_factory=list)   # finished turns: user, assistant, tool results
    system: str = ""                                     # the system prompt ("" none)
    tools: tuple = ()                                    # the function schemas offered

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
        return self._chat_request(self.messages + [{"role": "user", "content": prompt}])

    def _chat_request(self, turns: list[dict]) -> dict:
        system = ({"role": "system", "content": self.system},) if self.system else ()
        request = {"messages": system + tuple(dict(m) for m in turns), "thinking": self.thinking}
        if self.tools:
            request["tools"] = self.tools
        return request

    def pending_calls(self) -> list[str]:
        """The ids of the last answer's calls that no /result answered yet."""
        if not self.messages or self.mode == "text":
            return []
        k = max((i for i, m in enumerate(self.messages) if m["role"] == "assistant"), default=None)
        if k is None or not self.messages[k].get("tool_calls"):
            return []
        answered = {m.get("tool_call_id") for m in self.messages[k + 1:] if m["role"] == "tool"}
        if any(m["role"] == "user" for m in self.messages[k + 1:]):
            return []
        return [c["id"] for c in self.messages[k]["tool_calls"] if c["id"] not in answered]

    def result(self, text: str) -> dict | None:
        """/result: the next pending call's result joins the history; once every call has one, the
        request that sends them to the model (None while calls wait for theirs)."""
        pending = self.pending_calls()
        if not pending:
            raise Ds4fError("/result: no tool call waits for a result (the model's last answer made none)",
                            param="prompt")
        self.messages.append({"role": "tool", "tool_call_id": pending[0], "content": text})
        return self._chat_request(self.messages) if len(pending) == 1 else None

    def set_system(self, text: str) -> None:
        self.system = text

    def load_tools(self, path: str) -> int:
        """/tools FILE: the function schemas of a JSON file (none: no path); how many."""
        if not path:
            self.tools = ()
            return 0
        file = Path(path).expanduser()
        # a regular file only (a FIFO or /dev/zero is refused without blocking the interface), at
        # most MAX_TOOLS_FILE bytes read whatever st_size says, nested within the JSON bound
        tools = read_regular_json(file, "/tools", MAX_TOOLS_FILE)
        try:
            self.tools = check_tools(tools)
        except Ds4fError as exc:
            raise Ds4fError(f"/tools {file}: {exc.message}", path=file) from None
        except RecursionError:     # a schema nested within the file's bound, still too deep to check
            raise Ds4fError(f"/tools {file}: the schemas nest too deeply to check", path=file) from None
        return len(self.tools)

    def answered(self, request: dict, message: dict | None) -> None:
        """A chat answer ended (done or stopped): its turn (the run's assistant_message: the
        reasoning apart, its calls, and the ids generated for the answer, so the next turn's prompt
        continues this run's state) joins the history. Completions leave no history; the system
        prompt is not history (/system may change it)."""
        messages = request.get("messages")
        if not messages or message is None:
            return
        self.messages = [dict(m) for m in messages if m["role"] != "system"] + [dict(message)]


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
