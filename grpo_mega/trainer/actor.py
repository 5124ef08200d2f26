"""The actor under Megatron: the trainable policy (DDP, optimizer, LR schedule) and the GRPO update.

Owns: the update's mini-batches and the token statistics the policy loss (`grpo_mega.algo.POLICY_LOSSES`, that
also decides the loss's terms) turns into each micro-batch's loss; the mini-batch normaliser, computed once
per mini-batch over DP ranks, and the loss scaling that makes Megatron's own per-micro-batch division and
DP averaging cancel (docs/design.md, "Loss aggregation"); the optimizer step and per-mini-batch metrics.
Beside it: dp_layout.py (which rows each DP rank runs), forward.py (micro-batches through Megatron's schedule,
the token statistics, the reference in lockstep), optimizer.py (megatron's optimizer and schedule),
reference.py (the frozen reference). The math is grpo_mega.algo's, the collectives grpo_mega.parallel's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from functools import partial
from typing import TYPE_CHECKING, Optional

import torch

from grpo_mega import algo
from grpo_mega.conf.algo import AlgoConfig
from grpo_mega.conf.batch import BatchConfig
from grpo_mega.conf.lora import LoraConfig
from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.optim import OptimConfig, PrecisionConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.models.builder import build_actor
from grpo_mega.parallel import comm
from grpo_mega.trainer.batch import RolloutBatch
from grpo_mega.trainer.dp_layout import dp_rows, layout, parallel_state
from grpo_mega.trainer.forward import (assemble_logprobs, forward_logprobs, forward_micro, lockstep_forward, run_schedule,
                                       to_device, token_stats, with_fused_output, with_positions)
from grpo_mega.trainer.optimizer import build_optimizer

if TYPE_CHECKING:
    from grpo_mega.trainer.reference import Reference


log = logging.getLogger(__name__)


class Actor:
    """The trainable policy: Megatron DDP + optimizer + LR schedule, and the GRPO update."""

    def __init__(self, model_cfg: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                 optim: OptimConfig, algo_cfg: AlgoConfig, batch: BatchConfig, lora: Optional[LoraConfig] = None):
        self.model_cfg, self.parallel, self.precision = model_cfg, parallel, precision
        self.optim, self.algo, self.batch = optim, algo_cfg, batch
        self.policy_loss = algo.POLICY_LOSSES.get(algo_cfg.policy_loss)
        self.objective = algo_cfg.objective()
        self.lora = lora if lora is not None and lora.enabled else None
        self.built = build_actor(model_cfg, parallel, precision, optim.use_distributed_optimizer, self.lora)
        self.moe = None
        if model_cfg.is_moe:
            from grpo_mega.models.moe_metrics import MoEMetrics

            self.moe = MoEMetrics(self.built.gpt, model_cfg.num_layers, model_cfg.num_experts, parallel.sequence_parallel)
            from grpo_mega.models import routing_replay

            routing_replay.install(self.built.gpt, model_cfg.moe_layers())
            # algo.routing_replay=measure: the engine's routes are compared with the routers' own, not followed
            routing_replay.set_replay(self.built.gpt, algo_cfg.routing_replay != "measure")
        bf16 = precision.params_dtype == "bf16"
        self.params_dtype = torch.bfloat16 if bf16 else torch.float32
        self.optimizer, self.scheduler = build_optimizer(self.built.module, optim, bf16)
        self.skipped_early_stop = 0
        self.skipped_nonfinite = 0

    def logprobs(self, rollout: RolloutBatch, temperature: float) -> torch.Tensor:
        if self.model_cfg.is_moe:  # routing_agreement() after this counts this pass alone
            from grpo_mega.models.routing_replay import take_agreement

            take_agreement(self.built.gpt)
        return forward_logprobs(self.built.module, self.model_cfg, self.parallel, self.batch, rollout, temperature)

    def routing_agreement(self) -> dict:
        """Collective: {"moe/routing_agreement": share} over the actor's forwards since the last call or the last
        `logprobs` (the loop asks after the step's first pass: the old-logprob pass, or the update when it is the
        batch's one optimizer step), with the engine's routes: of the (token, MoE layer) pairs the engine
        routed, the share where the trainer's own top-k of its router logits is the engine's set
        (grpo_mega.models.routing_replay; counted whether or not the routes are replayed, algo.routing_replay=
        rollout or measure: under replay a layer's inputs are those the replayed layers before it made). {} for a
        dense model or without routes."""
        if not self.model_cfg.is_moe:
            return {}
        from grpo_mega.models.routing_replay import world_agreement

        share = world_agreement(self.built.gpt)
        return {} if share is None else {"moe/routing_agreement": share}

    def dp_rows(self, seq_lens: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """For a step's batch of these sequence lengths: (each DP rank's rows in the logprob pass, a partition
        of the batch; every row each DP rank runs in any pass of the step: that pass and every mini-batch of
        `update`). From the lengths alone: what rollout routing sends each DP replica (grpo_mega.rollout.
        routing)."""
        return dp_rows(seq_lens, self.parallel, self.batch, parallel_state().get_data_parallel_world_size())

    @property
    def full_kl_in_loss(self) -> bool:
        """The loss's KL term is the full-vocabulary KL: the update needs the reference's logits."""
        return self.objective.full_kl_in_loss

    # ---- the loss of one micro-batch (last pipeline stage) --------------------------------------------

    def _loss(self, mb: dict, normaliser: torch.Tensor, scale: int, temperature: float,
              ref_logits: Optional[torch.Tensor], logits: torch.Tensor):
        """The micro-batch's scaled policy loss (`algo.policy_loss`, grpo_mega.algo.POLICY_LOSSES) and its
        metric sums. logits, ref_logits: [b, s, V/tp] (the reference's only with the full KL in the loss,
        without grad); with batch.fused_output the output layer's inputs [b, s, h] (`with_fused_output`)."""
        logp, entropy, full_kl = token_stats(logits, mb, self.model_cfg, self.batch, temperature, ref_logits)
        own_old = "old_logp" not in mb
        if own_old:  # one update per batch: the old (proximal) logprobs are this forward's, detached (ratio 1)
            mb["old_logp"] = logp.detach()
        loss, stats = self.policy_loss(
            self.objective, logp=logp, old_logp=mb["old_logp"], advantages=mb["advantages"], mask=mb["mask"],
            normaliser=normaliser, entropy=entropy, ref_logp=mb.get("ref_logp"), full_kl=full_kl,
            engine_logp=mb.get("engine_logp"),
        )
        if own_old:  # they become rollout.old_logp (engine/trainer mismatch metrics)
            stats.update(logp=logp.detach() * mb["mask"], rows=mb["rows"])
        return loss * scale, stats

    def update(self, rollout: RolloutBatch, temperature: float = 1.0, reference: Optional[Reference] = None) -> list[dict]:
        """`ppo_epochs` passes over the step's mini-batches, one optimizer step each. Needs
        rollout.advantages, rollout.old_logp, and with the KL term in the loss rollout.ref_logp, or for
        `algo.kl_estimator=full` the `reference` itself (it runs in lockstep with the actor; ref_logp is
        not used). Returns one metrics dict per mini-batch, identical on every rank.

        Without rollout.old_logp the update is the batch's one optimizer step (one epoch, one mini-batch: the
        weights are still those the old-logprob pass would run on, the proximal policy, whichever version sampled
        the tokens): each token's old logprob is the update forward's own, detached, and rollout.old_logp is filled
        from them afterwards: the loss, gradient and metrics are those of the path with a separate old-logprob
        pass, without its forward. The rollout correction still weighs each token by old / engine logprob."""
        if rollout.advantages is None:
            raise ValueError("update() needs rollout.advantages")
        if self.objective.rollout_is_batch_norm:  # the weights' normaliser over the whole batch, this update's
            if rollout.is_batch_mean is None:
                raise ValueError("algo.rollout_is_batch_norm=true needs rollout.is_batch_mean (the batch's mean "
                                 "correction weight, grpo_mega.trainer.loop.world_is_batch_mean)")
            self.objective = dataclasses.replace(self.objective, is_batch_mean=float(rollout.is_batch_mean))
        rollout.check_vocab(self.model_cfg.vocab_size)
        if self.full_kl_in_loss and reference is None:
            raise ValueError("algo.kl_estimator='full' with algo.kl_coef != 0 needs the reference's logits: "
                             "pass the Reference, Actor.update(rollout, temperature, reference=reference)")
        if self.objective.kl_in_loss and not self.full_kl_in_loss and rollout.ref_logp is None:
            raise ValueError(f"algo.kl_coef != 0 with algo.kl_estimator={self.algo.kl_estimator!r} needs rollout.ref_logp")
        ps = parallel_state()
        dp = ps.get_data_parallel_world_size()
        per_mini = self.batch.mini_batch_responses(rollout.size)
        self.batch.check_layout(self.parallel, dp, per_mini // self.batch.ppo_mini_batch_size)
        own_old = rollout.old_logp is None
        if own_old and (self.algo.ppo_epochs != 1 or per_mini != rollout.size):
            raise ValueError(f"update() without rollout.old_logp is the batch's one optimizer step; with algo.ppo_epochs="
                             f"{self.algo.ppo_epochs} and {rollout.size // per_mini} mini-batches it needs the old logprobs")
        ref = reference if self.full_kl_in_loss else None
        metrics = []
        with ref.on_device() if ref is not None else contextlib.nullcontext():
            for _ in range(self.algo.ppo_epochs):
                for start in range(0, rollout.size, per_mini):
                    mini = rollout.rows(start, start + per_mini)
                    metrics.append(self._update_mini_batch(mini, temperature, ref, keep_logp=own_old))
        if own_old:
            rollout.old_logp = assemble_logprobs(metrics[0].pop("old_logp"), rollout)
        return metrics

    def _update_mini_batch(self, mini: RolloutBatch, temperature: float, reference: Optional[Reference] = None,
                           keep_logp: bool = False) -> dict:
        ps = parallel_state()
        dp = ps.get_data_parallel_world_size()
        micro, length, shape = layout(mini, self.parallel, self.batch)
        # The normaliser belongs to the mini-batch: every micro-batch's share, summed over DP ranks.
        normaliser = sum(
            algo.local_normaliser(self.algo.loss_agg_mode, mb["mask"], self.batch.max_response_length) for mb in micro
        ).to(torch.float64)
        comm.dp_all_reduce(normaliser)
        scale = algo.megatron_loss_scale(len(micro), dp)

        def forward_step(data_iterator, model):
            mb = with_positions(to_device(next(data_iterator)), self.batch)
            mb = with_fused_output(mb, self.batch, model, reference.built.gpt if reference is not None else None)
            if reference is None:
                return forward_micro(model, mb), partial(self._loss, mb, normaliser.float(), scale, temperature, None)
            out, ref_logits = lockstep_forward(model, reference.built.gpt, mb)
            return out, partial(self._loss, mb, normaliser.float(), scale, temperature, ref_logits)

        module = self.built.module
        module.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe is not None:
            self.moe.start()
        out = run_schedule(module, micro, length, forward_step, forward_only=False,
                           lockstep=1 if reference is None else 2)

        # The policy loss's metric sums (grpo_mega.algo.policy_loss.METRIC_*), over micro-batches, then ranks.
        sums = {k: 0.0 for k in algo.policy_loss.METRIC_SUMS}
        mins = {k: math.inf for k in algo.policy_loss.METRIC_MINS}
        maxs = {k: -math.inf for k in algo.policy_loss.METRIC_MAXS}
        for d in out:
            for k in sums:
                sums[k] += float(d[k])
            for k in mins:
                mins[k] = min(mins[k], float(d[k]))
            for k in maxs:
                maxs[k] = max(maxs[k], float(d[k]))
        sums, mins, maxs = comm.reduce_stage_metrics(sums, mins, maxs)
        m = {
            **algo.policy_loss.mini_batch_metrics(sums, mins, maxs),
            "lr": self.optimizer.param_groups[0]["lr"],
            **shape,
            **(self.moe.metrics(len(micro)) if self.moe is not None else {}),
        }
        if keep_logp:
            m["old_logp"] = [{"logp": d["logp"], "rows": d["rows"]} for d in out]
        if comm.any_rank(sums["extreme"] > 0):
            self.skipped_early_stop += 1
            module.zero_grad_buffer()
            m.update(grad_norm=float("nan"), skipped=1.0, skip_reason="early_stop_imp_ratio")
            return m
        # Megatron checks for inf/nan only under fp16 loss scaling: with bf16 or fp32 a non-finite gradient
        # would be stepped into the weights. Look at the loss and at this rank's grad buffers; all ranks
        # decide together. A buffer's sum is finite iff all its elements are (one read of the buffer:
        # torch.isfinite(buffer).all() writes three temporaries of its size, 0.75 s a step on smollm2-135m on
        # the CPU, bench_results/step_cpu.json); a sum that overflows is counted as non-finite (elements near
        # 1e30, which megatron's grad norm would already report as inf).
        bad = not math.isfinite(sums["loss"]) or not bool(
            torch.isfinite(torch.stack([b.grad_data.sum(dtype=torch.float32) for b in module.buffers])).all())
        if comm.any_rank(bad):
            self.skipped_nonfinite += 1
            module.zero_grad_buffer()
            self.optimizer.zero_grad()
            log.warning("mini-batch skipped: non-finite loss (%s) or gradient; the weights are unchanged", sums["loss"])
            m.update(grad_norm=float("nan"), skipped=1.0, skip_reason="non_finite")
            return m
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        m.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), skipped=0.0 if ok else 1.0,
                 skip_reason="" if ok else "optimizer")
        return m
