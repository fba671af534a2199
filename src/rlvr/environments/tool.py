"""``tool``: the model calls Python functions; their results come back as tool messages.

Each model turn is parsed for tool calls in the run's format (``rlvr.environments.formats``). A turn
without a call ends the conversation (it is the answer); a turn with calls gets one tool message per
call, in order: the function's result as text, or an error (an unknown tool, arguments the function
does not take, a call that is not valid JSON), so a bad call costs the model a turn, never the run.
The reward function receives ``tool_calls`` (calls made) and ``tool_errors`` (of them, those that
failed) as keyword arguments.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from rlvr.environments.base import EnvStep
from rlvr.environments.formats import ToolCall, tool_format, tool_message
from rlvr.environments.tools import Tool

if TYPE_CHECKING:
    from rlvr.task.example import Example


class ToolEnvironment:
    def __init__(self, tools: list[Tool], format_name: str = "auto", chat_template: str | None = None) -> None:
        self.tools = {t.name: t for t in tools}
        self.format_name = format_name
        self.format = tool_format(format_name, chat_template)

    def bind(self, chat_template: str | None) -> ToolEnvironment:
        """The format that ``auto`` picks for this chat template (None: a base model)."""
        self.format = tool_format(self.format_name, chat_template)
        return self

    @property
    def stop(self) -> tuple[str, ...]:
        return self.format.stop

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def reset(self, row: Example, messages: list[dict]) -> list[dict]:
        return messages

    def step(self, messages: list[dict]) -> EnvStep:
        calls = self.format.parse(messages[-1]["content"])
        # Counted over the whole conversation, so the environment keeps no state between rows.
        made = sum(len(self.format.parse(m["content"])) for m in messages if m["role"] == "assistant")
        failed = sum(m["content"].startswith("error:") for m in messages if m["role"] == "tool")
        if not calls:
            return EnvStep(done=True, reward_fields={"tool_calls": made, "tool_errors": failed})
        results = [self.run(call) for call in calls]
        errors = sum(content.startswith("error:") for content, _ in results)
        return EnvStep(
            messages=[tool_message(content, name) for content, name in results],
            reward_fields={"tool_calls": made, "tool_errors": failed + errors},
        )

    def run(self, call: ToolCall) -> tuple[str, str | None]:
        """``(content, tool name)`` of the tool message answering ``call``."""
        if call.error is not None:
            return f"error: {call.error}", call.name
        tool = self.tools.get(call.name or "")
        if tool is None:
            return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(self.tools))}", call.name
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as e:
            return f"error: {e}", call.name
        return tool(call.arguments), call.name
