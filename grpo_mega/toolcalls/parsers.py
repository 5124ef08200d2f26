"""Finding tool calls in a model turn's text: a registry of parsers by name (rollout.multi_turn.parser), and
`parse_turn`, the one entry the rollout uses, which never raises on model output.

A parser returns every call it finds, in order; a call whose JSON or arguments are malformed is still
returned, with `error` set, so that the error becomes the tool's turn and the rollout goes on. `parse_turn`
adds the limits (a call's text at most `max_chars` characters, its arguments nested at most `MAX_DEPTH`
deep, at most `max_calls` calls a turn: the rest answered by one error), turns anything a parser raises on
adversarial text (RecursionError on deep nesting, ValueError on a 5,000-digit number) into an error call, and
counts a call opened and never closed (`unclosed`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from grpo_mega.registry import Registry

MAX_DEPTH = 32
"""Arguments nested deeper than this (objects and lists) are refused: they could not be pickled to a worker."""


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: Optional[str] = None
    """Why the call could not be made (malformed JSON, arguments not an object, over a limit); None: well formed."""


@dataclass
class ParsedTurn:
    """What `parse_turn` found in one model turn."""

    calls: list[ToolCall]
    unclosed: int = 0
    """Calls opened and never closed (`<tool_call>` without `</tool_call>`): not run, counted."""
    dropped: int = 0
    """Calls beyond max_calls (answered by one error call)."""


PARSERS: Registry[Callable[[str], list[ToolCall]]] = Registry("tool-call parser")

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MAX_BODY = 1 << 20  # a parser never reads more of one call than this (parse_turn's max_chars is lower)


def _depth(obj, limit: int) -> int:
    """The nesting depth of a parsed JSON value, walked without recursion; stops counting past `limit`."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


@PARSERS.register("hermes", "qwen")
def hermes(text: str) -> list[ToolCall]:
    """Hermes / Qwen2.5 / Qwen3 format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
    per turn. `arguments` may also be a JSON-encoded string of an object (as some models write it)."""
    calls = []
    for m in _HERMES.finditer(text):
        body = m.group(1).strip()
        if len(body) > _MAX_BODY:
            calls.append(ToolCall(name="", error=f"the tool call has {len(body)} characters; at most {_MAX_BODY}"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(name="", error=f"the tool call is not valid JSON ({e.msg}): {body[:200]!r}"))
            continue
        except (RecursionError, ValueError) as e:  # nested too deep for the decoder; an over-long integer
            calls.append(ToolCall(name="", error=f"the tool call cannot be read ({type(e).__name__}: {str(e)[:100]})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(name="", error=f'a tool call needs {{"name": ..., "arguments": {{...}}}}; got {body[:200]!r}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (RecursionError, ValueError):
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], error=f"arguments must be a JSON object; got {str(args)[:200]!r}"))
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


def _unclosed(parser: str, text: str) -> int:
    if parser == "bare":
        return 0
    return max(0, text.count("<tool_call>") - len(_HERMES.findall(text)))


def _size(call: ToolCall) -> int:
    try:
        return len(json.dumps(call.arguments, ensure_ascii=False)) + len(call.name)
    except (TypeError, ValueError, RecursionError):
        return _MAX_BODY + 1


def parse_turn(parser: str, text: str, max_calls: int = 8, max_chars: int = 8192) -> ParsedTurn:
    """The calls of one model turn with parser `parser`, within the limits; never raises on the text."""
    try:
        calls = PARSERS.get(parser)(text)
        unclosed = _unclosed(parser, text)
    except Exception as e:  # noqa: BLE001 - model output must not end the rollout; the error becomes a tool turn
        return ParsedTurn([ToolCall(name="", error=f"the tool calls could not be parsed ({type(e).__name__}: "
                                                   f"{str(e)[:100]})")])
    for c in calls:
        if c.error is not None:
            continue
        if _depth(c.arguments, MAX_DEPTH) > MAX_DEPTH:
            c.arguments, c.error = {}, f"the call's arguments are nested deeper than {MAX_DEPTH} levels"
        elif _size(c) > max_chars:
            c.arguments, c.error = {}, (f"the call's arguments have more than {max_chars} characters "
                                        f"(rollout.multi_turn.max_tool_call_chars)")
    dropped = max(0, len(calls) - max_calls)
    if dropped:
        calls = calls[:max_calls] + [ToolCall(name="", error=f"{dropped} more tool calls in this turn were not run: at "
                                                             f"most {max_calls} a turn (rollout.multi_turn."
                                                             f"max_tool_calls_per_turn)")]
    return ParsedTurn(calls, unclosed, dropped)
