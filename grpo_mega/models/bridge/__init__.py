"""HF <-> Megatron bridge, one module per model family; the shared tensor mapping is in common.py."""

from grpo_mega.models.bridge.common import (
    expert_of,
    expert_offset,
    from_hf,
    global_name,
    hf_names,
    layer_offset,
    merge_tp,
    shard_from_hf,
    spec_for,
    split_tp,
    to_hf,
)
from grpo_mega.models.bridge.llama import Llama
from grpo_mega.models.bridge.qwen2 import Qwen2
from grpo_mega.models.bridge.qwen3 import Qwen3
from grpo_mega.models.bridge.qwen3_moe import Qwen3Moe
from grpo_mega.registry import Registry

FAMILIES: Registry = Registry("model family")
FAMILIES.register("llama")(Llama())
FAMILIES.register("qwen2")(Qwen2())
FAMILIES.register("qwen3")(Qwen3())
FAMILIES.register("qwen3_moe")(Qwen3Moe())


def family_of_hf(hf_config: dict):
    """The family for an HF config.json, by model_type."""
    return FAMILIES.get(hf_config.get("model_type", ""))


__all__ = [
    "FAMILIES", "expert_of", "expert_offset", "family_of_hf", "from_hf", "global_name", "hf_names", "layer_offset", "merge_tp", "shard_from_hf",
    "spec_for", "split_tp", "to_hf",
]
