"""The run's rollout engines as the trainer sees them: where they live (one by default, on global rank 0;
`rollout.num_engines` of them on evenly spaced ranks), how a batch of prompts is shared between them and
the samples returned to every rank, and the weight sync into all of them at once (grpo_mega.rollout.
weight_sync: one gather per bucket, one broadcast to every engine). Collective: every rank calls every
method."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch.distributed as dist

from grpo_mega.parallel import comm
from grpo_mega.engines import validate
from grpo_mega.engines.interface import Generation
from grpo_mega.engines.weight_sync import SyncRoute, sync_weights


class RolloutError(RuntimeError):
    """The rollout engine failed (it died, timed out, refused the request, or answered samples that break the
    contract: grpo_mega.engines.validate); raised on every rank. `transient`: a server that did not answer or
    answered 5xx, still so after the client's retries (the trainer exits 75 and the job is requeued)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def _failure(engine, rank: int, e: Exception, doing: str = "failed") -> "RolloutError":
    return RolloutError(f"the rollout engine ({type(engine).__name__}, on rank {rank}) {doing}: {type(e).__name__}: {e}",
                        transient=bool(getattr(e, "transient", False)))


class Engines:
    """The run's rollout engines: global rank `ranks[i]` hosts engine i (`local` on that rank, else None). Every
    Generation an engine returns is checked against `spec` (grpo_mega.engines.validate) before any rank sees it."""

    def __init__(self, factory: Callable[[], object], count: int = 1, spec: validate.OutputSpec = validate.OutputSpec()):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % count:
            raise ValueError(f"rollout.num_engines={count} must divide the number of ranks ({world})")
        self.ranks = [i * (world // count) for i in range(count)]
        self.spec = spec
        self.local, error = None, None
        if rank in self.ranks:
            try:
                self.local = factory()
            except Exception as e:  # noqa: BLE001 - reported on every rank below, before any training
                error = f"the rollout engine on rank {rank} did not start: {type(e).__name__}: {e}"
        errors = [e for e in comm.all_gather_objects(error) if e is not None]
        if errors:
            raise RolloutError(errors[0])
        self._route = None
        if count > 1 and rank == 0:
            print(f"rollout engines on ranks {self.ranks}", flush=True)

    def generate(self, prompts: list[list[int]], n, temperature, top_p, max_new, stop, seed,
                 to_all: bool = True, rows: Optional[list[dict]] = None) -> Optional[Generation]:
        """Each engine samples its contiguous share of `prompts` (and of their `rows`, given to multi-turn
        engines: grpo_mega.rollout.multi_turn); every rank gets all the samples, in order (without `to_all`,
        rank 0 only: None elsewhere, for grpo_mega.rollout.routing to share out). A failing engine becomes a
        RolloutError on every rank (the others would otherwise wait in the collective until its timeout)."""
        rank, k = dist.get_rank(), len(self.ranks)
        per = -(-len(prompts) // k)
        mine = None
        if self.local is not None:
            i = self.ranks.index(rank)
            share = prompts[i * per:(i + 1) * per]
            try:
                if share:
                    kw = {} if rows is None else {"rows": rows[i * per:(i + 1) * per]}
                    mine = self.local.generate(share, n, temperature, top_p, max_new, stop, seed, prompt_offset=i * per,
                                               **kw)
                    validate.check_generation(mine, self.spec, [len(p) for p in share for _ in range(n)])
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                mine = _failure(self.local, rank, e)
        if not to_all:  # to rank 0 (an engine rank); every rank learns of a failure
            if k == 1:
                parts = [mine] if rank == 0 else None
            else:
                everyone = comm.gather_objects(mine)
                parts = None if everyone is None else [everyone[r] for r in self.ranks]
            gen, error = None, None
            if parts is not None:
                error = next(((str(p), p.transient) for p in parts if isinstance(p, RolloutError)), None)
                try:
                    gen = None if error else self._join(parts)
                except RolloutError as e:
                    error = (str(e), e.transient)
            error = comm.broadcast_object(error)
            if error is not None:
                raise RolloutError(*error)
            return gen
        if k == 1:
            parts = [comm.broadcast_object(mine, src=self.ranks[0])]
        else:
            everyone = comm.all_gather_objects(mine)
            parts = [everyone[r] for r in self.ranks]
        for part in parts:
            if isinstance(part, RolloutError):
                raise part
        return self._join(parts)

    @staticmethod
    def _join(parts: list) -> Generation:
        """The engines' answers, in order, as one Generation."""
        parts = [g for g in parts if g is not None]
        versions = {g.weight_version for g in parts}
        if len(versions) > 1:
            raise RolloutError(f"the rollout engines answered with different weight versions {sorted(versions)}")
        if len(parts) == 1:
            return parts[0]
        masks = None
        if any(g.model_mask is not None for g in parts):
            masks = [m for g in parts for m in (g.model_mask or [[1] * len(t) for t in g.token_ids])]
        extra = {}
        if any("multi_turn" in g.extra for g in parts):
            from grpo_mega.rollout.multi_turn import join_stats

            extra["multi_turn"] = join_stats([g.extra.get("multi_turn") for g in parts])
        routed = None
        if any(g.routed_experts is not None for g in parts):
            routed = [r for g in parts for r in (g.routed_experts or [None] * len(g.token_ids))]
        trajectories = None
        if any(g.trajectories is not None for g in parts):
            trajectories = [t for g in parts for t in (g.trajectories or [None] * len(g.token_ids))]
        return Generation(token_ids=[t for g in parts for t in g.token_ids], logprobs=[lp for g in parts for lp in g.logprobs],
                          finish_reasons=[f for g in parts for f in g.finish_reasons], weight_version=parts[0].weight_version,
                          extra=extra, model_mask=masks, routed_experts=routed, trajectories=trajectories)

    def sync(self, gpt, version: int, **kwargs):
        """The trainer's weights into every engine (collective): each bucket gathered once and broadcast to
        all engines. A failure on any engine (or an audit mismatch) raises on every rank. Returns the
        stats on rank 0 (an engine rank), seconds for all engines."""
        t0 = time.perf_counter()
        if self._route is None:
            self._route = SyncRoute(self.ranks)  # collective: creates the broadcast groups, once
        stats, error = None, None
        try:
            stats = sync_weights(gpt, engine=self.local, version=version, route=self._route, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = (f"weight sync into the rollout engine on rank {dist.get_rank()} failed: {type(e).__name__}: {e}",
                     bool(getattr(e, "transient", False)))
        errors = [e for e in comm.all_gather_objects(error) if e is not None]
        if errors:
            raise RolloutError(errors[0][0] + (f" (and {len(errors) - 1} more engines)" if len(errors) > 1 else ""),
                               transient=all(t for _, t in errors))
        if stats is not None:
            stats.seconds = time.perf_counter() - t0
        return stats if dist.get_rank() == self.ranks[0] else None

    def shutdown(self) -> None:
        if self.local is not None:
            self.local.shutdown()
