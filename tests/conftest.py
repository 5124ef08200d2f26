"""Shared test setup: import torch and megatron-core once in the pytest process, so that the multi-rank
tests fork warm ranks (grpo_mega.parallel.forked) instead of paying megatron's 5-6 s import per rank."""

import os
import warnings

# wandb is installed in the test tier: no test logs anywhere unless it asks for WANDB_MODE=offline itself.
os.environ["WANDB_MODE"] = "disabled"

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")

# Under pytest-xdist the workers share the cores: each worker's processes get cores // workers torch threads
# (OMP_NUM_THREADS, which grpo_mega.trainer.setup.threads_per_rank honours), so that two workers' OpenMP teams do
# not oversubscribe the cores and spin at each other's barriers. Set before torch loads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

from grpo_mega.parallel import cpu_compat  # noqa: E402

cpu_compat.apply()
import megatron.core  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401


# The quick tier (`make test-quick`, `pytest -m quick`): pure math, configs and plans, single-process checks,
# the forked-rank harness and small multi-rank parity checks, the configurations refused before training, and one
# 2-rank layout of the GRPO update against the single-process run. Node-id prefixes; each test under one of
# them is marked `quick`.
QUICK = [
    "tests/algo/",
    "tests/conf/",
    "tests/data/",
    "tests/models/test_builder.py",
    "tests/models/test_bridge_qwen3.py",
    "tests/parallel/",
    "tests/rewards/test_rewards.py",
    "tests/rewards/test_reward_model.py",
    "tests/rollout/test_scheduler.py",
    "tests/engines/test_http_conn.py",
    "tests/engines/test_continuous.py",  # the stand-in's decode loop against the embedded engine alone
    "tests/cli/",  # the plans and the commands' --help
    "tests/bench/test_table.py",
    "tests/test_design.py",
    "tests/test_bad_inputs.py::test_bad_configuration",  # refused before training (forked: ~1 s each)
    "tests/test_bad_inputs.py::test_hf_model_with_pickle",
    "tests/test_bad_inputs.py::test_the_corpus",
    "tests/trainer/test_actor.py",
    "tests/trainer/test_checkpoint_store.py",
    "tests/trainer/test_watchdog.py",
    "tests/trainer/test_memory.py",
    "tests/trainer/test_offpolicy_world.py",  # world_offpolicy on 2 forked ranks vs one process (~2 s)
    "tests/toolcalls/test_toolcalls.py",
    "tests/trainer/test_packing.py::test_first_fit",
    "tests/trainer/test_packing.py::test_plan",
    "tests/trainer/test_packing.py::test_block_causal",
    "tests/trainer/test_packing.py::test_packed_row",
    "tests/trainer/test_packing.py::test_a_sequence",
    "tests/trainer/test_packing.py::test_the_fused",
    "tests/trainer/test_layout_invariance.py::test_reference_is_nontrivial",
    "tests/trainer/test_layout_invariance.py::test_layout_matches_single_process[DP2]",
    "tests/test_train.py::test_golden_curve_first_10_steps",  # the numbers most sensitive to the CPU's kernels
]
# Under a QUICK prefix but whole training runs (tens of seconds each): the main tier's.
NOT_QUICK = [
    "tests/algo/test_losses_learn.py",  # 80 demo steps per loss
    "tests/algo/test_new_losses_run.py",  # the demo once per new loss
]


def pytest_collection_modifyitems(config, items):
    """Tests under QUICK are marked `quick`. Tests marked `gpu` need CUDA: `make test` deselects them where
    there is none (so CI skips nothing); a direct pytest run that selects them there skips them ("no CUDA")."""
    import pytest
    import torch

    for item in items:
        if item.nodeid.startswith(tuple(QUICK)) and not item.nodeid.startswith(tuple(NOT_QUICK)):
            item.add_marker(pytest.mark.quick)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# Per-test CPU time (GRPO_MEGA_TEST_TIMES=FILE): user + system seconds of the pytest process and of every child
# it waited for (forked ranks, subprocesses), beside the wall time, one JSON line per test phase. CPU seconds
# hold on a loaded machine where wall times do not; they say where the suite's time goes.
_TIMES = os.environ.get("GRPO_MEGA_TEST_TIMES")
if _TIMES:
    import json
    import resource
    import time

    import pytest

    def _cpu() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall = _cpu(), time.monotonic()
        yield
        with open(_TIMES, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu() - cpu, 2),
                                "wall_s": round(time.monotonic() - wall, 2)}) + "\n")
