"""Llama (Llama-3.x, SmolLM2): config.json mapping. The tensor mapping is common.py's."""

from grpo_mega.models.bridge.common import DecoderFamily


class Llama(DecoderFamily):
    family = "llama"
    model_type = "llama"
    architectures = ("LlamaForCausalLM",)
