"""Response-only output layer (`batch.response_only_logits`): only the positions the loss reads go through the
vocab-parallel output layer and the logprob/entropy/KL op. At TP1, TP2 with sequence parallelism, PP2 and DP2,
packed rows (padded too at TP1), with the full KL in the loss (the reference's logits at the same positions),
one GRPO update from the same weights with the switch off (every position: the path the layout and full-KL
tests prove against single-process and dense runs) and on gives the same loss, logged KL, grad norm and full
gradient (every local parameter's main_grad after Megatron's grad finalisation), and the same actor and
reference logprob passes; and the output layer really saw fewer rows.

Tolerances (fp32 on CPU): loss, KL, grad norm 1e-6 relative; gradient 1e-6 relative (norm of the difference
over the norm); logprobs 1e-6 absolute.
"""

import dataclasses

import pytest
import torch

from grpo_mega.parallel.forked import run_ranks
from tests.trainer import layouts as L

TOL = 1e-6
LAYOUTS = {  # name: (tp, pp, dp, sequence_parallel, packings)
    "TP1": (1, 1, 1, False, (True, False)),
    "TP2-SP": (2, 1, 1, True, (True,)),
    "PP2": (1, 2, 1, False, (True,)),
    "DP2": (1, 1, 2, False, (True,)),
}


def _configs(packed: bool, on: bool) -> dict:
    kw = L.configs("token-mean", 2, "sgd", dict(packing=packed, response_only_logits=on))
    kw["algo_cfg"] = dataclasses.replace(kw["algo_cfg"], kl_estimator="full", kl_coef=2.0)
    return kw


def _count_rows(gpt, seen: list) -> None:
    layer = getattr(gpt, "output_layer", None)
    if layer is not None:
        layer.register_forward_hook(lambda m, args, out: seen.append(out[0].shape[0] * out[0].shape[1]))


def _rank(tp, pp, sp, packings):
    """On every rank: per packing, the logprob passes and one full-KL update with the switch off and on, from
    the same weights. Returns {(packed, on): (actor logp, reference logp, metrics, grads, output-layer rows)}."""
    from grpo_mega.conf import ParallelConfig
    from grpo_mega.models.builder import copy_weights
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=1234)
        parallel = ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp)
        cfg = L.model_cfg()
        base = _configs(True, False)
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
        for packed in packings:
            for on in (False, True):
                kw = _configs(packed, on)
                actor = Actor(cfg, parallel, **kw)
                copy_weights(first.built.gpt, actor.built.gpt)
                ref.batch = kw["batch"]
                seen = []
                _count_rows(actor.built.gpt, seen)
                logp = actor.logprobs(batch, L.TEMPERATURE)
                ref_logp = ref.logprobs(batch, L.TEMPERATURE)
                b = L.rollout(lengths="packing")
                b.old_logp = old_logp
                (m,) = actor.update(b, L.TEMPERATURE, reference=ref)
                grads = {n: p.main_grad.detach().double().clone() for n, p in actor.built.gpt.named_parameters()}
                out[(packed, on)] = (logp, ref_logp, m, grads, sum(seen))
        destroy_distributed()
        return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_response_only_equals_all_positions(name):
    tp, pp, dp, sp, packings = LAYOUTS[name]
    batch = L.rollout(lengths="packing")
    loss_positions = int(batch.loss_mask().sum())
    for per_rank in run_ranks(_rank, tp * pp * dp, tp, pp, sp, packings, timeout=300):
        for packed in packings:
            logp0, ref0, m0, g0, rows0 = per_rank[(packed, False)]
            logp1, ref1, m1, g1, rows1 = per_rank[(packed, True)]
            where = f"{name} packed={packed}"
            assert m0["skipped"] == 0.0 and m1["skipped"] == 0.0, where
            assert m0["kl"] > 0.01, where  # the reference differs: the full KL is in play
            for k in ("loss", "kl", "grad_norm", "entropy"):
                assert abs(m1[k] - m0[k]) <= TOL * abs(m0[k]), (where, k, m1[k], m0[k])
            assert float((logp1 - logp0).abs().max()) <= TOL, where
            assert float((ref1 - ref0).abs().max()) <= TOL, where
            assert float(logp0.abs().sum()) > 0
            num = sum(float((g1[k] - g0[k]).norm()) ** 2 for k in g0) ** 0.5
            den = sum(float(g.norm()) ** 2 for g in g0.values()) ** 0.5
            assert den > 0 and num <= TOL * den, f"{where}: gradient relative error {num / den:.2e}"
            if rows0:  # the last stage: fewer output-layer rows, the loss positions exactly (per DP rank's share)
                assert rows1 < rows0, (where, rows1, rows0)
                if dp == 1:
                    # the logprob pass and the update each: every loss position once
                    assert rows1 == 2 * loss_positions, (where, rows1, loss_positions)
