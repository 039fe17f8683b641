"""DeepSeek-V4's chat prompt format (the release's encoding/encoding_dsv4.py, without tools).

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>         (thinking mode; chat mode ends with </think>)

System text goes in as it is, with no role token. Each user turn is <｜User｜> + its text. Each
earlier assistant turn is <｜Assistant｜></think> + its content + <｜end▁of▁sentence｜>: its
reasoning is dropped. The prompt ends with <｜Assistant｜> and <think> (thinking mode: the model
reasons first, then writes </think> and the answer) or </think> (chat mode: straight to the
answer). The last message must be the user's.

The markers are the format's alone: every content is encoded as text (Tokenizer.encode_text), so
a message holding "<｜Assistant｜>" or "</think>" is those characters, never the control tokens
(render_chat's text, read back with Tokenizer.encode, would make them control tokens: it is for
showing, not for the model).

An earlier assistant turn may carry `tokens`: the ids the model generated for its content. When
they still spell the content exactly, the prompt holds those ids rather than the tokenizer's
reading of the text (a model's output seldom re-tokenizes to the ids it was sampled as), so a
conversation's prompt begins with the state its last turn left: the prefix cache then reuses the
answers too, not only what came before them. They come from this process (the console, `ds4f
chat`), never from a client.

A client that sends answers back as text (an OpenAI client) gets the same from `kept`: the token
ids of the states the prefix cache keeps. An earlier answer without `tokens` is then spelled the
way a kept state continues the prompt so far, as far as that state spells the answer's bytes, and
tokenized only after that (the ids already computed stay authoritative, as in antirez/ds4).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ds4f.errors import Ds4fError
from ds4f.engine.text.output import split_reasoning
from ds4f.engine.text.tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER

ROLES = ("system", "user", "assistant")


def _check(messages: Sequence[Mapping]) -> list[tuple[str, str, tuple[int, ...] | None]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise Ds4fError("messages: a list of {role, content} messages expected", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise Ds4fError(f"messages[{i}]: a {{role, content}} mapping expected", param="messages")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise Ds4fError(f"messages[{i}]: role {role!r} is not one of {', '.join(ROLES)}", param="messages")
        if not isinstance(content, str):
            raise Ds4fError(f"messages[{i}]: content must be a string", param="messages")
        reasoning = m.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise Ds4fError(f"messages[{i}]: reasoning must be a string", param="messages")
        tokens = m.get("tokens")
        if tokens is not None:
            if role != "assistant" or isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) \
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
                raise Ds4fError(f"messages[{i}]: tokens, on an assistant message only, must be a list of token ids",
                                param="messages")
            tokens = tuple(tokens)
        out.append((role, content, tokens))
    if not out or out[-1][0] != "user":
        raise Ds4fError("messages: the last message must be the user's (the model answers it)", param="messages")
    return out


def _rendered(role: str, content: str) -> str:
    """One message as the prompt holds it."""
    if role == "system":
        return content
    if role == "user":
        return USER + content
    return ASSISTANT + END_THINK + content + EOS


def _opening(thinking: bool) -> str:
    """What follows the last user message: the assistant's turn, reasoning first or not."""
    return ASSISTANT + (THINK if thinking else END_THINK)


def render_chat(messages: Sequence[Mapping], thinking: bool = False) -> str:
    """The prompt text, BOS and the special token strings inline (see the module docstring)."""
    return BOS + "".join(_rendered(role, content) for role, content, _ in _check(messages)) + _opening(thinking)


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping], thinking: bool = False,
                    kept: Sequence[Sequence[int]] = ()) -> list[int]:
    """The prompt's token ids, BOS first: the format's markers as their control tokens, every
    content as text (a special token's string in a message is ordinary text: no content can forge
    a turn). `kept`: the token ids of kept states, to spell earlier answers given as text alone
    (see the module docstring)."""
    bos, user, assistant, think, end_think, eos = (tokenizer.special_id(s)   # a Ds4fError naming the
                                                   for s in (BOS, USER, ASSISTANT, THINK, END_THINK, EOS))  # tokenizer
    ids = [bos]
    for role, content, tokens in _check(messages):
        if role == "system":
            ids += tokenizer.encode_text(content)
        elif role == "user":
            ids += [user] + tokenizer.encode_text(content)
        else:                  # its ids when they are known: given, or as a kept state spells it
            ids += [assistant, end_think]
            spelled = list(tokens) if tokens is not None and tokenizer.decode(tokens) == content \
                else _as_kept(tokenizer, content, ids, kept) if kept else None
            ids += (spelled if spelled is not None else tokenizer.encode_text(content)) + [eos]
    return ids + [assistant, think if thinking else end_think]


TRIES = 8      # tokens _as_kept gives back at most, looking for a spelling of the rest


def _as_kept(tokenizer, content: str, prefix: list[int], kept: Sequence[Sequence[int]]) -> list[int] | None:
    """`content` spelled as the kept state that spells most of it after `prefix` does (the rest
    tokenized), or None when no kept state continues `prefix` with any of it. A kept state ends a
    token short of a run's answer (the last pick is not fed), so its tail is usually a prefix of the
    content; an undecodable byte sequence at its end costs a token or a few."""
    n, best = len(prefix), None
    for tokens in kept:
        if len(tokens) <= n or list(tokens[:n]) != prefix:
            continue
        tail = list(tokens[n:])   # up to its first control token: text spells no control token
        tail = tail[:next((i for i, t in enumerate(tail) if tokenizer.is_special(t)), len(tail))]
        for k in range(len(tail), max(len(tail) - TRIES, 0), -1):
            if best is not None and k <= best[0]:
                break
            said = tokenizer.decode(tail[:k])
            if not content.startswith(said):
                continue
            rest = content[len(said):]
            spelled = tail[:k] + (tokenizer.encode_text(rest) if rest else [])
            if tokenizer.decode(spelled) == content:
                best = (k, spelled)
                break
    return best[1] if best is not None else None


def answer_message(tokenizer, generated: Sequence[int], text: str, thinking: bool) -> dict:
    """An answer as the assistant message of the next turn: its content (the reasoning apart, as
    `reasoning`) and, when they spell the content exactly, the ids the model generated for it
    (`tokens`: after </think> in thinking mode, the end-of-sentence token left out).
    `generated`: the run's picked ids; `text`: its output text."""
    reasoning, answer = split_reasoning(text, thinking)
    message = {"role": "assistant", "content": answer}
    if reasoning:
        message["reasoning"] = reasoning
    ids = list(generated)
    if thinking:
        end = tokenizer.special_id(END_THINK)
        ids = ids[ids.index(end) + 1:] if end in ids else []
    eos = tokenizer.special_id(EOS)
    if eos in ids:
        ids = ids[:ids.index(eos)]
    if tokenizer.decode(ids) == answer:
        message["tokens"] = ids
    return message
