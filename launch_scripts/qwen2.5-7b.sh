#!/usr/bin/env bash
# GRPO on Qwen2.5-7B(-Instruct), one node of 8 H100 80GB: TP4 x DP2 (4 KV groups: tp <= 4), sequence parallel,
# bf16 with fp32 main weights, distributed optimizer, reference resident, SGLang colocated on the same GPUs.
#   MODEL=/ckpts/Qwen2.5-7B-Instruct DATA=~/data/gsm8k/train.parquet launch_scripts/qwen2.5-7b.sh [OVERRIDE ...]
# Per-GPU memory of exactly what this submits: grpo-mega-plan --from-launch-script launch_scripts/qwen2.5-7b.sh
# Slurm partition/account/time: sbatch's own SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT.
# SGLang: ENGINES engines (default one per GPU, engine tp=ENGINE_TP) each keep ENGINE_MEM of their GPU (weights 14.2 GiB + KV cache per GPU at engine tp=1).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

NODES=${NODES:-1}
MODEL=${MODEL:-qwen2.5-7b}                    # HF directory with the weights, or a model_configs name (random init)
TP=${TP:-4} PP=${PP:-1} MICRO_BATCH=${MICRO_BATCH:-2}
ENGINE_TP=${ENGINE_TP:-1} ENGINES=${ENGINES:-8}
source "$REPO/launch_scripts/_common.sh"  # the shared defaults (DATA, STEPS, PROMPTS, LR, ...) and `overrides`

exec sbatch --nodes="$NODES" --gpus-per-node=8 --job-name="${JOB_NAME:-grpo-qwen2.5-7b}" \
  "$REPO/slurm/train.sbatch" "${overrides[@]}" "$@"
