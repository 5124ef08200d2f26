"""Tools a policy may call during a multi-turn rollout (grpo_mega.rollout.multi_turn): the `Tool` interface and
its per-trajectory lifecycle, the registry of built-in tools (an unknown name raises, listing the valid ones),
user tools by dotted path, and the built-in `calculator`. How a call is found in the model's text is
grpo_mega.toolcalls.parsers'; where and under which limits a tool runs is grpo_mega.toolcalls.pool's (worker
processes started from grpo_mega.toolcalls.worker, which holds the per-trajectory instances).
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
from typing import Any, Optional

from grpo_mega.registry import Registry


class ToolError(Exception):
    """A tool refused its arguments; the message becomes the tool's turn (the rollout goes on)."""


class Tool:
    """A tool the model calls, with verl's BaseTool lifecycle. `name` is what the model calls; `parameters` the
    JSON schema of its arguments (what a chat template's `tools=` shows the model).

    Lifecycle, in a tool worker process (grpo_mega.toolcalls.pool): the tool is built once per worker (`__init__`:
    put shared, read-only resources there); each trajectory that calls it gets its own instance, a shallow copy
    of that object, on which `create(**create_kwargs)` runs first (the prompt row's
    extra_info.tools_kwargs[name].create_kwargs: state set on `self` there belongs to this trajectory alone),
    then `call(args, **execute_kwargs)` for each of the trajectory's calls, in order (`args`: the model's
    arguments; execute_kwargs: the row's), returning the text of the tool's turn; at the trajectory's end
    `reward()` (an optional per-tool score, None for none; the reward function sees it as
    sample["tool_rewards"][name]) and `release()`. A `ToolError` (or any exception) in `call` becomes the
    tool's turn as an error message and the rollout goes on."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

    def create(self, **create_kwargs) -> None:
        """Start this trajectory's instance (default: keep the row's create_kwargs as `self.create_kwargs`)."""
        self.create_kwargs = create_kwargs

    def call(self, args: dict, **execute_kwargs) -> str:
        raise NotImplementedError

    def reward(self) -> Optional[float]:
        """This trajectory's score from the tool's point of view (None: none)."""
        return None

    def release(self) -> None:
        """The trajectory ended: free what `create` and `call` took."""

    def schema(self) -> dict:
        """The OpenAI-style function schema for `tokenizer.apply_chat_template(..., tools=[...])`."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


TOOLS: Registry[type] = Registry("tool")
"""Built-in tool classes by name."""


def build_tool(name: str) -> Tool:
    """A registered tool by name, or a user Tool (class or instance) by dotted path (`pkg.mod:MyTool` or
    `pkg.mod.MyTool`); the tool's own `name` is what the model calls."""
    if name in TOOLS:
        return TOOLS.get(name)()
    if "." not in name and ":" not in name:
        TOOLS.get(name)  # raises, listing the valid names
    module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tool {name!r}: cannot import {attr!r} from {module!r} ({e})") from None
    tool = obj() if isinstance(obj, type) else obj
    if not isinstance(tool, Tool) or not tool.name:
        raise ValueError(f"tool {name!r} must be a grpo_mega.toolcalls.Tool (class or instance) with a name; "
                         f"got {type(tool).__name__}")
    return tool


def build_tools(names) -> dict[str, Tool]:
    """The tools `names` (rollout.multi_turn.tools) by the name the model calls them; duplicates raise."""
    out: dict[str, Tool] = {}
    for n in names:
        t = build_tool(n)
        if t.name in out:
            raise ValueError(f"rollout.multi_turn.tools: two tools are called {t.name!r}")
        out[t.name] = t
    return out


# ---- calculator: arithmetic over a parsed expression tree (never eval) -------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100


def evaluate_arithmetic(expression: str) -> float | int:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses), walked node by node over
    `ast.parse(mode="eval")`: names, calls, attributes and anything else are refused (ToolError)."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION:
        raise ToolError(f"expression of {len(expression)} characters; at most {MAX_EXPRESSION}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse {expression!r}: {e.msg}") from None

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
                raise ToolError("result out of range")
            return value
        raise ToolError(f"{type(node).__name__} is not allowed: numbers and + - * / // % ** ( ) only")

    value = walk(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not finite")
    return value


@TOOLS.register("calculator")
class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses)."
    parameters = {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
                  "required": ["expression"]}
    expression: Optional[str] = None

    def create(self, expression: Optional[str] = None, **_) -> None:
        """`expression`: the prompt row's (create_kwargs), used when the model's call gives none."""
        self.expression = expression

    def call(self, args: dict, **_) -> str:
        if not args and self.expression is not None:
            args = {"expression": self.expression}
        if set(args) != {"expression"}:
            raise ToolError(f"calculator takes exactly one argument 'expression'; got {sorted(args)}")
        return str(evaluate_arithmetic(args["expression"]))
