"""Anthropic's Messages API: what an Anthropic client library, or Claude Code, expects of a server.

    POST /v1/messages                 system + messages (+ tools) -> an assistant message; streams too
    POST /v1/messages/count_tokens    the same request -> {"input_tokens": n}, the prompt's length

Parameters: model (one of the served model's names, GET /v1/models: a client asking for
"claude-..." gets a 404, so point it at this server's name, e.g. Claude Code's ANTHROPIC_MODEL, or
serve under that name with --served-model-name), max_tokens (required, as Anthropic's), messages,
system (a string or text blocks, joined by newlines), tools, tool_choice, thinking, temperature (0
to 1, as Anthropic's), top_p, top_k, stop_sequences, stream, output_config.effort (low, medium,
high, xhigh, max: the reasoning effort of thinking mode; xhigh and max ask for the release's
maximum, the rest add nothing), output_config.format ({"type": "json_schema", "schema": {...}}:
structured outputs, the answer held to the schema token by token, as response_format on chat
completions; server.structured). Taken and ignored, since they do not change the answer (IGNORED):
metadata, service_tier auto / standard_only, context_management, thread, `cache_control` wherever
Anthropic puts it (the prefix cache works without marks). What would change the answer and cannot
be honoured is a 400 naming it (server tools, mcp_servers, container, tools[].input_examples,
image and document blocks), and so is anything unknown.

- Content blocks. User: text, tool_result {tool_use_id, content (a string or text blocks),
  is_error (the content is passed as it is: the tool's error text says what went wrong)}; image
  and document blocks are refused (the model reads text only). Assistant: text, thinking (its text
  is the turn's reasoning: with tools in thinking mode every turn keeps it, else the prompt drops
  it), redacted_thinking (ignored), tool_use {id, name, input}. A user message's tool_result
  blocks become the tool results of the calls before it (each tool_use needs one, in the very next
  message), its text a user turn after them. A system message (role "system", as the SDK's types
  allow and Claude Code sends after a user turn) is a system message of the chat at its place. A
  conversation must end with the user's message, system messages after it aside (an assistant
  prefill is refused).
- tools: client tools {name, description, input_schema} (type "custom" or none; `strict` is
  taken: the answer's calls are always checked against the schema; defer_loading,
  eager_input_streaming and cache_control are taken and change nothing); server tools (web
  search, code execution...) are refused. The prompt shows each as {"name", "description",
  "parameters"}, as every endpoint's (server.conversation).
- tool_choice: auto, any (a call is forced), tool {name} (that call is forced), none (the tools
  stay in the prompt, DSML is read as text); disable_parallel_tool_use: one call at most.
- thinking: {"type": "enabled", "budget_tokens": n} or {"type": "adaptive"} turn on DeepSeek's
  thinking mode, {"type": "disabled"} (the default) turns it off. The budget cannot be enforced
  (the model ends its reasoning when it will; max_tokens bounds reasoning and answer together);
  `display` is ignored (the reasoning is shown whole). The thinking block's signature is an
  opaque string derived from its text (never "": clients drop such blocks); a thinking block sent
  back is taken whatever its signature says.

The answer: content blocks thinking (thinking mode, when there is reasoning), text (when not
empty), tool_use (id "toolu_<hex>", input the checked arguments); stop_reason tool_use, end_turn
(the end-of-sentence token), max_tokens, or stop_sequence with the stop_sequence that matched.
An answer whose calls do not parse or that the tools refuse: its text is the text block,
stop_reason end_turn, and a top-level `tool_call_error` says what was wrong. Usage: input_tokens
(the prompt tokens computed), cache_read_input_tokens (those the prefix cache gave),
cache_creation_input_tokens 0, output_tokens. The message's id is `msg_<run id>`: GET /runs/<run id>
shows the run.

Streaming: Anthropic's events (message_start, ping, content_block_start / _delta / _stop per
block, message_delta with the stop reason and the usage, message_stop); a request that waits for
the engine gets `ping` events until its run starts; an error once the stream is under way is an
`error` event. Errors have Anthropic's shape, {"type": "error", "error": {"type", "message"}},
the message starting with the parameter it concerns (messages[1].content[0].tool_use_id: ...).
The server's own checks ahead of the endpoint (the token, the Host, the body's size) answer in
that shape too on these paths (server.errors).

count_tokens counts the prompt as it is tokenized afresh; a run's prompt_tokens may be a few
tokens off for a conversation whose earlier answers the prefix cache spells as their generated ids.
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ds4f.api import MAX_GEN, Ds4fError, Tokenizer, chat_prompt_ids, check_choice, check_tools

from .conversation import Conversation
from .errors import HttpError, bad, json_bytes, json_response
from .generation import Ask, reply_of, respond, streamed
from .request import EFFORTS, boolean, check_model, check_names, json_body, number, parse_sampling, refused
from .structured import text_format_of

# Taken and ignored: how Anthropic's service keeps, bills or trims a conversation, never what the model
# reads here. context_management asks Anthropic to clear old tool results and thinking server-side;
# this server reads the conversation as sent, whole (the prefix cache makes that cheap). thread is
# Anthropic's bookkeeping of a conversation. Each must be an object.
IGNORED = ("metadata", "cache_control", "context_management", "thread")
# Refused, named in a 400, because they would change the answer and cannot be honoured: server tools
# (tools[].type other than custom, mcp_servers, container),
# tools[].input_examples (shown to Anthropic's models), image and document blocks; unknown keys too.
CREATE_PARAMS = ("model", "max_tokens", "messages", "system", "tools", "tool_choice", "thinking", "temperature",
                 "top_p", "top_k", "stop_sequences", "stream", "output_config", *IGNORED)
COUNT_PARAMS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", *IGNORED)
DEFAULT_ONLY = {"service_tier": ("auto", "standard_only")}
# a tool's keys: the schema, and what does not change the prompt (cache_control; defer_loading asks
# Anthropic to load the tool on demand: here it is in the prompt from the start; strict: the calls
# are checked against the schema anyway; eager_input_streaming: calls stream as they are read)
TOOL_KEYS = ("name", "description", "input_schema", "type", "cache_control", "strict", "defer_loading",
             "eager_input_streaming")
SIGNATURE = b"ds4f-thinking\0"    # what a thinking block's signature hashes with its text
MAX_STOP_SEQUENCES = 64
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")


# -- errors --------------------------------------------------------------------------------------
def error_response(exc: HttpError) -> Response:
    return exc.response("/v1/messages")


# -- parameters ----------------------------------------------------------------------------------
def _max_tokens(raw: dict) -> int:
    v = raw.get("max_tokens")
    if v is None:
        raise bad("max_tokens", "required: the most tokens to generate (reasoning and answer together)",
                  code="missing_parameter")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise bad("max_tokens", f"must be a whole number of at least 1, got {json.dumps(v)}")
    return min(v, MAX_GEN)      # a ceiling: the answer stops where the context ends (stop_reason max_tokens)


def _text_blocks(value, where: str, what: str) -> str:
    """A string, or a list of text blocks (joined by newlines)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(where, f"expected {what}: a string, or a list of {{\"type\": \"text\", \"text\": ...}} blocks")
    texts = []
    for k, block in enumerate(value):
        bw = f"{where}[{k}]"
        if not isinstance(block, dict):
            raise bad(bw, "expected a content block {\"type\": \"text\", \"text\": ...}")
        kind = block.get("type")
        if kind in UNSUPPORTED_BLOCKS:
            raise bad(bw, f"{kind} blocks are not supported (this model reads text only)", code="unsupported_value")
        if kind != "text":
            raise bad(f"{bw}.type", f"expected a text block, got {json.dumps(kind)}")
        if not isinstance(block.get("text"), str):
            raise bad(f"{bw}.text", "expected a string")
        texts.append(block["text"])
    return "\n".join(texts)


def parse_thinking(value) -> bool:
    if value is None:
        return False
    shape = ("expected {\"type\": \"enabled\", \"budget_tokens\": n}, {\"type\": \"adaptive\"} or "
             "{\"type\": \"disabled\"}")
    if not isinstance(value, dict):
        raise bad("thinking", shape)
    kind = value.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad("thinking.type", f"{json.dumps(kind)}: {shape}")
    for key in value:
        if key not in ("type", "budget_tokens", "display"):
            raise bad(f"thinking.{key}", "unknown field (known: type, budget_tokens, display)",
                      code="unknown_parameter")
    budget = value.get("budget_tokens")       # taken, not enforced: max_tokens bounds reasoning and answer
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise bad("thinking.budget_tokens", f"expected a whole number of tokens, got {json.dumps(budget)}")
    display = value.get("display")            # how to show the reasoning: it is sent whole whatever this says
    if display is not None and not isinstance(display, str):
        raise bad("thinking.display", f"expected a string (summarized, omitted...), got {json.dumps(display)}")
    return kind != "disabled"


def parse_effort(value, thinking: bool) -> str | None:
    """output_config.effort -> the reasoning effort of thinking mode (None outside it)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("output_config", "expected an object: {\"effort\": ...}")
    for key in value:
        if key not in ("effort", "format"):
            raise bad(f"output_config.{key}", "unknown field (known: effort)", code="unknown_parameter")
    effort = value.get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS or effort == "minimal":
        raise bad("output_config.effort", f"{json.dumps(effort)} is not an effort (low, medium, high, xhigh, max)")
    return EFFORTS[effort] if thinking else None


def parse_tools(value) -> tuple:
    """Client tools -> the function schemas {name, description, parameters: input_schema}."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("tools", "expected a list of tools {name, description, input_schema}")
    fns = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, "expected a tool {name, description, input_schema}")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad(f"{where}.type", f"{json.dumps(kind)}: server tools (web search, code execution, bash, text "
                                       f"editor...) are not supported; only client tools {{name, description, "
                                       f"input_schema}}", code="unsupported_value")
        for key in tool:
            if key not in TOOL_KEYS:
                raise bad(f"{where}.{key}", f"unknown field (known: {', '.join(TOOL_KEYS)})", code="unknown_parameter")
        boolean(tool.get("strict"), f"{where}.strict")
        if tool.get("input_schema") is None:
            raise bad(f"{where}.input_schema", "required: the JSON Schema of the tool's input",
                      code="missing_parameter")
        fn = {"name": tool.get("name")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        fns.append(fn)
    try:
        return check_tools(fns, "tools")
    except Ds4fError as exc:
        raise HttpError(400, exc.message.replace(".parameters", ".input_schema"), param="tools",
                        code="invalid_value") from None


def parse_tool_choice(value, tools: tuple) -> tuple[str | None, bool]:
    """-> (auto | none | required | a tool's name, parallel calls)."""
    if value is None:
        return None, True
    shape = ("expected {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", \"name\": ...} or "
             "{\"type\": \"none\"}")
    if not isinstance(value, dict):
        raise bad("tool_choice", shape)
    kind = value.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type", f"{json.dumps(kind)}: {shape}")
    for key in value:
        if key not in ("type", "name", "disable_parallel_tool_use", "cache_control"):
            raise bad(f"tool_choice.{key}", "unknown field (known: type, name, disable_parallel_tool_use)",
                      code="unknown_parameter")
    single = boolean(value.get("disable_parallel_tool_use"), "tool_choice.disable_parallel_tool_use")
    if kind == "tool":
        choice = value.get("name")
        if not isinstance(choice, str) or not choice:
            raise bad("tool_choice.name", "expected the name of the tool to call")
    elif value.get("name") is not None:
        raise bad("tool_choice.name", "only with \"type\": \"tool\"")
    else:
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    try:
        choice = check_choice(choice, tools)
    except Ds4fError as exc:
        where = "tool_choice.name" if kind == "tool" else "tool_choice"
        raise bad(where, exc.message.split(": ", 1)[-1]) from None
    return choice, not single


def _user(conv: Conversation, blocks: list, where: str, open_calls: dict) -> None:
    texts, results = [], []
    for j, block in enumerate(blocks):
        bw = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise bad(bw, "expected a content block {\"type\", ...}")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad(f"{bw}.text", "expected a string")
            texts.append(block["text"])
        elif kind == "tool_result":
            cid = block.get("tool_use_id")
            if not isinstance(cid, str) or not cid:
                raise bad(f"{bw}.tool_use_id", "expected the id of the tool_use block it answers")
            if cid not in open_calls:
                raise bad(f"{bw}.tool_use_id", f"{cid!r} answers no tool_use block of the assistant message before"
                                               f" it" + (" (answered twice?)" if any(r[0] == cid for r in results)
                                                         else ""))
            open_calls.pop(cid)
            boolean(block.get("is_error"), f"{bw}.is_error")
            content = block.get("content")
            text = "" if content is None else _text_blocks(content, f"{bw}.content", "the tool's result")
            results.append((cid, text, bw))
        elif kind in UNSUPPORTED_BLOCKS:
            raise bad(bw, f"{kind} blocks are not supported (this model reads text only)", code="unsupported_value")
        elif kind in ("thinking", "redacted_thinking", "tool_use"):
            raise bad(f"{bw}.type", f"{kind} is a block of the assistant's messages, not the user's")
        else:
            raise bad(f"{bw}.type", f"{json.dumps(kind)} is not supported in a user message (text, tool_result)")
    if open_calls:
        raise bad(f"{where}.content", f"the tool_use blocks {', '.join(map(repr, open_calls))} of the assistant "
                                      f"message before it have no tool_result (each needs one, in this message)")
    for cid, text, bw in results:
        conv.add({"role": "tool", "tool_call_id": cid, "content": text}, bw)
    if texts or not results:
        conv.add({"role": "user", "content": "\n".join(texts)}, f"{where}.content")


def _assistant(conv: Conversation, blocks: list, where: str) -> dict:
    """The assistant message; -> its calls' ids (those the next message answers)."""
    texts, reasoning, calls = [], [], []
    k = len(conv.messages)
    for j, block in enumerate(blocks):
        bw = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise bad(bw, "expected a content block {\"type\", ...}")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad(f"{bw}.text", "expected a string")
            texts.append(block["text"])
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise bad(f"{bw}.thinking", "expected a string")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            cid, name, args = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(cid, str) or not cid:
                raise bad(f"{bw}.id", "expected the tool_use's id (its tool_result names it)")
            if any(c["id"] == cid for c in calls):
                raise bad(f"{bw}.id", f"{cid!r} is the id of another tool_use block of this message")
            if not isinstance(name, str) or not name:
                raise bad(f"{bw}.name", "expected the called tool's name")
            if args is None:
                args = {}
            if not isinstance(args, dict):
                raise bad(f"{bw}.input", "expected a JSON object of the call's arguments")
            conv.call_origins[(k, len(calls))] = bw
            calls.append({"id": cid, "name": name, "arguments": args})
        elif kind in UNSUPPORTED_BLOCKS:
            raise bad(bw, f"{kind} blocks are not supported (this model reads text only)", code="unsupported_value")
        elif kind == "tool_result":
            raise bad(f"{bw}.type", "tool_result is a block of the user's messages, not the assistant's")
        else:
            raise bad(f"{bw}.type", f"{json.dumps(kind)} is not supported in an assistant message (text, thinking,"
                                    f" redacted_thinking, tool_use)")
    msg = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        msg["reasoning"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    conv.add(msg, where)
    return {c["id"]: None for c in calls}


def parse_messages(value, system) -> Conversation:
    conv = Conversation()
    if system is not None:
        text = _text_blocks(system, "system", "the system prompt")
        if text:
            conv.add({"role": "system", "content": text}, "system")
    if value is None:
        raise bad("messages", "required: the conversation to answer", code="missing_parameter")
    if not isinstance(value, list) or not value:
        raise bad("messages", "expected a non-empty list of {role, content} messages")
    open_calls: dict = {}
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "expected a {role, content} object")
        for key in m:
            if key not in ("role", "content"):
                raise bad(f"{where}.{key}", "unknown field (known: role, content)", code="unknown_parameter")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise bad(f"{where}.role", f"{json.dumps(role)}: expected user, assistant or system")
        if role == "system":        # an instruction at its place in the conversation (Claude Code's reminders)
            text = _text_blocks(content, f"{where}.content", "a system message")
            if text:
                conv.add({"role": "system", "content": text}, f"{where}.content")
            continue
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}] if content or role == "user" else []
        elif isinstance(content, list) and content:
            blocks = content
        else:
            raise bad(f"{where}.content", "expected a string or a non-empty list of content blocks")
        if role == "user":
            _user(conv, blocks, where, open_calls)
            open_calls = {}
        else:
            if open_calls:
                raise bad(where, f"the tool_use blocks {', '.join(map(repr, open_calls))} before it have no "
                                 f"tool_result (the next message must be the user's, with a tool_result for each)")
            open_calls = _assistant(conv, blocks, where)
    k = max((i for i, m in enumerate(value) if m["role"] != "system"), default=len(value) - 1)
    last = f"messages[{k}]"
    if open_calls:
        raise bad(last, "the conversation ends with a tool_use and no tool_result: send the tool's result (a user "
                        "message with a tool_result block naming its tool_use_id) for the model to go on")
    if value[k].get("role") != "user":
        raise bad(last, "the last message must be the user's (the model answers it); an assistant message to "
                        "continue (a prefill) is not supported", code="unsupported_value")
    return conv


def parse_chat(raw: dict) -> tuple[dict, bool, tuple, str | None, bool]:
    """-> (RunConfig's chat fields, thinking, tools, tool_choice, parallel calls)."""
    thinking = parse_thinking(raw.get("thinking"))
    effort = parse_effort(raw.get("output_config"), thinking)
    tools = parse_tools(raw.get("tools"))
    choice, parallel = parse_tool_choice(raw.get("tool_choice"), tools)
    for key in IGNORED:
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise bad(key, "expected an object")
    conv = parse_messages(raw.get("messages"), raw.get("system"))
    fields = conv.fields(tools, choice, thinking, effort)      # the chat layer's checks, named as sent
    return fields, thinking, tools, choice, parallel


def parse_stop_sequences(value) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STOP_SEQUENCES \
            or not all(isinstance(s, str) and s for s in value):
        raise bad("stop_sequences", f"expected a list of at most {MAX_STOP_SEQUENCES} non-empty strings")
    return tuple(value)


NAMES = {"gen": "max_tokens", "text": "messages", "prompt": "messages", "sampling": "temperature",
         "stop": "stop_sequences"}


def parse_ask(raw: dict, svc) -> Ask:
    check_names(raw, CREATE_PARAMS, DEFAULT_ONLY)
    check_model(raw, svc)
    gen = _max_tokens(raw)
    stream_ = boolean(raw.get("stream"), "stream")
    number(raw, "temperature", 0, 1)
    thread = raw.get("thread")
    if isinstance(thread, dict) and thread.get("type") not in (None, "create"):
        # this server keeps no threads: a client continuing one is told so, and sends the whole conversation
        raise HttpError(404, "thread: this server keeps no threads; send the whole conversation (thread type"
                             " \"create\", or no thread)", param="thread", code="thread_not_found",
                        extra={"details": {"error_code": "thread_not_found"}})
    fields, thinking, tools, choice, parallel = parse_chat(raw)
    fields["stop"] = parse_stop_sequences(raw.get("stop_sequences"))
    fields["stop_at_eos"] = True
    fmt = (raw.get("output_config") or {}).get("format")    # structured outputs: {"type": "json_schema", "schema"}
    if fmt is not None:
        fields["response_format"] = text_format_of({"format": fmt}, tools, choice, "output_config")
    return Ask("chat", fields, gen, "max_tokens", parse_sampling(raw, svc), bool(stream_), False, thinking, tools,
               choice, parallel, names=dict(NAMES), endpoint="messages", gen_ceiling=True)


# -- answers -------------------------------------------------------------------------------------
def usage_of(run, final: bool = True) -> dict:
    reused = run.prompt_tokens_reused
    return {"input_tokens": run.prompt_tokens - reused, "output_tokens": run.generated_tokens if final else 0,
            "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_of(run, reply) -> tuple[str, str | None]:
    if reply.calls:
        return "tool_use", None
    if reply.error is not None:
        return "end_turn", None
    if run.finish_reason == "eos":
        return "end_turn", None
    if run.finish_reason == "stop":
        return "stop_sequence", run.stop_string
    return "max_tokens", None


def signature(thinking: str) -> str:
    """A thinking block's signature: opaque, never empty (clients drop a block whose signature is
    ""), the same for the same text. Taken back with any value: the thinking's text is the reasoning."""
    return base64.b64encode(hashlib.sha256(SIGNATURE + thinking.encode()).digest()).decode()


def blocks_of(ask: Ask, reply) -> list[dict]:
    out = []
    if ask.thinking and reply.reasoning:
        out.append({"type": "thinking", "thinking": reply.reasoning, "signature": signature(reply.reasoning)})
    if reply.content:
        out.append({"type": "text", "text": reply.content})
    for call in reply.calls:
        out.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["name"],
                    "input": json.loads(call["arguments"])})
    return out


def _message(run, svc, content: list, stop: tuple = (None, None), usage: dict | None = None) -> dict:
    return {"id": "msg_" + run.id, "type": "message", "role": "assistant", "model": svc.model_id, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage or usage_of(run)}


def answer(ask: Ask, run, svc) -> dict:
    reply = reply_of(ask, run, svc)
    message = _message(run, svc, blocks_of(ask, reply), stop_of(run, reply))
    if reply.error is not None:
        message["tool_call_error"] = reply.error
    return message


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: ".encode() + json_bytes({"type": event, **data}).rstrip(b"\n") + b"\n\n"


PING = sse("ping", {})


class _Blocks:
    """The content blocks of a streamed answer, from the reply parser's events: each opened when
    its first text comes, closed when the next opens (or at the end), indexed from 0."""

    def __init__(self, ask: Ask, svc=None) -> None:
        self.ask, self.svc = ask, svc
        self.index = -1
        self.open: str | None = None
        self.calls = 0
        self.thinking = ""         # the open thinking block's text: its signature's at the close

    @staticmethod
    def waiting(position: int, waiting: int) -> list[bytes]:
        return [PING]

    @staticmethod
    def alive() -> list[bytes]:
        return [PING]

    @staticmethod
    def refused(error) -> list[bytes]:
        return [sse("error", {"error": error.anthropic_body()["error"]})]

    failed = refused

    def start(self, run) -> list[bytes]:
        return [sse("message_start", {"message": _message(run, self.svc, [], usage=usage_of(run, final=False))}), PING]

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"index": self.index, "delta": delta})

    def _start(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(sse("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = [self._delta({"type": "signature_delta", "signature": signature(self.thinking)})] \
            if self.open == "thinking" else []
        out.append(sse("content_block_stop", {"index": self.index}))
        self.open = None
        return out

    def feed(self, events) -> list[bytes]:
        out: list[bytes] = []
        for kind, value in events:
            if kind == "reasoning":
                if not self.ask.thinking:
                    continue
                if self.open != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    self.thinking = ""
                self.thinking += value
                out.append(self._delta({"type": "thinking_delta", "thinking": value}))
            elif kind == "content":
                if self.open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": value}))
            else:
                if self.calls and not self.ask.parallel_calls:
                    continue
                self.calls += 1
                out += self._start("tool_use", {"type": "tool_use", "id": tool_use_id(value["id"]),
                                                "name": value["name"], "input": {}})
                out += [self._delta({"type": "input_json_delta", "partial_json": f}) for f in value["fragments"]]
                out += self.close()
        return out


    def end(self, run, reply) -> list[bytes]:
        """The last block closed, message_delta (the stop reason, the usage), message_stop."""
        reason, sequence = stop_of(run, reply)
        data = {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage_of(run)}
        if reply.error is not None:
            data["tool_call_error"] = reply.error
        return self.close() + [sse("message_delta", data), sse("message_stop", {})]


def _events(pending):
    """The SSE body: pings while queued, message_start, the blocks, message_delta, message_stop."""
    return streamed(pending, _Blocks(pending.ask, pending.svc))


# -- endpoints ----------------------------------------------------------------------------------
async def _create(request: Request) -> Response:
    svc = request.app.state.service
    return await respond(request, lambda raw: parse_ask(raw, svc), _events, lambda ask, run, raw: answer(ask, run, svc))


_tokenizer_lock = threading.Lock()


def _tokenizer(app, svc):
    """The served model's tokenizer, loaded once per app (its service)."""
    with _tokenizer_lock:
        tok = getattr(app.state, "anthropic_tokenizer", None)
        if tok is None:
            tok = Tokenizer.load(svc.model)
            app.state.anthropic_tokenizer = tok
        return tok


def _count(app, svc, fields: dict) -> int:
    tok = _tokenizer(app, svc)
    return len(chat_prompt_ids(tok, list(fields["messages"]), thinking=fields["thinking"], tools=fields["tools"],
                               tool_choice=fields["tool_choice"], reasoning_effort=fields["reasoning_effort"]))


async def _count_tokens(request: Request) -> Response:
    svc = request.app.state.service
    raw = await json_body(request, "request parameters")
    check_names(raw, COUNT_PARAMS, {})
    check_model(raw, svc)
    fields = parse_chat(raw)[0]
    return json_response(200, {"input_tokens": await run_in_threadpool(_count, request.app, svc, fields)})


async def _anthropic(handler, request: Request) -> Response:
    """The handler's answer, its errors in Anthropic's shape."""
    try:
        return await handler(request)
    except HttpError as exc:
        return error_response(exc)
    except Ds4fError as exc:
        return error_response(refused(exc, {}, NAMES))


async def messages(request: Request) -> Response:
    return await _anthropic(_create, request)


async def count_tokens(request: Request) -> Response:
    return await _anthropic(_count_tokens, request)
