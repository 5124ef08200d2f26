"""The toy task of the CPU demo: answer the successor of a digit ("3>" -> "4"), with a tokenizer made
in-process (nothing downloaded). An untrained model already answers right about 1 time in 16."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SPECIALS = ["<pad>", "<bos>", "<eos>"]
SYMBOLS = [str(d) for d in range(10)] + [">", "+", "="]


def make_tokenizer():
    """A word-level PreTrainedTokenizerFast over the task's symbols: <pad>=0, <bos>=1, <eos>=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + SYMBOLS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


@dataclass
class ToyExample:
    prompt_ids: list[int]
    answer: str
    extra_info: dict = field(default_factory=dict)
    """The row's extra_info: a toy tool task's tools_kwargs (grpo_mega.data.toy_tools)."""


class SuccessorTask:
    """Prompts "<bos> d >" for digits d; the answer is (d + 1) mod 10 followed by <eos>."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tok = tokenizer
        self.rng = random.Random(seed)

    def example(self, d: int) -> ToyExample:
        ids = [self.tok.bos_token_id] + self.tok.convert_tokens_to_ids([str(d), ">"])
        return ToyExample(prompt_ids=ids, answer=str((d + 1) % 10))

    def train_batch(self, size: int) -> list[ToyExample]:
        return [self.example(self.rng.randrange(10)) for _ in range(size)]

    def get_state(self):
        version, internal, gauss = self.rng.getstate()
        return [version, list(internal), gauss]

    def set_state(self, state) -> None:
        self.rng.setstate((state[0], tuple(state[1]), state[2]))

    def validation(self) -> list[ToyExample]:
        return [self.example(d) for d in range(10)]

    def reward(self, example: ToyExample, response_ids: list[int]) -> float:
        """1 for the right digit followed by <eos>; 0.5 for the right digit without it; else 0."""
        if not response_ids:
            return 0.0
        first = self.tok.convert_ids_to_tokens(response_ids[0])
        if first != example.answer:
            return 0.0
        return 1.0 if len(response_ids) > 1 and response_ids[1] == self.tok.eos_token_id else 0.5
