#!/usr/bin/env bash
# GRPO on Qwen2.5-72B(-Instruct), 8 nodes x 8 H100 80GB: TP8 x PP4 x DP2, sequence parallel, bf16 with fp32
# main weights, distributed optimizer, reference resident, SGLang colocated on the same GPUs.
#   MODEL=/ckpts/Qwen2.5-72B-Instruct DATA=~/data/gsm8k/train.parquet launch_scripts/qwen2.5-72b.sh [OVERRIDE ...]
# Per-GPU memory of exactly what this submits: python tools/plan.py --from-launch-script launch_scripts/qwen2.5-72b.sh
# Slurm partition/account/time: sbatch's own SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT.
# SGLang: ENGINES engines (default one per node, engine tp=ENGINE_TP over its 8 GPUs) each keep ENGINE_MEM of every GPU (weights 16.9 GiB + KV cache per GPU at engine tp=8).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

NODES=${NODES:-8}
MODEL=${MODEL:-qwen2.5-72b}                   # HF directory with the weights, or a model_configs name (random init)
DATA=${DATA:-$HOME/data/gsm8k/train.parquet}  # prompts in verl's schema, .parquet or .jsonl
VAL_DATA=${VAL_DATA:-}                        # default: the training file
STEPS=${STEPS:-200}
TP=${TP:-8} PP=${PP:-4} RECOMPUTE=${RECOMPUTE:-none}
PROMPTS=${PROMPTS:-64} N=${N:-8} MINI_BATCH=${MINI_BATCH:-16} MICRO_BATCH=${MICRO_BATCH:-1}
PROMPT_LEN=${PROMPT_LEN:-1024} RESPONSE_LEN=${RESPONSE_LEN:-3072}
LR=${LR:-1e-6} KL_COEF=${KL_COEF:-0.001}
CKPT_INTERVAL=${CKPT_INTERVAL:-20}            # checkpoints: slurm/train.sbatch keeps them per job name

overrides=(
  task=prompts "model=$MODEL" "data.train_files=$DATA" reward.name=math
  parallel.tp="$TP" parallel.pp="$PP" parallel.sequence_parallel=true parallel.recompute="$RECOMPUTE"
  precision.params_dtype=bf16 optim.use_distributed_optimizer=true
  optim.lr="$LR" optim.weight_decay=0.01 optim.clip_grad=1.0 optim.lr_warmup_steps=10
  algo.kl_coef="$KL_COEF" algo.kl_estimator=k3 algo.loss_agg_mode=token-mean
  batch.train_batch_size="$PROMPTS" rollout.n="$N" batch.ppo_mini_batch_size="$MINI_BATCH"
  batch.micro_batch_size="$MICRO_BATCH" batch.max_prompt_length="$PROMPT_LEN" batch.max_response_length="$RESPONSE_LEN"
  rollout.engine=sglang rollout.engine_tp="${ENGINE_TP:-8}" rollout.gpu_memory_fraction="${ENGINE_MEM:-0.3}"
  rollout.num_engines="${ENGINES:-$NODES}"
  rollout.temperature=1.0 run.steps="$STEPS" eval.interval=10
  checkpoint.interval="$CKPT_INTERVAL"
)
[[ -n "$VAL_DATA" ]] && overrides+=("data.val_files=$VAL_DATA")

exec sbatch --nodes="$NODES" --gpus-per-node=8 --job-name="${JOB_NAME:-grpo-qwen2.5-72b}" \
  "$REPO/slurm/train.sbatch" "${overrides[@]}" "$@"
