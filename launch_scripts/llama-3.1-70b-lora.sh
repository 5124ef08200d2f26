#!/usr/bin/env bash
# GRPO with LoRA on Llama-3.1-70B(-Instruct), 1 node x 8 H100 80GB: TP8 x DP1, sequence parallel, the bf16 base
# frozen, rank-16 adapters (alpha 32) on qkv, proj, fc1 and fc2 with fp32 main weights and Adam state (distributed
# optimizer), no reference model (the actor with its adapters off), SGLang colocated (merged weights synced).
# The fewest nodes grpo-mega-plan allows: the full-parameter launch_scripts/llama-3.1-70b.sh needs 8.
#   MODEL=/ckpts/Llama-3.1-70B-Instruct DATA=~/data/gsm8k/train.parquet launch_scripts/llama-3.1-70b-lora.sh [OVERRIDE ...]
# Per-GPU memory of exactly what this submits: grpo-mega-plan --from-launch-script launch_scripts/llama-3.1-70b-lora.sh
# LoRA runs on megatron-core's local layers, which the trainer picks under lora.rank even where Transformer Engine is
# installed (no FP8). Slurm partition/account/time: SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

NODES=${NODES:-1}
MODEL=${MODEL:-llama-3.1-70b}                 # HF directory with the weights, or a model_configs name (random init)
TP=${TP:-8} PP=${PP:-1} MICRO_BATCH=${MICRO_BATCH:-1}
ENGINE_TP=${ENGINE_TP:-8} ENGINES=${ENGINES:-$NODES}
LR=${LR:-1e-5}                                # adapters take a larger step than the full model's 1e-6
LORA_RANK=${LORA_RANK:-16} LORA_ALPHA=${LORA_ALPHA:-32}
source "$REPO/launch_scripts/_common.sh"  # the shared defaults (DATA, STEPS, PROMPTS, ...) and `overrides`
overrides+=(lora.rank="$LORA_RANK" lora.alpha="$LORA_ALPHA" "lora.target_modules=[qkv,proj,fc1,fc2]")

exec sbatch --nodes="$NODES" --gpus-per-node=8 --job-name="${JOB_NAME:-grpo-llama-3.1-70b-lora}" \
  "$REPO/slurm/train.sbatch" "${overrides[@]}" "$@"
