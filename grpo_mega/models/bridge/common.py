"""The HF <-> Megatron bridge for Llama-style decoders (Llama, Qwen2, Qwen3 dense): names, fused layouts, TP split/merge.

Owns the whole correspondence between an HF checkpoint and megatron-core's GPTModel:
  - names: `model.layers.{i}.self_attn.q_proj.weight` <-> `decoder.layers.{i}.self_attention.linear_qkv.weight`
    and the rest (the TE spec's fused-norm names are accepted as aliases of the local spec's);
  - megatron's fused QKV: rows grouped by query group, [q heads of group g | k_g | v_g] for each g, so a
    TP rank's contiguous rows are whole groups;
  - SwiGLU's fused first linear: full [gate; up], but each TP rank holds [gate_r; up_r], its own halves;
  - Qwen3's per-head q/k RMSNorm: `self_attn.q_norm.weight` <-> `self_attention.q_layernorm.weight` ([kv_channels],
    shared by every head, so replicated over TP);
  - vocabulary padding: embedding / output rows past the real vocabulary are zero;
  - TP split (for loading a shard straight from safetensors, reading only its rows or columns) and TP merge
    (for gathering a trained shard back to the full tensor).
Global names carry the global layer index; a pipeline stage maps its local index j to offset + j.
Family modules (llama.py, qwen2.py, qwen3.py) add the config.json mapping. Weights are read only from safetensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo_mega.conf.model import ModelConfig, RopeScaling

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# an expert's weight, SequentialMLP (local spec) and TEGroupedMLP (weight{j}) spellings; j is the expert index
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")

# megatron layer-local name -> canonical name (the TE spec fuses the norms into the next linear)
_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

# canonical layer-local megatron name -> (HF layer-local names, kind)
_LAYER_MAP = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
    "mlp.router.weight": (("mlp.gate.weight",), "replicated"),  # Qwen3-MoE: [num_experts, hidden], no bias
}
# expert j's megatron tensor -> (HF names with {j}, kind): the same SwiGLU layout as the dense MLP
_EXPERT_MAP = {
    "linear_fc1": (("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"), "gate_up"),
    "linear_fc2": (("mlp.experts.{j}.down_proj.weight",), "row"),
}
_GLOBAL_MAP = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "vocab"),
    "decoder.final_layernorm.weight": (("model.norm.weight",), "replicated"),
    "output_layer.weight": (("lm_head.weight",), "vocab"),
}


@dataclass(frozen=True)
class Spec:
    """How one megatron tensor relates to HF tensors."""

    hf_names: tuple[str, ...]
    kind: str  # replicated | qkv | gate_up | row | vocab


def canonical(name: str) -> str:
    m = _LAYER.match(name)
    if m:
        local = _ALIASES.get(m.group(2), m.group(2))
        g = _GROUPED_EXPERT.match(local)
        if g:
            local = f"mlp.experts.local_experts.{g.group(2)}.{g.group(1)}.weight"
        return f"decoder.layers.{m.group(1)}.{local}"
    return name


def expert_of(name: str) -> Optional[int]:
    """The expert index in a (canonical or TE grouped) megatron layer name; None for non-expert tensors."""
    m = _LAYER.match(canonical(name))
    e = _EXPERT.match(m.group(2)) if m else None
    return int(e.group(1)) if e else None


def spec_for(name: str, cfg: ModelConfig) -> Optional[Spec]:
    """The Spec of a global megatron parameter name; None for names with no HF counterpart (the tied
    output layer's copy on the last pipeline stage, TE's _extra_state)."""
    if name.endswith("_extra_state"):
        return None
    name = canonical(name)
    m = _LAYER.match(name)
    if m:
        e = _EXPERT.match(m.group(2))
        if e:
            hf, kind = _EXPERT_MAP[e.group(2)]
            return Spec(tuple(f"model.layers.{m.group(1)}.{h.format(j=e.group(1))}" for h in hf), kind)
        entry = _LAYER_MAP.get(m.group(2))
        if entry is None:
            raise KeyError(f"no HF counterpart known for megatron parameter {name!r}")
        hf, kind = entry
        return Spec(tuple(f"model.layers.{m.group(1)}.{h}" for h in hf), kind)
    if name == "output_layer.weight" and cfg.tie_word_embeddings:
        return None
    if name not in _GLOBAL_MAP:
        raise KeyError(f"no HF counterpart known for megatron parameter {name!r}")
    hf, kind = _GLOBAL_MAP[name]
    return Spec(hf, kind)


def hf_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name an HF checkpoint of this architecture holds, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for i, moe in enumerate(cfg.moe_layers()):
        for key, (hf, _) in _LAYER_MAP.items():
            if key.endswith(".bias") and not cfg.qkv_bias:
                continue
            if "_layernorm.weight" in key and key.startswith("self_attention.") and not cfg.qk_layernorm:
                continue
            if key.startswith("mlp.") and (key == "mlp.router.weight") != moe:
                continue
            names += [f"model.layers.{i}.{h}" for h in hf]
            if key == "mlp.router.weight":
                names += [f"model.layers.{i}.{h.format(j=j)}" for j in range(cfg.num_experts)
                          for hf_, _ in _EXPERT_MAP.values() for h in hf_]
    names.append("model.norm.weight")
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def global_name(local: str, layer_offset: int, expert_offset: int = 0) -> str:
    """A pipeline stage's local parameter name -> the global one (decoder.layers.{offset + j}...); an expert
    parallel rank's local expert j -> expert {expert_offset + j} (in the canonical SequentialMLP spelling)."""
    m = _LAYER.match(local)
    if not m:
        return local
    rest = m.group(2)
    g = _GROUPED_EXPERT.match(rest)
    if g:
        rest = f"mlp.experts.local_experts.{g.group(2)}.{g.group(1)}.weight"
    e = _EXPERT.match(rest)
    if e:
        rest = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}.weight"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"


def expert_offset(gpt, cfg: ModelConfig) -> int:
    """Global index of this expert-parallel rank's first expert (0 for a dense model)."""
    if not cfg.is_moe:
        return 0
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * (cfg.num_experts // ep)


def layer_offset(gpt) -> int:
    """Global index of this stage's first layer."""
    layers = gpt.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


# ---- full tensors: megatron (TP-merged) <-> HF --------------------------------------------------------


def to_hf(name: str, full: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A full (TP-merged) megatron tensor under its global name -> [(HF name, tensor)] (views, no copies)."""
    spec = spec_for(name, cfg)
    if spec is None:
        return []
    if spec.kind == "replicated" or spec.kind == "row":
        return [(spec.hf_names[0], full)]
    if spec.kind == "vocab":
        return [(spec.hf_names[0], full[: cfg.vocab_size])]
    if spec.kind == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return list(zip(spec.hf_names, (gate, up)))
    # qkv: [groups, (heads per group + 2) * d, ...]
    g, d, hpg = cfg.num_query_groups, cfg.kv_channels, cfg.num_attention_heads // cfg.num_query_groups
    grouped = full.view(g, (hpg + 2) * d, *full.shape[1:])
    q, k, v = grouped.split([hpg * d, d, d], dim=1)
    rest = full.shape[1:]
    return list(zip(spec.hf_names, (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))))


def from_hf(name: str, hf: dict[str, torch.Tensor], cfg: ModelConfig) -> Optional[torch.Tensor]:
    """HF tensors -> the full megatron tensor `name` (TP1 layout, vocabulary padded)."""
    return shard_from_hf(name, lambda n: hf[n], cfg, tp_rank=0, tp=1)


# ---- shards: TP split and merge -----------------------------------------------------------------------


def _rows(src, lo: int, hi: int) -> torch.Tensor:
    return src[lo:hi]


def shard_from_hf(name: str, open_hf: Callable[[str], object], cfg: ModelConfig, tp_rank: int, tp: int) -> Optional[torch.Tensor]:
    """This TP rank's shard of megatron tensor `name`, reading only the rows/columns it needs.

    open_hf(hf_name) returns something sliceable like a tensor (a safetensors slice or a tensor).
    Returns None for names with no HF counterpart.
    """
    spec = spec_for(name, cfg)
    if spec is None:
        return None
    if spec.kind == "replicated":
        return _rows(open_hf(spec.hf_names[0]), 0, None)
    if spec.kind == "row":
        src = open_hf(spec.hf_names[0])
        cols = _shape(src)[1]
        per = cols // tp
        return src[:, tp_rank * per : (tp_rank + 1) * per]
    if spec.kind == "vocab":
        src = open_hf(spec.hf_names[0])
        per = cfg.padded_vocab_size // tp
        lo, hi = tp_rank * per, (tp_rank + 1) * per
        real = src[lo : min(hi, cfg.vocab_size)] if lo < cfg.vocab_size else None
        width = _shape(src)[1]
        dtype = real.dtype if real is not None else _dtype(src)
        out = torch.zeros(per, width, dtype=dtype)
        if real is not None:
            out[: real.shape[0]] = real
        return out
    if spec.kind == "gate_up":  # the dense MLP (ffn_hidden_size) or an expert (moe_ffn_hidden_size)
        srcs = [open_hf(n) for n in spec.hf_names]
        per = _shape(srcs[0])[0] // tp
        return torch.cat([src[tp_rank * per : (tp_rank + 1) * per] for src in srcs], dim=0)
    # qkv: this rank holds query groups [g0, g1), each as [q heads | k | v]
    g, d, hpg = cfg.num_query_groups, cfg.kv_channels, cfg.num_attention_heads // cfg.num_query_groups
    per = g // tp
    q_src, k_src, v_src = (open_hf(n) for n in spec.hf_names)
    parts = []
    for grp in range(tp_rank * per, (tp_rank + 1) * per):
        parts += [q_src[grp * hpg * d : (grp + 1) * hpg * d], k_src[grp * d : (grp + 1) * d], v_src[grp * d : (grp + 1) * d]]
    return torch.cat(parts, dim=0)


def merge_tp(name: str, shards: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """TP shards (in TP-rank order) of megatron tensor `name` -> the full TP1 tensor."""
    spec = spec_for(name, cfg)
    kind = spec.kind if spec is not None else "vocab"
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0)  # qkv (whole groups per rank) and vocab rows


def split_tp(name: str, full: torch.Tensor, cfg: ModelConfig, tp: int) -> list[torch.Tensor]:
    """The inverse of merge_tp."""
    spec = spec_for(name, cfg)
    kind = spec.kind if spec is not None else "vocab"
    if kind == "replicated":
        return [full] * tp
    if kind == "row":
        return list(full.chunk(tp, dim=1))
    if kind == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return [torch.cat([g_, u_], dim=0) for g_, u_ in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]
    return list(full.chunk(tp, dim=0))


def _shape(src) -> tuple:
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)


def _dtype(src) -> torch.dtype:
    return src.get_dtype() if hasattr(src, "get_dtype") else src.dtype


# ---- config.json --------------------------------------------------------------------------------------


class DecoderFamily:
    """config.json <-> ModelConfig for one family. Subclasses set the names and the family's quirks."""

    family = "llama"
    model_type = "llama"
    architectures = ("LlamaForCausalLM",)
    qk_layernorm = False  # q_norm/k_norm on every layer (Qwen3)

    def model_config(self, hf: dict, name: str = "hf") -> ModelConfig:
        heads = hf["num_attention_heads"]
        # transformers 5 writes `rope_parameters` {rope_theta, rope_type, ...}; 4.x `rope_theta` + `rope_scaling`.
        params = dict(hf.get("rope_parameters") or {})
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope = dict(hf.get("rope_scaling") or params)
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        if kind == "default":
            rope = None
        elif kind == "llama3":
            rope = RopeScaling(type="llama3", **{k: v for k, v in rope.items() if k in RopeScaling.__dataclass_fields__})
        else:
            raise ValueError(f"{name}: RoPE type {kind!r} is not supported; megatron-core implements default and llama3")
        return ModelConfig(
            name=name,
            family=self.family,
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads", heads),
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_theta=float(theta),
            rope_scaling=rope,
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            qkv_bias=self._qkv_bias(hf),
            qk_layernorm=self.qk_layernorm,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **self._extra_model_fields(hf, name),
        )

    def _extra_model_fields(self, hf: dict, name: str) -> dict:
        return {}

    def _qkv_bias(self, hf: dict) -> bool:
        return bool(hf.get("attention_bias", False))

    def hf_config(self, cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
        out = dict(
            architectures=list(self.architectures),
            model_type=self.model_type,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.ffn_hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_query_groups,
            head_dim=cfg.kv_channels,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.norm_epsilon,
            tie_word_embeddings=cfg.tie_word_embeddings,
            hidden_act="silu",
            dtype=dtype,  # transformers 5 reads `dtype`, 4.x `torch_dtype`: both, always equal
            torch_dtype=dtype,
        )
        # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta/rope_scaling.
        rope = dict(rope_theta=cfg.rope_theta, rope_type="default")
        if cfg.rope_scaling is not None:
            r = cfg.rope_scaling
            scaling = dict(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                           high_freq_factor=r.high_freq_factor,
                           original_max_position_embeddings=r.original_max_position_embeddings)
            out["rope_scaling"] = scaling
            rope.update(scaling)
        out["rope_parameters"] = rope
        return self._extra_hf_config(cfg, out)

    def _extra_hf_config(self, cfg: ModelConfig, out: dict) -> dict:
        out["attention_bias"] = cfg.qkv_bias
        out["mlp_bias"] = False
        return out
