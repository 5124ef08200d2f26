"""Tiny random HF checkpoints made with transformers itself (nothing downloaded), and the prepared SmolLM2
(`smollm2_dir`, grpo_mega.cli.prepare_model's `prepared_dir`)."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_mega.cli.prepare_model import prepared_dir as smollm2_dir  # noqa: F401 - the prepared SmolLM2 directory


def tiny_hf(path: Path, family: str, dtype=torch.bfloat16, tied: bool = False, seed: int = 0,
            mlp_only_layers: tuple = (2,)) -> Path:
    """A 4-layer, 8-head, 4-KV-group random model saved with save_pretrained (safetensors). Qwen3's has a
    head_dim of 32, not hidden_size / heads (8), and random q/k norms. Qwen3-MoE's `mlp_only_layers` are dense
    (SGLang 0.5.23's Qwen3MoeForCausalLM ignores them and makes every layer sparse: () for SGLang)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tied,
              rope_theta=10000.0, initializer_range=0.15)
    cfg, cls = {
        "llama": lambda: (LlamaConfig(**kw), LlamaForCausalLM),
        "qwen2": lambda: (Qwen2Config(**kw), Qwen2ForCausalLM),
        "qwen3": lambda: (Qwen3Config(head_dim=32, **kw), Qwen3ForCausalLM),
        # 8 experts, top-2, renormalised top-k (as Qwen3-30B-A3B), layer 2 dense: both MLP kinds
        "qwen3_moe": lambda: (Qwen3MoeConfig(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, mlp_only_layers=list(mlp_only_layers), **kw), Qwen3MoeForCausalLM),
    }[family]()
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():  # make the norms and biases non-trivial so a swapped tensor would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p.float()).to(dtype) if "norm" in name else 0.1 * torch.randn_like(p.float()).to(dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path
