"""MoE metrics of an update pass: the load-balancing aux loss (and router z-loss) megatron-core's router
computed, and how many tokens each expert was routed.

The losses come from megatron's own tracker (`moe_utils.save_to_aux_losses_tracker`, which the router fills
with `aux_loss / coeff` per layer and micro-batch in training) and are reduced by its own
`reduce_aux_losses_tracker_across_ranks`. The token load is counted here by a forward hook on each router
(`routing_map` [tokens, num_experts], summed over tokens; only while autograd records, so that a recomputed
forward counts once, as megatron's expert-bias counter does), then summed over pipeline stages and DP ranks,
and over TP ranks only under sequence parallelism (otherwise every TP rank routed the same tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MoEMetrics:
    """Hooks on every TopKRouter of one GPTModel stage. `start()` before an update pass, `metrics(n)` after it
    (n: micro-batches in the pass); collective over the world, identical on every rank."""

    def __init__(self, gpt: torch.nn.Module, num_layers: int, num_experts: int, sequence_parallel: bool):
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_experts, self.sequence_parallel = num_experts, sequence_parallel
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.moe_layers: set[int] = set()
        for module in gpt.modules():
            if isinstance(module, TopKRouter):
                self.moe_layers.add(module.layer_number - 1)
                module.register_forward_hook(self._hook)

    def _hook(self, router, inputs, output) -> None:
        if router.training and torch.is_grad_enabled():
            routing_map = output[1]  # [tokens, num_experts] bool
            self.counts[router.layer_number - 1] += routing_map.detach().sum(0).to("cpu", torch.float64)

    def start(self) -> None:
        from megatron.core.transformer.moe import moe_utils

        self.counts.zero_()
        moe_utils.clear_aux_losses_tracker()

    def metrics(self, num_micro_batches: int) -> dict:
        """moe/aux_loss (and moe/z_loss): mean over MoE layers and micro-batches of the unscaled loss (the
        switch load-balancing loss is 1 at a uniform load); moe/expert_load/e{j}: expert j's share of the
        routed tokens, over all MoE layers (1 / num_experts each when balanced); moe/expert_load_max and
        moe/expert_load_min: the largest and smallest (layer, expert) load over the uniform load."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe import moe_utils

        out = {}
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        names = sorted(tracker)
        if names:
            moe_utils.reduce_aux_losses_tracker_across_ranks(names)
        layers = torch.zeros(self.counts.shape[0], dtype=torch.float64)
        layers[sorted(self.moe_layers)] = 1
        dist.all_reduce(layers, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
        moe = layers.bool()
        for name in names:
            values = tracker[name]["values"].detach().to("cpu", torch.float64)
            key = {"load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}.get(name, f"moe/{name}")
            out[key] = float(values[moe].mean()) / max(num_micro_batches, 1)
        counts = self.counts.clone()
        dist.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
        if self.sequence_parallel:
            dist.all_reduce(counts, group=ps.get_tensor_model_parallel_group())
        counts = counts[moe]
        total = counts.sum()
        if total > 0:
            share = counts.sum(0) / total
            out.update({f"moe/expert_load/e{j}": float(s) for j, s in enumerate(share)})
            per_layer = counts / counts.sum(1, keepdim=True) * self.num_experts
            out["moe/expert_load_max"] = float(per_layer.max())
            out["moe/expert_load_min"] = float(per_layer.min())
        return out
