"""Qwen2 / Qwen2.5: config.json mapping. Qwen2 always has q/k/v biases and no attention_bias field."""

from grpo_mega.models.bridge.common import DecoderFamily


class Qwen2(DecoderFamily):
    family = "qwen2"
    model_type = "qwen2"
    architectures = ("Qwen2ForCausalLM",)

    def _qkv_bias(self, hf: dict) -> bool:
        return True

    def _extra_hf_config(self, cfg, out: dict) -> dict:
        if not cfg.qkv_bias:
            raise ValueError(f"model {cfg.name}: a Qwen2 checkpoint always has q/k/v biases (model.qkv_bias=false)")
        out["use_sliding_window"] = False
        return out
