"""Tools the model may call: plain Python functions, their JSON schemas, and the built-in ones.

A tool is a function with type hints and a Google-style docstring (``Args:`` describing every
argument); ``transformers.utils.get_json_schema`` turns it into the schema that chat templates show
the model. Whatever the function returns is turned into the text of the tool message (``str()``);
an exception it raises becomes ``error: ...`` in that message, so a bad call costs the model a turn,
never the run.

``TOOLS`` is the table of built-in tools by name (``env.tools`` in a config names them):

- ``calculator``: evaluates an arithmetic expression (numbers, ``+ - * / // % **`` and parentheses)
  by walking its syntax tree, with no ``eval``;
- ``python``: runs a program in ``rlvr.sandbox.run_python`` and returns what it printed.
"""

from __future__ import annotations

import ast
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlvr.errors import UserError
from rlvr.sandbox import run_python


class ToolError(UserError, ValueError):
    """A tool that cannot be offered to the model (no docstring, an unknown name, ...)."""


@dataclass(frozen=True)
class Tool:
    """A callable the environment runs for the model, with the schema the model is shown."""

    name: str
    fn: Callable[..., Any]
    schema: dict

    def __call__(self, arguments: dict) -> str:
        """The text of the tool message for a call with ``arguments`` (errors included, as text)."""
        try:
            return str(self.fn(**arguments))
        except Exception as e:  # noqa: BLE001 - a failing call is the model's mistake, answered in the tool message
            return f"error: {type(e).__name__}: {e}"


def as_tool(fn: Callable[..., Any]) -> Tool:
    """``fn`` as a ``Tool``, its schema from its signature and docstring."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises its own error types for a bad docstring
        raise ToolError(
            f"tool {getattr(fn, '__name__', fn)!r} has no usable schema ({e}); give it type hints and a "
            "docstring with an Args: section describing every argument"
        ) from None
    return Tool(schema["function"]["name"], fn, schema)


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
"""Largest exponent ``**`` accepts, so that a call cannot ask for a number with millions of digits."""


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        unary: Callable[[Any], int | float] = _UNARY[type(node.op)]
        return unary(_evaluate(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


# CPython 3.11 keeps one AST-building depth counter for all threads, so two parses at once in the
# rollout's tool threads can fail with a spurious SystemError (python/cpython#106905).
_PARSE_LOCK = threading.Lock()


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, with numbers, + - * / // % ** and parentheses, e.g. (7 + 5) * 2.
    """
    with _PARSE_LOCK:
        tree = ast.parse(expression.strip(), mode="eval")
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 12.0 reads as 12: what a person writes
    return str(value)


def python(code: str) -> str:
    """Run a Python program and return what it printed.

    Args:
        code: The program; print the values you need.
    """

    result = run_python(code, timeout_s=PYTHON_TIMEOUT_S, require_isolation=PYTHON_REQUIRE_ISOLATION)
    out = result.stdout
    if not result.ok:
        tail = result.stderr.strip().splitlines()[-1:] or [result.stopped or f"exit status {result.returncode}"]
        out += f"error: {tail[0]}"
    return out.strip()


PYTHON_TIMEOUT_S = 10.0
"""Seconds a ``python`` tool call may run."""
PYTHON_REQUIRE_ISOLATION = True
"""Refuse to run the ``python`` tool where the sandbox cannot isolate the code (``rlvr.sandbox``)."""

TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}
"""Built-in tools by name; ``register_tool`` adds one."""


def register_tool(fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """Add ``fn`` to ``TOOLS`` (under its own name by default); returns ``fn`` (usable as a decorator)."""
    as_tool(fn)  # refuse a function without a schema now, not at the first rollout
    TOOLS[name or fn.__name__] = fn
    return fn


def get_tools(names: tuple[str, ...] | list[str]) -> list[Tool]:
    """The tools named in ``names`` (``TOOLS`` keys)."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ToolError(f"unknown tool {unknown[0]!r} in env.tools: choose from {', '.join(sorted(TOOLS))}")
    return [as_tool(TOOLS[n]) for n in names]
