"""Tools for multi-turn rollouts: the tool-call text format, its parser, a registry and a safe calculator tool.

Tool-call format (plain text inside an assistant turn, one or more per turn)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}</tool_call>

The JSON object needs ``name`` (str) and ``arguments`` (object, may be omitted for no arguments).
"""
from __future__ import annotations

import ast
import inspect
import json
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["ToolCall", "ToolError", "ToolRegistry", "parse_tool_calls", "format_tool_call",
           "calculator", "builtin_tools", "TOOL_CALL_START", "TOOL_CALL_END"]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


class ToolError(ValueError):
    """A tool that is unknown, rejects its arguments, or fails."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: the tool ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict = field(default_factory=dict)


def format_tool_call(name: str, arguments: Mapping[str, Any] | None = None) -> str:
    """The text of a tool call in the documented format (inverse of :func:`parse_tool_calls`)."""
    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': dict(arguments or {})})}{TOOL_CALL_END}"


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """All well-formed tool calls in ``text`` and one error message per malformed ``<tool_call>`` block."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for j, match in enumerate(_CALL_RE.finditer(text)):
        body = match.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {j}: body is not valid JSON ({exc.msg} at char {exc.pos}): {body[:80]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f"tool call {j}: expected an object with a string 'name', got {body[:80]!r}")
            continue
        args = obj.get("arguments", {})
        if args is None:
            args = {}
        if not isinstance(args, dict):
            errors.append(f"tool call {j} ({obj['name']}): 'arguments' must be an object, got {type(args).__name__}")
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls, errors


class ToolRegistry:
    """Named Python tools. A tool is ``fn(**arguments, **tool_kwargs) -> str`` (sync or async).

    Example::

        >>> tools = ToolRegistry()
        >>> @tools.register(description="add two ints")
        ... def add(a: int, b: int) -> str:
        ...     return str(a + b)
        >>> tools.names()
        ['add']
    """

    def __init__(self) -> None:
        self._tools: dict[str, Callable[..., Any]] = {}
        self._descriptions: dict[str, str] = {}

    def register(self, fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str = ""
                 ) -> Any:
        """Register ``fn`` (or decorate) under ``name`` (default: the function's name)."""

        def deco(f: Callable[..., Any]) -> Callable[..., Any]:
            if not callable(f):
                raise TypeError(f"tool must be callable, got {type(f).__name__}")
            tool_name = name or f.__name__
            if tool_name in self._tools and self._tools[tool_name] is not f:
                raise ValueError(f"tool {tool_name!r} is already registered")
            self._tools[tool_name] = f
            self._descriptions[tool_name] = description or (inspect.getdoc(f) or "").split("\n")[0]
            return f

        return deco(fn) if fn is not None else deco

    def names(self) -> list[str]:
        """Registered tool names, sorted."""
        return sorted(self._tools)

    def describe(self) -> dict[str, str]:
        """Tool name -> one-line description (for a system prompt)."""
        return {n: self._descriptions[n] for n in self.names()}

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    async def call(self, call: ToolCall, tool_kwargs: Mapping[str, Any] | None = None) -> str:
        """Run ``call``; unknown tools, argument clashes and exceptions inside the tool raise :class:`ToolError`."""
        if call.name not in self._tools:
            raise ToolError(f"unknown tool {call.name!r}; registered tools: {self.names()}")
        extra = dict(tool_kwargs or {})
        clash = sorted(set(extra) & set(call.arguments))
        if clash:
            raise ToolError(f"tool {call.name!r}: arguments {clash} are fixed by the dataset's tools_kwargs and "
                            f"cannot be passed by the model")
        try:
            result = self._tools[call.name](**call.arguments, **extra)
            if inspect.isawaitable(result):
                result = await result
        except ToolError:
            raise
        except Exception as exc:  # a failing tool is feedback for the policy, reported as an observation
            raise ToolError(f"tool {call.name!r} failed: {type(exc).__name__}: {exc}") from exc
        return result if isinstance(result, str) else json.dumps(result) if isinstance(result, (dict, list)) \
            else str(result)


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNOPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("exponent or base too large")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval_node(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses on numbers) and return the result."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a string of at most 200 characters")
    value = _eval_node(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def builtin_tools() -> ToolRegistry:
    """A new registry holding the built-in tools (``calculator``)."""
    reg = ToolRegistry()
    reg.register(calculator, description="evaluate an arithmetic expression: {'expression': '3*(4+5)'}")
    return reg
