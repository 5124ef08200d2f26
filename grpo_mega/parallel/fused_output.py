"""The output layer fused into the vocab-parallel token statistics: hidden states in, per-token logprob / entropy /
full KL out, with no [T, V/tp] tensor beyond one chunk of tokens in the forward or the backward pass.

Owns the autograd op the last pipeline stage runs with `batch.fused_output` on: for hidden states [T, h] (the
output layer's input after its tensor-parallel mapping, `output_layer_input`) and this rank's output weight shard
[V/tp, h], the logits z = h W^T are made one chunk of tokens at a time and reduced at once to the per-token
statistics of `grpo_mega.parallel.vocab_parallel` (its pure `local_stats` / `combine` / `finish`; the same two
all-reduces of [k, T] for all T, after the last chunk). The backward pass makes each chunk's logits again (or
keeps them, when the whole input is one chunk), forms their gradient with `local_grads`, and accumulates
grad_hidden[chunk] = g W and grad_W += g^T h[chunk]: no communication. The weight gradient goes where megatron's
own output layer puts it under gradient-accumulation fusion, straight into the fp32 `main_grad` of megatron DDP's
buffer (a plain parameter gets an ordinary `.grad`). The math stays in vocab_parallel.py; the input's
communication is megatron's (`tensor_parallel` mappings, as ColumnParallelLinear applies them); which positions
reach the op is grpo_mega.models.forward_hooks' (`set_output_positions`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from grpo_mega.parallel.vocab_parallel import (
    _chunks,
    _group_rank_size,
    combine,
    finish,
    local_grads,
    local_stats,
    shard_columns,
)

CHUNK_BYTES = 256 * 2**20
"""Without a chunk size: as many tokens per chunk as make one fp32 [chunk, V/tp] tensor at most this."""


def auto_chunk_size(local_vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk such that one fp32 [chunk, local_vocab] tensor is at most `budget` bytes."""
    return max(1, budget // (4 * max(1, local_vocab)))


def output_layer_input(hidden: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """ColumnParallelLinear's input mapping, megatron's own: under sequence parallelism the [s/tp, b, h] shards
    all-gathered to [s, b, h] (the gradient reduce-scattered back); otherwise the identity whose gradient is
    all-reduced over the tensor-parallel group (each rank's partial gradient from its vocabulary columns)."""
    from megatron.core import tensor_parallel

    if sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                                    group=group)
    return tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=group)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """[c, n] logits of this shard's n real columns, in the weight's dtype (as the output layer makes them)."""
    return torch.matmul(hidden, weight[:n].t())


class _FusedOutputStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, target, temperature, vocab_size, group, chunk_size,
                keep):
        rank, world = _group_rank_size(group)
        start, n = shard_columns(weight.shape[0], rank, vocab_size)
        t = hidden.shape[0]
        target_local = None
        if target is not None:
            local = target - start
            target_local = torch.where((local >= 0) & (local < n), local, -1)
        with_ref = ref_hidden is not None

        local = torch.empty(7, t, dtype=torch.float32, device=hidden.device)
        kept = ()
        for lo, hi in _chunks(t, chunk_size):
            z = _logits(hidden[lo:hi], weight, n)
            ref_z = _logits(ref_hidden[lo:hi], ref_weight, n) if with_ref else None
            local[:, lo:hi] = local_stats(z, ref_z, target_local[lo:hi] if target_local is not None else None,
                                          temperature, overwrite=not keep)
            if keep:  # the whole input is one chunk: its logits are kept for the backward, not made again
                kept = (z, ref_z) if with_ref else (z,)
            del z, ref_z
        maxes = local[[0, 4]].clone()
        if world > 1:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        sums = combine(maxes, local, target_local)
        if world > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        stats = finish(maxes, sums, with_ref)

        keys = [k for k in _SAVED if k in stats]
        ctx.save_for_backward(hidden, weight, ref_hidden, ref_weight, target_local, *[stats[k] for k in keys], *kept)
        ctx.meta = (temperature, n, chunk_size, with_ref, target is not None, len(keys))
        ctx.set_materialize_grads(False)
        kl = stats["kl"] if with_ref else torch.zeros_like(stats["entropy"])
        logprob = stats["logprob"] if target is not None else torch.zeros_like(stats["entropy"])
        return logprob, stats["entropy"], kl

    @staticmethod
    def backward(ctx, g_logprob, g_entropy, g_kl):
        temperature, n, chunk_size, with_ref, has_target, n_stats = ctx.meta
        hidden, weight, ref_hidden, ref_weight, target_local, *rest = ctx.saved_tensors
        stats = dict(zip([k for k in _SAVED if with_ref or k not in _REF_KEYS], rest[:n_stats]))
        kept = rest[n_stats:]
        if not has_target:
            g_logprob = None
        if not with_ref:
            g_kl = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nothing = (None,) * 10
        if not (need_h or need_w) or (g_logprob is None and g_entropy is None and g_kl is None):
            return nothing

        grad_h = torch.zeros_like(hidden) if need_h else None
        # The weight gradient: into megatron DDP's fp32 main_grad directly (as its output layer does under
        # gradient_accumulation_fusion), else an fp32 sum returned as the parameter's .grad. DDP's per-parameter
        # hook then has nothing of ours to add (with tied embeddings it still adds the embedding's .grad); it
        # would also mark the parameter ready for an overlapped reduction, which builder.build_actor leaves off
        # (overlap_grad_reduce=False: the reduction starts after the last micro-batch's backward).
        main = getattr(weight, "main_grad", None) if need_w else None
        acc = None
        if need_w:
            acc = main if main is not None else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo, hi in _chunks(hidden.shape[0], chunk_size):
            h = hidden[lo:hi]
            z = kept[0] if kept else _logits(h, weight, n)
            ref_z = None
            if with_ref:
                ref_z = kept[1] if kept else _logits(ref_hidden[lo:hi], ref_weight, n)
            g, _ = local_grads(
                z, ref_z, target_local[lo:hi] if target_local is not None else None, temperature,
                {k: v[lo:hi] for k, v in stats.items()},
                g_logprob[lo:hi] if g_logprob is not None else None,
                g_entropy[lo:hi] if g_entropy is not None else None,
                g_kl[lo:hi] if g_kl is not None else None,
                need_ref_grad=False, overwrite_ref=True, overwrite_logits=True,  # the chunk's logits are ours
            )
            del z, ref_z
            g = g.to(weight.dtype)  # the logit gradient in the logits' dtype, as the unfused path hands it on
            if need_h:
                torch.matmul(g, weight[:n], out=grad_h[lo:hi])
            if need_w:
                if g.dtype == acc.dtype:
                    acc[:n].addmm_(g.t(), h)
                else:  # bf16 GEMM, accumulated in fp32
                    acc[:n].add_(torch.matmul(g.t(), h))
            del g
        grad_w = None
        if need_w and main is None:
            grad_w = acc if acc.dtype == weight.dtype else acc.to(weight.dtype)
        return (grad_h, grad_w) + nothing[2:]


_SAVED = ("g_a", "log_s_a", "entropy", "g_b", "log_s_b", "kl")
_REF_KEYS = ("g_b", "log_s_b", "kl")


def fused_output_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    *,
    ref_hidden: Optional[torch.Tensor] = None,
    ref_weight: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Per-token (logprob of `target`, entropy, KL(p || q)) of the logits hidden @ weight^T, vocab-sharded,
    computed chunk by chunk over the tokens: `vocab_parallel_stats(output_layer(hidden), ...)` without the
    logits.

    hidden: [..., h] the output layer's input after its TP mapping (`output_layer_input`); weight: [V/tp, h]
    this rank's shard of the (padded) output weight (the embedding's, tied or not: the same Parameter); target:
    [...] global token ids (< vocab_size) or None (logprob 0); group: the tensor-parallel group; ref_hidden,
    ref_weight: the reference model's, for the full KL (no grad); temperature divides the logits; vocab_size:
    the real vocabulary (later columns are padding); chunk_size: tokens per chunk (None: `auto_chunk_size`).
    Returns fp32 [...] logprob, entropy, kl (None without a reference). Gradients flow to `hidden` and `weight`
    (into weight.main_grad where megatron DDP gave it one: then weight.grad stays None).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: expected [..., h] and "
                         "[V/tp, h]")
    if (ref_hidden is None) != (ref_weight is None):
        raise ValueError("the full KL needs both ref_hidden and ref_weight (or neither)")
    if ref_hidden is not None:
        if ref_hidden.shape != hidden.shape or ref_weight.shape != weight.shape:
            raise ValueError(f"reference shapes {tuple(ref_hidden.shape)}, {tuple(ref_weight.shape)} != the actor's "
                             f"{tuple(hidden.shape)}, {tuple(weight.shape)}")
        if ref_hidden.requires_grad or ref_weight.requires_grad:
            raise ValueError("the reference's hidden states and weight must not require grad (a frozen reference)")
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    ref_flat = ref_hidden.reshape(-1, hidden.shape[-1]) if ref_hidden is not None else None
    tgt = None
    if target is not None:
        if target.shape != lead:
            raise ValueError(f"target shape {tuple(target.shape)} != hidden leading shape {tuple(lead)}")
        tgt = target.reshape(-1).long()
        limit = vocab_size if vocab_size is not None else weight.shape[0] * _group_rank_size(group)[1]
        if tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= limit):
            raise ValueError(
                f"target ids must be in [0, {limit}) (the real vocabulary), got [{int(tgt.min())}, {int(tgt.max())}]"
            )
    chunk = int(chunk_size) if chunk_size else auto_chunk_size(weight.shape[0])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    keep = grad and chunk >= flat.shape[0]
    logprob, entropy, kl = _FusedOutputStats.apply(flat, weight, ref_flat, ref_weight, tgt, float(temperature),
                                                   vocab_size, group, chunk, keep)
    return logprob.view(lead), entropy.view(lead), (kl.view(lead) if ref_hidden is not None else None)
