"""A chat request's `tools` and `tool_choice` as SGLang 0.5.23 serves them without a
--tool-call-parser (serving_chat.py `_process_messages`): the tools are rendered into the chat
template and the model's raw text comes back as the content (no `tool_calls` parsing).

- `tool_choice` "auto" (the default when tools are given) renders the tools, each in the shape
  SGLang's `Tool.model_dump()` gives the template (`template_tool`), and the output text keeps
  special tokens (SGLang sets skip_special_tokens=false then, so tool-call markers survive).
- "none" renders no tools.
- "required" or a named function: SGLang forces a call by constrained decoding, which the embedded
  engine does not do; refused, as `response_format` is (admission.unserved).

SGLang's tools on system messages, its JSON-schema check of `parameters` and its rewrite of type
aliases in them are not followed here."""

from __future__ import annotations

import json
from typing import Any

SHAPE = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {a JSON schema}}}'
# SGLang's `Function` fields in their declared order; `strict` and `defer_loading` are left out when null
FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")
OMITTED_WHEN_NULL = {"strict", "defer_loading"}


def check_tools(tools: list[Any] | None) -> list[Any] | None:
    """ValueError naming `tools[i]`, its value and the shape to send, for the first item that is not an
    OpenAI function tool (SGLang's `Tool` and `Function` fields and types)."""
    for index, tool in enumerate(tools or []):
        if (problem := _tool_problem(tool)) is not None:
            where, value, why = problem
            raise ValueError(f"tools[{index}]{where}={value!r:.80}: {why}; send each tool as {SHAPE}")
    return tools


def _tool_problem(tool: Any) -> tuple[str, Any, str] | None:
    """(where inside the tool, the value there, what is wrong), or None when the tool is well formed."""
    if not isinstance(tool, dict):
        return "", tool, "a tool is a JSON object"
    if tool.get("type", "function") != "function":
        return ".type", tool["type"], "the embedded engine renders function tools only"
    function = tool.get("function")
    if not isinstance(function, dict):
        return ".function", function, "a tool needs a 'function' object"
    if not isinstance(function.get("name"), str):
        return ".function.name", function.get("name"), "a function needs a 'name' string"
    if not isinstance(function.get("description"), str | None):
        return ".function.description", function["description"], "a description is a string"
    if not isinstance(function.get("parameters"), dict | None):
        return ".function.parameters", function["parameters"], "parameters are a JSON schema object"
    for key, where in (("strict", function), ("defer_loading", function), ("defer_loading", tool)):
        if not isinstance(where.get(key), bool | None):
            prefix = ".function" if where is function else ""
            return f"{prefix}.{key}", where[key], f"{key} is true or false"
    try:
        json.dumps(tool, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "", tool, "it holds text with an unpaired surrogate, which UTF-8 cannot encode"
    return None


def check_tool_choice(choice: Any) -> Any:
    """ValueError naming `tool_choice`, its value and the fix unless it is "auto", "none" or unset."""
    if choice in (None, "auto", "none"):
        return choice
    forced = choice == "required" or (isinstance(choice, dict) and choice.get("type", "function") == "function")
    why = "a forced tool call needs constrained decoding, which the embedded engine does not do" if forced else ""
    raise ValueError(
        f"tool_choice={choice!r:.60}: {why or 'not a tool choice'}; send 'auto' or 'none' (the model's raw text "
        "is the content), or serve with SGLang (rollout.backend=sglang)"
    )


def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A checked tool as SGLang hands it to the chat template (`Tool.model_dump()`): type, function,
    defer_loading (null when unset); the function's known fields in the order the client sent them,
    then the others of description, name and parameters as null, unknown fields dropped. Templates
    often render `tool | tojson`, so the same prompt as SGLang's needs the same dict."""
    sent = tool["function"]
    values = {key: sent.get(key) for key in FUNCTION_FIELDS}
    if values["defer_loading"] is None:  # SGLang copies the tool's own defer_loading into the function
        values["defer_loading"] = tool.get("defer_loading")
    values = {key: value for key, value in values.items() if value is not None or key not in OMITTED_WHEN_NULL}
    order = [key for key in sent if key in values] + [key for key in values if key not in sent]
    function = {key: values[key] for key in order}
    return {"type": tool.get("type", "function"), "function": function, "defer_loading": tool.get("defer_loading")}
