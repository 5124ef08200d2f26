"""Rewards (reward.*): the function or reward model, its process pool, shaping, reward-model training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional



@dataclass(kw_only=True)
class RMTrainConfig:
    """reward.rm_train: continual training of the reward model (reward.name=reward_model)."""

    interval: int = 0
    """Train the reward model every this many steps (0: never; it stays frozen)."""
    steps: int = 10
    """Optimizer steps per update."""
    labels: str = ""
    """The label source: 'task' (the task's own verifier, task=successor), a registered rule (math, format)
    or a dotted path `pkg.mod:fn(response, ground_truth, sample) -> float in [0, 1]`."""
    replay_fraction: float = 0.1
    """Share of each update's training samples drawn from the replay buffer of earlier data, in [0, 1)."""
    buffer_size: int = 2048
    """Replay buffer capacity (samples); reservoir sampling keeps a uniform sample of all seen."""
    batch_size: int = 32
    """Samples per optimizer step."""
    lr: float = 1e-4
    """AdamW learning rate."""
    heldout_fraction: float = 0.25
    """Share of the labelled samples kept out of training to measure rm/accuracy, in [0, 1)."""
    seed: int = 0
    """Seeds the held-out split, the replay draws and the mini-batch order."""

    def __post_init__(self):
        if self.interval < 0:
            raise ValueError(f"reward.rm_train.interval={self.interval} must be >= 0 (0: the reward model stays frozen)")
        if not 0 <= self.replay_fraction < 1:
            raise ValueError(f"reward.rm_train.replay_fraction={self.replay_fraction} must be in [0, 1) "
                             "(the share of replayed samples; 1 would never train on new ones)")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"reward.rm_train.heldout_fraction={self.heldout_fraction} must be in [0, 1)")
        for name in ("steps", "buffer_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"reward.rm_train.{name}={getattr(self, name)} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"reward.rm_train.lr={self.lr} must be > 0")
        if self.interval and not self.labels:
            raise ValueError("reward.rm_train.interval > 0 needs reward.rm_train.labels (a rule such as math, "
                             "'task' for the task's own verifier, or a dotted path)")


@dataclass(kw_only=True)
class RewardConfig:
    """The reward (task=prompts): a registered name (math, format, mix, reward_model) or a dotted path.
    Rule rewards run in a process pool, each sample on one rank (grpo_mega/rewards/scoring.py)."""

    name: str = "math"
    """A registered reward (math, format, mix, reward_model) or a dotted path `pkg.mod:fn`."""
    on_error: str = "zero"
    """'zero': score a failing or timed-out sample 0 and report it; 'raise': stop."""
    weights: dict = field(default_factory=dict)
    """For name=mix: {reward name: weight}."""
    path: str = ""
    """For name=reward_model: an HF sequence-classification checkpoint (scored in batches on rank 0)."""
    device: str = ""
    """For name=reward_model: where it runs ('cuda:1', 'cpu'); '': the trainer's device (bf16 on GPUs)."""
    rm_batch_size: int = 64
    """For name=reward_model: samples per forward."""
    rm_train: RMTrainConfig = field(default_factory=RMTrainConfig)
    """For name=reward_model: keep training it on the policy's labelled samples (iterative RL)."""
    val_reward: str = ""
    """What scores validation: '' the training reward; 'task' the task's own verifier (task=successor); or a
    rule / dotted path. With a learned reward model, a rule judges the policy rather than the model."""
    overlong: str = "keep"
    """A response cut at batch.max_response_length: 'keep' its reward, 'zero' it, or 'mask' it out of the loss."""
    overlong_buffer_len: Optional[int] = None
    """DAPO's soft overlong punishment (verl's reward.overlong_buffer.len): a response longer than
    batch.max_response_length - overlong_buffer_len gets a penalty growing linearly to -overlong_penalty_factor at
    max_response_length, added to the score the advantages come from; null: off."""
    overlong_penalty_factor: float = 1.0
    """The soft overlong penalty at max_response_length (verl's reward.overlong_buffer.penalty_factor)."""
    num_workers: Optional[int] = None
    """Reward worker processes per rank; null: the node's cores divided among its ranks (at least 1)."""
    timeout_s: float = 30.0
    """Per-sample time limit: a sample still being scored is cut (its worker killed) and handled by on_error."""
    start_method: str = "forkserver"
    """How workers start: 'forkserver' (forked from a clean server, never from a rank's gloo/NCCL threads),
    'spawn', or 'fork'."""
    max_memory_mb: Optional[int] = None
    """Each worker's memory cap in MiB beyond its start size (RLIMIT_AS): a sample over it fails alone; 0/null: none."""
    max_error_fraction: float = 0.5
    """With on_error=zero: when more than this share of the samples scored over the last `error_window` steps
    failed (raised, returned a non-number or a non-finite one, timed out; a reward model's non-finite score),
    the run stops with an error before training on them, after a checkpoint of the step before (with
    checkpoint.dir). 1: never stop; 0: stop at the first failure."""
    error_window: int = 10
    """The steps max_error_fraction is measured over (fewer at the start: step 1 alone is a window)."""

    def __post_init__(self):
        if self.overlong_buffer_len is not None and self.overlong_buffer_len < 1:
            raise ValueError(f"reward.overlong_buffer_len={self.overlong_buffer_len} must be >= 1 tokens (null: off)")
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"reward.overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0")
        if self.max_memory_mb is not None and self.max_memory_mb < 0:
            raise ValueError(f"reward.max_memory_mb={self.max_memory_mb} must be >= 0 (0 or null: no limit)")
        if not 0 <= self.max_error_fraction <= 1:
            raise ValueError(f"reward.max_error_fraction={self.max_error_fraction} must be in [0, 1] (1: never stop)")
        if not isinstance(self.error_window, int) or self.error_window < 1:
            raise ValueError(f"reward.error_window={self.error_window} must be >= 1 (steps)")
        if self.overlong not in ("keep", "zero", "mask"):
            raise ValueError(f"reward.overlong={self.overlong!r} must be 'keep', 'zero' or 'mask'")
        if self.on_error not in ("zero", "raise"):
            raise ValueError(f"reward.on_error={self.on_error!r} must be 'zero' or 'raise'")
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers} must be >= 1 (or null: cores per rank)")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0")
        if self.start_method not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"reward.start_method={self.start_method!r} must be 'forkserver', 'spawn' or 'fork'")
        if isinstance(self.rm_train, dict):
            self.rm_train = RMTrainConfig(**self.rm_train)
        if self.rm_train.interval and self.name != "reward_model":
            raise ValueError(f"reward.rm_train.interval={self.rm_train.interval} trains a learned reward model: it "
                             f"needs reward.name=reward_model (got {self.name!r})")
        if self.rm_batch_size < 1:
            raise ValueError(f"reward.rm_batch_size={self.rm_batch_size} must be >= 1")
