#!/usr/bin/env bash
# The wheels a lent GPU machine needs to run grpo-mega, fetched here (where a package registry is reachable)
# into .whl/, for bench/gpu_check.sh to install there with `pip install --no-index --no-deps --target`.
#
#   bench/gpu_wheels.sh [DIR]          (default DIR: <repo>/.whl, ignored by git)
#
# That machine has Python 3.12, torch 2.11.0+cu130, transformers (and so tqdm, pyyaml, huggingface_hub,
# tokenizers), safetensors, numpy, pyarrow, matplotlib, tensorboard, psutil and pytest, and no registry. What
# importing grpo_mega.train, the rewards and the tests pulls in beyond that (measured: the import closure's
# distributions, less that machine's packages and their dependencies) is the list below. tqdm and pyyaml are
# already there through transformers; they are brought anyway (tiny, pure) so a different image still imports.
# Files reach that machine 64 MiB per call: the set must stay under 60 MiB, or this script fails.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-$ROOT/.whl}
PYTHON=${PYTHON:-python3}
LIMIT_MIB=60

# Pinned to what the CPU environment (.venv) runs and tests.
BINARY=(
  megatron-core==0.16.1        # cp312 manylinux_2_28 wheel (a small C helper for megatron's datasets)
  hydra-core==1.3.8
  omegaconf==2.3.1
  math-verify==0.9.0
  latex2sympy2-extended==1.11.0
  pytest-timeout==2.4.0        # pyproject's `timeout` and the tests' timeout markers
  tqdm==4.70.1
  PyYAML==6.0.4
)
# antlr4-python3-runtime 4.9.3 (the version hydra-core and math-verify's parser need) is published as an sdist
# only: it is pure Python, so a wheel built here installs anywhere.
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "${BINARY[@]}"
"$PYTHON" -m pip wheel --quiet --no-deps --no-binary=:all: -w "$DIR" "${SDIST_ONLY[@]}"

want=$(( ${#BINARY[@]} + ${#SDIST_ONLY[@]} ))
got=$(find "$DIR" -maxdepth 1 -type f -name '*.whl' | wc -l)
if (( got != want )); then
  echo "error: expected $want wheels in $DIR, found $got:" >&2
  ls "$DIR" >&2
  exit 1
fi
for w in "$DIR"/*.whl; do
  case $(basename "$w") in
    *-py3-none-any.whl|*-py2.py3-none-any.whl|*-cp312-*manylinux*x86_64*.whl) ;;
    *) echo "error: $(basename "$w") is not a Python 3.12 manylinux x86_64 (or pure) wheel" >&2; exit 1 ;;
  esac
done
bytes=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
ls -l "$DIR"/*.whl | awk '{ printf "  %8.1f KiB  %s\n", $5 / 1024, $NF }'
echo "$got wheels, $mib MiB in $DIR (limit $LIMIT_MIB MiB)"
if (( bytes > LIMIT_MIB * 1048576 )); then
  echo "error: the wheel set is $mib MiB, over the $LIMIT_MIB MiB that one device call can carry" >&2
  exit 1
fi
