"""Rollout correction: importance weights between the trainer's old logprobs and the rollout engine's.

The engine samples from pi_engine, which drifts from the trainer's pi_old (other kernels, precision, a
weight version behind with off-policy steps). Each token's loss is weighted by a function of the ratio
rho = pi_old / pi_engine, taken at one of three levels and bounded in one of two modes:

    level token:      rho_t = pi_old(y_t) / pi_engine(y_t)
    level sequence:   rho_i = prod_t rho_t = exp(sum_t log rho_t)            (one per response, on its tokens)
    level geometric:  rho_i = exp(mean_t log rho_t)                          (the per-token geometric mean)
    mode truncate:    w = clip(rho, low, high)       (TIS, Yao et al. 2025, "Your Efficient RL Framework
                                                      Secretly Brings You Off-Policy RL Training": low = 0)
    mode mask:        w = rho * 1[low <= rho <= high] (masked IS / rejection: Liu, Li et al. 2025, "When Speed
                                                      Kills Stability"; IcePop, Ling Team 2025 "Every Step
                                                      Evolves" (Ring-1T): token level, [0.5, 5])

The weight carries no gradient, and a weight of 0 keeps the token in the normaliser (IcePop's 1/sum|y_i|).
Pure tensor math: the settings are plain values, resolved from `algo.rollout_correction*` by `resolve`.
Shapes: B responses, T response positions; the trainer's rows are whole responses (a sequence is never
split across rows, ranks or pipeline stages when it reaches the loss), so the sequence sums are exact.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from grpo_mega.algo.kl import LOG_RATIO_CLAMP

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
PRESETS = {"icepop": ("token", "mask", 0.5, 5.0)}
"""Named presets: (level, mode, low, high). IcePop masks tokens whose ratio leaves [0.5, 5]."""
DEFAULT_HIGH = 2.0
"""The upper bound when none is given (verl's TIS default, as algo.engine_is_cap's off-policy default)."""


class Correction(NamedTuple):
    level: str
    mode: str
    low: float
    high: float


def resolve(name: Optional[str], mode: Optional[str] = None, low: Optional[float] = None,
            high: Optional[float] = None, engine_is_cap: Optional[float] = None) -> Optional[Correction]:
    """The correction from `algo.rollout_correction` (a level or a preset; null: off), its mode and bounds
    (null: the level's defaults: truncate, low 0 when truncating and 1/high when masking, high 2; a preset's
    own), and `algo.engine_is_cap` (an alias of token-level truncation at [0, cap]). None when off.
    Raises a ValueError naming the field for a bad value."""
    if engine_is_cap is not None:
        if name is not None:
            raise ValueError(f"algo.engine_is_cap={engine_is_cap} and algo.rollout_correction={name!r} both set a "
                             f"rollout correction; engine_is_cap=C is rollout_correction=token with "
                             f"rollout_correction_high=C: keep one")
        return Correction("token", "truncate", 0.0, float(engine_is_cap))
    if name is None:
        for field, value in (("mode", mode), ("low", low), ("high", high)):
            if value is not None:
                raise ValueError(f"algo.rollout_correction_{field}={value!r} without algo.rollout_correction: "
                                 f"set algo.rollout_correction to one of {', '.join(LEVELS + tuple(PRESETS))}")
        return None
    if name in PRESETS:
        level, preset_mode, preset_low, preset_high = PRESETS[name]
        if mode is not None and mode != preset_mode:
            raise ValueError(f"algo.rollout_correction={name!r} is {level}-level {preset_mode}; "
                             f"algo.rollout_correction_mode={mode!r} contradicts it (leave it unset)")
        mode = preset_mode
        low = preset_low if low is None else low
        high = preset_high if high is None else high
    elif name in LEVELS:
        level = name
        mode = mode or "truncate"
    else:
        raise ValueError(f"algo.rollout_correction={name!r} must be one of {', '.join(LEVELS + tuple(PRESETS))} "
                         f"(or null: off)")
    if mode not in MODES:
        raise ValueError(f"algo.rollout_correction_mode={mode!r} must be 'truncate' or 'mask'")
    high = DEFAULT_HIGH if high is None else float(high)
    low = (0.0 if mode == "truncate" else 1.0 / high) if low is None else float(low)
    if not 0.0 <= low < high:
        raise ValueError(f"algo.rollout_correction_low={low} and algo.rollout_correction_high={high} must satisfy "
                         f"0 <= low < high")
    return Correction(level, mode, low, high)


def correction_ratio(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """rho at `level`, on every position of its response (no gradient). All [B, T] -> [B, T].

    Log-ratios are clamped to [-20, 20] per token, and a sequence's sum or mean again before the exp."""
    lr = (old_logp - engine_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if level == "token":
        return lr.exp()
    m = mask.to(lr.dtype)
    s = (lr * m).sum(dim=-1, keepdim=True)
    if level == "geometric":
        s = s / m.sum(dim=-1, keepdim=True).clamp(min=1.0)
    elif level != "sequence":
        raise ValueError(f"rollout correction level {level!r} must be one of {', '.join(LEVELS)}")
    return s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().expand_as(lr)


def correction_weight(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                      c: Correction) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, rho, hit), each [B, T]: the per-token loss weight of correction `c` (no gradient), the ratio
    it was computed from, and where the bound acted (rho outside [low, high]: truncated or masked)."""
    rho = correction_ratio(old_logp, engine_logp, mask, c.level)
    hit = (rho < c.low) | (rho > c.high)
    if c.mode == "truncate":
        weight = rho.clamp(min=c.low, max=c.high)
    elif c.mode == "mask":
        weight = torch.where(hit, torch.zeros_like(rho), rho)
    else:
        raise ValueError(f"rollout correction mode {c.mode!r} must be 'truncate' or 'mask'")
    return weight, rho, hit


# ---- rejection on a divergence statistic, and the weights' batch normalisation --------------------------

REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
REJECTIONS = tuple(f"{lv}_{k}" for lv in REJECTION_LEVELS for k in ("k2", "k3"))
"""algo.rollout_rejection's values, verl's rollout_rs names: a divergence statistic of lr_t = log rho_t (clamped to
+-20) per token, k2 = lr^2 / 2 or k3 = e^lr - 1 - lr, taken per token or as its sum, mean or max over the response's
valid tokens; a token (a whole response at the seq_* levels) is rejected when it exceeds the threshold. The k1
rejections are the correction's mask mode (rollout_correction=token / sequence / geometric, mode mask)."""


class Rejection(NamedTuple):
    level: str
    stat: str
    threshold: float


def resolve_rejection(name: Optional[str], threshold: Optional[float]) -> Optional[Rejection]:
    """The rejection of `algo.rollout_rejection` (one of REJECTIONS; null: off) at `algo.rollout_rejection_threshold`
    (> 0, required with it). None when off. Raises a ValueError naming the field for a bad value."""
    if name is None:
        if threshold is not None:
            raise ValueError(f"algo.rollout_rejection_threshold={threshold} without algo.rollout_rejection: set "
                             f"algo.rollout_rejection to one of {', '.join(REJECTIONS)}")
        return None
    if name not in REJECTIONS:
        raise ValueError(f"algo.rollout_rejection={name!r} must be one of {', '.join(REJECTIONS)} (or null: off; the "
                         f"k1 rejections are algo.rollout_correction_mode=mask)")
    if threshold is None or not float(threshold) > 0:
        raise ValueError(f"algo.rollout_rejection={name!r} needs algo.rollout_rejection_threshold > 0 (the largest "
                         f"kept value of its statistic), got {threshold!r}")
    level, stat = name.rsplit("_", 1)
    return Rejection(level, stat, float(threshold))


def rejection_statistic(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                        r: Rejection) -> torch.Tensor:
    """The statistic `r` thresholds, on every position of its response (a response's at the seq_* levels; 0 for a
    response without valid tokens). All [B, T] -> [B, T] float64 (k3 = e^lr - 1 - lr of a log-ratio near 1e-7 is
    all rounding in float32), no gradient."""
    lr = (old_logp.detach().double() - engine_logp.detach().double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if r.stat == "k2":
        d = 0.5 * lr * lr
    elif r.stat == "k3":
        d = lr.exp() - 1.0 - lr
    else:
        raise ValueError(f"rollout rejection statistic {r.stat!r} must be k2 or k3")
    if r.level == "token":
        return d
    m = mask.to(d.dtype)
    if r.level == "seq_sum":
        s = (d * m).sum(dim=-1)
    elif r.level == "seq_mean":
        s = (d * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    elif r.level == "seq_max":
        s = d.masked_fill(~mask.bool(), -math.inf).max(dim=-1).values
        s = torch.where(torch.isinf(s), torch.zeros_like(s), s)
    else:
        raise ValueError(f"rollout rejection level {r.level!r} must be one of {', '.join(REJECTION_LEVELS)}")
    return s.unsqueeze(-1).expand_as(d)


def rollout_weight(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, c: Optional[Correction],
                   rejection: Optional[Rejection] = None,
                   batch_mean: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, rho, hit), each [B, T]: the correction's weight (1 without one), divided by `batch_mean` (its mean
    over the batch, `batch_mean_sums`; IS batch normalisation), times the rejection's keep mask (0 where the
    statistic exceeds the threshold); rho at the correction's level (token level without one); hit where the
    correction's bound acted or the rejection rejected. Neither carries a gradient."""
    if c is not None:
        weight, rho, hit = correction_weight(old_logp, engine_logp, mask, c)
    else:
        rho = correction_ratio(old_logp, engine_logp, mask, "token")
        weight, hit = torch.ones_like(rho), torch.zeros_like(rho, dtype=torch.bool)
    if batch_mean is not None:
        weight = weight / batch_mean
    if rejection is not None:
        rejected = rejection_statistic(old_logp, engine_logp, mask, rejection) > rejection.threshold
        weight = torch.where(rejected, torch.zeros_like(weight), weight)
        hit = hit | rejected
    return weight, rho, hit


@torch.no_grad()
def batch_mean_sums(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                    c: Correction) -> torch.Tensor:
    """(sum of weights, count) of some rows, float64 [2], to be summed over ranks: the correction's weights over
    valid tokens (token level) or one per response with a valid token (sequence, geometric: the response's weight),
    verl's rollout_is_batch_normalize means. `batch_mean` = sum / count (1 when the sum is not positive)."""
    weight = correction_weight(old_logp, engine_logp, mask, c)[0].to(torch.float64)
    m = mask.to(torch.float64)
    if c.level == "token":
        return torch.stack([(weight * m).sum(), m.sum()])
    seq = m.sum(dim=-1) > 0
    return torch.stack([weight[:, 0][seq].sum() if weight.shape[-1] else torch.zeros((), dtype=torch.float64),
                        seq.sum().to(torch.float64)])


def batch_mean(sums: torch.Tensor) -> float:
    """The IS batch normaliser from `batch_mean_sums` (summed over ranks): the mean weight, or 1.0 when there is
    none or it is not above 1e-8 (verl's guard)."""
    total, count = sums.tolist()
    mean = total / count if count else 1.0
    return mean if mean > 1e-8 else 1.0


QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
"""The quantiles of rho the trainer logs each step (`rollout_ratio/q01` ... `q99`)."""
_SCALE = 1e-4
_BINS = 4000
_EDGES = torch.sinh(torch.linspace(-math.asinh(LOG_RATIO_CLAMP / _SCALE), math.asinh(LOG_RATIO_CLAMP / _SCALE),
                                   _BINS + 1, dtype=torch.float64)) * _SCALE
"""Bin edges over log rho in [-20, 20], asinh-spaced: about 1e-6 wide near 0 and 0.65% of |log rho| away from
it, so that one all-reduce of fixed size gives quantiles of every rank's tokens to within one bin."""


def log_ratio_histogram(log_ratio: torch.Tensor) -> torch.Tensor:
    """log_ratio: [K] values of log rho (any order, clamped to [-20, 20]) -> [_BINS] float64 counts, to be
    summed over ranks and read by `histogram_quantiles`."""
    lr = log_ratio.detach().to(torch.float64).flatten().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.bincount(torch.bucketize(lr, _EDGES[1:-1]), minlength=_BINS).to(torch.float64)


def histogram_bin(value: float) -> tuple[float, float]:
    """The (low, high) log-rho edges of the bin holding log rho = `value` (the quantiles' error bound)."""
    i = int(torch.bucketize(torch.tensor([value], dtype=torch.float64), _EDGES[1:-1]))
    return float(_EDGES[i]), float(_EDGES[i + 1])


def histogram_quantiles(counts: torch.Tensor, qs=QUANTILES) -> list[float]:
    """rho at each quantile q of `counts` (a `log_ratio_histogram`, summed): the midpoint, in log space, of the bin
    holding the ceil(q * K)-th smallest value; NaN when empty. Within one bin of the exact order statistic."""
    total = float(counts.sum())
    if total == 0:
        return [math.nan] * len(qs)
    cdf = counts.cumsum(0)
    out = []
    for q in qs:
        i = int(torch.searchsorted(cdf, torch.tensor([max(math.ceil(q * total), 1)], dtype=cdf.dtype)))
        out.append(math.exp(0.5 * (float(_EDGES[i]) + float(_EDGES[i + 1]))))
    return out


# ---- off-policy diagnostics (verl's rollout_corr/* metrics) -----------------------------------------------

def _response_means(old: torch.Tensor, eng: torch.Tensor, m: torch.Tensor):
    """(responses with a valid token [B] bool, mean_t log p_old [B], mean_t log p_engine [B]), float64."""
    n = m.sum(dim=-1)
    nn = n.clamp(min=1.0)
    return n > 0, (old * m).sum(-1) / nn, (eng * m).sum(-1) / nn


OFFPOLICY_SUMS = ("tokens", "seqs", "kl", "k3_kl", "rho_sq", "seq_rho_sq", "training_log_ppl", "rollout_log_ppl",
                  "training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio", "w", "w_sq")
"""The additive sums behind `offpolicy_metrics`, in the order of `offpolicy_sums`' vector (one SUM over ranks)."""


@torch.no_grad()
def offpolicy_sums(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                   weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The engine/trainer divergence sums of some rows: [B, T] each -> float64 [len(OFFPOLICY_SUMS)], to be summed
    over ranks and read by `offpolicy_metrics`. With lr_t = log pi_old(y_t) - log pi_engine(y_t), over valid tokens:
    sum -lr_t (k1 of KL(engine || old)), sum e^lr_t - 1 - lr_t (k3), sum e^(2 lr_t) (chi2), and over responses with a
    valid token: e^(2 sum_t lr_t), each side's mean -log p (log perplexity) and its exp, their difference
    mean_t(log p_engine) - mean_t(log p_old) (= log(ppl_old / ppl_engine)), its abs and exp. `weight`: the token
    weights whose effective sample size is logged (the correction's; None: rho_t itself). Ratios are clamped at
    e^+-20 as the correction's (log-ratio sums too)."""
    m = mask.to(torch.float64)
    old, eng = old_logp.detach().to(torch.float64), engine_logp.detach().to(torch.float64)
    lr = (old - eng) * m
    lr_safe = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq, old_mean, eng_mean = _response_means(old, eng, m)
    diff = (eng_mean - old_mean)[seq]
    seq_lr = lr.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[seq]
    w = lr_safe.exp() if weight is None else weight.detach().to(torch.float64)
    return torch.stack([
        m.sum(), seq.sum().to(torch.float64),
        (-lr * m).sum(), ((lr_safe.exp() - 1.0 - lr_safe) * m).sum(), ((2.0 * lr_safe).exp() * m).sum(),
        (2.0 * seq_lr).exp().sum(),
        (-old_mean[seq]).sum(), (-eng_mean[seq]).sum(), (-old_mean[seq]).exp().sum(), (-eng_mean[seq]).exp().sum(),
        diff.sum(), diff.abs().sum(), diff.exp().sum(),
        (w * m).sum(), (w * w * m).sum(),
    ])


OFFPOLICY_MAXS = ("log_ppl_diff_max", "neg_log_ppl_diff_min")
"""The maxima behind `offpolicy_metrics`' extremes, in the order of `offpolicy_maxs`' vector (one MAX over ranks;
a minimum travels negated)."""


@torch.no_grad()
def offpolicy_maxs(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [2]: the largest and the negated smallest log_ppl_diff = mean_t(log p_engine) - mean_t(log p_old) of
    the responses with a valid token (-inf each without one), to be MAX-reduced over ranks."""
    m = mask.to(torch.float64)
    seq, old_mean, eng_mean = _response_means(old_logp.detach().to(torch.float64),
                                              engine_logp.detach().to(torch.float64), m)
    diff = (eng_mean - old_mean)[seq]
    if diff.numel() == 0:
        return torch.full((2,), -math.inf, dtype=torch.float64)
    return torch.stack([diff.max(), (-diff).max()])


def offpolicy_metrics(sums: torch.Tensor, maxs: Optional[torch.Tensor] = None) -> dict[str, float]:
    """`offpolicy_sums` (summed over ranks) -> the rollout_corr/* metrics, as verl names them: kl and k3_kl
    (token means of k1 and k3 of KL(engine || old)), chi2_token = E_t[rho_t^2] - 1, chi2_seq = E_i[(prod_t rho_t)^2]
    - 1, training_ppl / rollout_ppl (means over responses of exp(mean_t -log p)), their logs' means, log_ppl_diff
    (mean over responses of log(ppl_old / ppl_engine)), its abs, ppl_ratio (mean of ppl_old / ppl_engine), and ess,
    the effective sample size of the token weights as a share of the tokens: (sum w)^2 / (N sum w^2) in (0, 1]
    (verl's rollout_is_eff_sample_size, 1 / mean((w / mean w)^2)); with `maxs` (`offpolicy_maxs`, MAX-reduced over
    ranks), log_ppl_diff_max and log_ppl_diff_min, its largest and smallest over the responses. Empty when there are
    no valid tokens."""
    s = dict(zip(OFFPOLICY_SUMS, sums.tolist()))
    if s["tokens"] == 0:
        return {}
    t, q = s["tokens"], max(s["seqs"], 1.0)
    out = {"kl": s["kl"] / t, "k3_kl": s["k3_kl"] / t, "chi2_token": s["rho_sq"] / t - 1.0,
           "chi2_seq": s["seq_rho_sq"] / q - 1.0, "training_ppl": s["training_ppl"] / q,
           "rollout_ppl": s["rollout_ppl"] / q, "training_log_ppl": s["training_log_ppl"] / q,
           "rollout_log_ppl": s["rollout_log_ppl"] / q, "log_ppl_diff": s["log_ppl_diff"] / q,
           "log_ppl_abs_diff": s["log_ppl_abs_diff"] / q, "ppl_ratio": s["ppl_ratio"] / q,
           "ess": s["w"] ** 2 / (t * s["w_sq"]) if s["w_sq"] > 0 else 0.0}
    if maxs is not None:
        out["log_ppl_diff_max"], out["log_ppl_diff_min"] = float(maxs[0]), -float(maxs[1])
    return {f"rollout_corr/{k}": v for k, v in out.items()}


IS_STD_SUMS = ("tokens", "dev", "dev_sq")


@torch.no_grad()
def is_std_sums(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, c: Correction) -> torch.Tensor:
    """float64 [3], to be summed over ranks and read by `is_std`: the valid tokens, and the sums over them of d and d^2,
    d = clamp(rho, 1 / high, high) - 1 with rho the correction's ratio at its level (before its bound acts and before
    any batch normalisation) and high its upper bound: verl's compute_is_metrics clamps the weights to
    [1 / threshold, threshold] for rollout_is_std. The shift by 1 (the ideal weight) leaves the variance as it is and
    keeps E[d^2] - E[d]^2 clear of cancellation when the weights are near 1."""
    m = mask.to(torch.float64)
    rho = correction_ratio(old_logp.detach().to(torch.float64), engine_logp.detach().to(torch.float64), mask, c.level)
    d = rho.clamp(min=1.0 / c.high, max=c.high) - 1.0
    return torch.stack([m.sum(), (d * m).sum(), (d * d * m).sum()])


def is_std(sums: torch.Tensor) -> float:
    """verl's rollout_is_std from `is_std_sums` (summed over ranks): the population standard deviation over the valid
    tokens of the clamped ratio, sqrt(max(E[d^2] - E[d]^2, 0)); 0 with at most one valid token (verl's guard)."""
    n, s1, s2 = sums.tolist()
    if n <= 1:
        return 0.0
    return math.sqrt(max(s2 / n - (s1 / n) ** 2, 0.0))


# ---- rejection diagnostics (verl's rollout_corr/rollout_rs_* metrics) -------------------------------------

REJECTION_SUMS = ("tokens", "rows", "seqs", "stat", "clamped", "clamped_sq", "high", "seq_stat", "seq_stat_sq",
                  "seq_high", "masked", "seq_masked")
"""The additive sums behind `rejection_metrics`, in the order of `rejection_sums`' first vector (one SUM over
ranks)."""
REJECTION_MAXS = ("max", "neg_min", "seq_max", "neg_seq_min")
"""Its maxima (a minimum negated), in the order of `rejection_sums`' second vector (one MAX over ranks)."""


@torch.no_grad()
def rejection_sums(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                   r: Rejection) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, maxs), float64 [len(REJECTION_SUMS)] and [len(REJECTION_MAXS)], of rejection `r` on some rows, to be
    SUM- and MAX-reduced over ranks and read by `rejection_metrics`. With s_t the statistic on each valid token (a
    response's own at the seq_* levels, `rejection_statistic`) and v_i each response's value (its statistic at the
    seq_* levels, mean_t s_t at token level), over responses with a valid token: the valid tokens, all rows, the
    responses; sum s_t, sum c_t and c_t^2 (c_t = clamp(s_t, 0, threshold)), the tokens (token level) or responses
    (seq_* levels) above the threshold; sum v_i, v_i^2, the responses with v_i above it; the rejected tokens and the
    responses with a rejected token; and max s_t, -min s_t, max v_i, -min v_i (-inf without a valid token)."""
    valid = mask.bool()
    m = valid.to(torch.float64)
    s = rejection_statistic(old_logp, engine_logp, mask, r)
    n = m.sum(dim=-1)
    seq = n > 0
    if r.level == "token":
        v = (s * m).sum(dim=-1) / n.clamp(min=1.0)
    else:
        v = s[:, 0] if s.shape[-1] else torch.zeros(s.shape[0], dtype=s.dtype)
    v = v[seq]
    rejected = (s > r.threshold) & valid
    c = s.clamp(min=0.0, max=r.threshold)
    high = (rejected.to(torch.float64).sum() if r.level == "token" else (v > r.threshold).to(torch.float64).sum())
    sums = torch.stack([
        m.sum(), torch.tensor(float(s.shape[0]), dtype=torch.float64), seq.sum().to(torch.float64),
        (s * m).sum(), (c * m).sum(), (c * c * m).sum(), high,
        v.sum(), (v * v).sum(), (v > r.threshold).to(torch.float64).sum(),
        rejected.to(torch.float64).sum(), rejected.any(dim=-1).to(torch.float64).sum(),
    ])
    if not bool(valid.any()):
        return sums, torch.full((len(REJECTION_MAXS),), -math.inf, dtype=torch.float64)
    st = s[valid]
    return sums, torch.stack([st.max(), (-st).max(), v.max(), (-v).max()])


def rejection_metrics(name: str, r: Rejection, sums: torch.Tensor, maxs: torch.Tensor) -> dict[str, float]:
    """`rejection_sums` (reduced over ranks) -> verl's rollout_corr/rollout_rs_* metrics of the rejection named `name`
    (algo.rollout_rejection, verl's rollout_rs option), as rollout_corr_helper's compute_rs_metrics and
    compute_rollout_rejection_mask define them: with p = rollout_rs_<name>, p_mean (token mean of s_t), p_max / p_min,
    p_fraction_high (share of tokens, at the seq_* levels of responses, above the threshold), p_fraction_low (0: k2 and
    k3 have no lower bound), p_std (population std over tokens of clamp(s_t, 0, threshold); 0 with one token),
    p_seq_mean, p_seq_std (Bessel-corrected, as torch.std; 0 with one response), p_seq_max, p_seq_min,
    p_seq_max_deviation (max |v_i|), p_seq_fraction_high, p_masked_fraction (share of tokens rejected) and
    p_seq_masked_fraction (share of responses with a rejected token); and over all options (here one),
    rollout_rs_masked_fraction and rollout_rs_seq_masked_fraction (verl divides the latter by every row, responses
    without a valid token included). Empty when there are no valid tokens."""
    s = dict(zip(REJECTION_SUMS, sums.tolist()))
    x = dict(zip(REJECTION_MAXS, maxs.tolist()))
    t, q = s["tokens"], s["seqs"]
    if t == 0:
        return {}
    p = f"rollout_rs_{name}"
    std = math.sqrt(max(s["clamped_sq"] / t - (s["clamped"] / t) ** 2, 0.0)) if t > 1 else 0.0
    seq_std = math.sqrt(max((s["seq_stat_sq"] - s["seq_stat"] ** 2 / q) / (q - 1), 0.0)) if q > 1 else 0.0
    out = {
        f"{p}_mean": s["stat"] / t, f"{p}_max": x["max"], f"{p}_min": -x["neg_min"],
        f"{p}_fraction_high": s["high"] / (t if r.level == "token" else q), f"{p}_fraction_low": 0.0,
        f"{p}_std": std, f"{p}_seq_mean": s["seq_stat"] / q, f"{p}_seq_std": seq_std,
        f"{p}_seq_max": x["seq_max"], f"{p}_seq_min": -x["neg_seq_min"],
        f"{p}_seq_max_deviation": max(abs(x["seq_max"]), abs(x["neg_seq_min"])),
        f"{p}_seq_fraction_high": s["seq_high"] / q,
        f"{p}_masked_fraction": s["masked"] / t, f"{p}_seq_masked_fraction": s["seq_masked"] / q,
        "rollout_rs_masked_fraction": s["masked"] / t, "rollout_rs_seq_masked_fraction": s["seq_masked"] / s["rows"],
    }
    return {f"rollout_corr/{k}": v for k, v in out.items()}
