"""gspo and cispo learn the demo task: 80 steps of the default CPU run, the train reward of the last 10 steps
well above the first 10's. (50 steps were seed-dependent: with the engine's inverse-CDF sampling cispo went
0.05 -> 0.14 in 50 steps, 0.05 -> 0.41 in 80.) (The full 200-step demo reaches validation reward 0.95 with either;
docs in the report of issue 27.)"""

import json
import sys

import pytest

from tests.proc import run_tree

STEPS = 80
LOSSES = {"gspo": ["algo.policy_loss=gspo", "algo.loss_agg_mode=seq-mean-token-mean"],
          "cispo": ["algo.policy_loss=cispo"]}


@pytest.mark.parametrize("name", list(LOSSES))
def test_the_demo_learns(tmp_path, name):
    proc = run_tree([sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={tmp_path}", f"run.steps={STEPS}",
                     f"eval.interval={STEPS}", *LOSSES[name]], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [json.loads(line)["reward"] for line in open(tmp_path / "metrics.jsonl")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert len(rewards) == STEPS and last >= first + 0.15, (first, last)
