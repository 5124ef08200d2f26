"""Qwen3-MoE through megatron-core's own MoE layer (local spec: router, SequentialMLP experts, allgather
dispatcher), held against transformers' Qwen3MoeForCausalLM: a tiny random model with 8 experts, top-2,
renormalised top-k and one dense layer, loaded from an HF directory, gives transformers' logits, and
HF -> Megatron -> HF is bit-exact, at EP1 and with the experts split over EP ranks."""

from pathlib import Path

import pytest
import torch

from grpo_mega.conf import ParallelConfig, PrecisionConfig, load_model_config
from grpo_mega.models import bridge
from grpo_mega.models.convert import hf_to_mcore, mcore_to_hf, read_meta
from grpo_mega.models.hf_io import load_hf_into_gpt, read_hf_config
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from tests.models.hf_fixtures import tiny_hf
from tests.models.test_convert import _all_tensors

LOGIT_TOL = 1e-4  # max-abs, fp32


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return tiny_hf(tmp_path_factory.mktemp("hf") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def tiny_moe_fp32(tmp_path_factory):
    return tiny_hf(tmp_path_factory.mktemp("hf") / "qwen3_moe_fp32", "qwen3_moe", dtype=torch.float32, seed=1)


def _megatron_logits(hf_dir, tp, pp, ep, tokens):
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.trainer.forward import run_schedule

    with cpu_compat.cpu_device_mode():
        layout = init_distributed(tp=tp, pp=pp, ep=ep)
        _, _, cfg = read_hf_config(hf_dir)
        gpt, _ = build_gpt(cfg, ParallelConfig(tp=tp, pp=pp, ep=ep), PrecisionConfig(params_dtype="fp32"), init=False)
        load_hf_into_gpt(gpt, hf_dir, cfg, layout.tp_rank, tp)
        gpt.eval()
        first = bridge.expert_offset(gpt, cfg)
        local_experts = {bridge.expert_of(bridge.global_name(n, 0, first)) for n, _ in gpt.named_parameters()} - {None}
        b, s = tokens.shape
        mb = dict(tokens=tokens, position_ids=torch.arange(s).expand(b, s).contiguous())

        def forward_step(it, model):
            m = next(it)
            return model(m["tokens"], m["position_ids"], None), lambda out: (torch.zeros(()), {"logits": out})

        with torch.no_grad():
            out = run_schedule(gpt, [mb], s, forward_step, forward_only=True)
        destroy_distributed()
        return layout, (out[0]["logits"] if out else None), sorted(local_experts)


def _check_logits(hf_dir, tp, ep, pp=1):
    from transformers import AutoModelForCausalLM

    _, _, cfg = read_hf_config(str(hf_dir))
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ranks = run_ranks(_megatron_logits, tp * pp * ep, str(hf_dir), tp, pp, ep, tokens, timeout=300)
    # every EP rank holds num_experts / ep of them, all of them between the ranks
    experts = [r[2] for r in ranks if r[2]]
    assert all(len(e) == cfg.num_experts // ep for e in experts)
    assert sorted(set().union(*map(set, experts))) == list(range(cfg.num_experts))
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = hf_model(tokens).logits
    last = [r for r in ranks if r[0].pp_rank == pp - 1]
    for ep_rank in range(ep):  # each EP rank (a DP rank here, given the same tokens) against transformers
        mine = sorted((r for r in last if r[0].ep_rank == ep_rank), key=lambda r: r[0].tp_rank)
        logits = torch.cat([r[1] for r in mine], dim=-1)[..., : cfg.vocab_size]
        err = (logits - want).abs().max().item()
        print(f"qwen3_moe TP{tp}xPP{pp}xEP{ep} (ep rank {ep_rank}): max-abs logit error {err:.2e}, "
              f"max |logit| {want.abs().max():.1f}")
        assert err <= LOGIT_TOL, f"max-abs logit error {err:.2e} at TP{tp}xPP{pp}xEP{ep}"
    assert want.abs().max() > 1.0


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2)])
def test_logits_match_transformers(tiny_moe_fp32, tp, ep):
    _check_logits(tiny_moe_fp32, tp, ep)


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2)])
def test_roundtrip_bit_exact(tiny_moe, tmp_path, tp, ep):
    _roundtrip(tiny_moe, tmp_path, tp, ep)


def test_pp2_ep2_logits_and_roundtrip(tiny_moe_fp32, tiny_moe, tmp_path):
    """4 ranks: stage 0 holds MoE layers 0-1, stage 1 the dense layer 2 and MoE layer 3 (mlp_only_layers=[2]):
    each stage builds its slice of the MoE/dense pattern."""
    _check_logits(tiny_moe_fp32, 1, 2, pp=2)
    _roundtrip(tiny_moe, tmp_path, 1, 2, pp=2)


def test_tp2_ep2_logits_and_roundtrip(tiny_moe_fp32, tiny_moe, tmp_path):
    """4 ranks: each expert is split over the expert-tensor-parallel group (megatron's default size, tp) and the
    experts over EP; attention over TP. One test, both checks."""
    _check_logits(tiny_moe_fp32, 2, 2)
    _roundtrip(tiny_moe, tmp_path, 2, 2)


def _roundtrip(tiny_moe, tmp_path, tp, ep, pp=1):
    ck, out = tmp_path / "mc", tmp_path / "hf"
    hf_to_mcore(str(tiny_moe), str(ck), tp=tp, pp=pp, ep=ep)
    assert read_meta(str(ck))["saved_layout"] == {"tp": tp, "pp": pp} | ({"ep": ep} if ep > 1 else {})
    mcore_to_hf(str(ck), str(out), max_shard_bytes=200_000)
    a, b = _all_tensors(tiny_moe), _all_tensors(out)
    assert sorted(a) == sorted(b) and "model.layers.3.mlp.experts.7.down_proj.weight" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    from transformers import AutoConfig

    src, got = AutoConfig.from_pretrained(tiny_moe), AutoConfig.from_pretrained(out)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                "decoder_sparse_step", "head_dim", "model_type"):
        assert getattr(src, key) == getattr(got, key), key


def test_our_config_json_builds_the_same_tensors_in_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = load_model_config("tiny-qwen3-moe")
    hf = bridge.FAMILIES.get("qwen3_moe").hf_config(cfg, dtype="float32")
    config = AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    # transformers 5 fuses the experts in memory; the names it saves are the per-expert ones the bridge uses
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 2 * 32, 64)
    assert "model.layers.2.mlp.gate_proj.weight" in bridge.hf_names(cfg)  # mlp_only_layers=[2]: dense
    assert len([n for n in bridge.hf_names(cfg) if ".mlp.experts." in n]) == 3 * 8 * 3
    assert bridge.family_of_hf(hf | {"model_type": "qwen3_moe"}).model_config(hf, name=cfg.name) == cfg


def test_expert_names_map_both_ways():
    cfg = load_model_config("tiny-qwen3-moe")
    spec = bridge.spec_for("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight", cfg)
    assert spec.hf_names == ("model.layers.1.mlp.experts.5.gate_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight")
    # TE grouped GEMM spelling and an EP rank's local index
    assert bridge.spec_for("decoder.layers.1.mlp.experts.linear_fc2.weight5", cfg).hf_names == (
        "model.layers.1.mlp.experts.5.down_proj.weight",)
    assert bridge.global_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 2, 4) == \
        "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"
    assert bridge.spec_for("decoder.layers.0.mlp.router.weight", cfg).hf_names == ("model.layers.0.mlp.gate.weight",)


@pytest.mark.parametrize("experts,match", [(4, r"holds experts its config does not have \(num_experts=4\)"),
                                           (16, r"tensors missing for a qwen3_moe model .*mlp\.experts\.(8|9|1[0-5])\.")])
def test_expert_count_differing_from_the_config_is_refused(tiny_moe, tmp_path, experts, match):
    import json
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(tiny_moe, d)
    hf = json.loads((d / "config.json").read_text())
    hf.pop("num_experts", None)
    hf["num_local_experts"] = experts
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=match):
        hf_to_mcore(str(d), str(tmp_path / "ck"), 1, 1)
    assert not (tmp_path / "ck").exists()


def _moe_metrics_train_forward(hf_dir, tokens):
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.models.moe_metrics import MoEMetrics

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1)
        _, _, cfg = read_hf_config(hf_dir)
        gpt, _ = build_gpt(cfg, ParallelConfig(), PrecisionConfig(params_dtype="fp32"), init=False)
        load_hf_into_gpt(gpt, hf_dir, cfg, 0, 1)
        gpt.train()
        metrics = MoEMetrics(gpt, cfg.num_layers, cfg.num_experts, sequence_parallel=False)
        metrics.start()
        b, s = tokens.shape
        gpt(tokens, torch.arange(s).expand(b, s).contiguous(), None).sum().backward()  # one micro-batch
        out = metrics.metrics(1)
        destroy_distributed()
        return out


def test_aux_loss_and_expert_load_metrics_match_transformers(tiny_moe_fp32):
    """moe/aux_loss is megatron's switch loss over the coefficient, per MoE layer: transformers'
    load_balancing_loss_func on that layer's router logits over top_k (it counts k assignments per token);
    moe/expert_load/e{j} is expert j's share of the top-k assignments of transformers' routers."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, _, cfg = read_hf_config(str(tiny_moe_fp32))
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    got = run_ranks(_moe_metrics_train_forward, 1, str(tiny_moe_fp32), tokens, timeout=120)[0]
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_moe_fp32, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        router_logits = hf_model(tokens, output_router_logits=True).router_logits
    assert len(router_logits) == sum(cfg.moe_layers()) == 3
    k, e = cfg.moe_router_topk, cfg.num_experts
    want_aux = sum(float(load_balancing_loss_func((lg,), e, k)) / k for lg in router_logits) / len(router_logits)
    counts = sum(torch.bincount(lg.softmax(-1).topk(k, -1).indices.flatten(), minlength=e) for lg in router_logits)
    want_share = counts.double() / counts.sum()
    share = torch.tensor([got[f"moe/expert_load/e{j}"] for j in range(e)], dtype=torch.float64)
    print(f"moe/aux_loss {got['moe/aux_loss']:.6f} (transformers {want_aux:.6f}); loads {share.tolist()}")
    assert abs(got["moe/aux_loss"] - want_aux) <= 1e-5
    assert torch.equal(share, want_share)
    assert got["moe/expert_load_max"] > 1.0 > got["moe/expert_load_min"]  # a random router is not balanced
