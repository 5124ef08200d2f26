"""The full-vocabulary KL in the loss (`algo.kl_estimator=full`): the reference runs in lockstep with the actor
inside Megatron's schedule, and the update gives the loss, the logged KL and the full gradient of a dense
single-process computation we did not write the parallel parts of: both TP1 models' whole logits,
`torch.log_softmax`, kl_t = sum_v p (log p - log q) over the real vocabulary, grpo_mega.algo's token loss and
aggregation with the mini-batch normaliser, torch autograd. At TP1, TP2 with SP, PP2, TP2xPP2 and DP2, every
aggregation mode, packed and padded; tied embeddings with full recompute at PP2 and TP2xPP2.

The reference's weights are W0 plus noise (with equal weights the KL and its gradient vanish); the gradient is
read back through the optimizer (layouts.OPTIMS: W0 - W1 = g). Tolerances (fp32 on CPU): loss, KL metric and
gradient 1e-5 relative.
"""

import dataclasses
import os

import pytest
import torch

from grpo_mega.parallel.forked import run_ranks
from tests.trainer import layouts as L

REL_TOL = 1e-5
KL_COEF = 2.0  # large, so that a wrong KL gradient cannot hide under the policy-gradient term
REF_NOISE = 0.05  # W_ref = W0 + REF_NOISE * N(0, 1): a KL of about 0.1 nat per token
# (mode, packed?, micro_batch_size): every mode packed (rows of 44 tokens: several sequences each) and padded
# (micro-batches of 2 rows: 4 per DP rank, so 1F1B has a steady state at PP2)
COMBOS = [(m, packed, 2) for packed in (True, False) for m in L.MODES]
LAYOUTS = {  # name: (tp, pp, dp, sequence_parallel)
    "TP1": (1, 1, 1, False),
    "TP2-SP": (2, 1, 1, True),
    "PP2": (1, 2, 1, False),
    "TP2xPP2": (2, 2, 1, False),
    "DP2": (1, 1, 2, False),
}


def _configs(mode, packed, mbs):
    kw = L.configs(mode, mbs, "adam", dict(packing=packed))
    kw["algo_cfg"] = dataclasses.replace(kw["algo_cfg"], kl_estimator="full", kl_coef=KL_COEF)
    return kw


def _name(combo):
    mode, packed, mbs = combo
    return f"{mode}_{'packed' if packed else 'padded'}_{mbs}"


def _dense(gpt, ref_gpt, batch, old_logp, mode, kl_coef):
    """The GRPO loss of the whole mini-batch from both models' whole logits, and its backward (into gpt's
    .grad). Returns (loss, mean full KL over the loss mask)."""
    cfg = L.configs(mode, 1)["algo_cfg"]
    tokens = batch.tokens
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    v = L.model_cfg().vocab_size
    logits = gpt(tokens, pos, None)[..., :v]  # [N, L, V]: the padded vocabulary columns cut off
    with torch.no_grad():
        ref_logits = ref_gpt(tokens, pos, None)[..., :v]
    p = torch.log_softmax(logits.double() / L.TEMPERATURE, dim=-1)
    q = torch.log_softmax(ref_logits.double() / L.TEMPERATURE, dim=-1)
    logp = p.gather(-1, batch.labels().unsqueeze(-1)).squeeze(-1)
    entropy = -(p.exp() * p).sum(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    mask = batch.loss_mask()
    from grpo_mega import algo

    token_loss, _ = algo.grpo_token_loss(
        logp, old_logp.double(), batch.advantages.double(), cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.dual_clip,
        kl=kl, kl_coef=kl_coef, entropy=entropy, entropy_coef=cfg.entropy_coef,
    )
    loss = algo.aggregate(token_loss, mask, mode, algo.local_normaliser(mode, mask, L.MAX_RESPONSE))
    loss.backward()
    m = mask.double()
    return float(loss), float((kl.detach() * m).sum() / m.sum())


def make_dense(w0_dir, wref_dir, tied=False):
    """Single process: W0 and W_ref = W0 + noise (saved), the old logprobs, and per mode the dense loss, the
    mean full KL and the gradient; also the gradient without the KL term (to show that the KL's part of the
    gradient is large)."""
    from megatron.core import dist_checkpointing

    from grpo_mega.conf import ParallelConfig, PrecisionConfig
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=1234)
        cfg = L.model_cfg(tied)
        actor = Actor(cfg, ParallelConfig(), **_configs("token-mean", True, 2))
        for d in (w0_dir, wref_dir):
            os.makedirs(d, exist_ok=True)
        dist_checkpointing.save(actor.built.gpt.sharded_state_dict(), w0_dir)
        batch = L.rollout(lengths="packing")
        old_logp = L.perturbed(actor.logprobs(batch, L.TEMPERATURE), batch.response_mask(), 0.3, 1)
        precision = PrecisionConfig(params_dtype="fp32")
        gpt, _ = build_gpt(cfg, ParallelConfig(), precision)
        ref_gpt, _ = build_gpt(cfg, ParallelConfig(), precision)
        w0 = dist_checkpointing.load(gpt.sharded_state_dict(), w0_dir)
        gpt.load_state_dict(w0)
        g = torch.Generator().manual_seed(5)
        ref_gpt.load_state_dict(dist_checkpointing.load(ref_gpt.sharded_state_dict(), w0_dir))
        with torch.no_grad():
            for p in ref_gpt.parameters():
                p.add_(torch.randn(p.shape, generator=g) * REF_NOISE)
        dist_checkpointing.save(ref_gpt.sharded_state_dict(), wref_dir)
        names = {id(p): n for n, p in gpt.named_parameters()}
        out = {}
        for mode in L.MODES + ["no-kl"]:
            gpt.zero_grad(set_to_none=True)
            loss, kl = _dense(gpt, ref_gpt, batch, old_logp, "token-mean" if mode == "no-kl" else mode,
                              0.0 if mode == "no-kl" else KL_COEF)
            grads = {names[id(p)]: p.grad.double().clone() for p in gpt.parameters()}
            out[mode] = (loss, kl, grads)
        w0_state = L.full_state(gpt)
        destroy_distributed()
        return w0_state, old_logp, out


def run_layout(tp, pp, sp, w0_dir, wref_dir, out_dir, old_logp, combos, tied=False, parallel_kw=None):
    """On every rank: for each combo, W0 into a fresh actor, one update with the full KL against a Reference
    holding W_ref (no ref_logp given: the update must not need it), W1 saved. Returns {combo: metrics} and
    whether the reference's weights stayed as they were."""
    from megatron.core import dist_checkpointing

    from grpo_mega.conf import ParallelConfig
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=1234)
        parallel = ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp, **(parallel_kw or {}))
        cfg = L.model_cfg(tied)
        kw = _configs("token-mean", True, 2)
        ref = Reference(cfg, parallel, kw["precision"], kw["batch"])
        ref.built.gpt.load_state_dict(dist_checkpointing.load(ref.built.gpt.sharded_state_dict(), wref_dir))
        ref0 = L.full_state(ref.built.gpt)
        results = {}
        for combo in combos:
            actor = Actor(cfg, parallel, **_configs(*combo))
            L._load(actor, w0_dir)
            batch = L.rollout(lengths="packing")
            batch.old_logp = old_logp
            (m,) = actor.update(batch, L.TEMPERATURE, reference=ref)
            path = os.path.join(out_dir, _name(combo))
            os.makedirs(path, exist_ok=True)
            dist_checkpointing.save(actor.built.gpt.sharded_state_dict(), path)
            results[combo] = m
        ref_frozen = all(torch.equal(v, L.full_state(ref.built.gpt)[k]) for k, v in ref0.items())
        destroy_distributed()
        return results, ref_frozen


def _rel_grad(w0, state, grads):
    num = sum(float(((w0[k] - state[k]) - grads.get(k, torch.zeros_like(w0[k]))).norm()) ** 2 for k in w0) ** 0.5
    den = sum(float(g.norm()) ** 2 for g in grads.values()) ** 0.5
    return num / den


def _check_layout(tmp, dense, name, tp, pp, dp, sp, combos, tied=False, parallel_kw=None):
    w0, old_logp, per_mode = dense
    out = os.path.join(tmp, name)
    sub = "tied_" if tied else ""
    res = run_ranks(run_layout, tp * pp * dp, tp, pp, sp, os.path.join(tmp, sub + "w0"), os.path.join(tmp, sub + "wref"),
                    out, old_logp, combos, tied, parallel_kw, timeout=600)
    (states,) = run_ranks(L.load_many, 1, [os.path.join(out, _name(c)) for c in combos], tied, timeout=300)
    for metrics, ref_frozen in res:
        assert ref_frozen
        for combo in combos:
            loss, kl, _ = per_mode[combo[0]]
            m = metrics[combo]
            assert m["skipped"] == 0.0, (combo, m)
            assert abs(m["loss"] - loss) <= REL_TOL * abs(loss), (combo, m["loss"], loss)
            assert abs(m["kl"] - kl) <= REL_TOL * kl, (combo, m["kl"], kl)  # the logged KL: the mean full KL
    for combo in combos:
        rel = _rel_grad(w0, states[os.path.join(out, _name(combo))], per_mode[combo[0]][2])
        assert rel <= REL_TOL, f"{name} {_name(combo)}: gradient relative error {rel:.2e}"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("full_kl"))


@pytest.fixture(scope="module")
def dense(tmp):
    (out,) = run_ranks(make_dense, 1, os.path.join(tmp, "w0"), os.path.join(tmp, "wref"), timeout=600)
    return out


def test_dense_reference_is_nontrivial(dense):
    _, _, per_mode = dense
    for mode in L.MODES:
        assert 0.02 < per_mode[mode][1] < 1.0  # the reference differs: a KL of a few hundredths to a nat
    # the KL term is a large part of the gradient: dropping it moves the gradient by more than 10%
    with_kl, without = per_mode["token-mean"][2], per_mode["no-kl"][2]
    diff = sum(float((with_kl[k] - without[k]).norm()) ** 2 for k in with_kl) ** 0.5
    norm = sum(float(g.norm()) ** 2 for g in with_kl.values()) ** 0.5
    assert diff > 0.1 * norm
    # and the four modes differ
    assert len({round(per_mode[m][0], 6) for m in L.MODES}) == 4


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_full_kl_update_matches_dense(dense, tmp, name):
    tp, pp, dp, sp = LAYOUTS[name]
    _check_layout(tmp, dense, name, tp, pp, dp, sp, COMBOS)


def test_full_kl_with_tied_embeddings_and_recompute(tmp):
    """Tied input/output embeddings on the first and the last pipeline stage of both models, under full
    activation recompute of the actor (the reference, in eval mode and without grad, never recomputes)."""
    (dense_tied,) = run_ranks(make_dense, 1, os.path.join(tmp, "tied_w0"), os.path.join(tmp, "tied_wref"), True,
                              timeout=600)
    combos = [("token-mean", True, 2), ("seq-mean-token-mean", False, 2)]
    for name, (tp, pp) in {"tied_PP2": (1, 2), "tied_TP2xPP2": (2, 2)}.items():
        _check_layout(tmp, dense_tied, name, tp, pp, 1, False, combos, tied=True, parallel_kw=dict(recompute="full"))
