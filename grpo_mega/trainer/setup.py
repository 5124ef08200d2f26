"""Building a run before its first step (docs/design.md, "one step"): the model and tokenizer the config names,
the actor and the reference (HF weights loaded, a checkpoint restored), the rollout engines (through the
ENGINES registry, or the dedicated servers' client), routing and the rollout scheduler. `Run` holds what was
built and the per-step actions the loop calls (sync, evaluate, save, stop); `train()` only orchestrates.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import torch

from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.schema import TrainConfig
from grpo_mega.parallel import comm
from grpo_mega.rollout.placement import Engines
from grpo_mega.rollout.routing import Routing
from grpo_mega.rollout.scheduler import RolloutScheduler, SamplingArgs
from grpo_mega.engines.validate import OutputSpec
from grpo_mega.trainer.actor import Actor
from grpo_mega.trainer.reference import AdapterOffReference, Reference
from grpo_mega.trainer.guards import RewardBudget, RunStopped, SkipStreak
from grpo_mega.trainer.memory import MemorySites
from grpo_mega.data.tasks import Task
from grpo_mega.trainer.watchdog import StepWatchdog


def resolve_model(cfg: TrainConfig) -> tuple[ModelConfig, object, Optional[str]]:
    """(the model's config, its tokenizer, the HF directory or None): an HF directory brings its own config
    and tokenizer; a model_configs/ name runs on the toy task's tokenizer and vocabulary."""
    if (Path(cfg.model) / "config.json").is_file():
        from transformers import AutoTokenizer

        from grpo_mega.models.hf_io import read_hf_config

        return read_hf_config(cfg.model)[2], AutoTokenizer.from_pretrained(cfg.model), cfg.model
    from grpo_mega.conf.model import load_model_config
    from grpo_mega.data.tasks import task_tokenizer

    tok = task_tokenizer(cfg.task)
    model = load_model_config(cfg.model)
    model.vocab_size = len(tok)  # the toy task's own vocabulary
    return model, tok, None


def engine_factory(cfg: TrainConfig, model: ModelConfig, hf_dir: Optional[str], out_dir: Path, tok=None,
                   stop_token_ids: Optional[list[int]] = None) -> Callable[[], object]:
    """What builds one rollout engine on the ranks that hold one: the dedicated servers' client, or the
    registered engine class of rollout.engine (colocated: on the rank's own GPU where there is one), driven
    turn by turn with tools when rollout.multi_turn.enable (`tok` renders the tool turns)."""
    rollout = cfg.rollout
    mt = rollout.multi_turn

    def build():
        if rollout.placement == "dedicated":
            from grpo_mega.engines.client import ServerClient

            engine = ServerClient(list(rollout.servers), timeout_s=rollout.server_timeout_s, server_tp=rollout.engine_tp,
                                  moe_layers=model.moe_layers() if cfg.algo.records_routes else None,
                                  spec=OutputSpec.of(model), retries=rollout.server_retries,
                                  backoff_s=rollout.server_retry_backoff_s)
        else:
            import grpo_mega.engines.embedded  # noqa: F401  (each module registers its engine)
            import grpo_mega.engines.sglang_engine  # noqa: F401
            from grpo_mega.engines.interface import ENGINES, EngineSpec

            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            spec = EngineSpec(model=model, hf_dir=hf_dir, seed=cfg.run.seed, device=device, tp=rollout.engine_tp,
                              dtype="bfloat16" if cfg.precision.params_dtype == "bf16" else "float32",
                              mem_fraction=rollout.gpu_memory_fraction, workdir=str(out_dir / "engine_init"),
                              timeout_s=rollout.engine_timeout_s, record_routing=cfg.algo.records_routes,
                              decode=rollout.embedded_decode)
            engine = ENGINES.get(rollout.engine).for_run(spec)
        if not mt.enable:
            return engine
        from grpo_mega.rollout.multi_turn import MultiTurnEngine, check_multi_turn
        from grpo_mega.toolcalls.pool import ToolPool

        call_stop = check_multi_turn(mt, tok, stop_token_ids or [tok.eos_token_id])
        pool = ToolPool(mt.tools, num_workers=mt.tool_workers, timeout_s=mt.tool_timeout_s,
                        max_memory_mb=mt.tool_max_memory_mb, max_chars=mt.max_tool_response_chars, env_keep=mt.tool_env)
        return MultiTurnEngine(engine, tok, pool, mt.parser, mt.max_turns, stop_token_ids,
                               max_tool_response_chars=mt.max_tool_response_chars, call_stop_ids=call_stop,
                               agent_loop=mt.agent_loop or None, async_tools=mt.async_tools,
                               max_tool_calls_per_turn=mt.max_tool_calls_per_turn,
                               max_tool_call_chars=mt.max_tool_call_chars)

    return build


class Run:
    """A built run: the models, engines, scheduler and checkpoint store, and the actions the loop takes
    between phases. Every rank holds one; every method is collective unless it says otherwise."""

    def __init__(self, cfg: TrainConfig, model: ModelConfig, task: Task, engine_factory: Callable[[], object],
                 hf_dir: Optional[str] = None, out_dir: Optional[Path] = None, tok=None):
        self.cfg, self.model, self.task, self.hf_dir, self.tok = cfg, model, task, hf_dir, tok
        d = cfg.dist
        self.watchdog = StepWatchdog(Path(out_dir or ".") / f"stacks-rank{torch.distributed.get_rank()}.txt",
                                     d.watchdog_factor if out_dir is not None else 0.0, d.watchdog_min_s)
        self.n, self.steps = cfg.rollout.n, cfg.run.steps
        cfg.check_layout(model, torch.distributed.get_world_size())
        self.memory = MemorySites(cfg.run.memory_sites, out_dir, torch.distributed.get_rank())  # before any model
        self.actor = Actor(model, cfg.parallel, cfg.precision, cfg.optim, cfg.algo, cfg.batch, lora=cfg.lora)
        if hf_dir is not None:
            from megatron.core import parallel_state as ps

            from grpo_mega.models.hf_io import load_hf_into_gpt

            load_hf_into_gpt(self.actor.built.gpt, hf_dir, model, ps.get_tensor_model_parallel_rank(), cfg.parallel.tp)
            self.actor.optimizer.reload_model_params()
        self.reference = None
        if cfg.algo.kl_coef != 0 and cfg.lora.enabled:  # the base model: the actor with its adapters off
            self.reference = AdapterOffReference(self.actor)
        elif cfg.algo.kl_coef != 0:
            self.reference = Reference(model, cfg.parallel, cfg.precision, cfg.batch, offload=cfg.algo.ref_offload,
                                       replay=cfg.algo.routing_replay == "rollout")
            self.reference.load_from(self.actor)
        self.reward_budget = RewardBudget(cfg.reward.max_error_fraction, cfg.reward.error_window)
        self.skips = SkipStreak(cfg.optim.max_consecutive_skips)
        self.first_step, self.store, state, self.saved_step = 1, None, None, None
        # with checkpoints, what the initial weights are (hashed once): LoRA's base, or the model path a reference
        # still holds (then not written into checkpoints); it stops being that path's when algo.ref_update_interval
        # resets it
        self.base_model, self.reference_initial = None, True
        if cfg.checkpoint.dir:
            from grpo_mega.trainer import checkpoint, lora_checkpoint

            if cfg.lora.enabled or (hf_dir is not None and isinstance(self.reference, Reference)):
                self.base_model = lora_checkpoint.base_model_identity(
                    cfg.model, hf_dir, cfg.run.seed, torch.distributed.get_rank(), torch.distributed.get_world_size(),
                    gather=comm.all_gather_objects)
            self.store, state = checkpoint.open_for_run(cfg.checkpoint, self.actor, self.reference, cfg.to_dict(),
                                                        base_model=self.base_model)
            if state is not None:
                self.reference_initial = state.get("reference_from") is not None
                self.first_step = state["step"] + 1
                self.saved_step = state["step"]
                if task.set_state is not None:
                    task.set_state(state["task"])
                if task.load_files is not None:
                    task.load_files(Path(state["path"]) / "task")
        self.engines = Engines(engine_factory, cfg.rollout.num_engines, spec=OutputSpec.of(model))
        self.routing = Routing(self.actor.dp_rows)  # each DP replica gets only the samples it runs
        r = cfg.rollout
        sampling = SamplingArgs(r.n, r.temperature, r.top_p, cfg.batch.max_response_length, task.stop_token_ids,
                                cfg.run.seed, rows=r.multi_turn.enable)
        if r.replay_dir:
            from grpo_mega.rollout.replay import ReplayScheduler

            self.rollouts = ReplayScheduler(self.engines, task.train_batch, r.replay_dir, r.n, share=self.routing.share)
        elif r.mode == "async":
            from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler

            self.rollouts = AsyncRolloutScheduler(self.engines, task.train_batch, cfg.batch.train_batch_size, sampling,
                                                  r.off_policy_steps, cfg.run.steps, r.partial_rollouts,
                                                  r.segment_tokens, share=self.routing.share, get_state=task.get_state,
                                                  set_state=task.set_state, fresh=r.fresh_groups,
                                                  pause_mode=r.pause_mode, drop_stale=r.drop_stale)
        else:
            self.rollouts = RolloutScheduler(self.engines, task.train_batch, cfg.batch.train_batch_size, sampling,
                                             r.off_policy_steps, cfg.run.steps, task.get_state, task.set_state,
                                             share=self.routing.share)
        self.rollouts.restore(state and state.get("rollout"))  # a batch generated before the checkpoint, not yet trained
        self._sync = dict(cfg=model, bucket_mb=r.sync_bucket_mb, audit=r.audit_weights, dtype=self.actor.params_dtype)
        self.sync_weights(self.first_step - 1)

    @property
    def rank0(self) -> bool:
        return torch.distributed.get_rank() == 0

    def begin_step(self) -> None:
        """Arms the hang watchdog for this step."""
        self.watchdog.begin()

    def sync_weights(self, version: int) -> None:
        """The actor's weights into every engine, as weight version `version`."""
        self.rollouts.sync_weights(self.actor.built.gpt, version=version, **self._sync)

    def after_update(self, step: int) -> None:
        """Weight sync; iterative RL copies the policy into the reference every algo.ref_update_interval steps."""
        self.sync_weights(step)
        every = self.cfg.algo.ref_update_interval
        if self.reference is not None and every and step % every == 0:
            self.reference.load_from(self.actor)
            self.reference_initial = False

    def eval_due(self, step: int) -> bool:
        """Validation before step 1 (step 0), every eval.interval steps and after the last; never with interval 0."""
        every = self.cfg.eval.interval
        return bool(every) and (step % every == 0 or step == self.steps)

    def evaluate(self, step: int = 0) -> dict:
        """val_reward (greedy), val_pass_at_k (the fraction of prompts with a full-reward answer among k samples)
        and, multi-turn, the greedy rollouts' val/multi_turn/* and val/tool/* metrics; with rollout.dump_dir,
        the greedy trajectories are written (rank 0)."""
        from grpo_mega.rollout.multi_turn import rollout_metrics
        from grpo_mega.rollout.scheduler import example_row

        task, r, k = self.task, self.cfg.rollout, self.cfg.eval.pass_k
        val = task.validation()
        prompts, longest = [e.prompt_ids for e in val], self.cfg.batch.max_response_length
        kw = {"rows": [example_row(e) for e in val]} if r.multi_turn.enable else {}
        gen = self.engines.generate(prompts, 1, 0.0, 1.0, longest, task.stop_token_ids, 0, **kw)
        scores = [score_one(task.reward, e, ids, gen, i) for i, (e, ids) in enumerate(zip(val, gen.token_ids))]
        sampled = self.engines.generate(prompts, k, r.temperature, r.top_p, longest, task.stop_token_ids, 7, **kw)
        solved = [max(score_one(task.reward, e, sampled.token_ids[i * k + j], sampled, i * k + j) for j in range(k)) >= 1.0
                  for i, e in enumerate(val)]
        if r.dump_dir and self.rank0:
            from grpo_mega.rollout.dump import write_dump

            write_dump(Path(r.dump_dir) / f"val_step_{step:08d}.jsonl", step, val, gen, scores, tokenizer=self.tok)
        return {"val_reward": sum(scores) / len(val), "val_pass_at_k": sum(solved) / len(val),
                **rollout_metrics(gen, prefix="val/")}

    def stop_requested(self) -> bool:
        """Has checkpoint.stop_file appeared (seen on rank 0)?"""
        stop_file = self.cfg.checkpoint.stop_file
        return bool(stop_file) and comm.any_rank(self.rank0 and Path(stop_file).exists())

    def save_due(self, step: int, stop: bool) -> bool:
        every = self.cfg.checkpoint.interval
        return self.store is not None and (bool(every and step % every == 0) or step == self.steps or stop)

    def save(self, step: int) -> None:
        """A checkpoint of step `step`, with the next step's batch when it is already generated (README)."""
        from grpo_mega.trainer import checkpoint, lora_checkpoint

        c = self.cfg.checkpoint
        state = {"step": step, "weight_version": step, "config": self.cfg.to_dict(),
                 "task": self.rollouts.task_state() if self.task.get_state else None, "rollout": self.rollouts.state(),
                 "lora": lora_checkpoint.lora_state(self.actor, self.base_model)}
        checkpoint.save(self.store, step, self.actor, self.reference, state,
                        export=dict(model_cfg=self.model, dtype=self.actor.params_dtype, hf_dir=self.hf_dir,
                                    hf=c.export_hf),
                        task_files=self.task.save_files, reference_from=self._reference_from())
        self.saved_step = step

    def _reference_from(self) -> Optional[dict]:
        """The model path's identity while the reference (a copy of its own) still holds its weights; None: the
        reference is written (a random-init model's, one reset by algo.ref_update_interval, or none)."""
        holds = self.reference_initial and isinstance(self.reference, Reference)
        return self.base_model if holds and "weights_sha256" in (self.base_model or {}) else None

    def stop(self, step: int, why: str, trained: bool) -> None:
        """Collective, the same on every rank (grpo_mega.trainer.guards): checkpoint the last good state, then
        raise RunStopped(why). `trained`: step `step` was trained and is that state; else it was not (its
        rewards failed) and step - 1 is, so the resumed run trains step `step` again."""
        good = step if trained else step - 1
        where = "no checkpoint.dir: nothing saved"
        if self.store is not None:
            if trained:
                self.rollouts.wait()  # one step ahead: the next batch is part of the checkpoint
            else:
                self.rollouts.rewind()
            if self.saved_step != good:
                self.save(good)
            where = f"the last good state is checkpoint step {good} in {self.cfg.checkpoint.dir}"
        raise RunStopped(f"{why} ({where})")

    def end_step(self, step: int, stop: bool) -> bool:
        """After a step's metrics: heartbeat the checkpoint lock, honour a stop file. True: stop now."""
        self.watchdog.end()
        if self.store is not None and self.rank0:
            self.store.heartbeat()
        if not stop:
            return False
        if self.rank0:
            stop_file = Path(self.cfg.checkpoint.stop_file)
            if step < self.steps:  # renamed so that it is not seen again, and the launcher can tell why it stopped
                stop_file.rename(stop_file.with_name(stop_file.name + ".stopped"))
                where = (f"checkpoint of step {step} saved in {self.cfg.checkpoint.dir}" if self.store is not None
                         else "no checkpoint.dir: nothing saved")
                print(f"stop requested ({stop_file}): stopping after step {step}; {where}", flush=True)
            else:
                stop_file.unlink(missing_ok=True)
        return step < self.steps

    def close(self) -> None:
        self.watchdog.close()
        self.rollouts.close()
        self.engines.shutdown()
        if self.store is not None and self.rank0:
            self.store.release()


def build_run(cfg: TrainConfig, model: ModelConfig, tok, hf_dir: Optional[str], out_dir: Path) -> Run:
    """Everything a run needs, built on every rank (torch.distributed already initialised; `resolve_model`
    gave the model). The task's reward workers are closed if building fails; afterwards by the caller."""
    from grpo_mega.data.tasks import build_task

    task = build_task(cfg, tok)
    if hf_dir is not None and torch.distributed.get_rank() == 0:
        from grpo_mega.models.hf_io import zero_pad_row

        pad = zero_pad_row(hf_dir)
        if pad is not None:
            print(f"note: {hf_dir}: the embedding row of pad_token_id={pad} is all zeros (transformers' init; its "
                  f"nn.Embedding padding_idx never trains that row, grpo-mega does). Where token {pad} is in the input, "
                  f"its gradient passes RMSNorm at a zero input, 1/sqrt(rms_norm_eps) times the others': grad_norm "
                  f"is mostly that row's until it has moved", flush=True)
    if cfg.rollout.off_policy_steps and torch.distributed.get_rank() == 0:
        print(f"rollout.off_policy_steps={cfg.rollout.off_policy_steps}"
              f"{' (rollout.mode=async: the staleness bound)' if cfg.rollout.mode == 'async' else ''}: truncated importance correction on "
              f"(algo.engine_is_cap={cfg.algo.engine_is_cap})", flush=True)
    if cfg.rollout.multi_turn.enable:  # the tokenizer's side of rollout.multi_turn, before any model is built
        from grpo_mega.rollout.multi_turn import check_multi_turn

        try:
            check_multi_turn(cfg.rollout.multi_turn, tok, task.stop_token_ids)
        except BaseException:
            getattr(task.reward, "close", lambda: None)()
            raise
    try:
        return Run(cfg, model, task, engine_factory(cfg, model, hf_dir, out_dir, tok, task.stop_token_ids), hf_dir,
                   out_dir, tok)
    except BaseException:
        getattr(task.reward, "close", lambda: None)()  # the reward's worker processes end with the run
        raise


def score_one(reward, example, ids, gen, i: int) -> float:
    """One sample's reward (validation), given its trajectory (turns, tool rewards) when it has one."""
    import inspect

    traj = gen.trajectories[i] if gen.trajectories is not None else None
    if traj is None or "trajectory" not in inspect.signature(reward).parameters:
        return reward(example, ids)
    return reward(example, ids, trajectory=traj)


def threads_per_rank() -> int:
    """The CPU threads each rank of this node may use: taskset's affinity divided among the node's ranks, at most
    OMP_NUM_THREADS where that is set (as for torch itself: torchrun sets 1 for several ranks)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cpus // int(os.environ.get("WORLD_SIZE", "1")))
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(share, int(cap)) if cap.isdigit() and int(cap) > 0 else share

