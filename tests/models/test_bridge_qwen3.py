"""Qwen3's config.json mapping: a published config.json reads as its model_configs YAML, our config.json
builds transformers' Qwen3ForCausalLM with the same tensors the bridge names, and the variants this
bridge cannot represent are refused by name."""

import dataclasses

import pytest
import torch

from grpo_mega.conf import load_model_config
from grpo_mega.models import bridge

# Qwen/Qwen3-0.6B config.json as published (transformers 4.51 spelling: rope_theta, rope_scaling null).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_published_config_reads_as_the_yaml():
    got = bridge.family_of_hf(QWEN3_0_6B).model_config(QWEN3_0_6B, name="qwen3-0.6b")
    assert got == load_model_config("qwen3-0.6b")


@pytest.mark.parametrize("tied", [False, True])
def test_our_config_json_builds_the_same_tensors_in_transformers(tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dataclasses.replace(load_model_config("tiny-qwen3"), tie_word_embeddings=tied)
    hf = bridge.FAMILIES.get("qwen3").hf_config(cfg, dtype="float32")
    config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    state = model.state_dict()
    if tied:
        state.pop("lm_head.weight")  # the tied view of the embedding; not in a tied checkpoint
    assert sorted(state) == sorted(bridge.hf_names(cfg))
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)  # head_dim 32, not 64 / 4
    assert bridge.family_of_hf(hf | {"model_type": "qwen3"}).model_config(hf, name=cfg.name) == cfg


@pytest.mark.parametrize("key,match", [("attention_bias", "o_proj bias"), ("use_sliding_window", "whole sequence")])
def test_unsupported_variants_are_refused(key, match):
    with pytest.raises(ValueError, match=match):
        bridge.FAMILIES.get("qwen3").model_config(QWEN3_0_6B | {key: True})


def test_norm_names_map_both_ways():
    cfg = load_model_config("tiny-qwen3")
    spec = bridge.spec_for("decoder.layers.1.self_attention.k_layernorm.weight", cfg)
    assert spec.hf_names == ("model.layers.1.self_attn.k_norm.weight",) and spec.kind == "replicated"
    w = torch.randn(32)
    assert bridge.to_hf("decoder.layers.1.self_attention.q_layernorm.weight", w, cfg) == [
        ("model.layers.1.self_attn.q_norm.weight", w)]
    assert "model.layers.0.self_attn.q_norm.weight" not in bridge.hf_names(load_model_config("tiny"))
