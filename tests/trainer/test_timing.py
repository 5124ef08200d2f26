"""grpo_mega/trainer/timing.py's perf/mfu: model_flops against torch's own FLOP counter on a real forward +
backward, the peak table's lookup, and throughput's arithmetic by hand."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from grpo_mega.conf import load_model_config
from grpo_mega.trainer.timing import model_flops, peak_bf16_flops, throughput


def _hf_model(cfg):
    """The transformers model of `cfg` (random weights, fp32, eager attention: its QK^T and AV are matmuls the
    counter sees)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.models.bridge import FAMILIES

    hf = FAMILIES.get(cfg.family).hf_config(cfg, dtype="float32")
    config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
def test_model_flops_matches_flop_counter(name):
    """Two sequences of different lengths through forward + backward, counted by FlopCounterMode (matmuls only:
    2 x m x n x k each, attention's included). model_flops counts 6 x every parameter but the untied input
    embedding; the 1-D ones (norms, biases) feed no matmul, so the formula is above the counter by exactly
    6 x their number x tokens: that, and not a loose tolerance, is what the test allows (float sums of exact
    integers: 1e-12 relative)."""
    cfg = load_model_config(name)
    model = _hf_model(cfg)
    lens = [24, 9]
    with FlopCounterMode(display=False) as counter:
        for s in lens:
            ids = torch.randint(0, cfg.vocab_size, (1, s), generator=torch.Generator().manual_seed(s))
            model(input_ids=ids).logits.float().sum().backward()
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()  # the count model_flops starts from
    expected = model_flops(cfg, lens) - 6.0 * vectors * sum(lens)
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)
    assert 6.0 * vectors * sum(lens) < 0.02 * model_flops(cfg, lens)  # what is not a matmul is a small share


def test_peak_lookup_and_mfu_by_hand():
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12  # before the plain "H100" entry
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090") is None
    timing = {"timing/update": 2.0, "timing/generate": 1.0, "timing/generate_wait": 0.25}
    out = throughput(timing, 100.0, 40.0, update_flops=8e12, peak_flops=1e13)
    assert out["perf/mfu"] == pytest.approx(8e12 / 2.0 / 1e13) and out["perf/update_tokens_per_s"] == 50.0
    assert out["perf/overlap"] == 0.75 and "perf/mfu" not in throughput(timing, 100.0, 40.0)  # off CUDA: none
