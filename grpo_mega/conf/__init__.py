"""Every config of a run, composed by Hydra into one TrainConfig (schema.py, the root; one module per component beside it); model YAMLs live in model_configs/.
docs/config.md is generated from these dataclasses (python -m grpo_mega.conf.reference --write)."""

from grpo_mega.conf.algo import AlgoConfig
from grpo_mega.conf.batch import BatchConfig
from grpo_mega.conf.lora import LoraConfig
from grpo_mega.conf.model import ModelConfig, load_model_config
from grpo_mega.conf.optim import OptimConfig, PrecisionConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.conf.reward import RewardConfig, RMTrainConfig
from grpo_mega.conf.rollout import MultiTurnConfig, RolloutConfig
from grpo_mega.conf.run import CheckpointConfig, DataConfig, EvalConfig, RunConfig
from grpo_mega.conf.schema import TrainConfig

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
