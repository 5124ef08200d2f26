"""Benchmark: full fine-tuning vs LoRA (rank 8 and 64, alpha = 2 x rank, on qkv, proj, fc1, fc2) on the SmolLM2
example (launch_scripts/smollm2_arithmetic.sh: task=prompts, the arithmetic set, math reward, fp32 on the CPU).

    python -m bench.lora [--steps 4] [--val 4] [--modes full,r8,r64] [--model HF_DIR]
                         [--out bench_results/lora_smollm2.json]

Per mode, one training run of the example's settings (the same seed, data and steps; validation before step 1 and
after the last) gives the update time (median timing/update over the steps after the first), the weight sync's
time and the validation reward before and after. The trainer logs no memory or sync bytes, so a forked rank
builds the same actor (TP1, DP1, fp32, the DistributedOptimizer, random weights) and runs one real update on a small
batch, then counts what megatron allocated (distinct storages: the weights, frozen and trained apart, DDP's
gradient buffer, the optimizer's Adam moments; fp32 has no separate main weights) and what the weight sync sends
(grpo_mega.engines.weight_sync.stage_hf_tensors, the bytes it packs), against grpo_mega.planning's model states.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench import common
from grpo_mega.cli.prepare_model import default_out  # light: the standard library only

MODES = {"full": None, "r8": 8, "r64": 64}
EXAMPLE = ["task=prompts", "reward.name=math", "precision.params_dtype=fp32", "batch.train_batch_size=4", "rollout.n=4",
           "batch.ppo_mini_batch_size=4", "batch.micro_batch_size=8", "batch.max_prompt_length=128",
           "batch.max_response_length=32", "optim.lr=2e-6", "optim.weight_decay=0.0", "algo.kl_coef=0.001",
           "algo.clip_ratio_high=0.28", "rollout.temperature=1.0", "eval.pass_k=2", "checkpoint.interval=0"]


def _allocated(model_dir: str, rank) -> dict:
    """On one forked rank: the example's actor, one real update, then megatron's allocations and the sync's bytes."""
    import torch

    from grpo_mega import algo
    from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig
    from grpo_mega.conf.lora import LoraConfig
    from grpo_mega.engines.weight_sync import stage_hf_tensors
    from grpo_mega.models.hf_io import read_hf_config
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.batch import RolloutBatch

    def storage_bytes(tensors) -> int:
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    model = read_hf_config(model_dir)[2]
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=0)
        actor = Actor(model, ParallelConfig(), PrecisionConfig(params_dtype="fp32"),
                      OptimConfig(lr=2e-6, weight_decay=0.0), AlgoConfig(kl_coef=0.0),
                      BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=2, max_response_length=4),
                      lora=None if rank is None else LoraConfig(rank=rank, alpha=2.0 * rank))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.vocab_size, (5,), generator=g).tolist()] * 2
        batch = RolloutBatch.from_samples(prompts, [torch.randint(0, model.vocab_size, (4,), generator=g).tolist()
                                                    for _ in range(2)])
        batch.advantages = algo.group_advantages(torch.tensor([1.0, 0.0]), n=2).float()
        batch.old_logp = actor.logprobs(batch, 1.0)
        (metrics,) = actor.update(batch, 1.0)
        params = list(actor.built.module.module.parameters())
        states = [v for st in actor.optimizer.optimizer.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.dim() > 0]
        sync = sum(t.numel() * t.element_size() for _, t in stage_hf_tensors(actor.built.gpt, model, torch.float32))
        out = dict(trainable_params=sum(p.numel() for p in params if p.requires_grad),
                   frozen_params=sum(p.numel() for p in params if not p.requires_grad),
                   weights_bytes=storage_bytes(params),
                   frozen_bytes=storage_bytes(p for p in params if not p.requires_grad),
                   gradient_bytes=sum(b.grad_data.numel() * b.grad_data.element_size()
                                      for b in actor.built.module.buffers),
                   optimizer_bytes=storage_bytes(states), grad_norm=metrics["grad_norm"], sync_bytes_per_step=sync)
        destroy_distributed()
    return out


def _planned(model_dir: str, rank) -> dict:
    from grpo_mega import planning
    from grpo_mega.conf import ParallelConfig
    from grpo_mega.models.hf_io import read_hf_config

    (st,) = planning.plan(planning.PlanInput(model=read_hf_config(model_dir)[2], parallel=ParallelConfig(),
                                             world_size=1, params_dtype="fp32", reference="none",
                                             layer_spec="local", lora_rank=rank)).stages
    b = {k: round(st.gib[k] * planning.GIB) for k in ("parameters", "gradients", "optimizer")}
    return dict(trainable_params=st.adapter_numel if rank else st.param_numel, **b, total_bytes=sum(b.values()))


def _mode(model_dir: str, rank, rows: list[dict], summary: dict) -> dict:
    from grpo_mega.parallel.forked import run_ranks

    (got,) = run_ranks(_allocated, 1, model_dir, rank, timeout=600)
    measured = dict(parameters=got["weights_bytes"], gradients=got["gradient_bytes"], optimizer=got["optimizer_bytes"])
    return dict(lora_rank=rank, lora_alpha=rank and 2 * rank, planned=_planned(model_dir, rank),
                measured=dict(**got, total_bytes=sum(measured.values())),
                update_s_median=statistics.median(r["timing/update"] for r in rows[1:]),
                update_s=[r["timing/update"] for r in rows], weight_sync_s=[r["timing/weight_sync"] for r in rows],
                step_s=[r["timing/step"] for r in rows], train_reward=[r["reward"] for r in rows],
                grad_norm=[r["grad_norm"] for r in rows], val_reward_before=summary["initial_val_reward"],
                val_reward_after=summary["final_val_reward"])


def main(argv=None) -> int:
    ap = common.parser(__doc__, "lora_smollm2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--val", type=int, default=4, help="validation prompts (the example's val set has 16)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument("--model", default=str(default_out()), help="the HF directory (make smollm2)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an extra override for every run")
    args = ap.parse_args(argv)
    modes = common.names(args.modes, MODES, "--modes")
    if args.steps < 2:
        raise SystemExit(f"--steps={args.steps}: at least 2 (the first step's update time is not measured)")
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model={args.model}: no config.json there (run 'make smollm2' or pass an HF directory)")
    import json

    from grpo_mega.data import arithmetic

    load_before, result = os.getloadavg(), {}
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        data = Path(tmp) / "data"
        arithmetic.write(arithmetic.make_rows(256, seed=0), data / "train.parquet")
        arithmetic.write(arithmetic.make_rows(args.val, seed=1, split="val"), data / "val.parquet")
        overrides = [f"model={args.model}", f"data.train_files={data / 'train.parquet'}",
                     f"data.val_files={data / 'val.parquet'}", f"run.steps={args.steps}",
                     f"eval.interval={args.steps}", *EXAMPLE, *args.set]
        for m in modes:
            run, load, rank = Path(tmp) / m, os.getloadavg(), MODES[m]
            lora = [] if rank is None else [f"lora.rank={rank}", f"lora.alpha={2 * rank}"]
            rows = common.train(run, [*overrides, *lora], f"the {m} run")
            result[m] = _mode(args.model, rank, rows, json.loads((run / "summary.json").read_text()))
            result[m].update(loadavg_before=load, loadavg_after=os.getloadavg())  # the machine is shared
            common.write_json(args.out, _result(args, overrides, result, load_before))
            print(f"{m}: trainable {result[m]['measured']['trainable_params']:,}, model states "
                  f"{result[m]['measured']['total_bytes'] / 2**20:.1f} MiB (planned "
                  f"{result[m]['planned']['total_bytes'] / 2**20:.1f}), update {result[m]['update_s_median']:.2f} s, "
                  f"val {result[m]['val_reward_before']:.2f} -> {result[m]['val_reward_after']:.2f}")
    print(f"-> {args.out}")
    return 0


def _result(args, overrides, modes, load_before) -> dict:
    full = modes.get("full")
    return dict(
        benchmark="full fine-tuning vs LoRA on the SmolLM2 example (launch_scripts/smollm2_arithmetic.sh's settings)",
        machine=common.machine(loadavg_before=load_before, loadavg_after=os.getloadavg()),
        config=dict(model=args.model, steps=args.steps, val_prompts=args.val, overrides=overrides,
                    lora_targets=["qkv", "proj", "fc1", "fc2"]),
        modes=modes,
        vs_full={m: dict(model_state_bytes=r["measured"]["total_bytes"] / full["measured"]["total_bytes"],
                         update_time=r["update_s_median"] / full["update_s_median"],
                         sync_bytes=r["measured"]["sync_bytes_per_step"] / full["measured"]["sync_bytes_per_step"])
                 for m, r in modes.items() if full and m != "full"},
        notes=["measured: megatron's allocations in a forked rank with the same actor after one real update (the "
               "training run logs no memory); planned: grpo_mega.planning at TP1/DP1, fp32, reference none",
               "under LoRA the weight sync sends the merged full weights (W + s B A, fp32, tied embedding once): the "
               "same bytes as full fine-tuning; sending only the adapters is not implemented",
               "the example's lr (2e-6) for every mode; a few steps on 4-16 prompts: the validation rewards say the "
               "runs work, not which mode learns better",
               "times on a shared 2-core CPU"])


if __name__ == "__main__":
    sys.exit(main())
