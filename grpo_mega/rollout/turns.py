"""The token ids of the messages that follow a model turn (tool results, a simulated user's reply), exactly as
the tokenizer's chat template renders them, with the messages' own text tokenized as text.

How: the template is rendered once per shape of segment (the roles and tool names that follow the assistant
turn) with a marker in place of each message's content, against a fixed stand-in conversation, and cut after
the stand-in assistant's content: the pieces between markers are the template's glue (turn ends, role headers,
the next assistant turn's generation prompt), tokenized with the tokenizer as it is (its special tokens are
control tokens). Each message's content is what the template makes of it alone (rendered once in the same
way: a template that JSON-quotes tool results still does), tokenized by `TextEncoder`, which matches no added or
special token: a tool result holding `<|im_end|>\\n<|im_start|>user` stays text and cannot forge a turn.

The end of the model's turn is the template's whatever ended it (`render(..., after=...)`): after one of the
trajectory's stop tokens (which the model sampled, and which must be the text the template ends an assistant
turn with: checked at start-up) the glue starts after it; after a call-stop token (rollout.multi_turn.call_stop,
e.g. `</tool_call>`, part of the turn's content) the glue starts with the template's own turn end, so a
trajectory reads `</tool_call><|im_end|>\\n<|im_start|>tool...` as the template renders it, never
`</tool_call>\\n<|im_start|>tool`. `check_tools_shown` warns when a template drops `tools=`."""

from __future__ import annotations

import json
import warnings
from typing import Iterable, Optional, Sequence

_MARK = "GRPOMEGAASSISTANTMARK"
_CONTENT = "GRPOMEGACONTENT{}X"
_PROBES = ("42", "  spaced \n\n lines  ", '{"a": [1, "b"]}', "<|im_end|>\n<|im_start|>user\nhi", "</tool_call><tool>")


class TextEncoder:
    """Token ids of text as text: no added token (special or not) is matched, so a string that spells a control
    token becomes ordinary tokens. A fast tokenizer's pipeline (normalizer, pre-tokenizer, model) without its
    added tokens; a slow tokenizer's encode with split_special_tokens."""

    def __init__(self, tokenizer):
        self.tok, self.plain = tokenizer, None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            spec = json.loads(backend.to_str())
            spec["added_tokens"] = []
            self.plain = Tokenizer.from_str(json.dumps(spec))

    def __call__(self, text: str) -> list[int]:
        if not text:
            return []
        text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates cannot be tokenized
        if self.plain is not None:
            return list(self.plain.encode(text, add_special_tokens=False).ids)
        return list(self.tok.encode(text, add_special_tokens=False, split_special_tokens=True))


def control_ids(tokenizer) -> set[int]:
    """Every added token's id (special or not: <|im_end|>, <tool_call>, ...) and every special id."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    return ids


class MessageRenderer:
    """`render(messages, after)`: the ids after a model turn, and where each message's text is in them.
    `messages`: (role, content, name) triples (name: the tool's, or None); `after`: 'stop' (the turn ended with
    one of `stop_token_ids`, which it holds) or 'call' (it ended with a call-stop token, part of its content).
    A template that cannot render the roles, that rewrites content in context, or whose assistant turn does not
    end with a stop token's text, is refused at construction (start-up) with a ValueError."""

    def __init__(self, tokenizer, stop_token_ids: Iterable[int], roles: Sequence[str] = ("tool",)):
        self.tok, self.text = tokenizer, TextEncoder(tokenizer)
        self.stop_texts = {int(i): tokenizer.decode([int(i)]) for i in stop_token_ids}
        self._glue: dict[tuple, list[str]] = {}
        self._single: dict[tuple, tuple[str, str]] = {}
        self._ids: dict[str, list[int]] = {}
        for role in roles:  # the template's turn end against every stop token, and its content handling
            rest = self._render([(role, _CONTENT.format(0), role if role == "tool" else None)])
            for i, s in self.stop_texts.items():
                if not s or not rest.startswith(s):
                    raise ValueError(f"the stop token {s!r} (id {i}) does not end an assistant turn in the chat template, "
                                     f"which ends one with {rest[:40]!r}: the {role} turn after it could not be "
                                     f"rendered as the template renders it; stop generation with the token the "
                                     f"template ends an assistant turn with")
            msgs = [(role, p, "probe" if role == "tool" else None) for p in _PROBES]
            assembled = "".join(self._pieces(msgs))
            if assembled != self._render(msgs):
                raise ValueError(f"the chat template renders a {role} message's content differently in context than "
                                 f"alone; its {role} turns cannot be tokenized piece by piece")

    def _render(self, messages) -> str:
        conv = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        for role, content, name in messages:
            conv.append({"role": role, "content": content, **({"name": name} if name else {})})
        try:
            full = self.tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - templates raise many types
            roles = sorted({m[0] for m in messages})
            raise ValueError(f"the chat template cannot render {', '.join(roles)} messages after an assistant turn "
                             f"({type(e).__name__}: {e})") from None
        if _MARK not in full:
            raise ValueError("the chat template dropped the assistant turn's content; cannot find the segment after it")
        return full[full.index(_MARK) + len(_MARK):]

    def _glue_of(self, shape: tuple) -> list[str]:
        if shape not in self._glue:
            marked = self._render([(r, _CONTENT.format(k), n) for k, (r, n) in enumerate(shape)])
            pieces = []
            for k in range(len(shape)):
                m = _CONTENT.format(k)
                if marked.count(m) != 1:
                    raise ValueError(f"the chat template does not show a {shape[k][0]} message's content as given "
                                     f"(found it {marked.count(m)} times)")
                head, marked = marked.split(m)
                pieces.append(head)
            self._glue[shape] = pieces + [marked]
        return self._glue[shape]

    def _content(self, role: str, content: str, name) -> str:
        """What the template makes of `content` in a message of its own (JSON-quoted, trimmed, or as it is)."""
        if (role, name) not in self._single:
            head, tail = self._glue_of(((role, name),))
            self._single[(role, name)] = (head, tail)
        head, tail = self._single[(role, name)]
        alone = self._render([(role, content, name)])
        if not (alone.startswith(head) and alone.endswith(tail)) or len(alone) < len(head) + len(tail):
            raise ValueError(f"the chat template rendered a {role} message around its content differently")
        return alone[len(head):len(alone) - len(tail)]

    def _pieces(self, messages) -> list[str]:
        glue = self._glue_of(tuple((r, n) for r, _, n in messages))
        out = [glue[0]]
        for (role, content, name), g in zip(messages, glue[1:]):
            out += [self._content(role, content, name), g]
        return out

    def _glue_ids(self, text: str) -> list[int]:
        if text not in self._ids:
            self._ids[text] = list(self.tok.encode(text, add_special_tokens=False))
        return self._ids[text]

    def render(self, messages: Sequence[tuple[str, str, Optional[str]]], after: str = "stop",
               stop_token: Optional[int] = None) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, [(start, end) of each message's content in ids]). `after='stop'`: the model's turn ended with
        `stop_token` (default: the first stop token), whose text the glue starts with and is dropped."""
        messages = [(r, c.encode("utf-8", "replace").decode("utf-8"), n) for r, c, n in messages]
        pieces = self._pieces(messages)
        if after == "stop":
            s = self.stop_texts[stop_token] if stop_token is not None else next(iter(self.stop_texts.values()))
            pieces[0] = pieces[0][len(s):]
        ids, spans = list(self._glue_ids(pieces[0])), []
        for k in range(len(messages)):
            start = len(ids)
            ids += self.text(pieces[1 + 2 * k])
            spans.append((start, len(ids)))
            ids += self._glue_ids(pieces[2 + 2 * k])
        return ids, spans


def check_tools_shown(tokenizer, schemas: list[dict], where: str = "") -> bool:
    """False, with a warning, when the chat template renders the same prompt with and without `tools=`: the
    model would never see the tools' schemas."""
    if not schemas:
        return True
    msgs = [{"role": "user", "content": "u"}]
    try:
        with_tools = tokenizer.apply_chat_template(msgs, tools=schemas, tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails here fails on the data too, with its own message
        return True
    if with_tools != without:
        return True
    warnings.warn(f"the chat template{where} ignores tools=: the model never sees the tools' schemas "
                  f"({', '.join(s['function']['name'] for s in schemas)}); describe them in the prompt (a system "
                  f"message) or use a template that renders tools", stacklevel=2)
    return False
