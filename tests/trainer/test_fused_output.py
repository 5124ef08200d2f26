"""The fused output layer in the trainer (`batch.fused_output`): with the full KL in the loss (the reference in
lockstep), one GRPO update from the same weights with the switch off (the output layer's logits, then the
vocab-parallel op: the path the layout, full-KL and response-only tests prove against single-process and dense
runs) and on gives the same loss, logged KL and entropy, grad norm and full gradient (every local parameter's
main_grad after Megatron's grad finalisation, the output weight's included), and the same actor and reference
logprob passes. One layout per claim: TP1 padded rows, TP1 packed rows with tied embeddings (the output weight
is the embedding's: its two gradients meet in one main_grad), TP2 with sequence parallelism, PP2 (the last stage's
own copy of the output weight); response-only positions everywhere (the default), and at TP1 all positions too.
The fused op runs in chunks of 5 tokens (the backward making each chunk's logits again) and, at PP2, in one
chunk (the logits kept for the backward).

Tolerances (fp32 on CPU): loss, KL, entropy, grad norm 1e-6 relative; gradient 1e-6 relative (norm of the
difference over the norm); logprobs 1e-6 absolute (they are O(1-10); measured differences are a few 1e-7 at most).
"""

import dataclasses

import pytest
import torch

from grpo_mega.parallel.forked import run_ranks
from tests.trainer import layouts as L

TOL = 1e-6
LAYOUTS = {  # name: (tp, pp, sequence_parallel, tied, batch overrides of the fused side, row settings)
    "TP1-padded": (1, 1, False, False, dict(logprob_chunk_size=5), [dict(packing=False),
                                                                     dict(packing=False, response_only_logits=False)]),
    "TP1-packed-tied": (1, 1, False, True, dict(logprob_chunk_size=5), [dict(packing=True)]),
    "TP2-SP": (2, 1, True, False, dict(logprob_chunk_size=5), [dict(packing=True)]),
    "PP2": (1, 2, False, False, dict(logprob_chunk_size=None), [dict(packing=True)]),
}


def _configs(rows: dict, fused: bool, fused_kw: dict) -> dict:
    batch_kw = {**rows, "fused_output": fused, **(fused_kw if fused else {})}
    kw = L.configs("token-mean", 2, "sgd", batch_kw)
    kw["algo_cfg"] = dataclasses.replace(kw["algo_cfg"], kl_estimator="full", kl_coef=2.0)
    return kw


def _rank(tp, pp, sp, tied, fused_kw, row_settings):
    """On every rank, per row setting: the logprob passes and one full-KL update with the switch off and on, from
    the same weights. Returns {(setting index, fused): (actor logp, reference logp, metrics, grads)}."""
    from grpo_mega.conf import ParallelConfig
    from grpo_mega.models.builder import copy_weights
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=1234)
        parallel = ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp)
        cfg = L.model_cfg(tied)
        base = _configs(row_settings[0], False, {})
        ref = Reference(cfg, parallel, base["precision"], base["batch"])
        first = Actor(cfg, parallel, **base)
        copy_weights(first.built.gpt, ref.built.gpt)
        with torch.no_grad():  # the same noise on every rank for a parameter of a given name: TP copies agree
            for name, p in ref.built.gpt.named_parameters():
                g = torch.Generator().manual_seed(sum(map(ord, name)))
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        batch = L.rollout(lengths="packing")
        old_logp = L.perturbed(first.logprobs(batch, L.TEMPERATURE), batch.response_mask(), 0.3, 1)
        out = {}
        for i, rows in enumerate(row_settings):
            for fused in (False, True):
                kw = _configs(rows, fused, fused_kw)
                actor = Actor(cfg, parallel, **kw)
                copy_weights(first.built.gpt, actor.built.gpt)
                ref.batch = kw["batch"]
                widths = []  # what the output layer returns: logits [.., V/tp], or its input [.., h] when fused
                for gpt in (actor.built.gpt, ref.built.gpt):
                    if getattr(gpt, "output_layer", None) is not None:
                        gpt.output_layer.register_forward_hook(lambda m, a, o: widths.append(o[0].shape[-1]))
                logp = actor.logprobs(batch, L.TEMPERATURE)
                ref_logp = ref.logprobs(batch, L.TEMPERATURE)
                b = L.rollout(lengths="packing")
                b.old_logp = old_logp
                (m,) = actor.update(b, L.TEMPERATURE, reference=ref)
                grads = {n: p.main_grad.detach().double().clone() for n, p in actor.built.gpt.named_parameters()}
                out[(i, fused)] = (logp, ref_logp, m, grads, set(widths), cfg.hidden_size)
        destroy_distributed()
        return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fused_output_equals_unfused(name):
    tp, pp, sp, tied, fused_kw, row_settings = LAYOUTS[name]
    for per_rank in run_ranks(_rank, tp * pp, tp, pp, sp, tied, fused_kw, row_settings, timeout=300):
        for i, rows in enumerate(row_settings):
            logp0, ref0, m0, g0, widths0, h = per_rank[(i, False)]
            logp1, ref1, m1, g1, widths1, _ = per_rank[(i, True)]
            if widths0:  # the last stage: logits unfused, the hidden states fused
                assert h not in widths0 and widths1 == {h}, (name, widths0, widths1)
            where = f"{name} {rows}"
            assert m0["skipped"] == 0.0 and m1["skipped"] == 0.0, where
            assert m0["kl"] > 0.01, where  # the reference differs: the full KL is in play
            for k in ("loss", "kl", "entropy", "grad_norm"):
                assert abs(m1[k] - m0[k]) <= TOL * abs(m0[k]), (where, k, m1[k], m0[k])
            assert float(logp0.abs().sum()) > 0 and float(ref0.abs().sum()) > 0, where
            assert float((logp1 - logp0).abs().max()) <= TOL, where
            assert float((ref1 - ref0).abs().max()) <= TOL, where
            num = sum(float((g1[k] - g0[k]).norm()) ** 2 for k in g0) ** 0.5
            den = sum(float(g.norm()) ** 2 for g in g0.values()) ** 0.5
            assert den > 0 and num <= TOL * den, f"{where}: gradient relative error {num / den:.2e}"
            out_w = [k for k in g0 if k.endswith(("output_layer.weight", "word_embeddings.weight"))]
            for k in out_w:  # the output weight itself (the embedding when tied), and the embedding
                assert float(g0[k].norm()) > 0, (where, k)
                rel = float((g1[k] - g0[k]).norm()) / float(g0[k].norm())
                assert rel <= TOL, f"{where}: {k} gradient relative error {rel:.2e}"
