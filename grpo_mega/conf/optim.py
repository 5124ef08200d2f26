"""Numerics and the optimizer: precision.* and optim.*."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional



@dataclass(kw_only=True)
class PrecisionConfig:
    """Parameter and compute precision."""

    params_dtype: str = "bf16"
    """'bf16' or 'fp32' (bf16 runs with fp32 main weights and gradients in the optimizer)."""
    fp8: Optional[str] = None
    """Transformer Engine FP8: null, 'hybrid' (E4M3 forward, E5M2 backward) or 'e4m3'. GPU only."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe: 'delayed', 'tensorwise', 'mxfp8' or 'blockwise'."""

    def __post_init__(self):
        if self.params_dtype not in ("bf16", "fp32"):
            raise ValueError(f"precision.params_dtype={self.params_dtype!r} must be 'bf16' or 'fp32'")
        if self.fp8 not in (None, "hybrid", "e4m3"):
            raise ValueError(f"precision.fp8={self.fp8!r} must be null, 'hybrid' or 'e4m3'")
        if self.fp8_recipe not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            raise ValueError(f"precision.fp8_recipe={self.fp8_recipe!r} must be delayed, tensorwise, mxfp8 or blockwise")


@dataclass(kw_only=True)
class OptimConfig:
    """Megatron optimizer and LR schedule for the actor."""

    optimizer: str = "adam"
    """'adam' (AdamW) or 'sgd'."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's denominator epsilon."""
    sgd_momentum: float = 0.0
    """Momentum for optimizer=sgd."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_decay_steps: Optional[int] = None
    """Optimizer steps to decay over (null: no decay, lr_decay_style constant only)."""
    lr_decay_style: str = "constant"
    """'constant', 'linear' or 'cosine'."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP (Megatron DistributedOptimizer)."""
    max_consecutive_skips: int = 10
    """Mini-batches in a row skipped for a non-finite loss or gradient (counted across steps; an applied
    optimizer step resets the count) before the run stops with an error, after a checkpoint (with
    checkpoint.dir; skipped mini-batches leave the weights unchanged). 0: never stop."""

    def __post_init__(self):
        if not isinstance(self.max_consecutive_skips, int) or self.max_consecutive_skips < 0:
            raise ValueError(f"optim.max_consecutive_skips={self.max_consecutive_skips} must be >= 0 (0: never stop)")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer={self.optimizer!r} must be 'adam' or 'sgd'")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.lr_decay_style={self.lr_decay_style!r} must be constant, linear or cosine")
        if self.lr_decay_style != "constant" and self.lr_decay_steps is None:
            # without it the schedule decayed over 1 step: min_lr from step 2 on (a run at min_lr=0 learns nothing)
            raise ValueError(f"optim.lr_decay_style={self.lr_decay_style!r} needs optim.lr_decay_steps (the optimizer "
                             "steps to decay over, e.g. run.steps)")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr={self.lr} and optim.min_lr={self.min_lr} must satisfy 0 <= min_lr <= lr")
