"""Sequences into a few buckets of similar lengths, each bucket padded to its longest: packed rows' attention on the
local spec (grpo_mega.models.local_attention: one SDPA call a bucket) and the stand-in server's prefill forwards
(grpo_mega.engines.continuous: one forward a bucket). Pure Python, importable without megatron."""

from __future__ import annotations


def length_buckets(lens: list[int], call_slots: int, most: int) -> list[list[int]]:
    """The sequences (indices into `lens`) in at most `most` buckets of similar lengths, longest first: the split of
    the sorted lengths with the fewest slots (a bucket's count x its longest) plus `call_slots` a bucket (what one
    more call over a bucket costs)."""
    order = sorted(range(len(lens)), key=lambda j: -lens[j])
    w = [max(lens[j], 1) for j in order]
    n = len(order)
    # best[b][i]: the cost of the first i sorted sequences in b buckets; cut[b][i]: where the last bucket starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(most + 1)]
    cut = [[0] * (n + 1) for _ in range(most + 1)]
    best[0][0] = 0
    for b in range(1, most + 1):
        for i in range(1, n + 1):
            for j in range(b - 1, i):  # the last bucket holds sorted sequences j..i-1, as wide as the j-th
                c = best[b - 1][j] + (i - j) * w[j] + call_slots
                if c < best[b][i]:
                    best[b][i], cut[b][i] = c, j
    b = min(range(1, most + 1), key=lambda b: best[b][n])
    out, i = [], n
    while b:
        j = cut[b][i]
        out.append(order[j:i])
        i, b = j, b - 1
    return out[::-1]
