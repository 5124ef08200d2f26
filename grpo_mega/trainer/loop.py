"""The GRPO loop (docs/design.md, "One training step"): rollout -> reward -> advantage -> old/ref logprobs ->
update -> weight sync -> eval/save. `train()` only orchestrates: the run is built before it (grpo_mega.trainer.setup),
the per-step shaping of rewards, advantages and masks is algo's (grpo_mega.algo.shaping), the loss the
actor's. Every rank runs it; every sample is scored once, on the rank that trains it, and the scores reach
every rank, so advantages are the same everywhere. Each phase is timed (grpo_mega.trainer.timing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from grpo_mega.algo.correction import (
    QUANTILES,
    batch_mean,
    batch_mean_sums,
    histogram_quantiles,
    is_std,
    is_std_sums,
    log_ratio_histogram,
    offpolicy_maxs,
    offpolicy_metrics,
    offpolicy_sums,
    rejection_metrics,
    rejection_sums,
    rollout_weight,
)
from grpo_mega.algo.shaping import shape_step
from grpo_mega.parallel import comm
from grpo_mega.rollout.multi_turn import rollout_metrics
from grpo_mega.trainer.batch import RolloutBatch
from grpo_mega.trainer.sampling import collect_step
from grpo_mega.trainer.setup import Run
from grpo_mega.trainer.timing import StepTimer, model_flops, throughput, world_peak_flops


@dataclass
class History:
    initial_val_reward: Optional[float] = None
    """Before step 1 (None: evaluation off)."""
    rows: list[dict] = field(default_factory=list)


def train(run: Run, log: Optional[Callable[[dict], None]] = None) -> History:
    """Steps run.first_step..run.cfg.run.steps; returns the per-step metrics (identical on every rank)."""
    cfg, actor, rollouts = run.cfg, run.actor, run.rollouts
    temperature = cfg.rollout.temperature
    val = run.evaluate(0) if run.eval_due(0) else None
    history = History(initial_val_reward=val and val["val_reward"])
    for step in range(run.first_step, cfg.run.steps + 1):
        timer = StepTimer()
        run.begin_step()  # arms the hang watchdog
        got = collect_step(run, step, timer)  # generated and scored (refilled: algo.dynamic_sampling=refill)
        gen, samples, rewards, reward_metrics = got.gen, got.samples, got.rewards, got.metrics
        if (why := run.reward_budget.check(step, reward_metrics)) is not None:
            run.stop(step, why, trained=False)  # too many failed rewards: not trained on (trainer/guards.py)
        owned = run.routing.owned([len(e.prompt_ids) + len(t) for e, t in zip(samples, gen.token_ids)])
        rb = RolloutBatch.from_samples([e.prompt_ids for e in samples], gen.token_ids, gen.model_mask,
                                       gen.routed_experts)  # the engine's experts: replayed (algo.routing_replay)
        if not cfg.skips_old_logprob_pass:  # else the update's own logprobs are the old ones
            with timer("old_logprobs"):
                rb.old_logp = actor.logprobs(rb, temperature)
            routing = actor.routing_agreement()  # MoE: engine vs trainer routing on the same weights
        if run.reference is not None and not actor.full_kl_in_loss:  # the full KL's reference runs in the update
            with timer("ref_logprobs"):
                rb.ref_logp = run.reference.logprobs(rb, temperature)
        overlong = torch.tensor([f == "length" for f in gen.finish_reasons])
        shaped = shape_step(cfg.shaping(), rewards, overlong, rb.old_logp, rb.ref_logp, rb.response_mask(),
                            rb.response_lens)
        rb.advantages, rb.in_loss = shaped.advantages, shaped.in_loss
        if cfg.rollout.dump_dir and run.rank0:  # rank 0 holds every sample
            from grpo_mega.rollout.dump import write_dump

            write_dump(Path(cfg.rollout.dump_dir) / f"train_step_{step:08d}.jsonl", step, samples, gen,
                       rewards.tolist(), shaped.advantages.tolist(), run.tok)
        rb.engine_logp = engine_logprobs(gen, rb)
        if cfg.algo.rollout_is_batch_norm:  # the old logprobs are in (the config runs their pass)
            rb.is_batch_mean = world_is_batch_mean(rb, owned, cfg.algo.correction())
        with timer("update"):
            updates = actor.update(rb, temperature, run.reference)
        run.memory.report(step)  # run.memory_sites: what the peak so far is made of, after the first update only
        diverged = run.skips.check(step, updates)  # non-finite mini-batches in a row (stops after the metrics)
        if cfg.skips_old_logprob_pass:  # the update's own forward was the pass on the trainer's weights
            routing = actor.routing_agreement()
        mismatch, ratio_quantiles = world_mismatch(rb, owned), world_ratio_quantiles(rb, owned)
        offpolicy = world_offpolicy(rb, owned, actor.objective)
        with timer("generate_wait"):  # the next step's samples: a server's weights never change under a generation
            rollouts.wait()
        with timer("weight_sync"):
            run.after_update(step)
        timer.add("generate", rollouts.take_timing()[0])
        if run.eval_due(step):
            with timer("eval"):
                val = run.evaluate(step)
        stop = run.stop_requested()
        if run.save_due(step, stop):
            with timer("checkpoint"):
                run.save(step)
        row = dict(step=step, reward=float(shaped.rewards.mean()), **_val_metrics(val),
                   overlong_fraction=float(overlong.float().mean()), rows_in_loss=int(shaped.in_loss.sum()),
                   response_length=float(rb.response_lens.float().mean()), logprob_mismatch=mismatch,
                   weight_version=gen.weight_version, lr=actor.optimizer.param_groups[0]["lr"], **ratio_quantiles,
                   **offpolicy,
                   **update_means(updates), **routing, **reward_metrics, **rollout_metrics(gen), **rollouts.metrics(), **step_metrics(timer, updates, rb, cfg.algo.ppo_epochs, run.model))
        history.rows.append(row)
        if log is not None:
            log(row)
        if diverged is not None:
            run.stop(step, diverged, trained=True)
        if run.end_step(step, stop):
            break
    return history


def _val_metrics(val: Optional[dict]) -> dict:
    return {} if val is None else dict(val)


UPDATE_MEANS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "grad_norm", "is_weight_mean", "is_capped_fraction",
                "is_seq_capped_fraction", "pg_clipfrac_lower", "ppo_kl")


def update_means(updates: list[dict]) -> dict:
    """The step's loss metrics, averaged over its mini-batches (and epochs); skipped mini-batches counted.
    grad_norm is the mean over the mini-batches that stepped (a skipped one has none); NaN when none did."""
    # MoE models add moe/* (grpo_mega.models.moe_metrics: aux loss, per-expert token load), averaged the same way
    moe = sorted({k for u in updates for k in u if k.startswith("moe/")})
    stepped = [u["grad_norm"] for u in updates if not u["skipped"]]
    return {**{k: sum(u[k] for u in updates) / len(updates) for k in UPDATE_MEANS},
            "grad_norm": sum(stepped) / len(stepped) if stepped else float("nan"),
            **{k: sum(u[k] for u in updates if k in u) / sum(k in u for u in updates) for k in moe},
            "skipped": sum(u["skipped"] for u in updates)}


def world_mismatch(rb: RolloutBatch, owned: list[int]) -> float:
    """algo.logprob_mismatch over the whole batch, each rank summing the rows it owns (the only engine
    logprobs it may hold) and one SUM over the world (collective)."""
    mask = torch.zeros(rb.tokens.shape, dtype=torch.float64)
    index = torch.tensor(owned, dtype=torch.long)
    mask[index] = rb.response_mask()[index].to(torch.float64)
    sums = torch.stack([((rb.engine_logp.double() - rb.old_logp.double()).abs() * mask).sum(), mask.sum()])
    total, count = comm.world_all_reduce_sum(sums).tolist()
    return total / count if count else 0.0


def world_ratio_quantiles(rb: RolloutBatch, owned: list[int]) -> dict:
    """The quantiles of the token-level ratio rho = p_trainer_old / p_engine over the step's response tokens
    (`rollout_ratio/q01` .. `q99`; grpo_mega.algo.correction.histogram_quantiles: within one bin, about 1e-6
    near rho = 1): each rank histograms the rows it owns, one SUM over the world (collective)."""
    index = torch.tensor(owned, dtype=torch.long)
    mask = rb.response_mask()[index]
    lr = (rb.old_logp.double() - rb.engine_logp.double())[index][mask]
    counts = comm.world_all_reduce_sum(log_ratio_histogram(lr))
    return {f"rollout_ratio/q{round(q * 100):02d}": v for q, v in zip(QUANTILES, histogram_quantiles(counts))}


def world_is_batch_mean(rb: RolloutBatch, owned: list[int], correction) -> float:
    """algo.rollout_is_batch_norm: the correction's mean weight over the step's response tokens (token level) or
    responses (sequence, geometric), each rank summing the rows it owns, one SUM over the world (collective)."""
    index = torch.tensor(owned, dtype=torch.long)
    sums = batch_mean_sums(rb.old_logp[index], rb.engine_logp[index], rb.response_mask()[index], correction)
    return batch_mean(comm.world_all_reduce_sum(sums))


def world_offpolicy(rb: RolloutBatch, owned: list[int], objective) -> dict:
    """verl's off-policy diagnostics between the engine's and the trainer's old logprobs over the step's response
    tokens (`rollout_corr/kl`, `k3_kl`, `chi2_token`, `chi2_seq`, the perplexities and their ratio, log_ppl_diff's
    mean, max and min, and `ess` of the loss's token weights (correction and rejection), of rho itself when both are
    off; with a correction, `rollout_is_std`; with a rejection, its `rollout_rs_*`; grpo_mega.algo.correction):
    each rank sums the rows it owns and takes their maxima, one SUM and one MAX over the world (collective)."""
    index = torch.tensor(owned, dtype=torch.long)
    mask = rb.response_mask()[index]
    old, eng = rb.old_logp[index], rb.engine_logp[index]
    c, r = objective.correction, objective.rejection
    weight = rollout_weight(old, eng, mask, c, r)[0] if objective.rollout_weighted else None
    sums, maxs = [offpolicy_sums(old, eng, mask, weight)], [offpolicy_maxs(old, eng, mask)]
    if c is not None:
        sums.append(is_std_sums(old, eng, mask, c))
    if r is not None:
        rs_sums, rs_maxs = rejection_sums(old, eng, mask, r)
        sums.append(rs_sums)
        maxs.append(rs_maxs)
    total = comm.world_all_reduce_sum(torch.cat(sums)).split([len(x) for x in sums])
    top = torch.tensor(comm.world_max(torch.cat(maxs).tolist()), dtype=torch.float64).split([len(x) for x in maxs])
    out = offpolicy_metrics(total[0], top[0])
    if out and c is not None:
        out["rollout_corr/rollout_is_std"] = is_std(total[1])
    if r is not None:
        out.update(rejection_metrics(objective.rollout_rejection, r, total[-1], top[-1]))
    return out


def engine_logprobs(gen, rb: RolloutBatch) -> torch.Tensor:
    """[N, L] position-aligned: the rollout engine's logprob of each response token (docs/design.md, "Tokens,
    masks and logprobs")."""
    out = torch.zeros(rb.tokens.shape, dtype=torch.float32)
    for i, lps in enumerate(gen.logprobs):
        start = int(rb.prompt_lens[i]) - 1
        out[i, start : start + len(lps)] = torch.tensor(lps)
    return out


def step_metrics(timer: StepTimer, updates: list[dict], rb: RolloutBatch, epochs: int, model) -> dict:
    """The step's timing/* (reduced over ranks: collective), perf/* and batch/* metrics; `model`: the
    ModelConfig (perf/mfu's FLOPs)."""
    timing = timer.metrics()
    trained = rb.in_loss if rb.in_loss is not None else torch.ones(rb.size, dtype=torch.bool)
    lens = (rb.prompt_lens + rb.response_lens)[trained]
    computed = sum(u["computed_tokens"] for u in updates)
    return {
        **timing,
        **throughput(timing, float(lens.sum()) * epochs, float(rb.response_lens.sum()),
                     model_flops(model, lens.tolist()) * epochs, world_peak_flops()),
        "batch/pad_fraction": 1.0 - sum(u["useful_tokens"] for u in updates) / computed if computed else 0.0,
        "batch/micro_batches": sum(u["micro_batches"] for u in updates),
        "batch/dp_token_imbalance": max(u["dp_token_imbalance"] for u in updates),
    }
