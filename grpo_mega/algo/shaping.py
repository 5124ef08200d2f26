"""Per-step shaping, pure: from a step's rewards (and, for KL-in-reward, the old and reference logprobs) to the
rewards reported, the scores advantages are computed from, the advantages, and which rows enter the loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo_mega.algo.advantages import group_advantages, kl_in_reward, nonuniform_groups
from grpo_mega.algo.kl import kl_penalty


@dataclass(frozen=True)
class StepShaping:
    n: int
    overlong: str = "keep"
    kl_in_reward: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    norm_adv_by_std: bool = True
    global_adv_norm: bool = False
    dynamic_sampling: bool = False


@dataclass
class ShapedStep:
    rewards: torch.Tensor
    scores: torch.Tensor
    advantages: torch.Tensor
    in_loss: torch.Tensor


def shape_step(s: StepShaping, rewards: torch.Tensor, overlong: torch.Tensor, old_logp: Optional[torch.Tensor] = None,
               ref_logp: Optional[torch.Tensor] = None, response_mask: Optional[torch.Tensor] = None) -> ShapedStep:
    if s.overlong not in ("keep", "zero", "mask"):
        raise ValueError(f"reward.overlong={s.overlong!r} must be 'keep', 'zero' or 'mask'")
    if s.overlong == "zero":
        rewards = torch.where(overlong, 0.0, rewards)
    scores = rewards
    if s.kl_in_reward:
        scores = kl_in_reward(rewards, kl_penalty(old_logp, ref_logp, s.kl_estimator), response_mask, s.kl_coef)[1]
    advantages = group_advantages(scores, s.n, s.norm_adv_by_std, s.global_adv_norm)
    in_loss = torch.ones(len(rewards), dtype=torch.bool)
    if s.overlong == "mask":
        in_loss &= ~overlong
    if s.dynamic_sampling:
        in_loss &= nonuniform_groups(scores, s.n).repeat_interleave(s.n)
    return ShapedStep(rewards, scores, advantages, in_loss)
