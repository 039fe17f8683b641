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
