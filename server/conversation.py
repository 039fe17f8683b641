"""What every generating endpoint hands the chat layer (engine.text.chat), built the same way
whichever API the request speaks: the messages and where each came from in the request, and the
function schemas of its tools.

    conv = Conversation("input", "call_id")       # what this API calls its conversation, a result's call id
    conv.add({"role": "user", "content": "hi"}, "input[0]")
    fields = conv.fields(tools, tool_choice, thinking, effort)    # RunConfig's chat fields, or a 400
    function_schema(fn)                           # {name, description, parameters}, nothing else

The chat layer checks the messages as the prompt reads them and names what it refuses as
`messages[k]...`; a Conversation renames that to the request's own field (`input[3]`,
`messages[2].content[0]`), so the 400 names the parameter the client sent.

A tool reaches the prompt as {"name", "description", "parameters"}, in that order, whatever else
the request's tool object holds (`strict`, `cache_control`, `defer_loading`, `type`...): the
prompt shows each schema as one line of JSON, so the same tools give the same prompt on every
endpoint.
"""
from __future__ import annotations

import re

from ds4f.api import Ds4fError, check_chat

from .errors import HttpError

FUNCTION_KEYS = ("name", "description", "parameters")      # what the prompt shows of a tool, in order
_WHERE = re.compile(r"messages\[(\d+)\](\.tool_call_id|\.tool_calls\[(\d+)\])?")


def from_ds4f(exc: Ds4fError) -> HttpError:
    """A chat setting the engine's checks refused, as a 400 naming the parameter."""
    return HttpError(400, exc.message, param=exc.param, code="invalid_value")


def function_schema(fn: dict) -> dict:
    """A checked function schema as the prompt shows it: its name, description and parameters."""
    return {k: fn[k] for k in FUNCTION_KEYS if fn.get(k) is not None}


def chat_fields(messages: tuple, tools: tuple, tool_choice, thinking: bool, effort) -> dict:
    """RunConfig's chat fields, checked as the prompt reads them (a 400 naming the parameter)."""
    tools = tuple(function_schema(t) for t in tools or ())
    try:
        check_chat(messages, tools or None, effort, tool_choice)
    except Ds4fError as exc:
        raise from_ds4f(exc) from None
    return {"messages": messages, "thinking": thinking, "tools": tools or None, "tool_choice": tool_choice,
            "reasoning_effort": effort}


class Conversation:
    """The request's messages as the chat layer's, and where each came from in the request."""

    def __init__(self, param: str = "messages", call_id: str = "tool_call_id") -> None:
        self.param = param                    # what the request calls its conversation
        self.call_id = call_id                # what it calls the id a tool result answers
        self.messages: list[dict] = []
        self.origins: list[str] = []          # per chat message: where it is in the request
        self.call_origins: dict = {}          # (chat message, call) -> where the call is in the request

    def add(self, msg: dict, origin: str) -> dict:
        self.messages.append(msg)
        self.origins.append(origin)
        return msg

    def renamed(self, message: str) -> str:
        """A message of the chat layer's checks, its `messages[k]...` named as the request has it."""
        def where(m: re.Match) -> str:
            k = min(int(m.group(1)), len(self.origins) - 1)
            if m.group(3) is not None:
                return self.call_origins.get((k, int(m.group(3))), self.origins[k])
            return self.origins[k] + (f".{self.call_id}" if m.group(2) == ".tool_call_id" else "")
        if self.origins:
            message = _WHERE.sub(where, message)
        if message.startswith("messages:"):
            message = self.param + message[len("messages"):]
        return message

    def fields(self, tools: tuple, tool_choice, thinking: bool, effort) -> dict:
        """RunConfig's chat fields (chat_fields), a refusal of the messages named as the request has them."""
        try:
            return chat_fields(tuple(self.messages), tools, tool_choice, thinking, effort)
        except HttpError as exc:
            if exc.param == "messages":
                exc.message = self.renamed(exc.message)
                exc.param = self.param
            raise
