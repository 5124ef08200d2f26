"""The frozen reference policy: its own copy of the weights (Reference), or under LoRA the actor with its
adapters off (AdapterOffReference, no second copy). `actor` below is a grpo_mega.trainer.actor.Actor (not
imported: the actor imports this module).
"""

from __future__ import annotations

import contextlib

import torch

from grpo_mega.conf.batch import BatchConfig
from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.optim import PrecisionConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.models.builder import Built, build_reference, copy_weights, move_module
from grpo_mega.trainer.batch import RolloutBatch
from grpo_mega.trainer.forward import forward_logprobs


class Reference:
    """The frozen reference policy: same placement as the actor; its logprobs, or its logits inside the
    actor's update (`Actor.update(..., reference=)`, full KL in the loss). With `offload`, its weights wait
    in host memory between uses and visit the GPU only for those."""

    def __init__(self, model_cfg: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, batch: BatchConfig,
                 offload: bool = False, replay: bool = True):
        self.model_cfg, self.parallel, self.batch = model_cfg, parallel, batch
        self.built = build_reference(model_cfg, parallel, precision)
        if model_cfg.is_moe:  # `replay`: routes given with the rollout are followed (False: only compared)
            from grpo_mega.models import routing_replay

            routing_replay.install(self.built.gpt, model_cfg.moe_layers())
            routing_replay.set_replay(self.built.gpt, replay)
        self.offload = offload and torch.cuda.is_available()
        if self.offload:
            move_module(self.built.gpt, "cpu")

    @contextlib.contextmanager
    def on_device(self):
        """The weights on this rank's GPU for the duration (with `offload`; nothing to do otherwise)."""
        if self.offload:
            move_module(self.built.gpt, f"cuda:{torch.cuda.current_device()}")
        try:
            yield self.built.gpt
        finally:
            if self.offload:
                move_module(self.built.gpt, "cpu")

    def logprobs(self, rollout: RolloutBatch, temperature: float) -> torch.Tensor:
        with self.on_device():
            return forward_logprobs(self.built.module, self.model_cfg, self.parallel, self.batch, rollout, temperature)

    def load_from(self, actor) -> None:
        """Iterative RL: the reference becomes a copy of the current policy."""
        copy_weights(actor.built.gpt, self.built.gpt)


class AdapterOffReference:
    """The reference under LoRA: the actor itself with its adapters off (grpo_mega.models.lora), the same
    placement, forward and lockstep path as `Reference`, no second copy of the weights."""

    def __init__(self, actor):
        self.model_cfg, self.parallel, self.batch = actor.model_cfg, actor.parallel, actor.batch
        gpt = actor.built.gpt
        self.built = Built(module=gpt, gpt=gpt, config=actor.built.config)

    @contextlib.contextmanager
    def on_device(self):
        yield self.built.gpt

    def logprobs(self, rollout: RolloutBatch, temperature: float) -> torch.Tensor:
        from grpo_mega.models.lora import adapters_disabled

        with adapters_disabled(self.built.gpt):
            return forward_logprobs(self.built.module, self.model_cfg, self.parallel, self.batch, rollout, temperature)

    def load_from(self, actor) -> None:
        """Nothing to copy: the base weights are the actor's, frozen."""
        if actor.built.gpt is not self.built.gpt:
            raise ValueError("AdapterOffReference.load_from: a different actor; the reference is its own actor's base")
