"""Core attention for megatron-core's local layer spec: torch's scaled_dot_product_attention, causal, and
per sequence in a packed row.

megatron-core 0.16.1's local `DotProductAttention` materialises the [b*np, s, s] scores (baddbmm, an
unfused softmax, bmm) and takes packed rows only as a dense [1, 1, S, S] block-causal mask: attention over
a packed row then costs S^2 however short its sequences are (the tiny model's update ran 1.8x slower
packed than padded because of it). Here a packed row is cut at its cu_seqlens and each sequence (the
row's padding tail is a segment of its own) attends causally to itself alone, through SDPA; padded rows
are one causal SDPA call. Transformer Engine's spec (THD with cu_seqlens) does the same on GPUs.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from grpo_mega.models.buckets import length_buckets


def _dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class SDPACoreAttention(_dot_product_attention()):
    """Drop-in for the local spec's `core_attention` (same constructor; its scale, heads per TP partition).

    forward(query [s, b, np, hn], key/value [s, b, ng, hn], attention_mask, ...) -> [s, b, np*hn]: causal
    attention per row when attention_mask is None. For a packed row ([S, 1, ...]) `attention_mask` carries the
    offsets of its sequences instead of a mask (`packed_row_mask`: [k+1] int32, cu[0] = 0); the row's positions
    from cu[-1] on are padding. The sequences are gathered into a few buckets of similar lengths (`length_buckets`),
    each bucket's into rows of its longest one's length, attend causally in one SDPA call a bucket (a sequence's padding
    comes after it: causality keeps it unseen) and are scattered back; the padding's output is 0. Carried in the mask's argument, the offsets reach every layer and
    megatron's activation recomputation (selective or full) as an input of the checkpointed function, as a
    mask would. A dense mask is refused: no row built here needs one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        if c.apply_query_key_layer_scaling or self.softmax_offset is not None or c.window_size is not None:
            raise ValueError("SDPACoreAttention: query-key layer scaling, softmax offsets and sliding windows "
                             "are not implemented; use megatron-core's DotProductAttention")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention takes causal rows (padded, or packed with cu_seqlens in the "
                             "attention_mask argument), not an attention bias or THD packed_seq_params")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("SDPACoreAttention: attention dropout is not implemented (model config sets 0)")
        s, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = q.shape[1] != k.shape[1]
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, np*hn]
        buckets, scatter = _packed_index(attention_mask, s, b)
        if not buckets:
            return query.new_zeros(s, b, q.shape[1] * q.shape[3])
        outs = []
        for gather, n, width in buckets:  # sequences of similar lengths together: less padding to attend over
            # [1, heads, S, hn] -> [n, heads, width, hn]: sequence j's tokens at row j, then its padding
            qb, kb, vb = (t.index_select(2, gather).unflatten(2, (n, width)).transpose(0, 2).squeeze(2)
                          for t in (q, k, v))
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
            outs.append(out.permute(0, 2, 1, 3).reshape(n * width, -1))  # [n * width, np*hn]
        outs.append(outs[0].new_zeros(1, outs[0].shape[1]))  # the last slot: the row's padding
        return torch.cat(outs).index_select(0, scatter).view(s, b, -1)


CALL_SLOTS = 64
"""What one more SDPA call costs, in slots of the [n, width] layout (on one CPU core a call over 1 x 48 slots took what
~70 slots of a 32 x 48 one did): the sequences are cut into another bucket where that saves more padding."""
MAX_BUCKETS = 4


def _packed_index(cu: torch.Tensor, s: int, b: int):
    """For a packed row of `s` positions cut at `cu`: the buckets [(gather [n * width], n, width)] (the row position
    of each slot of a bucket's [n, width] layout; slots past a sequence's end repeat its last token), and scatter [s]
    (each row position's slot in the buckets' slots one after the other; the last slot, after them all, for the
    padding). Cached on the offsets tensor: one computation per micro-batch."""
    cached = getattr(cu, "_grpo_packed_index", None)
    if cached is not None and cached[0] == s:
        return cached[1:]
    if cu.dim() != 1 or cu.is_floating_point() or cu.dtype == torch.bool:
        raise ValueError(f"SDPACoreAttention: attention_mask must be None or a packed row's cu_seqlens (1-D int), "
                         f"got {tuple(cu.shape)} {cu.dtype}")
    offsets = cu.tolist()
    if b != 1 or not offsets or offsets[0] != 0 or offsets[-1] > s or any(y < x for x, y in zip(offsets, offsets[1:])):
        raise ValueError(f"SDPACoreAttention: cu_seqlens {offsets} do not cut a packed row of {s} tokens (batch {b})")
    lens = [y - x for x, y in zip(offsets, offsets[1:])]
    buckets, scatter, base = [], [0] * s, 0
    for seqs in (length_buckets(lens, CALL_SLOTS, MAX_BUCKETS) if lens else []):
        width = max([lens[j] for j in seqs] + [1])
        gather = []
        for row, j in enumerate(seqs):
            start, n = offsets[j], lens[j]
            gather += [start + min(t, max(n - 1, 0)) for t in range(width)]
            for t in range(n):
                scatter[start + t] = base + row * width + t
        buckets.append((torch.tensor(gather, dtype=torch.long, device=cu.device), len(seqs), width))
        base += len(seqs) * width
    for pos in range(offsets[-1], s):
        scatter[pos] = base
    scatter = torch.tensor(scatter, dtype=torch.long, device=cu.device)
    cu._grpo_packed_index = (s, buckets, scatter)
    return buckets, scatter


def packed_row_mask(cu_seqlens: torch.Tensor, sequences: int) -> torch.Tensor:
    """What a packed row passes as the model's attention_mask under SDPACoreAttention: the offsets of its first
    `sequences` segments (its real sequences; the rest of the row is padding)."""
    return cu_seqlens[: sequences + 1].to(torch.int32).contiguous()
