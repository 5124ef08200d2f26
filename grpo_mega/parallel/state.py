"""Process groups for the trainer: a thin layer over `megatron.core.parallel_state`.

Owns: starting torch.distributed (on GPU NCCL for CUDA tensors and gloo for host tensors; gloo on CPU),
checking the TP x PP x DP layout against the world size, creating megatron's groups and seeding its RNG
tracker. Everything else reads the groups from megatron's parallel_state; nothing here knows about models or
the loss.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpo_mega.parallel import cpu_compat


_RUNTIME: list = []
"""The device mode init_distributed entered on a machine without CUDA (left by destroy_distributed)."""


@dataclass(frozen=True)
class Layout:
    """One rank's place in the TP x PP x DP grid."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1
    ep_rank: int = 0


def check_layout(world_size: int, tp: int, pp: int, ep: int = 1) -> int:
    """Return dp = world_size / (tp * pp), or raise ValueError naming the sizes that do not fit (ep must divide dp)."""
    for name, value in (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {tp} * {pp} = {tp * pp}; "
            f"launch a multiple of {tp * pp} ranks or change the layout"
        )
    dp = world_size // (tp * pp)
    if dp % ep:
        raise ValueError(f"parallel.ep={ep} must divide the data-parallel size dp={dp} "
                         f"(world {world_size} / (tp {tp} * pp {pp})): experts are split over DP ranks")
    return dp


def default_backend() -> str:
    """gloo on CPU. On GPU both: NCCL carries CUDA tensors, gloo the host tensors the trainer also sends
    (the logprobs gathered over DP and PP, weight-sync buckets and their headers, the rank table): under
    plain "nccl" every collective on a host tensor fails ("No backend type associated with device type cpu")."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(tp: int = 1, pp: int = 1, seed: int = 1234, timeout_s: float = 1800.0, ep: int = 1) -> Layout:
    """Start torch.distributed if needed (env:// rendezvous, as torchrun sets it), create megatron's
    model-parallel groups for `tp` x `pp` (dp is what remains; `ep` expert-parallel ranks within it, the
    expert tensor-parallel size megatron's default, tp) and seed megatron's RNG tracker. `timeout_s`
    (dist.timeout_s) bounds every collective of the world's and megatron's groups.

    On a machine without CUDA the CPU compatibility layer is applied first, the backend is gloo, and this thread
    runs under cpu_compat's device mode (CUDA devices mapped to the CPU) until destroy_distributed: whoever
    starts the process groups gets the runtime megatron needs, no entry point has to remember it.
    """
    cpu_compat.apply()
    if not torch.cuda.is_available() and not _RUNTIME:
        mode = cpu_compat.cpu_device_mode()
        mode.__enter__()
        _RUNTIME.append(mode)
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=default_backend(), timeout=datetime.timedelta(seconds=timeout_s)
        )
    dp = check_layout(dist.get_world_size(), tp, pp, ep)

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep,
                                 distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep=ep,
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default process group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _RUNTIME:
        _RUNTIME.pop().__exit__(None, None, None)
