"""The builder: uninitialised (load-ready) and meta models carry the same tensor-parallel tags as initialised ones."""

from grpo_mega.conf import ParallelConfig, PrecisionConfig, load_model_config
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed


def _tags(init, meta):
    from grpo_mega.models.builder import build_gpt

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=2, pp=1)
        gpt, _ = build_gpt(load_model_config("tiny"), ParallelConfig(tp=2), PrecisionConfig(params_dtype="fp32"),
                           init=init, meta=meta)
        tags = {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1), p.device.type)
                for n, p in gpt.named_parameters()}
        destroy_distributed()
        return tags


def test_uninitialised_and_meta_models_are_tagged_like_initialised_ones():
    ref = run_ranks(_tags, 2, True, False, timeout=60)[0]
    assert sum(t[0] for t in ref.values()) >= 10  # qkv, proj, fc1, fc2 per layer, embedding, output
    for init, meta in ((False, False), (False, True)):
        got = run_ranks(_tags, 2, init, meta, timeout=60)[0]
        assert {n: t[:2] for n, t in got.items()} == {n: t[:2] for n, t in ref.items()}
        assert {t[2] for t in got.values()} == {"meta" if meta else "cpu"}


# --- layer-spec choice (issue 38): LoRA builds megatron-core's local layers even where Transformer Engine exists ---

import importlib.util
import logging

import pytest
import torch

from grpo_mega.conf.lora import LoraConfig


def _availability(monkeypatch, te_installed: bool, cuda: bool) -> None:
    """The two checks builder.have_transformer_engine makes, answered as given (this machine has neither)."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "transformer_engine":
            return importlib.machinery.ModuleSpec("transformer_engine", None) if te_installed else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


@pytest.mark.parametrize("te_installed", [True, False])
@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("lora", [True, False])
def test_spec_choice_is_local_under_lora_even_where_transformer_engine_exists(monkeypatch, te_installed, cuda, lora):
    from grpo_mega.models import builder

    _availability(monkeypatch, te_installed, cuda)
    assert builder.have_transformer_engine() == (te_installed and cuda)
    got = builder.spec_choice(LoraConfig(rank=4) if lora else None)
    assert got == ("transformer_engine" if te_installed and cuda and not lora else "local")
    assert builder.spec_choice(LoraConfig()) == builder.spec_choice(None)  # rank null: no LoRA


def _build_lora_actor_where_te_exists(te_installed: bool):
    """One rank: build_actor with LoRA while builder.have_transformer_engine (the check of the package and CUDA that
    spec_choice makes, tested above) answers `te_installed`; the build itself runs on this CPU."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from grpo_mega.models import builder
    from grpo_mega.models.local_attention import SDPACoreAttention

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger(builder.__name__).addHandler(handler)
    logging.getLogger(builder.__name__).setLevel(logging.INFO)
    builder.have_transformer_engine = lambda: te_installed  # this forked rank's module only
    builder._said_lora_local = False  # this test process may have said it already (the choice test above)
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1)
        built = builder.build_actor(load_model_config("tiny"), ParallelConfig(), PrecisionConfig(params_dtype="fp32"),
                                    lora=LoraConfig(rank=4))
        again = builder.spec_choice(LoraConfig(rank=4))
        gpt = built.gpt
        layer = gpt.decoder.layers[0]
        classes = {n: type(m).__name__ for n, m in gpt.named_modules()}
        out = dict(
            spec=gpt.grpo_mega_layer_spec, again=again, uses_te=builder.uses_transformer_engine(gpt), log=seen,
            qkv=isinstance(layer.self_attention.linear_qkv, ColumnParallelLinear),
            proj=isinstance(layer.self_attention.linear_proj, RowParallelLinear),
            fc1=isinstance(layer.mlp.linear_fc1, ColumnParallelLinear),
            fc2=isinstance(layer.mlp.linear_fc2, RowParallelLinear),
            core=isinstance(layer.self_attention.core_attention, SDPACoreAttention),
            norm=type(layer.input_layernorm) is builder.LocalRMSNorm,
            te_modules=sorted({c for c in classes.values() if c.startswith("TE")}),
            adapters=sorted(n for n, p in gpt.named_parameters() if p.requires_grad),
            fusion=built.config.gradient_accumulation_fusion or built.config.bias_activation_fusion,
        )
        destroy_distributed()
    return out


@pytest.mark.parametrize("te_installed", [True, False])
def test_lora_actor_is_built_on_local_layers_where_transformer_engine_exists(te_installed):
    got = run_ranks(_build_lora_actor_where_te_exists, 1, te_installed, timeout=120)[0]
    assert (got["spec"], got["again"], got["uses_te"]) == ("local", "local", False)
    assert all(got[k] for k in ("qkv", "proj", "fc1", "fc2", "core", "norm")), got
    assert got["te_modules"] == [] and not got["fusion"]
    assert len(got["adapters"]) == 2 * 4 * load_model_config("tiny").num_layers  # A and B on qkv, proj, fc1, fc2
    assert all(n.endswith(("lora_A", "lora_B")) for n in got["adapters"])
    said = [m for m in got["log"] if "local layer spec" in m]
    # said once, and only where it differs from what the builder would have picked without LoRA
    assert len(said) == (1 if te_installed else 0), got["log"]
    if said:
        assert said[0].startswith("lora.rank=4: megatron-core's local layer spec")


def test_fp8_with_a_local_spec_is_refused_in_one_line(monkeypatch):
    from grpo_mega.models import builder

    _availability(monkeypatch, True, True)
    with pytest.raises(ValueError, match=r"^precision\.fp8='hybrid' runs only on Transformer Engine's layer spec.*"
                                         r"set precision\.fp8=null$"):
        builder.transformer_config(load_model_config("tiny"), ParallelConfig(), PrecisionConfig(fp8="hybrid"), "local")
