"""Structured configs: one kw-only dataclass per component, each field documented, each rule checked in
`__post_init__` (or, where it needs two components, in `check_layout`) with a message that names the
field, the value and the rule. Hydra composes these; nothing here imports torch.distributed or megatron.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
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
    """Architecture of a decoder-only Llama/Qwen2/Qwen3/Qwen3-MoE model: the fields of its HF config.json that
    decide shapes and numerics, and nothing about parallelism or training."""

    name: str = "custom"
    """Name (the YAML's file name)."""
    family: str = "llama"
    """'llama', 'qwen2', 'qwen3' or 'qwen3_moe': picks the HF bridge."""
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
    qk_layernorm: bool = False
    """RMSNorm over each query and key head before RoPE, one weight of kv_channels shared by all heads
    (Qwen3's q_norm/k_norm; megatron's q_layernorm/k_layernorm). Qwen3 always has it, Llama and Qwen2 never."""
    tie_word_embeddings: bool = False
    """Output layer shares the input embedding's weight."""
    num_experts: Optional[int] = None
    """Routed experts per MoE layer (HF num_experts); null for a dense model. Only family qwen3_moe has them."""
    moe_router_topk: Optional[int] = None
    """Experts each token is sent to (HF num_experts_per_tok); MoE models only."""
    moe_ffn_hidden_size: Optional[int] = None
    """SwiGLU inner width of each expert (HF moe_intermediate_size); MoE models only."""
    moe_norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 (HF norm_topk_prob); MoE models only."""
    decoder_sparse_step: int = 1
    """Layer i (0-based) is an MoE layer when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: list = field(default_factory=list)
    """0-based layers that keep a dense MLP of ffn_hidden_size in an MoE model (HF mlp_only_layers)."""
    moe_aux_loss_coeff: Optional[float] = None
    """Load-balancing aux loss coefficient (HF router_aux_loss_coef; megatron moe_aux_loss_coeff); null: 0.001 for
    an MoE model. Training setting kept with the router it acts on."""
    moe_z_loss_coeff: Optional[float] = None
    """Router z-loss coefficient (ST-MoE); null: off. MoE models only."""

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.family not in ("llama", "qwen2", "qwen3", "qwen3_moe"):
            raise ValueError(f"model.family={self.family!r} must be 'llama', 'qwen2', 'qwen3' or 'qwen3_moe'")
        qk = self.family in ("qwen3", "qwen3_moe")
        if self.qk_layernorm != qk:
            raise ValueError(f"model.qk_layernorm={self.qk_layernorm} with model.family={self.family!r}: Qwen3 "
                             "checkpoints always have q/k norms, Llama and Qwen2 checkpoints never; set "
                             f"model.qk_layernorm={str(qk).lower()}")
        self._check_moe()
        for f in ("rope_theta", "norm_epsilon"):  # YAML 1.1 reads 5.0e5 (no sign in the exponent) as text
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"model.{f}={v!r} must be a positive number (YAML reads 5.0e5 as text: write "
                                 "5.0e+5 or 500000.0)")
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

    def _check_moe(self) -> None:
        moe_fields = dict(moe_router_topk=self.moe_router_topk, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
                          moe_aux_loss_coeff=self.moe_aux_loss_coeff, moe_z_loss_coeff=self.moe_z_loss_coeff)
        if self.family != "qwen3_moe":
            if self.num_experts is not None:
                raise ValueError(f"model.num_experts={self.num_experts} with model.family={self.family!r}: only "
                                 "family qwen3_moe has experts")
            for k, v in moe_fields.items():
                if v is not None:
                    raise ValueError(f"model.{k}={v} is an MoE setting; model {self.name} is dense "
                                     f"(family {self.family!r}, no num_experts)")
            return
        for k in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "decoder_sparse_step"):
            _positive(f"model.{k}", getattr(self, k))
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_experts={self.num_experts}")
        self.mlp_only_layers = sorted(int(i) for i in self.mlp_only_layers)
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"model.mlp_only_layers={bad} are not layers of a {self.num_layers}-layer model (0-based)")
        if self.moe_aux_loss_coeff is None:
            self.moe_aux_loss_coeff = 0.001
        for k in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"model.{k}={v!r} must be a number >= 0")
        if not any(self.moe_layers()):
            raise ValueError(f"model {self.name}: no MoE layer (decoder_sparse_step={self.decoder_sparse_step}, "
                             f"mlp_only_layers={self.mlp_only_layers})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def moe_layers(self) -> list[bool]:
        """Per layer (0-based): does it hold experts? HF Qwen3MoeDecoderLayer's rule."""
        if not self.is_moe:
            return [False] * self.num_layers
        return [i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                for i in range(self.num_layers)]

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
        if self.qk_layernorm:
            attn += 2 * d
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + sum(self._mlp_parameters(moe) for moe in self.moe_layers()) + embed + h

    def _mlp_parameters(self, moe: bool, experts: Optional[int] = None) -> int:
        h = self.hidden_size
        if not moe:
            return 3 * h * self.ffn_hidden_size
        return (self.num_experts if experts is None else experts) * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h

    def num_active_parameters(self) -> int:
        """Parameters one token uses: as num_parameters, with moe_router_topk experts per MoE layer."""
        if not self.is_moe:
            return self.num_parameters()
        return self.num_parameters() - sum(self._mlp_parameters(True) - self._mlp_parameters(True, self.moe_router_topk)
                                           for moe in self.moe_layers() if moe)


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
    ep: int = 1
    """Expert-parallel size (MoE models): the experts of each layer are split over ep ranks of the data-parallel
    group; must divide num_experts and dp."""
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
        _positive("parallel.ep", self.ep)
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
        if self.ep > 1 and not model.is_moe:
            raise ValueError(f"parallel.ep={self.ep} needs an MoE model; model {model.name} is dense (no num_experts)")
        if model.is_moe and model.num_experts % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide num_experts={model.num_experts} (model {model.name})")
        if model.is_moe and model.moe_ffn_hidden_size % self.tp:
            raise ValueError(f"parallel.tp={self.tp} must divide moe_ffn_hidden_size={model.moe_ffn_hidden_size} "
                             f"(model {model.name})")
        if world_size is None:
            return 1
        if world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {self.tp} * {self.pp}; "
                f"launch a multiple of {self.tp * self.pp} ranks or change the layout"
            )
        dp = world_size // (self.tp * self.pp)
        if dp % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide the data-parallel size dp={dp} "
                             f"(world {world_size} / (tp {self.tp} * pp {self.pp})): experts are split over DP ranks")
        return dp


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
    (dense MLP gate/up, fused), 'fc2' (dense MLP down)."""
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


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""lora.target_modules' names."""


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
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's denominator epsilon."""
    sgd_momentum: float = 0.0
    """Momentum for optimizer=sgd."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up."""
    lr_decay_steps: Optional[int] = None
    """Optimizer steps to decay over (null: no decay, lr_decay_style constant only)."""
    lr_decay_style: str = "constant"
    """'constant', 'linear' or 'cosine'."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP (Megatron DistributedOptimizer)."""
    max_consecutive_skips: int = 10
    """Mini-batches in a row skipped for a non-finite loss or gradient (counted across steps; an applied
    optimizer step resets the count) before the run stops with an error, after a checkpoint (with
    checkpoint.dir; skipped mini-batches leave the weights unchanged). 0: never stop."""

    def __post_init__(self):
        if not isinstance(self.max_consecutive_skips, int) or self.max_consecutive_skips < 0:
            raise ValueError(f"optim.max_consecutive_skips={self.max_consecutive_skips} must be >= 0 (0: never stop)")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer={self.optimizer!r} must be 'adam' or 'sgd'")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.lr_decay_style={self.lr_decay_style!r} must be constant, linear or cosine")
        if self.lr_decay_style != "constant" and self.lr_decay_steps is None:
            # without it the schedule decayed over 1 step: min_lr from step 2 on (a run at min_lr=0 learns nothing)
            raise ValueError(f"optim.lr_decay_style={self.lr_decay_style!r} needs optim.lr_decay_steps (the optimizer "
                             "steps to decay over, e.g. run.steps)")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr={self.lr} and optim.min_lr={self.min_lr} must satisfy 0 <= min_lr <= lr")


@dataclass(kw_only=True)
class AlgoConfig:
    """The GRPO objective (docs/design.md, "The algorithm")."""

    policy_loss: str = "ppo_clip"
    """The policy loss, by name (grpo_mega.algo.POLICY_LOSSES): 'ppo_clip' (the clipped surrogate, with
    clip-higher and dual-clip), 'gspo' / 'gspo_token' (GSPO's sequence-level ratio and clip), 'cispo' (MiniMax-M1's
    clipped, stop-gradient IS weight on log pi), 'geo_mean' (GMPO: geometric mean of log-clipped token ratios),
    'sapo' (SAPO's smooth gate), 'gpg' (plain -A log pi), 'clip_cov' / 'kl_cov' (PPO with the gradient cut, or a KL
    added, on high-covariance tokens), 'dppo_tv' / 'dppo_kl' (DPPO: tokens outside a probability-divergence trust
    region leave the update). gspo, gspo_token, geo_mean and sapo need loss_agg_mode=seq-mean-token-mean."""
    ppo_epochs: int = 1
    """Passes over the step's responses."""
    clip_ratio_low: float = 0.2
    """eps_low of the clipped surrogate."""
    clip_ratio_high: float = 0.2
    """eps_high; > clip_ratio_low is DAPO's clip-higher."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (the loss of A < 0 is at most -c A), or null: off (verl
    always applies c = 3, its clip_ratio_c; docs/verl.md). ppo_clip, gspo and gspo_token."""
    gspo_clip_low: float = 3e-4
    """GSPO: eps_low on the sequence ratio s_i = exp(mean_t log(pi/pi_old)) (Zheng et al. 2025: 3e-4)."""
    gspo_clip_high: float = 4e-4
    """GSPO: eps_high on s_i (the paper's 4e-4)."""
    seq_log_ratio_cap: float = 10.0
    """Upper cap on a sequence-level log-ratio before its exp (gspo, gspo_token; verl's GSPO caps at 10): bounds a
    negative advantage's loss by |A| e^cap; no gradient above the cap."""
    cispo_eps_low: float = 1.0
    """CISPO: the IS weight is clipped below at 1 - cispo_eps_low (1.0: no lower bound, as MiniMax-M1)."""
    cispo_eps_high: float = 4.0
    """CISPO: the IS weight is clipped above at 1 + cispo_eps_high."""
    gmpo_clip_low: float = 0.4
    """geo_mean (GMPO): each token's log-ratio is clipped below at -gmpo_clip_low (the paper's ratio range
    (e^-0.4, e^0.4); verl reads clip_ratio_low here)."""
    gmpo_clip_high: float = 0.4
    """geo_mean: each token's log-ratio is clipped above at gmpo_clip_high."""
    sapo_tau_pos: float = 1.0
    """sapo: the gate's temperature for tokens with A > 0 (verl's tau_pos)."""
    sapo_tau_neg: float = 1.05
    """sapo: the gate's temperature for tokens with A <= 0 (verl's tau_neg)."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: the share of a micro-batch's valid tokens whose policy-gradient term is dropped (at least 1)."""
    clip_cov_lb: float = 1.0
    """clip_cov: a token is a candidate when its advantage/log-prob covariance is in (clip_cov_lb, clip_cov_ub)."""
    clip_cov_ub: float = 5.0
    """clip_cov: the candidates' covariance upper bound."""
    kl_cov_ratio: float = 2e-4
    """kl_cov: the share of a micro-batch's valid tokens (largest covariance, at least 1) given the KL term."""
    kl_cov_coef: float = 0.1
    """kl_cov: the coefficient of |log r_t| on those tokens (verl's ppo_kl_coef)."""
    dppo_div_low: float = 0.2
    """dppo_tv / dppo_kl: the divergence threshold for tokens with A <= 0 (verl reads clip_ratio_low here)."""
    dppo_div_high: float = 0.2
    """dppo_tv / dppo_kl: the divergence threshold for tokens with A > 0 (verl reads clip_ratio_high here)."""
    dppo_is_cap: float = 20.0
    """dppo_tv / dppo_kl: the cap of the stop-gradient IS weight on kept tokens (verl's clip_ratio_c, 20 there)."""
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
    adv_estimator: str = "grpo"
    """The advantage estimator (grpo_mega.algo.advantages.ADV_ESTIMATORS): 'grpo' (group mean and std),
    'rloo' (leave-one-out mean), 'reinforce_plus_plus_baseline' (group mean, then whitened over the batch's tokens),
    'grpo_passk' (only each group's best response, by its margin over the second best)."""
    norm_adv_by_std: bool = True
    """Divide advantages by the group std (false: DrGRPO); read by adv_estimator grpo and grpo_passk only."""
    global_adv_norm: bool = False
    """Divide advantages by their std over the whole batch (after any adv_estimator)."""
    early_stop_imp_ratio: Optional[float] = None
    """Skip a mini-batch with an importance ratio above this (or below its inverse); null: never."""
    ref_update_interval: Optional[int] = None
    """Iterative RL: copy the policy into the reference every this many steps; null: never."""
    ref_offload: bool = False
    """Keep the reference's weights in host memory between uses; they visit the GPU only for its forward
    (on GPUs; a no-op on CPU)."""
    kl_in_reward: bool = False
    """PPO-style: subtract beta * KL from the reward instead of adding it to the loss."""
    dynamic_sampling: Optional[str] = None
    """DAPO dynamic sampling (grpo_mega.algo.dynamic_sampling): 'filter' keeps groups whose rewards are all equal
    out of the loss; 'refill' generates more prompts until train_batch_size informative groups are held (or
    max_gen_rounds rounds ran); null: off (true/false, the setting's boolean form: filter/off)."""
    max_gen_rounds: int = 10
    """dynamic_sampling=refill: at most this many generation rounds per step (>= 1; 1: filter)."""
    recompute_old_logprobs: bool = False
    """Always run the old-logprob pass. By default it is skipped when the update is exactly on-policy (ppo_epochs
    1, one mini-batch, no off-policy steps, no kl_in_reward): the update's own logprobs, detached, are the old
    ones (the loss and gradient are the same; one forward pass over the batch is saved)."""
    engine_is_cap: Optional[float] = None
    """Importance correction for rollout/trainer drift: weight each token's loss by
    min(p_trainer_old / p_engine, cap) (truncated importance sampling); null: off. The same as
    rollout_correction=token with rollout_correction_high=cap."""
    rollout_correction: Optional[str] = None
    """Rollout correction (grpo_mega.algo.correction): weight each token's loss by a function of
    rho = p_trainer_old / p_engine at level 'token', 'sequence' (the product over the response) or 'geometric'
    (its per-token geometric mean); or the preset 'icepop' (token level, mask outside [0.5, 5]); null: off."""
    rollout_correction_mode: Optional[str] = None
    """'truncate' (weight clip(rho, low, high)) or 'mask' (weight rho inside [low, high], 0 outside); null:
    truncate (icepop: mask)."""
    rollout_correction_low: Optional[float] = None
    """Lower bound on rho; null: 0 when truncating, 1/high when masking (icepop: 0.5)."""
    rollout_correction_high: Optional[float] = None
    """Upper bound on rho (> low); null: 2.0 (icepop: 5.0)."""
    routing_replay: str = "none"
    """MoE models: 'rollout' (R3) routes each token in the trainer's passes to the top-k experts the rollout engine
    chose for it (prompt and response; grpo_mega.models.routing_replay); 'measure': the engine's choices are
    recorded and only compared (moe/routing_agreement logged), the trainer routes on its own: whether replay is
    needed; 'none': the trainer routes on its own, nothing recorded."""

    def __post_init__(self):
        from grpo_mega.algo.kl import KL_ESTIMATORS
        from grpo_mega.algo.loss import AGG_MODES
        from grpo_mega.algo.policy_loss import POLICY_LOSSES, check_settings

        from grpo_mega.algo.advantages import ADV_ESTIMATORS

        POLICY_LOSSES.get(self.policy_loss)
        ADV_ESTIMATORS.get(self.adv_estimator)
        KL_ESTIMATORS.get(self.kl_estimator)
        AGG_MODES.get(self.loss_agg_mode)
        check_settings(self.policy_loss, self.loss_agg_mode, self.dual_clip)
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
        self.correction()
        from grpo_mega.algo.dynamic_sampling import resolve_mode

        self.dynamic_sampling = resolve_mode(self.dynamic_sampling)
        if self.max_gen_rounds < 1:
            raise ValueError(f"algo.max_gen_rounds={self.max_gen_rounds} must be >= 1 (the step's first round counts)")
        if self.routing_replay not in ("none", "measure", "rollout"):
            raise ValueError(f"algo.routing_replay={self.routing_replay!r} must be 'none', 'measure' or 'rollout'")
        if not 0.0 <= self.cispo_eps_low <= 1.0 or self.cispo_eps_high < 0:
            raise ValueError(f"algo.cispo_eps_low={self.cispo_eps_low} must be in [0, 1] and "
                             f"algo.cispo_eps_high={self.cispo_eps_high} >= 0")
        if self.gspo_clip_low < 0 or self.gspo_clip_high < 0:
            raise ValueError(f"algo.gspo_clip_low={self.gspo_clip_low} and gspo_clip_high={self.gspo_clip_high} "
                             f"must be >= 0")
        if not self.seq_log_ratio_cap > 0:
            raise ValueError(f"algo.seq_log_ratio_cap={self.seq_log_ratio_cap} must be > 0 (verl's GSPO uses 10)")
        self.objective()  # the loss's own checks (grpo_mega.algo.policy_loss.Objective), at start-up

    def objective(self):
        """The policy loss's settings (grpo_mega.algo.policy_loss.Objective): every field of it read from the
        field of the same name here, the one place the loss reads the config."""
        from dataclasses import fields

        from grpo_mega.algo.policy_loss import Objective

        return Objective(**{f.name: getattr(self, f.name) for f in fields(Objective)})

    @property
    def records_routes(self) -> bool:
        """The engine returns the experts it chose (routing_replay 'rollout' replays them, 'measure' compares)."""
        return self.routing_replay != "none"

    def correction(self):
        """The rollout correction (level, mode, low, high) these fields resolve to, or None when off
        (grpo_mega.algo.correction.resolve; engine_is_cap is its token-level truncation)."""
        from grpo_mega.algo.correction import resolve

        return resolve(self.rollout_correction, self.rollout_correction_mode, self.rollout_correction_low,
                       self.rollout_correction_high, self.engine_is_cap)


@dataclass(kw_only=True)
class BatchConfig:
    """Batch semantics (docs/design.md, "Batch semantics"). All sizes global, counted in prompts unless named
    otherwise."""

    train_batch_size: int = 8
    """Prompts per step."""
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
    """Tokens per chunk in the vocab-parallel logprob/entropy/KL op (null: with fused_output, as many as make one
    fp32 [chunk, vocab/tp] tensor 256 MiB; without, the whole micro-batch)."""
    fused_output: bool = True
    """The output layer fused into the logprob/entropy/KL op (grpo_mega/parallel/fused_output.py): logits made
    and reduced chunk by chunk, made again in the backward, so no [tokens, vocab/tp] tensor beyond one chunk
    exists; false: the output layer's whole logits, then the op. Same results either way."""
    response_only_logits: bool = True
    """Only the positions the loss reads (those predicting a response token) go through the output layer and
    the logprob/entropy/KL op; false: every position, prompts and padding included. Same gradient either way."""
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
        if self.logprob_chunk_size is not None:
            _positive("batch.logprob_chunk_size", self.logprob_chunk_size)
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

    def check_layout(self, parallel: "ParallelConfig", dp: int, n: int) -> None:
        """The batch against the layout: without packing, mini-batches split into DP ranks x micro-batches;
        with packing under sequence parallelism, the token budget divides by tp (rows are cut into tp
        sequence shards)."""
        if not self.packing:
            self.check_dp(dp, n)
        self.check_packing(parallel)

    def check_packing(self, parallel: "ParallelConfig") -> None:
        """With packing under sequence parallelism, the token budget must divide by tp."""
        if self.packing and parallel.sequence_parallel and self.token_budget % parallel.tp:
            raise ValueError(
                f"batch.max_tokens_per_micro_batch={self.token_budget} is not divisible by parallel.tp={parallel.tp}: "
                f"with sequence parallelism a packed row is cut into tp shards; make it a multiple of {parallel.tp}"
            )

    def check_dp(self, dp: int, n: int) -> None:
        """Without packing, each mini-batch's responses (ppo_mini_batch_size * rollout.n) must split evenly
        into DP ranks x micro-batches."""
        responses = self.ppo_mini_batch_size * n
        if responses % (dp * self.micro_batch_size):
            raise ValueError(
                f"a mini-batch of ppo_mini_batch_size * rollout.n = {self.ppo_mini_batch_size} * {n} = "
                f"{responses} responses does not split into dp={dp} ranks x micro_batch_size={self.micro_batch_size}; "
                f"make it a multiple of {dp * self.micro_batch_size}"
            )

    @property
    def mini_batches_per_step(self) -> int:
        return self.train_batch_size // self.ppo_mini_batch_size

    def mini_batch_responses(self, step_responses: int) -> int:
        """Responses per mini-batch of a step of `step_responses` (train_batch_size * rollout.n): the step
        splits into mini_batches_per_step equal mini-batches, one optimizer step each."""
        if step_responses % self.mini_batches_per_step:
            raise ValueError(f"{step_responses} responses do not split into batch.train_batch_size / "
                             f"batch.ppo_mini_batch_size = {self.mini_batches_per_step} mini-batches")
        return step_responses // self.mini_batches_per_step


@dataclass(kw_only=True)
class MultiTurnConfig:
    """rollout.multi_turn: multi-turn rollouts with tool calls (grpo_mega.rollout.multi_turn), token in and
    token out; tool results carry no loss."""

    enable: bool = False
    """Generate each sample turn by turn, running the tool calls the model writes (off: single-turn)."""
    max_turns: int = 4
    """The model's turns per sample; the last turn's tool calls are not run (counted: multi_turn/max_turns_reached).
    All turns and tool results fit in batch.max_response_length tokens (a trajectory cut by it ends 'length')."""
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """Tools by registered name (calculator) or dotted path to a grpo_mega.toolcalls.Tool (`pkg.mod:MyTool`)."""
    parser: str = "hermes"
    """How tool calls are found in a model turn: 'hermes' (alias 'qwen': <tool_call>{json}</tool_call>),
    'expression' or 'bare' (the toy tasks')."""
    agent_loop: str = ""
    """An `async def loop(traj)` by dotted path (`pkg.mod:fn`) that drives each trajectory (generate, call tools,
    reply as a user: docs/agents.md); '': the default loop (the model's turn, its tool calls, again)."""
    async_tools: bool = True
    """Tool calls run while the engine generates other samples' turns, and a sample goes on as soon as its own
    calls are answered; false: turns in lockstep (each batch waits for every sample's calls)."""
    tool_timeout_s: float = 10.0
    """A tool call still running after this is killed (its worker, by PID) and answers with an error."""
    tool_workers: int = 2
    """Worker processes per rollout engine running tool calls."""
    tool_max_memory_mb: Optional[int] = 2048
    """Cap on each tool worker's memory beyond its size at start (RLIMIT_AS; null or 0: none): a call over it
    answers with an error, the run goes on, and the node's OOM killer never has to pick a process."""
    tool_env: list[str] = field(default_factory=list)
    """Environment variables a tool worker gets beyond PATH, locale and time zone (all others, API keys
    included, are removed from its environment), e.g. [SEARCH_API_KEY]."""
    max_tool_response_chars: int = 4096
    """A tool result longer than this is cut to it and ends '...[truncated N chars]' (counted)."""
    max_tool_calls_per_turn: int = 8
    """Calls run per model turn; more are answered with one error turn (counted as errors)."""
    max_tool_call_chars: int = 8192
    """A call whose arguments (as JSON) are longer than this is answered with an error, not run."""
    call_stop: list[str] = field(default_factory=list)
    """Tokens (each one token of the tokenizer) that also end a model turn so its calls run, e.g. [</tool_call>];
    the chat template's own turn end follows them in the trajectory, as the template renders it."""

    def __post_init__(self):
        if self.max_tool_response_chars < 1:
            raise ValueError(f"rollout.multi_turn.max_tool_response_chars={self.max_tool_response_chars} must be >= 1")
        if self.max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns={self.max_turns} must be >= 1")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"rollout.multi_turn.tool_timeout_s={self.tool_timeout_s} must be > 0")
        if self.tool_workers < 1:
            raise ValueError(f"rollout.multi_turn.tool_workers={self.tool_workers} must be >= 1")
        if self.tool_max_memory_mb is not None and self.tool_max_memory_mb < 0:
            raise ValueError(f"rollout.multi_turn.tool_max_memory_mb={self.tool_max_memory_mb} must be >= 0 "
                             "(0 or null: no limit)")
        if self.max_tool_calls_per_turn < 1:
            raise ValueError(f"rollout.multi_turn.max_tool_calls_per_turn={self.max_tool_calls_per_turn} must be >= 1")
        if self.max_tool_call_chars < 2:
            raise ValueError(f"rollout.multi_turn.max_tool_call_chars={self.max_tool_call_chars} must be >= 2")
        from grpo_mega.toolcalls.parsers import PARSERS

        try:
            PARSERS.get(self.parser)
        except ValueError as e:
            raise ValueError(f"rollout.multi_turn.parser: {e}") from None
        if not self.enable:
            return
        if not self.tools:
            raise ValueError("rollout.multi_turn.enable=true needs rollout.multi_turn.tools=[calculator,...]")
        from grpo_mega.toolcalls import build_tools

        tools = build_tools(self.tools)  # an unknown name or a path that does not import fails here
        if self.parser == "bare" and len(tools) != 1:
            raise ValueError(f"rollout.multi_turn.parser=bare calls the run's only tool; rollout.multi_turn.tools has "
                             f"{len(tools)}: {sorted(tools)}")
        if self.agent_loop:
            from grpo_mega.registry import import_async_function

            import_async_function(self.agent_loop, "rollout.multi_turn.agent_loop")


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling and weight sync."""

    engine: str = "embedded"
    """'embedded' (our engine, in the trainer's process) or 'sglang'; with placement=dedicated the servers'."""
    n: int = 4
    """Responses per prompt: the GRPO group (>= 2). A step trains batch.train_batch_size * n responses."""
    temperature: float = 1.0
    """Sampling temperature; logprobs are of softmax(logits / temperature) (docs/design.md)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    embedded_decode: str = "auto"
    """The embedded engine's decode: 'dynamic' (a KV cache grown by concatenation), 'static' (one preallocated per
    batch, prompt width + max new tokens), 'compiled' (CUDA only: static, the per-token forward under
    torch.compile(mode="reduce-overhead"), replayed as a CUDA graph), 'auto' (compiled on CUDA, dynamic on the CPU,
    where static is no faster: bench_results/decode.json)."""
    engine_tp: int = 1
    """The SGLang engine's tensor-parallel size (its own; the trainer's parallel.tp need not match)."""
    gpu_memory_fraction: Optional[float] = None
    """SGLang's mem_fraction_static: the share of each GPU the colocated engine keeps (weights + KV cache);
    null: SGLang's default. grpo-mega-plan counts it against the trainer's memory."""
    num_engines: int = 1
    """Rollout engines, on global ranks 0, W/k, 2W/k, ...: each samples a contiguous share of the prompts
    (the samples do not depend on k). On a cluster, one per node (with engine_tp = GPUs per node)."""
    sync_bucket_mb: float = 64.0
    """Weight-sync bucket size."""
    audit_weights: bool = False
    """Checksum every synced tensor against the engine's copy."""
    placement: str = "colocated"
    """'colocated': engines inside trainer ranks, phases in turn. 'dedicated': the engines are the servers
    in `servers` (SGLang's HTTP API; `python -m grpo_mega.rollout.standin_server` is the CPU stand-in), spoken to
    from global rank 0."""
    servers: list[str] = field(default_factory=list)
    """Dedicated placement: the servers' URLs, e.g. [http://10.0.0.5:30000, http://10.0.0.6:30000]."""
    server_timeout_s: float = 300.0
    """Dedicated placement: the longest a server may take to answer one request (a generate included)."""
    server_retries: int = 3
    """Dedicated placement: a generate or read that meets a transient failure (no connection, a reset, a timeout,
    HTTP 5xx) is tried again this many times; one still failing ends the run with exit status 75, which
    slurm/train.sbatch requeues (docs/slurm.md). Weight updates are never retried."""
    server_retry_backoff_s: float = 2.0
    """Seconds before the first retry, doubling before each next one (2, 4, 8 s)."""
    engine_timeout_s: float = 900.0
    """A colocated SGLang engine: the longest one call (a step's generation included) may take."""
    off_policy_steps: int = 0
    """0: each step generates, then trains. 1 (placement=dedicated): step k+1's samples are generated on the
    servers while step k trains, from the weights step k-1 trained from (one version behind; samples of step
    k >= 2 carry weight version k-2, version v being the weights after v steps); truncated importance
    correction (algo.engine_is_cap, default 2.0 here) covers the lag. With mode=async: any k >= 1, the staleness
    bound."""
    mode: str = "sync"
    """'sync': each step's batch is generated as one (in turn, or one step ahead with off_policy_steps=1). 'async'
    (placement=dedicated): fully asynchronous; the servers generate whole groups continuously from the prompt
    stream, the trainer takes the first train_batch_size completed groups whose oldest token's weight version is
    at least its own minus off_policy_steps (the staleness bound k >= 1; older groups are dropped and counted), and
    weights go to the servers after every update without waiting for generations in flight (docs/design.md,
    "Versions and off-policy")."""
    partial_rollouts: bool = True
    """mode=async: responses are generated in segments of segment_tokens tokens, continued from their token prefix,
    so that a response in flight when new weights arrive continues under them (each token records its version).
    false: each response is generated in one request and keeps the version it started on (the weight update
    waits for the server's request in flight)."""
    segment_tokens: int = 16
    """mode=async with partial_rollouts: the tokens a response gets per request (the longest a weight update waits)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tool calls (off by default)."""
    dump_dir: str = ""
    """Write every trajectory (prompt and response ids, text, model mask, turns, tool calls, reward, advantage)
    as jsonl, one file per step (train_step_XXXXXXXX.jsonl) and per validation (val_step_XXXXXXXX.jsonl), by
    rank 0 (grpo_mega.rollout.dump); '': none."""

    def __post_init__(self):
        if isinstance(self.multi_turn, dict):  # a checkpoint's saved config
            self.multi_turn = MultiTurnConfig(**self.multi_turn)
        if self.engine not in ("embedded", "sglang"):
            raise ValueError(f"rollout.engine={self.engine!r} must be 'embedded' or 'sglang'")
        if not isinstance(self.n, int) or self.n < 2:
            raise ValueError(f"rollout.n={self.n} must be >= 2 for GRPO: a group of one has no baseline")
        if self.placement not in ("colocated", "dedicated"):
            raise ValueError(f"rollout.placement={self.placement!r} must be 'colocated' or 'dedicated'")
        if self.embedded_decode not in ("auto", "dynamic", "static", "compiled"):
            raise ValueError(f"rollout.embedded_decode={self.embedded_decode!r} must be 'auto', 'dynamic', 'static' "
                             "or 'compiled'")
        if self.placement == "dedicated" and not self.servers:
            raise ValueError("rollout.placement=dedicated needs rollout.servers=[http://host:port,...]")
        if self.placement == "colocated" and self.servers:
            raise ValueError(f"rollout.servers={list(self.servers)} is for rollout.placement=dedicated; "
                             "set it, or drop the servers")
        if self.placement == "dedicated" and self.num_engines != 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be 1 with placement=dedicated "
                             "(one client on rank 0 spreads the prompts over rollout.servers)")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"rollout.mode={self.mode!r} must be 'sync' or 'async'")
        if self.mode == "async":
            if not isinstance(self.off_policy_steps, int) or self.off_policy_steps < 1:
                raise ValueError(f"rollout.mode=async needs rollout.off_policy_steps=k >= 1 (the staleness bound: a "
                                 f"sample's oldest token at most k versions behind the trainer); got {self.off_policy_steps}")
            if not isinstance(self.segment_tokens, int) or self.segment_tokens < 1:
                raise ValueError(f"rollout.segment_tokens={self.segment_tokens} must be >= 1")
        elif self.off_policy_steps not in (0, 1):
            raise ValueError(f"rollout.off_policy_steps={self.off_policy_steps} must be 0 or 1 with rollout.mode=sync "
                             "(rollout.mode=async takes any k >= 1 as its staleness bound)")
        if self.off_policy_steps and self.placement != "dedicated":
            raise ValueError(f"rollout.off_policy_steps={self.off_policy_steps} needs rollout.placement=dedicated "
                             f"(got {self.placement!r}): generation overlaps training only on servers of their own; "
                             "set rollout.placement=dedicated rollout.servers=[http://host:port]")
        if self.server_timeout_s <= 0:
            raise ValueError(f"rollout.server_timeout_s={self.server_timeout_s} must be > 0")
        if not isinstance(self.server_retries, int) or self.server_retries < 0:
            raise ValueError(f"rollout.server_retries={self.server_retries} must be >= 0")
        if self.server_retry_backoff_s < 0:
            raise ValueError(f"rollout.server_retry_backoff_s={self.server_retry_backoff_s} must be >= 0")
        if self.engine_timeout_s <= 0:
            raise ValueError(f"rollout.engine_timeout_s={self.engine_timeout_s} must be > 0")
        if self.num_engines < 1:
            raise ValueError(f"rollout.num_engines={self.num_engines} must be >= 1")
        if self.engine_tp < 1:
            raise ValueError(f"rollout.engine_tp={self.engine_tp} must be >= 1")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction < 1:
            raise ValueError(f"rollout.gpu_memory_fraction={self.gpu_memory_fraction} must be in (0, 1)")


@dataclass(kw_only=True)
class RunConfig:
    """How long the run is and how it is seeded."""

    steps: int = 40
    """Training steps (one generation and one update each); a resumed run continues to this step."""
    seed: int = 1234
    """Seeds the model's initialisation, the data order and sampling."""

    def __post_init__(self):
        _positive("run.steps", self.steps)


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = ""
    """Checkpoint root ('' : no checkpoints)."""
    interval: int = 0
    """Save every this many steps (0: only at the end)."""
    keep_last: Optional[int] = None
    """Keep this many newest checkpoints (null: all)."""
    resume: str = "auto"
    """'auto': continue from the newest checkpoint in `dir` that verifies (start fresh when there is none; an
    error when there are some and none verifies); 'never'; or the path of one step_XXXXXXXX directory."""
    stop_file: str = ""
    """When this file appears, checkpoint after the current step and stop (slurm/train.sbatch creates it on
    USR1, before a time limit or preemption, and requeues the job; the restart loses nothing)."""
    export_hf: bool = False
    """Also write the actor as an HF directory (`hf/`, loadable by transformers/SGLang) into every checkpoint.
    Any checkpoint can be exported later: grpo-mega-convert-to-hf --ckpt DIR/step_XXXXXXXX."""
    lock_stale_s: float = 300.0
    """The run holding `dir` heartbeats its lock from a thread every lock_stale_s / 10; a lock on another host
    without a heartbeat for this long is taken over (a holder on this host or in this Slurm job is checked
    by PID). Raise it on file systems whose modification times lag by minutes."""

    def __post_init__(self):
        if self.resume not in ("auto", "never") and not self.resume.rstrip("/").split("/")[-1].startswith("step_"):
            raise ValueError(f"checkpoint.resume={self.resume!r} must be 'auto', 'never' or a checkpoint's "
                             "step_XXXXXXXX directory")
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval={self.interval} must be >= 0 (0: only at the end)")
        if self.resume not in ("auto", "never") and not self.dir:
            self.dir = str(Path(self.resume).parent)  # continue writing next to the checkpoint resumed from
        if (self.interval or self.export_hf) and not self.dir:
            raise ValueError("checkpoint.interval / checkpoint.export_hf need checkpoint.dir=PATH")
        if self.lock_stale_s <= 0:
            raise ValueError(f"checkpoint.lock_stale_s={self.lock_stale_s} must be > 0 (seconds without a "
                             "heartbeat before another run may take the lock over)")


SGLANG_READS_BACK = ("llama",)
"""Model families whose SGLang model class has get_weights_by_name (SGLang 0.5.23: Llama's; not Qwen2's or
Qwen3's), which rollout.audit_weights needs."""


@dataclass(kw_only=True)
class EvalConfig:
    """Validation: greedy reward and pass@k on the validation prompts."""

    interval: int = 5
    """Validate every this many steps, and before step 1 and after the last; 0: no evaluation at all."""
    pass_k: int = 4
    """Validation also samples k responses per prompt at the rollout temperature: pass@k."""
    max_prompts: int = 64
    """task=prompts without data.val_files: validate on this many training prompts (a fixed, seeded sample)."""

    def __post_init__(self):
        if not isinstance(self.interval, int) or self.interval < 0:
            raise ValueError(f"eval.interval={self.interval} must be >= 0 (0: no evaluation)")
        _positive("eval.pass_k", self.pass_k)
        _positive("eval.max_prompts", self.max_prompts)


@dataclass(kw_only=True)
class DataConfig:
    """Prompt files in verl's schema (task=prompts)."""

    train_files: str = ""
    """A .jsonl or .parquet file of prompts."""
    val_files: str = ""
    """Validation prompts ('': eval.max_prompts prompts sampled from the training file)."""
    cache_dir: str = ""
    """Where a .parquet file's Arrow copy is written once (keyed by its content hash) and memory-mapped by every
    rank ('': $GRPO_MEGA_CACHE/data, GRPO_MEGA_CACHE defaulting to ~/.cache/grpo_mega); a .jsonl needs none."""


@dataclass(kw_only=True)
class RMTrainConfig:
    """reward.rm_train: continual training of the reward model (reward.name=reward_model)."""

    interval: int = 0
    """Train the reward model every this many steps (0: never; it stays frozen)."""
    steps: int = 10
    """Optimizer steps per update."""
    labels: str = ""
    """The label source: 'task' (the task's own verifier, task=successor), a registered rule (math, format)
    or a dotted path `pkg.mod:fn(response, ground_truth, sample) -> float in [0, 1]`."""
    replay_fraction: float = 0.1
    """Share of each update's training samples drawn from the replay buffer of earlier data, in [0, 1)."""
    buffer_size: int = 2048
    """Replay buffer capacity (samples); reservoir sampling keeps a uniform sample of all seen."""
    batch_size: int = 32
    """Samples per optimizer step."""
    lr: float = 1e-4
    """AdamW learning rate."""
    heldout_fraction: float = 0.25
    """Share of the labelled samples kept out of training to measure rm/accuracy, in [0, 1)."""
    seed: int = 0
    """Seeds the held-out split, the replay draws and the mini-batch order."""

    def __post_init__(self):
        if self.interval < 0:
            raise ValueError(f"reward.rm_train.interval={self.interval} must be >= 0 (0: the reward model stays frozen)")
        if not 0 <= self.replay_fraction < 1:
            raise ValueError(f"reward.rm_train.replay_fraction={self.replay_fraction} must be in [0, 1) "
                             "(the share of replayed samples; 1 would never train on new ones)")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"reward.rm_train.heldout_fraction={self.heldout_fraction} must be in [0, 1)")
        for name in ("steps", "buffer_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"reward.rm_train.{name}={getattr(self, name)} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"reward.rm_train.lr={self.lr} must be > 0")
        if self.interval and not self.labels:
            raise ValueError("reward.rm_train.interval > 0 needs reward.rm_train.labels (a rule such as math, "
                             "'task' for the task's own verifier, or a dotted path)")


@dataclass(kw_only=True)
class RewardConfig:
    """The reward (task=prompts): a registered name (math, format, mix, reward_model) or a dotted path.
    Rule rewards run in a process pool, each sample on one rank (grpo_mega/rewards/scoring.py)."""

    name: str = "math"
    """A registered reward (math, format, mix, reward_model) or a dotted path `pkg.mod:fn`."""
    on_error: str = "zero"
    """'zero': score a failing or timed-out sample 0 and report it; 'raise': stop."""
    weights: dict = field(default_factory=dict)
    """For name=mix: {reward name: weight}."""
    path: str = ""
    """For name=reward_model: an HF sequence-classification checkpoint (scored in batches on rank 0)."""
    device: str = ""
    """For name=reward_model: where it runs ('cuda:1', 'cpu'); '': the trainer's device (bf16 on GPUs)."""
    rm_batch_size: int = 64
    """For name=reward_model: samples per forward."""
    rm_train: RMTrainConfig = field(default_factory=RMTrainConfig)
    """For name=reward_model: keep training it on the policy's labelled samples (iterative RL)."""
    val_reward: str = ""
    """What scores validation: '' the training reward; 'task' the task's own verifier (task=successor); or a
    rule / dotted path. With a learned reward model, a rule judges the policy rather than the model."""
    overlong: str = "keep"
    """A response cut at batch.max_response_length: 'keep' its reward, 'zero' it, or 'mask' it out of the loss."""
    overlong_buffer_len: Optional[int] = None
    """DAPO's soft overlong punishment (verl's reward.overlong_buffer.len): a response longer than
    batch.max_response_length - overlong_buffer_len gets a penalty growing linearly to -overlong_penalty_factor at
    max_response_length, added to the score the advantages come from; null: off."""
    overlong_penalty_factor: float = 1.0
    """The soft overlong penalty at max_response_length (verl's reward.overlong_buffer.penalty_factor)."""
    num_workers: Optional[int] = None
    """Reward worker processes per rank; null: the node's cores divided among its ranks (at least 1)."""
    timeout_s: float = 30.0
    """Per-sample time limit: a sample still being scored is cut (its worker killed) and handled by on_error."""
    start_method: str = "forkserver"
    """How workers start: 'forkserver' (forked from a clean server, never from a rank's gloo/NCCL threads),
    'spawn', or 'fork'."""
    max_memory_mb: Optional[int] = None
    """Each worker's memory cap in MiB beyond its start size (RLIMIT_AS): a sample over it fails alone; 0/null: none."""
    max_error_fraction: float = 0.5
    """With on_error=zero: when more than this share of the samples scored over the last `error_window` steps
    failed (raised, returned a non-number or a non-finite one, timed out; a reward model's non-finite score),
    the run stops with an error before training on them, after a checkpoint of the step before (with
    checkpoint.dir). 1: never stop; 0: stop at the first failure."""
    error_window: int = 10
    """The steps max_error_fraction is measured over (fewer at the start: step 1 alone is a window)."""

    def __post_init__(self):
        if self.overlong_buffer_len is not None and self.overlong_buffer_len < 1:
            raise ValueError(f"reward.overlong_buffer_len={self.overlong_buffer_len} must be >= 1 tokens (null: off)")
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"reward.overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0")
        if self.max_memory_mb is not None and self.max_memory_mb < 0:
            raise ValueError(f"reward.max_memory_mb={self.max_memory_mb} must be >= 0 (0 or null: no limit)")
        if not 0 <= self.max_error_fraction <= 1:
            raise ValueError(f"reward.max_error_fraction={self.max_error_fraction} must be in [0, 1] (1: never stop)")
        if not isinstance(self.error_window, int) or self.error_window < 1:
            raise ValueError(f"reward.error_window={self.error_window} must be >= 1 (steps)")
        if self.overlong not in ("keep", "zero", "mask"):
            raise ValueError(f"reward.overlong={self.overlong!r} must be 'keep', 'zero' or 'mask'")
        if self.on_error not in ("zero", "raise"):
            raise ValueError(f"reward.on_error={self.on_error!r} must be 'zero' or 'raise'")
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers} must be >= 1 (or null: cores per rank)")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0")
        if self.start_method not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"reward.start_method={self.start_method!r} must be 'forkserver', 'spawn' or 'fork'")
        if isinstance(self.rm_train, dict):
            self.rm_train = RMTrainConfig(**self.rm_train)
        if self.rm_train.interval and self.name != "reward_model":
            raise ValueError(f"reward.rm_train.interval={self.rm_train.interval} trains a learned reward model: it "
                             f"needs reward.name=reward_model (got {self.name!r})")
        if self.rm_batch_size < 1:
            raise ValueError(f"reward.rm_batch_size={self.rm_batch_size} must be >= 1")


@dataclass(kw_only=True)
class DistConfig:
    """torch.distributed and hang detection."""

    timeout_s: float = 1800.0
    """The world's and megatron's process groups: the longest any rank waits in one collective (a rank 0 that
    generates, scores or saves while the others wait counts against it)."""
    watchdog_factor: float = 10.0
    """Dump every thread's stack (faulthandler, into the run directory's stacks-rank<R>.txt) when a step runs
    longer than this many times the median step so far (at least watchdog_min_s); 0: no watchdog."""
    watchdog_min_s: float = 300.0
    """The watchdog never fires before a step has run this long."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"dist.timeout_s={self.timeout_s} must be > 0")
        if self.watchdog_factor != 0 and self.watchdog_factor <= 1:
            raise ValueError(f"dist.watchdog_factor={self.watchdog_factor} must be > 1 (or 0: off)")
        if not self.watchdog_min_s > 0:
            raise ValueError(f"dist.watchdog_min_s={self.watchdog_min_s} must be > 0")


@dataclass(kw_only=True)
class TrainConfig:
    """The whole run, composed by Hydra (grpo_mega/conf/config.yaml, the task's grpo_mega/conf/task/<task>.yaml,
    then command-line overrides): every field of
    every component is overridable (`algo.entropy_coef=0.01`). Each component checks its own fields; the
    checks that need two of them run here, before any model is built."""

    model: str = "tiny"
    """A model_configs/ name (random init), or an HF directory (weights and tokenizer loaded from it)."""
    task: str = "successor"
    """'successor' (the toy demo), 'product_tool' (the toy tool task: 2-digit products, solvable with
    rollout.multi_turn's calculator), 'tens_tool' (the tens digit of such a product), 'lookup_tool' (the letter
    stored under a key, which only the tool knows; grpo_mega.data.toy_tools), 'lookup_call' (its warm-up: a
    shaping reward for calling the tool, not a measure) or 'prompts' (data.* files scored by reward.*). On the command
    line `task=` also picks the task's settings, grpo_mega/conf/task/<task>.yaml: the toy tasks run with the demo's
    (successor.yaml), task=prompts with these defaults."""
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        for f in fields(self):  # plain dicts (a checkpoint's saved config) become their dataclasses
            kind = _COMPONENTS.get(f.name)
            if kind is not None and isinstance(getattr(self, f.name), dict):
                setattr(self, f.name, kind(**getattr(self, f.name)))
        if self.task not in ("successor", "product_tool", "tens_tool", "lookup_tool", "lookup_call", "prompts"):
            raise ValueError(f"task={self.task!r} must be 'successor', 'product_tool', 'tens_tool', 'lookup_tool', "
                             "'lookup_call' or 'prompts'")
        if self.task == "prompts" and not self.data.train_files:
            raise ValueError("task=prompts needs data.train_files=PATH (.jsonl or .parquet in verl's schema)")
        self.batch.check_packing(self.parallel)
        buffer = self.reward.overlong_buffer_len
        if buffer is not None and buffer > self.batch.max_response_length:
            raise ValueError(f"reward.overlong_buffer_len={self.reward.overlong_buffer_len} must be <= "
                             f"batch.max_response_length={self.batch.max_response_length} (the buffer is its last "
                             f"tokens)")
        if self.reward.rm_train.interval and self.algo.ref_update_interval is None:
            # Iterative RL (Algorithm 1): the reference follows the reward model's updates.
            self.algo.ref_update_interval = self.reward.rm_train.interval
        if self.algo.dynamic_sampling == "refill" and self.reward.rm_train.interval:
            raise ValueError(f"algo.dynamic_sampling=refill with reward.rm_train.interval={self.reward.rm_train.interval}: "
                             "refill scores a step in several rounds and the reward model would train on each; "
                             "use algo.dynamic_sampling=filter, or reward.rm_train.interval=0")
        if self.rollout.mode == "async":
            self.check_async()
        if self.lora.enabled:
            self.check_lora()
        if self.rollout.off_policy_steps and self.algo.correction() is None:
            # One step behind: truncated importance correction against the engine's logprobs covers the lag.
            self.algo.engine_is_cap = OFF_POLICY_IS_CAP

    def check_async(self) -> None:
        """What rollout.mode=async does not do yet, each refused in one line."""
        why = None
        if self.algo.dynamic_sampling == "refill":
            why = ("algo.dynamic_sampling=refill (extra rounds of one step's prompts) has no meaning with a continuous "
                   "stream of groups; use algo.dynamic_sampling=filter")
        elif self.rollout.multi_turn.enable:
            why = "rollout.multi_turn.enable=true: multi-turn trajectories are not generated in segments yet"
        elif self.algo.routing_replay != "none":
            why = f"algo.routing_replay={self.algo.routing_replay}: the routes of continued responses are not joined yet"
        elif self.checkpoint.dir:
            why = ("checkpoint.dir: resuming a fully asynchronous run (its groups in flight) is not built yet "
                   "(issue 39, Build 5); run without checkpoint.dir, or with rollout.mode=sync")
        if why is not None:
            raise ValueError(f"rollout.mode=async with {why}")

    def check_layout(self, model: ModelConfig, world_size: int) -> int:
        """The layout against the model and the launched world: returns dp, or a ValueError naming the field."""
        if model.is_moe and self.parallel.tp > 1 and not self.parallel.sequence_parallel:
            raise ValueError(f"parallel.tp={self.parallel.tp} with an MoE model needs parallel.sequence_parallel=true "
                             "(megatron-core's MoE layer refuses tensor parallelism without it in training)")
        self.check_routing_replay(model)
        dp = self.parallel.check(model, world_size)
        self.batch.check_layout(self.parallel, dp, self.rollout.n)
        if world_size % self.rollout.num_engines:
            raise ValueError(f"rollout.num_engines={self.rollout.num_engines} must divide the number of ranks "
                             f"({world_size}): the engines sit on evenly spaced ranks (one per node)")
        if (self.rollout.audit_weights and self.rollout.engine == "sglang" and self.rollout.placement == "colocated"
                and model.family not in SGLANG_READS_BACK):
            raise ValueError(f"rollout.audit_weights=true reads every tensor back with SGLang's get_weights_by_name, "
                             f"which SGLang implements for {', '.join(SGLANG_READS_BACK)} models, not "
                             f"model.family={model.family!r}: set rollout.audit_weights=false (the engine/trainer "
                             "logprob mismatch metric still checks the weights) or use rollout.engine=embedded")
        return dp

    def check_lora(self) -> None:
        """What LoRA cannot be combined with yet: a ValueError naming the setting."""
        r = self.lora.rank
        if self.checkpoint.dir:
            raise ValueError(f"lora.rank={r} with checkpoint.dir={self.checkpoint.dir!r}: LoRA checkpoints (adapters and "
                             "their optimizer state) are not written yet and a base checkpoint would drop the adapters; "
                             "unset checkpoint.dir or set lora.rank=null")
        if self.algo.ref_update_interval:
            raise ValueError(f"lora.rank={r} with algo.ref_update_interval={self.algo.ref_update_interval}: under LoRA the "
                             "reference is the frozen base (the actor with adapters off) and cannot follow the policy; "
                             "set algo.ref_update_interval=null or lora.rank=null")

    def check_routing_replay(self, model: ModelConfig) -> None:
        """algo.routing_replay=rollout or measure against the model and the engines: a ValueError naming what
        refuses it (both need the engine's routes; measure counts in every router call, as replay routes)."""
        if self.algo.routing_replay == "none":
            return
        mode = self.algo.routing_replay
        if not model.is_moe:
            raise ValueError(f"algo.routing_replay={mode} needs an MoE model; model {model.name} is "
                             f"dense (family {model.family!r}, no num_experts): set algo.routing_replay=none")
        if self.rollout.engine != "embedded" and self.rollout.placement == "colocated":
            raise ValueError(f"algo.routing_replay={mode} with the colocated rollout.engine={self.rollout.engine}: its "
                             "routed experts are not read yet (SGLang 0.5.23 returns them to dedicated servers' clients, "
                             "rollout.placement=dedicated, started with --enable-return-routed-experts); use "
                             "rollout.engine=embedded or rollout.placement=dedicated")
        if self.rollout.multi_turn.enable:
            raise ValueError(f"algo.routing_replay={mode} with rollout.multi_turn.enable=true: tool turns are not "
                             "recorded yet; set algo.routing_replay=none")
        if self.parallel.recompute == "full":
            raise ValueError(f"algo.routing_replay={mode} with parallel.recompute=full: a recomputed layer would route "
                             "again with another micro-batch's experts (and be counted again); use "
                             "parallel.recompute=selective or none")

    @classmethod
    def from_hydra(cls, cfg) -> "TrainConfig":
        """The typed config from Hydra's composed DictConfig (each component validating itself)."""
        from omegaconf import OmegaConf

        c = OmegaConf.to_container(cfg, resolve=True)
        c.pop("hydra", None)
        return cls(**c)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def on_policy(self) -> bool:
        """The update is exactly on-policy: the old-logprob pass is skipped (algo.recompute_old_logprobs)."""
        a = self.algo
        return (a.ppo_epochs == 1 and self.batch.mini_batches_per_step == 1 and not self.rollout.off_policy_steps
                and not a.kl_in_reward and not a.recompute_old_logprobs)

    def shaping(self):
        """The settings of the per-step shaping (grpo_mega.algo.shaping), as plain values."""
        from grpo_mega.algo.shaping import StepShaping

        a = self.algo
        return StepShaping(n=self.rollout.n, overlong=self.reward.overlong, kl_in_reward=a.kl_in_reward,
                           overlong_buffer_len=self.reward.overlong_buffer_len,
                           overlong_penalty_factor=self.reward.overlong_penalty_factor,
                           max_response_length=self.batch.max_response_length,
                           kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, adv_estimator=a.adv_estimator,
                           norm_adv_by_std=a.norm_adv_by_std,
                           global_adv_norm=a.global_adv_norm, dynamic_sampling=bool(a.dynamic_sampling))


OFF_POLICY_IS_CAP = 2.0
"""algo.engine_is_cap when rollout.off_policy_steps=1 and none is set (verl's TIS default)."""

_COMPONENTS = {"data": DataConfig, "reward": RewardConfig, "parallel": ParallelConfig, "precision": PrecisionConfig,
               "optim": OptimConfig, "algo": AlgoConfig, "batch": BatchConfig, "rollout": RolloutConfig,
               "run": RunConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "dist": DistConfig,
               "lora": LoraConfig}

RENAMED = {"batch.n": "rollout.n", "seed": "run.seed"}
"""Settings that had two names: the old one is refused, naming the new."""


def check_renamed(overrides: list[str]) -> None:
    """A ValueError for a command-line override that uses a setting's old name."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in RENAMED:
            raise ValueError(f"{key} is now {RENAMED[key]}: write {RENAMED[key]}={o.split('=', 1)[1] if '=' in o else '...'}")


def register_schema() -> None:
    """TrainConfig in Hydra's ConfigStore as `train_schema`, the schema grpo_mega/conf/config.yaml composes against:
    whoever composes the config (the entry point, the planner, the SGLang launcher, tests) calls this, so none of
    them imports the entry point for it. Idempotent."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
