"""Every config of a run, composed by Hydra into one TrainConfig (schema.py); model YAMLs live in model_configs/.
docs/config.md is generated from these dataclasses (python -m grpo_mega.conf.reference --write)."""

from grpo_mega.conf.schema import (
    AlgoConfig,
    BatchConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    MultiTurnConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RewardConfig,
    RMTrainConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    load_model_config,
)

__all__ = [
    "AlgoConfig",
    "BatchConfig",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "LoraConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RMTrainConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "load_model_config",
]
