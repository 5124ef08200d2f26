"""gspo and cispo learn the demo task: 80 steps of the default CPU run, the train reward of the last 10 steps
well above the first 10's. (50 steps were seed-dependent: with the engine's inverse-CDF sampling cispo went
0.05 -> 0.14 in 50 steps, 0.05 -> 0.41 in 80.) (The full 200-step demo reaches validation reward 0.95 with either;
docs in the report of issue 27.)"""

import json
from pathlib import Path

import pytest

from tests.fork_server import run_main

ROOT = Path(__file__).resolve().parents[2]

STEPS = 80
LOSSES = {"gspo": ["algo.policy_loss=gspo", "algo.loss_agg_mode=seq-mean-token-mean"],
          "cispo": ["algo.policy_loss=cispo"]}


@pytest.mark.parametrize("name", list(LOSSES))
def test_the_demo_learns(tmp_path, name):
    # forked from the warm server (tests/fork_server.py): the entry point without an interpreter's start-up
    proc = run_main([f"hydra.run.dir={tmp_path}", f"run.steps={STEPS}", f"eval.interval={STEPS}", *LOSSES[name]],
                    timeout=600, cwd=ROOT, scratch=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [json.loads(line)["reward"] for line in open(tmp_path / "metrics.jsonl")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert len(rewards) == STEPS and last >= first + 0.15, (first, last)
