"""Vocab-parallel per-token logprob, entropy and full KL from vocab-sharded logits, never gathering [T, V].

Owns the one fused autograd op the GRPO loss needs from the LM head: for logits sharded over the vocabulary
across a tensor-parallel group ([T, V/tp] on each rank, shard r holding columns [r*V/tp, (r+1)*V/tp)), it
returns, per token,

    logprob  log p(y_t)                            of the target token y_t
    entropy  H(p_t) = -sum_v p_t(v) log p_t(v)
    kl       KL(p_t || q_t) = sum_v p_t(v) (log p_t(v) - log q_t(v))      (when reference logits are given)

with p = softmax(logits / temperature), q = softmax(ref_logits / temperature). Columns at or beyond
`vocab_size` (docs/design.md, "Vocabulary padding") are treated as -inf: excluded from every sum, zero
gradient.

The math follows Megatron's `tensor_parallel/cross_entropy.py`: static steps on one rank's shard, and a thin
autograd.Function with the collectives between them. Each shard is reduced to per-token statistics (its max,
its sum of exponentials and softmax-weighted means, all relative to its max) and those are combined across
the group with two all-reduces of [k, T] tensors (one MAX of [2, T], one SUM of [5, T]). The backward pass needs no communication: each rank rebuilds its columns
of p (and q) from its logits and the saved [T]-sized global statistics. All math is fp32 whatever the
input dtype. With `chunk_size`, tokens are processed in chunks so temporaries are [chunk, V/tp]; the only
tensor of the logits' size ever allocated is the gradient itself, and with `donate_ref_logits` (the
reference's logits are of no further use to the caller) not even that: the gradient is written into the
reference logits' memory, so that the full KL costs no [T, V/tp] tensor beyond the reference's own logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_NEG_INF = float("-inf")


# ---- pure per-shard math ------------------------------------------------------------------------------


def shard_columns(local_width: int, rank: int, vocab_size: Optional[int]) -> tuple[int, int]:
    """(first global column of this shard, number of real (unpadded) columns in it)."""
    start = rank * local_width
    if vocab_size is None:
        return start, local_width
    return start, max(0, min(local_width, vocab_size - start))


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh fp32 copy of z / temperature (never a view of the input: callers modify it in place)."""
    return torch.div(z.to(torch.float32), temperature)


def local_stats(
    z: torch.Tensor,
    ref_z: Optional[torch.Tensor],
    target_local: Optional[torch.Tensor],
    temperature: float,
    overwrite: bool = False,
) -> torch.Tensor:
    """Per-token statistics of one shard's real columns, each relative to the shard's own max.

    z, ref_z: [c, n] logits (n real columns of this shard, any dtype); target_local: [c] column of the
    target in this shard, or -1 where another shard holds it. With a = z / T, b = ref_z / T and
    e = exp(a - max a), returns [7, c] fp32 rows:
      0  m_a     max_v a_v                   1  s_a   sum_v e_v
      2  mean_a  sum_v e_v (a_v - m_a) / s_a  3  tgt   a_target where this shard holds it, else 0
      4  m_b     max_v b_v                   5  s_b   sum_v exp(b_v - m_b)
      6  mean_b  sum_v e_v (b_v - m_b) / s_a
    (rows 4-6 are 0 without ref). Keeping every quantity relative to a max keeps fp32 exact for logits of
    any magnitude: nothing of the size of the logits is ever subtracted from something of that size.
    An empty shard (n == 0) gives m = -inf and s = 0. With `overwrite`, fp32 z and ref_z are used as scratch
    (the caller's own temporaries) instead of copied.
    """
    c, n = z.shape
    out = torch.zeros(7, c, dtype=torch.float32, device=z.device)
    if n == 0:
        out[0] = _NEG_INF
        out[4] = _NEG_INF
        return out
    a = z.div_(temperature) if overwrite and z.dtype == torch.float32 else _scaled(z, temperature)
    if target_local is not None:
        here = target_local >= 0
        out[3] = torch.where(here, a.gather(1, target_local.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    out[0] = a.amax(dim=1)
    a.sub_(out[0].unsqueeze(1))  # a - m_a, in place
    e = a.exp()
    out[1] = e.sum(dim=1)
    out[2] = a.mul_(e).sum(dim=1) / out[1]  # in place: no third [c, n] tensor
    del a
    if ref_z is not None:
        b = ref_z.div_(temperature) if overwrite and ref_z.dtype == torch.float32 else _scaled(ref_z, temperature)
        out[4] = b.amax(dim=1)
        b.sub_(out[4].unsqueeze(1))
        out[6] = e.mul_(b).sum(dim=1) / out[1]
        del e
        out[5] = b.exp_().sum(dim=1)
    return out


def combine(maxes: torch.Tensor, local: torch.Tensor, target_local: Optional[torch.Tensor]) -> torch.Tensor:
    """One shard's terms of the cross-shard sums.

    maxes: [2, c], the group-wide MAX of rows (m_a, m_b) = (G_a, G_b); local: [7, c] from `local_stats`.
    Returns [5, c] rows, to be SUMmed over the shards:
      0  w = s_a exp(m_a - G_a)                       (sum: S_a = sum_v exp(a_v - G_a))
      1  w (mean_a + m_a - G_a)                       (sum / S_a: E_p[a] - G_a)
      2  w (mean_b + m_b - G_b)                       (sum / S_a: E_p[b] - G_b)
      3  s_b exp(m_b - G_b)                           (sum: S_b)
      4  a_target - G_a on the shard holding the target, else 0
    """
    w = local[1] * (local[0] - maxes[0]).exp()
    wb = local[5] * (local[4] - maxes[1]).exp()
    has = w > 0  # an empty shard, or one far below the max: keep 0 * (-inf) out
    zero = torch.zeros_like(w)
    out = torch.stack(
        [
            w,
            torch.where(has, w * (local[2] + (local[0] - maxes[0])), zero),
            torch.where(has, w * (local[6] + (local[4] - maxes[1])), zero),
            wb,
            zero if target_local is None else torch.where(target_local >= 0, local[3] - maxes[0], zero),
        ]
    )
    return out


def finish(maxes: torch.Tensor, sums: torch.Tensor, with_ref: bool) -> dict[str, torch.Tensor]:
    """Global per-token results from the group-wide MAX `maxes` and SUM `sums` of `combine`. All [c] fp32.

    log p_v = (a_v - G_a) - log S_a, so logprob = sums[4] - log S_a and
    H = -E_p[log p] = log S_a - (E_p[a] - G_a);  KL = E_p[log p] - E_p[log q].
    """
    log_s = sums[0].log()
    ea = sums[1] / sums[0]
    out = {"g_a": maxes[0], "log_s_a": log_s, "logprob": sums[4] - log_s, "entropy": log_s - ea}
    if with_ref:
        log_sb = sums[3].log()
        out["g_b"] = maxes[1]
        out["log_s_b"] = log_sb
        out["kl"] = (ea - log_s) - (sums[2] / sums[0] - log_sb)
    return out


def local_grads(
    z: torch.Tensor,
    ref_z: Optional[torch.Tensor],
    target_local: Optional[torch.Tensor],
    temperature: float,
    stats: dict[str, torch.Tensor],
    g_logprob: Optional[torch.Tensor],
    g_entropy: Optional[torch.Tensor],
    g_kl: Optional[torch.Tensor],
    need_ref_grad: bool,
    overwrite_ref: bool = False,
    overwrite_logits: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gradients w.r.t. one shard's real columns (fp32), from its logits and the global [c] statistics.

    With a = z/T, p = softmax(a), q = softmax(ref_z/T), y the target:
      d logprob / d a_v = 1[v = y] - p_v
      d H / d a_v       = -p_v (log p_v + H)
      d KL / d a_v      = p_v (log p_v - log q_v - KL)        d KL / d b_v = q_v - p_v
    and d/dz = d/da / T. z, ref_z: [c, n]; g_*: [c] upstream gradients (None: unused output). With
    `overwrite_ref` (and no ref grad), an fp32 ref_z is turned into log q in place instead of copied; with
    `overwrite_logits`, an fp32 z into log p.
    Returns (grad_z [c, n] fp32, grad_ref_z [c, n] fp32 or None).
    """
    c = z.shape[0]
    zeros = torch.zeros(c, dtype=torch.float32, device=z.device)
    g_lp = zeros if g_logprob is None else g_logprob.float()
    g_h = zeros if g_entropy is None else g_entropy.float()
    g_k = zeros if (g_kl is None or ref_z is None) else g_kl.float()

    logp = z.div_(temperature) if overwrite_logits and z.dtype == torch.float32 else _scaled(z, temperature)
    logp.sub_(stats["g_a"].unsqueeze(1)).sub_(stats["log_s_a"].unsqueeze(1))
    # p * (coef * logp - g_k * logq + const): the entropy and KL terms share p and log p.
    grad = logp * (g_k - g_h).unsqueeze(1)
    const = -g_lp - g_h * stats["entropy"]
    logq = None
    if ref_z is not None and (g_kl is not None or need_ref_grad):
        const = const - g_k * stats["kl"]
        in_place = overwrite_ref and not need_ref_grad and ref_z.dtype == torch.float32
        logq = ref_z.div_(temperature) if in_place else _scaled(ref_z, temperature)
        logq.sub_(stats["g_b"].unsqueeze(1)).sub_(stats["log_s_b"].unsqueeze(1))
        grad.addcmul_(logq, g_k.unsqueeze(1), value=-1.0)
    grad.add_(const.unsqueeze(1))
    p = logp.exp_()
    grad.mul_(p)
    if target_local is not None and g_logprob is not None:
        here = target_local >= 0
        rows = torch.nonzero(here).squeeze(1)
        grad[rows, target_local[rows]] += g_lp[rows]
    grad.div_(temperature)

    grad_ref = None
    if need_ref_grad:
        q = logq.exp_()
        grad_ref = q.sub_(p).mul_(g_k.unsqueeze(1)).div_(temperature)
    return grad, grad_ref


# ---- the autograd op ----------------------------------------------------------------------------------


def _group_rank_size(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _chunks(t: int, chunk_size: Optional[int]):
    step = t if not chunk_size else max(1, int(chunk_size))
    for lo in range(0, t, step):
        yield lo, min(t, lo + step)


class _VocabParallelStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_logits, target, temperature, vocab_size, group, chunk_size, donate_ref):
        rank, world = _group_rank_size(group)
        start, n = shard_columns(logits.shape[-1], rank, vocab_size)
        t = logits.shape[0]
        target_local = None
        if target is not None:
            local = target - start
            target_local = torch.where((local >= 0) & (local < n), local, -1)
        with_ref = ref_logits is not None

        local = torch.empty(7, t, dtype=torch.float32, device=logits.device)
        for lo, hi in _chunks(t, chunk_size):
            local[:, lo:hi] = local_stats(
                logits[lo:hi, :n],
                ref_logits[lo:hi, :n] if with_ref else None,
                target_local[lo:hi] if target_local is not None else None,
                temperature,
            )
        maxes = local[[0, 4]].clone()
        if world > 1:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        sums = combine(maxes, local, target_local)
        if world > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        stats = finish(maxes, sums, with_ref)

        ctx.save_for_backward(logits, ref_logits, target_local, *[stats[k] for k in _SAVED if k in stats])
        ctx.meta = (temperature, n, chunk_size, with_ref, target is not None, donate_ref)
        ctx.set_materialize_grads(False)
        kl = stats["kl"] if with_ref else torch.zeros_like(stats["entropy"])
        logprob = stats["logprob"] if target is not None else torch.zeros_like(stats["entropy"])
        return logprob, stats["entropy"], kl

    @staticmethod
    def backward(ctx, g_logprob, g_entropy, g_kl):
        temperature, n, chunk_size, with_ref, has_target, donate_ref = ctx.meta
        logits, ref_logits, target_local, *saved = ctx.saved_tensors
        stats = dict(zip([k for k in _SAVED if with_ref or k not in _REF_KEYS], saved))
        need_ref_grad = with_ref and ctx.needs_input_grad[1]
        if not has_target:
            g_logprob = None
        if not with_ref:
            g_kl = None

        donate = donate_ref and with_ref and not need_ref_grad and ctx.needs_input_grad[0]
        if donate:  # each chunk's gradient goes where that chunk's reference logits were, once read
            grad = ref_logits
            grad[:, n:] = 0
        else:
            grad = torch.zeros_like(logits) if ctx.needs_input_grad[0] else None
        grad_ref = torch.zeros_like(ref_logits) if need_ref_grad else None
        if grad is None and grad_ref is None:
            return (None,) * 8
        for lo, hi in _chunks(logits.shape[0], chunk_size):
            g_a, g_b = local_grads(
                logits[lo:hi, :n],
                ref_logits[lo:hi, :n] if with_ref else None,
                target_local[lo:hi] if target_local is not None else None,
                temperature,
                {k: v[lo:hi] for k, v in stats.items()},
                g_logprob[lo:hi] if g_logprob is not None else None,
                g_entropy[lo:hi] if g_entropy is not None else None,
                g_kl[lo:hi] if g_kl is not None else None,
                need_ref_grad,
                overwrite_ref=donate,
            )
            if grad is not None:
                grad[lo:hi, :n] = g_a
            if grad_ref is not None:
                grad_ref[lo:hi, :n] = g_b
        return grad, grad_ref, None, None, None, None, None, None


_SAVED = ("g_a", "log_s_a", "entropy", "g_b", "log_s_b", "kl")
_REF_KEYS = ("g_b", "log_s_b", "kl")


def vocab_parallel_stats(
    logits: torch.Tensor,
    target: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    ref_logits: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    donate_ref_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Per-token (logprob of `target`, entropy, KL(p || q)) from vocab-sharded logits.

    logits: [..., V/tp] this rank's shard of the (padded) vocabulary, any float dtype; target: [...] global
    token ids (< vocab_size), or None (logprob is then 0); group: the tensor-parallel group (None: the
    logits hold the whole vocabulary); ref_logits: [..., V/tp] the reference model's shard for KL, or
    None; temperature: divides the logits, as the rollout engine does; vocab_size: the real vocabulary,
    columns at or past it are padding (-inf); chunk_size: tokens per chunk (None: all at once);
    donate_ref_logits: the caller gives `ref_logits` up (no grad, same dtype as `logits`): the backward pass
    overwrites them with the gradient of `logits` instead of allocating one (the full KL in the GRPO loss,
    where the reference's logits exist for this op alone). One backward pass only.

    Returns fp32 tensors of shape [...]: logprob, entropy, and kl (None without ref_logits). Gradients flow
    to `logits` and, if it requires grad, `ref_logits`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if ref_logits is not None and ref_logits.shape != logits.shape:
        raise ValueError(f"ref_logits shape {tuple(ref_logits.shape)} != logits shape {tuple(logits.shape)}")
    if donate_ref_logits and (ref_logits is None or ref_logits.requires_grad or ref_logits.dtype != logits.dtype):
        raise ValueError(
            "donate_ref_logits=True needs ref_logits without grad and of the logits' dtype "
            f"(got {None if ref_logits is None else (ref_logits.dtype, ref_logits.requires_grad)} for logits "
            f"{logits.dtype}); pass donate_ref_logits=False to keep them"
        )
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    ref_flat = ref_logits.reshape(-1, logits.shape[-1]) if ref_logits is not None else None
    tgt = None
    if target is not None:
        if target.shape != lead:
            raise ValueError(f"target shape {tuple(target.shape)} != logits leading shape {tuple(lead)}")
        tgt = target.reshape(-1).long()
        limit = vocab_size if vocab_size is not None else logits.shape[-1] * _group_rank_size(group)[1]
        if tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= limit):
            raise ValueError(
                f"target ids must be in [0, {limit}) (the real vocabulary), got [{int(tgt.min())}, {int(tgt.max())}]"
            )
    logprob, entropy, kl = _VocabParallelStats.apply(flat, ref_flat, tgt, float(temperature), vocab_size, group, chunk_size,
                                                     donate_ref_logits)
    return logprob.view(lead), entropy.view(lead), (kl.view(lead) if ref_logits is not None else None)


def vocab_parallel_logprob(logits, target, group=None, **kw) -> torch.Tensor:
    """log p(target) per token from vocab-sharded logits. See `vocab_parallel_stats`."""
    return vocab_parallel_stats(logits, target, group, **kw)[0]


def vocab_parallel_entropy(logits, group=None, **kw) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per token from vocab-sharded logits."""
    return vocab_parallel_stats(logits, None, group, **kw)[1]


def vocab_parallel_kl(logits, ref_logits, group=None, **kw) -> torch.Tensor:
    """Full-vocabulary KL(p || q) per token, p from `logits`, q from `ref_logits`, both vocab-sharded."""
    return vocab_parallel_stats(logits, None, group, ref_logits=ref_logits, **kw)[2]
