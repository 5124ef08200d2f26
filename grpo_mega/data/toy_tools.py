"""The toy tool task (task=product_tool, with rollout.multi_turn.enable=true): multiply two 2-digit numbers
("<bos>37*58=" -> "2146"), which a tiny model cannot do by itself (a guess is right about 1 time in 10^4) and
can by calling the calculator: `<tool_call>37*58</tool_call><eos>` (the `expression` parser), the tool's turn
`<tool>2146</tool>`, then `2146<eos>`. The tokenizer is made in-process: the successor task's symbols plus
'*' and the tool-call markers, with a chat template for the tool turns."""

from __future__ import annotations

import random

from grpo_mega.data.toy import SPECIALS, ToyExample
from grpo_mega.toolcalls import Tool, ToolError

SYMBOLS = [str(d) for d in range(10)] + [">", "+", "=", "*"]
MARKERS = ["<tool_call>", "</tool_call>", "<tool>", "</tool>"]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}<eos>"
                 "{% elif m.role == 'tool' %}<tool>{{ m.content }}</tool>{% else %}{{ m.content }}{% endif %}"
                 "{% endfor %}")


TENS_TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}<eos>"
                 "{% elif m.role == 'tool' %}<tool>{{ m.content }}{% else %}{{ m.content }}{% endif %}{% endfor %}")
"""task=tens_tool's: a tool turn is `<tool>RESULT`, the model's turn following right after the result."""


def make_tool_tokenizer(chat_template: str = CHAT_TEMPLATE, extra_symbols: tuple = ()):
    """A character-level PreTrainedTokenizerFast: <pad>=0, <bos>=1, <eos>=2, the symbols, the markers (whole),
    then `extra_symbols` (single characters)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + SYMBOLS + MARKERS + list(extra_symbols))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIALS + MARKERS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    tok.chat_template = chat_template
    return tok


class ProductTask:
    """Prompts "<bos>a*b=" for a, b in [10, 99]; the answer is a*b, the last model turn, followed by <eos>."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tok = tokenizer
        self.rng = random.Random(seed)

    def example(self, a: int, b: int) -> ToyExample:
        ids = [self.tok.bos_token_id] + self.tok.convert_tokens_to_ids(list(f"{a}*{b}="))
        return ToyExample(prompt_ids=ids, answer=str(a * b))

    def train_batch(self, size: int) -> list[ToyExample]:
        return [self.example(self.rng.randint(10, 99), self.rng.randint(10, 99)) for _ in range(size)]

    def get_state(self):
        version, internal, gauss = self.rng.getstate()
        return [version, list(internal), gauss]

    def set_state(self, state) -> None:
        self.rng.setstate((state[0], tuple(state[1]), state[2]))

    def validation(self) -> list[ToyExample]:
        r = random.Random(99)
        return [self.example(r.randint(10, 99), r.randint(10, 99)) for _ in range(16)]

    def reward(self, example: ToyExample, response_ids: list[int], trajectory: dict | None = None) -> float:
        """1 when the model's last turn is exactly the product and <eos>."""
        want = self.tok.convert_tokens_to_ids(list(example.answer)) + [self.tok.eos_token_id]
        return 1.0 if last_model_turn(response_ids, trajectory) == want else 0.0


def last_model_turn(response_ids: list[int], trajectory: dict | None) -> list[int]:
    """The ids of the model's last turn (trajectory["turns"]: grpo_mega.rollout.multi_turn); without turns, the
    whole response."""
    turns = [t for t in (trajectory or {}).get("turns", []) if t["role"] == "assistant"]
    return list(response_ids[turns[-1]["start"]:turns[-1]["end"]]) if turns else list(response_ids)


class TensDigitTask(ProductTask):
    """task=tens_tool, the toy task that learns with a tool from a random start: "<bos>37*58=" -> the tens
    digit of the product ("4": 2146), which a tiny model cannot work out in a short run (chance: 1 in 10)
    and can read off the calculator's answer. Each prompt's expression ("37*58//10%10") is its row's
    tools_kwargs (verl's create_kwargs), so calling the tool takes one token: with rollout.multi_turn.parser=bare
    and call_stop=[<tool_call>], a turn ending `<tool_call>` gets the template's turn end and the tool's turn,
    `<eos><tool>4` (TENS_TEMPLATE), and the next turn copies it, `4<eos>`. Reward: the first token of the
    model's last turn (trajectory["turns"]) is the digit: 1.0 with <eos> next, 0.5 without; else 0."""

    def example(self, a: int, b: int) -> ToyExample:
        ex = super().example(a, b)
        return ToyExample(prompt_ids=ex.prompt_ids, answer=str(a * b // 10 % 10),
                          extra_info={"tools_kwargs": self.tools_kwargs(ex.prompt_ids)})

    def validation(self) -> list[ToyExample]:
        r = random.Random(99)
        return [self.example(r.randint(10, 99), r.randint(10, 99)) for _ in range(64)]

    def tools_kwargs(self, prompt_ids) -> dict:
        """The prompt's row for the calculator: {"calculator": {"create_kwargs": {"expression": "37*58//10%10"}}}."""
        text = self.tok.decode(list(prompt_ids), skip_special_tokens=True)
        return {"calculator": {"create_kwargs": {"expression": text.rstrip("=") + "//10%10"}}}

    def reward(self, example: ToyExample, response_ids: list[int], trajectory: dict | None = None) -> float:
        ids = last_model_turn(response_ids, trajectory)
        if not ids or self.tok.convert_ids_to_tokens(ids[0]) != example.answer:
            return 0.0
        return 1.0 if len(ids) > 1 and ids[1] == self.tok.eos_token_id else 0.5


LETTERS = [chr(c) for c in range(ord("a"), ord("j") + 1)]
LOOKUP_TABLE = {f"{k:03d}": random.Random(2026 + k).choice(LETTERS) for k in range(1000)}
"""task=lookup_tool's secret: a letter for each 3-digit key, drawn at random (nothing in a key predicts it)."""


ERROR_SYMBOLS = [chr(c) for c in range(ord("k"), ord("z") + 1)] + ["E", ":", " ", "."]
"""Spelling a tool's error turn ("Error: down.") in the lookup tokenizer, after the answer letters."""


def make_lookup_tokenizer():
    """The tool tokenizer (TENS_TEMPLATE) with the answer letters a-j, then the rest of the lowercase letters,
    'E', ':', ' ' and '.' (for the tool's error messages), beside the digits."""
    return make_tool_tokenizer(TENS_TEMPLATE, extra_symbols=tuple(LETTERS + ERROR_SYMBOLS))


class KeyLookup(Tool):
    """The `lookup` tool of task=lookup_tool: the letter stored under a 3-digit key (LOOKUP_TABLE). The key
    comes from the prompt row's tools_kwargs (create_kwargs), so the call takes no arguments."""

    name = "lookup"
    description = "The letter stored under a 3-digit key."
    parameters = {"type": "object", "properties": {"key": {"type": "string", "description": "e.g. 042"}},
                  "required": ["key"]}

    key: str | None = None

    def create(self, key: str | None = None, **_) -> None:
        """`key`: the prompt row's (create_kwargs), used when the model's call gives none."""
        self.key = key

    def call(self, args: dict, **_) -> str:
        key = args.get("key", self.key)
        if key not in LOOKUP_TABLE:
            raise ToolError(f"no key {key!r}: keys are 3 digits, 000 to 999")
        return LOOKUP_TABLE[key]


class UnavailableLookup(KeyLookup):
    """The `lookup` tool when it is down: every call raises, so the tool's turn is the error message
    `<tool>Error: down.` (counted in multi_turn/tool_errors). The control run of
    experiments/tool_task.py: the same command as the run with the tool, this tool in its place."""

    def call(self, args: dict, **_) -> str:
        raise ToolError("down.")


class LookupTask(ProductTask):
    """task=lookup_tool, the toy tool task: "<bos>372=" -> the letter (a-j) stored under key 372, drawn at
    random per key (LOOKUP_TABLE), so nothing but the tool can know it, and the 64 validation keys are never
    trained on (nothing to memorise). With rollout.multi_turn (parser=bare, call_stop=[<tool_call>],
    tools=[grpo_mega.data.toy_tools:KeyLookup]) a turn ending `<tool_call>` gets the template's turn end and the
    tool's turn, `<eos><tool>x`, and the next turn answers: `<tool_call>` | `<eos><tool>x` | `x<eos>`.

    Reward (nothing for calling): 1.0 when the first letter a-j the model writes in its turn after the last
    tool turn (trajectory["turns"]: a result or an error message; a `<tool>` the model writes itself is none)
    is the answer; else 0, and 0 without a tool turn, so guessing instead of calling never pays more than
    calling. With the tool unavailable (UnavailableLookup: its turn is an error message) the answer after
    it is a guess: chance, 1 in 10.

    `shaping=True` (task=lookup_call, the warm-up of experiments/tool_task.py, NOT a measure of anything): 1.0 for a
    call. The warm-up runs one turn (rollout.multi_turn.max_turns=1: the turn ends at the call and no tool
    runs), so nothing after a tool result is trained and the measured runs start knowing no answer."""

    def __init__(self, tokenizer, seed: int = 0, shaping: bool = False):
        super().__init__(tokenizer, seed)
        self.shaping = shaping
        self.tool_call = tokenizer.convert_tokens_to_ids("<tool_call>")
        self.letters = set(tokenizer.convert_tokens_to_ids(LETTERS))
        keys = list(range(1000))
        random.Random(7).shuffle(keys)
        self.val_keys, self.train_keys = keys[:64], keys[64:]

    def example(self, key: int) -> ToyExample:
        k = f"{key:03d}"
        ids = [self.tok.bos_token_id] + self.tok.convert_tokens_to_ids(list(k + "="))
        return ToyExample(prompt_ids=ids, answer=LOOKUP_TABLE[k], extra_info={"tools_kwargs": self.tools_kwargs(ids)})

    def train_batch(self, size: int) -> list[ToyExample]:
        return [self.example(self.rng.choice(self.train_keys)) for _ in range(size)]

    def validation(self) -> list[ToyExample]:
        return [self.example(k) for k in self.val_keys]

    def tools_kwargs(self, prompt_ids) -> dict:
        """The prompt row's tools_kwargs: {"lookup": {"create_kwargs": {"key": "372"}}}."""
        text = self.tok.decode(list(prompt_ids), skip_special_tokens=True)
        return {"lookup": {"create_kwargs": {"key": text.split("=")[0]}}}

    def final_turn(self, response_ids: list[int], trajectory: dict | None) -> list[int] | None:
        """The ids of the model's turn after the last tool turn (a result or an error message), or None without
        a tool turn."""
        turns = (trajectory or {}).get("turns", [])
        last_tool = max((k for k, t in enumerate(turns) if t["role"] == "tool"), default=None)
        if last_tool is None:
            return None
        after = [t for t in turns[last_tool + 1:] if t["role"] == "assistant"]
        return list(response_ids[after[0]["start"]:after[0]["end"]]) if after else []

    def reward(self, example: ToyExample, response_ids: list[int], trajectory: dict | None = None) -> float:
        if self.shaping:  # the warm-up: a call, whatever follows
            return 1.0 if self.tool_call in response_ids else 0.0
        turn = self.final_turn(response_ids, trajectory)
        if turn is None:
            return 0.0  # no tool turn: nothing the model says counts
        letters = [t for t in turn if t in self.letters]  # the answer: the first of a-j the model writes
        return 1.0 if letters[:1] == self.tok.convert_tokens_to_ids([example.answer]) else 0.0


# ---- the registered tasks (grpo_mega.data.tasks.TASKS): each one's builder and tokenizer ---------------------

def _task(t):
    from grpo_mega.data.tasks import Task

    return Task(train_batch=t.train_batch, validation=t.validation, reward=t.reward, stop_token_ids=[t.tok.eos_token_id],
                get_state=t.get_state, set_state=t.set_state)


def product_tool_task(cfg, tok):
    return _task(ProductTask(tok, seed=cfg.run.seed))


def tens_tool_task(cfg, tok):
    return _task(TensDigitTask(tok, seed=cfg.run.seed))


def lookup_tool_task(cfg, tok):
    return _task(LookupTask(tok, seed=cfg.run.seed))


def lookup_call_task(cfg, tok):
    return _task(LookupTask(tok, seed=cfg.run.seed, shaping=True))


def product_tool_tokenizer():
    return make_tool_tokenizer(CHAT_TEMPLATE)


def tens_tool_tokenizer():
    return make_tool_tokenizer(TENS_TEMPLATE)


lookup_tool_tokenizer = lookup_call_tokenizer = make_lookup_tokenizer
