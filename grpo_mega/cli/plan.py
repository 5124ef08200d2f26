"""Memory per GPU of a GRPO training layout, before a GPU is touched; refuses layouts that do not fit.

    grpo-mega-plan --model llama-3.1-70b --nodes 8 --tp 8 --pp 4 --seq-len 4096 --engine-mem 0.3
    grpo-mega-plan --from-launch-script launch_scripts/llama-3.1-70b.sh [OVERRIDE ...] [--json] [--verify]
    python -m grpo_mega.cli.plan ...   (the same)

Per GPU of the worst pipeline stage: parameters (weights + fp32 main weights), the fp32 gradient buffer,
Adam state, activations held by 1F1B, logits and loss buffers, the KL reference and a colocated rollout
engine's share, against the GPU's memory less a margin. Under LoRA (lora.rank, --lora-rank) the parameters are
the frozen base and the adapters, gradients and optimizer state the adapters' alone, and there is no reference.
Exit status 0: fits; 1: does not fit (the reason names the component, and layouts of the same GPUs that fit are
listed); 2: invalid layout or arguments.
--from-launch-script runs the script with `sbatch` replaced by a recorder (nothing is submitted), composes
the Hydra overrides it would submit with the real config schema and plans that run; a `# plan: FLAGS` line
in the script adds planner flags for what the schema does not hold (the engine's share). --verify builds
each pipeline stage on the meta device under a fake process group and compares parameter bytes.
The arithmetic is grpo_mega/planning.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from grpo_mega import planning
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.conf.model import load_model_config

_STUB = """#!/bin/sh
: > "$GRPO_MEGA_PLAN_SBATCH_ARGS"
for a in "$@"; do printf '%s\\0' "$a" >> "$GRPO_MEGA_PLAN_SBATCH_ARGS"; done
echo "sbatch recorded by grpo-mega-plan (nothing submitted)"
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*",
                    help="with --from-launch-script: extra Hydra overrides, passed to the script (its \"$@\")")
    ap.add_argument("--from-launch-script", metavar="PATH", help="plan the run this launch script would submit")
    ap.add_argument("--model", help="model_configs name, YAML path, or HF directory")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE models): experts split over ep DP ranks")
    ap.add_argument("--dp", type=int, help="data-parallel size (default: from --gpus or --nodes x --gpus-per-node)")
    ap.add_argument("--gpus", type=int, help="total GPUs")
    ap.add_argument("--nodes", type=int, help="nodes (x --gpus-per-node)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                    help="sequence parallel (default: on when tp > 1)")
    ap.add_argument("--recompute", choices=planning.RECOMPUTE, default="none")
    ap.add_argument("--first-stage-layers", type=int, help="uneven pipeline: layers on the first stage")
    ap.add_argument("--last-stage-layers", type=int, help="uneven pipeline: layers on the last stage")
    ap.add_argument("--micro-batch", type=int, default=1, help="responses per forward on one rank")
    ap.add_argument("--seq-len", type=int, default=4096, help="prompt + response tokens")
    ap.add_argument("--num-microbatches", type=int, help="micro-batches per DP rank per mini-batch (default: >= pp)")
    ap.add_argument("--precision", choices=("bf16", "fp8", "fp32"), default="bf16",
                    help="fp8: bf16 weights, TE FP8 GEMMs")
    ap.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--ref", choices=planning.REFERENCE, default="gpu",
                    help="KL reference: resident, offloaded, or none")
    ap.add_argument("--engine-mem", default="0", help="colocated rollout engine per GPU: a fraction of the GPU "
                    "(SGLang's mem_fraction_static, e.g. 0.3) or GiB (e.g. 20GiB); 0: engine on other GPUs")
    ap.add_argument("--gpu-gib", type=float, default=planning.H100_GIB,
                    help="GPU memory (default: H100 80GB, 79.6 GiB)")
    ap.add_argument("--margin", type=float, default=0.10, help="fraction of the GPU kept free (default 0.10)")
    ap.add_argument("--unfused-attention", action="store_true", help="attention keeps [a, s, s] scores")
    ap.add_argument("--local-spec", action="store_true",
                    help="megatron-core's local layers (no Transformer Engine): torch norms, SDPA attention, unfused SwiGLU")
    ap.add_argument("--logprob-chunk", type=int, help="tokens per chunk of the vocab-parallel loss op")
    ap.add_argument("--unfused-output", action="store_true",
                    help="batch.fused_output=false: the output layer's whole logits, then the loss op")
    ap.add_argument("--full-kl", action="store_true", help="algo.kl_estimator=full (the reference's logits in the loss)")
    ap.add_argument("--lora-rank", type=int, help="lora.rank: a frozen base and adapters of this rank, the only "
                    "weights with gradients and optimizer state; no reference model; megatron-core's local layers")
    ap.add_argument("--lora-targets", default=",".join(planning.LORA_TARGETS),
                    help="lora.target_modules, comma-separated (default: qkv,proj,fc1,fc2)")
    ap.add_argument("--suggest", type=int, default=5, help="layouts to suggest when this one does not fit")
    ap.add_argument("--verify", action="store_true", help="compare parameter bytes with the meta-device build")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap


def engine_gib(spec: str, gpu_gib: float) -> float:
    s = str(spec).strip()
    for unit in ("GiB", "G"):
        if s.endswith(unit):
            return float(s[: -len(unit)])
    x = float(s)
    if not 0 <= x <= 1:
        raise ValueError(f"--engine-mem={spec!r}: a fraction in [0, 1] of the GPU, or GiB with a unit (20GiB)")
    return x * gpu_gib


def resolve_model(name: str):
    if (Path(name) / "config.json").is_file():
        from grpo_mega.models.hf_io import read_hf_config

        return read_hf_config(name)[2]
    return load_model_config(name)


# ---- launch scripts -----------------------------------------------------------------------------------


def record_launch_script(path: str, extra: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Run a launch script with `sbatch` replaced by a recorder; returns (sbatch options, Hydra overrides,
    planner flags from its `# plan:` lines)."""
    script = Path(path)
    if not script.is_file():
        raise ValueError(f"--from-launch-script {path}: no such file")
    text = script.read_text()
    if not any(line.lstrip().startswith(("sbatch ", "exec sbatch ")) for line in text.splitlines()):
        raise ValueError(f"{path} does not submit with sbatch; --from-launch-script plans only scripts that run "
                         "`sbatch ... slurm/train.sbatch OVERRIDES` (it runs the script with sbatch recorded)")
    flags = []
    for line in text.splitlines():
        if line.startswith("# plan:"):
            flags += shlex.split(line[len("# plan:"):])
    with tempfile.TemporaryDirectory(prefix="grpo_mega_plan_") as tmp:
        stub, record = Path(tmp) / "sbatch", Path(tmp) / "args"
        stub.write_text(_STUB)
        stub.chmod(0o755)
        env = dict(os.environ, PATH=f"{tmp}{os.pathsep}{os.environ.get('PATH', '')}",
                   GRPO_MEGA_PLAN_SBATCH_ARGS=str(record))
        # Its own session, so that a script that does more than submit is ended with all it started.
        proc = subprocess.Popen(["bash", str(script), *extra], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise ValueError(f"{path} was still running after 30 s; a launch script only submits") from None
        if proc.returncode != 0:
            raise ValueError(f"{path} exited with {proc.returncode}: {err.strip()[-500:]}")
        if not record.is_file():
            raise ValueError(f"{path} never called sbatch; a launch script submits with "
                             "`sbatch ... slurm/train.sbatch OVERRIDES`")
        args = record.read_text().split("\0")[:-1]
    for i, a in enumerate(args):
        if not a.startswith("-") and (a.endswith(".sbatch") or a.endswith(".sh")):
            return args[:i], args[i + 1:], flags
    raise ValueError(f"{path}: no sbatch script among the sbatch arguments {args}")


def sbatch_option(options: list[str], *names: str):
    for i, o in enumerate(options):
        for n in names:
            if o.startswith(n + "="):
                return o.split("=", 1)[1]
            if o == n and i + 1 < len(options):
                return options[i + 1]
    return None


def sbatch_defaults(options: list[str]) -> list[str]:
    """The overrides slurm/train.sbatch puts before the script's own: checkpoints under the job's name."""
    job = sbatch_option(options, "--job-name", "-J") or "grpo-mega"
    return [f"checkpoint.dir=logs/{job}/checkpoints", "checkpoint.resume=auto"]


def compose(overrides: list[str]) -> dict:
    """The run's config exactly as `python -m grpo_mega.train OVERRIDES` composes it (Hydra, the real schema),
    with each typed component constructed, so every field is validated."""
    warnings.simplefilter("ignore")
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from grpo_mega.conf.schema import TrainConfig, register_schema

    register_schema()

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="grpo_mega.conf", version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    c = OmegaConf.to_container(cfg, resolve=True)
    tc = TrainConfig.from_hydra(cfg)
    typed = {k: getattr(tc, k) for k in ("parallel", "precision", "optim", "algo", "rollout", "batch", "run", "eval",
                                         "checkpoint", "lora")}
    return dict(raw=c, **typed)


def from_launch_script(args, ap) -> tuple[argparse.Namespace, dict]:
    options, overrides, flags = record_launch_script(args.from_launch_script, args.overrides)
    args = ap.parse_args(flags + sys.argv[1:])  # flags given here win over the script's `# plan:` line
    nodes = int(sbatch_option(options, "--nodes", "-N") or 1)
    # dedicated rollout servers (slurm/train.sbatch): the allocation's last K nodes hold no trainer rank
    exported = dict(kv.split("=", 1) for kv in (sbatch_option(options, "--export") or "").split(",") if "=" in kv)
    rollout_nodes = int(exported.get("GRPO_MEGA_ROLLOUT_NODES", 0))
    nodes -= rollout_nodes
    gpn = sbatch_option(options, "--gpus-per-node")
    if gpn is None:
        raise ValueError(f"{args.from_launch_script}: sbatch has no --gpus-per-node (got {options})")
    c = compose(sbatch_defaults(options) + overrides)
    par, batch, prec = c["parallel"], c["batch"], c["precision"]
    args.model, args.nodes, args.gpus_per_node = c["raw"]["model"], nodes, int(gpn.split(":")[-1])
    args.tp, args.pp, args.sp, args.recompute = par.tp, par.pp, par.sequence_parallel, par.recompute
    args.ep = par.ep
    args.first_stage_layers = par.num_layers_in_first_pipeline_stage
    args.last_stage_layers = par.num_layers_in_last_pipeline_stage
    args.micro_batch, args.seq_len = batch.micro_batch_size, batch.max_prompt_length + batch.max_response_length
    args.logprob_chunk = batch.logprob_chunk_size
    args.unfused_output = args.unfused_output or not batch.fused_output
    args.full_kl = args.full_kl or (c["algo"].kl_estimator == "full" and c["algo"].kl_coef != 0)
    args.precision = "fp8" if prec.fp8 else prec.params_dtype
    args.distributed_optimizer = c["optim"].use_distributed_optimizer
    if c["algo"].kl_coef == 0 and not c["algo"].kl_in_reward:
        args.ref = "none"
    elif c["algo"].ref_offload and "--ref" not in sys.argv:
        args.ref = "offload"
    lora = c["lora"]
    if lora.enabled and "--lora-rank" not in sys.argv:
        args.lora_rank, args.lora_targets = lora.rank, ",".join(lora.target_modules)
    fraction = c["rollout"].gpu_memory_fraction
    if rollout_nodes and "--engine-mem" not in sys.argv:
        args.engine_mem = "0"  # the engines are the servers on their own nodes
    elif fraction is not None and c["rollout"].engine == "sglang" and "--engine-mem" not in sys.argv:
        args.engine_mem = str(fraction)  # the engine's share as the run will ask SGLang for it
    info = dict(script=args.from_launch_script, sbatch=options, overrides=overrides, plan_flags=flags, batch=batch,
                n=c["rollout"].n, rollout_nodes=rollout_nodes)
    return args, info


# ---- output -------------------------------------------------------------------------------------------


def _columns(p: planning.Plan) -> list[int]:
    pp = len(p.stages)
    cols = list(range(pp)) if pp <= 4 else sorted({0, 1, pp - 2, pp - 1, p.worst})
    return cols


def table(p: planning.Plan) -> str:
    inp = p.input
    cols = _columns(p)
    ref = {"gpu": "reference on GPU", "offload": "reference offloaded", "none": "no reference"}[inp.reference]
    if inp.lora_rank is not None:
        ref = "no reference (the actor with adapters off)"
    prec = "fp8 (bf16 weights)" if inp.fp8 else inp.params_dtype
    opt = "distributed optimizer" if inp.distributed_optimizer else "optimizer state replicated over DP"
    lines = [
        f"{inp.model.name} on {inp.world_size} GPUs ({inp.gpus_per_node} per node): {inp.describe()}",
        f"  sequences of {inp.seq_length} tokens (prompt + response), {prec}, {opt}, {ref},",
        f"  rollout engine {inp.engine_gib:.1f} GiB per GPU, {'flash' if inp.flash_attention else 'unfused'} attention"
        f"{', local layer spec' if inp.layer_spec == 'local' else ''}",
    ]
    if inp.lora_rank is not None:
        lines.append(f"  LoRA rank {inp.lora_rank} on {','.join(inp.lora_targets)}: the base frozen "
                     f"(its weights only), gradients and optimizer state for the adapters alone")
    lines += [
        "",
        f"  {'GiB per GPU':<22}" + "".join(f"{'stage ' + str(s):>10}" for s in cols),
        f"  {'layers':<22}" + "".join(f"{p.stages[s].layers:>10}" for s in cols),
        f"  {'params (millions)':<22}" + "".join(f"{p.stages[s].param_numel / 1e6:>10.1f}" for s in cols),
    ]
    if inp.lora_rank is not None:
        lines += [
            f"  {'frozen base (GiB)':<22}" + "".join(f"{p.stages[s].frozen_bytes / planning.GIB:>10.2f}" for s in cols),
            f"  {'adapters (millions)':<22}" + "".join(f"{p.stages[s].adapter_numel / 1e6:>10.2f}" for s in cols),
        ]
    lines += [
        f"  {'micro-batches held':<22}" + "".join(f"{p.stages[s].in_flight:>10}" for s in cols),
    ]
    for name in planning.COMPONENTS:
        lines.append(f"  {name:<22}" + "".join(f"{p.stages[s].gib[name]:>10.2f}" for s in cols))
    if inp.reference == "offload":
        lines.append(f"  {'(reference forward)':<22}" + "".join(f"{p.stages[s].ref_forward_gib:>10.2f}" for s in cols))
    lines.append(f"  {'total':<22}" + "".join(f"{p.stages[s].total_gib:>10.2f}" for s in cols))
    if len(cols) < len(p.stages):
        lines.append(f"  (stages {', '.join(str(s) for s in range(len(p.stages)) if s not in cols)} not shown)")
    verdict = "fits" if p.fits else "DOES NOT FIT"
    headroom = inp.usable_gib - p.total_gib
    lines += ["", f"  worst: stage {p.worst}, {p.total_gib:.1f} GiB of {inp.usable_gib:.1f} GiB usable "
                  f"({inp.gpu_gib:.1f} GiB less {inp.margin:.0%}): {headroom:+.1f} GiB headroom -> {verdict}"]
    return "\n".join(lines)


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    info = None
    try:
        if args.from_launch_script:
            args, info = from_launch_script(args, ap)
        elif args.overrides:
            raise ValueError(f"positional overrides {args.overrides} need --from-launch-script")
        if not args.model:
            raise ValueError("--model (or --from-launch-script) is required")
        lora_targets = tuple(t for t in args.lora_targets.split(",") if t)
        if args.lora_rank is not None:
            if args.precision == "fp8":
                raise ValueError("--lora-rank with --precision fp8: LoRA runs on megatron-core's local layers, FP8 "
                                 "only through Transformer Engine; use --precision bf16")
            args.ref, args.local_spec = "none", True  # the reference is the actor with its adapters off
        model = resolve_model(args.model)
        sp = args.tp > 1 if args.sp is None else args.sp
        par = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, sequence_parallel=sp, recompute=args.recompute,
                             num_layers_in_first_pipeline_stage=args.first_stage_layers,
                             num_layers_in_last_pipeline_stage=args.last_stage_layers)
        if args.gpus:
            world = args.gpus
        elif args.nodes:
            world = args.nodes * args.gpus_per_node
        elif args.dp:
            world = args.dp * args.tp * args.pp
        else:
            raise ValueError("give --gpus, --nodes (x --gpus-per-node) or --dp")
        num_mb = args.num_microbatches
        batch = info["batch"] if info else None
        if batch is not None:
            dp = par.check(model, world)
            n = info["n"]
            batch.check_dp(dp, n)
            num_mb = batch.ppo_mini_batch_size * n // (dp * batch.micro_batch_size)
        inp = planning.PlanInput(
            model=model, parallel=par, world_size=world, gpus_per_node=args.gpus_per_node,
            micro_batch_size=args.micro_batch, seq_length=args.seq_len, num_microbatches=num_mb,
            params_dtype="fp32" if args.precision == "fp32" else "bf16", fp8=args.precision == "fp8",
            distributed_optimizer=args.distributed_optimizer, reference=args.ref,
            engine_gib=engine_gib(args.engine_mem, args.gpu_gib), gpu_gib=args.gpu_gib, margin=args.margin,
            flash_attention=not args.unfused_attention,
            layer_spec="local" if args.local_spec else "transformer_engine", logprob_chunk_size=args.logprob_chunk,
            fused_output=not args.unfused_output, full_kl=args.full_kl, lora_rank=args.lora_rank,
            lora_targets=lora_targets,
        )
        if args.dp and args.dp != inp.dp:
            raise ValueError(f"--dp={args.dp} but {world} GPUs at tp={args.tp} pp={args.pp} give dp={inp.dp}")
        result = planning.plan(inp)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    suggestions = [] if result.fits else planning.suggest(inp, batch, info["n"] if info else 0, limit=args.suggest)
    verify = None
    if args.verify:
        warnings.simplefilter("ignore")  # megatron's "Transformer Engine and Apex are not installed" on CPU
        lora = None
        if args.lora_rank is not None:
            from grpo_mega.conf.lora import LoraConfig

            lora = LoraConfig(rank=args.lora_rank, target_modules=list(lora_targets))
        verify = planning.compare_with_meta(model, par, world, lora)
    out = result.to_dict()
    out["suggestions"] = [s.to_dict() for s in suggestions]
    if info:
        out["launch_script"] = {k: v for k, v in info.items() if k not in ("batch", "n")}
    if verify is not None:
        out["verify"] = verify
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        if info:
            print(f"{info['script']}: sbatch {' '.join(info['sbatch'])} slurm/train.sbatch "
                  f"({len(info['overrides'])} overrides; plan flags: {' '.join(info['plan_flags']) or 'none'})")
        print(table(result))
        if not result.fits:
            print(f"\nrefused: {result.reason}")
            if suggestions:
                print("layouts of the same GPUs that fit:")
                for s in suggestions:
                    headroom = s.input.usable_gib - s.total_gib
                    print(f"  {s.input.describe():<58} {s.total_gib:6.1f} GiB ({headroom:+.1f})")
            else:
                print("no layout of these GPUs fits; use more GPUs, a shorter sequence or a smaller engine share")
        if verify is not None:
            print("\nparameters per rank, planner vs megatron on the meta device (fake process group):")
            for r in verify:
                adapters = (f"; adapters planner {r['planner_adapter_numel']:,}, meta {r['meta_adapter_numel']:,}"
                            if "meta_adapter_numel" in r else "")
                print(f"  stage {r['stage']} (rank {r['rank']}): planner {r['planner_bytes']:,} B, "
                      f"meta {r['meta_bytes']:,} B{adapters}, difference {r['rel_diff']:.3%}")
    if not result.fits:
        if args.json:
            print(f"refused: {result.reason}", file=sys.stderr)
        return 1
    if verify is not None and any(r["rel_diff"] > 0.02 for r in verify):
        print("error: planner and meta-device parameter bytes differ by more than 2%", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
