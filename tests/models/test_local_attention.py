"""SDPACoreAttention (the local spec's core attention) against megatron-core's own DotProductAttention: padded
causal rows, and packed rows (in one SDPA call, and in buckets of lengths) against megatron's attention under a dense
block-causal mask built here by hand; outputs and the gradients of query, key and value, with grouped-query attention.

Tolerances, as max |difference| over max |megatron's| per tensor: fp32 1e-6 (measured ~1e-7); bf16 1e-2 (bf16 has
8 significant bits, 4e-3 relative per rounding; the two round the scores and the softmax at different points).
"""

import pytest
import torch

from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed


def block_causal_mask(seq_lens, length):
    """[1, 1, S, S] bool, True where attention is NOT allowed (megatron's convention): each sequence attends
    causally to itself only; the padding at the row's end attends causally to itself."""
    seg = torch.full((length,), len(seq_lens), dtype=torch.long)
    pos = 0
    for j, n in enumerate(seq_lens):
        seg[pos:pos + n] = j
        pos += n
    same = seg.unsqueeze(0) == seg.unsqueeze(1)
    return ~(same & torch.ones(length, length, dtype=torch.bool).tril()).view(1, 1, length, length)


def test_block_causal_mask_by_hand():
    allowed = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # the padding: itself only
    ]
    assert torch.equal(~block_causal_mask([2, 3], 6)[0, 0], torch.tensor(allowed, dtype=torch.bool))


def _compare(dtype_name):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from grpo_mega.models.local_attention import SDPACoreAttention, packed_row_mask

    dtype = getattr(torch, dtype_name)
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1)
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                kv_channels=8, attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
                                params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True)
        ours = SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
        theirs = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
        g = torch.Generator().manual_seed(0)
        out = {}
        # (name, [s, b], seq_lens of a packed row or None)
        # "buckets": lengths that length_buckets splits into more than one SDPA call
        for name, (s, b), lens in (("padded", (19, 3), None), ("packed", (24, 1), [7, 1, 9]),
                                   ("buckets", (80, 1), BUCKETED)):
            q = torch.randn(s, b, 4, 8, generator=g).to(dtype)
            k, v = (torch.randn(s, b, 2, 8, generator=g).to(dtype) for _ in range(2))
            grad_out = torch.randn(s, b, 32, generator=g).to(dtype)
            if lens is None:
                mask_ours = mask_theirs = None
            else:
                # as packed_micro_batch: the row's padding after the sequences
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist(), s], dtype=torch.int32)
                mask_ours, mask_theirs = packed_row_mask(cu, len(lens)), block_causal_mask(lens, s)
            res = []
            for module, mask in ((ours, mask_ours), (theirs, mask_theirs)):
                qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                o = module(qq, kk, vv, mask)
                if lens is not None:  # the padding's output is 0 here, megatron's attends to itself: not compared
                    used = sum(lens)
                    if module is ours:
                        out[name + "_padding_max"] = o[used:].abs().max().item()
                    o, g_out = o[:used], grad_out[:used]
                else:
                    g_out = grad_out
                o.backward(g_out)
                res.append([o.detach().float(), qq.grad.float(), kk.grad.float(), vv.grad.float()])
            out[name] = [(a - b_).abs().max().item() / b_.abs().max().item() for a, b_ in zip(*res)]
        destroy_distributed()
        return out


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_sdpa_core_attention_equals_megatrons_dot_product_attention(dtype, tol):
    (out,) = run_ranks(_compare, 1, dtype, timeout=120)
    for name in ("padded", "packed", "buckets"):
        assert max(out[name]) <= tol, (name, out[name])  # output, dq, dk, dv: max |diff| / max |megatron's|
    assert out["packed_padding_max"] == out["buckets_padding_max"] == 0.0


BUCKETED = [30, 2, 2, 2, 2, 2, 2, 2, 2, 25, 1, 3]


def test_length_buckets_hold_every_sequence_once_in_fewer_slots():
    from grpo_mega.models.buckets import length_buckets
    from grpo_mega.models.local_attention import CALL_SLOTS, MAX_BUCKETS

    buckets = length_buckets(BUCKETED, CALL_SLOTS, MAX_BUCKETS)
    assert 1 < len(buckets) <= MAX_BUCKETS
    assert sorted(j for bucket in buckets for j in bucket) == list(range(len(BUCKETED)))
    cost = sum(len(bk) * max(BUCKETED[j] for j in bk) + CALL_SLOTS for bk in buckets)
    assert cost < len(BUCKETED) * max(BUCKETED) + CALL_SLOTS  # one bucket of the longest's width costs more
    assert length_buckets([5] * 8, CALL_SLOTS, MAX_BUCKETS) == [list(range(8))]  # equal lengths: one call


def _refusals():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from grpo_mega.models.local_attention import SDPACoreAttention

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1)
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, kv_channels=8,
                                attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
        attn = SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
        q = torch.zeros(6, 1, 4, 8)
        msgs = []
        for mask in (torch.zeros(1, 1, 6, 6, dtype=torch.bool), torch.tensor([0, 4, 7], dtype=torch.int32)):
            try:
                attn(q, q, q, mask)
                msgs.append(None)
            except ValueError as e:
                msgs.append(str(e))
        destroy_distributed()
        return msgs


def test_a_dense_mask_or_offsets_that_do_not_cut_the_row_are_refused():
    (msgs,) = run_ranks(_refusals, 1, timeout=120)
    assert "cu_seqlens" in msgs[0] and "(1, 1, 6, 6)" in msgs[0]
    assert "[0, 4, 7] do not cut a packed row of 6" in msgs[1]
