"""Shared test setup: import torch and megatron-core once in the pytest process, so that the multi-rank
tests fork warm ranks (grpo_mega.parallel.forked) instead of paying megatron's 5-6 s import per rank."""

import os
import warnings

# wandb is installed in the test tier: no test logs anywhere unless it asks for WANDB_MODE=offline itself.
os.environ["WANDB_MODE"] = "disabled"

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")

from grpo_mega.parallel import cpu_compat  # noqa: E402

cpu_compat.apply()
import megatron.core  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are collected everywhere and skipped, with the reason "no CUDA", only where torch
    sees no GPU."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
