"""Benchmark: what one GRPO training step costs. Writes JSON.

    python -m bench.step --cpu [--models tiny,smollm2-135m] [--steps 3] [--out bench_results/step_cpu.json]
    python -m bench.step --gpu [--models qwen2.5-0.5b,qwen2.5-1.5b] [--out bench_results/gpu_<device>.json]

--cpu: the framework's overhead. The Megatron path's update step (grpo_mega.trainer.actor.Actor.update on one
mini-batch: the pipeline schedule, vocab-parallel GRPO loss, DDP grad buffer, DistributedOptimizer) against
a plain-PyTorch step doing the same work: the transformers model of the same architecture holding the same
weights (copied through the bridge), the same batch, the same GRPO loss from grpo_mega.algo on
torch.log_softmax logprobs, grad clipping and torch.optim.AdamW (fused, on both sides). fp32, random weights, one process, the
same torch.set_num_threads for both; the median of --steps timed steps after --warmup. Both paths' first
losses are recorded, and must agree (they start from the same weights), so the two sides do the same work.
Then --profile-steps steps of each path under torch.profiler, with megatron-core's own pieces labelled
(MEGATRON_PIECES: the DistributedOptimizer's collectives and copies, grad-buffer zeroing, the attention): each
piece's seconds per step and share of the megatron step, how much of the gap to the plain step they account for,
and the aten ops whose self time differs most between the two (`megatron_core_breakdown`). On a loaded machine (the load average
is recorded) OpenMP threads wait on each other: the seconds of both paths are then inflated, unevenly.

--gpu (on one CUDA device, TP1, bf16, random weights): the update's tokens/s and MFU (the trainer's perf/mfu:
grpo_mega.trainer.timing.model_flops against the GPU's dense bf16 peak), the embedded engine's generated tokens/s, weight sync's bytes/s against
a device-to-device copy of the same bytes, and torch.cuda.max_memory_allocated above the baseline around
each phase against grpo-mega-plan's prediction for the same layout (grpo_mega.planning). --gpu-path-on-cpu
runs that same code on the CPU with the memory and MFU figures left null (the tests use it to keep the GPU
path from rotting unseen).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from bench import common



def synthetic_rollout(vocab: int, groups: int, n: int, prompt_len: int, response_len: int, seed: int = 0):
    """groups x n responses, every prompt `prompt_len` and every response `response_len` tokens (no padding,
    so every token counts), random tokens and rewards, advantages from grpo_mega.algo."""
    import torch

    from grpo_mega import algo
    from grpo_mega.trainer.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        p = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(n):
            prompts.append(p)
            responses.append(torch.randint(0, vocab, (response_len,), generator=g).tolist())
    rb = RolloutBatch.from_samples(prompts, responses)
    rb.advantages = algo.group_advantages(torch.randint(0, 2, (groups * n,), generator=g).float(), n=n).float()
    return rb


def _configs(groups: int, n: int, response_len: int, micro: int, dtype: str):
    from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, PrecisionConfig

    return dict(
        precision=PrecisionConfig(params_dtype=dtype),
        # No weight decay: megatron exempts biases and norms from it, torch's AdamW does not.
        optim=OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0),
        algo_cfg=AlgoConfig(kl_coef=0.01, kl_estimator="k3", entropy_coef=0.01, loss_agg_mode="token-mean",
                            clip_ratio_low=0.2, clip_ratio_high=0.28),
        batch=BatchConfig(train_batch_size=groups, ppo_mini_batch_size=groups, micro_batch_size=micro,
                          max_response_length=response_len),
    )


def _with_logprob_inputs(actor, rb, temperature: float):
    """old/ref logprobs: the actor's own, perturbed (ratios and KL away from their trivial values)."""
    import torch

    logp = actor.logprobs(rb, temperature)
    mask = rb.response_mask()
    g = torch.Generator().manual_seed(1)
    rb.old_logp = (logp + 0.05 * torch.randn(logp.shape, generator=g)) * mask
    rb.ref_logp = (logp + 0.05 * torch.randn(logp.shape, generator=g)) * mask
    return rb


# ---- --cpu: Megatron against plain PyTorch ------------------------------------------------------------------


def hf_model_like(actor, cfg, device=None, **from_config):
    """The transformers model of `cfg`'s architecture with the actor's current weights (through the bridge), fp32,
    built on `device` (default: the CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.models.bridge import FAMILIES
    from grpo_mega.engines.weight_sync import stage_hf_tensors

    hf = FAMILIES.get(cfg.family).hf_config(cfg, dtype="float32")
    config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **from_config)
    weights = dict(stage_hf_tensors(actor.built.gpt, cfg, torch.float32))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF model and bridge disagree: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def plain_step(model, opt, rb, a, temperature: float, clip: float, max_response: int, micro=None, device=None,
               autocast: bool = False) -> float:
    """One GRPO step in plain PyTorch: HF forward, torch.log_softmax logprobs, grpo_mega.algo's loss,
    backward, clip, AdamW. Returns the loss. With `micro`, the batch in micro-batches of that many rows, their
    gradients accumulated (the mini-batch's normaliser for each: the same loss and gradient); `device`: where
    the batch goes; `autocast`: the forward under torch.autocast(bf16) over fp32 weights (transformers' Trainer
    with bf16=True)."""
    import torch

    from grpo_mega import algo

    labels_all, mask_all = rb.labels(), rb.loss_mask()
    normaliser = algo.local_normaliser(a.loss_agg_mode, mask_all, max_response)
    micro = micro or rb.size
    total = 0.0
    for s in range(0, rb.size, micro):
        rows = slice(s, s + micro)
        tokens, labels, mask = rb.tokens[rows], labels_all[rows], mask_all[rows]
        old, ref, adv = rb.old_logp[rows], rb.ref_logp[rows], rb.advantages[rows]
        if device is not None:
            tokens, labels, mask, old, ref, adv = (t.to(device) for t in (tokens, labels, mask, old, ref, adv))
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=tokens).logits
        logits = logits.float() / temperature  # [B, L, V]
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1) * mask
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        kl = algo.kl_penalty(logp, ref, a.kl_estimator)
        token_loss, _ = algo.grpo_token_loss(logp, old, adv, a.clip_ratio_low, a.clip_ratio_high,
                                             a.dual_clip, kl=kl, kl_coef=a.kl_coef, entropy=entropy,
                                             entropy_coef=a.entropy_coef)
        loss = algo.aggregate(token_loss, mask, a.loss_agg_mode, normaliser)
        loss.backward()
        total += float(loss)
        del logits, logp_all, entropy, token_loss, loss
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


# What megatron-core does in an update that the plain step does not, each labelled for torch.profiler by wrapping
# the megatron-core method that does it: label -> (module, class, method, what it is).
MEGATRON_PIECES = {
    "ddp_grad_reduce_scatter": (
        "megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup", "start_grad_sync",
        "DDP's gradient reduce-scatter over the data-parallel group (for the DistributedOptimizer); over one DP "
        "rank the identity, skipped (grpo_mega.parallel.cpu_compat; gloo copied the whole grad buffer)"),
    "distopt_param_all_gather": (
        "megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup", "start_param_sync",
        "DistributedOptimizer's all-gather of the updated parameters; over one DP rank skipped as above"),
    "distopt_main_to_model_params": (
        "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "_copy_main_params_to_model_params",
        "DistributedOptimizer's copy of each main-parameter shard into the model parameter (fp32: the same memory, "
        "a self-copy of every parameter)"),
    "distopt_model_to_main_grads": (
        "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "_copy_model_grads_to_main_grads",
        "DistributedOptimizer's hand-over of grad-buffer shards to the main parameters"),
    "ddp_zero_grad_buffer": (
        "megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel", "zero_grad_buffer",
        "zeroing the contiguous fp32 grad buffer before the backward accumulates into it (the plain step sets "
        "grads to None)"),
    "megatron_attention_forward": (
        "grpo_mega.models.local_attention", "SDPACoreAttention", "forward",
        "the local spec's core attention forward (SDPA, grpo_mega.models.local_attention); the plain model runs "
        "SDPA too (subtracted below)"),
}
# SDPA's forward and backward events (the megatron side's backward; the plain side's both).
SDPA_BACKWARD = "autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0"
PLAIN_ATTENTION = ("aten::scaled_dot_product_attention", SDPA_BACKWARD)


def profile_breakdown(mega_step, plain_step_fn, steps: int, gap_s: float) -> dict:
    """torch.profiler over `steps` steps of each path, megatron-core's pieces (MEGATRON_PIECES) labelled: each
    piece's inclusive seconds per step, its share of the (profiled) megatron step, and how much of the
    measured gap (megatron - plain median, unprofiled) they account for; the attention as the megatron side's
    attention forward + backward minus the plain side's. Then `op_gap`: the aten ops whose self time per step
    differs most between the two (megatron - plain), which names where the rest goes."""
    import importlib

    from torch.profiler import ProfilerActivity, profile, record_function

    saved = []
    for label, (mod, cls, meth, _) in MEGATRON_PIECES.items():
        owner = getattr(importlib.import_module(mod), cls)
        saved.append((owner, meth, owner.__dict__[meth]))
        setattr(owner, meth, record_function(label)(owner.__dict__[meth]))  # a decorator too
    try:
        totals, wall, selfs = {}, {}, {}
        for side, fn in (("megatron", mega_step), ("plain", plain_step_fn)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    fn()
                wall[side] = (time.perf_counter() - t0) / steps
            averages = prof.key_averages()
            totals[side] = {e.key: e.cpu_time_total / 1e6 / steps for e in averages}
            selfs[side] = {e.key: (e.self_cpu_time_total / 1e6 / steps, e.count // steps) for e in averages
                           if e.key.startswith("aten::")}
    finally:
        for owner, meth, fn in saved:
            setattr(owner, meth, fn)
    m, p = totals["megatron"], totals["plain"]
    pieces = {label: dict(seconds_per_step=m.get(label, 0.0), what=what)
              for label, (_, _, _, what) in MEGATRON_PIECES.items()}
    pieces["megatron_attention_backward"] = dict(
        seconds_per_step=m.get(SDPA_BACKWARD, 0.0), what="its backward (SDPA's, with the gather's index_add)")
    plain_attention = sum(p.get(k, 0.0) for k in PLAIN_ATTENTION)
    pieces["plain_sdpa_forward_backward"] = dict(
        seconds_per_step=-plain_attention, what="minus the plain step's SDPA forward + backward (what the "
        "attention costs there)")
    for v in pieces.values():
        v["share_of_megatron_step"] = v["seconds_per_step"] / wall["megatron"]
    explained = sum(v["seconds_per_step"] for v in pieces.values())
    ops = set(selfs["megatron"]) | set(selfs["plain"])
    mega_self, plain_self = ({op: selfs[side].get(op, (0.0, 0)) for op in ops} for side in ("megatron", "plain"))
    diff = {op: mega_self[op][0] - plain_self[op][0] for op in ops}
    op_gap = [dict(op=op, megatron_s=mega_self[op][0], plain_s=plain_self[op][0], difference_s=diff[op],
                   megatron_calls=mega_self[op][1], plain_calls=plain_self[op][1])
              for op in sorted(ops, key=lambda o: -abs(diff[o]))[:12]]
    return dict(profiled_steps=steps, profiled_step_s=wall, pieces=pieces, explained_s=explained, gap_s=gap_s,
                explained_over_gap=explained / gap_s if gap_s > 0 else None, op_gap=op_gap)


def compare_cpu(name: str, steps: int, warmup: int, groups: int, n: int, prompt_len: int, response_len: int,
                profile_steps: int = 0) -> dict:
    import functools

    import torch

    from grpo_mega.conf import ParallelConfig, load_model_config
    from grpo_mega.trainer.actor import Actor

    cfg = load_model_config(name)
    c = _configs(groups, n, response_len, micro=groups * n, dtype="fp32")
    actor = Actor(cfg, ParallelConfig(), **c)
    rb = _with_logprob_inputs(actor, synthetic_rollout(cfg.vocab_size, groups, n, prompt_len, response_len), 1.0)
    model = hf_model_like(actor, cfg)
    # fused: what transformers' Trainer (so TRL) uses on torch >= 2.8, and what the Actor sets on the CPU
    opt = torch.optim.AdamW(model.parameters(), lr=c["optim"].lr, betas=(c["optim"].adam_beta1, c["optim"].adam_beta2),
                            eps=c["optim"].adam_eps, weight_decay=0.0, fused=True)

    update = functools.partial(actor.update, rb, 1.0)
    plain = functools.partial(plain_step, model, opt, rb, c["algo_cfg"], 1.0, c["optim"].clip_grad, response_len)
    runs = common.alternate(dict(megatron=update, plain=plain), warmup + steps)
    mega_s, plain_s = ([wall for wall, _, _ in runs[k][warmup:]] for k in ("megatron", "plain"))
    first = dict(megatron=runs["megatron"][0][2][0]["loss"], plain=runs["plain"][0][2])
    tokens = int((rb.prompt_lens + rb.response_lens).sum())
    med_m, med_p = statistics.median(mega_s), statistics.median(plain_s)
    breakdown = profile_breakdown(update, plain, profile_steps, med_m - med_p) if profile_steps else None
    return dict(
        model=name, params=sum(p.numel() for p in actor.built.gpt.parameters()), responses=rb.size,
        tokens_per_step=tokens, megatron_seconds=mega_s, plain_seconds=plain_s, megatron_median_s=med_m,
        plain_median_s=med_p, ratio_megatron_over_plain=med_m / med_p,
        megatron_tokens_per_s=tokens / med_m, plain_tokens_per_s=tokens / med_p,
        first_step_loss=first, first_step_loss_abs_diff=abs(first["megatron"] - first["plain"]),
        plain_attention=model.config._attn_implementation, megatron_core_breakdown=breakdown,
    )


# ---- --gpu: throughput, MFU, engine, weight sync and memory against the plan -------------------------------


def _diff(a, b):
    return None if a is None or b is None else a - b


def plan_one_gpu(cfg, micro: int, seq: int, num_microbatches: int, dtype: str, **kw):
    """grpo-mega-plan's plan at this benchmark's layout: one GPU, TP1, flash attention, the reference on the GPU,
    the batch config's default logprob chunk and fused output; `kw`: layer_spec (default local), gpu_gib."""
    from grpo_mega import planning
    from grpo_mega.conf import BatchConfig, ParallelConfig

    batch = BatchConfig()
    return planning.plan(planning.PlanInput(
        model=cfg, parallel=ParallelConfig(), world_size=1, micro_batch_size=micro, seq_length=seq,
        num_microbatches=num_microbatches, params_dtype=dtype, reference="gpu", flash_attention=True,
        logprob_chunk_size=batch.logprob_chunk_size, fused_output=batch.fused_output, **{"layer_spec": "local", **kw}))


def largest_fitting(gpu_gib: float, seq: int, micro: int, num_microbatches: int, dtype: str) -> dict:
    """The model_configs model with the most parameters that grpo-mega-plan says fits one GPU of `gpu_gib` at
    this shape (plan_one_gpu, the local spec)."""
    from grpo_mega import planning
    from grpo_mega.conf import ParallelConfig, load_model_config
    from grpo_mega.conf.model import MODEL_CONFIG_DIR

    best, seen = None, []
    for name in sorted(f.stem for f in MODEL_CONFIG_DIR.glob("*.yaml") if not f.stem.startswith("tiny")):
        cfg = load_model_config(name)
        try:
            p = plan_one_gpu(cfg, micro, seq, num_microbatches, dtype, gpu_gib=gpu_gib)
        except ValueError:
            continue
        params = sum(sp.total for sp in planning.stage_params(cfg, ParallelConfig()))
        seen.append(dict(model=name, params=params, planned_gib=p.total_gib, fits=p.fits))
        if p.fits and (best is None or params > best["params"]):
            best = seen[-1]
    return dict(gpu_gib=gpu_gib, chosen=best["model"] if best else None, candidates=seen)


def gpu_report(name: str, steps: int, warmup: int, groups: int, n: int, prompt_len: int, response_len: int,
               micro: int, gen_tokens: int, dtype: str, engine_decode: str = "static", plain: bool = True,
               memory_top: int = 12) -> dict:
    import functools
    import gc

    import torch

    from grpo_mega.conf import ParallelConfig, load_model_config
    from grpo_mega.models.builder import have_transformer_engine
    from grpo_mega.engines.embedded import EmbeddedEngine
    from grpo_mega.engines.weight_sync import sync_weights
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.memory import MemorySites
    from grpo_mega.trainer.reference import Reference
    from grpo_mega.trainer.timing import model_flops, peak_bf16_flops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mem = common.CudaMemory(cuda)
    cfg = load_model_config(name)
    c = _configs(groups, n, response_len, micro, dtype)
    seq = prompt_len + response_len
    measured, t = {}, {}
    sites = MemorySites(memory_top if cuda else 0)  # run.memory_sites's recording, from here through the first update
    if sites.recording:
        warmup = max(warmup, 1)  # the recorded (slower) first update is not timed

    base = mem.now()
    actor = Actor(cfg, ParallelConfig(), **c)
    after_actor = mem.now()
    measured["parameters_and_gradients"] = _diff(after_actor, base)  # weights, fp32 main weights, grad buffer
    reference = Reference(cfg, ParallelConfig(), c["precision"], c["batch"])
    reference.load_from(actor)
    after_ref = mem.now()
    measured["reference"] = _diff(after_ref, after_actor)

    rb = synthetic_rollout(cfg.vocab_size, groups, n, prompt_len, response_len)
    mem.reset_peak()

    def logprob_inputs():
        _with_logprob_inputs(actor, rb, 1.0)
        rb.ref_logp = reference.logprobs(rb, 1.0)

    t["logprobs_s"] = common.timed(logprob_inputs, cuda)[0]
    measured["logprob_forward_peak_above_states"] = _diff(mem.peak(), after_ref)

    times, first_peak, after_first = [], None, None
    for i in range(warmup + steps):
        mem.reset_peak()
        dt = common.timed(lambda: actor.update(rb, 1.0), cuda)[0]
        if i == 0:
            first_peak, after_first = mem.peak(), mem.now()
            t["memory_sites"] = sites.report(1)
        if i >= warmup:
            times.append(dt)
    measured["optimizer"] = _diff(after_first, after_ref)  # Adam's m and v, allocated by the first step
    # The update's transient peak above what stays allocated: activations, logits and the loss's buffers.
    measured["activations_and_logits"] = _diff(first_peak, after_first)
    measured["update_peak_total"] = _diff(first_peak, base)

    params = sum(p.numel() for p in actor.built.gpt.parameters())
    tokens = rb.size * seq
    med = statistics.median(times)
    flops = model_flops(cfg, [seq] * rb.size)
    peak = peak_bf16_flops(torch.cuda.get_device_name()) if cuda else None

    # Weight sync into an embedded engine on the same device, against a plain copy of the same bytes.
    engine_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    before_engine = mem.now()
    engine = EmbeddedEngine.from_model_config(cfg, dtype=engine_dtype, device=str(device), decode=engine_decode)
    measured["embedded_engine"] = _diff(mem.now(), before_engine)
    sync_s = []
    for v in range(3):
        dt, _, stats = common.timed(functools.partial(sync_weights, actor.built.gpt, cfg, engine, version=v + 1,
                                                      bucket_mb=512, dtype=engine_dtype), cuda)
        sync_s.append(dt)
    sync_rate = stats.bytes / min(sync_s)
    copy_rate = common.copy_bytes_per_s(stats.bytes, device)

    prompts = [rb.tokens[g * n, :prompt_len].tolist() for g in range(groups)]
    engine.generate(prompts[:1], 1, 1.0, 1.0, 4, [], seed=0)  # warm-up
    # no stop token: every row runs to the end
    gen_s, _, gen = common.timed(functools.partial(engine.generate, prompts, n, 1.0, 1.0, gen_tokens, [], seed=1), cuda)
    generated = sum(len(x) for x in gen.token_ids)
    engine.shutdown()
    del engine

    # The plain transformers step on the same device, batch, loss and optimizer: fp32 weights (the actor's, through
    # the bridge) under bf16 autocast, SDPA, fused AdamW, the same micro-batches (transformers' Trainer with
    # bf16=True). Built after the actor and reference are freed, so each side has the card to itself.
    plain_out = None
    if plain:
        model = hf_model_like(actor, cfg, device=device, attn_implementation="sdpa")
        del actor, reference
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        opt = torch.optim.AdamW(model.parameters(), lr=c["optim"].lr,
                                betas=(c["optim"].adam_beta1, c["optim"].adam_beta2), eps=c["optim"].adam_eps,
                                weight_decay=0.0, fused=cuda)
        plain_base = mem.now()
        plain_times, plain_peak, plain_loss = [], None, None
        for i in range(warmup + steps):
            mem.reset_peak()
            dt, _, plain_loss = common.timed(lambda: plain_step(
                model, opt, rb, c["algo_cfg"], 1.0, c["optim"].clip_grad, response_len, micro=micro, device=device,
                autocast=dtype == "bf16"), cuda)
            if i == 0:
                plain_peak = _diff(mem.peak(), plain_base)
            if i >= warmup:
                plain_times.append(dt)
        pmed = statistics.median(plain_times)
        plain_out = dict(what="transformers model, fp32 weights under bf16 autocast (fp32 without bf16), SDPA, fused "
                         "AdamW, the same batch, micro-batches, GRPO loss and clipping", seconds=plain_times,
                         median_s=pmed, tokens_per_s=tokens / pmed, mfu=flops / pmed / peak if peak else None,
                         attention=model.config._attn_implementation, last_loss=plain_loss,
                         peak_gib_above_weights=plain_peak, megatron_over_plain=med / pmed)
        del model, opt

    te = have_transformer_engine()  # the layer spec builder.build_gpt picked
    plan = plan_one_gpu(cfg, micro, seq, rb.size // micro, dtype, layer_spec="transformer_engine" if te else "local")
    pg = plan.stages[0].gib
    planned = dict(parameters_and_gradients=pg["parameters"] + pg["gradients"], reference=pg["reference"],
                   optimizer=pg["optimizer"], activations_and_logits=pg["activations"] + pg["logits"],
                   update_peak_total=plan.total_gib)
    return dict(
        model=name, dtype=dtype, params=params, responses=rb.size, seq_len=seq,
        micro_batch_size=micro,
        tokens_per_update=tokens, update_seconds=times, update_median_s=med, update_tokens_per_s=tokens / med,
        update_model_flops=flops, achieved_tflops=flops / med / 1e12, peak_bf16_tflops=peak / 1e12 if peak else None,
        mfu=flops / med / peak if peak else None, logprob_forwards_s=t["logprobs_s"],
        engine_generated_tokens=generated, engine_seconds=gen_s, engine_tokens_per_s=generated / gen_s,
        weight_sync_bytes=stats.bytes, weight_sync_seconds=min(sync_s), weight_sync_gb_per_s=sync_rate / 1e9,
        device_copy_gb_per_s=copy_rate / 1e9, weight_sync_over_copy=sync_rate / copy_rate,
        engine_decode=engine_decode, plain_transformers_step=plain_out,
        memory_sites_at_first_update_peak=t["memory_sites"],
        memory_gib=dict(measured=measured, planned=planned,
                        measured_over_planned={k: (measured[k] / planned[k] if measured.get(k) is not None
                                                   and planned[k] else None) for k in planned}),
    )


def _free_device(name: str) -> None:
    """The next model starts from an empty device: the last one's actor, reference and engine hold reference
    cycles (hooks, the grad buffer) that only a collection frees."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"  after {name}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated", flush=True)


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3' (for the file name)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


def main(argv=None) -> int:
    ap = common.parser(__doc__, None)
    modes = ap.add_mutually_exclusive_group(required=True)
    modes.add_argument("--cpu", action="store_true", help="Megatron's update step against plain PyTorch, on the CPU")
    modes.add_argument("--gpu", action="store_true", help="throughput, MFU, engine, sync and memory on one GPU")
    modes.add_argument("--gpu-path-on-cpu", action="store_true", help="the --gpu code on the CPU (a smoke test)")
    ap.add_argument("--models", default=None, help="model_configs names, comma-separated; with --gpu, 'largest' is "
                    "the largest model grpo-mega-plan says fits this GPU at the benchmark's shape")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads, for both paths")
    ap.add_argument("--groups", type=int, default=None, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--response-len", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=4, help="--gpu: responses per micro-batch")
    ap.add_argument("--gen-tokens", type=int, default=128, help="--gpu: tokens the engine generates per sample")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="--gpu: params dtype")
    ap.add_argument("--profile-steps", type=int, default=2,
                    help="--cpu: steps of each path under torch.profiler, megatron-core's share by piece (0: none)")
    ap.add_argument("--engine-decode", default="static", choices=("dynamic", "static", "compiled", "auto"),
                    help="--gpu: the embedded engine's decode (rollout.embedded_decode; bench.decode compares them)")
    ap.add_argument("--no-plain", action="store_true", help="--gpu: skip the plain transformers step")
    ap.add_argument("--memory-top", type=int, default=12,
                    help="--gpu: allocation sites (torch.cuda.memory._record_memory_history) at the first update's "
                         "peak, largest first (0: not recorded)")
    ap.add_argument("--dry-run", action="store_true", help="print the parsed arguments and exit")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    if args.memory_top < 0:
        ap.error(f"--memory-top={args.memory_top} must be >= 0")
    if args.dry_run:
        print(vars(args))
        return 0

    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    import torch

    if args.gpu and not torch.cuda.is_available():
        print("error: --gpu needs CUDA (torch.cuda.is_available() is False); use --cpu here", file=sys.stderr)
        return 2
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.train import single_process_env

    torch.set_num_threads(args.threads)
    single_process_env()
    load_start = os.getloadavg()
    if args.cpu:
        models = (args.models or "tiny,smollm2-135m").split(",")
        shape = dict(groups=args.groups or 2, n=args.n, prompt_len=args.prompt_len or 32,
                     response_len=args.response_len or 32)
    else:
        models = (args.models or ("qwen2.5-0.5b,qwen2.5-1.5b" if args.gpu else "tiny")).split(",")
        shape = dict(groups=args.groups or 16, n=args.n, prompt_len=args.prompt_len or 256,
                     response_len=args.response_len or 768)
    largest = None
    if "largest" in models:
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
        seq = shape["prompt_len"] + shape["response_len"]
        largest = largest_fitting(gib, seq, args.micro_batch, shape["groups"] * shape["n"] // args.micro_batch,
                                  args.dtype)
        print(f"largest model the plan fits in {gib:.1f} GiB at {shape['groups'] * shape['n']} x {seq}: "
              f"{largest['chosen']}", flush=True)
        models = [m for m in models if m != "largest"]
        if largest["chosen"] and largest["chosen"] not in models:
            models.append(largest["chosen"])
    rows = []
    machine = common.machine()
    mode = "cpu" if args.cpu else ("gpu" if args.gpu else "gpu_path_on_cpu")
    out_path = args.out or common.out_path(
        "step_cpu" if args.cpu else (f"gpu_{device_slug(machine['device'])}" if args.gpu else mode))
    what = ("Megatron update step vs plain PyTorch (HF model, same weights, batch and GRPO loss, AdamW), fp32, CPU"
            if args.cpu else "one GPU, TP1, random weights: update throughput/MFU beside the plain transformers step, "
            "embedded engine, weight sync, memory vs grpo-mega-plan with the allocation sites at the update's peak")

    def write():  # after every model: a step cut off by its time limit keeps what it measured
        out = dict(what=what, mode=mode, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine=machine,
                   threads=args.threads, loadavg_start=list(load_start), loadavg_end=list(os.getloadavg()),
                   steps=args.steps, warmup=args.warmup, batch=shape, largest_fitting=largest, results=rows)
        common.write_json(out_path, out)
        return out

    failed = False
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=1234)
        for name in models:
            if args.cpu:
                r = compare_cpu(name, args.steps, args.warmup, profile_steps=args.profile_steps, **shape)
                print(f"{name}: megatron {r['megatron_median_s']:.3f} s, plain {r['plain_median_s']:.3f} s, "
                      f"ratio {r['ratio_megatron_over_plain']:.2f} (first losses "
                      f"{r['first_step_loss']['megatron']:.6f} / {r['first_step_loss']['plain']:.6f})", flush=True)
                if r["megatron_core_breakdown"]:
                    b = r["megatron_core_breakdown"]
                    for label, v in b["pieces"].items():
                        print(f"  {label:32s} {v['seconds_per_step']:+.3f} s/step ({v['share_of_megatron_step']:+.1%})")
                    print(f"  explained {b['explained_s']:.3f} s of the {b['gap_s']:.3f} s gap", flush=True)
            else:
                try:
                    r = gpu_report(name, args.steps, args.warmup, micro=args.micro_batch, gen_tokens=args.gen_tokens,
                                   dtype=args.dtype if args.gpu else "fp32", engine_decode=args.engine_decode,
                                   plain=not args.no_plain, memory_top=args.memory_top, **shape)
                except torch.OutOfMemoryError as e:  # the next model (and the JSON) still come
                    failed = True
                    rows.append(dict(model=name, error=f"CUDA out of memory: {str(e)[:600]}"))
                    print(f"{name}: CUDA out of memory", flush=True)
                    write()
                    _free_device(name)
                    continue
                mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
                print(f"{name}: update {r['update_tokens_per_s']:.0f} tok/s (MFU {mfu}), engine "
                      f"{r['engine_tokens_per_s']:.0f} tok/s, sync {r['weight_sync_gb_per_s']:.2f} GB/s "
                      f"({r['weight_sync_over_copy']:.3f} of a device copy)", flush=True)
                if p := r["plain_transformers_step"]:
                    print(f"  plain transformers step {p['tokens_per_s']:.0f} tok/s; megatron/plain time "
                          f"{p['megatron_over_plain']:.2f}", flush=True)
                for x in (r["memory_sites_at_first_update_peak"] or {}).get("top", [])[:5]:
                    print(f"  {x['gib']:7.2f} GiB  {x['site']}", flush=True)
            rows.append(r)
            write()
            if not args.cpu:
                _free_device(name)
        destroy_distributed()
    out = write()
    print(f"wrote {out_path} (load average {load_start[0]:.2f} -> {out['loadavg_end'][0]:.2f} "
          f"on {os.cpu_count()} cpus)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
