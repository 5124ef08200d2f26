"""KL estimators between the policy p = pi_theta and the frozen reference q = pi_ref, per token.

Pure tensor math. The sampled-token estimators follow Schulman, "Approximating KL Divergence" (2020),
with verl's names and clamps so the same inputs give the same numbers:

    k1             log(p/q)
    abs            |log(p/q)|
    k2, mse        0.5 * log(p/q)^2
    k3, low_var_kl q/p - log(q/p) - 1, log(q/p) clamped to [-20, 20] before exp, value to [-10, 10]
    full           sum_v p(v) (log p(v) - log q(v)) over the whole vocabulary

`full` needs whole-vocabulary distributions: the trainer computes it from vocab-sharded logits
(grpo_mega.parallel.vocab_parallel) and passes the per-token values in; `full_kl` here is the dense
definition, for tests and single-device use.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from grpo_mega.registry import Registry

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0

KL_ESTIMATORS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log p - log q. logp, ref_logp: [B, T] -> [B, T]. Unbiased, high variance, can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("abs")
def abs_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|log p - log q|. [B, T] -> [B, T]."""
    return (logp - ref_logp).abs()


@KL_ESTIMATORS.register("k2", "mse")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """0.5 (log p - log q)^2 (Schulman's k2). [B, T] -> [B, T]."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """q/p - log(q/p) - 1 (Schulman's k3; GRPO's estimator, Shao et al. 2024 eq. 4). Non-negative,
    unbiased for KL(p||q) under samples from p. [B, T] -> [B, T], clamped to [-10, 10] as verl does."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_ratio.exp() - log_ratio - 1).clamp(-K3_CLAMP, K3_CLAMP)


def full_kl(logp_vocab: torch.Tensor, ref_logp_vocab: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) = sum_v p(v) (log p(v) - log q(v)) from normalised log-probabilities.

    logp_vocab, ref_logp_vocab: [..., V] (log_softmax outputs). Returns [...].
    """
    return (logp_vocab.exp() * (logp_vocab - ref_logp_vocab)).sum(dim=-1)


@KL_ESTIMATORS.register("full")
def _full_precomputed(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    raise ValueError("algo.kl_estimator='full' needs the per-token full-vocabulary KL passed as `full`")


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, full: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-token KL penalty by estimator name (k1, abs, k2/mse, k3/low_var_kl, full).

    logp, ref_logp: [B, T] log-probabilities of the sampled tokens. For `full`, pass `full`: [B, T], the
    per-token whole-vocabulary KL computed from the logits. Returns [B, T].
    """
    fn = KL_ESTIMATORS.get(estimator)
    if estimator == "full" and full is not None:
        return full
    return fn(logp, ref_logp)
