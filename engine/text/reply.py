"""A chat answer as it streams: reasoning, content, tool calls. The one state machine behind every
endpoint's messages and deltas, the CLI's printing and the console's transcript.

    reply = ReplyParser(thinking=True, tools=schemas)
    for piece in text_pieces:
        for event in reply.push(piece): ...     # ("reasoning", text) | ("content", text) | ("call", call)
    for event in reply.finish(): ...
    reply.result                                 # Reply: reasoning, content, calls, error, repairs

The answer's grammar (DeepSeek-V4's encoding): in thinking mode the reasoning runs up to `</think>`;
then the content, up to the end or `\\n\\n<｜DSML｜tool_calls>`; then one block of DSML invokes, the
calls (engine.text.dsml). Text that may be the start of a marker waits for the next piece. The
calls block is held until it closes and is then checked whole, so a call is handed out complete
and valid or not at all: a "call" event carries {"id", "name", "arguments"} (the arguments as
JSON text, the keys in the model's order) and `fragments`, pieces of that text in the order a
stream sends them (one per parameter).

What the model gets wrong, and what it becomes (never an exception):

- repaired, where the format leaves one reading: a call block that opens inside the reasoning (an
  unclosed `</think>`: the reasoning ends there), the DSML marker with a doubled or missing bar or
  ASCII bars, a block missing only its closing tag, a value whose type the schema fixes (string
  "3" for an integer, 3 for a string), a parameter without its `string` attribute; text after
  the closed block (the answer ends with its calls: that text is dropped). Each repair is named
  in `Reply.repairs`.
- refused: a block that does not parse, a call to a function the request did not offer, arguments
  the schema refuses (a missing required one, an unknown one where `additionalProperties` is
  false, a value of the wrong type). The whole answer after the reasoning is then the content, as
  the model wrote it, no calls, and `Reply.error` says what was wrong (the endpoints finish with
  `tool_call_error`).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ds4f.engine.text.dsml import (CALLS_CLOSE, CALLS_OPEN, CALLS_START, DSML, INVOKE_CLOSE, INVOKE_OPEN, JSON_TYPES,
                                   MAX_ARGUMENTS_DEPTH, PARAM_CLOSE, PARAM_OPEN, to_json)
from ds4f.errors import Ds4fError, parse_json
from ds4f.engine.text.output import THINK_END

# the DSML marker as models misspell it -> as the format spells it
_MISSPELT = ((re.compile(r"[｜|]{2,}DSML[｜|]{2,}"), DSML), (re.compile(r"\|DSML\|"), DSML),
             (re.compile(r"(</?)DSML｜"), r"\1" + DSML))
_STARTS = (CALLS_START, CALLS_OPEN, "<｜｜DSML｜｜tool_calls>", "<DSML｜tool_calls>", "<|DSML|tool_calls>")
_INVOKE = re.compile(r'\s*' + re.escape(INVOKE_OPEN) + r'\s+name="([^"\n]*)"\s*>\n?')
_PARAM = re.compile(r'\s*' + re.escape(PARAM_OPEN) + r'\s+name="([^"\n]*)"(?:\s+string="(true|false)")?\s*>')


def normalize_dsml(text: str) -> str:
    for pattern, repl in _MISSPELT:
        text = pattern.sub(repl, text)
    return text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class Reply:
    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)    # [{"id", "name", "arguments": JSON text, "fragments"}]
    error: str | None = None                      # why the calls were refused (then they are content)
    repairs: list = field(default_factory=list)   # what was repaired, one name per repair

    def message(self) -> dict:
        """As an assistant message of the next turn: content, reasoning, tool_calls (arguments as objects)."""
        msg = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [{"id": c["id"], "name": c["name"], "arguments": json.loads(c["arguments"])}
                                 for c in self.calls]
        return msg


class ReplyParser:
    """See the module docstring. thinking: the answer starts in its reasoning; tools: the function
    schemas offered (None: any name, no schema check); calls: False reads DSML as content (a
    request with tool_choice none); prefix: text the prompt already holds of the answer (a forced
    call's opening), parsed first and never handed out."""

    def __init__(self, thinking: bool, tools: Sequence[Mapping] | None = None, calls: bool = True,
                 prefix: str = "") -> None:
        self.phase = "reasoning" if thinking else "content"
        self.tools = {t["name"]: t for t in tools} if tools is not None else None
        self.parse_calls = calls
        self.buf = ""              # text not yet handed out (a marker's possible start), or the calls block
        self.block = ""            # the calls block as written (after its opening), for a refusal
        self.after = ""            # what came after a closed calls block (dropped)
        self.opening = ""          # how the block's opening was written
        self.result = Reply()
        self._hidden = len(prefix)  # characters of the prefix: parsed, not handed out
        if prefix:
            self.push(prefix)

    # -- streaming ------------------------------------------------------------------------------------
    def push(self, piece: str) -> list[tuple]:
        out: list[tuple] = []
        self.buf += piece
        while True:
            if self.phase == "reasoning":
                if not self._reasoning(out):
                    break
            elif self.phase == "content":
                if not self._content(out):
                    break
            elif self.phase == "calls":
                self._calls_text(out)
                break
            elif self.phase == "after":        # past a closed block: not the answer's (see finish)
                self.after += self.buf
                self.buf = ""
                break
            else:
                break
        return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        if self.phase == "reasoning":
            self._emit(out, "reasoning", self.buf)
        elif self.phase == "content":
            self._emit(out, "content", self.buf)
        elif self.phase == "calls":
            self._close_block(out, closed=False)
        if self.after.strip():
            self.result.repairs.append("text_after_calls")
        self.buf = ""
        self.phase = "done"
        return out

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self._hidden:
            cut = min(self._hidden, len(text))
            text, self._hidden = text[cut:], self._hidden - cut
        if not text:
            return
        if kind == "reasoning":
            self.result.reasoning += text
        else:
            self.result.content += text
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _reasoning(self, out: list) -> bool:
        ends = [(i, THINK_END, False) for i in [self.buf.find(THINK_END)] if i >= 0]
        if self.parse_calls:
            ends += [(i, s, True) for s in _STARTS if (i := self.buf.find(s)) >= 0]
        if not ends:
            self._release(out, "reasoning", (THINK_END,) + (_STARTS if self.parse_calls else ()))
            return False
        i, marker, is_call = min(ends, key=lambda e: (e[0], not e[2]))
        self._emit(out, "reasoning", self.buf[:i])
        if is_call:                    # the block opened before </think>: the reasoning ends there
            self.result.repairs.append("unclosed_think")
            self._hidden = 0
            self._open_block(marker)
        else:
            self._hidden = max(0, self._hidden - len(marker))
            self.buf = self.buf[i + len(marker):]
            self.phase = "content"
        return True

    def _content(self, out: list) -> bool:
        if not self.parse_calls:
            self._emit(out, "content", self.buf)
            self.buf = ""
            return False
        found = [(i, s) for s in _STARTS if (i := self.buf.find(s)) >= 0]
        if not found:
            self._release(out, "content", _STARTS)
            return False
        i, marker = min(found, key=lambda f: (f[0], -len(f[1])))
        self._emit(out, "content", self.buf[:i])
        self._hidden = 0
        self._open_block(marker)
        return True

    def _release(self, out: list, kind: str, markers: tuple[str, ...]) -> None:
        """Hand out the buffer but for a tail that may begin one of `markers`."""
        keep = 0
        for k in range(min(len(self.buf), max(len(m) for m in markers) - 1), 0, -1):
            if any(m.startswith(self.buf[-k:]) for m in markers):
                keep = k
                break
        self._emit(out, kind, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]

    def _open_block(self, marker: str) -> None:
        i = self.buf.find(marker)
        self.opening = marker
        if marker not in (CALLS_START, CALLS_OPEN):
            self.result.repairs.append("misspelt_dsml")
        self.buf = self.buf[i + len(marker):]
        self.block = ""
        self.phase = "calls"

    def _calls_text(self, out: list) -> None:
        self.block += self.buf
        self.buf = ""
        norm = normalize_dsml(self.block)
        if CALLS_CLOSE in norm:
            self._close_block(out, closed=True)

    # -- the block ------------------------------------------------------------------------------------
    def _close_block(self, out: list, closed: bool) -> None:
        self.phase = "after"
        text = normalize_dsml(self.block)
        end = text.find(CALLS_CLOSE)
        if end >= 0:                   # what follows the block is not part of it
            self.after, text = text[end + len(CALLS_CLOSE):], text[:end + len(CALLS_CLOSE)]
        if normalize_dsml(self.block) != self.block and "misspelt_dsml" not in self.result.repairs:
            self.result.repairs.append("misspelt_dsml")
        try:
            calls = self._parse_block(text, closed)
        except ValueError as exc:
            self.result.error = str(exc)
            self.result.repairs = [r for r in self.result.repairs if r == "unclosed_think"]
            self._emit(out, "content", self.opening + self.block)   # as the model wrote it, and the rest too
            self.after, self.phase, self.parse_calls = "", "content", False
            return
        self.result.calls = calls
        for call in calls:
            out.append(("call", call))

    def _parse_block(self, text: str, closed: bool) -> list[dict]:
        end = text.find(CALLS_CLOSE)
        body = text if end < 0 else text[:end]
        calls, at = [], 0
        while True:
            m = _INVOKE.match(body, at)
            if m is None:
                break
            name, at = m.group(1), m.end()
            args, at = self._parse_params(body, at, name)
            calls.append(self._checked(name, args))
        if body[at:].strip():
            raise ValueError(f"the tool calls block does not parse at {body[at:].strip()[:60]!r}")
        if not calls:
            raise ValueError("a tool calls block without an invoke")
        if end < 0:
            if not closed:
                self.result.repairs.append("unclosed_block")
        return calls

    def _parse_params(self, body: str, at: int, name: str) -> tuple[list, int]:
        args, seen = [], set()
        while True:
            m = _PARAM.match(body, at)
            if m is None:
                break
            key, string = m.group(1), m.group(2)
            close = body.find(PARAM_CLOSE, m.end())
            if close < 0:
                raise ValueError(f"{name}: parameter {key!r} is not closed")
            if key in seen:
                raise ValueError(f"{name}: parameter {key!r} given twice")
            seen.add(key)
            args.append((key, string, body[m.end():close]))
            at = close + len(PARAM_CLOSE)
        rest = body[at:]
        stripped = rest.lstrip()
        if not stripped.startswith(INVOKE_CLOSE):
            raise ValueError(f"{name}: the invoke does not parse at {stripped[:60]!r}" if stripped
                             else f"{name}: the invoke is not closed")
        return args, at + (len(rest) - len(stripped)) + len(INVOKE_CLOSE)

    def _checked(self, name: str, args: list) -> dict:
        """The call with its arguments typed as the schema says (see the module docstring)."""
        schema = None
        if self.tools is not None:
            if name not in self.tools:
                offered = ", ".join(self.tools) or "none"
                raise ValueError(f"a call to {name!r}, which the request did not offer (offered: {offered})")
            schema = self.tools[name].get("parameters") or {}
        props = (schema or {}).get("properties") or {}
        values = []
        for key, string, raw in args:
            sub = props.get(key)
            if schema is not None and sub is None and schema.get("additionalProperties") is False:
                raise ValueError(f"{name}: no parameter {key!r} in its schema")
            values.append((key, self._value(name, key, string, raw, sub)))
        for key in (schema or {}).get("required") or ():
            if key not in {k for k, _ in values}:
                raise ValueError(f"{name}: the required parameter {key!r} is missing")
        fragments = []
        for i, (key, value) in enumerate(values):
            fragments.append(("{" if i == 0 else ", ") + f"{to_json(key)}: {to_json(value)}")
        fragments.append("}" if values else "{}")
        return {"id": new_call_id(), "name": name, "arguments": "".join(fragments), "fragments": fragments}

    def _value(self, name: str, key: str, string: str | None, raw: str, schema):
        kinds = _kinds(schema)
        if string is None:
            self.result.repairs.append("string_attribute")
            string = "true" if kinds and "string" in kinds else "false"
        if string == "true":
            if not kinds or "string" in kinds:
                return raw
            try:
                value = _loads(raw)
            except ValueError:
                raise ValueError(f"{name}: parameter {key!r} is {' or '.join(kinds)} in the schema, got the"
                                 f" text {raw[:40]!r}") from None
            value = _typed(value, kinds)
            if value is _WRONG:
                raise ValueError(f"{name}: parameter {key!r} is {' or '.join(kinds)} in the schema, got {raw[:40]!r}")
            self.result.repairs.append("value_type")
            return value
        try:
            value = _loads(raw)
        except ValueError:
            if kinds and "string" in kinds:
                self.result.repairs.append("value_type")
                return raw
            raise ValueError(f"{name}: parameter {key!r} is not valid JSON: {raw[:40]!r}") from None
        if not kinds:
            return value
        typed = _typed(value, kinds)
        if typed is not _WRONG:
            if typed is not value or type(typed) is not type(value):
                self.result.repairs.append("value_type")
            return typed
        if "string" in kinds:
            self.result.repairs.append("value_type")
            return raw
        raise ValueError(f"{name}: parameter {key!r} is {' or '.join(kinds)} in the schema, got {raw[:40]!r}")


_WRONG = object()


def _loads(raw: str):
    """A parameter's JSON as the model wrote it; ValueError when it is not JSON, or nests deeper than
    an argument may (what reads it next recurses once a level)."""
    try:
        return parse_json(raw, "value", max_depth=MAX_ARGUMENTS_DEPTH)
    except Ds4fError as exc:
        raise ValueError(exc.message) from None


def _kinds(schema) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if kind is None and isinstance(schema.get("enum"), list):
        return []
    return [k for k in (kind if isinstance(kind, list) else [kind]) if k in JSON_TYPES]


def _typed(value, kinds: list[str]):
    """`value` as one of the JSON types `kinds` (an integral float as an integer), or _WRONG."""
    for k in kinds:
        if k in ("integer", "number") and isinstance(value, bool):
            continue
        if k == "integer" and isinstance(value, float) and value.is_integer():
            return int(value)
        if k == "number" and isinstance(value, (int, float)):
            return value
        if isinstance(value, JSON_TYPES[k]) and not (k == "integer" and isinstance(value, bool)):
            return value
    return _WRONG


def parse_reply(text: str, thinking: bool, tools: Sequence[Mapping] | None = None, calls: bool = True,
                prefix: str = "") -> Reply:
    """A whole answer's text read as ReplyParser reads it streamed."""
    p = ReplyParser(thinking, tools, calls, prefix)
    p.push(text)
    p.finish()
    return p.result
