"""How a step's samples are split over the data-parallel ranks: each rank's rows (balanced by tokens, padded
to shapes that every rank shares where the layout needs it) and the layout the update runs on.
"""

from __future__ import annotations

from typing import Optional

import torch

from grpo_mega.conf.batch import BatchConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.parallel import cpu_compat
from grpo_mega.trainer.batch import RolloutBatch, micro_batches


def parallel_state():
    from megatron.core import parallel_state as ps

    return ps


def pad_multiple(parallel: ParallelConfig) -> int:
    return parallel.tp if parallel.sequence_parallel else 1


def same_over_ranks(parallel: ParallelConfig) -> bool:
    """Every DP rank's i-th micro-batch has one shape (cpu_compat.needs_equal_micro_batch_shapes)."""
    return cpu_compat.needs_equal_micro_batch_shapes(parallel.ep)


def chunk_of(size: int, batch: BatchConfig) -> Optional[int]:
    """The update's mini-batch size in responses when a batch of `size` is several of them, else None: a pass
    over the whole step batch then gives each DP rank the rows it trains (the logprob passes)."""
    if size % batch.mini_batches_per_step:
        return None
    per_mini = batch.mini_batch_responses(size)
    return per_mini if size > per_mini else None


def padded_shares(size: int, dp: int, chunk: Optional[int]) -> list[list[int]]:
    """Without packing: contiguous DP shares of each chunk (of the whole batch without one), joined per rank."""
    chunk = chunk or size
    if chunk % dp:
        raise ValueError(f"{chunk} responses do not split over dp={dp} ranks")
    per = chunk // dp
    return [[i for start in range(0, size, chunk) for i in range(start + r * per, start + (r + 1) * per)]
            for r in range(dp)]


def dp_shares(seq_lens: list[int], parallel: ParallelConfig, batch: BatchConfig, dp: int,
              chunk: Optional[int] = None) -> list[list[int]]:
    """The rows (sequence indices) each DP rank runs in one pass over `seq_lens`, as `layout` assigns them:
    from the lengths alone, the same on every rank."""
    from grpo_mega.trainer.batch import plan_packing

    if batch.packing:
        plan = plan_packing(seq_lens, dp, batch.token_budget, pad_multiple(parallel), same_length=parallel.pp > 1,
                            chunk=chunk, same_over_ranks=same_over_ranks(parallel))
        return [sorted(i for row in plan.rows[r] for i in row) for r in range(dp)]
    return padded_shares(len(seq_lens), dp, chunk)


def dp_rows(seq_lens: list[int], parallel: ParallelConfig, batch: BatchConfig, dp: int
            ) -> tuple[list[list[int]], list[list[int]]]:
    """Actor.dp_rows for `dp` DP ranks."""
    first = dp_shares(seq_lens, parallel, batch, dp, chunk_of(len(seq_lens), batch))
    needs = [set(rows) for rows in first]
    per_mini = chunk_of(len(seq_lens), batch) or len(seq_lens)
    for start in range(0, len(seq_lens), per_mini):
        for r, rows in enumerate(dp_shares(seq_lens[start:start + per_mini], parallel, batch, dp)):
            needs[r].update(start + i for i in rows)
    return first, [sorted(n) for n in needs]


def layout(rollout: RolloutBatch, parallel: ParallelConfig, batch: BatchConfig,
           chunk: Optional[int] = None) -> tuple[list[dict], int, dict]:
    """This DP rank's micro-batches of `rollout`, their (longest) length, and the layout's figures on every
    rank: micro_batches (per rank), computed and useful tokens (all ranks), dp_token_imbalance.

    Packed (batch.packing): sequences balanced over DP ranks by tokens and packed into rows of at most
    batch.token_budget tokens (docs/design.md, "Batch semantics"); with pipeline parallelism every row of a
    rank is padded to the
    rank's longest (one tensor shape for the schedule's point-to-point sends). Padded: contiguous DP shares
    in micro_batch_size rows, each trimmed to its share's longest. With `chunk`, the DP shares are those of
    each run of `chunk` rows (the update's mini-batches) joined: each rank runs the rows it will train. Every
    micro-batch carries `rows`, the indices of its sequences in `rollout`."""
    from grpo_mega.trainer.batch import packed_micro_batches, plan_packing

    ps = parallel_state()
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    seq_lens = (rollout.prompt_lens + rollout.response_lens).tolist()
    pad = pad_multiple(parallel)
    if batch.packing:
        plan = plan_packing(seq_lens, dp, batch.token_budget, pad, same_length=parallel.pp > 1, chunk=chunk,
                            same_over_ranks=same_over_ranks(parallel))
        micro = packed_micro_batches(rollout, plan, rank)
        stats = dict(micro_batches=plan.micro_batches, computed_tokens=plan.computed, useful_tokens=plan.useful,
                     dp_token_imbalance=plan.dp_token_imbalance(seq_lens))
        return micro, max(plan.lengths[rank]), stats
    shares = padded_shares(rollout.size, dp, chunk)
    computed, per_rank = 0, []
    for rows in shares:
        longest = max(seq_lens[i] for i in rows)
        computed += len(rows) * max(pad, -(-longest // pad) * pad)
        per_rank.append(sum(seq_lens[i] for i in rows))
    index = torch.tensor(shares[rank], dtype=torch.long)
    longest = max(seq_lens) if same_over_ranks(parallel) else None
    micro, length = micro_batches(rollout.rows_at(index), batch.micro_batch_size, pad, longest)
    for mb in micro:
        mb["rows"] = index[mb["rows"]]
    mean = sum(per_rank) / dp
    stats = dict(micro_batches=len(micro), computed_tokens=computed, useful_tokens=sum(seq_lens),
                 dp_token_imbalance=max(per_rank) / mean if mean else 1.0)
    return micro, length, stats
