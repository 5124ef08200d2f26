"""The Hydra entry point end to end on the CPU default (what `make demo` runs): the demo in a fresh process, the
other runs forked from the warm server (tests/fork_server.py)."""

import json
import sys
from pathlib import Path

import pytest

from grpo_mega.trainer.timing import WALL_PHASES as PHASES  # the phases that add up to the step
from tests.fork_server import run_main
from tests.proc import run_tree

ROOT = Path(__file__).resolve().parents[1]

# The first 10 steps of the default run (seed 1234, torch 2.13.0 CPU): mean train reward per step and the
# mini-batch-averaged loss. Regenerated 2026-11-26 (engine: one batched inverse-CDF draw per step; local spec:
# SDPA per sequence; torch's fused CPU AdamW).
# Why these tolerances hold on any x86-64 CPU (AVX2, AVX-512, AMX take other BLAS/oneDNN/ATen kernels, so fp32
# sums differ in their last bits):
# - rewards are multiples of 1/256 and must match exactly: a sample changes only if a uniform draw falls within
#   a few fp32 ulps (~1e-7) of a CDF boundary, about 1e-3 per run over 10 x 128 samples x 3 tokens;
# - each loss is a token mean of per-token terms of size |advantage| ~ 1 that cancel to 1e-2..5e-5, so its error
#   scales with the terms, not with the result: a few ulps of 1 per reduction, carried through 10 updates. The
#   tolerance is 1e-6 absolute (LOSS_SCALE_TOL), ~10x the worst seen (2.6e-9 on AMD EPYC AVX2 at step 10, whose
#   value is a near-cancelling 5.3e-5).
GOLDEN_REWARD = [0.035156, 0.046875, 0.039062, 0.042969, 0.046875, 0.0625, 0.074219, 0.023438, 0.035156, 0.042969]
GOLDEN_LOSS = [-0.010195617331191897, -0.016983214300125837, -0.0035616153036244214, -0.010236341273412108,
               -0.005205771420150995, -0.0007638474926352501, -0.003821019332453268, -0.004777723923325539,
               -0.002391941729001701, 5.328375846147537e-05]
LOSS_SCALE_TOL = 1e-6


def _run(tmp_path, *overrides, env=None, fresh=False):
    """`python -m grpo_mega.train OVERRIDES`: forked from the warm server (tests/fork_server.py), or with `fresh`
    in a new interpreter, the entry path as a user's shell takes it (the demo's run)."""
    argv = [f"hydra.run.dir={tmp_path}", *overrides]
    tmp_path.mkdir(parents=True, exist_ok=True)
    if fresh:
        proc = run_tree([sys.executable, "-m", "grpo_mega.train", *argv], capture_output=True, text=True,
                        timeout=600, env=env)
    else:
        proc = run_main(argv, timeout=600, cwd=ROOT, scratch=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    return proc, rows


def test_golden_curve_first_10_steps(tmp_path):
    """The default run (packed micro-batches), with wandb offline: the golden numbers, the per-phase profile,
    and wandb receiving what metrics.jsonl has."""
    import os

    from tests.wandb_records import history

    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    proc, rows = _run(tmp_path, "run.steps=10", "eval.interval=5", "checkpoint.dir=" + str(tmp_path / "ckpt"),
                      "checkpoint.interval=5", env=env)
    assert [round(r["reward"], 6) for r in rows] == GOLDEN_REWARD
    assert [r["loss"] for r in rows] == pytest.approx(GOLDEN_LOSS, rel=1e-5, abs=LOSS_SCALE_TOL)
    for name in ("reward", "val_reward", "kl", "entropy", "response_length"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert "validation reward (greedy): 0.00 at step 0" in proc.stdout and "plots:" in proc.stdout
    assert list((tmp_path / "tensorboard").iterdir())
    assert all(r["logprob_mismatch"] < 1e-5 for r in rows)  # engine and trainer agree every step
    # where the time went: every phase, adding up to the step within 10% or 50 ms, whichever is larger (the rest:
    # advantages, packing, bookkeeping; on a loaded 2-core machine a ~0.25 s step once left 12.5 ms outside, a
    # 0.49 s step 34 ms: preemption lands between phases too); a phase left out of the sum is a larger share
    for r in rows:
        phases = sum(r[f"timing/{p}"] for p in PHASES)
        slack = max(0.10 * r["timing/step"], 0.05)
        assert abs(phases - r["timing/step"]) <= slack, (r["step"], phases, r["timing/step"])
        assert r["perf/update_tokens_per_s"] > 0 and r["perf/generated_tokens_per_s"] > 0
        assert 0 <= r["batch/pad_fraction"] <= 0.10 and r["batch/micro_batches"] >= 1
    assert rows[4]["timing/checkpoint"] > 0 and rows[3]["timing/checkpoint"] == 0  # saved at steps 5 and 10
    assert rows[4]["timing/eval"] > 0 and rows[3]["timing/eval"] == 0
    assert (tmp_path / "timing.png").stat().st_size > 1000
    assert "step_s=" in proc.stderr and "tok_s=" in proc.stderr  # the progress bar
    # wandb (offline) received every key of every row, with the same values
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = history(run_dir)
    assert len(logged) == len(rows)
    for row, w in zip(rows, logged):
        assert {k: v for k, v in w.items() if not k.startswith("_")} == row
        assert w["_step"] == row["step"]


def test_unknown_override_names_the_field(tmp_path):
    proc = run_tree([sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={tmp_path}", "algo.kl_estimator=k9"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "unknown KL estimator 'k9'; valid:" in proc.stderr


def test_make_demo_run_learns(tmp_path):
    """The default run: validation reward from at most 0.3 to at least 0.9, numbers printed, plots written."""
    import re
    import time

    t0 = time.monotonic()
    proc, rows = _run(tmp_path, fresh=True)
    seconds = time.monotonic() - t0
    m = re.search(r"validation reward \(greedy\): ([\d.]+) at step 0 -> ([\d.]+) after (\d+) steps", proc.stdout)
    start, end = float(m.group(1)), float(m.group(2))
    print(f"demo: validation reward {start:.2f} -> {end:.2f} in {seconds:.0f} s")
    assert start <= 0.3 and end >= 0.9  # its time is printed, not asserted: a loaded machine takes 5x (OpenMP)
    assert "Warning" not in proc.stderr and "not installed" not in proc.stderr  # megatron-core's TE/Apex fallback
    assert (tmp_path / "val_reward.png").is_file()


@pytest.mark.sglang
def test_the_loop_runs_on_sglang(tmp_path):
    proc, rows = _run(tmp_path, "rollout.engine=sglang", "run.steps=3", "eval.interval=3", fresh=True)
    assert len(rows) == 3 and all(r["logprob_mismatch"] < 1e-4 for r in rows)
    assert "plots:" in proc.stdout


def test_algorithm_options_wired_through_the_loop(tmp_path):
    """KL-in-reward with a reference refreshed every 2 steps, DAPO dynamic sampling, overlong masking, pass@k."""
    proc, rows = _run(tmp_path, "algo.kl_in_reward=true", "algo.kl_coef=0.05", "algo.dynamic_sampling=true",
                      "reward.overlong=mask", "algo.ref_update_interval=2", "run.steps=4", "eval.interval=2")
    total = 16 * 8
    for r in rows:
        assert 0 <= r["rows_in_loss"] < total  # overlong rows and equal-reward groups are out of the loss
        assert r["overlong_fraction"] > 0 and 0 <= r["val_pass_at_k"] <= 1
        assert r["skipped"] == 0
    assert rows[0]["kl"] > 0  # the reference exists and is compared with


def test_full_kl_in_the_loss_through_the_loop(tmp_path):
    """algo.kl_estimator=full: no separate reference pass (the reference runs inside the update), a KL that
    grows from 0 as the actor leaves the reference; with kl_coef=0 no reference is built at all."""
    import json

    ckpt = tmp_path / "ckpt"
    proc, rows = _run(tmp_path, "algo.kl_estimator=full", "algo.kl_coef=0.01", "run.steps=3", "eval.interval=3",
                      f"checkpoint.dir={ckpt}")
    assert all(r["timing/ref_logprobs"] == 0 and r["timing/update"] > 0 and r["skipped"] == 0 for r in rows)
    # two mini-batches a step: the first one's KL is 0 (the reference starts as the actor), then it grows
    assert 0 < rows[0]["kl"] < rows[1]["kl"] < rows[2]["kl"]
    assert json.loads((ckpt / "step_00000003" / "loop_state.json").read_text())["has_reference"] is True
    ckpt0 = tmp_path / "ckpt0"
    proc, rows = _run(tmp_path / "kl0", "algo.kl_estimator=full", "algo.kl_coef=0", "run.steps=1", "eval.interval=1",
                      f"checkpoint.dir={ckpt0}")
    assert json.loads((ckpt0 / "step_00000001" / "loop_state.json").read_text())["has_reference"] is False
    assert rows[0]["kl"] == 0.0


def test_lora_through_the_loop(tmp_path):
    """lora.rank=8 with the full KL in the loss: the engine receives the merged weights W + s B A (its logprobs
    are the trainer's every step, as in the golden run), the reference is the actor with adapters off (no
    reference pass, a KL that grows from ~0 as the adapters move)."""
    proc, rows = _run(tmp_path, "lora.rank=8", "optim.lr=0.01", "algo.kl_estimator=full", "algo.kl_coef=0.01",
                      "run.steps=3", "eval.interval=3")
    assert all(r["logprob_mismatch"] < 1e-5 and r["skipped"] == 0 and r["grad_norm"] > 0 for r in rows)
    assert all(r["timing/ref_logprobs"] == 0 for r in rows)
    assert 0 < rows[0]["kl"] < rows[1]["kl"] < rows[2]["kl"]


def test_engine_importance_correction_is_neutral_when_engine_and_trainer_agree(tmp_path):
    """With the embedded engine the two logprobs agree to ~1e-7, so the truncated weights are ~1 and the
    first steps' losses equal the golden ones."""
    proc, rows = _run(tmp_path, "algo.engine_is_cap=2.0", "run.steps=3", "eval.interval=3")
    assert [r["loss"] for r in rows] == pytest.approx(GOLDEN_LOSS[:3], rel=1e-4, abs=LOSS_SCALE_TOL)


def test_evaluation_off(tmp_path):
    """eval.interval=0: no evaluation at all (none before step 1, none at the end); the run still trains."""
    proc, rows = _run(tmp_path, "eval.interval=0", "run.steps=2", "rollout.n=4")
    assert len(rows) == 2 and all("val_reward" not in r and r["timing/eval"] == 0 for r in rows)
    assert "no evaluation" in proc.stdout and "validation reward" not in proc.stdout
