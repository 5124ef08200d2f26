"""On CUDA nothing of grpo_mega.parallel.cpu_compat is active (issue 37 Build 2): with torch.cuda.is_available()
forced True, apply() and cpu_device_mode() leave every object they patch on a CPU machine untouched, and the
trainer's entry point (init_distributed: apply and the device mode) enters no TorchFunctionMode, and the MoE
dispatcher and DP shapes are megatron's own. Runs on
the CPU, in a fresh interpreter (this one may have applied the patches already), against the unpatched objects
read before the calls; then, as a control that the check can fail, the same script with CUDA left absent must
see every patch applied."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import sys, torch
force = sys.argv[1] == "cuda"
if force:
    torch.cuda.is_available = lambda: True
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer import utils as tutils
from megatron.core.fusions import fused_softmax
from megatron.core.distributed import param_and_grad_buffer as buffers
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.transformer.moe import moe_utils
from torch.overrides import _get_current_function_mode_stack

targets = {
    "CudaRNGStatesTracker": (mrandom, "CudaRNGStatesTracker"),
    "_get_cuda_rng_state": (mrandom, "_get_cuda_rng_state"),
    "_set_cuda_rng_state": (mrandom, "_set_cuda_rng_state"),
    "torch.cuda.current_device": (torch.cuda, "current_device"),
    "torch.cuda.synchronize": (torch.cuda, "synchronize"),
    "utils.get_default_causal_mask": (tutils, "get_default_causal_mask"),
    "utils.get_sliding_window_causal_mask": (tutils, "get_sliding_window_causal_mask"),
    "fused_softmax.get_default_causal_mask": (fused_softmax, "get_default_causal_mask"),
    "dist_all_gather_func": (buffers, "dist_all_gather_func"),
    "dist_reduce_scatter_func": (buffers, "dist_reduce_scatter_func"),
    "_get_write_results_queue": (filesystem_async, "_get_write_results_queue"),
}
before = {k: getattr(m, a) for k, (m, a) in targets.items()}
te_gemm_before = hasattr(moe_utils, "te_general_gemm")

from grpo_mega.parallel import cpu_compat
cpu_compat.apply()
cpu_compat.apply()
with cpu_compat.cpu_device_mode() as mode:
    modes = [type(m).__name__ for m in _get_current_function_mode_stack()]
changed = sorted(k for k, (m, a) in targets.items() if getattr(m, a) is not before[k])
print("applied", cpu_compat._APPLIED)
print("mode", type(mode).__name__ if mode is not None else None)
print("modes", modes)
print("changed", changed)
print("dispatcher", cpu_compat.moe_token_dispatcher(), cpu_compat.needs_equal_micro_batch_shapes(2))
print("te_general_gemm_defined", (not te_gemm_before) and hasattr(moe_utils, "te_general_gemm"))
"""


def _run(which: str) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT, which], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    return out


def test_nothing_of_cpu_compat_is_active_on_cuda():
    cuda = _run("cuda")
    assert cuda["applied"] == "False"
    assert cuda["mode"] == "None" and cuda["modes"] == "[]"  # nullcontext: no CudaToCpuMode
    assert cuda["changed"] == "[]", cuda["changed"]
    assert cuda["te_general_gemm_defined"] == "False"
    assert cuda["dispatcher"] == "alltoall False"  # megatron's own dispatcher, DP ranks' shapes free
    # the control: on this CPU machine the same calls patch every target and enter the mode
    cpu = _run("cpu")
    assert cpu["applied"] == "True" and cpu["modes"] == "['CudaToCpuMode']"
    assert cpu["changed"].count("'") == 2 * 11, cpu["changed"]  # all 11 targets replaced
    assert cpu["te_general_gemm_defined"] == "True"
    assert cpu["dispatcher"] == "allgather True"
