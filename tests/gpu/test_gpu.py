"""The trainer on a CUDA GPU against the same work on the CPU: a TP1 update (fp32 and bf16), reference offload
measured with torch.cuda.memory_allocated, and checkpoints moving GPU -> CPU and CPU -> GPU.

Marked `gpu`: collected everywhere, skipped with "no CUDA" where torch sees no GPU (tests/conftest.py). Every
job runs in its own process (tests/gpu/worker.py): the CPU side with CUDA_VISIBLE_DEVICES='' so that it takes
the CPU path (cpu_compat, gloo) exactly as on a machine without a GPU.
"""

import os
import sys

import pytest
import torch

from tests.proc import run_tree

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# fp32 on the GPU against fp32 on the CPU: the same math in another summation order (TF32 is off by default
# for matmuls in torch). bf16 on the GPU against fp32 on the CPU: bf16 keeps 8 significant bits (2^-8 = 0.4%
# per rounding); measured on the CPU (bf16 vs fp32, the same tiny model and batch): logprobs 3.0e-3 max,
# gradient 7.1e-3 relative, loss 6e-4 relative. The bounds are about 5-10x those.
FP32_TOL = dict(logp_max=1e-4, grad_rel=1e-4, loss_rel=1e-5)
BF16_TOL = dict(logp_max=3e-2, logp_mean=5e-3, grad_rel=3e-2, grad_cos=0.999, loss_abs=5e-3)


def _job(*args, cuda: bool, timeout: float = 300):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = run_tree([sys.executable, "-W", "ignore", "-m", "tests.gpu.worker", *args], timeout=timeout,
                    capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, f"worker {args[0]} ({'cuda' if cuda else 'cpu'}) failed:\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def w0(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "w0.pt"
    _job("init", str(path), cuda=False)
    return path


def _update(w0, tmp, device: str, dtype: str) -> dict:
    out = tmp / f"update_{device}_{dtype}.pt"
    _job("update", str(w0), str(out), "--dtype", dtype, cuda=device == "cuda")
    res = torch.load(out)
    assert res["device"] == device and res["param_device"].startswith(device), res["param_device"]
    return res


def _flat(grads: dict, names) -> torch.Tensor:
    return torch.cat([grads[n].flatten() for n in names])


def test_update_on_cuda_matches_cpu(w0, tmp_path):
    """One GRPO update of the tiny model at TP1 from the same weights and batch: logprobs, loss, grad norm and
    the whole fp32 gradient, GPU against CPU, in fp32 and in bf16."""
    cpu = _update(w0, tmp_path, "cpu", "fp32")
    names = sorted(cpu["grads"])
    g_cpu = _flat(cpu["grads"], names)
    mask = cpu["mask"]
    assert g_cpu.norm() > 0

    gpu32 = _update(w0, tmp_path, "cuda", "fp32")
    assert (gpu32["logp"] - cpu["logp"]).abs()[mask].max() <= FP32_TOL["logp_max"]
    assert gpu32["metrics"]["loss"] == pytest.approx(cpu["metrics"]["loss"], rel=FP32_TOL["loss_rel"], abs=1e-7)
    assert (_flat(gpu32["grads"], names) - g_cpu).norm() / g_cpu.norm() <= FP32_TOL["grad_rel"]

    gpu16 = _update(w0, tmp_path, "cuda", "bf16")
    assert gpu16["param_dtype"] == "torch.bfloat16"
    d = (gpu16["logp"] - cpu["logp"]).abs()[mask]
    assert d.max() <= BF16_TOL["logp_max"] and d.mean() <= BF16_TOL["logp_mean"], (d.max(), d.mean())
    assert abs(gpu16["metrics"]["loss"] - cpu["metrics"]["loss"]) <= BF16_TOL["loss_abs"]
    g16 = _flat(gpu16["grads"], names)
    assert (g16 - g_cpu).norm() / g_cpu.norm() <= BF16_TOL["grad_rel"]
    assert torch.nn.functional.cosine_similarity(g16, g_cpu, dim=0) >= BF16_TOL["grad_cos"]


def test_reference_offload_frees_gpu_memory(tmp_path):
    """algo.ref_offload: the reference (SmolLM2-135M-shaped, bf16) holds no GPU memory after it is built and
    after each use, and holds its weights on the GPU during the use. The same reference without offload is
    the control: its weights stay allocated (so the measurement can see them)."""
    out = tmp_path / "offload.pt"
    _job("offload", str(out), cuda=True)
    res = torch.load(out)
    on, off = res[True], res[False]
    weights = on["param_bytes"]
    assert weights > 200 * 2**20  # 135M parameters in bf16
    slack = 32 * 2**20  # rotary tables, the allocator's rounding: well under the weights' 257 MiB
    assert on["param_device"] == "cpu" and on["finite"] and off["finite"]
    assert on["after_build"] - on["base"] <= slack, on
    assert on["after_use"] - on["base"] <= slack, on
    assert on["peak_during_use"] - on["base"] >= weights, on
    assert off["param_device"].startswith("cuda")
    assert off["after_use"] - off["base"] >= weights, off


@pytest.mark.parametrize("save_on,load_on", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_gpu_and_cpu(w0, tmp_path, save_on, load_on):
    """A checkpoint (weights, DistributedOptimizer's Adam state, schedule, RNG) written on one device resumes
    on the other: the loaded weights are the saved ones bit for bit, and the next update equals the one the
    saving run took (fp32; FP32_TOL), which it cannot without Adam's moments."""
    saved, loaded = tmp_path / "saved.pt", tmp_path / "loaded.pt"
    _job("ckpt-save", str(w0), str(tmp_path / "ckpt"), str(saved), cuda=save_on == "cuda")
    s = torch.load(saved)
    assert s["device"] == save_on
    _job("ckpt-load", str(w0), s["path"], str(loaded), cuda=load_on == "cuda")
    r = torch.load(loaded)
    assert r["device"] == load_on and r["param_device"].startswith(load_on) and r["step"] == 1
    for k, v in s["w1"].items():
        assert torch.equal(r["loaded"][k], v), k
    step = max((s["w2"][k] - s["w1"][k]).abs().max().item() for k in s["w1"])
    assert step > 1e-4  # the second update moved the weights (lr 1e-3)
    for k in s["w2"]:
        assert torch.allclose(r["w2"][k], s["w2"][k], rtol=0, atol=1e-6), k
    for key in ("loss", "grad_norm"):
        assert r["metrics2"][key] == pytest.approx(s["metrics2"][key], rel=1e-4, abs=1e-6), key


def test_packed_rows_on_cuda_match_padded(tmp_path):
    """batch.packing on the GPU: Transformer Engine's THD path (PackedSeqParams, cu_seqlens) where TE is
    installed, else the local spec's block-diagonal mask; old logprobs and the update's gradient against the
    padded path in the same process, fp32 (FP32_TOL: another kernel order, TF32 off)."""
    out = tmp_path / "packing.pt"
    _job("packing", str(out), cuda=True)
    res = torch.load(out)
    print("packed path:", "Transformer Engine THD" if res["transformer_engine"] else "local spec, block mask")
    padded, packed = res[False], res[True]
    mask = padded["mask"]
    assert (packed["logp"] - padded["logp"]).abs()[mask].max() <= FP32_TOL["logp_max"]
    names = sorted(padded["grads"])
    g = _flat(padded["grads"], names)
    assert g.norm() > 0
    assert (_flat(packed["grads"], names) - g).norm() / g.norm() <= FP32_TOL["grad_rel"]
    assert packed["metrics"]["loss"] == pytest.approx(padded["metrics"]["loss"], rel=FP32_TOL["loss_rel"], abs=1e-7)
    assert packed["metrics"]["computed_tokens"] < padded["metrics"]["computed_tokens"]
