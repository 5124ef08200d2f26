"""LoRA adapters (lora.*): rank, alpha, targets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional



@dataclass(kw_only=True)
class LoraConfig:
    """LoRA (Hu et al., 2021): trainable low-rank adapters W + (alpha / rank) B A on the chosen linears of the frozen
    base model (grpo_mega/models/lora.py). The reference for the KL is the actor with its adapters off."""

    rank: Optional[int] = None
    """Adapter rank r; null: no LoRA (every weight trains). Must be > 0 and at most each adapted layer's smaller dimension."""
    alpha: float = 16.0
    """Scale alpha: the adapter adds (alpha / rank) B A x."""
    target_modules: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])
    """Adapted linears of each layer: 'qkv' (attention input, fused q/k/v), 'proj' (attention output), 'fc1'
    (dense MLP gate/up, fused), 'fc2' (dense MLP down); on an MoE layer 'expert_fc1' / 'expert_fc2' (every expert's
    gate/up and down, an adapter per expert, sharded over expert TP like the dense MLP's) and
    'router' (the router's gate). Each name must match some layer of the model."""
    init: str = "kaiming"
    """A's initialisation ('kaiming': PEFT's kaiming-uniform, a=sqrt(5); 'gaussian': normal with std 1/rank); B = 0,
    so step 0 is the base model. Dropout is 0."""
    seed: int = 0
    """Seed of A's initialisation (the same full A on every layout, each rank keeping its shard)."""

    def __post_init__(self):
        if self.rank is not None and self.rank <= 0:
            raise ValueError(f"lora.rank={self.rank} must be > 0 (or null: no LoRA)")
        unknown = [m for m in self.target_modules if m not in LORA_TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(f"lora.target_modules={list(self.target_modules)}: unknown {unknown or 'empty list'}; "
                             f"choose from {', '.join(LORA_TARGETS)}")
        if self.init not in ("kaiming", "gaussian"):
            raise ValueError(f"lora.init={self.init!r} must be 'kaiming' or 'gaussian'")

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "expert_fc1", "expert_fc2", "router")
"""lora.target_modules' names."""
MOE_TARGETS = ("expert_fc1", "expert_fc2", "router")
"""The targets that only an MoE layer has."""
