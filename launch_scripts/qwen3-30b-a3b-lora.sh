#!/usr/bin/env bash
# GRPO with LoRA on Qwen3-30B-A3B (128 experts, top-8), 1 node x 8 H100 80GB: TP2 x EP4 x DP4 (32 experts per EP
# rank, each expert and its adapters split over the TP pair), sequence parallel, the bf16 base frozen, rank-16
# adapters (alpha 32) on attention qkv and proj, every expert's fc1 and fc2 and each router, fp32 main weights and
# Adam state (distributed optimizer; the expert adapters over expert DP), no reference model (the actor with its
# adapters off), SGLang colocated (merged weights synced). The fewest nodes grpo-mega-plan allows: the
# full-parameter launch_scripts/qwen3-30b-a3b.sh needs 4 (TP1 x EP8 here leaves no room for the activations).
#   MODEL=/ckpts/Qwen3-30B-A3B DATA=~/data/gsm8k/train.parquet launch_scripts/qwen3-30b-a3b-lora.sh [OVERRIDE ...]
# Per-GPU memory of exactly what this submits: grpo-mega-plan --from-launch-script launch_scripts/qwen3-30b-a3b-lora.sh
# LoRA runs on megatron-core's local layers, which the trainer picks under lora.rank even where Transformer Engine is
# installed (no FP8). Slurm partition/account/time: SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

NODES=${NODES:-1}
MODEL=${MODEL:-qwen3-30b-a3b}             # HF directory with the weights, or a model_configs name (random init)
TP=${TP:-2} PP=${PP:-1} EP=${EP:-4} MICRO_BATCH=${MICRO_BATCH:-1}
ENGINE_TP=${ENGINE_TP:-8} ENGINES=${ENGINES:-$NODES}
LR=${LR:-1e-5}                            # adapters take a larger step than the full model's 1e-6
LORA_RANK=${LORA_RANK:-16} LORA_ALPHA=${LORA_ALPHA:-32}
source "$REPO/launch_scripts/_common.sh"  # the shared defaults (DATA, STEPS, PROMPTS, ...) and `overrides`
overrides+=(lora.rank="$LORA_RANK" lora.alpha="$LORA_ALPHA"
            "lora.target_modules=[qkv,proj,expert_fc1,expert_fc2,router]")

exec sbatch --nodes="$NODES" --gpus-per-node=8 --job-name="${JOB_NAME:-grpo-qwen3-30b-a3b-lora}" \
  "$REPO/slurm/train.sbatch" "${overrides[@]}" "$@"
