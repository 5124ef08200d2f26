"""Group-relative advantages (GRPO), KL-in-reward shaping and DAPO dynamic-sampling filters.

Pure tensor math over the whole step's responses: no torch.distributed, no config objects. Responses are
laid out group-contiguous: rows [g*n, (g+1)*n) are the n samples of prompt g.
"""

from __future__ import annotations

import torch

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
