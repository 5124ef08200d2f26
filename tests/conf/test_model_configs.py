"""Every model YAML describes its published model: parameter count from the YAML alone, checked against
transformers' own modelling code (built on the meta device from the same fields) and the published figure."""

import pytest
import torch

from grpo_mega.conf import load_model_config
from grpo_mega.conf.model import MODEL_CONFIG_DIR, ModelConfig

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
    # Qwen3 cards give 0.6B (0.44B non-embedding), 8.2B (6.95B) and 32.8B (31.2B); the hub's safetensors
    # metadata 0.596B, 8.19B and 32.8B. Held to those.
    "qwen3-0.6b": (0.596e9, 0.001e9),
    "qwen3-8b": (8.19e9, 0.01e9),
    "qwen3-32b": (32.8e9, 0.1e9),
    # Qwen3-MoE cards: 30.5B total / 3.3B activated, 235B / 22B activated.
    "qwen3-30b-a3b": (30.5e9, 0.1e9),
    "qwen3-235b-a22b": (235e9, 1e9),
}
# name -> published activated parameter count (one token's experts only), one unit of its last digit
PUBLISHED_ACTIVE = {"qwen3-30b-a3b": (3.3e9, 0.1e9), "qwen3-235b-a22b": (22e9, 1e9)}
# name -> published non-embedding parameter count, one unit of its last digit
PUBLISHED_NON_EMBEDDING = {"qwen3-0.6b": (0.44e9, 0.01e9), "qwen3-8b": (6.95e9, 0.01e9), "qwen3-32b": (31.2e9, 0.1e9)}
TEST_ONLY = {"tiny", "tiny-qwen3", "tiny-qwen3-moe"}


def _hf_model(cfg):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    kw = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, tie_word_embeddings=cfg.tie_word_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
    )
    if cfg.family == "qwen2":
        hf_cfg, cls = Qwen2Config(**kw), Qwen2ForCausalLM
    elif cfg.family == "qwen3":
        hf_cfg, cls = Qwen3Config(attention_bias=cfg.qkv_bias, head_dim=cfg.kv_channels, **kw), Qwen3ForCausalLM
    elif cfg.family == "qwen3_moe":
        hf_cfg = Qwen3MoeConfig(head_dim=cfg.kv_channels, num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                                moe_intermediate_size=cfg.moe_ffn_hidden_size, decoder_sparse_step=cfg.decoder_sparse_step,
                                mlp_only_layers=cfg.mlp_only_layers, **kw)
        cls = Qwen3MoeForCausalLM
    else:
        hf_cfg, cls = LlamaConfig(attention_bias=cfg.qkv_bias, head_dim=cfg.kv_channels, **kw), LlamaForCausalLM
    with torch.device("meta"):
        return cls(hf_cfg)


def _hf_count(cfg) -> int:
    return sum(p.numel() for p in _hf_model(cfg).parameters())


def _hf_active_count(cfg) -> int:
    """transformers' parameter count less the experts a token does not use: top_k of num_experts per MoE block."""
    model = _hf_model(cfg)
    unused = 0
    for name, m in model.named_modules():
        if type(m).__name__ == "Qwen3MoeExperts":
            n = sum(p.numel() for p in m.parameters())
            unused += n - n // cfg.num_experts * cfg.moe_router_topk
    return sum(p.numel() for p in model.parameters()) - unused


def test_every_yaml_is_covered():
    assert {p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml")} == set(PUBLISHED) | TEST_ONLY


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count(name):
    cfg = load_model_config(name)
    n = cfg.num_parameters()
    assert n == _hf_count(cfg)
    published, unit = PUBLISHED[name]
    assert abs(n - published) <= unit, f"{name}: {n / 1e9:.4f}B vs published {published / 1e9}B"
    if name in PUBLISHED_NON_EMBEDDING:
        non_embedding = n - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        published, unit = PUBLISHED_NON_EMBEDDING[name]
        assert abs(non_embedding - published) <= unit, f"{name}: {non_embedding / 1e9:.4f}B non-embedding"
    if name in PUBLISHED_ACTIVE:
        active = cfg.num_active_parameters()
        assert active == _hf_active_count(cfg)
        published, unit = PUBLISHED_ACTIVE[name]
        assert abs(active - published) <= unit, f"{name}: {active / 1e9:.4f}B active"


@pytest.mark.parametrize("name", sorted(TEST_ONLY))
def test_test_model_parameter_count(name):
    cfg = load_model_config(name)
    assert cfg.num_parameters() == _hf_count(cfg)
    if cfg.is_moe:
        assert cfg.num_active_parameters() == _hf_active_count(cfg)


def test_exact_known_counts():
    assert load_model_config("smollm2-135m").num_parameters() == 134_515_008
    assert load_model_config("llama-3.1-8b").num_parameters() == 8_030_261_248
    assert load_model_config("qwen2.5-0.5b").num_parameters() == 494_032_768
    assert load_model_config("qwen3-0.6b").num_parameters() == 596_049_920


def test_vocabulary_padding_is_fixed_by_the_model():
    assert load_model_config("tiny").padded_vocab_size == 384
    assert load_model_config("qwen2.5-7b").padded_vocab_size == 152064


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'qwen9'.*known models: .*llama-3.1-8b.*tiny"):
        load_model_config("qwen9")


def test_qk_layernorm_goes_with_the_family():
    with pytest.raises(ValueError, match=r"model.qk_layernorm=False with model.family='qwen3'.*set model.qk_layernorm=true"):
        ModelConfig(family="qwen3", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_query_groups=2, vocab_size=320)
    with pytest.raises(ValueError, match=r"model.qk_layernorm=True with model.family='qwen2'"):
        ModelConfig(family="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_query_groups=2, vocab_size=320, qk_layernorm=True)


def test_yaml_with_unknown_or_missing_fields(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layers: 2\nhidden_size: 8\nnum_heads: 2\n")
    with pytest.raises(ValueError, match=r"unknown fields \['num_heads'\]"):
        load_model_config(str(bad))
    bad.write_text("num_layers: 2\nhidden_size: 8\n")
    with pytest.raises(ValueError, match="missing"):
        load_model_config(str(bad))
