#!/usr/bin/env bash
# The tiny model learning the toy task (answer the successor of a digit) with GRPO on this machine's CPUs:
# the quick run, one process or several (gloo). The same overrides work under slurm/train.sbatch.
#
#   launch_scripts/tiny_cpu.sh [hydra overrides...]          e.g. NPROC=4 TP=2 STEPS=50 launch_scripts/tiny_cpu.sh
#
# Environment: NPROC (ranks on this machine; >1 runs torchrun on a free port), TP, PP, STEPS, OUT (run directory
# and checkpoints), CKPT_INTERVAL (save every N steps into $OUT/checkpoints and resume from there; default: no
# checkpoints), PYTHON.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
NPROC=${NPROC:-1}
TP=${TP:-1}
PP=${PP:-1}
STEPS=${STEPS:-200}
OUT=${OUT:-$ROOT/outputs/tiny_cpu}
CKPT_INTERVAL=${CKPT_INTERVAL:-}

launcher=("$PYTHON")
if (( NPROC > 1 )); then
  port=$("$PYTHON" -c 'from grpo_mega.processes import free_port; print(free_port())')
  launcher+=(-m grpo_mega.cli.torchrun --nproc-per-node "$NPROC" --master-port "$port")
fi
checkpoints=()
[[ -n $CKPT_INTERVAL ]] && checkpoints=(checkpoint.dir="$OUT/checkpoints" checkpoint.interval="$CKPT_INTERVAL")
cd "$ROOT"
exec "${launcher[@]}" -m grpo_mega.train \
  model=tiny task=successor parallel.tp="$TP" parallel.pp="$PP" run.steps="$STEPS" \
  hydra.run.dir="$OUT/run" "${checkpoints[@]}" "$@"
