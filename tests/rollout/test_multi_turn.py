"""grpo_mega.rollout.multi_turn: token in, token out across several tool turns (the ids trained on are the ids
the engine sampled plus the tool segments' ids, never a re-tokenized conversation), the model mask, the budget,
and the loss mask excluding tool tokens."""

import json

import pytest
import torch

from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.multi_turn import MultiTurnEngine, rollout_metrics
from grpo_mega.rollout.turns import MessageRenderer
from grpo_mega.toolcalls.pool import ToolPool
from grpo_mega.trainer.batch import RolloutBatch

# A Qwen3-like template: earlier assistant turns lose their <think>...</think>; tool results are a user turn.
THINK_STRIPPING = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}{% set c = m.content %}"
    "{% if not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def call(expr: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "</tool_call>"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tests.models.hf_fixtures import smollm2_dir

    t = AutoTokenizer.from_pretrained(smollm2_dir())
    t.chat_template = THINK_STRIPPING
    return t


class ScriptedEngine:
    """Answers each sample (known by its prompt) with the next of its scripted turns; records every call."""

    weight_version = 3

    def __init__(self, tok, scripts: dict):
        self.tok, self.scripts, self.calls, self.sampled = tok, scripts, [], {}
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        assert n == 1 and len(row_seeds) == len(prompts)
        self.calls.append([list(p) for p in prompts])
        ids, lps, fins = [], [], []
        for ctx in prompts:
            key = next(k for k in self.scripts if list(ctx[:len(k)]) == list(k))
            turns = self.sampled.setdefault(key, [])
            out = self.tok.encode(self.scripts[key][len(turns)], add_special_tokens=False) + [self.end]
            fin = "stop"
            if len(out) > max_new_tokens:
                out, fin = out[:max_new_tokens], "length"
            turns.append(out)
            ids.append(out)
            lps.append([-0.01 * (i + 1) for i in range(len(out))])
            fins.append(fin)
        return Generation(ids, lps, fins, self.weight_version)

    def shutdown(self):
        pass


def render_ids(tok, msgs, **kw):
    return tok.encode(tok.apply_chat_template(msgs, tokenize=False, **kw), add_special_tokens=False)


def prompt_ids(tok, q):
    return render_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True)


def test_token_in_token_out_across_tool_turns(tok):
    p1, p2 = prompt_ids(tok, "What is 6*7, then +1, then *2?"), prompt_ids(tok, "Say hi")
    script1 = ["<think>I need a tool.</think>" + call("6*7"), "<think>Now add one.</think>" + call("42+1"),
               "<think>Double it; also a broken call.</think>" + call("43*2") + "<tool_call>{oops}</tool_call>",
               "<think>Done.</think>The answer is 86."]
    engine = ScriptedEngine(tok, {tuple(p1): script1, tuple(p2): ["hi"]})
    pool = ToolPool(["calculator"], start_method="fork")
    mt = MultiTurnEngine(engine, tok, pool, "hermes", max_turns=5, stop_token_ids=[engine.end])
    try:
        gen = mt.generate([p1, p2], 1, 1.0, 1.0, 400, [engine.end], seed=11)
    finally:
        mt.shutdown()
    traj, mask = gen.token_ids[0], gen.model_mask[0]
    renderer = MessageRenderer(tok, [engine.end])
    tool = lambda *results: renderer.render([("tool", r, "calculator" if r[0].isdigit() else None)  # noqa: E731
                                             for r in results])[0]
    segs = [tool("42"), tool("43"), tool("86", "Error: the tool call is not valid JSON "
                                              "(Expecting property name enclosed in double quotes): '{oops}'")]
    sampled = engine.sampled[tuple(p1)]
    expected = sampled[0] + segs[0] + sampled[1] + segs[1] + sampled[2] + segs[2] + sampled[3]
    assert traj == expected  # the ids trained on: exactly the engine's ids and the tool segments' ids
    assert mask == [1] * len(sampled[0]) + [0] * len(segs[0]) + [1] * len(sampled[1]) + [0] * len(segs[1]) + \
        [1] * len(sampled[2]) + [0] * len(segs[2]) + [1] * len(sampled[3])
    # token in: each engine call continued exactly the prompt + trajectory so far
    done = 0
    for t, c in enumerate(engine.calls):
        assert c[0] == p1 + traj[:done]
        done += len(sampled[t]) + (len(segs[t]) if t < 3 else 0)
    assert len(engine.calls[0]) == 2 and all(len(c) == 1 for c in engine.calls[1:])  # p2 finished after one turn
    assert [lp for lp, m in zip(gen.logprobs[0], mask) if m] == [x for s in sampled for x in
                                                                  [-0.01 * (i + 1) for i in range(len(s))]]
    assert all(lp == 0.0 for lp, m in zip(gen.logprobs[0], mask) if not m)
    assert gen.finish_reasons == ["stop", "stop"] and gen.token_ids[1] == engine.sampled[tuple(p2)][0]
    assert gen.weight_version == 3
    # the rendered conversation, re-tokenized, is NOT what was sampled (earlier turns lose their <think>)
    text = tok.decode(sampled[0][:-1])
    assert "<think>" in tok.decode(traj)
    msgs = [{"role": "user", "content": "What is 6*7, then +1, then *2?"}]
    for t, results in enumerate([["42"], ["43"], ["86", "x"]]):
        msgs.append({"role": "assistant", "content": tok.decode(sampled[t][:-1])})
        msgs += [{"role": "tool", "content": r} for r in results]
    msgs.append({"role": "assistant", "content": tok.decode(sampled[3][:-1])})
    retok = render_ids(tok, msgs)
    assert retok[:len(p1)] == p1 and retok[len(p1):] != traj and text.startswith("<think>")
    assert tok.decode(retok).count("<think>") == 1  # only the last turn keeps it
    s = gen.extra["multi_turn"]
    assert s["turns"] == [4, 1] and s["tool_calls"] == [4, 0] and s["tool_errors"] == [1, 0]
    m = rollout_metrics(gen)
    assert m["multi_turn/turns"] == 2.5 and m["multi_turn/tool_calls"] == 2.0
    assert m["multi_turn/model_tokens"] + m["multi_turn/tool_tokens"] == sum(map(len, gen.token_ids)) / 2


def test_budget_cuts_with_length(tok):
    p = prompt_ids(tok, "loop")
    engine = ScriptedEngine(tok, {tuple(p): [call("1+1")] * 10})
    mt = MultiTurnEngine(engine, tok, ToolPool(["calculator"], start_method="fork"), max_turns=10,
                         stop_token_ids=[engine.end])
    try:
        one = len(engine.tok.encode(call("1+1"), add_special_tokens=False)) + 1
        seg = len(mt.renderer.render([("tool", "2", "calculator")])[0])
        for budget in (one + seg + 3, one + seg, one + 2):
            engine.sampled.clear()
            gen = mt.generate([p], 1, 1.0, 1.0, budget, [engine.end], seed=0)
            assert gen.finish_reasons == ["length"] and len(gen.token_ids[0]) == budget, budget
        gen = mt.generate([p], 1, 1.0, 1.0, budget, [engine.end], seed=0)
        engine.sampled.clear()
        mt.max_turns = 2  # the last turn's tool call is not run: the trajectory ends "stop"
        gen = mt.generate([p], 1, 1.0, 1.0, 1000, [engine.end], seed=0)
        assert gen.finish_reasons == ["stop"] and gen.extra["multi_turn"]["turns"] == [2]
        assert len(gen.token_ids[0]) == 2 * one + seg
    finally:
        mt.shutdown()


def test_loss_mask_excludes_tool_tokens():
    prompts, responses = [[5, 6], [7]], [[1, 2, 3, 4], [8, 9]]
    masks = [[1, 0, 0, 1], [1, 1]]
    rb = RolloutBatch.from_samples(prompts, responses, masks)
    plain = RolloutBatch.from_samples(prompts, responses)
    assert plain.model_mask is None
    want = plain.response_mask().clone()
    want[0, 2:4] = False  # positions 2, 3 predict response tokens 1, 2 (tool tokens)
    assert torch.equal(rb.response_mask(), want)
    assert torch.equal(rb.rows_at(torch.tensor([1, 0])).response_mask(), want[[1, 0]])
    assert torch.equal(rb.rows(0, 1).loss_mask(), want[:1])


def test_bad_tool_calls_become_error_turns_and_the_trajectory_goes_on(tok):
    """Malformed JSON, an unknown tool, a tool that raises, one that hangs past its limit, and one whose result is
    longer than max_tool_response_chars: each answers with a one-line error (or the cut, marked result) as the
    tool's turn, is counted, and the model's next turn is generated as usual."""
    p = prompt_ids(tok, "try everything")
    turns = ["<tool_call>{oops</tool_call>",
             '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
             '<tool_call>{"name": "raiser", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "sleeper", "arguments": {"s": 30}}</tool_call>',
             '<tool_call>{"name": "calculator", "arguments": {"expression": "10**80"}}</tool_call>',
             "done"]
    engine = ScriptedEngine(tok, {tuple(p): turns})
    pool = ToolPool(["calculator", "tests.toolcalls.test_toolcalls:Sleeper", "tests.toolcalls.test_toolcalls:Raiser"],
                    timeout_s=1.0, start_method="fork")
    mt = MultiTurnEngine(engine, tok, pool, "hermes", max_turns=8, stop_token_ids=[engine.end],
                         max_tool_response_chars=70)
    try:
        gen = mt.generate([p], 1, 1.0, 1.0, 1000, [engine.end], seed=0)
    finally:
        mt.shutdown()
    text = tok.decode(gen.token_ids[0])
    expect = ["Error: the tool call is not valid JSON", "Error: unknown tool 'search'; valid: calculator, raiser, sleeper",
              "Error: raiser raised RuntimeError: boom", "Error: sleeper timed out after 1 s",
              "1" + "0" * 69 + "...[truncated 11 chars]"]
    pos = [text.find(e) for e in expect]
    assert all(i >= 0 for i in pos) and pos == sorted(pos), (pos, text)
    assert text.rstrip().endswith("done<|im_end|>") and gen.finish_reasons == ["stop"]
    s = gen.extra["multi_turn"]
    assert (s["turns"], s["tool_calls"], s["tool_errors"], s["tool_timeouts"], s["tool_truncated"]) == \
        ([6], [5], [4], [1], [2])  # cut: the calculator's 81 digits and the JSON error's long message
    assert rollout_metrics(gen)["multi_turn/tool_truncated"] == 2.0


def test_a_tool_result_longer_than_the_remaining_budget_is_cut_and_marked_length(tok):
    """The result is cut at the budget (the trajectory is exactly max_new_tokens long, ends "length" for
    reward.overlong, the cut counted); the other sample in the batch finishes normally."""
    p1, p2 = prompt_ids(tok, "long"), prompt_ids(tok, "short")
    engine = ScriptedEngine(tok, {tuple(p1): [call("9" * 30 + "*" + "9" * 30), "never"], tuple(p2): ["fine"]})
    mt = MultiTurnEngine(engine, tok, ToolPool(["calculator"], start_method="fork"), max_turns=4,
                         stop_token_ids=[engine.end])
    try:
        first = len(tok.encode(call("9" * 30 + "*" + "9" * 30), add_special_tokens=False)) + 1
        budget = first + 10
        gen = mt.generate([p1, p2], 1, 1.0, 1.0, budget, [engine.end], seed=0)
    finally:
        mt.shutdown()
    assert len(mt.renderer.render([("tool", "9" * 60, "calculator")])[0]) > 10  # the full result would not fit
    assert gen.finish_reasons == ["length", "stop"] and len(gen.token_ids[0]) == budget
    assert gen.model_mask[0] == [1] * first + [0] * 10
    assert gen.extra["multi_turn"]["tool_truncated"] == [1, 0] and gen.extra["multi_turn"]["turns"] == [1, 1]
    assert len(engine.calls) == 1  # no model turn after the cut


def test_a_rows_tools_kwargs_reach_its_calls(tok):
    """verl's tools_kwargs: the row's create_kwargs/execute_kwargs are given to the tool it names, for that
    prompt only (the calculator takes its expression from them when the model's call gives none)."""
    p1, p2 = prompt_ids(tok, "with kwargs"), prompt_ids(tok, "without")
    bare = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    engine = ScriptedEngine(tok, {tuple(p1): [bare, "ok"], tuple(p2): [bare, "ok"]})
    rows = {tuple(p1): {"calculator": {"create_kwargs": {"expression": "6*7"}, "execute_kwargs": {}}}}
    mt = MultiTurnEngine(engine, tok, ToolPool(["calculator"], start_method="fork"), max_turns=3,
                         stop_token_ids=[engine.end], row_tools_kwargs=lambda ids: rows.get(tuple(ids)))
    try:
        gen = mt.generate([p1, p2], 1, 1.0, 1.0, 200, [engine.end], seed=0)
    finally:
        mt.shutdown()
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(gen.token_ids[0])
    assert "calculator takes exactly one argument 'expression'; got []" in tok.decode(gen.token_ids[1])
    assert gen.extra["multi_turn"]["tool_errors"] == [0, 1]
