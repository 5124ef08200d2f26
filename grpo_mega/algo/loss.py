"""The GRPO policy loss: clipped surrogate, KL and entropy terms per token, and their aggregation.

Pure tensor math (no torch.distributed, no config objects). Cross-rank quantities arrive as arguments:
the aggregation normaliser is a property of the whole mini-batch; `local_normaliser` gives each
micro-batch's additive share of it, and the trainer sums the shares over micro-batches and DP ranks (one
all-reduce) before calling `aggregate` with the total. Shapes: B responses, T response positions;
`mask` is the response mask M (1 on generated tokens, EOS included).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from grpo_mega.algo.kl import LOG_RATIO_CLAMP
from grpo_mega.registry import Registry

Number = Union[float, int, torch.Tensor]


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """log r_t = logp - old_logp, clamped to [-20, 20] before any exp (verl's convention). [B, T]."""
    return (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate as a per-token loss (Schulman et al. 2017, eq. 7):

        L_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A),   r_t = exp(logp - old_logp)

    eps_high > eps_low is DAPO's clip-higher (Yu et al. 2025). With `dual_clip=c` (c > 1; Ye et al. 2020,
    "Mastering Complex Control in MOBA Games"), tokens with A < 0 are further bounded: L_t = min(L_t, -c A).

    logp, old_logp: [B, T]; advantages: [B] (one per response) or [B, T].
    Returns (loss [B, T], clipped [B, T] bool: where the clipped branch was taken).
    """
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"algo.dual_clip={dual_clip} must be > 1 (or null to disable)")
    adv = advantages.unsqueeze(-1) if advantages.dim() == logp.dim() - 1 else advantages
    ratio = log_ratio(logp, old_logp).exp()
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is not None:
        bound = -adv * dual_clip
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, clipped


def entropy_bonus(entropy: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token loss term -coef * H_t that rewards entropy (Mnih et al. 2016; PPO eq. 9). [B, T]."""
    return -coef * entropy


def valid_token_scale(mask: torch.Tensor) -> torch.Tensor:
    """DAPO's per-response scale: 1 / (number of valid tokens of the response) on its tokens, 0 elsewhere.

    mask: [B, T]. Returns [B, T] float64 if mask is float64, else the default dtype.
    """
    m = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.get_default_dtype())
    return m / m.sum(dim=-1, keepdim=True).clamp(min=1.0)


def truncated_is_weight(old_logp: torch.Tensor, engine_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weight min(pi_old / pi_engine, cap) per token, no gradient (TIS; Yao et al.
    2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): corrects for the rollout
    engine sampling from a slightly different distribution than the trainer's. [B, T] -> [B, T]."""
    return log_ratio(old_logp, engine_logp).exp().clamp(max=cap).detach()


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float] = None,
    kl: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    token_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token GRPO loss L_t = pg_t + beta * kl_t - c_H * H_t (times `token_scale` if given).

    kl: [B, T] per-token KL penalty (see grpo_mega.algo.kl); entropy: [B, T]; token_scale: [B, T], e.g.
    `valid_token_scale(mask)`. Returns (loss [B, T], per-token terms for metrics).
    """
    pg, clipped = clipped_surrogate(logp, old_logp, advantages, eps_low, eps_high, dual_clip)
    loss = pg
    terms = {"pg_loss": pg, "clipped": clipped.to(pg.dtype)}
    if kl is not None and kl_coef:
        loss = loss + kl_coef * kl
    if entropy is not None and entropy_coef:
        loss = loss + entropy_bonus(entropy, entropy_coef)
    if token_scale is not None:
        loss = loss * token_scale
    return loss, terms


# ---- aggregation over the [B, T] token-loss matrix -------------------------------------------------------

Aggregator = Callable[[torch.Tensor, torch.Tensor, Number], torch.Tensor]
AGG_MODES: Registry[Aggregator] = Registry("loss aggregation mode")


def _masked(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return loss * mask.to(loss.dtype)


@AGG_MODES.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, normaliser: Number) -> torch.Tensor:
    """sum(L M) / N, N = valid tokens in the whole mini-batch (DAPO's token-level loss)."""
    return _masked(loss, mask).sum() / normaliser


@AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, normaliser: Number) -> torch.Tensor:
    """mean_i sum_t L M: sum(L M) / N, N = sequences in the whole mini-batch."""
    return _masked(loss, mask).sum() / normaliser


@AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, normaliser: Number) -> torch.Tensor:
    """mean_i (sum_t L M / sum_t M), the original GRPO objective (Shao et al. 2024, eq. 3).
    N = sequences in the whole mini-batch; a sequence's own token count stays within its micro-batch."""
    per_seq = _masked(loss, mask).sum(dim=-1) / mask.to(loss.dtype).sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / normaliser


@AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, normaliser: Number) -> torch.Tensor:
    """sum(L M) / (B * max_response_length): DrGRPO's constant normaliser (Liu et al. 2025, sec. 3.1)."""
    return _masked(loss, mask).sum() / normaliser


def local_normaliser(mode: str, mask: torch.Tensor, max_response_length: int) -> torch.Tensor:
    """This micro-batch's additive share of the mini-batch normaliser of `mode`.

    token-mean: valid tokens; seq-mean-token-sum and seq-mean-token-mean: sequences;
    seq-mean-token-sum-norm: sequences * max_response_length. Summed over every micro-batch of a mini-batch
    on every DP rank, it is the normaliser that `aggregate` takes. mask: [B, T]. Returns a float64 scalar.
    """
    AGG_MODES.get(mode)
    if mode == "token-mean":
        return mask.to(torch.float64).sum()
    num_seqs = torch.tensor(float(mask.shape[0]), dtype=torch.float64)
    if mode == "seq-mean-token-sum-norm":
        if max_response_length < 1:
            raise ValueError(f"max_response_length={max_response_length} must be >= 1")
        return num_seqs * max_response_length
    return num_seqs


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: Number) -> torch.Tensor:
    """Aggregate a [B, T] token-loss matrix to a scalar with the mini-batch `normaliser` of `mode`.

    The normaliser is never recomputed from this micro-batch: splitting a mini-batch into micro-batches
    (or over DP ranks) and summing the results gives the whole mini-batch's loss and gradient.
    """
    if float(normaliser) <= 0:
        return _masked(loss, mask).sum() * 0.0  # an empty mini-batch: zero loss, gradient graph kept
    return AGG_MODES.get(mode)(loss, mask, normaliser)


def megatron_loss_scale(num_microbatches: int, dp_size: int) -> int:
    """Factor to multiply each micro-batch's aggregated loss by before handing it to Megatron.

    Megatron's schedule divides every micro-batch loss by `num_microbatches` and DDP averages gradients
    over `dp_size` ranks; with this factor both cancel and only the mini-batch normaliser remains.
    """
    if num_microbatches < 1 or dp_size < 1:
        raise ValueError(f"num_microbatches={num_microbatches} and dp_size={dp_size} must be >= 1")
    return num_microbatches * dp_size


# ---- early stop ----------------------------------------------------------------------------------------


def has_extreme_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """True when any valid token's importance ratio r_t is above `threshold` or below 1/threshold.

    Such a mini-batch is skipped (algo.early_stop_imp_ratio). This is one rank's verdict: the trainer
    combines them with a MAX all-reduce so that every rank skips together. Returns a bool scalar.
    """
    if threshold <= 1.0:
        raise ValueError(f"algo.early_stop_imp_ratio={threshold} must be > 1")
    lr = log_ratio(logp, old_logp).abs()
    return ((lr > torch.log(torch.tensor(threshold, dtype=lr.dtype))) & mask.bool()).any()


def logprob_mismatch(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |engine logprob - trainer logprob| over response tokens: the rollout/trainer drift metric.
    All [B, T], position-aligned. 0.0 for an empty mask."""
    m = mask.to(torch.float64)
    n = float(m.sum())
    return float(((engine_logp.double() - trainer_logp.double()).abs() * m).sum() / n) if n else 0.0
