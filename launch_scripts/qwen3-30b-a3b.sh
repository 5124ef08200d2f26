#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (128 experts, top-8), 4 nodes x 8 H100 80GB: TP4 x EP8 x DP8 (4 KV groups: tp <= 4;
# each expert split over the TP pair, 16 experts per EP rank), sequence parallel, bf16 with fp32 main weights,
# distributed optimizer, reference resident, SGLang colocated on the same GPUs. No MoE run on a GPU yet.
#   MODEL=/ckpts/Qwen3-30B-A3B DATA=~/data/gsm8k/train.parquet launch_scripts/qwen3-30b-a3b.sh [OVERRIDE ...]
# Per-GPU memory of exactly what this submits: grpo-mega-plan --from-launch-script launch_scripts/qwen3-30b-a3b.sh
# Slurm partition/account/time: sbatch's own SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT.
# SGLang: ENGINES engines (default one per node, engine tp=ENGINE_TP over its 8 GPUs) each keep ENGINE_MEM of every GPU (weights 7.1 GiB + KV cache per GPU at engine tp=8).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

NODES=${NODES:-4}
MODEL=${MODEL:-qwen3-30b-a3b}             # HF directory with the weights, or a model_configs name (random init)
TP=${TP:-4} PP=${PP:-1} EP=${EP:-8} MICRO_BATCH=${MICRO_BATCH:-1}
ENGINE_TP=${ENGINE_TP:-8} ENGINES=${ENGINES:-$NODES}
source "$REPO/launch_scripts/_common.sh"  # the shared defaults (DATA, STEPS, PROMPTS, LR, ...) and `overrides`

exec sbatch --nodes="$NODES" --gpus-per-node=8 --job-name="${JOB_NAME:-grpo-qwen3-30b-a3b}" \
  "$REPO/slurm/train.sbatch" "${overrides[@]}" "$@"
