"""Where a step's time goes: seconds per phase (waiting for samples, reward, old/ref logprobs, update, weight
sync, eval, checkpoint; WALL_PHASES add up to the step) and the whole step, each the maximum over ranks (a step
is as slow as its slowest rank), reduced once per step in one all-reduce; and the step's throughput. The loop
opens a phase with `with timer("update"):`. `generate` is the engines' own seconds for the batch the step
waited for (`timer.add`): in turn with training it equals `generate_wait`; generated one step ahead
(rollout.off_policy_steps=1) it ran while the step trained, and perf/overlap is the share of it hidden.
On GPUs each phase ends with a device synchronisation, so that queued kernels count in the phase that launched
them.
"""

from __future__ import annotations

import contextlib
import time

import torch

from grpo_mega.parallel import comm

WALL_PHASES = ("generate_wait", "reward", "old_logprobs", "ref_logprobs", "update", "weight_sync", "eval", "checkpoint")
PHASES = ("generate",) + WALL_PHASES


class StepTimer:
    """Seconds per phase of one step on this rank; `metrics()` reduces them over ranks (collective)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if phase not in self.seconds:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        """Seconds of a phase measured elsewhere (the engines' generation, on rank 0's rollout thread)."""
        if phase not in self.seconds:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        self.seconds[phase] += seconds

    def metrics(self) -> dict[str, float]:
        """`timing/<phase>` and `timing/step` (since construction), each the maximum over ranks."""
        step = time.perf_counter() - self.start
        values = comm.world_max([self.seconds[p] for p in PHASES] + [step])
        return {f"timing/{p}": v for p, v in zip(PHASES + ("step",), values)}


def throughput(timing: dict[str, float], update_tokens: float, generated_tokens: float) -> dict[str, float]:
    """perf/update_tokens_per_s (prompt + response tokens of the rows that train, every epoch, per second of
    the update), perf/generated_tokens_per_s (response tokens of the step's batch per second of generation)
    and perf/overlap (1 - generate_wait / generate: the share of generation hidden behind training; 0 in turn)."""
    def rate(tokens, seconds):
        return tokens / seconds if seconds > 0 else 0.0

    gen = timing["timing/generate"]
    return {"perf/update_tokens_per_s": rate(update_tokens, timing["timing/update"]),
            "perf/generated_tokens_per_s": rate(generated_tokens, gen),
            "perf/overlap": min(1.0, max(0.0, 1.0 - timing["timing/generate_wait"] / gen)) if gen > 0 else 0.0}
