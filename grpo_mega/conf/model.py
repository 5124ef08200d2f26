"""The model's architecture (ModelConfig: a model_configs/ YAML or an HF config.json) and its shape arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from grpo_mega.conf.rules import positive


MODEL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "model_configs"


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
            positive(f"model.{f}", getattr(self, f))
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
            positive(f"model.{k}", getattr(self, k))
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
