"""Structured configs (kw-only dataclasses) composed by Hydra; model YAMLs live in model_configs/."""

from grpo_mega.conf.schema import (
    AlgoConfig,
    BatchConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    load_model_config,
)

__all__ = [
    "AlgoConfig",
    "BatchConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "load_model_config",
]
