"""Batch sizes, micro-batching, packing and memory (batch.*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from grpo_mega.conf.rules import positive

if TYPE_CHECKING:
    from grpo_mega.conf.parallel import ParallelConfig


@dataclass(kw_only=True)
class BatchConfig:
    """Batch semantics (docs/design.md, "Batch semantics"). All sizes global, counted in prompts unless named
    otherwise."""

    train_batch_size: int = 8
    """Prompts per step."""
    ppo_mini_batch_size: int = 4
    """Prompts per mini-batch: one optimizer step each."""
    micro_batch_size: int = 2
    """Responses per forward on one rank, without packing: bounds memory only. With packing it sets the
    default token budget (micro_batch_size * (max_prompt_length + max_response_length))."""
    max_prompt_length: int = 256
    """Longest prompt in tokens."""
    max_response_length: int = 256
    """Longest response in tokens (DrGRPO's constant)."""
    logprob_chunk_size: Optional[int] = None
    """Tokens per chunk in the vocab-parallel logprob/entropy/KL op (null: with fused_output, as many as make one
    fp32 [chunk, vocab/tp] tensor 256 MiB; without, the whole micro-batch)."""
    fused_output: bool = True
    """The output layer fused into the logprob/entropy/KL op (grpo_mega/parallel/fused_output.py): logits made
    and reduced chunk by chunk, made again in the backward, so no [tokens, vocab/tp] tensor beyond one chunk
    exists; false: the output layer's whole logits, then the op. Same results either way."""
    response_only_logits: bool = True
    """Only the positions the loss reads (those predicting a response token) go through the output layer and
    the logprob/entropy/KL op; false: every position, prompts and padding included. Same gradient either way."""
    packing: bool = True
    """Pack each DP rank's sequences back to back into rows of at most max_tokens_per_micro_batch tokens (one
    row per micro-batch; each sequence attends only to itself), balanced over DP ranks by tokens. false: rows
    padded to the longest, micro_batch_size rows per micro-batch. The gradient is the same either way."""
    max_tokens_per_micro_batch: Optional[int] = None
    """With packing: the token budget of one micro-batch (one packed row) on one rank; it bounds activation
    memory. null: micro_batch_size * (max_prompt_length + max_response_length), the padded path's worst case.
    At least max_prompt_length + max_response_length, so that any one sequence fits."""

    def __post_init__(self):
        for f in ("train_batch_size", "ppo_mini_batch_size", "micro_batch_size", "max_prompt_length", "max_response_length"):
            positive(f"batch.{f}", getattr(self, f))
        if self.logprob_chunk_size is not None:
            positive("batch.logprob_chunk_size", self.logprob_chunk_size)
        if self.max_tokens_per_micro_batch is not None:
            positive("batch.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
            longest = self.max_prompt_length + self.max_response_length
            if self.max_tokens_per_micro_batch < longest:
                raise ValueError(
                    f"batch.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} is smaller than "
                    f"max_prompt_length + max_response_length = {self.max_prompt_length} + "
                    f"{self.max_response_length} = {longest}: the longest sequence would not fit; raise it to "
                    f"at least {longest}"
                )
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={self.train_batch_size} must be a multiple of "
                f"ppo_mini_batch_size={self.ppo_mini_batch_size}"
            )

    @property
    def token_budget(self) -> int:
        """Tokens per packed micro-batch (max_tokens_per_micro_batch, or its default)."""
        if self.max_tokens_per_micro_batch is not None:
            return self.max_tokens_per_micro_batch
        return self.micro_batch_size * (self.max_prompt_length + self.max_response_length)

    def check_layout(self, parallel: "ParallelConfig", dp: int, n: int) -> None:
        """The batch against the layout: without packing, mini-batches split into DP ranks x micro-batches;
        with packing under sequence parallelism, the token budget divides by tp (rows are cut into tp
        sequence shards)."""
        if not self.packing:
            self.check_dp(dp, n)
        self.check_packing(parallel)

    def check_packing(self, parallel: "ParallelConfig") -> None:
        """With packing under sequence parallelism, the token budget must divide by tp."""
        if self.packing and parallel.sequence_parallel and self.token_budget % parallel.tp:
            raise ValueError(
                f"batch.max_tokens_per_micro_batch={self.token_budget} is not divisible by parallel.tp={parallel.tp}: "
                f"with sequence parallelism a packed row is cut into tp shards; make it a multiple of {parallel.tp}"
            )

    def check_dp(self, dp: int, n: int) -> None:
        """Without packing, each mini-batch's responses (ppo_mini_batch_size * rollout.n) must split evenly
        into DP ranks x micro-batches."""
        responses = self.ppo_mini_batch_size * n
        if responses % (dp * self.micro_batch_size):
            raise ValueError(
                f"a mini-batch of ppo_mini_batch_size * rollout.n = {self.ppo_mini_batch_size} * {n} = "
                f"{responses} responses does not split into dp={dp} ranks x micro_batch_size={self.micro_batch_size}; "
                f"make it a multiple of {dp * self.micro_batch_size}"
            )

    @property
    def mini_batches_per_step(self) -> int:
        return self.train_batch_size // self.ppo_mini_batch_size

    def mini_batch_responses(self, step_responses: int) -> int:
        """Responses per mini-batch of a step of `step_responses` (train_batch_size * rollout.n): the step
        splits into mini_batches_per_step equal mini-batches, one optimizer step each."""
        if step_responses % self.mini_batches_per_step:
            raise ValueError(f"{step_responses} responses do not split into batch.train_batch_size / "
                             f"batch.ppo_mini_batch_size = {self.mini_batches_per_step} mini-batches")
        return step_responses // self.mini_batches_per_step
