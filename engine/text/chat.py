"""DeepSeek-V4's chat prompt format: the release's encoding_dsv4.py (encode_messages), for the
Flash checkpoint; tool_choice as DeepSeek's own encoder (deepseek-recipe) renders it.

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>         (thinking mode; chat mode ends with </think>)

System text goes in as it is, with no role token, where it stands. A developer message is a turn
of its own, <｜User｜> + its text. A system message that follows a user's turn (or ends the
conversation) is rendered as a developer message: the release's file would leave the prompt
without its <｜Assistant｜>. Each run of user messages and tool results is one user turn:
<｜User｜> + its parts joined by a blank line, a tool result as <tool_result>...</tool_result>, the
results in the order of the calls they answer. Each earlier assistant turn is its content + its
tool calls (DSML, see engine.text.dsml) + <｜end▁of▁sentence｜>. A user or developer turn that an
assistant turn follows, or that ends the conversation, ends with <｜Assistant｜> and <think>
(thinking mode: the model reasons first, then writes </think> and the answer) or </think> (chat
mode: straight to the answer).

Tools: the function schemas (name, description, parameters) go at the end of the first system
prompt, after two newlines, as the "## Tools" section (an empty system prompt is put first when
there is none). tool_choice "none" leaves the section out (the model is not told of the tools,
and its answer is read as text); a function's name lists only that function; "required" or a
name ends the prompt with the calls block's opening, `\n\n<｜DSML｜tool_calls>\n`, in chat mode
(thinking mode has no forced call: refused, as DeepSeek's encoder refuses it).

Reasoning: thinking mode without tools drops the reasoning of earlier turns, and the developer
turns before the last user turn; with tools every assistant turn keeps its reasoning,
<think>{reasoning}</think>{answer}. reasoning_effort "max" opens a thinking-mode prompt with the
release's instruction to reason exhaustively ("high" and the others add nothing).

Token ids: the format's markers (BOS, EOS, <｜User｜>, <｜Assistant｜>, <think>, </think>, ｜DSML｜)
in the format's own text are their control tokens; each maximal run of text between two markers,
the format's text and the messages' together, is tokenized whole with no added tokens
(Tokenizer.encode_text). So a conversation whose messages hold no marker string gets the ids of
the release's string tokenized whole (the BPE merges across `}}` and `\n\n`, `.` and `\n\n`,
`>` and `\n` as it does there), and a marker string in a message, a schema or a tool result is
always those characters, never a control token (the release's whole-string tokenization would
forge it: render_chat's text is for showing, not for the model).

An earlier assistant turn may carry `tokens`: the ids the model generated for its answer (content
and calls). When they still spell it exactly, the prompt holds those ids rather than the
tokenizer's reading of the text (a model's output seldom re-tokenizes to the ids it was sampled
as), so a conversation's prompt begins with the state its last turn left: the prefix cache then
reuses the answers too, not only what came before them. They come from this process (the
console, `ds4f chat`), never from a client.

A client that sends answers back as text (an OpenAI client) gets the same from `kept`: the token
ids of the states the prefix cache keeps. An earlier answer (or reasoning) without `tokens` is then
spelled the way a kept state continues the prompt so far, as far as that state spells the answer's
bytes, and tokenized only after that (the ids already computed stay authoritative, as in
antirez/ds4).
"""
from __future__ import annotations

import json
import re
import weakref
from typing import Mapping, Sequence

from ds4f.errors import Ds4fError
from ds4f.engine.text.dsml import (CALLS_START, DSML, REASONING_EFFORT_MAX, TOOL_RESULT, check_call,
                                   check_text, check_tools, pieces_text, render_calls, render_tools)
from ds4f.engine.text.reply import parse_reply
from ds4f.engine.text.tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER

ROLES = ("system", "developer", "user", "assistant", "tool")
# The format's markers: in its own text they are their control tokens (where the tokenizer has them);
# in a message they are text.
MARKERS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML)
EFFORTS = ("low", "medium", "high", "max")


def _fail(message: str) -> Ds4fError:
    return Ds4fError(message, param="messages")


def _check(messages: Sequence[Mapping]) -> list[dict]:
    """The messages checked, as dicts of the fields the format reads."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise _fail("messages: a list of {role, content} messages expected")
    out: list[dict] = []
    open_calls: dict[str, int] | None = None      # the last assistant turn's calls not yet answered: id -> index
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise _fail(f"messages[{i}]: a {{role, content}} mapping expected")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise _fail(f"messages[{i}]: role {role!r} is not one of {', '.join(ROLES)}")
        calls = m.get("tool_calls") or ()
        if content is None and role == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            raise _fail(f"messages[{i}]: content must be a string")
        check_text(content, f"messages[{i}].content", "messages")
        if role == "developer" and not content:
            raise _fail(f"messages[{i}]: a developer message needs content")
        msg = {"role": role, "content": content}
        reasoning = m.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, str):
            raise _fail(f"messages[{i}]: reasoning must be a string")
        if reasoning:
            check_text(reasoning, f"messages[{i}].reasoning", "messages")
        if reasoning:
            msg["reasoning"] = reasoning
        tokens = m.get("tokens")
        if tokens is not None:
            if role != "assistant" or isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) \
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
                raise _fail(f"messages[{i}]: tokens, on an assistant message only, must be a list of token ids")
            msg["tokens"] = tuple(tokens)
        if calls:
            if role != "assistant":
                raise _fail(f"messages[{i}]: tool_calls on an assistant message only")
            if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
                raise _fail(f"messages[{i}].tool_calls: expected a list of calls")
            msg["tool_calls"] = [check_call(c, f"messages[{i}].tool_calls[{j}]", "messages")
                                 for j, c in enumerate(calls)]
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise _fail(f"messages[{i}].tool_call_id: a tool result names the call it answers")
            if open_calls is None or cid not in open_calls:
                raise _fail(f"messages[{i}].tool_call_id: {cid!r} answers no call of the assistant message"
                            f" before it" + (" (answered twice?)" if open_calls is not None else ""))
            msg["tool_call_id"], msg["order"] = cid, open_calls.pop(cid)
        elif role == "assistant":
            _check_answered(open_calls, i)
            open_calls = None
        else:           # a user who speaks instead of a tool leaves the calls unanswered: that is allowed
            open_calls = None
        if role == "assistant" and calls:
            ids = [c["id"] for c in msg["tool_calls"]]
            if any(not c for c in ids) or len(set(ids)) != len(ids):
                raise _fail(f"messages[{i}].tool_calls: each call needs an id of its own (its result names it)")
            open_calls = {c: j for j, c in enumerate(ids)}
        out.append(msg)
    if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
        raise _fail(f"messages[{len(out) - 1}]: the conversation ends with a tool call and no result: send the"
                    f" tool's result (a tool message with its tool_call_id) for the model to go on")
    if not out or out[-1]["role"] not in ("user", "tool", "developer") and not (
            out[-1]["role"] == "system" and any(m["role"] in ("user", "tool") for m in out)):
        raise _fail("messages: the last message must be the user's, a tool's result, or a developer or system"
                    " instruction after them (the model answers it)")
    if out[-1]["role"] == "tool":
        _check_answered(open_calls, len(out))
    return out


def _check_answered(open_calls: dict | None, i: int) -> None:
    if open_calls:
        raise _fail(f"messages[{i}]: the calls {', '.join(map(repr, open_calls))} before it have no tool result"
                    f" (a tool message with their tool_call_id)")


def _turns(msgs: list[dict]) -> list[dict]:
    """The messages as the prompt's turns (the release's merge_tool_messages): each run of user
    messages and tool results one user turn of parts (tool results in the order of the calls they
    answer), a system message that follows a user's turn, or ends the conversation, a developer turn
    (see the module docstring)."""
    turns: list[dict] = []
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system" and turns and (turns[-1]["role"] in ("user", "developer") or i == len(msgs) - 1):
            role = "developer"
        if role in ("user", "tool"):
            part = ("result", m["content"], m.get("order", 0)) if role == "tool" else ("text", m["content"])
            if turns and turns[-1]["role"] == "user":
                turns[-1]["parts"].append(part)
            else:
                turns.append({"role": "user", "parts": [part]})
        else:
            turns.append({**m, "role": role})
    for t in turns:
        if t["role"] == "user":
            results = sorted((p for p in t["parts"] if p[0] == "result"), key=lambda p: p[2])
            it = iter(results)
            t["parts"] = [next(it) if p[0] == "result" else p for p in t["parts"]]
    return turns


def check_effort(effort) -> str | None:
    if effort is not None and effort not in EFFORTS:
        raise Ds4fError(f"reasoning_effort: one of {', '.join(EFFORTS)}, got {json.dumps(effort)}",
                        param="reasoning_effort")
    return effort


def check_choice(choice, tools, thinking: bool | None = None) -> str | None:
    """tool_choice: None / "auto" / "none" / "required" / a function's name (one the tools offer).
    A forced call ("required" or a name) is for chat mode only (thinking=True refuses it, as
    DeepSeek's own encoder does; None: not checked here)."""
    if choice in (None, "auto", "none"):
        return choice
    if not tools:
        raise Ds4fError(f"tool_choice: {json.dumps(choice)} needs tools to choose from", param="tool_choice")
    if not isinstance(choice, str) or (choice != "required" and choice not in {t["name"] for t in tools}):
        if isinstance(choice, str):
            raise Ds4fError(f"tool_choice: no function {choice!r} among the tools "
                            f"({', '.join(t['name'] for t in tools)})", param="tool_choice")
        raise Ds4fError(f"tool_choice: expected auto, none, required or a function's name, got "
                        f"{json.dumps(choice)}", param="tool_choice")
    if thinking:
        raise Ds4fError(f"tool_choice: {json.dumps(choice)} forces a call, which DeepSeek-V4's format has in chat"
                        f" mode only: turn thinking off, or use tool_choice auto", param="tool_choice")
    return choice


def offered(tools, tool_choice=None) -> tuple:
    """The function schemas the prompt lists and the answer may call: none for tool_choice "none",
    the named one for a function's name, else all."""
    if not tools or tool_choice == "none":
        return ()
    if tool_choice not in (None, "auto", "required"):
        return tuple(t for t in tools if t["name"] == tool_choice)
    return tuple(tools)


def answer_opening(thinking: bool, tool_choice: str | None = None) -> tuple[bool, str]:
    """(does the answer begin in its reasoning, the answer's text the prompt already holds): a
    forced call's opening, `\n\n<｜DSML｜tool_calls>\n` (chat mode: no reasoning), else nothing."""
    if tool_choice in (None, "auto", "none"):
        return thinking, ""
    return False, CALLS_START + "\n"


def check_chat(messages: Sequence[Mapping], tools=None, reasoning_effort=None, tool_choice=None,
               thinking: bool | None = None) -> tuple:
    """A chat's settings checked as the prompt reads them: (the messages, the function schemas);
    a Ds4fError naming the parameter (messages, tools, reasoning_effort, tool_choice) that is wrong."""
    msgs = _check(messages)
    schemas = check_tools(tools) if tools else ()
    check_effort(reasoning_effort)
    check_choice(tool_choice, schemas, thinking)
    return msgs, schemas


def _render(messages: Sequence[Mapping], thinking: bool, tools, effort, tool_choice) -> list:
    """The prompt as pieces, the release's encode_messages step by step: ("mark", text) the
    format's strings, ("text", text) a message's, ("answer", message, pieces) an earlier assistant
    turn's answer (content and calls), spelled by its ids where they are known (chat_prompt_ids),
    ("reasoning", message, text) its kept reasoning."""
    msgs, schemas = check_chat(messages, tools, effort, tool_choice, thinking)
    shown = offered(schemas, tool_choice)
    turns = _turns(msgs)
    if shown and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": ""})
    drop = thinking and not shown          # thinking without tools: earlier turns lose their reasoning,
    if drop:                               # and developer turns before the last user turn are left out
        last = max(k for k, t in enumerate(turns) if t["role"] in ("user", "developer"))
        turns = [t for k, t in enumerate(turns) if t["role"] != "developer" or k >= last]
    last = max(k for k, t in enumerate(turns) if t["role"] in ("user", "developer"))
    out: list = [("mark", BOS)]
    if thinking and effort == "max":
        out.append(("mark", REASONING_EFFORT_MAX))
    for k, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            out.append(("text", turn["content"]))
            if shown and k == 0:
                out += [("mark", "\n\n")] + render_tools(shown)
        elif role == "developer":
            out += [("mark", USER), ("text", turn["content"])]
        elif role == "user":
            out.append(("mark", USER))
            for j, part in enumerate(turn["parts"]):
                if j:
                    out.append(("mark", "\n\n"))
                if part[0] == "result":
                    out += [("mark", TOOL_RESULT[0]), ("text", part[1]), ("mark", TOOL_RESULT[1])]
                else:
                    out.append(("text", part[1]))
        else:
            if thinking and not drop:
                out += [("reasoning", turn, turn.get("reasoning", "")), ("mark", END_THINK)]
            out += [("answer", turn, [("text", turn["content"])] + render_calls(turn.get("tool_calls", ()))),
                    ("mark", EOS)]
        if role in ("user", "developer") and (k == len(turns) - 1 or turns[k + 1]["role"] == "assistant"):
            out.append(("mark", ASSISTANT + (THINK if thinking and (not drop or k >= last) else END_THINK)))
    forced = answer_opening(thinking, tool_choice)[1]
    if forced:
        out.append(("mark", forced))
    return out


def _text_of(item) -> str:
    return item[1] if item[0] in ("mark", "text") else item[2] if item[0] == "reasoning" else pieces_text(item[2])


def render_chat(messages: Sequence[Mapping], thinking: bool = False, tools=None, reasoning_effort=None,
                tool_choice=None) -> str:
    """The prompt text, BOS and the special token strings inline (see the module docstring)."""
    return "".join(_text_of(item) for item in _render(messages, thinking, tools, reasoning_effort, tool_choice))


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping], thinking: bool = False,
                    kept: Sequence[Sequence[int]] = (), tools=None, reasoning_effort=None,
                    tool_choice=None) -> list[int]:
    """The prompt's token ids, BOS first (see the module docstring): the format's markers as their
    control tokens, each run of text between them tokenized whole as text. `kept`: the token ids
    of kept states, to spell earlier answers given as text alone."""
    for s in (BOS, USER, ASSISTANT, THINK, END_THINK, EOS):   # a Ds4fError naming the tokenizer
        tokenizer.special_id(s)
    ids: list[int] = []
    pieces: list = []          # mark and text pieces not yet encoded: they end at a marker
    for item in _render(messages, thinking, tools, reasoning_effort, tool_choice):
        kind = item[0]
        if kind in ("mark", "text"):
            pieces.append(item)
            continue
        # an earlier answer or reasoning: a marker before it and after it (</think>, <think>, EOS)
        ids += _encode_pieces(tokenizer, pieces)
        pieces = []
        answer = item[2] if kind == "answer" else [("text", item[2])]
        target = pieces_text(answer)
        tokens = item[1].get("tokens") if kind == "answer" else None
        if tokens is not None and tokenizer.decode(tokens) == target and _same_markers(tokenizer, tokens, answer):
            ids += tokens
            continue
        spelled = _as_kept(tokenizer, answer, ids, kept) if kept and target else None
        ids += spelled if spelled is not None else _encode_pieces(tokenizer, answer)
    return ids + _encode_pieces(tokenizer, pieces)


def _same_markers(tokenizer, tokens: Sequence[int], pieces) -> bool:
    """Whether an answer's generated ids hold the control tokens its rendering holds, no other (a
    model may write a marker's token inside its text: in the next prompt that is text). The
    rendering's are the markers in its marks (a message's text holds none)."""
    split = _marker_split(tokenizer)
    rendered = [] if split is None else [tokenizer.special_id(m) for kind, text in pieces if kind == "mark"
                                         for m in split.split(text)[1::2]]
    return [t for t in tokens if tokenizer.is_special(t)] == rendered


_SPLITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # tokenizer -> its marker regex (or None)


def _marker_split(tokenizer):
    """A regex that splits the format's text at its markers (those the tokenizer has as tokens)."""
    if tokenizer not in _SPLITS:
        have = [m for m in MARKERS if tokenizer.has_token(m)]
        _SPLITS[tokenizer] = re.compile("(" + "|".join(map(re.escape, sorted(have, key=len, reverse=True))) + ")") \
            if have else None
    return _SPLITS[tokenizer]


def _encode_pieces(tokenizer, pieces, skip: int = 0) -> list[int]:
    """Pieces' ids from character `skip` on: the markers in the format's text (marks) as their
    control tokens; each maximal run of text between them, the format's and the messages' alike,
    tokenized whole with Tokenizer.encode_text (so the BPE merges across a mark and a message as
    the release's whole-string tokenization does, and no message's text is ever a marker)."""
    split = _marker_split(tokenizer)
    ids: list[int] = []
    run: list[str] = []
    for kind, text in pieces:
        if skip >= len(text):
            skip -= len(text)
            continue
        text, skip = text[skip:], 0
        if kind != "mark" or split is None:
            run.append(text)
            continue
        for j, part in enumerate(split.split(text)):
            if j % 2 == 0:
                run.append(part)
            else:
                ids += tokenizer.encode_text("".join(run)) if any(run) else []
                run = []
                ids.append(tokenizer.special_id(part))
    if any(run):
        ids += tokenizer.encode_text("".join(run))
    return ids


TRIES = 8      # tokens _as_kept gives back at most, looking for a spelling of the rest


def _as_kept(tokenizer, pieces, prefix: list[int], kept: Sequence[Sequence[int]]) -> list[int] | None:
    """`pieces` (an answer's text) spelled as the kept state that spells most of it after `prefix`
    does (the rest encoded piece by piece), or None when no kept state continues `prefix` with any
    of it. A kept state ends a token short of a run's answer (the last pick is not fed), so its tail
    is usually a prefix of the answer; an undecodable byte sequence at its end costs a token or a few."""
    content = pieces_text(pieces)
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
            spelled = tail[:k] + _encode_pieces(tokenizer, pieces, len(said))
            if tokenizer.decode(spelled) == content:
                best = (k, spelled)
                break
    return best[1] if best is not None else None


def answer_message(tokenizer, generated: Sequence[int], text: str, thinking: bool, tools=None,
                   tool_choice=None) -> dict:
    """An answer as the assistant message of the next turn: its content (the reasoning apart, as
    `reasoning`; its calls as `tool_calls`, read by engine.text.reply) and, when they spell the
    answer exactly, the ids the model generated for it (`tokens`: after </think> in thinking mode,
    the end-of-sentence token left out). `generated`: the run's picked ids; `text`: its output text."""
    begins_in_reasoning, forced = answer_opening(thinking, tool_choice)
    schemas = offered(check_tools(tools) if tools else (), tool_choice)
    reply = parse_reply(text, begins_in_reasoning, schemas, calls=bool(schemas), prefix=forced)
    message = reply.message()
    ids = list(generated)
    if begins_in_reasoning:
        end = tokenizer.special_id(END_THINK)
        ids = ids[ids.index(end) + 1:] if end in ids else []
    eos = tokenizer.special_id(EOS)
    if eos in ids:
        ids = ids[:ids.index(eos)]
    answer = [("text", message["content"])] + render_calls(message.get("tool_calls", ()))
    if not forced and tokenizer.decode(ids) == pieces_text(answer):
        message["tokens"] = ids
    return message
