"""Prompt datasets in verl's schema, from jsonl or parquet.

A row: `prompt` (chat messages: a non-empty list of {"role", "content"}), `reward_model.ground_truth`,
optionally `data_source` and `extra_info`. Prompts are rendered with the tokenizer's chat template (with the
generation prompt) and tokenised here; prompts longer than `max_prompt_length` tokens are dropped and
counted (one whose rendered text has more characters than that many tokens could hold is dropped before it
is tokenised). A malformed row (bytes that are not UTF-8, a wrong-typed column, a null ground truth) stops
loading with a one-line error naming the file, the line and what to do.

Multi-turn rows (rollout.multi_turn, verl's fields): `extra_info.tools_kwargs` ({tool name: {"create_kwargs":
{...}, "execute_kwargs": {...}}}) names the tools the row offers (their schemas go to the chat template's
`tools=`; a name not among the run's tools is refused at start-up) and the keyword arguments their calls get;
`extra_info.need_tools_kwargs: true` requires them. A row without tools_kwargs is offered every tool of the run.
The row travels with its prompt to the multi-turn engine, so rows with the same prompt may differ in kwargs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator


class DataError(ValueError):
    """A data file that cannot be used as it is."""


@dataclass
class PromptExample:
    prompt_ids: list[int]
    ground_truth: Any
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)
    index: int = 0


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a BOM only starts a file
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{line_no}: not UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} of "
                                    f"the line); save the file as UTF-8, e.g. iconv -f latin1 -t utf-8") from None
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg}); expected one JSON object per line") from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError("reading parquet needs pyarrow: pip install pyarrow") from None
        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        for start in range(0, table.num_rows, 1024):
            try:
                rows = table.slice(start, 1024).to_pylist()
            except UnicodeDecodeError:  # find the row, for the message
                for i in range(start, min(start + 1024, table.num_rows)):
                    try:
                        table.slice(i, 1).to_pylist()
                    except UnicodeDecodeError as e:
                        raise DataError(f"{path}:{i + 1}: a string column is not UTF-8 ({e.reason}); rewrite the "
                                        f"file with its strings as UTF-8") from None
                raise
            for i, row in enumerate(rows, start + 1):
                yield i, row
    else:
        raise DataError(f"{path}: unknown data format {path.suffix!r}; expected .jsonl or .parquet")


def _check(row: Any, where: str) -> tuple[list[dict], Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with 'prompt' and 'reward_model', got {type(row).__name__}")
    if "prompt" not in row:
        raise DataError(f"{where}: missing column 'prompt' (chat messages: [{{'role': 'user', 'content': ...}}])")
    msgs = row["prompt"]
    if isinstance(msgs, str) or not isinstance(msgs, list) or not msgs or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        raise DataError(f"{where}: 'prompt' must be a non-empty list of {{'role': str, 'content': str}} messages")
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise DataError(f"{where}: missing column 'reward_model.ground_truth'")
    if rm["ground_truth"] is None:
        raise DataError(f"{where}: 'reward_model.ground_truth' is null; give the answer the reward checks against, "
                        f"or drop the row")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: 'extra_info' must be an object ({{\"key\": value, ...}}) or absent, got "
                        f"{type(extra).__name__} {str(extra)[:40]!r}; wrap it, e.g. {{\"note\": ...}}, or drop it")
    return msgs, rm["ground_truth"]


def _chars_per_token(tokenizer) -> int | None:
    """An upper bound on the characters one token covers: its longest vocabulary entry (a byte-level entry
    spells each byte as one character; a text character is at least one byte), times 4 for a normaliser that
    merges characters (NFKC composes at most a few into one). None where the tokenizer lists no vocabulary."""
    try:
        return 4 * max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: tokenise every prompt
        return None


def row_tools(row: dict, where: str, tools: dict[str, dict]) -> tuple[list[dict], dict]:
    """(the schemas the row offers, its tools_kwargs) against the run's tools {name: schema}."""
    extra = row.get("extra_info") or {}
    kwargs = extra.get("tools_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) or v is None for v in kwargs.values()):
        raise DataError(f"{where}: 'extra_info.tools_kwargs' must map tool names to objects "
                        f"({{\"calculator\": {{\"create_kwargs\": {{...}}}}}}), got {str(kwargs)[:60]!r}")
    unknown = [n for n in kwargs if n not in tools]
    if unknown:
        raise DataError(f"{where}: extra_info.tools_kwargs names tool {unknown[0]!r}, which is not in "
                        f"rollout.multi_turn.tools ({', '.join(tools)}); add it there or drop it from the row")
    if extra.get("need_tools_kwargs") and not kwargs:
        raise DataError(f"{where}: extra_info.need_tools_kwargs is true but extra_info.tools_kwargs is empty; "
                        f"give the row's tools_kwargs or set need_tools_kwargs to false")
    for name, kw in kwargs.items():
        for k in ("create_kwargs", "execute_kwargs"):
            if kw and kw.get(k) is not None and not isinstance(kw[k], dict):
                raise DataError(f"{where}: extra_info.tools_kwargs.{name}.{k} must be an object, got "
                                f"{type(kw[k]).__name__}")
    names = list(kwargs) or list(tools)
    return [tools[n] for n in names], {n: dict(kw or {}) for n, kw in kwargs.items()}


def load_prompts(path: str, tokenizer, max_prompt_length: int,
                 tools: dict[str, dict] | None = None) -> tuple[list[PromptExample], int]:
    """(examples, number dropped for being longer than max_prompt_length). Raises DataError on bad input.
    `tools` ({name: schema}, rollout.multi_turn on): each prompt is rendered with the schemas its row offers as
    the chat template's `tools=`, and its tools_kwargs checked against them (kept in extra_info)."""
    p = Path(path)
    out, dropped, seen = [], 0, 0
    per_token = _chars_per_token(tokenizer)
    for line_no, row in _rows(p):
        where = f"{p}:{line_no}"
        msgs, truth = _check(row, where)
        seen += 1
        kw = {}
        if tools is not None:
            schemas, tools_kwargs = row_tools(row, where, tools)
            kw = {"tools": schemas}
        try:
            if per_token and sum(len(m["content"]) for m in msgs) > per_token * max_prompt_length and len(
                    tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
            ) > per_token * max_prompt_length:  # (rendered: a template may leave a message out)
                dropped += 1  # more text than max_prompt_length tokens can spell: dropped without tokenising it
                continue
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
        except Exception as e:  # noqa: BLE001 - template errors come in many types
            raise DataError(f"{where}: the tokenizer's chat template failed on this prompt ({e})") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        out.append(PromptExample(prompt_ids=list(ids), ground_truth=truth, data_source=str(row.get("data_source", "")),
                                 extra_info=dict(row.get("extra_info") or {}), index=len(out)))
    if seen == 0:
        raise DataError(f"{p}: no rows; expected prompts in verl's schema")
    if not out:
        raise DataError(f"{p}: all {seen} prompts are longer than batch.max_prompt_length={max_prompt_length} tokens")
    return out, dropped


class PromptStream:
    """Shuffled batches of prompts, epoch after epoch, reproducible from a seed and a cursor."""

    def __init__(self, examples: list[PromptExample], seed: int):
        self.examples, self.seed, self.cursor = examples, seed, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def get_state(self) -> int:
        return self.cursor

    def set_state(self, cursor: int) -> None:
        self.cursor = int(cursor)

    def next_batch(self, size: int) -> list[PromptExample]:
        out = []
        n = len(self.examples)
        while len(out) < size:
            epoch, pos = divmod(self.cursor, n)
            out.append(self.examples[self._order(epoch)[pos]])
            self.cursor += 1
        return out
