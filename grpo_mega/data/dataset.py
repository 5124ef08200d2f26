"""Prompt datasets in verl's schema, from jsonl or parquet.

A row: `prompt` (chat messages: a non-empty list of {"role", "content"}), `reward_model.ground_truth`,
optionally `data_source` and `extra_info`. Prompts are rendered with the tokenizer's chat template (with the
generation prompt) and tokenised here; prompts longer than `max_prompt_length` tokens are dropped and
counted. A malformed row stops loading with an error naming the file, the line and what was expected.
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
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
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
        for i, row in enumerate(table.to_pylist(), 1):
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
    return msgs, rm["ground_truth"]


def load_prompts(path: str, tokenizer, max_prompt_length: int) -> tuple[list[PromptExample], int]:
    """(examples, number dropped for being longer than max_prompt_length). Raises DataError on bad input."""
    p = Path(path)
    out, dropped, seen = [], 0, 0
    for line_no, row in _rows(p):
        where = f"{p}:{line_no}"
        msgs, truth = _check(row, where)
        seen += 1
        try:
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
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
