"""One step's reward shaping and loss rows: from the scored responses to the advantages the update trains on.

Owns the per-step algorithm work between scoring and the update: overlong handling (`reward.overlong`, and
DAPO's soft overlong punishment `reward.overlong_buffer_len`),
PPO-style KL in the reward (`algo.kl_in_reward`), GRPO group advantages, DAPO's dynamic-sampling mask and
which rows enter the loss. Pure tensor math over the whole step's responses (the same on every rank): no
torch.distributed, no config objects; the settings arrive as a `StepShaping` of plain values. Scoring,
logprobs and the update itself belong to the trainer. Responses are group-contiguous: rows [g*n, (g+1)*n)
are the n samples of prompt g.

The trainer's loop calls it once per step, after the old (and reference) logprobs:

    shaping = StepShaping(n=batch.n, overlong=task.overlong, kl_in_reward=algo_cfg.kl_in_reward,
                          kl_coef=algo_cfg.kl_coef, kl_estimator=algo_cfg.kl_estimator,
                          norm_adv_by_std=algo_cfg.norm_adv_by_std, global_adv_norm=algo_cfg.global_adv_norm,
                          dynamic_sampling=bool(algo_cfg.dynamic_sampling))  # once, before the steps
    overlong = torch.tensor([f == "length" for f in gen.finish_reasons])
    shaped = shape_step(shaping, rewards, overlong, rb.old_logp, rb.ref_logp, rb.response_mask(), rb.response_lens)
    rb.advantages, rb.in_loss = shaped.advantages, shaped.in_loss
    # shaped.rewards: the rewards after overlong zeroing (the logged `reward`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo_mega.algo.advantages import ADV_ESTIMATORS, advantages, kl_in_reward, nonuniform_groups
from grpo_mega.algo.kl import KL_ESTIMATORS, kl_penalty

OVERLONG_MODES = ("keep", "zero", "mask")


@dataclass(frozen=True, kw_only=True)
class StepShaping:
    """The settings of one step's shaping, plain values (built once from the run's config)."""

    n: int
    """Responses per prompt (rollout.n): the group size."""
    overlong: str = "keep"
    """reward.overlong, for responses cut at max_response_length (finish reason "length"): 'keep' their
    reward, 'zero' it, or 'mask' the rows out of the loss (DAPO's overlong filtering, Yu et al. 2025)."""
    overlong_buffer_len: Optional[int] = None
    """reward.overlong_buffer_len: DAPO's soft overlong punishment over the last this many tokens before
    max_response_length (`overlong_penalty`); None: off."""
    overlong_penalty_factor: float = 1.0
    """reward.overlong_penalty_factor: the penalty at max_response_length."""
    max_response_length: Optional[int] = None
    """batch.max_response_length (needed with overlong_buffer_len)."""
    kl_in_reward: bool = False
    """algo.kl_in_reward: subtract kl_coef * KL(old || ref) from each response's reward (needs ref_logp)."""
    kl_coef: float = 0.0
    """algo.kl_coef: beta of the KL in the reward."""
    kl_estimator: str = "k3"
    """algo.kl_estimator for the KL in the reward (a sampled-token estimator: not 'full')."""
    adv_estimator: str = "grpo"
    """algo.adv_estimator (grpo_mega.algo.advantages.ADV_ESTIMATORS)."""
    norm_adv_by_std: bool = True
    """algo.norm_adv_by_std: divide advantages by the group std (false: DrGRPO); grpo and grpo_passk."""
    global_adv_norm: bool = False
    """algo.global_adv_norm: divide advantages by their std over the whole batch."""
    dynamic_sampling: bool = False
    """algo.dynamic_sampling set (filter or refill): rows of groups whose (shaped) rewards are all equal leave the
    loss (DAPO). Refill's extra rounds (grpo_mega.algo.dynamic_sampling) come before: what they could not
    replace is filtered here."""

    def __post_init__(self):
        if self.overlong not in OVERLONG_MODES:
            raise ValueError(f"reward.overlong={self.overlong!r} must be 'keep', 'zero' or 'mask'")
        if self.n < 2:
            raise ValueError(f"rollout.n={self.n} must be >= 2 for GRPO: a group of one has no baseline")
        if self.overlong_buffer_len is not None and not (
                self.max_response_length is not None and 1 <= self.overlong_buffer_len <= self.max_response_length):
            raise ValueError(f"reward.overlong_buffer_len={self.overlong_buffer_len} must be in [1, "
                             f"batch.max_response_length={self.max_response_length}]")
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"reward.overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0")
        KL_ESTIMATORS.get(self.kl_estimator)
        ADV_ESTIMATORS.get(self.adv_estimator)
        if self.kl_in_reward and self.kl_estimator == "full":
            raise ValueError("algo.kl_estimator='full' with algo.kl_in_reward=true: the reward's KL is estimated "
                             "from the sampled tokens' logprobs; use k1, abs, k2 or k3")


@dataclass(frozen=True)
class ShapedStep:
    """What the update trains on. All [B] (B = num_prompts * n)."""

    rewards: torch.Tensor
    """The task's rewards after overlong zeroing."""
    scores: torch.Tensor
    """The rewards the advantages come from: `rewards`, plus the soft overlong penalty with overlong_buffer_len,
    less beta * KL with kl_in_reward."""
    advantages: torch.Tensor
    """The advantages of `scores` (algo.adv_estimator; GRPO's group advantages by default), one per response."""
    in_loss: torch.Tensor
    """bool: rows that count in the loss (not masked as overlong, not in a uniform group under dynamic sampling)."""


def overlong_rewards(rewards: torch.Tensor, overlong: torch.Tensor, mode: str) -> torch.Tensor:
    """reward.overlong='zero' sets the reward of truncated responses to 0; 'keep' and 'mask' leave it.
    rewards: [B]; overlong: [B] bool. Returns [B]."""
    if mode not in OVERLONG_MODES:
        raise ValueError(f"reward.overlong={mode!r} must be 'keep', 'zero' or 'mask'")
    return torch.where(overlong, 0.0, rewards) if mode == "zero" else rewards


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, sec. 3.4, eq. 13), scaled by `factor` as verl's:

        R_length(y) = 0                                   |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                      -1                                  L_max < |y|

    times factor; L_max = max_len, L_cache = buffer_len. lengths: [B] response tokens. Returns [B] float64."""
    expected = max_len - buffer_len
    excess = lengths.to(torch.float64) - expected
    return (-excess / buffer_len).clamp(min=-1.0, max=0.0) * factor


def loss_rows(scores: torch.Tensor, overlong: torch.Tensor, n: int, overlong_mode: str,
              dynamic_sampling: bool) -> torch.Tensor:
    """Which rows enter the loss: all, less truncated ones under reward.overlong='mask', less the groups
    whose scores are all equal under dynamic sampling (DAPO, Yu et al. 2025, sec. 3.2: they add no gradient).
    scores: [B]; overlong: [B] bool. Returns [B] bool."""
    if overlong_mode not in OVERLONG_MODES:
        raise ValueError(f"reward.overlong={overlong_mode!r} must be 'keep', 'zero' or 'mask'")
    in_loss = torch.ones(scores.numel(), dtype=torch.bool)
    if overlong_mode == "mask":
        in_loss &= ~overlong
    if dynamic_sampling:
        in_loss &= nonuniform_groups(scores, n).repeat_interleave(n)
    return in_loss


def shape_step(shaping: StepShaping, rewards: torch.Tensor, overlong: torch.Tensor,
               old_logp: Optional[torch.Tensor] = None, ref_logp: Optional[torch.Tensor] = None,
               response_mask: Optional[torch.Tensor] = None,
               response_lengths: Optional[torch.Tensor] = None) -> ShapedStep:
    """Shape one step: overlong zeroing, KL in the reward, the advantages (algo.adv_estimator), the rows in the loss.

    rewards: [B] the task's scores, group-contiguous; overlong: [B] bool, the responses cut at
    max_response_length. With `shaping.kl_in_reward`: old_logp, ref_logp: [B, L] log-probabilities of the
    sampled tokens under the old policy and the reference, and response_mask: [B, L] bool (1 on response
    positions; also the lengths reinforce_plus_plus_baseline whitens with); each response's score becomes
    score - kl_coef * sum_t KL_t (grpo_mega.algo.kl_in_reward).
    With `shaping.overlong_buffer_len`: response_lengths: [B] each response's tokens (all it generated, tool
    results included: what counts against max_response_length); its soft overlong penalty is added to the score.
    The dynamic-sampling filter looks at the shaped scores.
    """
    if overlong.shape != rewards.shape:
        raise ValueError(f"overlong {tuple(overlong.shape)} and rewards {tuple(rewards.shape)}: "
                         "both need one entry per response")
    rewards = overlong_rewards(rewards, overlong, shaping.overlong)
    scores = rewards
    if shaping.overlong_buffer_len is not None:  # DAPO's soft overlong punishment
        if response_lengths is None:
            raise ValueError("reward.overlong_buffer_len needs the responses' lengths (response_lengths)")
        penalty = overlong_penalty(response_lengths, shaping.max_response_length, shaping.overlong_buffer_len,
                                   shaping.overlong_penalty_factor)
        scores = scores + penalty.to(scores.dtype)
    if shaping.kl_in_reward:  # PPO-style: the KL penalty goes into the sequence reward
        if old_logp is None or ref_logp is None or response_mask is None:
            raise ValueError("algo.kl_in_reward=true needs old_logp, ref_logp and response_mask; the reference "
                             "runs only with algo.kl_coef != 0")
        kl = kl_penalty(old_logp, ref_logp, shaping.kl_estimator)
        scores = kl_in_reward(rewards, kl, response_mask, shaping.kl_coef)[1]
    lengths = response_mask.sum(dim=-1) if response_mask is not None else None
    adv = advantages(shaping.adv_estimator, scores, shaping.n, lengths=lengths, norm_by_std=shaping.norm_adv_by_std,
                     global_norm=shaping.global_adv_norm)
    in_loss = loss_rows(scores, overlong, shaping.n, shaping.overlong, shaping.dynamic_sampling)
    return ShapedStep(rewards=rewards, scores=scores, advantages=adv, in_loss=in_loss)
