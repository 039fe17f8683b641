"""Streaming detokenisation: text as tokens arrive, never a broken UTF-8 sequence.

    stream = TextStream(tokenizer)
    for token in tokens:
        print(stream.push(token), end="")    # only complete characters
    print(stream.flush())                    # what is left, undecodable bytes as U+FFFD

A byte-level token may carry part of a multi-byte character (one token ends inside an emoji,
the next finishes it): the bytes wait until the character is complete. Bytes that can never
become valid UTF-8 come out as U+FFFD as soon as that is certain. The text pushed and flushed
for some ids equals tokenizer.decode(ids).
"""
from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, tokenizer, *, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text `token_id` completes (may be "", while a character is incomplete)."""
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """The bytes still waiting, decoded with errors="replace"; the stream starts afresh."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text

    @property
    def pending(self) -> bytes:
        """The bytes of an incomplete character held back."""
        return self._decoder.getstate()[0]
