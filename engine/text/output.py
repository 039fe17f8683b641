"""The text a run produces, token by token: what each token adds to the output, never a broken
UTF-8 sequence, never the start of a stop string that may still complete.

    out = OutputText(tokenizer, stop=("\\n\\n",))
    piece, stopped = out.push(token_id)   # piece: the text safe to show now; stopped: a stop string ended it
    rest = out.finish()                   # at the end (token limit, EOS): what was held back

A stop string ends the output before it (it is not part of the text), as OpenAI's `stop` does.
Text that could be the beginning of a stop string is held back until the next tokens decide.
"""
from __future__ import annotations

from ds4f.engine.text.stream import TextStream

THINK_END = "</think>"


class OutputText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._stream = TextStream(tokenizer)
        self._stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""          # the whole output so far, held-back text included
        self.emitted = 0        # characters of `text` handed out so far
        self.stopped: str | None = None   # the stop string that ended the output

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Add a generated token; (the text it lets out, the stop string if one ended the output)."""
        if self.stopped is not None:
            return "", self.stopped
        self.text += self._stream.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The output ends here: what the stream and the stop check held back."""
        if self.stopped is not None:
            return ""
        self.text += self._stream.flush()
        piece, _ = self._release(final=True)
        return piece

    def _release(self, final: bool) -> tuple[str, str | None]:
        if self._stop:
            start = max(0, self.emitted - self._longest)
            found = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
            if found:
                cut, self.stopped = min(found)
                self.text = self.text[:cut]
                piece, self.emitted = self.text[self.emitted:], len(self.text)
                return piece, self.stopped
        safe = len(self.text) if final else len(self.text) - self._held_back()
        piece = self.text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return piece, None

    def _held_back(self) -> int:
        """Characters at the end of the text that begin some stop string (and may still complete it)."""
        tail = self.text[-self._longest:] if self._longest else ""
        for k in range(len(tail), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self._stop):
                return k
        return 0


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, answer) of a chat output: in thinking mode the model writes its reasoning, then
    `</think>`, then the answer; in chat mode all of it is the answer."""
    if not thinking:
        return "", text
    reasoning, sep, answer = text.partition(THINK_END)
    return (reasoning, answer) if sep else (text, "")


class ReasoningSplit:
    """Thinking mode's output as it streams: the reasoning, then `</think>`, then the answer.
    push(piece) -> [(kind, text)] with kind `reasoning` or `answer` (names of the caller's
    choosing), the marker dropped; text that may be the start of the marker waits for the next
    piece, and finish() releases what is held. In chat mode (thinking False) everything is the
    answer. The one splitter behind the server's messages and deltas and the CLI's printing;
    split_reasoning is the same split of a whole text."""

    def __init__(self, thinking: bool, reasoning: str = "reasoning", answer: str = "answer") -> None:
        self.reasoning = thinking    # still in the reasoning
        self.held = ""
        self._kinds = (reasoning, answer)

    def push(self, piece: str) -> list[tuple[str, str]]:
        reasoning, answer = self._kinds
        if not self.reasoning:
            return [(answer, piece)] if piece else []
        text = self.held + piece
        i = text.find(THINK_END)
        if i >= 0:
            self.reasoning, self.held = False, ""
            return [(k, v) for k, v in ((reasoning, text[:i]), (answer, text[i + len(THINK_END):])) if v]
        keep = next((k for k in range(min(len(text), len(THINK_END) - 1), 0, -1) if THINK_END.startswith(text[-k:])), 0)
        out, self.held = text[:len(text) - keep], text[len(text) - keep:]
        return [(reasoning, out)] if out else []

    def finish(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        return [(self._kinds[0] if self.reasoning else self._kinds[1], held)] if held else []
