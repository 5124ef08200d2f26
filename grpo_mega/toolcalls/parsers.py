"""Finding tool calls in a model turn's text: a registry of parsers by name (rollout.multi_turn.parser).
A parser returns every call it finds, in order; a call whose JSON or arguments are malformed is still
returned, with `error` set, so that the error becomes the tool's turn and the rollout goes on."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from grpo_mega.registry import Registry


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: Optional[str] = None
    """Why the call could not be made (malformed JSON, arguments not an object); None: well formed."""
    kwargs: dict = field(default_factory=dict)
    """The prompt row's keyword arguments for this tool (verl's extra_info.tools_kwargs[name]: create_kwargs and
    execute_kwargs merged), given to Tool.call beside the model's arguments; {} for none."""


PARSERS: Registry[Callable[[str], list[ToolCall]]] = Registry("tool-call parser")

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@PARSERS.register("hermes", "qwen")
def hermes(text: str) -> list[ToolCall]:
    """Hermes / Qwen2.5 / Qwen3 format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
    per turn. `arguments` may also be a JSON-encoded string of an object (as some models write it)."""
    calls = []
    for m in _HERMES.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(name="", error=f"the tool call is not valid JSON ({e.msg}): {body[:200]!r}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(name="", error=f'a tool call needs {{"name": ..., "arguments": {{...}}}}; got {body[:200]!r}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], error=f"arguments must be a JSON object; got {args!r:.200}"))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return calls


@PARSERS.register("expression")
def expression(text: str) -> list[ToolCall]:
    """`<tool_call>EXPR</tool_call>`: the calculator on EXPR (whitespace dropped); for small vocabularies
    (task=product_tool) that cannot spell JSON."""
    return [ToolCall(name="calculator", arguments={"expression": "".join(m.group(1).split())})
            for m in _HERMES.finditer(text)]


@PARSERS.register("bare")
def bare(text: str) -> list[ToolCall]:
    """Each `<tool_call>` in the turn is one call, without arguments, of the run's only tool (the name is left
    empty; grpo_mega.rollout.multi_turn fills it in, and refuses a run with several tools): the prompt row's
    tools_kwargs give the arguments (the toy tasks tens_tool and lookup_tool, with
    rollout.multi_turn.call_stop=[<tool_call>])."""
    return [ToolCall(name="") for _ in range(text.count("<tool_call>"))]
