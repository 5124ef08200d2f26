"""CPU compatibility layer for megatron-core 0.16.1: the only place the project bends megatron to run without CUDA.

megatron-core assumes a GPU in a handful of places that the CPU/gloo build of this project reaches. `apply()`
patches each of them, and is a no-op when CUDA is present, so a GPU run executes megatron's code untouched.
Every patch below names the error it prevents. Checked with torch 2.13.0 (CPU wheel) and torch 2.14.1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode_temporarily

log = logging.getLogger(__name__)

_APPLIED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _map_device(device):
    """cuda, cuda:N, an int ordinal, or torch.device('cuda') -> cpu; anything else unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA devices to the CPU in every torch call made under it.

    Prevents `RuntimeError: Torch not compiled with CUDA enabled` / `Found no NVIDIA driver` from the
    `device="cuda"` and `device=torch.cuda.current_device()` literals in megatron's pipeline schedules,
    p2p communication, gradient buffers (`distributed/param_and_grad_buffer.py`), the optimizer and
    `transformer/utils.py:get_default_causal_mask`; and reports CPU tensors' `Tensor.type()` as
    `torch.cuda.*`. A TorchFunctionMode is per thread: enter it on every
    thread that calls into megatron (`cpu_device_mode()`).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The optimizer (`optimizer.py`, `distrib_optimizer.py`) sorts parameters by
            # `param.type() == 'torch.cuda.FloatTensor'` and raises "Wrapped parameters must be one of
            # torch.cuda.FloatTensor, ..." otherwise; `clip_grads.py` asserts the same of every grad.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _map_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def _make_cpu_tracker(base):
    class _CpuRNGStatesTracker(base):
        """megatron's RNG tracker over the CPU default generator.

        Prevents `RuntimeError: Torch not compiled with CUDA enabled` from `torch.cuda.get_rng_state()` in
        `CudaRNGStatesTracker.add` (called by `model_parallel_cuda_manual_seed`) and in `fork()` (used for
        tensor-parallel weight init and dropout). Same semantics: named states, fork swaps the state in
        and out.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return _CpuRNGStatesTracker


def define_te_general_gemm() -> None:
    """Prevents `NameError: name 'te_general_gemm' is not defined` from the MoE router's gating
    (`moe_utils.RouterGatingLinearFunction.forward`: `if te_general_gemm is not None`): moe_utils imports the
    name only inside its `try: import transformer_engine`, so without Transformer Engine it never exists. Bound
    to None, the gating takes its own torch matmul path. A no-op wherever TE defined it (every TE GPU run); it
    is also needed on a GPU without TE, so builder.build_gpt calls it for MoE models besides apply()."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _one_rank_buffer_collectives() -> None:
    """Megatron DDP reduce-scatters the grad buffer, and its DistributedOptimizer all-gathers the param
    buffer, over the data-parallel group after every step, also when that group has one rank; gloo then
    copies the whole buffer both times (measured 0.6 s of a 4.4 s SmolLM2-135M update on this CPU,
    bench_results/step_cpu.json). Over one rank both collectives are the identity: the output is the input
    (megatron passes the same memory, the one shard being the whole buffer), so no call is made; where the
    two differ the input is copied. Several ranks, or an asynchronous call, go to torch.distributed."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    def one_rank(func):
        @functools.wraps(func)
        def call(output, input, *args, group=None, async_op=False, **kwargs):
            if group is None or group.size() != 1 or async_op:
                return func(output, input, *args, group=group, async_op=async_op, **kwargs)
            if output.data_ptr() != input.data_ptr() or output.shape != input.shape:
                output.copy_(input.view_as(output))
            return None

        call.one_rank_identity = True
        return call

    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        func = getattr(buffers, name)
        if not getattr(func, "one_rank_identity", False):
            setattr(buffers, name, one_rank(func))


def _lazy_compile(compile_fn):
    """torch.compile deferred to the first call of what it decorates.

    megatron-core binds `jit_fuser = torch.compile` (megatron/core/jit.py) and decorates ~30 fused kernels with it
    when its modules load; torch.compile's own start-up imports torch._dynamo and inductor, about 3 s of CPU in
    every process that imports megatron, although no CPU code path calls those kernels. Deferred, a kernel that is
    called is compiled at its first call with the same arguments, so nothing changes but the start-up."""

    def lazy(model=None, **kwargs):
        if model is None:
            return lambda fn: lazy(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **kwargs)
            return compiled(*args, **kw)

        return call

    return lazy


def apply() -> None:
    """Patch megatron-core for CPU-only machines. Idempotent; does nothing when CUDA is available."""
    global _APPLIED
    if _APPLIED or cuda_available():
        return
    _APPLIED = True

    # Expected on a CPU machine, and printed once per module at import: not worth a user's attention.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*", category=UserWarning)

    # SGLang's environment brings flash_mla, whose import raises OSError (no libcuda) where
    # megatron.core.transformer.attention catches only ImportError: mark it absent before megatron loads.
    if "flash_mla" not in sys.modules:
        try:
            import flash_mla  # noqa: F401
        except ImportError:
            pass
        except OSError:
            sys.modules["flash_mla"] = None

    # megatron's import decorates its fused kernels with torch.compile (see _lazy_compile): deferred while its
    # modules load, and for the ones loaded later through megatron.core.jit.jit_fuser.
    compile_fn, torch.compile = torch.compile, _lazy_compile(torch.compile)
    try:
        from megatron.core import jit

        jit.jit_fuser = _lazy_compile(compile_fn) if jit.jit_fuser is compile_fn else jit.jit_fuser
    finally:
        torch.compile = compile_fn

    define_te_general_gemm()
    _one_rank_buffer_collectives()

    from megatron.core.tensor_parallel import random as mrandom

    cpu_tracker = _make_cpu_tracker(mrandom.CudaRNGStatesTracker)
    mrandom.CudaRNGStatesTracker = cpu_tracker
    # `_get_cuda_rng_state`/`_set_cuda_rng_state` are used by checkpointed (recomputed) activations and
    # by `_get_all_rng_states`: `torch.cuda.random.get_rng_state` fails without CUDA.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # `torch.cuda.current_device()` raises "Torch not compiled with CUDA enabled"; megatron calls it
    # ~175 times to pick a device, e.g. `torch.empty(n, device=torch.cuda.current_device())` in the
    # backward of `_AllGatherFromTensorParallelRegion`. Autograd backward runs outside any
    # TorchFunctionMode, so the answer must itself be the CPU, not an ordinal the mode would map.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # `torch.cuda.synchronize()` in dist_checkpointing's `preload_tensors` (every save) raises
    # "Torch not compiled with CUDA enabled"; with no device there is nothing to wait for.
    torch.cuda.synchronize = lambda device=None: None

    # The attention masks are built with `device="cuda"` (transformer/utils.py) and, under activation
    # recompute, rebuilt inside the backward pass, where no TorchFunctionMode is active: "Torch not
    # compiled with CUDA enabled". fused_softmax imported them by name, so both references are replaced.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache(maxsize=32)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    def sliding_window_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = causal_mask
        mod.get_sliding_window_causal_mask = sliding_window_mask

    # dist_checkpointing's writer collects results through a spawn-context Manager, which re-imports
    # `__main__` in a fresh interpreter: 3.5-8.5 s a save, and an EOFError when `__main__` cannot be
    # re-run (a forked test rank, a script without a main guard). Without CUDA there is nothing that makes
    # fork unsafe, and a fork-context Manager starts in 0.1-0.3 s.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def _fork_results_queue():
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
        return filesystem_async._results_queue

    filesystem_async._get_write_results_queue = _fork_results_queue


def moe_token_dispatcher() -> str:
    """megatron-core's MoE token dispatcher: `alltoall` with CUDA; `allgather` without, which prevents the
    `alltoall` dispatcher's failure at construction (it makes a torch.cuda.Stream)."""
    return "alltoall" if cuda_available() else "allgather"


def needs_equal_micro_batch_shapes(ep: int) -> bool:
    """Whether every DP rank's i-th micro-batch must have one shape: with expert parallelism on the `allgather`
    dispatcher (moe_token_dispatcher, without CUDA), which all-gathers equal token counts over the EP group
    (unequal ones fail in that all-gather). grpo_mega.trainer.dp_layout pads the rows to one shape then."""
    return ep > 1 and not cuda_available()


def without_device_mode():
    """Context under which this thread's torch calls skip CudaToCpuMode, for code that names no CUDA device (the
    embedded engine's transformers model): under the mode every torch call goes through its Python
    `__torch_function__`, about 1 us each, and a decode step makes hundreds. Nothing where the mode is not this
    thread's innermost one (a GPU, a thread that never entered it, another mode above it)."""
    stack = _get_current_function_mode_stack()
    if stack and isinstance(stack[-1], CudaToCpuMode):
        return _pop_mode_temporarily()
    return contextlib.nullcontext()


def cpu_device_mode():
    """Context under which megatron runs on this thread: CudaToCpuMode without CUDA, nothing with it."""
    if cuda_available():
        return contextlib.nullcontext()
    apply()
    return CudaToCpuMode()
