"""Chat messages as SGLang 0.5.23 hands them to a Jinja chat template (serving_chat.py
`_apply_jinja_template`), so a multi-turn tool conversation renders the same prompt as on SGLang.

SGLang dumps each message's model (`msg.model_dump()`), then:
- an assistant message's `tool_calls[i].function.arguments` given as a JSON string is parsed into
  a dict (`normalize_assistant_tool_call_arguments`; templates render `arguments | tojson` or
  iterate it): a string that is not JSON, or JSON that is not an object, is a 400;
- content null becomes "" (an assistant message that only calls tools);
- keys whose value is null are dropped (`process_content_for_template_format`), so a template's
  `message.tool_calls is defined` holds only where there are calls; inside a tool call, nulls
  stay (`{"id", "index", "type", "function": {"name", "arguments"}}`, unknown keys dropped);
- a `tool` message keeps `tool_call_id` and `name`; its text parts are joined with spaces
  (`normalize_tool_content`);
- a `user` message is role and content only (SGLang's user model has no other field).

Not followed: `tools` on a system message, `phase` and `prefix` (dropped, as unknown fields are).
"""

from __future__ import annotations

import json
from typing import Any

CALL_SHAPE = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<a JSON object, as a string>"}}'
MESSAGE_FIELDS = ("tool_call_id", "name", "reasoning_content")  # passed on when not null, in SGLang's order


def check_tool_calls(messages: list) -> list:
    """ValueError naming `messages[i].tool_calls[j]...`, the value and the shape to send, for the
    first tool call that SGLang would refuse (its `ToolCall` fields and the arguments it parses)."""
    for index, message in enumerate(messages):
        if (problem := _tool_calls_problem(message.tool_calls, message.role == "assistant")) is not None:
            where, value, why = problem
            raise ValueError(
                f"messages[{index}].tool_calls{where}={value!r:.80}: {why}; send each call as {CALL_SHAPE}"
            )
    return messages


def _tool_calls_problem(calls: Any, parses_arguments: bool) -> tuple[str, Any, str] | None:
    """(where inside `tool_calls`, the value there, what is wrong), or None when well formed."""
    if calls is None:
        return None
    if not isinstance(calls, list):
        return "", calls, "tool_calls is a list of calls"
    for position, call in enumerate(calls):
        if (problem := _call_problem(call, parses_arguments)) is not None:
            where, value, why = problem
            return f"[{position}]{where}", value, why
    return None


def _call_problem(call: Any, parses_arguments: bool) -> tuple[str, Any, str] | None:
    if not isinstance(call, dict):
        return "", call, "a tool call is a JSON object"
    if call.get("type", "function") != "function":
        return ".type", call["type"], "a tool call's type is 'function'"
    for key, kind in (("id", str), ("index", int)):
        if not isinstance(call.get(key), kind | None) or isinstance(call.get(key), bool):
            return f".{key}", call[key], f"{key} is {'a string' if kind is str else 'an integer'} or null"
    function = call.get("function")
    if not isinstance(function, dict):
        return ".function", function, "a tool call needs a 'function' object"
    if not isinstance(function.get("name"), str | None):
        return ".function.name", function["name"], "a function's name is a string"
    arguments = function.get("arguments")
    if not isinstance(arguments, str | dict | None):
        return ".function.arguments", arguments, "arguments are a JSON object as a string (or an object)"
    if parses_arguments and isinstance(arguments, str):
        why = _arguments_problem(arguments)
        return (".function.arguments", arguments, why) if why else None
    return None


def _arguments_problem(arguments: str) -> str | None:
    """Why SGLang would refuse these arguments when it parses them for the template, or None."""
    try:
        parsed = json.loads(arguments, parse_constant=_no_constant)
    except ValueError as exc:
        return f"not valid JSON ({exc})"
    return None if isinstance(parsed, dict) else "the arguments must be a JSON object, not another JSON value"


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's parser takes NaN and Infinity; SGLang's orjson does not


def template_message(role: str, content: str, fields: dict[str, Any]) -> dict[str, Any]:
    """One message as SGLang passes it to the chat template: `content` already text, `fields` the
    message's tool_call_id, name, reasoning_content and tool_calls as sent (checked)."""
    if role == "user":
        return {"role": role, "content": content}
    message = {"role": role, "content": content}
    message.update({key: fields[key] for key in MESSAGE_FIELDS if fields.get(key) is not None})
    if fields.get("tool_calls") is not None:
        message["tool_calls"] = [_template_call(call, role == "assistant") for call in fields["tool_calls"]]
    return message


def _template_call(call: dict[str, Any], parse_arguments: bool) -> dict[str, Any]:
    """SGLang's `ToolCall.model_dump()`: id, index, type, function {name, arguments}; arguments
    parsed into a dict on assistant messages."""
    function = call["function"]
    arguments = function.get("arguments")
    if parse_arguments and isinstance(arguments, str):
        arguments = json.loads(arguments)
    return {
        "id": call.get("id"),
        "index": call.get("index"),
        "type": "function",
        "function": {"name": function.get("name"), "arguments": arguments},
    }
