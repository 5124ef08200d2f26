"""Outcome advantages, registered by name (`ADV_ESTIMATORS`: grpo, rloo, reinforce_plus_plus_baseline,
grpo_passk), KL-in-reward shaping and DAPO dynamic-sampling filters.

Pure tensor math over the whole step's responses: no torch.distributed, no config objects. Responses are
laid out group-contiguous: rows [g*n, (g+1)*n) are the n samples of prompt g. Every estimator takes the
responses' scalar scores and gives one advantage per response (verl broadcasts it over the response's tokens;
so does the loss here).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from grpo_mega.registry import Registry

EPS = 1e-6


def _groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * n], got shape {tuple(rewards.shape)}")
    if n < 2:
        raise ValueError(f"rollout.n={n} must be >= 2 for GRPO: a group of one has no baseline")
    if rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of rollout.n={n}")
    return rewards.view(-1, n)


def group_advantages(
    rewards: torch.Tensor,
    n: int,
    norm_by_std: bool = True,
    global_norm: bool = False,
    eps: float = EPS,
) -> torch.Tensor:
    """GRPO advantages, one per response (Shao et al. 2024, DeepSeekMath, sec. 4.1).

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps), with std the sample std (N-1), as verl and TRL compute it.
    `norm_by_std=False` keeps only the centring (DrGRPO, Liu et al. 2025). `global_norm=True` then
    divides by the std of the centred advantages over the whole batch (group mean, batch std: LitePPO,
    Liu et al. 2025, "Tricks or Traps"). A group whose rewards are all equal carries no signal and gets
    exactly 0.0, whatever the rounding of its mean.

    rewards: [num_prompts * n], group-contiguous. Returns [num_prompts * n], same dtype.
    """
    g = _groups(rewards, n)
    centred = g - g.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (g.std(dim=1, keepdim=True, unbiased=True) + eps)
    uniform = (g == g[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(uniform, torch.zeros_like(centred), centred).reshape(-1)
    if global_norm:
        adv = adv / (adv.std(unbiased=True) + eps)
    return adv


AdvEstimator = Callable[..., torch.Tensor]
ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("advantage estimator")
"""name -> fn(scores [B], n, *, lengths [B] or None, norm_by_std, eps) -> advantages [B]."""
NORM_BY_STD_ESTIMATORS = ("grpo", "grpo_passk")
"""The estimators that read algo.norm_adv_by_std (the others have no group std in their definition)."""


@ADV_ESTIMATORS.register("grpo")
def _grpo(scores: torch.Tensor, n: int, *, lengths: Optional[torch.Tensor] = None, norm_by_std: bool = True,
          eps: float = EPS) -> torch.Tensor:
    """`group_advantages` without the global norm (which `advantages` applies to every estimator)."""
    return group_advantages(scores, n, norm_by_std, False, eps)


@ADV_ESTIMATORS.register("rloo")
def rloo(scores: torch.Tensor, n: int, *, lengths: Optional[torch.Tensor] = None, norm_by_std: bool = True,
         eps: float = EPS) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", eq. 6): each response's
    baseline is the mean of the other n - 1 rewards of its group,

        A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mean_g(r)),

    no std. A group whose rewards are all equal gets exactly 0. scores: [num_prompts * n] -> [num_prompts * n]."""
    g = _groups(scores, n)
    adv = (g - g.mean(dim=1, keepdim=True)) * (n / (n - 1))
    uniform = (g == g[:, :1]).all(dim=1, keepdim=True)
    return torch.where(uniform, torch.zeros_like(adv), adv).reshape(-1)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(scores: torch.Tensor, n: int, *, lengths: Optional[torch.Tensor] = None,
                                 norm_by_std: bool = True, eps: float = EPS) -> torch.Tensor:
    """REINFORCE++ with baseline (Hu et al. 2025, "REINFORCE++", sec. on the group baseline; verl's
    reinforce_plus_plus_baseline): subtract the group mean, then whiten over the batch's tokens,

        c_i = r_i - mean_g(r),   A_i = (c_i - mu) / sqrt(var + 1e-8),
        mu = sum_i L_i c_i / N,  var = sum_i L_i (c_i - mu)^2 / (N - 1),  N = sum_i L_i,

    L_i the response's valid tokens (each token carries its response's c_i, so a response weighs by its length;
    the unbiased token variance as verl's masked_whiten). Uniform groups have c_i = 0 but A_i = -mu / sqrt(var).
    lengths: [B] valid tokens per response (needed; N >= 2)."""
    if lengths is None:
        raise ValueError("algo.adv_estimator='reinforce_plus_plus_baseline' whitens over tokens and needs the "
                         "responses' lengths")
    g = _groups(scores, n)
    c = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
    L = lengths.to(c.dtype).reshape(-1)
    N = L.sum()
    if float(N) < 2:
        raise ValueError(f"algo.adv_estimator='reinforce_plus_plus_baseline' needs >= 2 response tokens in the "
                         f"batch to whiten over (got {int(N)})")
    mu = (L * c).sum() / N
    var = (L * (c - mu) ** 2).sum() / (N - 1)
    return (c - mu) * torch.rsqrt(var + 1e-8)


@ADV_ESTIMATORS.register("grpo_passk")
def grpo_passk(scores: torch.Tensor, n: int, *, lengths: Optional[torch.Tensor] = None, norm_by_std: bool = True,
               eps: float = EPS) -> torch.Tensor:
    """GRPO for pass@k (Chen et al. 2025, "Pass@k Training", arXiv 2503.19595; verl's grpo_passk): only the best
    response of each group gets an advantage, the margin of its reward over the second best,

        A_best = (r_(1) - r_(2)) / (std_g(r) + eps)  (without "/ (std + eps)" when norm_by_std is false),

    every other response 0 (ties at the top: 0 for all). std is the sample std (N-1).
    scores: [num_prompts * n] -> [num_prompts * n]."""
    g = _groups(scores, n)
    top = torch.topk(g, 2, dim=1)
    margin = top.values[:, 0] - top.values[:, 1]
    if norm_by_std:
        margin = margin / (g.std(dim=1, unbiased=True) + eps)
    adv = torch.zeros_like(g)
    adv.scatter_(1, top.indices[:, :1], margin.unsqueeze(1))
    return adv.reshape(-1)


def advantages(name: str, scores: torch.Tensor, n: int, *, lengths: Optional[torch.Tensor] = None,
               norm_by_std: bool = True, global_norm: bool = False, eps: float = EPS) -> torch.Tensor:
    """The advantages of estimator `name` (ADV_ESTIMATORS), then, with `global_norm`, divided by their std over
    the whole batch (LitePPO's batch std, as `group_advantages`). scores, lengths: [B]. Returns [B]."""
    adv = ADV_ESTIMATORS.get(name)(scores, n, lengths=lengths, norm_by_std=norm_by_std, eps=eps)
    if global_norm:
        adv = adv / (adv.std(unbiased=True) + eps)
    return adv


def nonuniform_groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): which groups to keep.

    A group whose n rewards are all equal has zero advantage everywhere and adds no gradient; DAPO drops
    it and samples more prompts. rewards: [num_prompts * n]. Returns keep: [num_prompts] bool.
    """
    g = _groups(rewards, n)
    return ~(g == g[:, :1]).all(dim=1)


def response_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """M[i, t] = 1 for t < lengths[i]: exactly the generated tokens, the terminating EOS/stop included.

    Built from lengths, never from pad_token_id (some tokenizers pad with EOS). lengths: [B] int.
    Returns [B, max_len] bool.
    """
    if lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(f"a response of {int(lengths.max())} tokens exceeds max_len={max_len}")
    return torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def kl_in_reward(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-style KL penalty in the reward (Ziegler et al. 2019; Ouyang et al. 2022).

    Per-token reward r_t = score * 1[t is the last response token] - beta * kl_t on response tokens, 0
    elsewhere; the sequence reward is sum_t r_t, which then goes through group normalisation. A response
    with no tokens has nowhere to put its score and gets 0. scores: [B]; kl, mask: [B, T]. Returns (token_rewards [B, T], sequence_rewards [B]).
    """
    m = mask.to(kl.dtype)
    lengths = mask.sum(dim=1).long()
    last = torch.zeros_like(m)
    has_tokens = lengths > 0
    rows = torch.nonzero(has_tokens).squeeze(1)
    last[rows, lengths[rows] - 1] = 1.0
    token_rewards = (scores.to(kl.dtype).unsqueeze(1) * last - beta * kl) * m
    return token_rewards, token_rewards.sum(dim=1)
