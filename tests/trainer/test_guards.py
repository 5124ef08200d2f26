"""A run that can no longer learn stops, with one line and exit status 2, after a checkpoint of its last good state
(grpo_mega.trainer.guards): rewards of any real type are taken, failed rewards beyond reward.max_error_fraction and
non-finite mini-batches beyond optim.max_consecutive_skips stop it, and the metrics stay strict JSON on the way."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_mega.rewards import check_reward_value
from grpo_mega.trainer.guards import RewardBudget, SkipStreak
from grpo_mega.trainer.loop import update_means
from grpo_mega.trainer.sinks import strict_json_row
from tests.fork_server import run_main
from tests.models.hf_fixtures import demo_settings

ROOT = Path(__file__).resolve().parents[2]


# ---- reward functions the runs below import by dotted path (in the reward's worker processes) -------------------

def numpy_reward(response, ground_truth, sample):
    """What a numpy-based scorer returns: a float32 scalar (0.5, or 1 when the truth is in the response)."""
    return np.float32(1.0 if str(ground_truth) in response else 0.5) + np.float32(len(response) % 3) / 8


def nan_reward(response, ground_truth, sample):
    return float("nan")


_calls = 0


def fails_after_four(response, ground_truth, sample):
    """numpy_reward for its first four calls in a worker (step 1's samples with reward.num_workers=1), NaN after."""
    global _calls
    _calls += 1
    return numpy_reward(response, ground_truth, sample) if _calls <= 4 else float("nan")


# ---- units ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,want", [(1, 1.0), (0.25, 0.25), (True, 1.0), (False, 0.0), (np.float32(0.5), 0.5),
                                        (np.int64(3), 3.0), (np.bool_(True), 1.0), (np.array(2.0), 2.0),
                                        (torch.tensor(1.5), 1.5), (torch.tensor(2, dtype=torch.int32), 2.0),
                                        (torch.tensor(0.5, dtype=torch.bfloat16), 0.5)])
def test_a_reward_is_any_real_number(value, want):
    assert check_reward_value(value) == want and type(check_reward_value(value)) is float


@pytest.mark.parametrize("value", ["1.0", None, [1.0], 1j, float("nan"), -math.inf, np.float32("nan"),
                                   torch.tensor(float("inf")), torch.tensor([1.0]), np.array([1.0, 2.0])])
def test_a_reward_that_is_not_a_finite_real_is_refused(value):
    with pytest.raises(TypeError, match="a reward must be a finite number"):
        check_reward_value(value)


def test_the_reward_budget_counts_samples_over_a_window_of_steps():
    budget = RewardBudget(0.5, window=3)
    assert budget.check(1, {"reward/errors": 2.0, "reward/samples": 4.0}) is None  # 2/4 is not more than 0.5
    assert budget.check(2, {"reward/errors": 0.0, "reward/samples": 4.0}) is None
    assert budget.check(3, {"reward/errors": 3.0, "reward/samples": 4.0}) is None  # 5/12
    why = budget.check(4, {"reward/errors": 4.0, "reward/samples": 4.0})  # steps 2..4: 7/12
    assert why.startswith("the reward failed on 7 of 12 samples in steps 2..4 (more than reward.max_error_fraction=0.5")
    assert RewardBudget(0.0, 1).check(1, {"reward/errors": 1.0, "reward/samples": 64.0}) is not None
    assert RewardBudget(1.0, 1).check(1, {"reward/errors": 64.0, "reward/samples": 64.0}) is None


def test_the_skip_streak_counts_non_finite_mini_batches_in_a_row_across_steps():
    ok = dict(skipped=0.0, skip_reason="")
    bad = dict(skipped=1.0, skip_reason="non_finite")
    early = dict(skipped=1.0, skip_reason="early_stop_imp_ratio")
    streak = SkipStreak(3)
    assert streak.check(1, [bad, bad, ok, bad]) is None and streak.count == 1
    assert streak.check(2, [early, bad]) is None and streak.count == 2  # an early stop neither counts nor resets
    assert streak.check(3, [bad]).startswith("3 mini-batches in a row (up to step 3) had a non-finite loss")
    assert SkipStreak(0).check(1, [bad] * 100) is None


def test_grad_norm_is_the_mean_over_the_mini_batches_that_stepped():
    def mb(grad_norm, skipped):
        return dict(loss=0.1, pg_loss=0.1, kl=0.0, entropy=1.0, clip_fraction=0.0, grad_norm=grad_norm,
                    is_weight_mean=1.0, is_capped_fraction=0.0, is_seq_capped_fraction=0.0, pg_clipfrac_lower=0.0,
                    ppo_kl=0.0, skipped=skipped)

    means = update_means([mb(2.0, 0.0), mb(float("nan"), 1.0), mb(4.0, 0.0)])
    assert means["grad_norm"] == 3.0 and means["skipped"] == 1.0
    assert math.isnan(update_means([mb(float("nan"), 1.0)])["grad_norm"])  # nothing stepped


def test_metrics_rows_are_strict_json_with_non_finite_values_as_null_and_counted():
    line = strict_json_row({"step": 3, "loss": float("nan"), "kl": float("inf"), "reward": 0.5, "skipped": 1.0})
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert row == {"step": 3, "loss": None, "kl": None, "reward": 0.5, "skipped": 1.0, "nonfinite_metrics": 2}
    assert "nonfinite_metrics" not in json.loads(strict_json_row({"step": 1, "loss": 0.1}))


# ---- end to end: task=prompts on a tiny random Llama with SmolLM2's tokenizer ----------------------------------

@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from tests.models.hf_fixtures import tiny_chat_hf

    d = tmp_path_factory.mktemp("guards")
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "reward_model": {"ground_truth": str(a + b)},
             "data_source": "arith"} for a, b in [(2, 3), (4, 4), (7, 1), (3, 5), (6, 2), (1, 1)]]
    (d / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tiny_chat_hf(d / "model"), d / "arith.jsonl"


KL = "algo.kl_coef=0.01"


def _cli(out: Path, prompts, reward: str, *extra, steps: int = 3):
    model, data = prompts
    argv = [f"hydra.run.dir={out}", "task=prompts", *demo_settings(), f"model={model}", f"data.train_files={data}",
            f"reward.name=tests.trainer.test_guards:{reward}", "reward.num_workers=1", "batch.train_batch_size=2",
            "rollout.n=2", "batch.ppo_mini_batch_size=2", "batch.micro_batch_size=4", "batch.max_response_length=4",
            "eval.interval=0", "optim.lr=1e-2", f"run.steps={steps}", *extra]
    out.mkdir(parents=True, exist_ok=True)
    return run_main(argv, timeout=300, cwd=ROOT, scratch=out)


def _rows(out: Path) -> dict:
    return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


def test_a_numpy_reward_trains(prompts, tmp_path):
    """np.float32 rewards used to be refused as non-numbers and scored 0: every step learned nothing, exit 0."""
    proc = _cli(tmp_path / "run", prompts, "numpy_reward", steps=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert all(r["reward/errors"] == 0 and r["reward/samples"] == 4 and r["reward"] >= 0.5 for r in rows.values())


def test_failed_rewards_stop_the_run_after_a_checkpoint_that_resumes_into_the_uninterrupted_run(prompts, tmp_path):
    """The reward turns NaN at step 2: the run stops there with one line and exit 2, step 2 untrained, after a
    checkpoint of step 1 (the data cursor rewound to before step 2's prompts). Resumed with the reward fixed, it
    trains steps 2 and 3 exactly as a run that never failed. With a KL term: the checkpoint holds no reference (the
    model path's weights, loaded again on resume: tests/trainer/test_resume.py), and the KL resumes exactly too."""
    whole = _cli(tmp_path / "whole", prompts, "numpy_reward", KL)
    assert whole.returncode == 0, whole.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    failed = _cli(tmp_path / "failed", prompts, "fails_after_four", f"checkpoint.dir={ckpt}", "reward.error_window=1",
                  KL)
    assert failed.returncode == 2, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the reward failed on 4 of 4 samples in step 2 (more than reward.max_error_fraction"
                      f"=0.5 over reward.error_window=1 steps; the warnings above name each sample and why): fix the "
                      f"reward function, then resume (the last good state is checkpoint step 1 in {ckpt})"], errors
    assert "Traceback" not in failed.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000001"]
    assert list(_rows(tmp_path / "failed")) == [1]  # step 2 was not trained (no row)
    assert json.loads((ckpt / "step_00000001" / "loop_state.json").read_text())["reference_from"]["weights_sha256"]
    resumed = _cli(tmp_path / "resumed", prompts, "numpy_reward", f"checkpoint.dir={ckpt}", KL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _rows(tmp_path / "whole"), _rows(tmp_path / "resumed")
    assert list(b) == [2, 3] and a[3]["kl"] > 0
    for s in (2, 3):
        for key in ("reward", "loss", "grad_norm", "entropy", "kl"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-6, abs=1e-6), (s, key)


def test_failed_rewards_at_step_1_checkpoint_step_0(prompts, tmp_path):
    """A reward that fails from the start: nothing trained, the initial state checkpointed (before any optimizer
    step), and a resume from it trains step 1."""
    ckpt = tmp_path / "ckpt"
    proc = _cli(tmp_path / "run", prompts, "nan_reward", f"checkpoint.dir={ckpt}", steps=1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "the reward failed on 4 of 4 samples in step 1 " in proc.stderr
    assert f"(the last good state is checkpoint step 0 in {ckpt})" in proc.stderr
    resumed = _cli(tmp_path / "resumed", prompts, "numpy_reward", f"checkpoint.dir={ckpt}", steps=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list(_rows(tmp_path / "resumed")) == [1] and "resumed from" in resumed.stdout


def test_non_finite_mini_batches_in_a_row_stop_the_run_after_a_checkpoint(tmp_path):
    """The demo at lr=1e30: the first update blows the weights up, every later mini-batch is non-finite and skipped.
    The run stops at the step where the count reaches optim.max_consecutive_skips, after its metrics row and a
    checkpoint of it; the
    grad_norm of a step with skipped mini-batches is that of the ones that stepped, and the metrics rows stay
    strict JSON (non-finite losses as null, counted)."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    proc = run_main([f"hydra.run.dir={out}", "optim.lr=1e30", "run.steps=5", "optim.max_consecutive_skips=2",
                     "batch.ppo_mini_batch_size=4",  # 4 mini-batches a step: the limit is met in step 1
                     "eval.interval=0", f"checkpoint.dir={ckpt}"], timeout=300, cwd=ROOT, scratch=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "had a non-finite loss or gradient and were skipped (optim.max_consecutive_skips=2)" \
        in errors[0], proc.stderr[-3000:]
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
            for line in open(out / "metrics.jsonl")]
    last = rows[-1]["step"]
    assert f"(up to step {last})" in errors[0] and f"checkpoint step {last} in {ckpt}" in errors[0]
    assert (ckpt / f"step_{last:08d}").is_dir()
    first = rows[0]  # 4 mini-batches: the first stepped (a finite norm), the others skipped
    assert first["skipped"] >= 1 and math.isfinite(first["grad_norm"]) and first["loss"] is None
    assert first["nonfinite_metrics"] >= 1
