"""Whole policy losses, registered by name: from a micro-batch's token statistics to its aggregated loss.

A policy loss decides which terms the objective has (the KL to the reference in the loss or not, which KL,
the entropy bonus, DAPO's per-response token scale, the truncated importance correction against the
engine's logprobs), combines them per token and aggregates with the mini-batch normaliser. The trainer
computes the token statistics from the logits (vocab-parallel logprobs, entropy, full KL), sums the
normaliser over micro-batches and ranks, and scales the loss for Megatron; a new loss is a new function
registered in `POLICY_LOSSES`, not a branch in the trainer (verl `core_algos.py`, `@register_policy_loss`):
`ppo_clip` (GRPO/DAPO), `gspo` and `gspo_token` (Zheng et al. 2025), `cispo` (MiniMax-M1), `geo_mean` (GMPO),
`sapo` (SAPO), `gpg` (GPG), `clip_cov` and `kl_cov` (Cui et al. 2025), `dppo_tv` and `dppo_kl` (DPPO), `dro`, and
verl's bypass mode `bypass_ppo_clip` / `bypass_reinforce` (the engine's logprobs as the old policy). The rollout
correction against the engine's logprobs (grpo_mega.algo.correction) weights every loss's tokens the same way.
Pure tensor math: the settings arrive as an `Objective` of plain values.

Every row of [B, T] is one whole response: the trainer unpacks packed rows into per-sequence rows before the
loss, a sequence is never split over DP ranks or micro-batches, and the last pipeline stage holds every
position of its logits (sequence parallelism gathers the sequence before the output layer; the vocab-parallel
ops reduce over TP; there is no context parallelism, which would need a CP all-reduce of these sums). So
GSPO's and the correction's per-sequence reductions over t are exact here;
tests/trainer/test_policy_loss_layouts.py checks them against a single process under TP2+SP, PP2 and DP2.

Every entry has the signature of `ppo_clip` and returns (loss, metric sums): the loss a scalar with a
gradient graph, the sums detached scalars the trainer adds over micro-batches (`token_metrics` gives the
ones every loss reports).

Long on purpose: every registered loss beside the others, each a short function over the same `Objective` and
token statistics, so they are read against each other and against verl's core_algos.py in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from grpo_mega.algo.correction import Correction, Rejection, resolve, resolve_rejection, rollout_weight
from grpo_mega.algo.kl import KL_ESTIMATORS, kl_penalty
from grpo_mega.algo.loss import (
    AGG_MODES,
    aggregate,
    clipped_surrogate,
    entropy_bonus,
    grpo_token_loss,
    has_extreme_ratio,
    log_ratio,
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
    """Truncated importance correction min(p_old / p_engine, cap) per token, or None (the same as
    rollout_correction=token, truncate, [0, cap])."""
    rollout_correction: Optional[str] = None
    """Rollout correction level ('token', 'sequence', 'geometric') or preset ('icepop'), or None (off)."""
    rollout_correction_mode: Optional[str] = None
    """'truncate' or 'mask' (None: the level's default, see grpo_mega.algo.correction.resolve)."""
    rollout_correction_low: Optional[float] = None
    """Lower bound on the correction's ratio (None: the default)."""
    rollout_correction_high: Optional[float] = None
    """Upper bound on the correction's ratio (None: the default)."""
    rollout_rejection: Optional[str] = None
    """Rejection on a divergence statistic between the trainer's old and the engine's logprobs (one of
    grpo_mega.algo.correction.REJECTIONS), combined with the correction's weight; None: off."""
    rollout_rejection_threshold: Optional[float] = None
    """The largest kept value of the rejection's statistic (> 0; required with it)."""
    rollout_is_batch_norm: bool = False
    """Divide the correction's weights by their mean over the step's batch (needs a correction)."""
    is_batch_mean: Optional[float] = field(default=None, metadata={"runtime": True})
    """Runtime, not a setting (metadata runtime: AlgoConfig has no field of it): the batch's mean correction
    weight, set per update when rollout_is_batch_norm is on (grpo_mega.algo.correction.batch_mean)."""
    early_stop_imp_ratio: Optional[float] = None
    """Flag a micro-batch with an importance ratio above this (or below its inverse), or None."""
    gspo_clip_low: float = 3e-4
    """GSPO's eps_low on the sequence ratio s_i (Zheng et al. 2025, sec. 5.1: 3e-4)."""
    gspo_clip_high: float = 4e-4
    """GSPO's eps_high on s_i (the paper's 4e-4)."""
    seq_log_ratio_cap: float = 10.0
    """Upper cap on a sequence-level log-ratio (GSPO's log s_i, GMPO's clipped mean): exp(min(log s_i, cap)), no
    gradient above it (verl caps GSPO-token's log s_i,t at 10). Bounds the loss of a negative advantage by
    |A| e^cap."""
    cispo_eps_low: float = 1.0
    """CISPO: the IS weight is clipped below at 1 - eps_low (MiniMax-M1 sets no lower bound: 1.0)."""
    cispo_eps_high: float = 4.0
    """CISPO: the IS weight is clipped above at 1 + eps_high."""
    gmpo_clip_low: float = 0.4
    """GMPO (geo_mean): each token's log-ratio is clipped below at -gmpo_clip_low (the paper's (e^-0.4, e^0.4))."""
    gmpo_clip_high: float = 0.4
    """GMPO: each token's log-ratio is clipped above at gmpo_clip_high."""
    sapo_tau_pos: float = 1.0
    """SAPO: the gate's temperature for tokens with A > 0."""
    sapo_tau_neg: float = 1.05
    """SAPO: the gate's temperature for tokens with A <= 0."""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: the share of a micro-batch's valid tokens whose gradient is cut (at least 1)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: a token is a candidate when its covariance is in (clip_cov_lb, clip_cov_ub)."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: the candidates' covariance upper bound."""
    kl_cov_ratio: float = 2e-4
    """KL-Cov: the share of a micro-batch's valid tokens (the largest covariances, at least 1) given the KL term."""
    kl_cov_coef: float = 0.1
    """KL-Cov: the coefficient of |log r_t| on those tokens (verl's ppo_kl_coef)."""
    dppo_div_low: float = 0.2
    """DPPO: the divergence threshold for tokens with A <= 0 (TV: p - p_old >= -low; KL: binary KL <= low)."""
    dppo_div_high: float = 0.2
    """DPPO: the divergence threshold for tokens with A > 0 (TV: p - p_old <= high; KL: binary KL <= high)."""
    dppo_is_cap: float = 20.0
    """DPPO: the stop-gradient IS weight min(r_t, cap) on every kept token (verl's clip_ratio_c fallback 20)."""
    dro_beta: float = 1.0
    """DRO: the coefficient of the quadratic log-ratio penalty (beta / 2) (log pi - log pi_old)^2."""

    def __post_init__(self):
        KL_ESTIMATORS.get(self.kl_estimator)
        AGG_MODES.get(self.loss_agg_mode)
        _ = self.correction  # a bad correction setting fails here, not in the first micro-batch
        _ = self.rejection
        if self.rollout_is_batch_norm and self.correction is None:
            raise ValueError("algo.rollout_is_batch_norm=true normalises the rollout correction's weights: set "
                             "algo.rollout_correction (or algo.engine_is_cap), or rollout_is_batch_norm=false")
        if not 0.0 <= self.cispo_eps_low <= 1.0 or self.cispo_eps_high < 0:
            raise ValueError(f"algo.cispo_eps_low={self.cispo_eps_low} must be in [0, 1] and "
                             f"algo.cispo_eps_high={self.cispo_eps_high} >= 0")
        if self.gspo_clip_low < 0 or self.gspo_clip_high < 0:
            raise ValueError(f"algo.gspo_clip_low={self.gspo_clip_low} and gspo_clip_high={self.gspo_clip_high} "
                             f"must be >= 0")
        if not self.seq_log_ratio_cap > 0:
            raise ValueError(f"algo.seq_log_ratio_cap={self.seq_log_ratio_cap} must be > 0 (verl's GSPO uses 10)")
        if self.gmpo_clip_low < 0 or self.gmpo_clip_high < 0:
            raise ValueError(f"algo.gmpo_clip_low={self.gmpo_clip_low} and algo.gmpo_clip_high={self.gmpo_clip_high} "
                             f"must be >= 0 (bounds on the token log-ratio)")
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"algo.sapo_tau_pos={self.sapo_tau_pos} and algo.sapo_tau_neg={self.sapo_tau_neg} must "
                             f"be > 0 (SAPO's gate divides by them)")
        if not (0 < self.clip_cov_ratio <= 1 and 0 < self.kl_cov_ratio <= 1):
            raise ValueError(f"algo.clip_cov_ratio={self.clip_cov_ratio} and algo.kl_cov_ratio={self.kl_cov_ratio} "
                             f"must be in (0, 1] (shares of the valid tokens)")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"algo.clip_cov_lb={self.clip_cov_lb} must be < algo.clip_cov_ub={self.clip_cov_ub}")
        if self.kl_cov_coef < 0:
            raise ValueError(f"algo.kl_cov_coef={self.kl_cov_coef} must be >= 0")
        if not self.dro_beta >= 0:
            raise ValueError(f"algo.dro_beta={self.dro_beta} must be >= 0 (the weight of DRO's quadratic penalty)")
        if self.dppo_div_low < 0 or self.dppo_div_high < 0 or not self.dppo_is_cap > 0:
            raise ValueError(f"algo.dppo_div_low={self.dppo_div_low} and algo.dppo_div_high={self.dppo_div_high} must "
                             f"be >= 0 and algo.dppo_is_cap={self.dppo_is_cap} > 0")

    @property
    def correction(self) -> Optional[Correction]:
        """The rollout correction (level, mode, low, high), or None when off."""
        return resolve(self.rollout_correction, self.rollout_correction_mode, self.rollout_correction_low,
                       self.rollout_correction_high, self.engine_is_cap)

    @property
    def rejection(self) -> Optional[Rejection]:
        """The rollout rejection (level, statistic, threshold), or None when off."""
        return resolve_rejection(self.rollout_rejection, self.rollout_rejection_threshold)

    @property
    def rollout_weighted(self) -> bool:
        """The loss weights its tokens by the engine/trainer ratio (a correction or a rejection): needs engine_logp."""
        return self.correction is not None or self.rejection is not None

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


class Weights(NamedTuple):
    """token_scale: DAPO's valid-token scale times the rollout correction's weight ([B, T] or None); the
    correction's weight, ratio and where its bound acted ([B, T] each, None when it is off)."""

    token_scale: Optional[torch.Tensor]
    is_weight: Optional[torch.Tensor] = None
    is_ratio: Optional[torch.Tensor] = None
    is_hit: Optional[torch.Tensor] = None


def token_weights(obj: Objective, mask: torch.Tensor, old_logp: torch.Tensor,
                  engine_logp: Optional[torch.Tensor]) -> Weights:
    """The per-token weights every loss applies: DAPO's valid-token scale (dapo_token_scale) times the rollout
    correction's weight (grpo_mega.algo.correction; algo.engine_is_cap is its token-level truncation), divided by
    its batch mean (rollout_is_batch_norm), times the rollout rejection's keep mask."""
    token_scale = valid_token_scale(mask) if obj.dapo_token_scale else None
    c, rejection = obj.correction, obj.rejection
    if c is None and rejection is None:
        return Weights(token_scale)
    if engine_logp is None:
        which = ("algo.engine_is_cap" if obj.engine_is_cap is not None else "algo.rollout_correction" if c is not None
                 else "algo.rollout_rejection")
        raise ValueError(f"{which} needs the engine's logprobs (rollout.engine_logp)")
    if obj.rollout_is_batch_norm and obj.is_batch_mean is None:
        raise ValueError("algo.rollout_is_batch_norm=true needs the batch's mean weight (Objective.is_batch_mean, "
                         "set by Actor.update from rollout.is_batch_mean)")
    is_weight, rho, hit = rollout_weight(old_logp, engine_logp, mask, c, rejection,
                                         obj.is_batch_mean if obj.rollout_is_batch_norm else None)
    token_scale = is_weight if token_scale is None else token_scale * is_weight
    return Weights(token_scale, is_weight, rho, hit)


@torch.no_grad()
def token_metrics(obj: Objective, loss: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor,
                  mask: torch.Tensor, entropy: torch.Tensor, kl: Optional[torch.Tensor],
                  ref_logp: Optional[torch.Tensor], w: Weights) -> dict[str, torch.Tensor]:
    """The metric sums every policy loss reports, over the micro-batch's valid tokens (the trainer divides
    by the summed `tokens` and `seqs`, see `mini_batch_metrics`): loss, entropy, KL (the loss's, else k3 to the
    reference when there is one), importance ratio sum/min/max, the rollout correction's mean weight, the
    share of tokens and of sequences where its bound acted (truncated or masked) and its ratio's mean/min/max,
    whether a ratio is extreme (algo.early_stop_imp_ratio), and verl's ppo_kl sum (of log pi_old - log pi). The
    loss-specific sums (pg_loss_sum, clipped_sum, and clipped_lower_sum, 0 here: where a dual clip acted) are the
    entry's own. Keys: METRIC_SUMS, METRIC_MINS, METRIC_MAXS."""
    m = mask.to(torch.float32)
    valid = mask.bool()
    ratio = log_ratio(logp, old_logp).exp()
    if kl is not None:
        kl_sum = (kl * m).sum()
    elif ref_logp is not None:
        kl_sum = (kl_penalty(logp, ref_logp, "k3") * m).sum()
    else:
        kl_sum = torch.zeros(())
    rho = w.is_ratio if w.is_ratio is not None else torch.ones_like(ratio)
    hit = w.is_hit & valid if w.is_hit is not None else torch.zeros_like(valid)
    return {
        "loss": loss.detach(),
        "entropy_sum": (entropy * m).sum(),
        "kl_sum": kl_sum,
        "tokens": m.sum(),
        "seqs": valid.any(dim=-1).sum().to(m.dtype),
        "ratio_sum": (ratio * m).sum(),
        "ratio_min": ratio[valid].min() if valid.any() else torch.tensor(math.inf),
        "ratio_max": ratio[valid].max() if valid.any() else torch.tensor(-math.inf),
        "is_weight_sum": (w.is_weight * m).sum() if w.is_weight is not None else m.sum(),
        "is_capped_sum": (hit * m).sum(),
        "is_seq_capped_sum": hit.any(dim=-1).sum().to(m.dtype),
        "is_ratio_sum": (rho * m).sum(),
        "is_ratio_min": rho[valid].min() if valid.any() else torch.tensor(math.inf),
        "is_ratio_max": rho[valid].max() if valid.any() else torch.tensor(-math.inf),
        "ppo_kl_sum": ((old_logp.detach() - logp.detach()) * m).sum(),
        "clipped_lower_sum": torch.zeros(()),
        "extreme": has_extreme_ratio(logp, old_logp, mask, obj.early_stop_imp_ratio).float()
        if obj.early_stop_imp_ratio else torch.zeros(()),
    }


METRIC_SUMS = ("loss", "pg_loss_sum", "entropy_sum", "kl_sum", "clipped_sum", "tokens", "seqs", "ratio_sum",
               "extreme", "is_weight_sum", "is_capped_sum", "is_seq_capped_sum", "is_ratio_sum", "ppo_kl_sum",
               "clipped_lower_sum")
"""The metric sums every policy loss returns, added over micro-batches and DP ranks."""
METRIC_MINS = ("ratio_min", "is_ratio_min")
METRIC_MAXS = ("ratio_max", "is_ratio_max")


def mini_batch_metrics(sums: dict[str, float], mins: dict[str, float], maxs: dict[str, float]) -> dict[str, float]:
    """A mini-batch's loss metrics from its sums (over micro-batches and ranks), minima and maxima: per-token
    means, the rollout correction's token and sequence shares (is_capped_fraction, is_seq_capped_fraction;
    truncated or masked), and verl's ppo_kl (mean of log pi_old - log pi) and pg_clipfrac_lower (the share of
    tokens whose loss the dual clip bounded: A < 0 and ratio > c)."""
    tokens, seqs = max(sums["tokens"], 1.0), max(sums["seqs"], 1.0)
    return {
        "loss": sums["loss"],
        "pg_loss": sums["pg_loss_sum"] / tokens,
        "entropy": sums["entropy_sum"] / tokens,
        "kl": sums["kl_sum"] / tokens,
        "clip_fraction": sums["clipped_sum"] / tokens,
        "pg_clipfrac_lower": sums["clipped_lower_sum"] / tokens,
        "ppo_kl": sums["ppo_kl_sum"] / tokens,
        "ratio_mean": sums["ratio_sum"] / tokens,
        "is_weight_mean": sums["is_weight_sum"] / tokens,
        "is_capped_fraction": sums["is_capped_sum"] / tokens,
        "is_seq_capped_fraction": sums["is_seq_capped_sum"] / seqs,
        "is_ratio_mean": sums["is_ratio_sum"] / tokens,
        "ratio_min": mins["ratio_min"],
        "ratio_max": maxs["ratio_max"],
        "is_ratio_min": mins["is_ratio_min"],
        "is_ratio_max": maxs["is_ratio_max"],
        "tokens": sums["tokens"],
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
    w = token_weights(obj, mask, old_logp, engine_logp)
    token_loss, terms = grpo_token_loss(
        logp, old_logp, advantages, obj.clip_ratio_low, obj.clip_ratio_high, obj.dual_clip,
        kl=kl, kl_coef=obj.kl_coef if obj.kl_in_loss else 0.0,
        entropy=entropy if obj.entropy_coef else None, entropy_coef=obj.entropy_coef,
        token_scale=w.token_scale,
    )
    loss = aggregate(token_loss, mask, obj.loss_agg_mode, normaliser)
    stats = token_metrics(obj, loss, logp, old_logp, mask, entropy, kl, ref_logp, w)
    m = mask.to(torch.float32)
    with torch.no_grad():
        stats["pg_loss_sum"] = (terms["pg_loss"] * m).sum()
        stats["clipped_sum"] = (terms["clipped"] * m).sum()
        lower = dual_clip_hit(log_ratio(logp, old_logp).exp(), advantages, obj.dual_clip)
        stats["clipped_lower_sum"] = (lower * m).sum()
    return loss, stats


# ---- GSPO and CISPO ---------------------------------------------------------------------------------------

SEQUENCE_LEVEL_AGG = ("seq-mean-token-mean",)
"""The aggregation GSPO defines: the mean over responses of one term per response (for gspo_token, of the
mean over its tokens). The token-level and length-weighted modes would weight each response by its length."""
AGG_MODES_OF = {"gspo": SEQUENCE_LEVEL_AGG, "gspo_token": SEQUENCE_LEVEL_AGG, "geo_mean": SEQUENCE_LEVEL_AGG,
                "sapo": SEQUENCE_LEVEL_AGG}
"""The aggregation modes a policy loss is defined with, where it does not take them all."""
_DEFINED_IN = {"gspo": "Zheng et al. 2025, eq. 5", "gspo_token": "Zheng et al. 2025, eq. 13",
               "geo_mean": "GMPO, Zhao et al. 2025", "sapo": "SAPO, Gao et al. 2025"}


DUAL_CLIP_LOSSES = ("ppo_clip", "gspo", "gspo_token")
"""The losses that define the dual clip: min(L, -c A) for A < 0 on PPO's token surrogate, or on GSPO's
sequence surrogate (where the sequence ratio s_i takes the token ratio's place)."""


def check_settings(policy_loss: str, loss_agg_mode: str, dual_clip: Optional[float] = None) -> None:
    """Refuse a policy loss with settings it does not define: GSPO with a token-level aggregation, and the
    dual clip with a loss outside DUAL_CLIP_LOSSES. One-line ValueErrors."""
    modes = AGG_MODES_OF.get(policy_loss)
    if modes is not None and loss_agg_mode not in modes:
        raise ValueError(f"algo.policy_loss={policy_loss!r} needs algo.loss_agg_mode={' or '.join(modes)} "
                         f"(got {loss_agg_mode!r}): its objective is the mean over responses of one term each "
                         f"({_DEFINED_IN[policy_loss]}); {loss_agg_mode} would weight responses by length")
    if dual_clip is not None and policy_loss not in DUAL_CLIP_LOSSES:
        raise ValueError(f"algo.dual_clip={dual_clip} bounds a clipped ratio surrogate for negative advantages "
                         f"({', '.join(DUAL_CLIP_LOSSES)}); algo.policy_loss={policy_loss!r} does not define it: "
                         f"set algo.dual_clip=null")


def _with_terms(obj: Objective, pg: torch.Tensor, kl: Optional[torch.Tensor], entropy: torch.Tensor,
                token_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """pg_t + beta KL_t - c_H H_t (the terms the objective has), times the token weights. [B, T]."""
    loss = pg
    if kl is not None:
        loss = loss + obj.kl_coef * kl
    if obj.entropy_coef:
        loss = loss + entropy_bonus(entropy, obj.entropy_coef)
    return loss if token_scale is None else loss * token_scale


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t log(pi(y_t) / pi_old(y_t)) over response i's valid tokens, the token log-ratios
    not clamped (as verl: a clamp per token would cut the gradient of the tokens beyond it, which gspo_token's
    per-token form keeps); 0 for a response without valid tokens. [B, T] -> [B], with grad. The callers cap the
    mean (Objective.seq_log_ratio_cap) before any exp."""
    m = mask.to(logp.dtype)
    return ((logp - old_logp) * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)


def _sequence_clip(s: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                   dual_clip: Optional[float] = None):
    """-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A), and with dual_clip=c, min(that, -c A) where A < 0;
    returns (loss, where the clipped branch was taken)."""
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    return loss, clipped > unclipped


def dual_clip_hit(ratio: torch.Tensor, advantages: torch.Tensor, dual_clip: Optional[float]) -> torch.Tensor:
    """Where the dual clip bounded the loss (verl's pg_clipfrac_lower): A < 0 and the ratio above c (for A < 0,
    max(-A r, -A clip(r)) = |A| max(r, 1 - eps_low) exceeds -c A iff r > c, as c > 1). All False without a dual
    clip. ratio: [B, T] or [B]; advantages: [B] or [B, T]; broadcast to [B, T] (float, no gradient)."""
    r = ratio.detach()
    if r.dim() == 1:
        r = r.unsqueeze(-1)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    if dual_clip is None:
        return torch.zeros(torch.broadcast_shapes(r.shape, adv.shape), dtype=torch.float32)
    return ((adv < 0) & (r > dual_clip)).to(torch.float32)


def _finish(obj, token_loss, pg, clipped, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w,
            lower: Optional[torch.Tensor] = None):
    loss = aggregate(token_loss, mask, obj.loss_agg_mode, normaliser)
    stats = token_metrics(obj, loss, logp, old_logp, mask, entropy, kl, ref_logp, w)
    m = mask.to(torch.float32)
    with torch.no_grad():
        stats["pg_loss_sum"] = (pg.detach() * m).sum()
        stats["clipped_sum"] = (clipped.to(m.dtype) * m).sum()
        if lower is not None:
            stats["clipped_lower_sum"] = (lower.expand_as(m) * m).sum()
    return loss, stats


@POLICY_LOSSES.register("gspo")
def gspo(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
         ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
         engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7): the clip acts on the response's
    length-normalised sequence ratio

        s_i = exp(min((1/|y_i|) sum_t log(pi(y_i,t) / pi_old(y_i,t)), cap)),
        J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),

    eps = (gspo_clip_low, gspo_clip_high), the paper's 3e-4 / 4e-4; cap = seq_log_ratio_cap (verl's 10: without it
    a negative advantage's loss -A s_i grows as e^(log s_i), unbounded; above the cap s_i has no gradient). With
    dual_clip = c the loss of A_i < 0 is further bounded by -c A_i (PPO's dual clip on the sequence ratio). The
    loss is -J, with the same KL and entropy
    terms and token weights (rollout correction, DAPO scale) as ppo_clip, per token; aggregated by
    seq-mean-token-mean only (one term per response: a response's -min(...) sits on each of its tokens, and the
    mean over its tokens gives it back, value and gradient). Arguments and return as `ppo_clip`; advantages [B].
    """
    check_settings("gspo", obj.loss_agg_mode)
    if advantages.dim() != 1:
        raise ValueError(f"gspo takes one advantage per response ([B]); got shape {tuple(advantages.shape)}: "
                         f"use gspo_token for per-token advantages")
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    s = sequence_log_ratio(logp, old_logp, mask).clamp(max=obj.seq_log_ratio_cap).exp()
    pg_seq, clipped_seq = _sequence_clip(s, advantages, obj.gspo_clip_low, obj.gspo_clip_high, obj.dual_clip)
    pg = pg_seq.unsqueeze(-1).expand_as(logp)
    clipped = clipped_seq.unsqueeze(-1).expand_as(logp)
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    return _finish(obj, token_loss, pg, clipped, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w,
                   dual_clip_hit(s, advantages, obj.dual_clip))


@POLICY_LOSSES.register("gspo_token")
def gspo_token(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
               ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
               engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025, eq. 13-14): per-token ratios that carry the sequence ratio's value and
    each token's own gradient,

        s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)],
        J = (1/G) sum_i (1/|y_i|) sum_t min(s_i,t A_i,t, clip(s_i,t, 1 - eps_low, 1 + eps_high) A_i,t),

    which allows per-token advantages ([B] or [B, T]); log s_i,t is capped at seq_log_ratio_cap as gspo's log s_i
    (verl's clamp(max=10)), and dual_clip acts as in gspo, so with A_i,t = A_i it equals `gspo` in value and
    gradient, at any log-ratio.
    Aggregated by seq-mean-token-mean only (the (1/G)(1/|y_i|) above). Arguments and return as `ppo_clip`."""
    check_settings("gspo_token", obj.loss_agg_mode)
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    log_s = sequence_log_ratio(logp, old_logp, mask).detach().unsqueeze(-1)
    s_t = (log_s + logp - logp.detach()).clamp(max=obj.seq_log_ratio_cap).exp()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    pg, clipped = _sequence_clip(s_t, adv, obj.gspo_clip_low, obj.gspo_clip_high, obj.dual_clip)
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    return _finish(obj, token_loss, pg, clipped, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w,
                   dual_clip_hit(s_t, adv, obj.dual_clip))


@POLICY_LOSSES.register("cispo")
def cispo(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
          mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
          ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
          engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4-5): clip the importance-sampling weight, not the update, and
    keep every token's gradient,

        r_t = pi(y_t) / pi_old(y_t),   r^_t = clip(r_t, 1 - eps_low, 1 + eps_high),
        L_t = -sg(r^_t) A_t log pi(y_t),

    eps = (cispo_eps_low, cispo_eps_high); the paper sets no lower bound (eps_low = 1). Its gradient is
    -r^_t A_t grad log pi(y_t) on every token (where PPO's clip would zero it). Plus the KL and entropy terms and
    token weights of ppo_clip, aggregated by `loss_agg_mode` (the paper's is token-mean). clipped_sum counts
    tokens whose r_t was clipped. Arguments and return as `ppo_clip`."""
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    r = log_ratio(logp, old_logp).detach().exp()
    lo, hi = 1.0 - obj.cispo_eps_low, 1.0 + obj.cispo_eps_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    pg = -r.clamp(lo, hi) * adv * logp
    clipped = (r < lo) | (r > hi)
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    return _finish(obj, token_loss, pg, clipped, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w)


# ---- GMPO, SAPO, GPG, Clip-Cov, KL-Cov ---------------------------------------------------------------------


def _token_adv(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


@POLICY_LOSSES.register("geo_mean")
def geo_mean(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
             ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
             engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): the geometric mean of the token
    ratios, each clipped in log space, in place of their arithmetic mean,

        l_t = log(pi(y_t) / pi_old(y_t)),   l~_t = sgn(A_i) min(sgn(A_i) l_t, sgn(A_i) clip(l_t, -eps_low, eps_high)),
        J = (1/G) sum_i A_i exp(min((1/|y_i|) sum_t l~_t, cap)),

    eps = (gmpo_clip_low, gmpo_clip_high), the paper's 0.4 each; cap = seq_log_ratio_cap (as GSPO: a negative
    advantage with a large positive l_t would otherwise grow as e^l). The loss is -J, with the KL and entropy terms
    and token weights of ppo_clip per token; seq-mean-token-mean only (a response's term sits on each of its tokens).
    advantages: [B]. clipped_sum counts tokens whose clipped log-ratio was taken. Arguments and return as
    `ppo_clip`."""
    check_settings("geo_mean", obj.loss_agg_mode)
    if advantages.dim() != 1:
        raise ValueError(f"geo_mean takes one advantage per response ([B]); got shape {tuple(advantages.shape)}")
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    lr = logp - old_logp
    sgn = torch.sign(advantages).unsqueeze(-1)
    lr_clip = lr.clamp(-obj.gmpo_clip_low, obj.gmpo_clip_high)
    lr_min = sgn * torch.minimum(sgn * lr, sgn * lr_clip)
    m = mask.to(logp.dtype)
    log_s = (lr_min * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    pg_seq = -advantages * log_s.clamp(max=obj.seq_log_ratio_cap).exp()
    pg = pg_seq.unsqueeze(-1).expand_as(logp)
    clipped = (sgn * lr_clip < sgn * lr).detach()
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    return _finish(obj, token_loss, pg, clipped, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w)


@POLICY_LOSSES.register("sapo")
def sapo(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
         ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
         engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a smooth, temperature-controlled gate
    on the token ratio in place of the hard clip,

        f(r, tau) = (4 / tau) sigmoid(tau (r - 1)),   tau = sapo_tau_pos if A > 0 else sapo_tau_neg,
        J = (1/G) sum_i (1/|y_i|) sum_t f(r_i,t, tau) A_i,t,

    r = exp(log-ratio clamped to +-20). Its gradient is sigmoid'-shaped in r, 1 * A grad log pi at r = 1 (as PPO's
    on-policy gradient), decaying smoothly away from it. The loss is -J plus ppo_clip's KL and entropy terms and
    token weights; seq-mean-token-mean only. advantages [B] or [B, T]. clipped_sum is 0 (nothing is clipped).
    Arguments and return as `ppo_clip`."""
    check_settings("sapo", obj.loss_agg_mode)
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    adv = _token_adv(advantages)
    r = log_ratio(logp, old_logp).exp()
    tau = torch.where(adv > 0, obj.sapo_tau_pos, obj.sapo_tau_neg).to(r.dtype)
    pg = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    return _finish(obj, token_loss, pg, clipped, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w)


@POLICY_LOSSES.register("gpg")
def gpg(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
        ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
        engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (Chu et al. 2025, "GPG: A Minimalist Policy Optimization Framework"): plain policy
    gradient, no ratio and no clip,

        L_t = -A_t log pi(y_t),

    plus ppo_clip's KL and entropy terms and token weights, aggregated by `loss_agg_mode` (the paper's is
    token-mean). Its gradient is -A_t grad log pi(y_t) at any pi_old. advantages [B] or [B, T]. clipped_sum is 0.
    Arguments and return as `ppo_clip`."""
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    pg = -_token_adv(advantages) * logp
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    return _finish(obj, token_loss, pg, clipped, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w)


def token_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cov_t = (A_t - mean(A)) (log pi_t - mean(log pi)), the means over the micro-batch's valid tokens (Cui et al.
    2025, per token; verl's micro-batch means). logp: [B, T] (detached here); adv: [B, 1] or [B, T].
    Returns [B, T], no gradient; -inf on masked tokens."""
    valid = mask.bool()
    a = adv.detach().expand_as(logp)
    lp = logp.detach()
    if not valid.any():
        return torch.full_like(lp, -math.inf)
    cov = (a - a[valid].mean()) * (lp - lp[valid].mean())
    return cov.masked_fill(~valid, -math.inf)


def _selection_generator(old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Generator:
    """A CPU generator seeded by the micro-batch's old logprobs: every TP/PP rank that holds the micro-batch draws
    the same tokens, and a rerun of the step draws them again."""
    key = float((old_logp.detach().double() * mask.double()).sum()) * 1e6
    return torch.Generator().manual_seed(int(abs(key)) % (2 ** 62) + int(mask.sum()))


@POLICY_LOSSES.register("clip_cov")
def clip_cov(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
             ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
             engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models"): ppo_clip's surrogate (clip_ratio_low/high, dual_clip not defined), with the gradient cut on a few
    tokens of high covariance between advantage and log-probability (the tokens that drive entropy collapse):
    among the valid tokens that PPO's clip did not clip and whose Cov_t (`token_covariance`) lies in
    (clip_cov_lb, clip_cov_ub), max(1, floor(clip_cov_ratio * valid tokens)) are drawn at random and their
    policy-gradient term is dropped (loss and gradient 0; their KL and entropy terms stay). The draw is
    seeded by the micro-batch (`_selection_generator`). clipped_sum counts PPO-clipped plus dropped tokens.
    Arguments and return as `ppo_clip`; aggregated by `loss_agg_mode`."""
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    adv = _token_adv(advantages)
    pg, ppo_clipped = clipped_surrogate(logp, old_logp, advantages, obj.clip_ratio_low, obj.clip_ratio_high)
    valid = mask.bool()
    cov = token_covariance(logp, adv, mask)
    cand = valid & ~ppo_clipped & (cov > obj.clip_cov_lb) & (cov < obj.clip_cov_ub)
    idx = torch.nonzero(cand.reshape(-1)).squeeze(-1)
    k = min(max(int(obj.clip_cov_ratio * int(valid.sum())), 1), idx.numel())
    drop = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if k:
        pick = torch.randperm(idx.numel(), generator=_selection_generator(old_logp, mask))[:k]
        drop[idx[pick.to(idx.device)]] = True
    drop = drop.view_as(valid)
    pg = torch.where(drop, torch.zeros_like(pg), pg)
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    return _finish(obj, token_loss, pg, ppo_clipped | drop, logp, old_logp, mask, normaliser, entropy, kl,
                   ref_logp, w)


@POLICY_LOSSES.register("kl_cov")
def kl_cov(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
           mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
           ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
           engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025): the unclipped surrogate -A_t r_t on every token, plus a KL penalty
    kl_cov_coef * |log r_t| on the max(1, floor(kl_cov_ratio * valid tokens)) valid tokens of largest Cov_t
    (`token_covariance`),

        L_t = -A_t r_t + kl_cov_coef * |log r_t| * 1[t in top-k Cov],

    r_t = exp(log-ratio clamped to +-20). Plus ppo_clip's KL and entropy terms and token weights, aggregated by
    `loss_agg_mode`. clipped_sum counts the penalised tokens. Arguments and return as `ppo_clip`."""
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    adv = _token_adv(advantages)
    valid = mask.bool()
    lr = logp - old_logp
    pg = -adv * log_ratio(logp, old_logp).exp()
    cov = token_covariance(logp, adv, mask).reshape(-1)
    k = min(max(int(obj.kl_cov_ratio * int(valid.sum())), 1), int(valid.sum()))
    top = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if k:
        top[torch.topk(cov, k).indices] = True
    top = top.view_as(valid)
    pg = torch.where(top, pg + obj.kl_cov_coef * lr.abs(), pg)
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    return _finish(obj, token_loss, pg, top, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w)


# ---- DPPO ---------------------------------------------------------------------------------------------------


def _dppo(obj: Objective, keep: torch.Tensor, *, logp, old_logp, advantages, mask, normaliser, entropy, ref_logp,
          full_kl, engine_logp):
    """L_t = -A_t sg(min(r_t, dppo_is_cap)) log pi(y_t) * keep_t (keep: no gradient), with ppo_clip's KL and entropy
    terms and token weights; clipped_sum counts the dropped tokens."""
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    adv = _token_adv(advantages)
    r = log_ratio(logp, old_logp).detach().exp()
    pg = -adv * r.clamp(max=obj.dppo_is_cap) * logp * keep.to(logp.dtype)
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    return _finish(obj, token_loss, pg, ~keep, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w)


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
            ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
            engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning"): the trust region
    is a bound on the sampled token's probability change (the total variation of the binary distribution
    {y_t, not y_t}), not on the ratio; a token outside it leaves the update,

        keep_t = (p_t - p_old,t <= high) if A_t > 0 else (p_t - p_old,t >= -low),   p = exp(log pi),
        L_t = -A_t sg(min(r_t, dppo_is_cap)) log pi(y_t) keep_t,

    (low, high) = (dppo_div_low, dppo_div_high); r_t = exp(log-ratio clamped to +-20). Aggregated by
    `loss_agg_mode`. Arguments and return as `ppo_clip`."""
    p, p_old = logp.detach().exp(), old_logp.exp()
    keep = torch.where(_token_adv(advantages) > 0, p - p_old <= obj.dppo_div_high, p - p_old >= -obj.dppo_div_low)
    return _dppo(obj, keep, logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, normaliser=normaliser,
                 entropy=entropy, ref_logp=ref_logp, full_kl=full_kl, engine_logp=engine_logp)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
            ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
            engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (Qi et al. 2026): as `dppo_tv` with the binary KL as the divergence,

        D_t = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)),
        keep_t = (D_t <= high or p_t <= p_old,t) if A_t > 0 else (D_t <= low or p_t >= p_old,t)

    (a token moving against its advantage's push is always kept); L_t as dppo_tv. Arguments and return as
    `ppo_clip`."""
    lp, lp_old = logp.detach(), old_logp
    p, p_old = lp.exp(), lp_old.exp()
    d = p_old * (lp_old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    keep = torch.where(_token_adv(advantages) > 0, (d <= obj.dppo_div_high) | (p <= p_old),
                       (d <= obj.dppo_div_low) | (p >= p_old))
    return _dppo(obj, keep, logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, normaliser=normaliser,
                 entropy=entropy, ref_logp=ref_logp, full_kl=full_kl, engine_logp=engine_logp)


# ---- DRO and verl's bypass mode -----------------------------------------------------------------------------

@POLICY_LOSSES.register("dro")
def dro(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
        ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
        engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO (verl's `dro`, Tinker's DRO loss): the policy gradient with a quadratic penalty on the log-ratio instead
    of a clip,

        L_t = -(A_t log pi(y_t) - (beta / 2) (log pi(y_t) - log pi_old(y_t))^2),   beta = dro_beta,

    the log-ratio not clamped; plus ppo_clip's KL and entropy terms and token weights, aggregated by
    `loss_agg_mode`. advantages [B] or [B, T]. clipped_sum is 0. Arguments and return as `ppo_clip`."""
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, old_logp, engine_logp)
    d = logp - old_logp
    pg = -(_token_adv(advantages) * logp - 0.5 * obj.dro_beta * d * d)
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    return _finish(obj, token_loss, pg, clipped, logp, old_logp, mask, normaliser, entropy, kl, ref_logp, w)


BYPASS_LOSSES = ("bypass_ppo_clip", "bypass_reinforce")
"""verl's bypass_mode (loss_type ppo_clip / reinforce): the engine's logprobs stand in for the old ones."""


def _bypass_engine_logp(name: str, obj: Objective, engine_logp: Optional[torch.Tensor]) -> torch.Tensor:
    if engine_logp is None:
        raise ValueError(f"algo.policy_loss={name!r} takes the rollout engine's logprobs as the old policy: it needs "
                         f"them (rollout.engine_logp)")
    if obj.rollout_is_batch_norm:
        raise ValueError(f"algo.policy_loss={name!r} with algo.rollout_is_batch_norm=true: the batch mean is of "
                         f"p_old / p_engine, which bypass mode does not use; set rollout_is_batch_norm=false")
    return engine_logp


@POLICY_LOSSES.register("bypass_ppo_clip")
def bypass_ppo_clip(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
                    ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
                    engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's bypass mode with loss_type ppo_clip: `ppo_clip` with the engine's logprobs as the old policy (two
    policies, not three: r_t = pi / pi_engine, its clip the only importance correction, so no correction weight;
    algo.rollout_correction is refused), the rollout rejection judged on pi / pi_engine (the current policy,
    detached). The trainer's old_logp is not read. Metrics' ratio and ppo_kl are against the engine. Arguments and
    return as `ppo_clip`; engine_logp required."""
    eng = _bypass_engine_logp("bypass_ppo_clip", obj, engine_logp)
    if obj.correction is not None:
        raise ValueError("algo.policy_loss='bypass_ppo_clip' clips r = p / p_engine, its own importance correction: "
                         "unset algo.rollout_correction and algo.engine_is_cap (algo.rollout_rejection applies)")
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, logp.detach(), eng)
    token_loss, terms = grpo_token_loss(
        logp, eng, advantages, obj.clip_ratio_low, obj.clip_ratio_high, obj.dual_clip,
        kl=kl, kl_coef=obj.kl_coef if obj.kl_in_loss else 0.0,
        entropy=entropy if obj.entropy_coef else None, entropy_coef=obj.entropy_coef, token_scale=w.token_scale)
    return _finish(obj, token_loss, terms["pg_loss"], terms["clipped"].bool(), logp, eng, mask, normaliser, entropy,
                   kl, ref_logp, w, dual_clip_hit(log_ratio(logp, eng).exp(), advantages, obj.dual_clip))


@POLICY_LOSSES.register("bypass_reinforce")
def bypass_reinforce(obj: Objective, *, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
                     ref_logp: Optional[torch.Tensor] = None, full_kl: Optional[torch.Tensor] = None,
                     engine_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's bypass mode with loss_type reinforce: the policy gradient with an explicit importance weight against
    the engine,

        L_t = -A_t w_t log pi(y_t),   w_t = the rollout correction's weight of sg[pi] / pi_engine

    (algo.rollout_correction's level, mode and bounds, times the rollout rejection's keep mask; w = 1 with neither:
    plain REINFORCE, as `gpg`), no clip; plus ppo_clip's KL and entropy terms. The trainer's old_logp is not read;
    metrics' ratio and ppo_kl are against the engine. Arguments and return as `ppo_clip`; engine_logp required."""
    eng = _bypass_engine_logp("bypass_reinforce", obj, engine_logp)
    kl = kl_term(obj, logp, ref_logp, full_kl)
    w = token_weights(obj, mask, logp.detach(), eng)
    pg = -_token_adv(advantages) * logp
    token_loss = _with_terms(obj, pg, kl, entropy, w.token_scale)
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    return _finish(obj, token_loss, pg, clipped, logp, eng, mask, normaliser, entropy, kl, ref_logp, w)
