"""Samples to the DP replicas that train them: rank 0 holds a step's whole Generation (from the rollout servers,
or gathered from the colocated engines); every other rank gets only the responses its DP replica runs.

What every rank needs of every sample is small: its response length, finish reason, and the weight version;
rank 0 broadcasts those. From the lengths alone every rank computes the same plan (the trainer's
`dp_rows`: which rows each DP rank runs in the logprob pass and in each mini-batch of the update), and rank 0
scatters to each rank the token ids, engine logprobs (and, for routing replay, the engine's routed experts; for
multi-turn, the model mask and the turns) of its replica's rows, nothing else. The other rows
are placeholders of the right length (token 0, logprob 0.0): they fill [N, L] tensors whose rows are never
read on that rank.

Each sample is also given one owner rank (`owned`): its replica in the logprob pass (a partition of the
batch), spread round-robin over that replica's ranks. The owner scores it and counts it in the step's
per-sample metrics (summed over the world), so every sample is scored once, by a rank that holds it. A
scorer that runs on one rank (`on_one_rank`) runs on rank 0, which holds every sample. Collective: every rank
calls every method in the same order."""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from grpo_mega.parallel import comm
from grpo_mega.engines.interface import Generation


class Routing:
    """`rows_for(seq_lens) -> (logprob-pass shares, all rows)`, each a list per DP rank (Actor.dp_rows).
    Built collectively (it learns every global rank's DP rank)."""

    def __init__(self, rows_for: Callable[[list[int]], tuple[list[list[int]], list[list[int]]]]):
        from megatron.core import parallel_state as ps

        self.rows_for = rows_for
        self.dp_of = comm.all_gather_objects(ps.get_data_parallel_rank())  # by global rank
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.sent_rows = 0  # on rank 0: responses scattered to other ranks by the last share()

    def share(self, gen: Optional[Generation], prompt_lens: list[int]) -> Generation:
        """Rank 0's `gen` (None elsewhere) as every rank needs it: whole on rank 0, this replica's rows
        elsewhere (the rest placeholders), finish reasons and weight version everywhere."""
        meta = comm.broadcast_object(None if gen is None else ([len(t) for t in gen.token_ids], gen.finish_reasons,
                                                               gen.weight_version, gen.extra.get("multi_turn"),
                                                               gen.routed_experts is not None))
        lens, finish, version, multi_turn, with_routes = meta
        needs = self.rows_for([p + r for p, r in zip(prompt_lens, lens)])[1]
        payloads = None
        if self.rank == 0:
            masks, routed, trajs = gen.model_mask, gen.routed_experts, gen.trajectories
            payloads = [None if r == 0 else {i: (gen.token_ids[i], gen.logprobs[i], masks and masks[i],
                                                 routed and routed[i], trajs and trajs[i]) for i in needs[d]}
                        for r, d in enumerate(self.dp_of)]
            self.sent_rows = sum(len(p) for p in payloads if p is not None)
        mine = comm.scatter_objects(payloads)
        if self.rank == 0:
            return gen
        token_ids = [[0] * n for n in lens]
        logprobs = [[0.0] * n for n in lens]
        masks = None if multi_turn is None else [[1] * n for n in lens]  # placeholders, like the tokens
        routed = [None] * len(lens) if with_routes else None  # the routes of this replica's rows only
        trajectories = None if multi_turn is None else [None] * len(lens)  # turns of this replica's rows only
        for i, (t, lp, m, rt, tr) in mine.items():
            token_ids[i], logprobs[i] = t, lp
            if masks is not None and m is not None:
                masks[i] = m
            if routed is not None:
                routed[i] = rt
            if trajectories is not None:
                trajectories[i] = tr
        extra = {"held": sorted(mine)}
        if multi_turn is not None:
            extra["multi_turn"] = multi_turn
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reasons=finish, weight_version=version,
                          extra=extra, model_mask=masks, routed_experts=routed, trajectories=trajectories)

    def owned(self, seq_lens: list[int]) -> list[int]:
        """The rows this rank owns (scores and counts): each row once in the world, on a rank that holds it."""
        first = self.rows_for(seq_lens)[0]
        ranks = [r for r, d in enumerate(self.dp_of) if d == self.dp_of[self.rank]]
        k = ranks.index(self.rank)
        return first[self.dp_of[self.rank]][k::len(ranks)]
