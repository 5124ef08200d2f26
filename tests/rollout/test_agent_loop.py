"""grpo_mega.rollout.agent_loop: tool calls run while other trajectories generate (async) or in lockstep; a user's
agent loop by dotted path drives trajectories (a scripted user replying, as the chat template renders a user
turn); a failing loop ends its trajectory only; the counts of max_turns, unclosed calls and non-string results;
and 1,000 adversarial model outputs through the engine, every trajectory scored (issue 40)."""

import json
import math
import random
import time

import pytest

from grpo_mega.conf.rollout import MultiTurnConfig
from grpo_mega.rollout.dump import read_dump, write_dump
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.multi_turn import MultiTurnEngine, rollout_metrics
from grpo_mega.toolcalls import Tool
from grpo_mega.toolcalls.pool import ToolPool
from tests.models.hf_fixtures import smollm2_dir


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


def prompt_ids(tok, q):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)


class Policy:
    """A context -> turn function as an engine; records each call's time and the prompts (by their first user
    text) it batched."""

    weight_version = 0

    def __init__(self, tok, turn):
        self.tok, self.turn, self.log = tok, turn, []
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        texts = [self.tok.decode(p) for p in prompts]
        self.log.append((time.monotonic(), [first_user(t) for t in texts]))
        out = [self.tok.encode(self.turn(t, s), add_special_tokens=False) + [self.end] for t, s in zip(texts, row_seeds)]
        return Generation(out, [[-0.1] * len(o) for o in out], ["stop"] * len(out), 0)

    def shutdown(self):
        pass


def first_user(text: str) -> str:
    return text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]


def sleep_call(seconds):
    return '<tool_call>{"name": "sleeper", "arguments": {"s": %s}}</tool_call>' % seconds


@pytest.mark.parametrize("async_tools", [True, False])
def test_a_slow_call_holds_up_only_its_own_trajectory(tok, async_tools):
    """'slow' calls a tool that takes 1.5 s, 'fast' one that takes 0.05 s. Async: 'fast' has its next turn
    generated, alone, while the slow call runs, and ends before it returns; in lockstep (async_tools=false)
    every batch holds both, and the second waits for the slow call."""
    engine = Policy(tok, lambda t, s: "done" if "slept" in t else sleep_call(1.5 if first_user(t) == "slow" else 0.05))
    pool = ToolPool(["tests.toolcalls.test_toolcalls:Sleeper"], num_workers=2, timeout_s=20)
    mt = MultiTurnEngine(engine, tok, pool, max_turns=3, stop_token_ids=[engine.end], async_tools=async_tools)
    try:
        while len(pool.worker_stats) < 2:  # both workers up (a loaded machine starts an interpreter slowly)
            time.sleep(0.05)
        t0 = time.monotonic()
        gen = mt.generate([prompt_ids(tok, "slow"), prompt_ids(tok, "fast")], 1, 1.0, 1.0, 200, [engine.end], seed=0)
    finally:
        mt.shutdown()
    batches = [b for _, b in engine.log]
    if async_tools:
        assert batches == [["slow", "fast"], ["fast"], ["slow"]]
        assert engine.log[1][0] - t0 < 1.0  # fast's second turn while slow's call still runs
    else:
        assert batches == [["slow", "fast"], ["slow", "fast"]]
        assert engine.log[1][0] - t0 >= 1.5
    assert gen.extra["multi_turn"]["tool_calls"] == [1, 1] and gen.finish_reasons == ["stop", "stop"]
    assert [t["text"] for t in gen.trajectories[0]["turns"]] == [sleep_call(1.5), "slept", "done"]
    assert gen.extra["multi_turn"]["per_tool"]["sleeper"]["calls"] == 2


class StreamingPolicy(Policy):
    """A Policy that reports each row as it ends, as the embedded engine does (on_row_done): row 0 at once, the
    others `tail` seconds later (a long row still decoding)."""

    def __init__(self, tok, turn, tail):
        super().__init__(tok, turn)
        self.tail, self.streamed = tail, []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None, row_max_new_tokens=None, on_row_done=None):
        gen = super().generate(prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset,
                               row_seeds)
        self.streamed.append(on_row_done is not None)
        for r in range(len(prompts)):
            if r == 1:
                time.sleep(self.tail)
            if on_row_done is not None:
                on_row_done(r, gen.token_ids[r], gen.logprobs[r], gen.finish_reasons[r])
        return gen


@pytest.mark.parametrize("async_tools", [True, False])
def test_a_call_starts_when_its_row_ends_not_when_the_batch_does(tok, async_tools):
    """'quick' calls a 0.6 s tool in its first turn, whose row ends at once; 'long' answers, its row ending 1.2 s
    later. Async: quick's call runs while long's row decodes, so its second turn is generated as soon as the
    first batch is done (not 0.6 s after); in lockstep the engine is never asked to report rows early."""
    engine = StreamingPolicy(tok, lambda t, s: "done" if "slept" in t or first_user(t) == "long" else sleep_call(0.6),
                             tail=1.2)
    pool = ToolPool(["tests.toolcalls.test_toolcalls:Sleeper"], num_workers=1, timeout_s=20)
    mt = MultiTurnEngine(engine, tok, pool, max_turns=3, stop_token_ids=[engine.end], async_tools=async_tools)
    try:
        while len(pool.worker_stats) < 1:
            time.sleep(0.05)
        t0 = time.monotonic()
        gen = mt.generate([prompt_ids(tok, "quick"), prompt_ids(tok, "long")], 1, 1.0, 1.0, 200, [engine.end], seed=0)
    finally:
        mt.shutdown()
    assert [b for _, b in engine.log] == [["quick", "long"], ["quick"]]
    assert engine.streamed == [async_tools, async_tools]
    second = engine.log[1][0] - t0
    if async_tools:
        assert second < 1.2 + 0.4, second  # the call (0.6 s) ran inside the first batch's 1.2 s
        assert gen.extra["multi_turn"]["tool_calls"] == [1, 0]
    else:
        assert second >= 1.2 + 0.6, second
    assert [t["text"] for t in gen.trajectories[0]["turns"]] == [sleep_call(0.6), "slept", "done"]


async def retry_until_right(traj):
    """A scripted user: the model answers; a wrong answer gets "No. Try again." (a user turn), up to 3 answers."""
    for _ in range(3):
        turn = await traj.generate()
        if turn is None or traj.done or turn["text"].strip() == traj.row["ground_truth"]:
            return
        traj.reply("No. Try again.")


async def raising_loop(traj):
    turn = await traj.generate()
    if "boom" in turn["text"]:
        raise RuntimeError("a bug in the user's loop")


def sync_loop(traj):
    return None


def test_an_agent_loop_by_dotted_path_with_a_scripted_user(tok):
    """The user's turns are the template's user turns (mask 0), the model's its own (mask 1): prompt + trajectory
    is, character for character, the template's rendering of the whole conversation."""
    answers = iter(["12", "41", "42"])
    engine = Policy(tok, lambda t, s: next(answers))
    mt = MultiTurnEngine(engine, tok, ToolPool(["calculator"]), max_turns=4, stop_token_ids=[engine.end],
                         agent_loop="tests.rollout.test_agent_loop:retry_until_right")
    p = prompt_ids(tok, "What is 6*7?")
    try:
        gen = mt.generate([p], 1, 1.0, 1.0, 300, [engine.end], seed=0, rows=[{"ground_truth": "42"}])
    finally:
        mt.shutdown()
    conv = [{"role": "user", "content": "What is 6*7?"}]
    for a in ("12", "41"):
        conv += [{"role": "assistant", "content": a}, {"role": "user", "content": "No. Try again."}]
    conv.append({"role": "assistant", "content": "42"})
    assert tok.decode(p + gen.token_ids[0]) == tok.apply_chat_template(conv, tokenize=False).removesuffix("\n")
    turns = gen.trajectories[0]["turns"]
    assert [(t["role"], t["text"]) for t in turns] == [("assistant", "12"), ("user", "No. Try again."),
                                                      ("assistant", "41"), ("user", "No. Try again."),
                                                      ("assistant", "42")]
    mask, ids = gen.model_mask[0], gen.token_ids[0]
    for t in turns:
        assert set(mask[t["start"]:t["end"]]) == {1 if t["role"] == "assistant" else 0}
    assert tok.decode(ids[turns[1]["start"]:turns[1]["end"]]) == "No. Try again."
    assert gen.extra["multi_turn"]["turns"] == [3] and gen.extra["multi_turn"]["tool_calls"] == [0]


def test_a_failing_agent_loop_ends_its_trajectory_only_and_bad_loops_are_refused_with_the_config(tok):
    engine = Policy(tok, lambda t, s: "boom" if "first" in t else "fine")
    mt = MultiTurnEngine(engine, tok, ToolPool(["calculator"]), stop_token_ids=[engine.end],
                         agent_loop="tests.rollout.test_agent_loop:raising_loop")
    try:
        gen = mt.generate([prompt_ids(tok, "first"), prompt_ids(tok, "second")], 2, 1.0, 1.0, 50, [engine.end], seed=0)
    finally:
        mt.shutdown()
    assert gen.extra["multi_turn"]["agent_loop_errors"] == [1, 1, 0, 0] and gen.finish_reasons == ["stop"] * 4
    assert rollout_metrics(gen)["multi_turn/agent_loop_errors"] == 0.5
    with pytest.raises(ValueError, match="must be an `async def` function; got function"):
        MultiTurnConfig(enable=True, agent_loop="tests.rollout.test_agent_loop:sync_loop")
    with pytest.raises(ValueError, match="rollout.multi_turn.agent_loop='tests.rollout.test_agent_loop:nope': cannot"):
        MultiTurnConfig(enable=True, agent_loop="tests.rollout.test_agent_loop:nope")
    with pytest.raises(ValueError, match="rollout.multi_turn.parser: unknown tool-call parser 'xml'; valid: bare"):
        MultiTurnConfig(parser="xml")
    with pytest.raises(ValueError, match="unknown tool 'serach'"):
        MultiTurnConfig(enable=True, tools=["serach"])


class Dict(Tool):
    name = "dict"

    def call(self, args, **_):
        return {"value": 1}


def test_max_turns_unclosed_calls_and_non_string_results_are_counted(tok):
    calls = iter(['<tool_call>{"name": "dict", "arguments": {}}</tool_call>', '<tool_call>{"name": "dict"',
                  '<tool_call>{"name": "dict", "arguments": {}}</tool_call>'] * 2)
    engine = Policy(tok, lambda t, s: next(calls) if "loop" in t else "<tool_call>{unclosed")
    mt = MultiTurnEngine(engine, tok, ToolPool(["tests.rollout.test_agent_loop:Dict"]), max_turns=2,
                         stop_token_ids=[engine.end])
    try:
        gen = mt.generate([prompt_ids(tok, "loop"), prompt_ids(tok, "open")], 1, 1.0, 1.0, 300, [engine.end], seed=0)
    finally:
        mt.shutdown()
    s = gen.extra["multi_turn"]
    # "loop": a call (its non-string result), then an unclosed call: the second turn is final, nothing run
    assert (s["tool_calls"], s["tool_nonstring"], s["unclosed_calls"], s["max_turns_reached"]) == \
        ([1, 0], [1, 0], [1, 1], [0, 0])
    assert gen.trajectories[0]["turns"][1]["text"] == "{'value': 1}"
    engine = Policy(tok, lambda t, s: '<tool_call>{"name": "dict", "arguments": {}}</tool_call>')
    mt = MultiTurnEngine(engine, tok, ToolPool(["tests.rollout.test_agent_loop:Dict"]), max_turns=2,
                         stop_token_ids=[engine.end])
    try:
        gen = mt.generate([prompt_ids(tok, "again")], 1, 1.0, 1.0, 300, [engine.end], seed=0)
    finally:
        mt.shutdown()
    assert gen.extra["multi_turn"]["max_turns_reached"] == [1] and gen.extra["multi_turn"]["tool_calls"] == [1]
    assert rollout_metrics(gen)["multi_turn/max_turns_reached"] == 1.0


def adversarial(rng: random.Random, tok) -> str:
    """One model turn an attacker or a broken policy might write."""
    kind = rng.randrange(10)
    call = lambda body: "<tool_call>" + body + "</tool_call>"  # noqa: E731
    if kind == 0:  # brackets nested far deeper than the JSON decoder's recursion
        d = rng.choice([50, 1000, 3000])
        return call('{"name": "calculator", "arguments": {"x": ' + "[" * d + "]" * d + "}}")
    if kind == 1:  # valid JSON nested ~800 deep: parses, could not be pickled
        d = rng.choice([40, 800])
        return call(json.dumps({"name": "calculator", "arguments": {"x": json.loads("[" * d + "]" * d)}}))
    if kind == 2:  # numbers past int's 4,300-digit limit, and past float's range
        return call('{"name": "calculator", "arguments": {"expression": "1", "n": 1' + "0" * rng.choice([5000, 50])
                    + ', "f": 1e999}}')
    if kind == 3:  # hundreds of calls in one turn
        return call(json.dumps({"name": "calculator", "arguments": {"expression": "1+1"}})) * rng.randint(9, 300)
    if kind == 4:  # one huge argument
        return call(json.dumps({"name": "calculator", "arguments": {"expression": "hello " * rng.choice([1, 1000])}}))
    if kind == 5:  # special tokens inside and around calls
        specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"]
        return call('{"name": "calc' + rng.choice(specials) + 'ulator", "arguments": {}}') + rng.choice(specials)
    if kind == 6:  # random token ids (byte tokens that do not make UTF-8, special ids)
        return tok.decode([rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))])
    if kind == 7:  # unclosed, empty, wrong types
        return rng.choice(["<tool_call>{", "<tool_call></tool_call>", call("null"), call('{"name": 5}'),
                           call('{"name": "calculator", "arguments": "[1,2"}')])
    if kind == 8:  # lone surrogates and control characters in the arguments
        return call('{"name": "calculator", "arguments": {"expression": "\\udcff\\u0000' + "\x07" + '"}}')
    return call(json.dumps({"name": "calculator", "arguments": {"expression": f"{rng.randint(1, 99)}*7"}}))


class Fuzz:
    """Each turn one of 200 adversarial outputs (tokenized once), drawn by the turn's seed, ending <|im_end|>."""

    weight_version = 0

    def __init__(self, tok):
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        rng = random.Random(0)
        self.outputs = [tok.encode(adversarial(rng, tok), add_special_tokens=False) + [self.end] for _ in range(200)]

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        out = [random.Random(s).choice(self.outputs) for s in row_seeds]
        return Generation(out, [[-0.1] * len(o) for o in out], ["stop"] * len(out), 0)

    def shutdown(self):
        pass


def test_a_thousand_adversarial_model_outputs_end_scored(tok, tmp_path):
    """1,000 trajectories of two adversarial turns each (deep nesting, huge numbers, floods of calls, oversized
    arguments, special tokens, invalid UTF-8, unclosed and malformed calls): the engine returns every one, each
    bad call an error turn (counted), and every trajectory is scored and dumped."""
    engine = Fuzz(tok)
    mt = MultiTurnEngine(engine, tok, ToolPool(["calculator"], num_workers=2), max_turns=2,
                         stop_token_ids=[engine.end], max_tool_calls_per_turn=4, max_tool_call_chars=4096)
    prompts = [prompt_ids(tok, f"q{i}") for i in range(500)]
    try:
        gen = mt.generate(prompts, 2, 1.0, 1.0, 16384, [engine.end], seed=3)
    finally:
        mt.shutdown()
    assert len(gen.token_ids) == 1000 and len(gen.trajectories) == 1000

    def score(traj):  # a reward that reads the structure: the final model turn, the tool turns' error flags
        final = [t for t in traj["turns"] if t["role"] == "assistant"][-1]["text"]
        errors = sum(t["error"] for t in traj["turns"] if t["role"] == "tool")
        return float("42" in final) - 0.1 * errors

    scores = [score(t) for t in gen.trajectories]
    assert all(math.isfinite(x) for x in scores)
    s = gen.extra["multi_turn"]
    assert sum(s["tool_errors"]) > 300 and sum(s["tool_calls"]) - sum(s["tool_errors"]) > 50  # bad ones and good
    assert all(len(m) == len(t) for m, t in zip(gen.model_mask, gen.token_ids))
    texts = [t["text"] for traj in gen.trajectories for t in traj["turns"] if t["role"] == "tool"]
    for expect in ("cannot be read (RecursionError", "nested deeper than 32 levels", "cannot be read (ValueError",
                   "more tool calls in this turn were not run", "more than 4096 characters"):
        assert any(expect in x for x in texts), expect
    path = write_dump(tmp_path / "d.jsonl", 1, [type("E", (), {"prompt_ids": p})() for p in prompts], gen, scores)
    back = read_dump(path)
    assert [r["response_ids"] for r in back] == gen.token_ids and [r["reward"] for r in back] == scores
