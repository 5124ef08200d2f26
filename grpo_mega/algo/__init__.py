"""GRPO math as pure tensor functions: advantages (registry `ADV_ESTIMATORS`), KL estimators, the clipped
surrogate, entropy bonus, loss
aggregation, DAPO's valid-token scale and dynamic-sampling filter, early stop and KL-in-reward shaping; the
rollout correction against the engine's logprobs (token, sequence, geometric; truncate or mask);
one step's shaping (`shape_step`) and the registry of whole policy losses (`POLICY_LOSSES`).
Nothing here imports torch.distributed or reads a config: cross-rank normalisers arrive as arguments."""

from grpo_mega.algo.advantages import (
    ADV_ESTIMATORS,
    advantages,
    group_advantages,
    kl_in_reward,
    nonuniform_groups,
    response_mask,
)
from grpo_mega.algo.kl import KL_ESTIMATORS, full_kl, kl_penalty
from grpo_mega.algo.loss import (
    AGG_MODES,
    aggregate,
    clipped_surrogate,
    entropy_bonus,
    grpo_token_loss,
    has_extreme_ratio,
    local_normaliser,
    logprob_mismatch,
    megatron_loss_scale,
    truncated_is_weight,
    valid_token_scale,
)
from grpo_mega.algo.correction import Correction, correction_weight
from grpo_mega.algo.policy_loss import POLICY_LOSSES, Objective
from grpo_mega.algo.shaping import ShapedStep, StepShaping, shape_step

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "Correction",
    "KL_ESTIMATORS",
    "Objective",
    "POLICY_LOSSES",
    "ShapedStep",
    "StepShaping",
    "advantages",
    "aggregate",
    "clipped_surrogate",
    "correction_weight",
    "entropy_bonus",
    "full_kl",
    "group_advantages",
    "grpo_token_loss",
    "has_extreme_ratio",
    "kl_in_reward",
    "kl_penalty",
    "local_normaliser",
    "logprob_mismatch",
    "megatron_loss_scale",
    "nonuniform_groups",
    "response_mask",
    "shape_step",
    "truncated_is_weight",
    "valid_token_scale",
]
