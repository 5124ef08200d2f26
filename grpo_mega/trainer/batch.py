"""The step's responses as padded tensors, and how they are cut into DP shares and micro-batches.

Everything is in position space: row i holds prompt_i + response_i right-padded to L, and per-token
quantities (logprobs, masks) sit at the position of the logits that predict the token. Response token t of
row i is predicted by the logits at position prompt_len_i + t - 1 (DESIGN.md), so the response mask is 1
exactly on positions [P_i - 1, P_i - 1 + R_i): built from lengths, never from a pad id.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch


@dataclass
class RolloutBatch:
    """All of a step's responses, group-contiguous (rows [g*n, (g+1)*n) answer prompt g), on every rank."""

    tokens: torch.Tensor  # [N, L] int64, prompt + response, right-padded with 0
    prompt_lens: torch.Tensor  # [N] int64
    response_lens: torch.Tensor  # [N] int64
    advantages: Optional[torch.Tensor] = None  # [N] float32, one per response
    old_logp: Optional[torch.Tensor] = None  # [N, L] float32, position-aligned
    ref_logp: Optional[torch.Tensor] = None  # [N, L] float32, position-aligned
    engine_logp: Optional[torch.Tensor] = None  # [N, L] float32, position-aligned: the rollout engine's logprobs
    in_loss: Optional[torch.Tensor] = None  # [N] bool: rows that count in the loss (overlong=mask, dynamic sampling)

    @classmethod
    def from_samples(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> "RolloutBatch":
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if len(p) < 1:
                raise ValueError(f"sample {i}: empty prompt (at least one token is needed to predict from)")
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        tokens = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            tokens[i, : lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        return cls(
            tokens=tokens,
            prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
            response_lens=torch.tensor([len(r) for r in responses], dtype=torch.long),
        )

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def labels(self) -> torch.Tensor:
        """[N, L]: the token each position's logits predict (the last position predicts nothing: 0)."""
        out = torch.zeros_like(self.tokens)
        out[:, :-1] = self.tokens[:, 1:]
        return out

    def response_mask(self) -> torch.Tensor:
        """[N, L] bool: positions whose logits predict a response token (EOS/stop included)."""
        pos = torch.arange(self.tokens.shape[1]).unsqueeze(0)
        start = (self.prompt_lens - 1).unsqueeze(1)
        return (pos >= start) & (pos < start + self.response_lens.unsqueeze(1))

    def loss_mask(self) -> torch.Tensor:
        """[N, L] bool: the response mask, less the rows excluded from the loss (`in_loss`)."""
        m = self.response_mask()
        return m if self.in_loss is None else m & self.in_loss.bool().unsqueeze(1)

    def rows(self, lo: int, hi: int) -> "RolloutBatch":
        """Rows [lo, hi), every tensor sliced alike."""
        f = lambda t: None if t is None else t[lo:hi]  # noqa: E731
        return replace(
            self, tokens=self.tokens[lo:hi], prompt_lens=self.prompt_lens[lo:hi], response_lens=self.response_lens[lo:hi],
            advantages=f(self.advantages), old_logp=f(self.old_logp), ref_logp=f(self.ref_logp), in_loss=f(self.in_loss),
            engine_logp=f(self.engine_logp),
        )


def micro_batches(batch: RolloutBatch, micro_batch_size: int, pad_multiple: int = 1) -> tuple[list[dict], int]:
    """Cut `batch` into micro-batch dicts for Megatron's schedule, all trimmed to one length L' (the longest
    row, rounded up to `pad_multiple`: sequence parallelism needs L' divisible by tp). Returns (dicts, L')."""
    if batch.size % micro_batch_size:
        raise ValueError(f"{batch.size} responses do not split into micro-batches of {micro_batch_size}")
    used = int((batch.prompt_lens + batch.response_lens).max())
    length = -(-used // pad_multiple) * pad_multiple
    length = max(length, pad_multiple)

    def fit(t: torch.Tensor, fill=0) -> torch.Tensor:
        if t.shape[1] >= length:
            return t[:, :length]
        pad = torch.full((t.shape[0], length - t.shape[1]), fill, dtype=t.dtype)
        return torch.cat([t, pad], dim=1)

    tokens, labels, mask = fit(batch.tokens), fit(batch.labels()), fit(batch.loss_mask())
    out = []
    for lo in range(0, batch.size, micro_batch_size):
        sl = slice(lo, lo + micro_batch_size)
        b = micro_batch_size
        mb = dict(
            tokens=tokens[sl].contiguous(),
            position_ids=torch.arange(length).expand(b, length).contiguous(),
            labels=labels[sl].contiguous(),
            mask=mask[sl].contiguous(),
        )
        if batch.advantages is not None:
            mb["advantages"] = batch.advantages[sl].float()
        if batch.old_logp is not None:
            mb["old_logp"] = fit(batch.old_logp[sl].float())
        if batch.ref_logp is not None:
            mb["ref_logp"] = fit(batch.ref_logp[sl].float())
        if batch.engine_logp is not None:
            mb["engine_logp"] = fit(batch.engine_logp[sl].float())
        out.append(mb)
    return out, length
