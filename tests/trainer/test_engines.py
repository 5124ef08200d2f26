"""Several rollout engines (rollout.num_engines): each samples a contiguous share of the prompts, every engine
receives the weights after every step, and the run is the one-engine run."""

import json
from pathlib import Path

import pytest

from tests.fork_server import run_main

ROOT = Path(__file__).resolve().parents[2]


def _run(out, *extra):
    """2 ranks forked from the warm fork server with torchrun's environment (tests/fork_server.py)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = run_main([f"hydra.run.dir={out}", "run.steps=3", "eval.interval=3", *extra], timeout=300, cwd=ROOT,
                    scratch=out.parent, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_two_engines_sample_what_one_engine_samples(tmp_path):
    """DP2 on 2 ranks: one engine on rank 0, or one on each rank. Same rewards every step (the samples are
    drawn with the same per-sample seeds), same losses, and the engine on rank 1 is kept in sync: its
    samples' logprobs equal the trainer's after every update (a stale engine would show a mismatch)."""
    out_one, one = _run(tmp_path / "one")
    out_two, two = _run(tmp_path / "two", "rollout.num_engines=2")
    assert "rollout engines on ranks [0, 1]" in out_two and "rollout engines" not in out_one
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert b["reward"] == a["reward"] and b["val_reward"] == a["val_reward"]
        assert b["response_length"] == a["response_length"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["logprob_mismatch"] < 1e-5


def test_engines_that_do_not_divide_the_ranks_are_refused(tmp_path):
    proc = run_main([f"hydra.run.dir={tmp_path / 'run'}", "rollout.num_engines=2"], timeout=300, cwd=ROOT,
                    scratch=tmp_path)
    assert proc.returncode == 2 and "rollout.num_engines=2 must divide the number of ranks (1)" in proc.stderr
