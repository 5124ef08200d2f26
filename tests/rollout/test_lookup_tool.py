"""task=lookup_tool (grpo_mega.data.toy_tools.LookupTask): the letter under a key is random, so only the tool
knows it; a policy that calls (one token, parser=bare: the run's only tool, the key from the row's
tools_kwargs) and copies the result solves it; an answer without a tool turn scores 0; with the tool
unavailable (UnavailableLookup: an error turn) the answer after it is a guess, chance; validation keys are
never trained on; task=lookup_call (the warm-up's shaping) rewards a call."""

import pytest

from grpo_mega.data.toy_tools import LOOKUP_TABLE, KeyLookup, LookupTask, UnavailableLookup, make_lookup_tokenizer
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.multi_turn import MultiTurnEngine
from grpo_mega.toolcalls import ToolError
from grpo_mega.toolcalls.pool import ToolPool


class CallThenCopy:
    """Turn 1: `<tool_call>` (a call-stop token) or a fixed guess 'c'; after a tool result: its letter, <eos>;
    after an error turn: the guess 'c', <eos>."""

    weight_version = 0

    def __init__(self, tok, use_tool):
        self.tok, self.use_tool = tok, use_tool
        self.call, self.open = tok.convert_tokens_to_ids("<tool_call>"), tok.convert_tokens_to_ids("<tool>")

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        out = []
        for ctx in prompts:
            if ctx[-2] == self.open:
                out.append([ctx[-1], self.tok.eos_token_id])
            elif self.open in ctx:
                out.append(self.tok.convert_tokens_to_ids(["c"]) + [self.tok.eos_token_id])
            else:
                out.append([self.call] if self.use_tool else self.tok.convert_tokens_to_ids(["c"]) + [self.tok.eos_token_id])
        return Generation(out, [[-1.0] * len(o) for o in out], ["stop"] * len(out), 0)

    def shutdown(self):
        pass


def test_calling_and_copying_solves_it_guessing_or_an_unavailable_tool_does_not():
    tok = make_lookup_tokenizer()
    task = LookupTask(tok)
    val = task.validation()
    train_keys = {tok.decode(e.prompt_ids, skip_special_tokens=True) for e in task.train_batch(2000)}
    val_keys = {tok.decode(e.prompt_ids, skip_special_tokens=True) for e in val}
    assert len(val) == 64 and len(val_keys) == 64 and not train_keys & val_keys  # never trained on
    assert len(set(LOOKUP_TABLE.values())) == 10
    chance = sum(e.answer == "c" for e in val) / 64
    assert 0 < chance < 0.3
    error_turn = tok.convert_tokens_to_ids(["<tool>"] + list("Error: down."))
    assert tok.pad_token_id not in error_turn  # spelled in the vocabulary (an unknown character would be <pad>)
    scores = {}
    for name, tool, use_tool in (("tool", "KeyLookup", True), ("unavailable", "UnavailableLookup", True),
                                 ("no call", "KeyLookup", False)):
        mt = MultiTurnEngine(CallThenCopy(tok, use_tool), tok,
                             ToolPool([f"grpo_mega.data.toy_tools:{tool}"], start_method="fork"), "bare",
                             max_turns=2, call_stop_ids=[tok.convert_tokens_to_ids("<tool_call>")],
                             row_tools_kwargs=task.tools_kwargs)
        try:
            gen = mt.generate([e.prompt_ids for e in val], 1, 1.0, 1.0, 28, [tok.eos_token_id], seed=0)
        finally:
            mt.shutdown()
        scores[name] = sum(task.reward(e, ids, trajectory=t)
                           for e, ids, t in zip(val, gen.token_ids, gen.trajectories)) / len(val)
        stats = gen.extra["multi_turn"]
        if name == "tool":
            assert stats["tool_calls"] == [1] * 64 and stats["tool_errors"] == [0] * 64
            # <tool_call> | the template's turn end, <tool> x | x <eos>
            assert gen.model_mask[0] == [1, 0, 0, 0, 1, 1]
            assert gen.token_ids[0][1] == tok.eos_token_id
        if name == "unavailable":  # the same calls; each tool turn is the error message
            assert stats["tool_calls"] == [1] * 64 and stats["tool_errors"] == [1] * 64
            assert gen.token_ids[0] == tok.convert_tokens_to_ids(["<tool_call>", "<eos>"]) + error_turn + \
                tok.convert_tokens_to_ids(["c", "<eos>"])
    assert scores == {"tool": 1.0, "unavailable": pytest.approx(chance), "no call": 0.0}


def _trajectory(tok, *turns):
    """(response ids, trajectory) from (role, tokens) turns, as grpo_mega.rollout.multi_turn records them."""
    ids, out = [], []
    for role, tokens in turns:
        t = {"role": role, "text": "", "start": len(ids), "end": len(ids) + len(tokens)}
        if role == "tool":
            t.update(name="lookup", error=tokens[:1] == ["E"])
        out.append(t)
        ids += tok.convert_tokens_to_ids(tokens)
    return ids, {"turns": out, "tool_rewards": {}}


def test_reward_reads_the_answer_after_the_last_tool_result():
    tok = make_lookup_tokenizer()
    task = LookupTask(tok)
    ex = task.example(372)
    other = next(c for c in "abcdefghij" if c != ex.answer)
    a, o = ex.answer, other

    def reward(*turns):
        return task.reward(ex, *_trajectory(tok, *turns))

    assert reward(("assistant", [a, "<eos>"])) == 0.0  # a right guess without a tool turn: 0
    assert reward(("assistant", ["<tool_call>"]), ("tool", [a]), ("assistant", [a, "<eos>"])) == 1.0
    assert reward(("assistant", ["<tool_call>"]), ("tool", [a]), ("assistant", [a, o, o])) == 1.0  # its first letter
    assert reward(("assistant", ["<tool_call>"]), ("tool", [a]), ("assistant", ["5", "=", a, o])) == 1.0
    assert reward(("assistant", ["<tool_call>"]), ("tool", [a]), ("assistant", ["5", o, a])) == 0.0
    assert reward(("assistant", [a, "<tool_call>"]), ("tool", [a]), ("assistant", [o, "<eos>"])) == 0.0
    assert reward(("assistant", [o, "<tool_call>"]), ("tool", [a]), ("assistant", [a, "<eos>"])) == 1.0  # the last turn
    assert reward(("assistant", ["<tool_call>"]), ("tool", [a])) == 0.0  # no answer after the result
    assert reward(("assistant", ["<tool>", a, a, "<eos>"])) == 0.0  # a `<tool>` the model wrote is no tool turn
    assert task.reward(ex, [], {"turns": [], "tool_rewards": {}}) == 0.0
    error = ("tool", list("Error: down."))
    assert reward(("assistant", ["<tool_call>"]), error, ("assistant", [a, "<eos>"])) == 1.0  # a right guess after it
    assert reward(("assistant", ["<tool_call>"]), error, ("assistant", [o, a])) == 0.0
    # two tool turns: the answer after the last one counts
    assert reward(("assistant", ["<tool_call>"]), ("tool", [o]), ("assistant", ["<tool_call>"]), ("tool", [a]),
                  ("assistant", [a, "<eos>"])) == 1.0


def test_the_tool_refuses_unknown_keys_and_the_warm_up_rewards_a_call():
    tok = make_lookup_tokenizer()
    ex = LookupTask(tok).example(42)
    assert tok.convert_ids_to_tokens(ex.prompt_ids) == ["<bos>", "0", "4", "2", "="]
    assert LookupTask(tok).tools_kwargs(ex.prompt_ids) == {"lookup": {"create_kwargs": {"key": "042"}}}
    tool = KeyLookup()
    tool.create(key="042")  # the row's create_kwargs
    assert tool.call({}) == LOOKUP_TABLE["042"] == ex.answer
    tool.create(key="42")
    with pytest.raises(ToolError, match="no key '42'"):
        tool.call({})
    with pytest.raises(ToolError, match="down"):
        UnavailableLookup().call({})
    warm = LookupTask(tok, shaping=True)  # task=lookup_call: a call (the warm-up runs one turn: no tool result)
    ids = lambda s: tok.convert_tokens_to_ids(s)  # noqa: E731
    assert warm.reward(ex, ids(["<tool_call>"])) == 1.0
    assert warm.reward(ex, ids(["5", "<tool_call>"])) == 1.0
    assert warm.reward(ex, ids([ex.answer, "<eos>"])) == 0.0
    assert warm.reward(ex, ids(["<tool>", ex.answer, "<eos>"])) == 0.0


def test_bare_parser_needs_exactly_one_tool():
    tok = make_lookup_tokenizer()
    pool = ToolPool(["calculator", "grpo_mega.data.toy_tools:KeyLookup"], start_method="fork")
    try:
        with pytest.raises(ValueError, match="parser=bare calls the run's only tool; rollout.multi_turn.tools has 2"):
            MultiTurnEngine(CallThenCopy(tok, True), tok, pool, "bare")
    finally:
        pool.close()


def test_tool_task_start_leans_to_copying(tmp_path):
    """experiments/tool_task.py's start (tied embeddings x4 at init): after `<tool>x` the likeliest token is x, a
    prior the warm-up must not erase; at x1 (no scaling) p(x) is below 0.1."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from experiments import tool_task

    root = Path(__file__).resolve().parents[2]
    tok = make_lookup_tokenizer()
    task = LookupTask(tok)
    p_copy = {}
    for scale in (1.0, 4.0):
        tool_task.init_model(root / "model_configs" / "tiny.yaml", str(tmp_path / str(scale)), scale)
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / str(scale))).eval()
        assert model.config.tie_word_embeddings
        with torch.no_grad():
            probs = [torch.softmax(model(torch.tensor([e.prompt_ids + tok.convert_tokens_to_ids(
                ["<tool_call>", "<tool>", e.answer])])).logits[0, -1], -1) for e in task.validation()[:16]]
        p_copy[scale] = sum(p[tok.convert_tokens_to_ids(e.answer)].item()
                            for p, e in zip(probs, task.validation()[:16])) / 16
        if scale == 4.0:
            assert all(int(p.argmax()) == tok.convert_tokens_to_ids(e.answer)
                       for p, e in zip(probs, task.validation()[:16]))
    assert p_copy[4.0] > 0.5 > 0.1 > p_copy[1.0]
