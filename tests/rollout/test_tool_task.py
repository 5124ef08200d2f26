"""The toy tool task (task=product_tool): a policy that calls the calculator and copies its result solves it
through MultiTurnEngine and the real tool pool; without the tool it is guessing a 3-4 digit product. And the
whole loop trains with rollout.multi_turn on the tiny model (metrics by kind)."""

import json
import math
import sys

from grpo_mega.data.toy_tools import ProductTask, make_tool_tokenizer
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.multi_turn import MultiTurnEngine
from grpo_mega.toolcalls.pool import ToolPool
from tests.proc import run_tree


class ToolPolicy:
    """A context -> turn policy: ask the calculator for the prompt's product, then copy the tool's answer."""

    weight_version = 0

    def __init__(self, tok, use_tool: bool):
        self.tok, self.use_tool = tok, use_tool

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        out = []
        for ctx in prompts:
            text = self.tok.decode(ctx)
            if "</tool>" in text:
                turn = text.rsplit("<tool>", 1)[1].split("</tool>")[0]
            elif self.use_tool:
                turn = "<tool_call>" + text.split("<bos>")[1].rstrip("=") + "</tool_call>"
            else:
                turn = "1000"  # a guess
            out.append(self.tok.encode(turn, add_special_tokens=False) + [self.tok.eos_token_id])
        return Generation(out, [[-1.0] * len(o) for o in out], ["stop"] * len(out), 0)

    def shutdown(self):
        pass


def test_product_task_is_solved_with_the_tool_only():
    tok = make_tool_tokenizer()
    task = ProductTask(tok)
    val = task.validation()
    for use_tool, want in ((True, 1.0), (False, 0.0)):
        mt = MultiTurnEngine(ToolPolicy(tok, use_tool), tok, ToolPool(["calculator"], start_method="fork"),
                             "expression", max_turns=2)
        try:
            gen = mt.generate([e.prompt_ids for e in val], 1, 1.0, 1.0, 24, [tok.eos_token_id], seed=0)
        finally:
            mt.shutdown()
        assert sum(task.reward(e, ids, t) for e, ids, t in zip(val, gen.token_ids, gen.trajectories)) / len(val) == want
        if use_tool:
            assert gen.extra["multi_turn"]["turns"] == [2] * len(val)
            assert tok.decode(gen.token_ids[0]).count("<tool>") == 1


def test_train_loop_with_tools(tmp_path):
    """Two steps of the loop on task=product_tool with multi-turn on: trains, evaluates, logs the metrics."""
    proc = run_tree([sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={tmp_path}", "task=product_tool",
                     "rollout.multi_turn.enable=true", "rollout.multi_turn.parser=expression",
                     "rollout.multi_turn.max_turns=2", "batch.max_response_length=24", "run.steps=2",
                     "eval.interval=2", "rollout.temperature=1.5"],
                    capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2
    for r in rows:
        assert 1.0 <= r["multi_turn/turns"] <= 2.0 and r["multi_turn/tool_calls"] >= 0
        assert r["multi_turn/model_tokens"] > 0 and r["timing/tools"] >= 0
        assert math.isfinite(r["loss"]) and "val_reward" in rows[-1]
