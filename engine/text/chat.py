"""DeepSeek-V4's chat prompt format (the release's encoding/encoding_dsv4.py, without tools).

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>         (thinking mode; chat mode ends with </think>)

System text goes in as it is, with no role token. Each user turn is <｜User｜> + its text. Each
earlier assistant turn is <｜Assistant｜></think> + its content + <｜end▁of▁sentence｜>: its
reasoning is dropped. The prompt ends with <｜Assistant｜> and <think> (thinking mode: the model
reasons first, then writes </think> and the answer) or </think> (chat mode: straight to the
answer). The last message must be the user's.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ds4f.errors import Ds4fError
from ds4f.engine.text.tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER

ROLES = ("system", "user", "assistant")


def _check(messages: Sequence[Mapping]) -> list[tuple[str, str]]:
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
        out.append((role, content))
    if not out or out[-1][0] != "user":
        raise Ds4fError("messages: the last message must be the user's (the model answers it)", param="messages")
    return out


def render_chat(messages: Sequence[Mapping], thinking: bool = False) -> str:
    """The prompt text, BOS and the special token strings inline (see the module docstring)."""
    parts = [BOS]
    for role, content in _check(messages):
        if role == "system":
            parts.append(content)
        elif role == "user":
            parts += [USER, content]
        else:
            parts += [ASSISTANT, END_THINK, content, EOS]
    parts += [ASSISTANT, THINK if thinking else END_THINK]
    return "".join(parts)


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping], thinking: bool = False) -> list[int]:
    """The prompt's token ids, BOS first."""
    for s in (BOS, USER, ASSISTANT, THINK, END_THINK, EOS):
        tokenizer.special_id(s)   # a Ds4fError naming the tokenizer if it lacks a marker
    ids = tokenizer.encode(render_chat(messages, thinking))
    if not ids or ids[0] != tokenizer.special_id(BOS):
        raise Ds4fError(f"{tokenizer.path}: does not encode {BOS} as one token", path=tokenizer.path)
    return ids
