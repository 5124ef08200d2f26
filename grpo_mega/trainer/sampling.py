"""A step's scored samples: the scheduler's batch, scored once; under `algo.dynamic_sampling=refill` more rounds
of prompts (drawn from the task's data cursor, each with its own seed) until `batch.train_batch_size`
informative groups are held or `algo.max_gen_rounds` rounds ran, then the step's groups picked by
grpo_mega.algo.dynamic_sampling's slot rule and shared out again to the ranks that train them.

Rank 0 holds every round's whole Generation (grpo_mega.rollout.routing), so it assembles the step's; every
rank holds every round's rewards (grpo_mega.rewards.scoring). Nothing here outlives the step: a resume draws
and generates the same rounds again from the checkpoint's data cursor and the step's seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpo_mega.algo import dynamic_sampling as ds
from grpo_mega.algo.shaping import overlong_rewards
from grpo_mega.rewards.scoring import score_step
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.scheduler import StepSamples


@dataclass
class ScoredStep:
    samples: list
    """One example per response, group-contiguous."""
    gen: Generation
    rewards: torch.Tensor
    """[N] the task's rewards (before overlong handling), the same on every rank."""
    metrics: dict
    """reward/* (summed over rounds) and, with refill, dynamic_sampling/*."""


def _score(run, got: StepSamples, step: int) -> tuple[list, torch.Tensor, dict]:
    n = run.n
    samples = [got.examples[i // n] for i in range(len(got.gen.token_ids))]
    owned = run.routing.owned([len(e.prompt_ids) + len(t) for e, t in zip(samples, got.gen.token_ids)])
    rewards, metrics = score_step(run.task.reward, samples, got.gen.token_ids, step, owned, got.gen.trajectories)
    return samples, rewards, metrics


def _add(total: dict, more: dict) -> dict:
    return {k: total.get(k, 0.0) + more.get(k, 0.0) for k in {**total, **more}}


def collect_step(run, step: int, timer) -> ScoredStep:
    """Collective: step `step`'s samples and rewards (timed as generate_wait and reward)."""
    cfg, rollouts, n = run.cfg, run.rollouts, run.n
    refill = cfg.algo.dynamic_sampling == "refill"
    with timer("generate_wait"):  # one step ahead, the next step's generation starts in here (after refill's rounds)
        got = rollouts.result(step, submit_next=not refill)
    with timer("reward"):  # each sample scored once, by its owner; the same scores on every rank
        samples, rewards, metrics = _score(run, got, step)
    if not refill:
        return ScoredStep(samples, got.gen, rewards, metrics)
    rounds, round_rewards = [got], [rewards]

    def mask(got: StepSamples, rewards: torch.Tensor) -> torch.Tensor:
        overlong = torch.tensor([f == "length" for f in got.gen.finish_reasons])
        return ds.informative(overlong_rewards(rewards, overlong, cfg.reward.overlong), n)

    masks = [mask(got, rewards)]
    want = cfg.batch.train_batch_size
    while not ds.enough(masks, want) and len(rounds) < cfg.algo.max_gen_rounds:
        with timer("generate_wait"):
            more = rollouts.extra(step, len(rounds))
        with timer("reward"):
            _, more_rewards, more_metrics = _score(run, more, step)
        rounds.append(more)
        round_rewards.append(more_rewards)
        masks.append(mask(more, more_rewards))
        metrics = _add(metrics, more_metrics)
    picks = ds.refill_slots(masks, want)
    metrics.update(ds.refill_counts(masks, picks))
    rollouts.submit_next(step)  # one step ahead: the next step's draw comes after this step's extra rounds
    if picks == [(0, g) for g in range(want)]:
        return ScoredStep(samples, got.gen, rewards, metrics)
    examples = [rounds[r].examples[g] for r, g in picks]
    rows = [(r, g * n + j) for r, g in picks for j in range(n)]
    whole = dist.get_rank() == 0 or rollouts.share is None  # who holds every round's samples
    gen = rollouts.reshare(_pick([x.gen for x in rounds], rows) if whole else None, examples)
    rewards = torch.stack([round_rewards[r][i] for r, i in rows])
    return ScoredStep([examples[i // n] for i in range(len(rows))], gen, rewards, metrics)


def _pick(gens: list[Generation], rows: list[tuple[int, int]]) -> Generation:
    """The (round, row) samples of the rounds' Generations as one, in order. Its weight version is the oldest
    one used (off-policy: round 0 is a version behind the later rounds; the correction sees each token's own
    engine logprob)."""
    masks = None
    if any(g.model_mask is not None for g in gens):
        masks = [(gens[r].model_mask or [[1] * len(t) for t in gens[r].token_ids])[i] for r, i in rows]
    extra = {}
    if any("multi_turn" in g.extra for g in gens):
        from grpo_mega.rollout.multi_turn import select_stats

        extra["multi_turn"] = select_stats([g.extra["multi_turn"] for g in gens], rows)
    routed = None
    if any(g.routed_experts is not None for g in gens):
        routed = [(gens[r].routed_experts or [None] * len(gens[r].token_ids))[i] for r, i in rows]
    trajectories = None
    if any(g.trajectories is not None for g in gens):
        trajectories = [(gens[r].trajectories or [None] * len(gens[r].token_ids))[i] for r, i in rows]
    return Generation(token_ids=[gens[r].token_ids[i] for r, i in rows], logprobs=[gens[r].logprobs[i] for r, i in rows],
                      finish_reasons=[gens[r].finish_reasons[i] for r, i in rows],
                      weight_version=min(gens[r].weight_version for r in {r for r, _ in rows}),
                      extra=extra, model_mask=masks, routed_experts=routed, trajectories=trajectories)
