"""Whole policy losses, registered by name: from a micro-batch's token statistics to its aggregated loss.

A policy loss decides which terms the objective has (the KL to the reference in the loss or not, which KL,
the entropy bonus, DAPO's per-response token scale, the truncated importance correction against the
engine's logprobs), combines them per token and aggregates with the mini-batch normaliser. The trainer
computes the token statistics from the logits (vocab-parallel logprobs, entropy, full KL), sums the
normaliser over micro-batches and ranks, and scales the loss for Megatron; a new loss (GSPO, CISPO) is a
new function registered in `POLICY_LOSSES`, not a branch in the trainer (verl `core_algos.py`,
`@register_policy_loss`). Pure tensor math: the settings arrive as an `Objective` of plain values.

Every entry has the signature of `ppo_clip` and returns (loss, metric sums): the loss a scalar with a
gradient graph, the sums detached scalars the trainer adds over micro-batches (`token_metrics` gives the
ones every loss reports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo_mega.algo.kl import KL_ESTIMATORS, kl_penalty
from grpo_mega.algo.loss import (
    AGG_MODES,
    aggregate,
    grpo_token_loss,
    has_extreme_ratio,
    log_ratio,
    truncated_is_weight,
    valid_token_scale,
)
from grpo_mega.registry import Registry


@dataclass(frozen=True, kw_only=True)
class Objective:
    """The policy loss's settings, plain values (the trainer builds it once from `algo.*`)."""

    clip_ratio_low: float = 0.2
    """eps_low of the clipped surrogate."""
    clip_ratio_high: float = 0.2
    """eps_high; > clip_ratio_low is DAPO's clip-higher."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages, or None."""
    kl_coef: float = 0.0
    """beta of the KL term; 0 leaves it out."""
    kl_estimator: str = "k3"
    """KL estimator (grpo_mega.algo.kl); 'full' takes the whole-vocabulary KL the trainer passes in."""
    kl_in_reward: bool = False
    """The KL went into the reward (grpo_mega.algo.shaping) and is not in the loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; 0 leaves it out."""
    loss_agg_mode: str = "token-mean"
    """Aggregation over the [B, T] token losses (grpo_mega.algo.loss.AGG_MODES)."""
    dapo_token_scale: bool = False
    """Scale each token's loss by 1 / (valid tokens of its response)."""
    engine_is_cap: Optional[float] = None
    """Truncated importance correction min(p_old / p_engine, cap) per token, or None."""
    early_stop_imp_ratio: Optional[float] = None
    """Flag a micro-batch with an importance ratio above this (or below its inverse), or None."""

    def __post_init__(self):
        KL_ESTIMATORS.get(self.kl_estimator)
        AGG_MODES.get(self.loss_agg_mode)

    @property
    def kl_in_loss(self) -> bool:
        """The loss has a KL term: beta != 0 and the KL is not in the reward."""
        return self.kl_coef != 0 and not self.kl_in_reward

    @property
    def full_kl_in_loss(self) -> bool:
        """The loss's KL term is the full-vocabulary KL: the trainer must pass `full_kl` (the reference's logits)."""
        return self.kl_in_loss and self.kl_estimator == "full"


def kl_term(obj: Objective, logp: torch.Tensor, ref_logp: Optional[torch.Tensor],
            full_kl: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The per-token KL of the loss, or None when the objective has no KL term. [B, T]."""
    if not obj.kl_in_loss:
        return None
    if obj.kl_estimator == "full":
        if full_kl is None:
            raise ValueError("algo.kl_estimator='full' with algo.kl_coef != 0 needs the per-token full KL "
                             "(`full_kl`, from the reference's logits)")
        return full_kl
    if ref_logp is None:
        raise ValueError(f"algo.kl_coef != 0 with algo.kl_estimator={obj.kl_estimator!r} needs ref_logp")
    return kl_penalty(logp, ref_logp, obj.kl_estimator)


def token_weights(obj: Objective, mask: torch.Tensor, old_logp: torch.Tensor,
                  engine_logp: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(token_scale, is_weight), each [B, T] or None: DAPO's valid-token scale times the truncated importance
    weight, and that weight alone (for its metrics)."""
    token_scale = valid_token_scale(mask) if obj.dapo_token_scale else None
    is_weight = None
    if obj.engine_is_cap is not None:
        if engine_logp is None:
            raise ValueError("algo.engine_is_cap needs the engine's logprobs (rollout.engine_logp)")
        is_weight = truncated_is_weight(old_logp, engine_logp, obj.engine_is_cap)
        token_scale = is_weight if token_scale is None else token_scale * is_weight
    return token_scale, is_weight


@torch.no_grad()
def token_metrics(obj: Objective, loss: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor,
                  mask: torch.Tensor, entropy: torch.Tensor, kl: Optional[torch.Tensor],
                  ref_logp: Optional[torch.Tensor], is_weight: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The metric sums every policy loss reports, over the micro-batch's valid tokens (the trainer divides
    by the summed `tokens`): loss, entropy, KL (the loss's, else k3 to the reference when there is one),
    importance ratio sum/min/max, the importance correction's mean weight and capped share, and whether a
    ratio is extreme (algo.early_stop_imp_ratio). The loss-specific sums (pg_loss_sum, clipped_sum) are the
    entry's own."""
    m = mask.to(torch.float32)
    valid = mask.bool()
    ratio = log_ratio(logp, old_logp).exp()
    if kl is not None:
        kl_sum = (kl * m).sum()
    elif ref_logp is not None:
        kl_sum = (kl_penalty(logp, ref_logp, "k3") * m).sum()
    else:
        kl_sum = torch.zeros(())
    return {
        "loss": loss.detach(),
        "entropy_sum": (entropy * m).sum(),
        "kl_sum": kl_sum,
        "tokens": m.sum(),
        "ratio_sum": (ratio * m).sum(),
        "ratio_min": ratio[valid].min() if valid.any() else torch.tensor(math.inf),
        "ratio_max": ratio[valid].max() if valid.any() else torch.tensor(-math.inf),
        "is_weight_sum": (is_weight * m).sum() if is_weight is not None else m.sum(),
        "is_capped_sum": ((is_weight >= obj.engine_is_cap) * m).sum() if is_weight is not None else torch.zeros(()),
        "extreme": has_extreme_ratio(logp, old_logp, mask, obj.early_stop_imp_ratio).float()
        if obj.early_stop_imp_ratio else torch.zeros(()),
    }


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
             ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
             engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's objective (Shao et al. 2024): PPO's clipped surrogate per token (Schulman et al. 2017, with
    DAPO's clip-higher and optional dual clip), + beta * KL_t when the KL is in the loss, - c_H * H_t when
    entropy_coef != 0, times DAPO's valid-token scale and the truncated importance weight when on, then
    aggregated by `loss_agg_mode` over the mini-batch `normaliser` (grpo_mega.algo.loss.aggregate).

    logp: [B, T] the sampled tokens' log-probabilities under the policy, with grad; entropy: [B, T];
    old_logp, mask: [B, T]; advantages: [B]; normaliser: the mini-batch's total of `local_normaliser`
    (a scalar); ref_logp: [B, T], needed with a sampled-token KL in the loss; full_kl: [B, T] the
    whole-vocabulary KL, needed with kl_estimator='full'; engine_logp: [B, T], needed with engine_is_cap.
    Returns (loss: scalar, metric sums: `token_metrics` plus pg_loss_sum and clipped_sum).
    """
    kl = kl_term(obj, logp, ref_logp, full_kl)
    token_scale, is_weight = token_weights(obj, mask, old_logp, engine_logp)
    token_loss, terms = grpo_token_loss(
        logp, old_logp, advantages, obj.clip_ratio_low, obj.clip_ratio_high, obj.dual_clip,
        kl=kl, kl_coef=obj.kl_coef if obj.kl_in_loss else 0.0,
        entropy=entropy if obj.entropy_coef else None, entropy_coef=obj.entropy_coef,
        token_scale=token_scale,
    )
    loss = aggregate(token_loss, mask, obj.loss_agg_mode, normaliser)
    stats = token_metrics(obj, loss, logp, old_logp, mask, entropy, kl, ref_logp, is_weight)
    m = mask.to(torch.float32)
    with torch.no_grad():
        stats["pg_loss_sum"] = (terms["pg_loss"] * m).sum()
        stats["clipped_sum"] = (terms["clipped"] * m).sum()
    return loss, stats
