"""OpenAI's Responses API: POST /v1/responses, what Codex CLI and other Responses clients speak.

    input         a string (one user message) or a list of items: messages ({role, content}: system,
                  developer, user, assistant; content a string or input_text / output_text parts;
                  system and developer keep their role and place), function_call ({call_id, name,
                  arguments}), function_call_output ({call_id, output}), reasoning (the next
                  assistant turn's reasoning: the text of its content's reasoning_text parts, else
                  of its summary, else the encrypted_content this server gave)
    instructions  the system prompt
    tools         [{"type": "function", "name", "description", "parameters"}] (the prompt shows those
                  three; strict is taken); tool_choice auto, none, required or {"type": "function",
                  "name"}; parallel_tool_calls
    reasoning     {"effort": none | minimal | low | medium | high | xhigh}: thinking mode unless none
                  (xhigh asks for the release's maximum effort); summary is accepted
    max_output_tokens (left out: what the context leaves after the prompt), temperature, top_p,
    stream; text {"format": ...}: text, json_object or json_schema {name, schema, strict} (the answer
    held to it: server.structured); include (reasoning.encrypted_content; what concerns built-in
    tools and images, which this server never answers with, is taken; output logprobs are refused),
    truncation "disabled" or "auto", background false and top_logprobs 0 are accepted (background
    true, other values: 400 naming them), and so are the parameters that do not change the answer
    (server.request.IGNORED: store, metadata, user, prompt_cache_key, safety_identifier,
    service_tier...). Nothing is stored: no GET /v1/responses/{id}, previous_response_id is refused.

The answer's output items, in order: reasoning (thinking mode, when the model reasoned: the text
as its content and as its summary, the part most clients show), the message (its output_text),
one function_call per call. status is completed, or incomplete with incomplete_details.reason
max_output_tokens. An answer whose calls were refused (engine.text.reply): its text is the
message, and the response's `tool_call_error` says why. Streaming sends the API's events:
response.created, response.in_progress, per item response.output_item.added, its deltas
(response.reasoning_summary_part.added, response.reasoning_text.delta with
response.reasoning_summary_text.delta, their .done events and response.reasoning_summary_part.done;
response.content_part.added / response.output_text.delta / .done / response.content_part.done;
response.function_call_arguments.delta / .done), response.output_item.done, then
response.completed, response.incomplete or response.failed. A refused conversation is a 400
naming `input` (input[3], instructions). One engine path with the chat endpoint (server.generation).
"""
from __future__ import annotations

import base64
import json

from starlette.requests import Request
from starlette.responses import Response

from ds4f.api import MAX_GEN

from .conversation import Conversation
from .errors import bad, json_bytes
from .generation import Ask, SseWaits, reply_of, respond, streamed
from .request import (EFFORTS, IGNORED, boolean, check_model, check_names, parse_sampling, parse_tool_choice,
                      parse_tools, text_parts, whole)
from .structured import text_format_of


PARAMS = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "reasoning",
          "max_output_tokens", "temperature", "top_p", "stream", "include", "text", "previous_response_id", *IGNORED)
# taken when they ask for what this server does anyway, else a 400 naming them: an answer in the
# background (then polled for) is not done here, nor logprobs; truncation "auto" changes nothing
# for a conversation that fits, and one that does not is refused either way
DEFAULT_ONLY = {"truncation": ("disabled", "auto"), "background": (False,), "top_logprobs": (0,)}
# include: the encrypted reasoning is given; what concerns items this server never makes (built-in
# tools, images) changes nothing; output logprobs are not computed
INCLUDES = ("reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
            "web_search_call.action.sources", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
            "message.input_image.image_url")
ENCRYPTED = "ds4f:"        # the prefix of the reasoning this server hands out as encrypted_content (not encrypted)
TEXT_PARTS = ("input_text", "output_text", "text")


def _tools(value) -> tuple:
    """Responses tools ({"type": "function", "name", ...}, flat) as function schemas."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("tools", "expected a list of function tools")
    flat = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad("tools", f"tools[{i}]: only function tools are supported, got {json.dumps(kind)}",
                      code="unsupported_value")
        flat.append({k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None})
    return parse_tools(flat)


def _choice(value, tools):
    if isinstance(value, dict) and value.get("type") == "function" and "function" not in value:
        value = {"type": "function", "function": {"name": value.get("name")}}
    return parse_tool_choice(value, tools)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its content's reasoning_text parts, else its summary's parts (this
    server writes the reasoning there too), else the encrypted_content this server gave; the first
    of them that holds text (a client may send back empty content or an empty summary part)."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise bad("input", f"{where}.{key}: expected a list of text parts")
        texts = [p.get("text") for p in parts if key == "summary" or p.get("type") in ("reasoning_text", "text")]
        if not all(isinstance(t, str) for t in texts):
            raise bad("input", f"{where}.{key}: reasoning text parts hold text")
        if "".join(texts):
            return "\n".join(texts)
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and sealed.startswith(ENCRYPTED):
        try:
            return base64.b64decode(sealed[len(ENCRYPTED):], validate=True).decode("utf-8")
        except ValueError:
            raise bad("input", f"{where}.encrypted_content: not one this server gave") from None
    return ""


def parse_input(value, instructions) -> Conversation:
    """The input items as the chat layer's messages: an assistant turn gathers the reasoning,
    message and function_call items that follow each other; function_call_output is a tool message;
    system and developer messages keep their role and place."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", "expected a string or a non-empty list of input items")
    conv = Conversation("input", "call_id")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "expected a string")
        conv.add({"role": "system", "content": instructions}, "instructions")
    turn: dict | None = None       # the assistant turn being gathered

    def assistant(where: str) -> dict:
        nonlocal turn
        if turn is None:
            turn = conv.add({"role": "assistant", "content": ""}, where)
        return turn

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad("input", f"{where}: expected an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise bad("input", f"{where}.role: {json.dumps(role)} is not supported (system, developer, user,"
                                   f" assistant)")
            text = text_parts(item.get("content"), f"{where}.content", TEXT_PARTS)
            if role == "assistant":
                assistant(where)["content"] += text
            else:
                turn = None
                conv.add({"role": role, "content": text}, where)
        elif kind == "reasoning":
            t = assistant(where)
            t["reasoning"] = t.get("reasoning", "") + _reasoning_text(item, where)
        elif kind == "function_call":
            t = assistant(where)
            calls = t.setdefault("tool_calls", [])
            conv.call_origins[(len(conv.messages) - 1, len(calls))] = where
            calls.append({"id": item.get("call_id"), "name": item.get("name"), "arguments": item.get("arguments")})
        elif kind == "function_call_output":
            turn = None
            output = item.get("output")
            output = output if isinstance(output, str) else text_parts(output, f"{where}.output", TEXT_PARTS)
            conv.add({"role": "tool", "tool_call_id": item.get("call_id"), "content": output}, where)
        else:
            raise bad("input", f"{where}.type: {json.dumps(kind)} items are not supported (message, reasoning,"
                               f" function_call, function_call_output)", code="unsupported_value")
    return conv


def parse_ask(raw: dict, svc) -> Ask:
    check_names(raw, PARAMS, DEFAULT_ONLY)
    check_model(raw, svc)
    if raw.get("previous_response_id") is not None:
        raise bad("previous_response_id", "this server stores no responses: send the whole conversation as input",
                  code="unsupported_parameter")
    if "input" not in raw:
        raise bad("input", "required: the conversation to answer", code="missing_parameter")
    stream_ = boolean(raw.get("stream"), "stream")
    _check_include(raw.get("include"))
    gen = whole(raw, "max_output_tokens", 1, MAX_GEN)     # None: what the context leaves after the prompt
    reasoning = raw.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad("reasoning", "expected an object: {\"effort\": ...}")
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort != "none" and effort not in EFFORTS:
        raise bad("reasoning", f"effort {json.dumps(effort)} is not one of none, {', '.join(EFFORTS)}")
    thinking = effort is not None and effort != "none"
    tools = _tools(raw.get("tools"))
    choice = _choice(raw.get("tool_choice"), tools)
    parallel = boolean(raw.get("parallel_tool_calls"), "parallel_tool_calls")
    fields = parse_input(raw["input"], raw.get("instructions")).fields(tools, choice, thinking,
                                                                       EFFORTS[effort] if thinking else None)
    fields.update(stop=(), stop_at_eos=True, response_format=text_format_of(raw.get("text"), tools, choice))
    sampling = parse_sampling({k: raw.get(k) for k in ("temperature", "top_p")}, svc)
    return Ask("chat", fields, gen, "max_output_tokens", sampling, bool(stream_), thinking=thinking, tools=tools,
               tool_choice=choice, parallel_calls=parallel is not False, endpoint="responses",
               names={"gen": "max_output_tokens", "text": "input", "prompt": "input", "sampling": "temperature"})


def _check_include(value) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad("include", f"expected a list of what to include ({', '.join(INCLUDES)})")
    for v in value:
        if v == "message.output_text.logprobs":
            raise bad("include", "message.output_text.logprobs: this server computes no logprobs",
                      code="unsupported_value")
        if v not in INCLUDES:
            raise bad("include", f"{json.dumps(v)} is not one of {', '.join(INCLUDES)}")


# -- the response ---------------------------------------------------------------------------------
class Shape:
    """The response object and its items, as the request asked for them."""

    def __init__(self, ask: Ask, raw: dict, svc, run) -> None:
        self.ask, self.raw, self.svc, self.run = ask, raw, svc, run
        self.encrypted = "reasoning.encrypted_content" in (raw.get("include") or ())

    def response(self, status: str, output: list, usage: dict | None = None, **extra) -> dict:
        raw, ask = self.raw, self.ask
        effort = (raw.get("reasoning") or {}).get("effort")
        return {"id": "resp_" + self.run.id, "object": "response", "created_at": int(self.run.started_at),
                "status": status, "error": None, "incomplete_details": None, "instructions": raw.get("instructions"),
                "max_output_tokens": ask.gen, "model": self.svc.model_id, "output": output,
                "parallel_tool_calls": ask.parallel_calls, "previous_response_id": None,
                "reasoning": {"effort": effort, "summary": (raw.get("reasoning") or {}).get("summary")},
                "store": False, "temperature": ask.sampling.temperature,
                "text": {"format": (raw.get("text") or {}).get("format") or {"type": "text"}},
                "tool_choice": _choice_out(ask.tool_choice), "tools": raw.get("tools") or [],
                "top_p": ask.sampling.top_p, "truncation": "disabled", "usage": usage,
                "metadata": raw.get("metadata") or {}, **extra}

    def reasoning_item(self, text: str, status: str = "completed") -> dict:
        """The reasoning, whole, as its content and as its summary (the part clients show)."""
        item = {"type": "reasoning", "id": f"rs_{self.run.id}",
                "summary": [{"type": "summary_text", "text": text}] if text else [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}
        if self.encrypted:
            item["encrypted_content"] = ENCRYPTED + base64.b64encode(text.encode()).decode()
        return item

    def message_item(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": f"msg_{self.run.id}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}

    @staticmethod
    def call_item(call: dict, status: str = "completed") -> dict:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["name"], "arguments": call["arguments"] if status == "completed" else "",
                "status": status}

    def usage(self) -> dict:
        run = self.run
        reasoning = 0
        if self.ask.thinking:   # the tokens up to and with </think>
            ids = run.generated_ids
            end = _end_think(run)
            reasoning = ids.index(end) + 1 if end is not None and end in ids else len(ids)
        return {"input_tokens": run.prompt_tokens, "input_tokens_details": {"cached_tokens": run.prompt_tokens_reused},
                "output_tokens": run.generated_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": run.prompt_tokens + run.generated_tokens}

    def finished(self, reply, output: list) -> dict:
        extra = {"tool_call_error": reply.error} if reply.error is not None else {}
        if self.run.finish_reason == "length" and not reply.calls:
            return self.response("incomplete", output, self.usage(), **extra) | \
                {"incomplete_details": {"reason": "max_output_tokens"}}
        return self.response("completed", output, self.usage(), **extra)


def _end_think(run):
    tok = getattr(run, "tokenizer", None)
    try:
        return tok.special_id("</think>") if tok is not None else None
    except Exception:   # a tokenizer without the marker: no reasoning tokens to count
        return None


def _choice_out(choice):
    if choice in (None, "auto", "none", "required"):
        return choice or "auto"
    return {"type": "function", "name": choice}


def _output(shape: Shape, reply) -> list:
    out = []
    if shape.ask.thinking and reply.reasoning:
        out.append(shape.reasoning_item(reply.reasoning))
    if reply.content or not (out or reply.calls):      # an empty answer is an empty message
        out.append(shape.message_item(reply.content))
    out += [shape.call_item(c) for c in reply.calls]
    return out


async def create(request: Request) -> Response:
    svc = request.app.state.service

    def answer(ask: Ask, run, raw: dict) -> dict:
        shape = Shape(ask, raw, svc, run)
        reply = reply_of(ask, run, svc)
        return shape.finished(reply, _output(shape, reply))

    return await respond(request, lambda raw: parse_ask(raw, svc), _events, answer)


def _event(kind: str, seq: int, **fields) -> bytes:
    return f"event: {kind}\n".encode() + b"data: " + json_bytes({"type": kind, "sequence_number": seq, **fields}) \
        .rstrip(b"\n") + b"\n\n"


class _Items(SseWaits):
    """The output items of a streamed response, from the reply parser's events: a reasoning or
    message item opened when its first text comes, closed when another opens (or at the end); a
    function_call sent whole when it is read. Every event is numbered (sequence_number, from 0)."""

    def __init__(self, ask: Ask, svc, raw: dict) -> None:
        self.ask, self.svc, self.raw = ask, svc, raw
        self.shape: Shape | None = None     # the response, once its run has started
        self.seq = 0
        self.output: list = []              # the items done
        self.open: dict | None = None       # the item being streamed
        self.texts = {"reasoning": "", "content": ""}

    def emit(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return _event(kind, self.seq - 1, **fields)

    def refused(self, error) -> list[bytes]:
        return [self.emit("error", code=error.code, message=error.message, param=error.param)]

    def start(self, run) -> list[bytes]:
        shape = self.shape = Shape(self.ask, self.raw, self.svc, run)
        return [self.emit("response.created", response=shape.response("in_progress", [])),
                self.emit("response.in_progress", response=shape.response("in_progress", []))]

    def _begin(self, want: str) -> list[bytes]:
        index = len(self.output)
        if want == "reasoning":
            self.open = self.shape.reasoning_item("", "in_progress")
            return [self.emit("response.output_item.added", output_index=index, item=self.open),
                    self.emit("response.reasoning_summary_part.added", item_id=self.open["id"], output_index=index,
                              summary_index=0, part={"type": "summary_text", "text": ""})]
        self.open = self.shape.message_item("", "in_progress")
        return [self.emit("response.output_item.added", output_index=index, item=self.open),
                self.emit("response.content_part.added", item_id=self.open["id"], output_index=index,
                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        index, text = len(self.output), self.texts
        if self.open["type"] == "reasoning":
            item = self.shape.reasoning_item(text["reasoning"])
            out = [self.emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=text["reasoning"]),
                   self.emit("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                             summary_index=0, text=text["reasoning"]),
                   self.emit("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                             summary_index=0, part={"type": "summary_text", "text": text["reasoning"]})]
        else:
            item = self.shape.message_item(text["content"])
            out = [self.emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=text["content"], logprobs=[]),
                   self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=item["content"][0])]
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open = None
        return out

    def _call(self, call: dict) -> list[bytes]:
        if any(i["type"] == "function_call" for i in self.output) and not self.ask.parallel_calls:
            return []
        out = self.close()
        index = len(self.output)
        item = self.shape.call_item(call, "in_progress")
        out.append(self.emit("response.output_item.added", output_index=index, item=item))
        out += [self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=fragment) for fragment in call["fragments"]]
        out.append(self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=call["arguments"]))
        item = self.shape.call_item(call)
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out

    def feed(self, events) -> list[bytes]:
        out: list[bytes] = []
        for kind, value in events:
            if kind == "call":
                out += self._call(value)
                continue
            want = "reasoning" if kind == "reasoning" else "message"
            if want == "reasoning" and not self.ask.thinking:
                continue
            if self.open is not None and self.open["type"] != want:
                out += self.close()
            if self.open is None:
                out += self._begin(want)
            index, item_id = len(self.output), self.open["id"]
            if want == "reasoning":
                self.texts["reasoning"] += value
                out += [self.emit("response.reasoning_text.delta", item_id=item_id, output_index=index,
                                  content_index=0, delta=value),
                        self.emit("response.reasoning_summary_text.delta", item_id=item_id, output_index=index,
                                  summary_index=0, delta=value)]
            else:
                self.texts["content"] += value
                out.append(self.emit("response.output_text.delta", item_id=item_id, output_index=index,
                                     content_index=0, delta=value, logprobs=[]))
        return out

    def end(self, run, reply) -> list[bytes]:
        """The open item closed (an empty answer is an empty message), then the final response."""
        out = self._begin("message") if self.open is None and not self.output and not reply.calls else []
        out += self.close()
        final = self.shape.finished(reply, self.output)
        out.append(self.emit("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                             response=final))
        return out

    def failed(self, failure) -> list[bytes]:
        return [self.emit("response.failed", response=self.shape.response(
            "failed", self.output, error={"code": failure.code or "server_error", "message": failure.message}))]


def _events(pending):
    """The Responses API's event stream (see the module docstring and _Items)."""
    return streamed(pending, _Items(pending.ask, pending.svc, pending.raw))
