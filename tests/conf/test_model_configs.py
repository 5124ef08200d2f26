"""Every model YAML describes its published model: parameter count from the YAML alone, checked against
transformers' own modelling code (built on the meta device from the same fields) and the published figure."""

import pytest
import torch

from grpo_mega.conf import load_model_config
from grpo_mega.conf.schema import MODEL_CONFIG_DIR

# name -> (published parameter count, one unit of its last published digit)
PUBLISHED = {
    "smollm2-135m": (134.5e6, 0.1e6),  # as loaded here from the GGUF release: 134,515,008
    "qwen2.5-0.5b": (0.49e9, 0.01e9),
    "qwen2.5-1.5b": (1.54e9, 0.01e9),
    "qwen2.5-7b": (7.61e9, 0.01e9),
    # The card says 32.5B; the architecture it describes has 32.76B (transformers counts the same, and the
    # hub's safetensors metadata says 32.8B): the card is off by 0.26B, so this one is held to 1%.
    "qwen2.5-32b": (32.5e9, 0.33e9),
    "qwen2.5-72b": (72.7e9, 0.1e9),
    "llama-3.1-8b": (8.03e9, 0.01e9),
    "llama-3.1-70b": (70.6e9, 0.1e9),
    "llama-3.3-70b": (70.6e9, 0.1e9),
}


def _hf_count(cfg) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, tie_word_embeddings=cfg.tie_word_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
    )
    if cfg.family == "qwen2":
        hf_cfg, cls = Qwen2Config(**kw), Qwen2ForCausalLM
    else:
        hf_cfg, cls = LlamaConfig(attention_bias=cfg.qkv_bias, head_dim=cfg.kv_channels, **kw), LlamaForCausalLM
    with torch.device("meta"):
        model = cls(hf_cfg)
    return sum(p.numel() for p in model.parameters())


def test_every_yaml_is_covered():
    assert {p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml")} == set(PUBLISHED) | {"tiny"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count(name):
    cfg = load_model_config(name)
    n = cfg.num_parameters()
    assert n == _hf_count(cfg)
    published, unit = PUBLISHED[name]
    assert abs(n - published) <= unit, f"{name}: {n / 1e9:.4f}B vs published {published / 1e9}B"


def test_exact_known_counts():
    assert load_model_config("smollm2-135m").num_parameters() == 134_515_008
    assert load_model_config("llama-3.1-8b").num_parameters() == 8_030_261_248
    assert load_model_config("qwen2.5-0.5b").num_parameters() == 494_032_768


def test_vocabulary_padding_is_fixed_by_the_model():
    assert load_model_config("tiny").padded_vocab_size == 384
    assert load_model_config("qwen2.5-7b").padded_vocab_size == 152064


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'qwen9'.*known models: .*llama-3.1-8b.*tiny"):
        load_model_config("qwen9")


def test_yaml_with_unknown_or_missing_fields(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layers: 2\nhidden_size: 8\nnum_heads: 2\n")
    with pytest.raises(ValueError, match=r"unknown fields \['num_heads'\]"):
        load_model_config(str(bad))
    bad.write_text("num_layers: 2\nhidden_size: 8\n")
    with pytest.raises(ValueError, match="missing"):
        load_model_config(str(bad))
