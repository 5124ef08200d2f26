"""task=tens_tool (grpo_mega.data.toy_tools.TensDigitTask): the row's tools_kwargs give the calculator the
prompt's tens digit, so a policy that calls (one token) and copies solves it and a guessing one scores chance;
and a real run's metrics row carries every multi-turn and per-tool metric, consistent with its own response
lengths."""

import json
import math

import pytest

from grpo_mega.data.toy_tools import TENS_TEMPLATE, TensDigitTask, make_tool_tokenizer
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.multi_turn import MultiTurnEngine
from grpo_mega.toolcalls.pool import ToolPool
from tests.fork_server import ROOT, run_main


class CallThenCopy:
    """Turn 1: `<tool_call>` (a call-stop token) or a fixed guess; after a tool result: its digit, <eos>."""

    weight_version = 0

    def __init__(self, tok, use_tool):
        self.tok, self.use_tool = tok, use_tool
        self.call, self.open = tok.convert_tokens_to_ids("<tool_call>"), tok.convert_tokens_to_ids("<tool>")

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        assert self.call in stop_token_ids  # rollout.multi_turn.call_stop reaches the engine
        out = []
        for ctx in prompts:
            if ctx[-2] == self.open:
                out.append([ctx[-1], self.tok.eos_token_id])
            else:
                out.append([self.call] if self.use_tool else self.tok.encode("7", add_special_tokens=False) +
                           [self.tok.eos_token_id])
        return Generation(out, [[-1.0] * len(o) for o in out], ["stop"] * len(out), 0)

    def shutdown(self):
        pass


def test_calling_and_copying_solves_it_guessing_does_not():
    tok = make_tool_tokenizer(TENS_TEMPLATE)
    task = TensDigitTask(tok)
    val = task.validation()
    assert len(val) == 64 and all(e.answer == str(eval(tok.decode(e.prompt_ids, skip_special_tokens=True)
                                                       .rstrip("=")) // 10 % 10) for e in val)
    scores = {}
    for use_tool in (True, False):
        mt = MultiTurnEngine(CallThenCopy(tok, use_tool), tok, ToolPool(["calculator"], start_method="fork"), "bare",
                             max_turns=2, call_stop_ids=[tok.convert_tokens_to_ids("<tool_call>")],
                             row_tools_kwargs=task.tools_kwargs)
        try:
            gen = mt.generate([e.prompt_ids for e in val], 1, 1.0, 1.0, 12, [tok.eos_token_id], seed=0)
        finally:
            mt.shutdown()
        scores[use_tool] = sum(task.reward(e, ids, t) for e, ids, t in zip(val, gen.token_ids, gen.trajectories)) / len(val)
        if use_tool:
            assert gen.extra["multi_turn"]["tool_calls"] == [1] * 64 and gen.extra["multi_turn"]["tool_errors"] == [0] * 64
            assert gen.model_mask[0] == [1, 0, 0, 0, 1, 1]  # <tool_call> | <eos> <tool> d | d <eos>
    assert scores[True] == 1.0
    assert scores[False] == pytest.approx(sum(e.answer == "7" for e in val) / 64) and scores[False] < 0.3


def test_a_real_runs_metrics_row_has_the_multi_turn_metrics(tmp_path):
    """Two steps of task=tens_tool with the tool (random init calls it in some samples): every multi-turn
    metric is in each metrics.jsonl row; model + tool tokens per sample add up to the mean response length."""
    out = tmp_path / "run"
    proc = run_main([f"hydra.run.dir={out}", "task=tens_tool", "rollout.multi_turn.enable=true",
                     "rollout.multi_turn.parser=bare", "rollout.multi_turn.call_stop=['<tool_call>']",
                     "rollout.multi_turn.max_turns=2", "batch.max_response_length=12", "run.steps=2",
                     "eval.interval=0", "batch.train_batch_size=8", "batch.ppo_mini_batch_size=8", "rollout.n=4"],
                    timeout=300, cwd=ROOT, scratch=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 2
    for r in rows:
        for k in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_truncated", "model_tokens", "tool_tokens"):
            assert math.isfinite(r[f"multi_turn/{k}"]), k
        assert 1.0 < r["multi_turn/turns"] <= 2.0 and r["multi_turn/tool_calls"] > 0 and r["timing/tools"] > 0
        assert r["multi_turn/tool_errors"] == 0 and r["multi_turn/tool_timeouts"] == 0
        assert r["multi_turn/tool_tokens"] > 0
        assert r["multi_turn/model_tokens"] + r["multi_turn/tool_tokens"] == pytest.approx(r["response_length"], abs=1e-9)
        # per tool: totals over the step's 32 samples, and the mean latency of a call
        assert r["tool/calculator/calls"] == pytest.approx(r["multi_turn/tool_calls"] * 32, abs=1e-9)
        assert r["tool/calculator/errors"] == r["tool/calculator/timeouts"] == 0
        assert 0 < r["tool/calculator/latency_s"] < 5
