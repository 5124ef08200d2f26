"""The fused output layer + logprob/entropy/KL op (grpo_mega.parallel.fused_output) against today's unfused path:
megatron's ColumnParallelLinear output layer (its own input mapping, all-gather under sequence parallelism),
then grpo_mega.parallel.vocab_parallel_stats, which tests/parallel/test_vocab_parallel.py holds to
torch.log_softmax on the gathered logits. At TP1, TP2 and TP2 with sequence parallelism, with the full KL (a
reference model's hidden states and weight), a padded vocabulary whose last shard is short, chunks that do not
divide the tokens (the backward making each chunk's logits again) and one chunk (the logits kept): the same
logprob, entropy and KL, and the same gradients w.r.t. the hidden states and the output weight (returned as
.grad, or accumulated into megatron DDP's fp32 main_grad).

Tolerances (fp32 on CPU), each 1e-6 of the quantity's scale: per-token values 1e-6 x max(1, largest |value|)
(logprobs reach -12 and KLs 9 here, where one fp32 ulp is 1e-6: a chunk of one token is a GEMV, whose sums
round differently from the GEMM's, measured up to 2.5e-7 of the scale); gradients 1e-6 of the reference
gradient's largest element (measured up to 3e-7).
"""

import pytest
import torch
import torch.distributed as dist

from grpo_mega.parallel.forked import run_ranks

S, B, H, V = 12, 2, 16, 40  # [s, b, h] hidden states; padded vocabulary 40: 20 columns per shard at tp=2
VOCAB = 33  # real vocabulary: tp=2's second shard has 13 real columns and 7 padding
TEMPERATURE = 0.7
TOL = 1e-6
# (name, chunk_size, with reference (full KL), weight gradient into main_grad)
CASES = [
    ("chunked_full_kl", 5, True, False),
    ("one_chunk_full_kl", None, True, False),
    ("chunked_main_grad", 7, False, True),
    ("chunk_of_one_main_grad_full_kl", 1, True, True),
]


def _data():
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden=torch.randn(S, B, H, generator=g), ref_hidden=torch.randn(S, B, H, generator=g),
        weight=torch.randn(V, H, generator=g) * 0.5, ref_weight=torch.randn(V, H, generator=g) * 0.5,
        target=torch.randint(0, VOCAB, (S, B), generator=g), upstream=torch.randn(3, S, B, generator=g),
    )


def _rank(sp: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.fused_output import fused_output_stats, output_layer_input
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.parallel.vocab_parallel import vocab_parallel_stats

    with cpu_compat.cpu_device_mode():
        tp = dist.get_world_size()
        init_distributed(tp=tp, pp=1, seed=1234)
        rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        d = _data()
        w = V // tp
        rows = slice(rank * (S // tp), (rank + 1) * (S // tp)) if sp else slice(None)  # this rank's sequence shard
        config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=torch.float32,
                                     use_cpu_initialization=True, perform_initialization=False)

        def layer(full_weight, grad):
            out = ColumnParallelLinear(H, V, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                       gather_output=False)
            with torch.no_grad():
                out.weight.copy_(full_weight[rank * w:(rank + 1) * w])
            out.weight.requires_grad_(grad)
            return out

        out = {}
        for name, chunk, with_ref, main_grad in CASES:
            up = d["upstream"]
            # today's path: the output layer's logits [s, b, V/tp], then the vocab-parallel op
            x0 = d["hidden"][rows].clone().requires_grad_(True)
            out0, ref0 = layer(d["weight"], True), layer(d["ref_weight"], False)
            logits = out0(x0)[0]
            ref_logits = ref0(d["ref_hidden"][rows])[0] if with_ref else None
            lp0, ent0, kl0 = vocab_parallel_stats(logits, d["target"], group, ref_logits=ref_logits,
                                                  temperature=TEMPERATURE, vocab_size=VOCAB)
            # the fused op on the same inputs through the same mapping
            x1 = d["hidden"][rows].clone().requires_grad_(True)
            w1 = torch.nn.Parameter(out0.weight.detach().clone())
            if main_grad:
                w1.main_grad = torch.full(w1.shape, 0.25)  # gradients accumulate onto what is there
            ref_h = output_layer_input(d["ref_hidden"][rows], group, sp) if with_ref else None
            lp1, ent1, kl1 = fused_output_stats(output_layer_input(x1, group, sp), w1, d["target"], group,
                                                ref_hidden=ref_h, ref_weight=ref0.weight if with_ref else None,
                                                temperature=TEMPERATURE, vocab_size=VOCAB, chunk_size=chunk)
            loss0 = (up[0] * lp0 + up[1] * ent0 + (up[2] * kl0 if with_ref else 0)).sum()
            loss1 = (up[0] * lp1 + up[1] * ent1 + (up[2] * kl1 if with_ref else 0)).sum()
            loss0.backward()
            loss1.backward()
            gw1 = (w1.main_grad - 0.25) if main_grad else w1.grad
            out[name] = dict(
                values=[(a.detach(), b.detach())
                        for a, b in [(lp0, lp1), (ent0, ent1)] + ([(kl0, kl1)] if with_ref else [])],
                grad_hidden=(x0.grad, x1.grad), grad_weight=(out0.weight.grad, gw1),
                weight_grad_left_none=w1.grad is None, kl_none=kl1 is None,
            )
        destroy_distributed()
        return out


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)], ids=["TP1", "TP2", "TP2-SP"])
def test_fused_equals_output_layer_then_vocab_parallel_stats(tp, sp):
    for rank, res in enumerate(run_ranks(_rank, tp, sp, timeout=120)):
        for name, chunk, with_ref, main_grad in CASES:
            r, where = res[name], f"tp={tp} sp={sp} rank={rank} {name}"
            assert r["kl_none"] is not with_ref, where
            for want, got in r["values"]:
                assert got.shape == want.shape == (S, B), where
                err, scale = float((got - want).abs().max()), max(1.0, float(want.abs().max()))
                assert err <= TOL * scale, f"{where}: per-token max abs error {err:.2e} (scale {scale:.1f})"
            for key in ("grad_hidden", "grad_weight"):
                want, got = r[key]
                assert got.shape == want.shape, where
                scale = float(want.abs().max())
                err = float((got - want).abs().max())
                assert scale > 0 and err <= TOL * scale, f"{where}: {key} max abs error {err:.2e} (scale {scale:.2e})"
            if main_grad:
                assert r["weight_grad_left_none"], where  # all of it went into main_grad


def test_bad_inputs_are_named():
    from grpo_mega.parallel.fused_output import fused_output_stats

    h, w = torch.zeros(4, 8), torch.zeros(10, 8)
    with pytest.raises(ValueError, match="expected"):
        fused_output_stats(h, torch.zeros(10, 7))
    with pytest.raises(ValueError, match="both ref_hidden and ref_weight"):
        fused_output_stats(h, w, ref_hidden=h)
    with pytest.raises(ValueError, match="must not require grad"):
        fused_output_stats(h, w, ref_hidden=h.clone().requires_grad_(True), ref_weight=w)
    with pytest.raises(ValueError, match="target ids must be in"):
        fused_output_stats(h, w, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="temperature"):
        fused_output_stats(h, w, temperature=0.0)
