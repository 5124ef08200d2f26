"""Rollout routing replay (R3) in the trainer: each MoE layer routes a token to the experts the rollout engine
chose for it, where the engine returned a choice (`algo.routing_replay=rollout`, docs/design.md "Routing
replay"); and the routing agreement metric (the trainer's own top-k against the engine's), which
`algo.routing_replay=measure` takes without replaying (`Replay.replay` False).

Megatron-core 0.16.1 asks `TopKRouter.router_replay` for every top-k (`moe_utils.
topk_routing_with_score_function(..., router_replay=)` calls its `get_replay_topk(scores, topk, num_groups,
group_topk, default_compute_topk)`; with `moe_enable_routing_replay` it is a `router_replay.RouterReplay`). Its
REPLAY_FORWARD action needs a target for every token of the forward and keeps one process-wide list of
instances (the actor's and the reference's routers in one list). The engine has no choice for a sequence's
last token (it is never fed to the engine's model) nor for padding, so each router gets a `Replay` here, with
megatron's contract: it computes the default top-k, then takes the engine's experts where the target is >= 0
and gathers the scores at them, as megatron's REPLAY_FORWARD does (so the router's gradient flows through
the replayed experts' logits). The comparison of the default top-k with the target on the way is the
agreement count. Recompute of whole layers (parallel.recompute=full) would route again in the backward pass
with another micro-batch's target under pipeline parallelism: the config refuses the combination.

Routes travel as `[s, b, M, k]` int16 per micro-batch (`routes`), laid out like the model's input tokens
(s-major as the router flattens its [s, b, h] input; a packed row is b = 1), -1 where the trainer routes as
usual; M the model's MoE layers in order, k its top-k. Under sequence parallelism each TP rank's routers see
its s/tp slice.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class Replay:
    """One router's replay target and agreement counts (duck-types megatron's RouterReplay.get_replay_topk)."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal  # this router's index among the model's MoE layers (the engine's layer axis)
        self.target: Optional[torch.Tensor] = None  # [tokens, k] int64, -1: route as usual
        self.replay = True  # False: only count agreement (the trainer routes on its own)
        self.agree = 0
        self.total = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return probs, idx
        target = self.target.to(scores.device)
        if target.shape != idx.shape:
            raise ValueError(f"routing replay: the router has {tuple(idx.shape)} top-k choices, the engine's routes "
                             f"{tuple(target.shape)} (MoE layer {self.ordinal})")
        have = (target >= 0).all(-1)
        same = (idx.sort(-1).values == target.sort(-1).values).all(-1) & have
        self.agree += int(same.sum())
        self.total += int(have.sum())
        if not self.replay:
            return probs, idx
        idx = torch.where(have.unsqueeze(-1), target, idx)
        return scores.gather(1, idx), idx


def install(gpt: torch.nn.Module, moe_layers: list[bool]) -> list[Replay]:
    """A Replay on every TopKRouter of this GPTModel stage (`moe_layers`: per global layer, whether it holds
    experts: the engine's layer axis counts those). Idempotent."""
    from megatron.core.transformer.moe.router import TopKRouter

    if hasattr(gpt, "_routing_replay"):
        return gpt._routing_replay
    ordinal = {layer: sum(moe_layers[:layer]) for layer in range(len(moe_layers)) if moe_layers[layer]}
    out = []
    for module in gpt.modules():
        if isinstance(module, TopKRouter):
            r = Replay(ordinal[module.layer_number - 1])
            module.router_replay = r
            out.append(r)
    gpt._routing_replay = out
    return out


def set_routes(gpt: torch.nn.Module, routes: Optional[torch.Tensor], sequence_parallel: bool = False) -> None:
    """This stage's routers replay `routes` ([s, b, M, k], -1: route as usual) until reset with None."""
    replays = getattr(gpt, "_routing_replay", None)
    if replays is None:
        if routes is not None:
            raise ValueError("routing replay: the model has no Replay on its routers (models.routing_replay.install)")
        return
    if routes is not None and sequence_parallel:
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        per = routes.shape[0] // tp
        routes = routes[rank * per:(rank + 1) * per]
    for r in replays:
        r.target = None if routes is None else routes[:, :, r.ordinal].reshape(-1, routes.shape[-1]).long()


def set_replay(gpt: torch.nn.Module, replay: bool) -> None:
    """replay=False: the routers route on their own and only count agreement with the routes (the metric
    measured without replay; experiments/routing_replay.py)."""
    for r in getattr(gpt, "_routing_replay", []):
        r.replay = replay


def take_agreement(gpt: torch.nn.Module) -> tuple[int, int]:
    """(token-layer top-k sets equal to the engine's, token-layers with an engine choice) counted on this rank
    since the last call; resets the counts."""
    agree = total = 0
    for r in getattr(gpt, "_routing_replay", []):
        agree, total = agree + r.agree, total + r.total
        r.agree = r.total = 0
    return agree, total


def world_agreement(gpt: torch.nn.Module) -> Optional[float]:
    """Collective: moe/routing_agreement over every rank's counts since the last call (a share: TP ranks
    without sequence parallelism count the same tokens alike, which leaves it unchanged); None without any."""
    counts = torch.tensor(take_agreement(gpt), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(counts)
    agree, total = counts.tolist()
    return agree / total if total else None


def routes_layout(routed: list, indices: list[int], seq_lens: list[int], width: int, packed: bool,
                  moe_layers: int, topk: int) -> torch.Tensor:
    """[s, b, M, k] int16 routes of a micro-batch, -1 where the engine gave none: padded rows (b sequences
    `indices`, each at the start of its row of `width`) or one packed row (b = 1, the sequences back to back).
    routed[i]: [n_i, M, k] (the engine's choices for the first n_i tokens of sequence i) or None."""
    b = 1 if packed else len(indices)
    out = torch.full((width, b, moe_layers, topk), -1, dtype=torch.int16)
    pos = 0
    for j, i in enumerate(indices):
        r = routed[i]
        if r is not None:
            n = min(r.shape[0], seq_lens[i])
            if packed:
                out[pos:pos + n, 0] = r[:n]
            else:
                out[:n, j] = r[:n]
        pos += seq_lens[i]
    return out
