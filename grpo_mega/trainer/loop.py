"""The GRPO loop, as docs/design.md's "One training step": rollout -> reward -> advantage -> old/ref
logprobs -> update ->
weight sync -> eval/metrics. Every rank runs it; the rollout engines (one by default, on global rank 0;
`rollout.num_engines` spreads them evenly over the ranks, e.g. one per node) each sample a contiguous share
of the prompts (or dedicated servers answer them: rollout.placement), and every rank receives all the
samples. Each sample is scored once, on one rank (grpo_mega.rewards.scoring), and the scores reach every
rank, so advantages are computed identically everywhere. Each phase is timed (grpo_mega.trainer.timing).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from grpo_mega import algo
from grpo_mega.conf.schema import AlgoConfig, BatchConfig, ModelConfig, OptimConfig, ParallelConfig, PrecisionConfig
from grpo_mega.parallel import comm
from grpo_mega.rewards.scoring import score_step
from grpo_mega.rollout.placement import Engines
from grpo_mega.rollout.routing import Routing
from grpo_mega.rollout.scheduler import RolloutScheduler, SamplingArgs
from grpo_mega.trainer.actor import Actor, Reference
from grpo_mega.trainer.batch import RolloutBatch
from grpo_mega.trainer.timing import StepTimer, throughput


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling and weight sync."""

    engine: str = "embedded"
    """'embedded' or 'sglang'."""
    n: Optional[int] = None
    """Responses per prompt; verl's spelling of batch.n (set one of them)."""
    temperature: float = 1.0
    top_p: float = 1.0
    engine_tp: int = 1
    """The SGLang engine's tensor-parallel size (its own; the trainer's parallel.tp need not match)."""
    gpu_memory_fraction: Optional[float] = None
    """SGLang's mem_fraction_static: the share of each GPU the colocated engine keeps (weights + KV cache);
    null: SGLang's default. tools/plan.py counts it against the trainer's memory."""
    num_engines: int = 1
    """Rollout engines, on global ranks 0, W/k, 2W/k, ...: each samples a contiguous share of the prompts
    (the samples do not depend on k). On a cluster, one per node (with engine_tp = GPUs per node)."""
    sync_bucket_mb: float = 64.0
    """Weight-sync bucket size."""
    audit_weights: bool = False
    """Checksum every synced tensor against the engine's copy."""
    placement: str = "colocated"
    """'colocated': engines inside trainer ranks, phases in turn. 'dedicated': the engines are the servers
    in `servers` (SGLang's HTTP API; `python -m grpo_mega.rollout.standin_server` is the CPU stand-in), spoken to
    from global rank 0."""
    servers: list[str] = field(default_factory=list)
    """Dedicated placement: the servers' URLs, e.g. [http://10.0.0.5:30000, http://10.0.0.6:30000]."""
    server_timeout_s: float = 300.0
    """Dedicated placement: the longest a server may take to answer one request (a generate included)."""
    off_policy_steps: int = 0
    """0: each step generates, then trains. 1 (placement=dedicated): step k+1's samples are generated on the
    servers while step k trains, from the weights step k-1 trained from (one version behind; samples of step
    k >= 2 carry weight version k-2, version v being the weights after v steps); truncated importance
    correction (algo.engine_is_cap, default 2.0 here) covers the lag."""

    def __post_init__(self):
        if self.placement not in ("colocated", "dedicated"):
            raise ValueError(f"rollout.placement={self.placement!r} must be 'colocated' or 'dedicated'")
        if self.placement == "dedicated" and not self.servers:
            raise ValueError("rollout.placement=dedicated needs rollout.servers=[http://host:port,...]")
        if self.placement == "colocated" and self.servers:
            raise ValueError(f"rollout.servers={list(self.servers)} is for rollout.placement=dedicated; "
                             "set it, or drop the servers")
        if self.placement == "dedicated" and self.num_engines != 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be 1 with placement=dedicated "
                             "(one client on rank 0 spreads the prompts over rollout.servers)")
        if self.off_policy_steps not in (0, 1):
            raise ValueError(f"rollout.off_policy_steps={self.off_policy_steps} must be 0 or 1")
        if self.off_policy_steps and self.placement != "dedicated":
            raise ValueError(f"rollout.off_policy_steps={self.off_policy_steps} needs rollout.placement=dedicated "
                             f"(got {self.placement!r}): generation overlaps training only on servers of their own; "
                             "set rollout.placement=dedicated rollout.servers=[http://host:port]")
        if self.server_timeout_s <= 0:
            raise ValueError(f"rollout.server_timeout_s={self.server_timeout_s} must be > 0")
        if self.num_engines < 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be >= 1")
        if self.engine_tp < 1:
            raise ValueError(f"rollout.engine_tp={self.engine_tp} must be >= 1")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction < 1:
            raise ValueError(f"rollout.gpu_memory_fraction={self.gpu_memory_fraction} must be in (0, 1)")


@dataclass(kw_only=True)
class RunConfig:
    steps: int = 40
    seed: int = 1234


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = ""
    """Checkpoint root ('' : no checkpoints)."""
    interval: int = 0
    """Save every this many steps (0: only at the end)."""
    keep_last: Optional[int] = None
    """Keep this many newest checkpoints (null: all)."""
    resume: str = "auto"
    """'auto': continue from the newest checkpoint in `dir` that verifies (start fresh when there is none; an
    error when there are some and none verifies); 'never'; or the path of one step_XXXXXXXX directory."""
    stop_file: str = ""
    """When this file appears, checkpoint after the current step and stop (slurm/train.sbatch creates it on
    USR1, before a time limit or preemption, and requeues the job; the restart loses nothing)."""
    export_hf: bool = False
    """Also write the actor as an HF directory (`hf/`, loadable by transformers/SGLang) into every checkpoint.
    Any checkpoint can be exported later: tools/convert_mcore_to_hf.py --ckpt DIR/step_XXXXXXXX."""

    def __post_init__(self):
        if self.resume not in ("auto", "never") and not self.resume.rstrip("/").split("/")[-1].startswith("step_"):
            raise ValueError(f"checkpoint.resume={self.resume!r} must be 'auto', 'never' or a checkpoint's "
                             "step_XXXXXXXX directory")
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval={self.interval} must be >= 0 (0: only at the end)")
        if self.resume not in ("auto", "never") and not self.dir:
            self.dir = str(Path(self.resume).parent)  # continue writing next to the checkpoint resumed from
        if (self.interval or self.export_hf) and not self.dir:
            raise ValueError("checkpoint.interval / checkpoint.export_hf need checkpoint.dir=PATH")


@dataclass(kw_only=True)
class EvalConfig:
    interval: int = 5
    """Validate every this many steps (and at step 0 and the end)."""
    pass_k: int = 4
    """Validation also samples k responses per prompt at the rollout temperature: pass@k."""


@dataclass(kw_only=True)
class Task:
    """What the loop trains on: prompts, a reward, a validation set, the stop token."""

    train_batch: Callable[[int], list]  # size -> examples with .prompt_ids
    validation: Callable[[], list]
    reward: Callable[[object, list[int]], float]
    """Per sample (validation); a rewards.scoring.StepScorer also scores a step's samples, once each."""
    stop_token_ids: list[int]
    overlong: str = "keep"
    """A response cut at max_response_length: 'keep' its reward, score it 'zero', or 'mask' it out of the loss."""
    get_state: Optional[Callable[[], object]] = None
    """The task's own state (data cursor, sampler RNG) for checkpoints; JSON-serialisable."""
    set_state: Optional[Callable[[object], None]] = None
    save_files: Optional[Callable[[Path], None]] = None
    """Rank 0 writes the task's non-JSON state (a reward model in training) into a checkpoint's directory."""
    load_files: Optional[Callable[[Path], None]] = None
    """Every rank is given that directory on resume."""


@dataclass
class History:
    initial_val_reward: float = 0.0
    rows: list[dict] = field(default_factory=list)


def evaluate(engines: Engines, task: Task, batch: BatchConfig, rollout: RolloutConfig, k: int) -> tuple[float, float]:
    """(greedy validation reward, pass@k: the fraction of prompts with a full-reward answer among k samples)."""
    val = task.validation()
    prompts = [e.prompt_ids for e in val]
    gen = engines.generate(prompts, 1, 0.0, 1.0, batch.max_response_length, task.stop_token_ids, 0)
    greedy = sum(task.reward(e, r) for e, r in zip(val, gen.token_ids)) / len(val)
    sampled = engines.generate(prompts, k, rollout.temperature, rollout.top_p, batch.max_response_length,
                               task.stop_token_ids, 7)
    solved = [max(task.reward(e, sampled.token_ids[i * k + j]) for j in range(k)) >= 1.0 for i, e in enumerate(val)]
    return greedy, sum(solved) / len(val)


def world_mismatch(rb: RolloutBatch, owned: list[int]) -> float:
    """algo.logprob_mismatch over the whole batch, each rank summing the rows it owns (the only engine
    logprobs it may hold) and one SUM over the world (collective)."""
    mask = torch.zeros(rb.tokens.shape, dtype=torch.float64)
    index = torch.tensor(owned, dtype=torch.long)
    mask[index] = rb.response_mask()[index].to(torch.float64)
    sums = torch.stack([((rb.engine_logp.double() - rb.old_logp.double()).abs() * mask).sum(), mask.sum()])
    total, count = comm.world_all_reduce_sum(sums).tolist()
    return total / count if count else 0.0


def engine_logprobs(gen, rb: RolloutBatch) -> torch.Tensor:
    """[N, L] position-aligned: the rollout engine's logprob of each response token (docs/design.md, "Tokens,
    masks and logprobs")."""
    out = torch.zeros(rb.tokens.shape, dtype=torch.float32)
    for i, lps in enumerate(gen.logprobs):
        start = int(rb.prompt_lens[i]) - 1
        out[i, start : start + len(lps)] = torch.tensor(lps)
    return out


def step_metrics(timer: StepTimer, updates: list[dict], rb: RolloutBatch, epochs: int) -> dict:
    """The step's timing/* (reduced over ranks: collective), perf/* and batch/* metrics."""
    timing = timer.metrics()
    trained = rb.in_loss if rb.in_loss is not None else torch.ones(rb.size, dtype=torch.bool)
    update_tokens = float(((rb.prompt_lens + rb.response_lens) * trained).sum()) * epochs
    computed = sum(u["computed_tokens"] for u in updates)
    return {
        **timing,
        **throughput(timing, update_tokens, float(rb.response_lens.sum())),
        "batch/pad_fraction": 1.0 - sum(u["useful_tokens"] for u in updates) / computed if computed else 0.0,
        "batch/micro_batches": sum(u["micro_batches"] for u in updates),
        "batch/dp_token_imbalance": max(u["dp_token_imbalance"] for u in updates),
    }


UPDATE_MEANS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "grad_norm", "is_weight_mean", "is_capped_fraction")
OFF_POLICY_IS_CAP = 2.0
"""algo.engine_is_cap when rollout.off_policy_steps=1 and none is set (verl's TIS default)."""


def off_policy_algo(algo_cfg: AlgoConfig, rollout: RolloutConfig) -> AlgoConfig:
    """One step ahead, truncated importance correction against the engine's logprobs is on unless set."""
    if not rollout.off_policy_steps or algo_cfg.engine_is_cap is not None:
        return algo_cfg
    if torch.distributed.get_rank() == 0:
        print(f"rollout.off_policy_steps={rollout.off_policy_steps}: truncated importance correction on "
              f"(algo.engine_is_cap={OFF_POLICY_IS_CAP})", flush=True)
    return dataclasses.replace(algo_cfg, engine_is_cap=OFF_POLICY_IS_CAP)


def stop_requested(ckpt: Optional[CheckpointConfig]) -> bool:
    """Collective: has checkpoint.stop_file appeared (seen on rank 0)?"""
    return ckpt is not None and bool(ckpt.stop_file) and comm.any_rank(
        torch.distributed.get_rank() == 0 and Path(ckpt.stop_file).exists())


def take_stop_file(ckpt: CheckpointConfig, step: int, steps: int, saved: bool) -> None:
    """The stop file was honoured: rename it (so that it is not seen again, and the launcher can tell a run that
    stopped early on it from one that had finished anyway), say so."""
    if torch.distributed.get_rank() != 0:
        return
    stop_file = Path(ckpt.stop_file)
    if step < steps:
        stop_file.rename(stop_file.with_name(stop_file.name + ".stopped"))
        where = f"checkpoint of step {step} saved in {ckpt.dir}" if saved else "no checkpoint.dir: nothing saved"
        print(f"stop requested ({ckpt.stop_file}): stopping after step {step}; {where}", flush=True)
    else:
        stop_file.unlink(missing_ok=True)


def train(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, optim: OptimConfig,
          algo_cfg: AlgoConfig, batch: BatchConfig, rollout: RolloutConfig, run: RunConfig, evaluation: EvalConfig,
          task: Task,
          engine_factory: Callable[[], object], log: Optional[Callable[[dict], None]] = None,
          hf_dir: Optional[str] = None, ckpt: Optional[CheckpointConfig] = None,
          resolved_config: Optional[dict] = None) -> History:
    """Run `run.steps` GRPO steps; returns the per-step metrics (identical on every rank).
    With `hf_dir`, the actor (and so the reference) start from that HF checkpoint. `resolved_config` (the
    run's whole config) is saved in every checkpoint and compared with on resume."""
    batch.check_layout(parallel, torch.distributed.get_world_size() // (parallel.tp * parallel.pp))
    algo_cfg = off_policy_algo(algo_cfg, rollout)
    actor = Actor(model, parallel, precision, optim, algo_cfg, batch)
    if hf_dir is not None:
        from grpo_mega.models.hf_io import load_hf_into_gpt
        from megatron.core import parallel_state as ps

        load_hf_into_gpt(actor.built.gpt, hf_dir, model, ps.get_tensor_model_parallel_rank(), parallel.tp)
        actor.optimizer.reload_model_params()
    use_ref = algo_cfg.kl_coef != 0
    reference = Reference(model, parallel, precision, batch, offload=algo_cfg.ref_offload) if use_ref else None
    if reference is not None:
        reference.load_from(actor)
    first_step, store, state = 1, None, None
    if ckpt is not None and ckpt.dir:
        from grpo_mega.trainer import checkpoint

        store, state = checkpoint.open_for_run(ckpt, actor, reference, resolved_config)
        if state is not None:
            first_step = state["step"] + 1
            if task.set_state is not None:
                task.set_state(state["task"])
            if task.load_files is not None:
                task.load_files(Path(state["path"]) / "task")
    engines = Engines(engine_factory, rollout.num_engines)
    routing = Routing(actor.dp_rows)  # each DP replica gets only the samples it runs
    rollouts = RolloutScheduler(engines, task.train_batch, batch.train_batch_size, SamplingArgs(
        batch.n, rollout.temperature, rollout.top_p, batch.max_response_length, task.stop_token_ids, run.seed),
        rollout.off_policy_steps, run.steps, task.get_state, task.set_state, share=routing.share)
    rollouts.restore(state and state.get("rollout"))  # a batch generated before the checkpoint, not yet trained
    sync = dict(cfg=model, bucket_mb=rollout.sync_bucket_mb, audit=rollout.audit_weights, dtype=actor.params_dtype)
    rollouts.sync_weights(actor.built.gpt, version=first_step - 1, **sync)
    if task.overlong not in ("keep", "zero", "mask"):
        raise ValueError(f"reward.overlong={task.overlong!r} must be 'keep', 'zero' or 'mask'")
    val, pass_k = evaluate(engines, task, batch, rollout, evaluation.pass_k)
    history = History(initial_val_reward=val)
    for step in range(first_step, run.steps + 1):
        timer = StepTimer()
        with timer("generate_wait"):  # one step ahead, the next step's generation starts in here
            got = rollouts.result(step)
        gen, samples = got.gen, [got.examples[i // batch.n] for i in range(len(got.gen.token_ids))]
        owned = routing.owned([len(e.prompt_ids) + len(t) for e, t in zip(samples, gen.token_ids)])
        with timer("reward"):  # each sample scored once, by its owner; the same scores on every rank
            rewards, reward_metrics = score_step(task.reward, samples, gen.token_ids, step, owned)
        overlong = torch.tensor([f == "length" for f in gen.finish_reasons])
        if task.overlong == "zero":
            rewards = torch.where(overlong, 0.0, rewards)
        rb = RolloutBatch.from_samples([e.prompt_ids for e in samples], gen.token_ids)
        with timer("old_logprobs"):
            rb.old_logp = actor.logprobs(rb, rollout.temperature)
        if use_ref and not actor.full_kl_in_loss:  # the full KL's reference runs inside the update instead
            with timer("ref_logprobs"):
                rb.ref_logp = reference.logprobs(rb, rollout.temperature)
        scores = rewards
        if algo_cfg.kl_in_reward:  # PPO-style: the KL penalty goes into the sequence reward
            kl = algo.kl_penalty(rb.old_logp, rb.ref_logp, algo_cfg.kl_estimator)
            scores = algo.kl_in_reward(rewards, kl, rb.response_mask(), algo_cfg.kl_coef)[1]
        rb.advantages = algo.group_advantages(scores, batch.n, algo_cfg.norm_adv_by_std, algo_cfg.global_adv_norm)
        in_loss = torch.ones(len(samples), dtype=torch.bool)
        if task.overlong == "mask":
            in_loss &= ~overlong
        if algo_cfg.dynamic_sampling:  # DAPO: groups with equal rewards teach nothing; keep them out of the loss
            in_loss &= algo.nonuniform_groups(scores, batch.n).repeat_interleave(batch.n)
        rb.in_loss = in_loss
        rb.engine_logp = engine_logprobs(gen, rb)
        mismatch = world_mismatch(rb, owned)
        with timer("update"):
            updates = actor.update(rb, rollout.temperature, reference)
        with timer("generate_wait"):  # the next step's samples: a server's weights never change under a generation
            rollouts.wait()
        with timer("weight_sync"):
            rollouts.sync_weights(actor.built.gpt, version=step, **sync)
            if reference is not None and algo_cfg.ref_update_interval and step % algo_cfg.ref_update_interval == 0:
                reference.load_from(actor)
        timer.add("generate", rollouts.take_timing()[0])
        if step % evaluation.interval == 0 or step == run.steps:
            with timer("eval"):
                val, pass_k = evaluate(engines, task, batch, rollout, evaluation.pass_k)
        stop = stop_requested(ckpt)
        if store is not None and ((ckpt.interval and step % ckpt.interval == 0) or step == run.steps or stop):
            with timer("checkpoint"):  # with the next step's batch when it is already generated (README)
                checkpoint.save(store, step, actor, reference,
                                {"step": step, "weight_version": step, "config": resolved_config,
                                 "task": rollouts.task_state() if task.get_state else None, "rollout": rollouts.state()},
                                export=dict(model_cfg=model, dtype=actor.params_dtype, hf_dir=hf_dir, hf=ckpt.export_hf),
                                task_files=task.save_files)
        row = dict(
            step=step, reward=float(rewards.mean()), val_reward=val, val_pass_at_k=pass_k,
            overlong_fraction=float(overlong.float().mean()), rows_in_loss=int(in_loss.sum()),
            response_length=float(rb.response_lens.float().mean()), logprob_mismatch=mismatch,
            weight_version=gen.weight_version, lr=actor.optimizer.param_groups[0]["lr"],
            **{k: sum(u[k] for u in updates) / len(updates) for k in UPDATE_MEANS},
            skipped=sum(u["skipped"] for u in updates), **reward_metrics,
            **step_metrics(timer, updates, rb, algo_cfg.ppo_epochs),
        )
        history.rows.append(row)
        if log is not None:
            log(row)
        if store is not None and torch.distributed.get_rank() == 0:
            store.heartbeat()
        if stop:
            take_stop_file(ckpt, step, run.steps, store is not None)
            if step < run.steps:
                break
    engines.shutdown()
    if store is not None and torch.distributed.get_rank() == 0:
        store.release()
    return history
