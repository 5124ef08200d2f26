"""The trainer's collectives over megatron's groups: every all-reduce, gather and broadcast the trainer
needs outside the vocab-parallel op is one of these small functions, each saying which group it spans."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def dp_all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place over the data-parallel group (ranks holding the same model shard, different data)."""
    if _ps().get_data_parallel_world_size() > 1:
        dist.all_reduce(t, op=op, group=_ps().get_data_parallel_group())
    return t


def broadcast_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """In place: every pipeline stage receives the last stage's tensor (same shape and dtype everywhere)."""
    ps = _ps()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return t


def any_rank(flag: bool) -> bool:
    """True on every rank if it is True on any rank (one MAX all-reduce over the whole world): decisions
    such as skipping an optimizer step must be taken by all ranks together, or they hang."""
    t = torch.tensor([1.0 if flag else 0.0], device=_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def reduce_stage_metrics(sums: dict[str, float], mins: Optional[dict[str, float]] = None,
                         maxs: Optional[dict[str, float]] = None) -> tuple[dict, dict, dict]:
    """Metrics computed on the last pipeline stage: SUM (and MIN/MAX) over DP, then sent to every stage.

    Keys must be the same on every rank; non-last stages pass anything (their values are replaced).
    """
    mins, maxs = mins or {}, maxs or {}
    keys_s, keys_n, keys_x = sorted(sums), sorted(mins), sorted(maxs)
    dev = _device()
    s = torch.tensor([float(sums[k]) for k in keys_s], dtype=torch.float64, device=dev)
    n = torch.tensor([float(mins[k]) for k in keys_n], dtype=torch.float64, device=dev)
    x = torch.tensor([float(maxs[k]) for k in keys_x], dtype=torch.float64, device=dev)
    if s.numel():
        dp_all_reduce(s)
        broadcast_from_last_stage(s)
    if n.numel():
        dp_all_reduce(n, op=dist.ReduceOp.MIN)
        broadcast_from_last_stage(n)
    if x.numel():
        dp_all_reduce(x, op=dist.ReduceOp.MAX)
        broadcast_from_last_stage(x)
    return (dict(zip(keys_s, s.tolist())), dict(zip(keys_n, n.tolist())), dict(zip(keys_x, x.tolist())))


def all_gather_objects(obj) -> list:
    """Every rank's picklable object, indexed by global rank, on every rank (e.g. each engine's samples)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """A picklable object from global rank `src` to every rank (e.g. the engine's samples)."""
    box = [obj]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj, dst: int = 0) -> Optional[list]:
    """Every rank's picklable object, indexed by global rank, on rank `dst` only (None elsewhere)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def scatter_objects(objs: Optional[list], src: int = 0):
    """Rank `src`'s objs[r] to global rank r (objs: one picklable object per rank, given on `src` only)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return objs[0]
    box = [None]
    dist.scatter_object_list(box, objs if dist.get_rank() == src else None, src=src)
    return box[0]


def world_max(values: list[float]) -> list[float]:
    """The element-wise maximum of a list of floats over every rank (one MAX all-reduce over the world),
    e.g. each phase's seconds: a step is as slow as its slowest rank."""
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def world_all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """SUM over every rank of the world, in place (moved to the collective's device and back): e.g. per-sample
    scores where exactly one rank holds each entry and the others hold 0, which sums exactly."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return t
    dev = _device()
    buf = t.to(dev)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    t.copy_(buf.to(t.device))
    return t
