#!/usr/bin/env bash
# GRPO on Qwen2.5-72B(-Instruct), 8 nodes x 8 H100 80GB: TP8 x PP4 x DP2, sequence parallel, bf16 with fp32
# main weights, distributed optimizer, reference resident, SGLang colocated on the same GPUs.
#   MODEL=/ckpts/Qwen2.5-72B-Instruct DATA=~/data/gsm8k/train.parquet launch_scripts/qwen2.5-72b.sh [OVERRIDE ...]
# Per-GPU memory of exactly what this submits: grpo-mega-plan --from-launch-script launch_scripts/qwen2.5-72b.sh
# Slurm partition/account/time: sbatch's own SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT.
# SGLang: ENGINES engines (default one per node, engine tp=ENGINE_TP over its 8 GPUs) each keep ENGINE_MEM of every GPU (weights 16.9 GiB + KV cache per GPU at engine tp=8).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

NODES=${NODES:-8}
MODEL=${MODEL:-qwen2.5-72b}                   # HF directory with the weights, or a model_configs name (random init)
TP=${TP:-8} PP=${PP:-4} MICRO_BATCH=${MICRO_BATCH:-1}
ENGINE_TP=${ENGINE_TP:-8} ENGINES=${ENGINES:-$NODES}
source "$REPO/launch_scripts/_common.sh"  # the shared defaults (DATA, STEPS, PROMPTS, LR, ...) and `overrides`

exec sbatch --nodes="$NODES" --gpus-per-node=8 --job-name="${JOB_NAME:-grpo-qwen2.5-72b}" \
  "$REPO/slurm/train.sbatch" "${overrides[@]}" "$@"
