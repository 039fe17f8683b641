"""Structured outputs as the APIs ask for them: the answer held to JSON, or to a JSON Schema
(engine.text.constraint enforces it token by token).

    response_format_of(raw["response_format"], tools, tool_choice)    # chat completions
    text_format_of(raw["text"], tools, tool_choice)                    # the Responses API's text.format

Chat completions' response_format:
    {"type": "text"}                                          free text (as without it)
    {"type": "json_object"}                                   any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                                                              JSON valid against the schema
    {"type": "json_object", "schema": {...}}                  the same (llama.cpp's spelling)
The Responses API's text.format: {"type": "text" | "json_object"}, or {"type": "json_schema",
"name", "schema", "strict", "description"} (schema required, as there; chat completions' json_schema
without one is any JSON object, as there).

A schema the library cannot compile (a keyword it does not implement, an unknown format, a $ref
that resolves nowhere, bounds no value meets) is a 400 naming the parameter, with the reason. The
answer cannot be a tool call as well, so a request that offers tools (tool_choice other than
none) with a JSON format is refused. `strict` is accepted either way: the schema is always enforced.
"""
from __future__ import annotations

import json

from ds4f.api import Ds4fError, ResponseFormat, check_response_format

from .errors import HttpError, bad

KINDS = ("text", "json_object", "json_schema")


def response_format_of(value, tools=(), tool_choice=None, param: str = "response_format") -> ResponseFormat | None:
    """Chat completions' response_format -> a ResponseFormat (None: free text); a 400 naming it else."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in KINDS:
        raise bad(param, f"expected {{\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}, got "
                         f"{_short(value)}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        fmt = ResponseFormat.json_object() if schema is None else _schema_format(schema, None, None, param)
    else:
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad(f"{param}.json_schema", "expected {\"name\", \"schema\", \"strict\"}: the JSON Schema to follow")
        fmt = _json_schema(spec, f"{param}.json_schema")
    return _checked(fmt, tools, tool_choice, param)


def text_format_of(text, tools=(), tool_choice=None, param: str = "text") -> ResponseFormat | None:
    """The Responses API's `text` ({"format": ..., "verbosity": ...}) -> a ResponseFormat (None: free text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad(param, "expected {\"format\": {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}")
    value = text.get("format")
    if value is None:
        return None
    where = f"{param}.format"
    if not isinstance(value, dict) or value.get("type") not in KINDS:
        raise bad(where, f"expected {{\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}, got "
                         f"{_short(value)}")
    if value["type"] == "text":
        return None
    if value["type"] == "json_schema" and value.get("schema") is None:     # the Responses API requires it
        raise bad(f"{where}.schema", "required: the JSON Schema the answer must follow", code="missing_parameter")
    fmt = ResponseFormat.json_object() if value["type"] == "json_object" else _json_schema(value, where)
    return _checked(fmt, tools, tool_choice, where)


def _json_schema(spec: dict, where: str) -> ResponseFormat:
    name, strict = spec.get("name"), spec.get("strict")
    if name is not None and not isinstance(name, str):
        raise bad(f"{where}.name", f"expected a string, got {_short(name)}")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.strict", f"expected true or false, got {_short(strict)}")
    schema = spec.get("schema")
    if schema is None:      # chat completions' schema is optional: then any JSON object
        return ResponseFormat("json_object", name=name, strict=strict)
    return _schema_format(schema, name, strict, f"{where}.schema")


def _schema_format(schema, name, strict, where: str) -> ResponseFormat:
    if not isinstance(schema, dict):
        raise bad(where, f"expected a JSON Schema object, got {_short(schema)}")
    try:
        return ResponseFormat.json_schema(schema, name=name, strict=strict)
    except Ds4fError as exc:
        raise bad(where, _reason(exc)) from None


def _checked(fmt: ResponseFormat, tools, tool_choice, param: str) -> ResponseFormat:
    if tools and tool_choice != "none":
        raise bad(param, "a JSON answer cannot also be a tool call: send tool_choice \"none\" (the tools are then left"
                         " out of the prompt), or leave the tools or the format out", code="unsupported_value")
    try:
        return check_response_format(fmt)
    except Ds4fError as exc:
        raise HttpError(400, f"{param}: {_reason(exc)}", param=param, code="invalid_value") from None


def _reason(exc: Ds4fError) -> str:
    return exc.message.removeprefix("response_format: ")


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
