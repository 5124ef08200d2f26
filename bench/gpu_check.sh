#!/usr/bin/env bash
# The GPU path, proven on one CUDA machine in under 10 minutes: the tests marked gpu, the demo run on CUDA and
# python -m bench.step --gpu (the qwen2.5-0.5b shape, TP1, bf16, random weights).
#
#   bench/gpu_wheels.sh                 # here, where a registry is reachable: the wheels into .whl/
#   bench/gpu_check.sh [--dry-run]      # there: install .whl/ into $SITE, then the three steps
#
# Through the device tool: run `bench/gpu_check.sh` with carry [".whl"]; one log of every step and the benchmark
# JSONs are copied under $OUT (which comes back): gpu_check.log, demo_summary.json, demo_metrics.jsonl,
# bench_results/gpu_<device>.json and bench_results/decode_gpu_<device>.json. The machine has no `make` setup:
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

# The runs' own folders stay on that machine ($RUNS): a device call brings back at most 8 files, so every step's
# log goes into one file, $DEST/gpu_check.log.
RUNS=${RUNS:-/tmp/gpu_check_runs}
# name | time limit (s) | command. The limits add up to 540 s (one device call may run 600; the lent time is 15
# minutes in all, the machine's start included). bench.step: 0.5B, 1.5B (fits at 64 x 1024 with the fused output
# layer, grpo-mega-plan: 43 GiB) and the largest model the plan fits on this card, each beside the plain
# transformers step, with the allocation sites at the update's peak; bench.decode: the engine's compiled and static
# decode beside generate's static cache, 0.5B, 64 x 512 new tokens; the demo: full GRPO steps on CUDA, each step's
# phase seconds in its metrics.jsonl.
STEPS=(
  "install wheels|25|if $PYTHON -m pip --version >/dev/null 2>&1; then $PYTHON -m pip install --quiet --no-index --no-deps --target $SITE .whl/*.whl; else for w in .whl/*.whl; do $PYTHON -m zipfile -e \$w $SITE; done; fi"
  "cuda|15|$PYTHON -c \"import torch, megatron.core, hydra, math_verify; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'megatron-core', megatron.core.__version__)\""
  "gpu tests|130|$PYTHON -m pytest -q -rs -p no:cacheprovider -m gpu tests"
  "bench.step --gpu|170|$PYTHON -m bench.step --gpu --models qwen2.5-0.5b,qwen2.5-1.5b,largest --steps 2 --warmup 1 --gen-tokens 32"
  "bench.decode --gpu|130|$PYTHON -m bench.decode --gpu --modes compiled,static --hf-caches static --rounds 1"
  "grpo steps on cuda|70|$PYTHON -m grpo_mega.train run.steps=$DEMO_STEPS eval.interval=10 hydra.run.dir=$RUNS/demo && cp $RUNS/demo/summary.json $DEST/demo_summary.json && cp $RUNS/demo/metrics.jsonl $DEST/demo_metrics.jsonl"
)

if (( DRY )); then
  echo "plan (PYTHONPATH=$PYTHONPATH; logs and results to $DEST):"
  i=0
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    i=$((i + 1))
    echo "  $i. $name (at most ${limit} s): $cmd"
  done
  echo "  then: copy bench_results/gpu_*.json and bench_results/decode_gpu_*.json to $DEST/bench_results"
  exit 0
fi

if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "error: no wheels in $ROOT/.whl: run bench/gpu_wheels.sh where a package registry is reachable, and carry .whl" >&2
  exit 2
fi
mkdir -p "$DEST" "$SITE" "$RUNS/logs"
: >"$DEST/gpu_check.log"
failed=0
summary=()
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  log="$RUNS/logs/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_').log"
  echo "== $name (at most ${limit} s): $cmd"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$cmd" >"$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  { echo "== $name (at most ${limit} s, rc=$rc, $dt s): $cmd"; cat "$log"; } >>"$DEST/gpu_check.log"
  tail -n 15 "$log"
  (( rc == 124 || rc == 137 )) && echo "   timed out after ${limit} s"
  (( rc != 0 )) && failed=1
  summary+=("$(printf '%-20s rc=%-4s %4d s' "$name" "$rc" "$dt")")
done
mkdir -p "$DEST/bench_results"
cp bench_results/gpu_*.json bench_results/decode_gpu_*.json "$DEST/bench_results/" 2>/dev/null
echo "== summary"
printf '  %s\n' "${summary[@]}" | tee -a "$DEST/gpu_check.log"
exit $failed
