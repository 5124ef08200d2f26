#!/usr/bin/env bash
# SmolLM2-135M-Instruct on a small arithmetic set (verl's schema, math-verify reward), from its HF directory.
# A few steps on a CPU; the same command on a GPU machine. Checkpoints carry an HF export (hf/).
#
#   launch_scripts/smollm2_arithmetic.sh [hydra overrides...]      e.g. run.steps=50 optim.lr=5e-6
#
# Environment: MODEL (HF dir; default: make smollm2's), OUT (run, data and checkpoints), STEPS, NPROC (ranks on
# this machine; >1 runs torchrun), TP, PYTHON.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
MODEL=${MODEL:-${GRPO_MEGA_CACHE:-$HOME/.cache/grpo_mega}/SmolLM2-135M-Instruct}
OUT=${OUT:-$ROOT/outputs/smollm2_arithmetic}
STEPS=${STEPS:-4}
NPROC=${NPROC:-1}
TP=${TP:-1}

if [[ ! -f $MODEL/config.json ]]; then
  echo "error: no HF model at MODEL=$MODEL (run 'make smollm2', or point MODEL at an HF directory)" >&2
  exit 2
fi
[[ -f $OUT/data/train.parquet ]] || "$PYTHON" -m grpo_mega.data.arithmetic --out "$OUT/data/train.parquet" --n 256 --seed 0
[[ -f $OUT/data/val.parquet ]] || "$PYTHON" -m grpo_mega.data.arithmetic --out "$OUT/data/val.parquet" --n 16 --seed 1 --split val

launcher=("$PYTHON")
if (( NPROC > 1 )); then
  port=$("$PYTHON" -c 'from grpo_mega.processes import free_port; print(free_port())')
  launcher+=(-m grpo_mega.cli.torchrun --nproc-per-node "$NPROC" --master-port "$port")
fi
exec "${launcher[@]}" -m grpo_mega.train \
  task=prompts model="$MODEL" reward.name=math \
  data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet" \
  parallel.tp="$TP" precision.params_dtype=fp32 \
  batch.train_batch_size=4 rollout.n=4 batch.ppo_mini_batch_size=4 batch.micro_batch_size=8 \
  batch.max_prompt_length=128 batch.max_response_length=32 \
  optim.lr=2e-6 optim.weight_decay=0.0 algo.kl_coef=0.001 algo.clip_ratio_high=0.28 rollout.temperature=1.0 \
  run.steps="$STEPS" eval.interval="$STEPS" eval.pass_k=2 \
  checkpoint.dir="$OUT/checkpoints" checkpoint.interval=0 checkpoint.export_hf=true \
  hydra.run.dir="$OUT/run" "$@"
