"""When a run must stop rather than go on learning nothing: too many failed rewards, or too many mini-batches in a
row skipped for a non-finite loss or gradient. Each check is a pure function of metrics every rank holds
identically (reward counts summed over ranks, the update's per-mini-batch metrics), so every rank decides the
same; the loop then checkpoints the last good state and raises `RunStopped` (grpo_mega.trainer.setup.Run.stop),
which `python -m grpo_mega.train` reports in one line with exit status 2 (slurm/train.sbatch does not requeue it:
a rerun would fail the same way).
"""

from __future__ import annotations

from collections import deque
from typing import Optional


class RunStopped(RuntimeError):
    """The run cannot usefully go on (the message says why and what to do)."""


class RewardBudget:
    """reward.max_error_fraction over the last reward.error_window steps: the share of the samples scored whose
    reward failed (reward/errors of reward/samples; a step's refill rounds count with it)."""

    def __init__(self, max_fraction: float, window: int):
        self.max_fraction = max_fraction
        self.steps: deque[tuple[float, float]] = deque(maxlen=window)

    def check(self, step: int, metrics: dict) -> Optional[str]:
        """Add step `step`'s counts; the reason to stop, or None."""
        self.steps.append((float(metrics.get("reward/errors", 0.0)), float(metrics.get("reward/samples", 0.0))))
        errors, samples = (sum(x) for x in zip(*self.steps))
        if self.max_fraction >= 1 or not samples or errors / samples <= self.max_fraction:
            return None
        span = f"step {step}" if len(self.steps) == 1 else f"steps {step - len(self.steps) + 1}..{step}"
        return (f"the reward failed on {errors:.0f} of {samples:.0f} samples in {span} (more than "
                f"reward.max_error_fraction={self.max_fraction:g} over reward.error_window={self.steps.maxlen} steps; "
                f"the warnings above name each sample and why): fix the reward function, then resume")


class SkipStreak:
    """optim.max_consecutive_skips: mini-batches in a row skipped for a non-finite loss or gradient, across steps;
    an applied optimizer step resets the count (an early-stop skip, algo.early_stop_imp_ratio, neither counts nor
    resets)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def check(self, step: int, updates: list[dict]) -> Optional[str]:
        """Add step `step`'s mini-batches (Actor.update's metrics, in order); the reason to stop, or None."""
        for u in updates:
            if u.get("skip_reason") == "non_finite":
                self.count += 1
            elif not u.get("skipped"):
                self.count = 0
        if not self.limit or self.count < self.limit:
            return None
        return (f"{self.count} mini-batches in a row (up to step {step}) had a non-finite loss or gradient and were "
                f"skipped (optim.max_consecutive_skips={self.limit}): the run is diverging or its data is broken; "
                f"lower optim.lr, check the rewards and the data, or resume from an earlier checkpoint")
