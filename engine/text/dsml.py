"""DeepSeek-V4's tool calls: the tools block of the prompt and the DSML calls of an answer
(the release's encoding/encoding_dsv4.py; the facts in the project's reference notes).

    render_tools(tools)        # the "## Tools" section the system prompt ends with
    render_calls(calls)        # "\\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name=...>...</｜DSML｜tool_calls>"
    check_tools(tools)         # OpenAI-style tool list -> the function schemas, or a Ds4fError naming the entry

A call in the model's output:

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A string value is written as it is (string="true"); any other value as JSON (string="false").
Several invokes in one block are parallel calls. The bars of ｜DSML｜ are fullwidth (U+FF5C).

Pieces: rendering returns (kind, text) pieces, kind "mark" for the format's own strings (read with
the tokenizer's special tokens: a tokenizer that has ｜DSML｜ as one token gets that token) and
"text" for what a client wrote (names, values, schemas: read as text, so no value forges a mark).
"""
from __future__ import annotations

import json
from typing import Mapping, Sequence

from ds4f.errors import Ds4fError, parse_json

DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}tool_calls>"
CALLS_CLOSE = f"</{DSML}tool_calls>"
CALLS_START = "\n\n" + CALLS_OPEN          # where the content ends and the calls begin
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
TOOL_RESULT = ("<tool_result>", "</tool_result>")
MAX_ARGUMENTS_DEPTH = 100    # levels of arrays and objects an earlier call's arguments may nest (the prompt's
                             # JSON of them and the checks recurse once a level)

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

# Thinking mode's "max" reasoning effort: this text opens the prompt (high and the default add nothing).
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "array": list,
              "object": dict, "null": type(None)}
MAX_TOOLS = 256

MAX_ARGUMENTS_DEPTH = 100   # levels of arrays and objects a call's arguments may nest (the prompt's JSON of them
                            # and the checks recurse once a level)


def to_json(value) -> str:
    """JSON as the format writes it (json.dumps' default separators, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: Sequence[Mapping]) -> list[tuple[str, str]]:
    """The tools section: the template's text as marks (its DSML strings included), the schemas,
    one JSON object per line, as text."""
    head, tail = TOOLS_TEMPLATE.format(dsml=DSML, schemas="\0").split("\0")
    return [("mark", head), ("text", "\n".join(to_json(dict(t)) for t in tools)), ("mark", tail)]


def render_calls(calls: Sequence[Mapping]) -> list[tuple[str, str]]:
    """An assistant turn's calls as the prompt holds them: [{"name", "arguments": dict}] -> pieces."""
    if not calls:
        return []
    out = [("mark", CALLS_START + "\n")]
    for i, call in enumerate(calls):
        out += [("mark", f'{INVOKE_OPEN} name="'), ("text", call["name"]), ("mark", '">\n')]
        for j, (key, value) in enumerate(call["arguments"].items()):
            is_str = isinstance(value, str)
            out += [("mark", f'{PARAM_OPEN} name="'), ("text", key),
                    ("mark", f'" string="{"true" if is_str else "false"}">'),
                    ("text", value if is_str else to_json(value)), ("mark", PARAM_CLOSE)]
            if j + 1 < len(call["arguments"]):
                out.append(("mark", "\n"))
        out.append(("mark", "\n" + INVOKE_CLOSE + ("\n" if i + 1 < len(calls) else "")))
    out.append(("mark", "\n" + CALLS_CLOSE))
    return out


def pieces_text(pieces: Sequence[tuple[str, str]]) -> str:
    return "".join(text for _, text in pieces)


# -- the tools a request offers ----------------------------------------------------------------------
def check_tools(tools, param: str = "tools") -> tuple[dict, ...]:
    """The function schemas of an OpenAI-style tool list ([{"type": "function", "function": {name,
    description, parameters}}]; a bare {name, description, parameters} is taken too), each as the
    prompt lists it: its name, description and parameters as given (`strict` and any other key of
    the function object are the client's, not the prompt's); a Ds4fError naming the entry that is
    not one."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise Ds4fError(f"{param}: expected a list of tools ({{\"type\": \"function\", \"function\": {{...}}}})",
                        param=param)
    if len(tools) > MAX_TOOLS:
        raise Ds4fError(f"{param}: at most {MAX_TOOLS} tools, got {len(tools)}", param=param)
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, Mapping):
            raise Ds4fError(f"{where}: expected a tool object", param=param)
        if "function" in tool or tool.get("type") is not None:
            if tool.get("type") != "function":
                raise Ds4fError(f"{where}.type: only \"function\" tools are supported, got "
                                f"{json.dumps(tool.get('type'))}", param=param)
            fn = tool.get("function")
            where += ".function"
        else:
            fn = tool
        fn = check_function(fn, where, param)
        if fn["name"] in names:
            raise Ds4fError(f"{where}.name: {fn['name']!r} is offered twice", param=param)
        names.add(fn["name"])
        out.append(fn)
    return tuple(out)


def check_text(value, where: str, param: str) -> None:
    """Text the prompt reads is text: encodable as UTF-8 (a lone surrogate, which a JSON escape of
    half a character gives, is not); a value that is not a string is checked as its JSON."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        of = "" if isinstance(value, str) else " of its JSON"
        raise Ds4fError(f"{where}: not valid text: {text[exc.start]!r} at character {exc.start}{of} is a lone"
                        f" surrogate (invalid UTF-8 in the input?)", param=param) from None


def check_function(fn, where: str, param: str) -> dict:
    """One function schema: a name, an optional description, parameters as a JSON Schema object."""
    if not isinstance(fn, Mapping):
        raise Ds4fError(f"{where}: expected a function schema {{name, description, parameters}}", param=param)
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or any(c in name for c in '"<>\n\r\t '):
        raise Ds4fError(f"{where}.name: expected a function name (1 to 64 characters, no spaces, quotes or angle"
                        f" brackets), got {json.dumps(name, ensure_ascii=False)}", param=param)
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise Ds4fError(f"{where}.description: expected a string", param=param)
    schema = fn.get("parameters")
    if schema is not None:
        check_schema(schema, f"{where}.parameters", param)
        if schema.get("type", "object") != "object":
            raise Ds4fError(f"{where}.parameters: a function's parameters are a JSON Schema of type \"object\"",
                            param=param)
    out = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
    for key, value in out.items():
        check_text(value, f"{where}.{key}", param)
    return out


def check_schema(schema, where: str, param: str, depth: int = 0) -> None:
    """Enough of JSON Schema to refuse what is not one: an object whose `type` names JSON types,
    whose `properties` are schemas and whose `required` lists strings."""
    if depth > 32:
        raise Ds4fError(f"{where}: nested too deeply", param=param)
    if not isinstance(schema, Mapping):
        raise Ds4fError(f"{where}: not a JSON Schema (expected an object, got {type(schema).__name__})", param=param)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        raise Ds4fError(f"{where}.type: not a JSON Schema type: {json.dumps(kind)} (one of "
                        f"{', '.join(JSON_TYPES)})", param=param)
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, Mapping):
            raise Ds4fError(f"{where}.properties: expected an object of schemas", param=param)
        for key, sub in props.items():
            check_schema(sub, f"{where}.properties.{key}", param, depth + 1)
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise Ds4fError(f"{where}.required: expected a list of property names", param=param)
    if isinstance(schema.get("items"), Mapping):
        check_schema(schema["items"], f"{where}.items", param, depth + 1)


def check_call(call, where: str, param: str) -> dict:
    """An earlier assistant turn's call, as a client sends it back: {"id", "name", "arguments"}
    with arguments as a JSON object or its text; -> {"id", "name", "arguments": dict}."""
    if not isinstance(call, Mapping):
        raise Ds4fError(f"{where}: expected a tool call object", param=param)
    name, args, cid = call.get("name"), call.get("arguments"), call.get("id")
    if not isinstance(name, str) or not name:
        raise Ds4fError(f"{where}.name: expected the called function's name", param=param)
    if cid is not None and not isinstance(cid, str):
        raise Ds4fError(f"{where}.id: expected a string", param=param)
    if isinstance(args, str):
        if args.strip():
            try:
                args = parse_json(args, f"{where}.arguments", max_depth=MAX_ARGUMENTS_DEPTH, param=param)
            except Ds4fError as exc:
                raise Ds4fError(exc.message.replace(": malformed JSON: ", ": not valid JSON: "), param=param) from None
        else:
            args = {}
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise Ds4fError(f"{where}.arguments: expected a JSON object of the call's arguments", param=param)
    check_text(name, f"{where}.name", param)
    check_text(dict(args), f"{where}.arguments", param)
    return {"id": cid or "", "name": name, "arguments": dict(args)}
