#!/usr/bin/env bash
# The GPU path, proven on one CUDA machine in under 10 minutes: the tests marked gpu, the demo run on CUDA and
# python -m bench.step --gpu (the qwen2.5-0.5b shape, TP1, bf16, random weights).
#
#   bench/gpu_wheels.sh                 # here, where a registry is reachable: the wheels into .whl/
#   bench/gpu_check.sh [--dry-run]      # there: install .whl/ into $SITE, then the three steps
#
# Through the device tool: run `bench/gpu_check.sh` with carry [".whl"]; logs and the benchmark JSON are copied
# under $OUT (which comes back), bench_results/gpu_<device>.json among them. The machine has no `make` setup:
# the wheels go to $SITE with pip's --no-index --no-deps --target (unzipped if pip is missing), and
# PYTHONPATH is the repository root, then $SITE. --dry-run prints each step's command and exits 0, CUDA or not.
# Every step runs (a failure does not hide the next ones' results); the exit status is 1 if any failed.
#
# Environment: PYTHON (python3), SITE (/tmp/site), OUT (where logs and results are copied; default
# outputs/gpu_check), DEMO_STEPS (20), WANDB_MODE (disabled).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY=0
case ${1:-} in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
DEST=${OUT:-$ROOT/outputs/gpu_check}
DEMO_STEPS=${DEMO_STEPS:-20}
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export WANDB_MODE=${WANDB_MODE:-disabled}  # the demo logs to wandb when it is importable; never prompt for a key
cd "$ROOT"

# The runs' own folders stay on that machine ($RUNS): a device call brings back at most 8 files.
RUNS=${RUNS:-/tmp/gpu_check_runs}
# name | time limit (s) | command. The limits add up to 600 s: a device call may run 600, and the lent
# time is 15 minutes in all. qwen2.5-1.5b is left out of the benchmark: at its shape (64 x 1024 tokens,
# micro-batch 4) it ran out of an H100's 80 GB without Transformer Engine (2026-11-26, bench_results/gpu_check_h100.json).
STEPS=(
  "install wheels|60|if $PYTHON -m pip --version >/dev/null 2>&1; then $PYTHON -m pip install --quiet --no-index --no-deps --target $SITE .whl/*.whl; else for w in .whl/*.whl; do $PYTHON -m zipfile -e \$w $SITE; done; fi"
  "cuda|30|$PYTHON -c \"import torch, megatron.core, hydra, math_verify; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'megatron-core', megatron.core.__version__)\""
  "gpu tests|200|$PYTHON -m pytest -q -rs -p no:cacheprovider -m gpu tests"
  "demo on cuda|90|$PYTHON -m grpo_mega.train run.steps=$DEMO_STEPS eval.interval=10 hydra.run.dir=$RUNS/demo && cp $RUNS/demo/summary.json $DEST/demo_summary.json"
  "qwen3 on cuda|60|$PYTHON -m grpo_mega.train model=tiny-qwen3 run.steps=5 hydra.run.dir=$RUNS/qwen3"
  "bench.step --gpu|150|$PYTHON -m bench.step --gpu --models qwen2.5-0.5b"
)

if (( DRY )); then
  echo "plan (PYTHONPATH=$PYTHONPATH; logs and results to $DEST):"
  i=0
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    i=$((i + 1))
    echo "  $i. $name (at most ${limit} s): $cmd"
  done
  echo "  then: copy bench_results/gpu_*.json to $DEST/bench_results"
  exit 0
fi

if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "error: no wheels in $ROOT/.whl: run bench/gpu_wheels.sh where a package registry is reachable, and carry .whl" >&2
  exit 2
fi
mkdir -p "$DEST" "$SITE"
failed=0
summary=()
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  log="$DEST/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_').log"
  echo "== $name (at most ${limit} s): $cmd"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$cmd" >"$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  tail -n 15 "$log"
  (( rc == 124 || rc == 137 )) && echo "   timed out after ${limit} s"
  (( rc != 0 )) && failed=1
  summary+=("$(printf '%-18s rc=%-4s %4d s' "$name" "$rc" "$dt")")
done
mkdir -p "$DEST/bench_results"
cp bench_results/gpu_*.json "$DEST/bench_results/" 2>/dev/null
echo "== summary"
printf '  %s\n' "${summary[@]}"
exit $failed
