"""Qwen3 (dense): config.json mapping. The tensor mapping is common.py's, with the per-head q/k norms.

Qwen3 differs from Qwen2 by RMSNorm on each query and key head (q_norm/k_norm, always present), a head_dim
that need not be hidden_size / num_attention_heads, and no q/k/v biases. Qwen3-MoE is a different family.
"""

from grpo_mega.models.bridge.common import DecoderFamily


class Qwen3(DecoderFamily):
    family = "qwen3"
    model_type = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    qk_layernorm = True

    def _qkv_bias(self, hf: dict) -> bool:
        if hf.get("attention_bias", False):
            raise ValueError("Qwen3 with attention_bias=true is not supported: its o_proj bias has no counterpart "
                             "here (every published Qwen3 has attention_bias=false)")
        if hf.get("use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=true is not supported: megatron-core's local spec "
                             "attends over the whole sequence (every published Qwen3 has use_sliding_window=false)")
        return False

    def _extra_hf_config(self, cfg, out: dict) -> dict:
        if cfg.qkv_bias:
            raise ValueError(f"model {cfg.name}: Qwen3 has no q/k/v biases (model.qkv_bias=true)")
        out["attention_bias"] = False
        out["use_sliding_window"] = False
        return out
