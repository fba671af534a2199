"""How a model writes tool calls, per chat-template family: a table of parsers (``TOOL_FORMATS``).

- ``hermes`` (Qwen2.5, Qwen3 and other templates in the Hermes style): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, several per
  message allowed;
- ``llama3`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole message is one JSON object
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``;
- ``plain`` (base models, no chat template): the ``hermes`` call syntax, generation stopped at
  ``</tool_call>``, and the result appended as ``<tool_response>...</tool_response>`` after which the
  model goes on in the same text.

OLMo-2 instruct's chat template has no tool-calling format (no ``tools`` argument, no tool role), so
OLMo-2 models use ``plain``. ``auto`` picks from the chat template: ``hermes`` when it mentions
``<tool_call>``, ``llama3`` when it has the ``ipython`` role, else ``plain``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlvr.errors import UserError


class ToolFormatError(UserError, ValueError):
    """A tool-call format name that is not in the table."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and arguments, or ``error`` when it could not be read."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None


def _call_from_json(text: str, arguments_key: str) -> ToolCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall(None, error=f"the tool call is not valid JSON ({e.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error='a tool call is a JSON object with a "name"')
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], error=f'the "{arguments_key}" of a tool call must be a JSON object')
    return ToolCall(obj["name"], arguments)


_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text``, in order."""
    return [_call_from_json(m.group(1).strip(), "arguments") for m in _TAGGED.finditer(text)]


def parse_llama3(text: str) -> list[ToolCall]:
    """The message's one JSON tool call (``{"name": ..., "parameters": ...}``), or none when the message
    is not such an object (an ordinary answer: without tags, a malformed call cannot be told from prose,
    unless it follows ``<|python_tag|>``)."""
    stripped = text.strip()
    tagged = stripped.startswith("<|python_tag|>")
    body = stripped.removeprefix("<|python_tag|>").strip()
    if not (body.startswith("{") and body.endswith("}")):
        return []
    call = _call_from_json(body, "parameters")
    return [call] if call.name is not None or tagged else []


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parse: Callable[[str], list[ToolCall]]
    stop: tuple[str, ...] = ()
    """Stop strings that end a turn at a call (chat models end their turn with EOS instead)."""
    render_result: Callable[[str], str] | None = None
    """For formats without a chat template: the text appended after a call for its result."""


def _plain_result(content: str) -> str:
    return f" <tool_response>{content}</tool_response>"


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", parse_hermes),
    "llama3": ToolFormat("llama3", parse_llama3),
    "plain": ToolFormat("plain", parse_hermes, stop=("</tool_call>",), render_result=_plain_result),
}


def tool_format(name: str, chat_template: str | None = None) -> ToolFormat:
    """The format ``name`` (``auto``: chosen from ``chat_template``, see the module docstring)."""
    if name == "auto":
        if chat_template and "<tool_call>" in chat_template:
            name = "hermes"
        elif chat_template and "ipython" in chat_template:
            name = "llama3"
        else:
            name = "plain"
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise ToolFormatError(
            f"unknown env.tool_format {name!r}: choose auto or one of {', '.join(sorted(TOOL_FORMATS))}"
        ) from None


def tool_message(content: str, name: str | None) -> dict[str, Any]:
    """The tool-role message that carries a result back to the model."""
    return {"role": "tool", "content": content, **({"name": name} if name else {})}
