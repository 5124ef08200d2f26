"""HF export under LoRA (checkpoint.export_hf with lora.rank): `hf/` is the merged model W + (alpha / r) B A and
`peft/` the adapters in PEFT's layout, fused qkv and gate/up adapters split per HF projection.

Held against transformers: a random Qwen2 HF model (qkv bias, 8 heads in 4 query groups: the grouped qkv layout)
is the base; the actor (megatron, fp32) gets random nonzero adapters; its logits must equal transformers' on the
merged export, and on the base with the `peft/` directory loaded by the peft library (PeftModel.from_pretrained),
to 1e-5 max-abs in fp32 (eager attention); peft's own merge_and_unload gives the merged export's weights to 1e-6. The export at TP2 is the same files as at TP1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_mega.conf import LoraConfig, ParallelConfig, PrecisionConfig
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed

LORA = LoraConfig(rank=4, alpha=8.0)
# the MoE model: every target, experts and routers included (fc1/fc2: its dense layer 2; an all-MoE model has none)
LORA_MOE = LoraConfig(rank=4, alpha=8.0, target_modules=["qkv", "proj", "fc1", "fc2", "expert_fc1", "expert_fc2", "router"])
LORA_ALL_MOE = LoraConfig(rank=4, alpha=8.0, target_modules=["qkv", "proj", "expert_fc1", "expert_fc2", "router"])
LOGIT_TOL = 1e-5
TOKENS = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def _export(src: str, out: str, tp: int, ep: int = 1):
    """A LoRA actor on HF model `src` at TP`tp` (EP`ep`) with seeded random adapters: its merged and PEFT exports
    into `out`/hf and `out`/peft (an MoE model with dense MLP layers: hf/ alone, PEFT refused), and (TP1, EP1) its
    logits on TOKENS."""
    from grpo_mega.models.hf_io import load_hf_into_gpt, read_hf_config
    from grpo_mega.models.lora import adapter_state, load_adapter_state
    from grpo_mega.trainer.checkpoint import export_hf
    from grpo_mega.trainer.lora_checkpoint import export_peft
    from tests.trainer import layouts as L

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=1, ep=ep)
        from megatron.core import parallel_state as ps

        _, _, cfg = read_hf_config(src)
        lora = (LORA_MOE if not all(cfg.moe_layers()) else LORA_ALL_MOE) if cfg.is_moe else LORA
        base = L.tiny_actor(train=ep, mini=ep, micro=1)
        parallel = ParallelConfig(tp=tp, ep=ep, sequence_parallel=cfg.is_moe and tp > 1)
        actor = type(base)(cfg, parallel, PrecisionConfig(params_dtype="fp32"), base.optim,
                           base.algo, base.batch, lora=lora)
        gpt = actor.built.gpt
        load_hf_into_gpt(gpt, src, cfg, ps.get_tensor_model_parallel_rank(), tp)
        if cfg.is_moe:  # drawn from each adapter's global name: the same adapters at every EP layout
            from tests.trainer.test_lora import _adapters_random

            load_adapter_state(gpt, _adapters_random(gpt))
        else:
            g = torch.Generator().manual_seed(7)
            load_adapter_state(gpt, {k: torch.randn(v.shape, generator=g) * 0.1
                                     for k, v in sorted(adapter_state(gpt).items())})
        actor.optimizer.reload_model_params()
        export_hf(Path(out) / "hf", actor, cfg, torch.float32, src)
        if cfg.is_moe and lora is LORA_MOE:
            with pytest.raises(ValueError, match=r"lora.target_modules \['fc1', 'fc2'\] on the dense MLP layers of MoE "
                                                 r"model .*: PEFT reads gate_proj/up_proj/down_proj targets of an MoE"):
                export_peft(Path(out) / "peft", actor, cfg, torch.float32, src)
        else:
            export_peft(Path(out) / "peft", actor, cfg, torch.float32, src)
        logits = None
        if tp == 1 and ep == 1:
            gpt.eval()
            b, s = TOKENS.shape
            with torch.no_grad():
                logits = gpt(TOKENS, torch.arange(s).expand(b, s).contiguous(), None)[..., : cfg.vocab_size].float()
        destroy_distributed()
    return logits


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _export_one_process(tmp_path_factory, name: str, family: str, out: str, **hf_kw):
    """A random HF `family` model as the base and its one-process export into <dir>/`out`: (dir, base, logits)."""
    from tests.models.hf_fixtures import tiny_hf

    d = tmp_path_factory.mktemp(name)
    src = tiny_hf(d / "base", family, dtype=torch.float32, **hf_kw)
    (logits,) = run_ranks(_export, 1, str(src), str(d / out), 1, timeout=300)
    return d, src, logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export_one_process(tmp_path_factory, "lora_export", "qwen2", "tp1")


def test_merged_export_gives_the_trainers_logits(exported):
    from transformers import AutoModelForCausalLM

    d, _, logits = exported
    merged = AutoModelForCausalLM.from_pretrained(d / "tp1" / "hf", dtype=torch.float32, attn_implementation="eager")
    err = float((_hf_logits(merged) - logits).abs().max())
    print(f"LoRA merged export vs trainer: max-abs logit error {err:.2e}")
    assert err <= LOGIT_TOL, err


def test_peft_export_on_the_base_gives_the_trainers_logits(exported):
    from transformers import AutoModelForCausalLM

    d, src, logits = exported
    peft = d / "tp1" / "peft"
    config = json.loads((peft / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    assert config["base_model_name_or_path"] == str(src)
    tensors = load_file(peft / "adapter_model.safetensors")
    assert len(tensors) == 4 * 7 * 2  # 4 layers x 7 HF projections x (A, B)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    moved = float((_hf_logits(model) - logits).abs().max())
    assert moved > 1e-2, moved  # the base alone is far from the trainer: the adapters carry the match below
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
              "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}
    for key, a in tensors.items():
        if ".lora_A." in key:
            stem = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b, w = tensors[key.replace(".lora_A.", ".lora_B.")], weights[f"{stem}.weight"]
            assert tuple(w.shape) == shapes[stem.split(".")[-1]] and a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4)

    # the peft library itself loads the directory onto the HF base model
    from peft import PeftModel

    lora_model = PeftModel.from_pretrained(model, str(peft))
    lora_model.eval()
    err = float((_hf_logits(lora_model) - logits).abs().max())
    print(f"LoRA PEFT export loaded by peft on the base vs trainer: max-abs logit error {err:.2e} (the base alone: "
          f"{moved:.2e}; logits up to {float(logits.abs().max()):.2f})")
    assert err <= LOGIT_TOL, err
    # and peft's merge gives the merged export's weights, projection by projection
    folded = dict(lora_model.merge_and_unload().named_parameters())
    merged = load_file(d / "tp1" / "hf" / "model.safetensors")
    werr = max(float((folded[k].detach() - v).abs().max()) for k, v in merged.items() if k in folded)
    assert werr <= 1e-6, werr


def test_export_at_tp2_is_tp1s(exported):
    d, src, _ = exported
    run_ranks(_export, 2, str(src), str(d / "tp2"), 2, timeout=300)
    for rel in ("peft/adapter_model.safetensors", "hf/model.safetensors"):
        a, b = load_file(d / "tp1" / rel), load_file(d / "tp2" / rel)
        assert a.keys() == b.keys()
        err = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert err <= 1e-6, (rel, err)  # the adapters bit for bit; W + s B A summed per shard at TP2


@pytest.fixture(scope="module")
def exported_moe(tmp_path_factory):
    return _export_one_process(tmp_path_factory, "lora_export_moe", "qwen3_moe", "ep1")


def test_moe_merged_export_gives_the_trainers_logits(exported_moe):
    """Qwen3-MoE with adapters on every expert's fc1/fc2 and every router (beside attention and the dense layer's
    MLP): the merged export (each expert's W + s B A before its EP gather, the router's too) is the trainer's model
    in transformers, to 1e-5 max-abs; at EP2 (each rank 4 of the 8 experts' adapters) and at TP2+SP (every expert
    and its adapters split over expert TP, merged shard by shard and gathered) it is the same file to 1e-6. The base
    alone is far from it (the adapters carry the match)."""
    from transformers import AutoModelForCausalLM

    d, src, logits = exported_moe
    merged = AutoModelForCausalLM.from_pretrained(d / "ep1" / "hf", dtype=torch.float32, attn_implementation="eager")
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    err, moved = (float((_hf_logits(m) - logits).abs().max()) for m in (merged, base))
    print(f"LoRA (experts, routers) merged export vs trainer: max-abs logit error {err:.2e} (the base alone: {moved:.2e})")
    assert err <= LOGIT_TOL and moved > 1e-2, (err, moved)
    a = load_file(d / "ep1" / "hf" / "model.safetensors")
    for name, tp, ep in (("ep2", 1, 2), ("tp2", 2, 1)):
        run_ranks(_export, 2, str(src), str(d / name), tp, ep, timeout=300)
        b = load_file(d / name / "hf" / "model.safetensors")
        assert a.keys() == b.keys()
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, name


@pytest.fixture(scope="module")
def exported_all_moe(tmp_path_factory):
    return _export_one_process(tmp_path_factory, "lora_export_all_moe", "qwen3_moe", "ep1", mlp_only_layers=())


def test_moe_peft_export_loads_with_peft(exported_all_moe):
    """An all-MoE Qwen3 (as Qwen3-30B-A3B: no dense MLP layer) with adapters on attention, every expert and every
    router: `peft/` holds each expert's gate/up/down adapters under transformers' per-expert on-disk names and the
    router's as PEFT's adapter on the parameter mlp.gate.weight; the peft library loads it onto the HF base
    (fusing the experts' adapters as transformers fuses their weights) and gives the trainer's logits to 1e-5,
    and the EP2 export writes the same tensors."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d, src, logits = exported_all_moe
    peft = d / "ep1" / "peft"
    config = json.loads((peft / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]) and config["target_parameters"] == ["mlp.gate.weight"]
    tensors = load_file(peft / "adapter_model.safetensors")
    assert "base_model.model.model.layers.3.mlp.experts.7.down_proj.lora_B.weight" in tensors
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    moved = float((_hf_logits(model) - logits).abs().max())
    lora_model = PeftModel.from_pretrained(model, str(peft))
    lora_model.eval()
    err = float((_hf_logits(lora_model) - logits).abs().max())
    print(f"LoRA (experts, routers) PEFT export loaded by peft vs trainer: max-abs logit error {err:.2e} (the base "
          f"alone: {moved:.2e})")
    assert err <= LOGIT_TOL and moved > 1e-2, (err, moved)
    run_ranks(_export, 2, str(src), str(d / "ep2"), 1, 2, timeout=300)
    other = load_file(d / "ep2" / "peft" / "adapter_model.safetensors")
    assert other.keys() == tensors.keys()
    assert max(float((other[k] - tensors[k]).abs().max()) for k in tensors) == 0.0
