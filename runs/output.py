"""The text a run decodes: each generated token counted, the text it adds (complete UTF-8, no
pending stop string), and why the output ended (the end-of-sentence token, a stop string, the
token limit); a chat's answer as the next turn's assistant message."""
from __future__ import annotations

import threading

from ds4f.engine.text.chat import answer_message
from ds4f.engine.text.output import OutputText


class RunOutput:
    """A run's output, written by its thread (take), read from any thread."""

    def __init__(self, tokenizer, stop: tuple[str, ...], stop_at_eos: bool, eos_id: int,
                 lock: threading.Lock) -> None:
        self.tokenizer = tokenizer
        self._out = OutputText(tokenizer, tuple(stop)) if tokenizer is not None else None
        self.stop_at_eos, self.eos_id = stop_at_eos, eos_id
        self._lock = lock                   # the run's: its readers see the count and the ids together
        self.finish_reason: str | None = None
        self.generated = 0      # tokens picked after the prompt (an end-of-sentence one included)
        self._ids: list[int] = []   # their ids

    def take(self, token_id: int, last: bool) -> str:
        """Count a generated token and say what text it adds; sets the finish reason when the
        output ends here (the end-of-sentence token, a stop string, the token limit)."""
        with self._lock:
            self.generated += 1
            self._ids.append(int(token_id))
        out, piece = self._out, ""
        if self.stop_at_eos and token_id == self.eos_id:
            reason = "eos"
        else:
            if out is not None:
                piece, stopped = out.push(token_id)
                if stopped is not None:
                    self.finish_reason = "stop"
                    return piece
            reason = "length" if last else None
        if reason is not None:
            if out is not None:
                piece += out.finish()
            self.finish_reason = reason
        return piece

    @property
    def ids(self) -> tuple[int, ...]:
        """The ids of the tokens generated so far (an end-of-sentence token included)."""
        with self._lock:
            return tuple(self._ids)

    @property
    def text(self) -> str:
        """The text generated so far that is safe to show (complete UTF-8, no pending stop string);
        the whole output once the run has ended. "" when the checkpoint has no tokenizer."""
        out = self._out
        return out.text[:out.emitted] if out is not None else ""

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output (finish reason "stop"), else None."""
        out = self._out
        return out.stopped if out is not None and self.finish_reason == "stop" else None

    def assistant_message(self, config) -> dict | None:
        """A chat run's answer as the next turn's assistant message (engine.text.chat.answer_message:
        the content, the reasoning apart, and the ids generated for the content, so that the next
        turn's prompt begins with this run's state); None for a run that is not a chat's."""
        if config.messages is None or self.tokenizer is None:
            return None
        return answer_message(self.tokenizer, self.ids, self.text, config.thinking, config.tools,
                              config.tool_choice)
