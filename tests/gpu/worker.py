"""Work for the gpu tests, one job per process: `python -m tests.gpu.worker JOB ARGS...`.

Each job runs on whatever device its process sees (the tests start the CPU side with CUDA_VISIBLE_DEVICES=''
so that cpu_compat applies, and the GPU side with the GPU visible) and writes its results with torch.save,
host tensors only, for the test to compare. Jobs: `init` (the tiny model's initial weights and the update's
inputs, made once on the CPU), `update` (logprobs, one GRPO update and its gradient), `offload` (the
reference's GPU memory across a use), `ckpt-save` / `ckpt-load` (a checkpoint written on one device and
resumed on the other), `packing` (packed rows against padded ones: THD under Transformer Engine).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
from grpo_mega.processes import free_port
from tests.trainer import layouts as L


def _setup():
    from grpo_mega.parallel.state import init_distributed

    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed(tp=1, pp=1, seed=1234)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _configs(dtype: str, optim: dict):
    return dict(
        precision=PrecisionConfig(params_dtype=dtype),
        optim=OptimConfig(**optim),
        algo_cfg=AlgoConfig(loss_agg_mode="token-mean", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01,
                            clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=3.0),
        batch=BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=2,
                          max_response_length=L.MAX_RESPONSE),
    )


# The gradient is read from the grad buffer (fp32 main grads); Adam at lr 1e-3 for the checkpoint round trip.
GRAD_OPTIM = dict(optimizer="sgd", lr=0.0, weight_decay=0.0, clip_grad=1e9, use_distributed_optimizer=False)
ADAM_OPTIM = dict(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1e9, use_distributed_optimizer=True)


def _actor(dtype: str, optim: dict, w0: dict):
    from grpo_mega.trainer.actor import Actor

    actor = Actor(L.model_cfg(), ParallelConfig(), **_configs(dtype, optim))
    gpt = actor.built.gpt
    missing, unexpected = gpt.load_state_dict(w0["weights"], strict=False)
    if unexpected or [k for k in missing if "_extra_state" not in k]:
        raise RuntimeError(f"W0 does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    actor.optimizer.reload_model_params()  # bf16: the fp32 main weights from the loaded ones
    return actor


def _batch(w0: dict, seed: int = 0):
    b = L.rollout(seed)
    b.old_logp, b.ref_logp = w0["inputs"]
    return b


def _weights(gpt) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in gpt.state_dict().items()
            if torch.is_tensor(v) and "_extra_state" not in k}


def job_init(out: str) -> None:
    """Initial weights W0 of the tiny model (fp32, CPU) and the update's inputs: old and reference logprobs
    (W0's own, perturbed) for the rollout of tests.trainer.layouts."""
    from grpo_mega.trainer.actor import Actor

    assert not torch.cuda.is_available(), "init runs on the CPU (CUDA_VISIBLE_DEVICES='')"
    actor = Actor(L.model_cfg(), ParallelConfig(), **_configs("fp32", GRAD_OPTIM))
    batch = L.rollout()
    logp = actor.logprobs(batch, L.TEMPERATURE)
    mask = batch.response_mask()
    inputs = (L.perturbed(logp, mask, 0.3, 1), L.perturbed(logp, mask, 0.2, 2))
    torch.save(dict(weights=_weights(actor.built.gpt), inputs=inputs), out)


def job_update(w0_path: str, out: str, dtype: str) -> None:
    """On this device at `dtype`: W0's logprobs, then one update; its metrics and its fp32 gradient."""
    w0 = torch.load(w0_path)
    actor = _actor(dtype, GRAD_OPTIM, w0)
    batch = _batch(w0)
    logp = actor.logprobs(batch, L.TEMPERATURE)
    (metrics,) = actor.update(batch, L.TEMPERATURE)
    grads = {name: p.main_grad.detach().float().cpu().clone()
             for name, p in actor.built.module.module.named_parameters()}
    torch.save(dict(device=_device(), dtype=dtype, logp=logp.cpu(), mask=batch.response_mask(), metrics=metrics,
                    grads=grads, param_dtype=str(next(actor.built.gpt.parameters()).dtype),
                    param_device=str(next(actor.built.gpt.parameters()).device)), out)


def job_offload(out: str, model: str) -> None:
    """The reference with offload=True holds no GPU memory between uses; the same reference without
    offload (the control) holds its weights. torch.cuda.memory_allocated, in bytes."""
    from grpo_mega.trainer.reference import Reference

    assert torch.cuda.is_available(), "offload is measured on a GPU"
    cfg = load_model_config(model)
    batch_cfg = BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=4, max_response_length=16)
    precision = PrecisionConfig(params_dtype="bf16")
    rollout = L.rollout(vocab=cfg.vocab_size)
    # cuBLAS keeps a workspace (up to 32 MiB on Hopper) allocated from the first matmul on: take it before
    # the baseline, so that what stays allocated after a use is the reference's own.
    for dt in (torch.bfloat16, torch.float32):
        x = torch.ones(64, 64, dtype=dt, device="cuda")
        (x @ x).sum().item()
    del x
    res = {}
    for offload in (True, False):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        ref = Reference(cfg, ParallelConfig(), precision, batch_cfg, offload=offload)
        torch.cuda.synchronize()
        built = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        logp = ref.logprobs(rollout, 1.0)
        torch.cuda.synchronize()
        res[offload] = dict(base=base, after_build=built, peak_during_use=torch.cuda.max_memory_allocated(),
                            after_use=torch.cuda.memory_allocated(), finite=bool(torch.isfinite(logp).all()),
                            param_bytes=sum(p.numel() * p.element_size() for p in ref.built.gpt.parameters()),
                            param_device=str(next(ref.built.gpt.parameters()).device))
        del ref, logp
        torch.cuda.empty_cache()
    torch.save(res, out)


def job_ckpt_save(w0_path: str, ckpt_dir: str, out: str) -> None:
    """From W0: one Adam update, a checkpoint (step 1), then a second update: what a resumed run must repeat."""
    from grpo_mega.trainer import checkpoint
    from grpo_mega.trainer.checkpoint_store import CheckpointStore

    w0 = torch.load(w0_path)
    actor = _actor("fp32", ADAM_OPTIM, w0)
    actor.update(_batch(w0), L.TEMPERATURE)
    w1 = _weights(actor.built.gpt)
    path = checkpoint.save(CheckpointStore(ckpt_dir), 1, actor, None, {"step": 1, "weight_version": 1})
    (m2,) = actor.update(_batch(w0, seed=1), L.TEMPERATURE)
    torch.save(dict(device=_device(), path=str(path), w1=w1, metrics2=m2, w2=_weights(actor.built.gpt)), out)


def job_ckpt_load(w0_path: str, ckpt_path: str, out: str) -> None:
    """Resume the checkpoint on this device (a freshly built actor with other weights), then the second update."""
    from grpo_mega.trainer import checkpoint
    from grpo_mega.trainer.actor import Actor

    w0 = torch.load(w0_path)
    torch.manual_seed(99)
    actor = Actor(L.model_cfg(), ParallelConfig(), **_configs("fp32", ADAM_OPTIM))
    state = checkpoint.load(__import__("pathlib").Path(ckpt_path), actor, None)
    loaded = _weights(actor.built.gpt)
    (m2,) = actor.update(_batch(w0, seed=1), L.TEMPERATURE)
    torch.save(dict(device=_device(), step=state["step"], loaded=loaded, metrics2=m2, w2=_weights(actor.built.gpt),
                    param_device=str(next(actor.built.gpt.parameters()).device)), out)


def job_packing(out: str) -> None:
    """Packed against padded on this device, one model in one process (fp32): old logprobs and one update's
    gradient of the packing rollout (a sequence that fills a 22-token row alone, a row of four). With Transformer
    Engine installed the packed rows run as THD with cu_seqlens (PackedSeqParams); without it, the local spec's
    block-diagonal mask on the GPU. Records which ran."""
    from dataclasses import replace

    from grpo_mega.models.builder import have_transformer_engine
    from grpo_mega.trainer.actor import Actor

    kw = _configs("fp32", GRAD_OPTIM)
    kw["batch"] = replace(kw["batch"], max_prompt_length=L.MAX_PROMPT, micro_batch_size=1)
    actor = Actor(L.model_cfg(), ParallelConfig(), **kw)
    res = dict(device=_device(), transformer_engine=have_transformer_engine())
    for packing in (False, True):
        actor.batch = replace(kw["batch"], packing=packing)
        batch = L.rollout(lengths="packing")
        logp = actor.logprobs(batch, L.TEMPERATURE)
        batch.old_logp, batch.ref_logp = logp + 0.1 * batch.response_mask(), logp
        (metrics,) = actor.update(batch, L.TEMPERATURE)
        grads = {name: p.main_grad.detach().float().cpu().clone()
                 for name, p in actor.built.module.module.named_parameters()}
        res[packing] = dict(logp=logp.cpu(), mask=batch.response_mask(), metrics=metrics, grads=grads)
    torch.save(res, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=("init", "update", "offload", "ckpt-save", "ckpt-load", "packing"))
    ap.add_argument("args", nargs="*")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args(argv)
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed

    with cpu_compat.cpu_device_mode():
        _setup()
        if a.job == "init":
            job_init(*a.args)
        elif a.job == "update":
            job_update(*a.args, dtype=a.dtype)
        elif a.job == "offload":
            job_offload(*a.args, model=a.model)
        elif a.job == "ckpt-save":
            job_ckpt_save(*a.args)
        elif a.job == "packing":
            job_packing(*a.args)
        else:
            job_ckpt_load(*a.args)
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
