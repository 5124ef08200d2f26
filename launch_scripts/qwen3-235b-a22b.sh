#!/usr/bin/env bash
# GRPO on Qwen3-235B-A22B (128 experts, top-8, 94 layers), 16 training nodes x 8 H100 80GB: TP4 x PP2 x EP16 x DP16,
# full recompute, sequence parallel, bf16 with fp32 main weights, distributed optimizer, reference resident; plus
# ROLLOUT_NODES nodes of dedicated SGLang servers (one per node at tp 8: the 470 GB of bf16 weights do not fit
# a colocated engine's share next to the trainer). No MoE run on a GPU yet.
#   MODEL=/ckpts/Qwen3-235B-A22B DATA=~/data/gsm8k/train.parquet launch_scripts/qwen3-235b-a22b.sh [OVERRIDE ...]
# MODEL must be an HF directory here (the servers load it). Per-GPU memory of the trainer:
#   grpo-mega-plan --from-launch-script launch_scripts/qwen3-235b-a22b.sh
# Slurm partition/account/time: sbatch's own SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

NODES=${NODES:-16}                          # training nodes
ROLLOUT_NODES=${ROLLOUT_NODES:-4}           # SGLang server nodes (slurm/train.sbatch: GRPO_MEGA_ROLLOUT_NODES)
MODEL=${MODEL:-qwen3-235b-a22b}
TP=${TP:-4} PP=${PP:-2} EP=${EP:-16} MICRO_BATCH=${MICRO_BATCH:-1} RECOMPUTE=${RECOMPUTE:-full}
ENGINE_TP=${ENGINE_TP:-8} ENGINES=1         # dedicated servers: one client on rank 0
source "$REPO/launch_scripts/_common.sh"  # the shared defaults (DATA, STEPS, PROMPTS, LR, ...) and `overrides`

exec sbatch --nodes="$((NODES + ROLLOUT_NODES))" --gpus-per-node=8 --job-name="${JOB_NAME:-grpo-qwen3-235b-a22b}" \
  --export="ALL,GRPO_MEGA_ROLLOUT_NODES=$ROLLOUT_NODES,GRPO_MEGA_SERVER_MODEL=$MODEL" \
  "$REPO/slurm/train.sbatch" "${overrides[@]}" "$@"
