"""Structured configs: one kw-only dataclass per component, each field documented, each rule checked in
`__post_init__` (or, where it needs two components, in `check_layout`) with a message that names the
field, the value and the rule. Hydra composes these; nothing here imports torch.distributed or megatron.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

MODEL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "model_configs"


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass(kw_only=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (the only kind megatron-core's GPTModel implements)."""

    type: str = "llama3"
    """Scaling kind; only 'llama3'."""
    factor: float = 8.0
    """Divides the low frequencies."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are not scaled."""
    original_max_position_embeddings: int = 8192
    """Context length of the unscaled model."""

    def __post_init__(self):
        if self.type != "llama3":
            raise ValueError(f"rope_scaling.type={self.type!r} is not supported; megatron-core implements 'llama3'")


@dataclass(kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only Llama/Qwen2-family model: the fields of its HF config.json that
    decide shapes and numerics, and nothing about parallelism or training."""

    name: str = "custom"
    """Name (the YAML's file name)."""
    family: str = "llama"
    """'llama' or 'qwen2': picks the HF bridge."""
    num_layers: int
    """Transformer layers (HF num_hidden_layers)."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """SwiGLU inner width (HF intermediate_size)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA; HF num_key_value_heads)."""
    kv_channels: Optional[int] = None
    """Head dimension; hidden_size / num_attention_heads when null."""
    vocab_size: int
    """Real vocabulary (HF vocab_size)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding and output layer are padded to a multiple of this, the same at every TP size."""
    max_position_embeddings: int = 4096
    """Longest sequence the positional encoding is built for."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: Optional[RopeScaling] = None
    """Llama-3.1 RoPE scaling, or null."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon (HF rms_norm_eps)."""
    qkv_bias: bool = False
    """Bias on the q, k, v projections (Qwen2)."""
    tie_word_embeddings: bool = False
    """Output layer shares the input embedding's weight."""

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.family not in ("llama", "qwen2"):
            raise ValueError(f"model.family={self.family!r} must be 'llama' or 'qwen2'")
        for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings"):
            _positive(f"model.{f}", getattr(self, f))
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_query_groups={self.num_query_groups}"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"model.hidden_size={self.hidden_size} is not divisible by "
                    f"model.num_attention_heads={self.num_attention_heads}; set model.kv_channels"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rounded up to make_vocab_size_divisible_by: fixed by the model, not by tp
        (docs/design.md, "Vocabulary padding")."""
        m = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / m) * m)

    def num_parameters(self) -> int:
        """Parameters of the HF model this config describes (real vocabulary, no padding)."""
        h, d, kv = self.hidden_size, self.kv_channels, self.num_query_groups * self.kv_channels
        attn = h * self.num_attention_heads * d + 2 * h * kv + self.num_attention_heads * d * h
        if self.qkv_bias:
            attn += self.num_attention_heads * d + 2 * kv
        layer = attn + 3 * h * self.ffn_hidden_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h


def load_model_config(name_or_path: str) -> ModelConfig:
    """A ModelConfig from model_configs/<name>.yaml, or from a YAML path."""
    import yaml

    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = MODEL_CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))
        raise ValueError(f"unknown model {name_or_path!r}: no {path}; known models: {', '.join(known)}")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    allowed = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown fields {unknown}; allowed: {sorted(allowed)}")
    raw.setdefault("name", path.stem)
    try:
        return ModelConfig(**raw)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{path}: {e}") from None


@dataclass(kw_only=True)
class ParallelConfig:
    """How the actor and reference are placed: tp x pp x dp = world size, dp derived."""

    tp: int = 1
    """Tensor-parallel size: must divide heads, query groups, ffn width and the padded vocabulary."""
    pp: int = 1
    """Pipeline-parallel size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers on the first stage (null: even split)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers on the last stage (null: even split)."""
    recompute: str = "none"
    """Activation recompute: 'none', 'selective' (attention core) or 'full' (whole layers)."""

    def __post_init__(self):
        _positive("parallel.tp", self.tp)
        _positive("parallel.pp", self.pp)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"parallel.recompute={self.recompute!r} must be 'none', 'selective' or 'full'")

    def layers_per_stage(self, num_layers: int) -> list[int]:
        """Layers on each pipeline stage, or ValueError naming the numbers that do not add up."""
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if self.pp == 1:
            if first is not None or last is not None:
                raise ValueError("parallel.num_layers_in_first/last_pipeline_stage need parallel.pp > 1")
            return [num_layers]
        rest, middle = num_layers - (first or 0) - (last or 0), self.pp - (first is not None) - (last is not None)
        for n, v in (("first", first), ("last", last)):
            if v is not None and v < 1:
                raise ValueError(f"parallel.num_layers_in_{n}_pipeline_stage={v} must be >= 1")
        if middle == 0:
            if rest != 0:
                raise ValueError(
                    f"pipeline stages hold {first} + {last} layers but the model has {num_layers}: "
                    f"with pp=2 the first and last stage counts must add up to num_layers"
                )
            return [first, last]
        if rest < middle or rest % middle:
            raise ValueError(
                f"model.num_layers={num_layers} does not split over parallel.pp={self.pp} stages"
                + (f" with first={first}, last={last}" if first or last else "")
                + f": {rest} layers remain for {middle} stages and must divide evenly"
            )
        per = rest // middle
        return ([first] if first is not None else []) + [per] * middle + ([last] if last is not None else [])

    def check(self, model: ModelConfig, world_size: Optional[int] = None) -> int:
        """Validate this layout against a model (and a world size); return dp."""
        for what, n in (("num_attention_heads", model.num_attention_heads), ("num_query_groups", model.num_query_groups),
                        ("ffn_hidden_size", model.ffn_hidden_size), ("padded vocabulary", model.padded_vocab_size)):
            if n % self.tp:
                raise ValueError(f"parallel.tp={self.tp} must divide {what}={n} (model {model.name})")
        self.layers_per_stage(model.num_layers)
        if world_size is None:
            return 1
        if world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {self.tp} * {self.pp}; "
                f"launch a multiple of {self.tp * self.pp} ranks or change the layout"
            )
        return world_size // (self.tp * self.pp)


@dataclass(kw_only=True)
class PrecisionConfig:
    """Parameter and compute precision."""

    params_dtype: str = "bf16"
    """'bf16' or 'fp32' (bf16 runs with fp32 main weights and gradients in the optimizer)."""
    fp8: Optional[str] = None
    """Transformer Engine FP8: null, 'hybrid' (E4M3 forward, E5M2 backward) or 'e4m3'. GPU only."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe: 'delayed', 'tensorwise', 'mxfp8' or 'blockwise'."""

    def __post_init__(self):
        if self.params_dtype not in ("bf16", "fp32"):
            raise ValueError(f"precision.params_dtype={self.params_dtype!r} must be 'bf16' or 'fp32'")
        if self.fp8 not in (None, "hybrid", "e4m3"):
            raise ValueError(f"precision.fp8={self.fp8!r} must be null, 'hybrid' or 'e4m3'")
        if self.fp8_recipe not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            raise ValueError(f"precision.fp8_recipe={self.fp8_recipe!r} must be delayed, tensorwise, mxfp8 or blockwise")


@dataclass(kw_only=True)
class OptimConfig:
    """Megatron optimizer and LR schedule for the actor."""

    optimizer: str = "adam"
    """'adam' (AdamW) or 'sgd'."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_decay_steps: Optional[int] = None
    """Optimizer steps to decay over (null: no decay)."""
    lr_decay_style: str = "constant"
    """'constant', 'linear' or 'cosine'."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP (Megatron DistributedOptimizer)."""

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer={self.optimizer!r} must be 'adam' or 'sgd'")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.lr_decay_style={self.lr_decay_style!r} must be constant, linear or cosine")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr={self.lr} and optim.min_lr={self.min_lr} must satisfy 0 <= min_lr <= lr")


@dataclass(kw_only=True)
class AlgoConfig:
    """The GRPO objective (docs/design.md, "The algorithm")."""

    ppo_epochs: int = 1
    """Passes over the step's responses."""
    clip_ratio_low: float = 0.2
    """eps_low of the clipped surrogate."""
    clip_ratio_high: float = 0.2
    """eps_high; > clip_ratio_low is DAPO's clip-higher."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages, or null."""
    kl_coef: float = 0.001
    """beta: weight of the KL term in the loss (0 disables the reference in the loss)."""
    kl_estimator: str = "k3"
    """k1, abs, k2 (mse), k3 (low_var_kl) or full (the whole-vocabulary KL from both models' logits: the
    reference runs in lockstep with the actor during the update; not with kl_in_reward)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    dapo_token_scale: bool = False
    """Scale each token's loss by 1 / (valid tokens of its response)."""
    norm_adv_by_std: bool = True
    """Divide advantages by the group std (false: DrGRPO)."""
    global_adv_norm: bool = False
    """Divide advantages by their std over the whole batch."""
    early_stop_imp_ratio: Optional[float] = None
    """Skip a mini-batch with an importance ratio above this (or below its inverse); null: never."""
    ref_update_interval: Optional[int] = None
    """Iterative RL: copy the policy into the reference every this many steps; null: never."""
    ref_offload: bool = False
    """Keep the reference's weights in host memory between uses; they visit the GPU only for its forward
    (on GPUs; a no-op on CPU)."""
    kl_in_reward: bool = False
    """PPO-style: subtract beta * KL from the reward instead of adding it to the loss."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal."""
    engine_is_cap: Optional[float] = None
    """Importance correction for rollout/trainer drift: weight each token's loss by
    min(p_trainer_old / p_engine, cap) (truncated importance sampling); null: off."""

    def __post_init__(self):
        from grpo_mega.algo.kl import KL_ESTIMATORS
        from grpo_mega.algo.loss import AGG_MODES

        KL_ESTIMATORS.get(self.kl_estimator)
        AGG_MODES.get(self.loss_agg_mode)
        _positive("algo.ppo_epochs", self.ppo_epochs)
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError(f"algo.clip_ratio_low={self.clip_ratio_low} and clip_ratio_high={self.clip_ratio_high} must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"algo.dual_clip={self.dual_clip} must be > 1 (or null)")
        if self.kl_in_reward and self.kl_estimator == "full":
            raise ValueError("algo.kl_estimator='full' with algo.kl_in_reward=true: the reward's KL is estimated "
                             "from the sampled tokens' logprobs; use k1, abs, k2 or k3 there, or "
                             "kl_in_reward=false for the full KL in the loss")
        if self.engine_is_cap is not None and self.engine_is_cap < 1:
            raise ValueError(f"algo.engine_is_cap={self.engine_is_cap} must be >= 1 (or null)")
        if self.early_stop_imp_ratio is not None and self.early_stop_imp_ratio <= 1:
            raise ValueError(f"algo.early_stop_imp_ratio={self.early_stop_imp_ratio} must be > 1 (or null)")


@dataclass(kw_only=True)
class BatchConfig:
    """Batch semantics (docs/design.md, "Batch semantics"). All sizes global, counted in prompts unless named
    otherwise."""

    train_batch_size: int = 8
    """Prompts per step."""
    n: int = 4
    """Responses per prompt (rollout.n); >= 2 for GRPO."""
    ppo_mini_batch_size: int = 4
    """Prompts per mini-batch: one optimizer step each."""
    micro_batch_size: int = 2
    """Responses per forward on one rank, without packing: bounds memory only. With packing it sets the
    default token budget (micro_batch_size * (max_prompt_length + max_response_length))."""
    max_prompt_length: int = 256
    """Longest prompt in tokens."""
    max_response_length: int = 256
    """Longest response in tokens (DrGRPO's constant)."""
    logprob_chunk_size: Optional[int] = None
    """Tokens per chunk in the vocab-parallel logprob/entropy/KL op (null: whole micro-batch)."""
    packing: bool = True
    """Pack each DP rank's sequences back to back into rows of at most max_tokens_per_micro_batch tokens (one
    row per micro-batch; each sequence attends only to itself), balanced over DP ranks by tokens. false: rows
    padded to the longest, micro_batch_size rows per micro-batch. The gradient is the same either way."""
    max_tokens_per_micro_batch: Optional[int] = None
    """With packing: the token budget of one micro-batch (one packed row) on one rank; it bounds activation
    memory. null: micro_batch_size * (max_prompt_length + max_response_length), the padded path's worst case.
    At least max_prompt_length + max_response_length, so that any one sequence fits."""

    def __post_init__(self):
        for f in ("train_batch_size", "ppo_mini_batch_size", "micro_batch_size", "max_prompt_length", "max_response_length"):
            _positive(f"batch.{f}", getattr(self, f))
        if self.n < 2:
            raise ValueError(f"rollout.n={self.n} must be >= 2 for GRPO: a group of one has no baseline")
        if self.max_tokens_per_micro_batch is not None:
            _positive("batch.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
            longest = self.max_prompt_length + self.max_response_length
            if self.max_tokens_per_micro_batch < longest:
                raise ValueError(
                    f"batch.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} is smaller than "
                    f"max_prompt_length + max_response_length = {self.max_prompt_length} + "
                    f"{self.max_response_length} = {longest}: the longest sequence would not fit; raise it to "
                    f"at least {longest}"
                )
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={self.train_batch_size} must be a multiple of "
                f"ppo_mini_batch_size={self.ppo_mini_batch_size}"
            )

    @property
    def token_budget(self) -> int:
        """Tokens per packed micro-batch (max_tokens_per_micro_batch, or its default)."""
        if self.max_tokens_per_micro_batch is not None:
            return self.max_tokens_per_micro_batch
        return self.micro_batch_size * (self.max_prompt_length + self.max_response_length)

    def check_layout(self, parallel: "ParallelConfig", dp: int) -> None:
        """The batch against the layout: without packing, mini-batches split into DP ranks x micro-batches;
        with packing under sequence parallelism, the token budget divides by tp (rows are cut into tp
        sequence shards)."""
        if not self.packing:
            self.check_dp(dp)
        self.check_packing(parallel)

    def check_packing(self, parallel: "ParallelConfig") -> None:
        """With packing under sequence parallelism, the token budget must divide by tp."""
        if self.packing and parallel.sequence_parallel and self.token_budget % parallel.tp:
            raise ValueError(
                f"batch.max_tokens_per_micro_batch={self.token_budget} is not divisible by parallel.tp={parallel.tp}: "
                f"with sequence parallelism a packed row is cut into tp shards; make it a multiple of {parallel.tp}"
            )

    def check_dp(self, dp: int) -> None:
        """Without packing, each mini-batch's responses must split evenly into DP ranks x micro-batches."""
        responses = self.ppo_mini_batch_size * self.n
        if responses % (dp * self.micro_batch_size):
            raise ValueError(
                f"a mini-batch of ppo_mini_batch_size * rollout.n = {self.ppo_mini_batch_size} * {self.n} = "
                f"{responses} responses does not split into dp={dp} ranks x micro_batch_size={self.micro_batch_size}; "
                f"make it a multiple of {dp * self.micro_batch_size}"
            )

    @property
    def mini_batches_per_step(self) -> int:
        return self.train_batch_size // self.ppo_mini_batch_size


def to_dict(cfg) -> dict:
    return asdict(cfg)
