import itertools
import math

import pytest
import torch

from grpo_mega import algo
from grpo_mega.algo import policy_loss
from grpo_mega.algo.policy_loss import POLICY_LOSSES, Objective, kl_term, ppo_clip


def _actor_loss(a: Objective, mb: dict, logp, entropy, full_kl, normaliser):
    """Actor._loss's loss and metric sums before the policy loss moved into algo (grpo_mega/trainer/actor.py at
    ab5b7bc), verbatim but for reading the settings from `a` and taking the token statistics as arguments:
    ppo_clip must give exactly these numbers and gradients."""
    mask = mb["mask"]
    use_kl = a.kl_coef != 0 and not a.kl_in_reward
    if not use_kl:
        kl = None
    elif a.kl_estimator == "full":
        kl = full_kl
    else:
        kl = algo.kl_penalty(logp, mb["ref_logp"], a.kl_estimator)
    token_scale = algo.valid_token_scale(mask) if a.dapo_token_scale else None
    is_weight = None
    if a.engine_is_cap is not None:
        is_weight = algo.truncated_is_weight(mb["old_logp"], mb["engine_logp"], a.engine_is_cap)
        token_scale = is_weight if token_scale is None else token_scale * is_weight
    token_loss, terms = algo.grpo_token_loss(
        logp, mb["old_logp"], mb["advantages"], a.clip_ratio_low, a.clip_ratio_high, a.dual_clip,
        kl=kl, kl_coef=a.kl_coef if use_kl else 0.0,
        entropy=entropy if a.entropy_coef else None, entropy_coef=a.entropy_coef,
        token_scale=token_scale,
    )
    loss = algo.aggregate(token_loss, mask, a.loss_agg_mode, normaliser)
    m = mask.to(torch.float32)
    with torch.no_grad():
        log_ratio = algo.loss.log_ratio(logp, mb["old_logp"])
        valid = mask.bool()
        ratio = log_ratio.exp()
        stats = {
            "loss": loss.detach(),
            "pg_loss_sum": (terms["pg_loss"] * m).sum(),
            "entropy_sum": (entropy * m).sum(),
            "kl_sum": (kl * m).sum() if kl is not None
            else (algo.kl_penalty(logp, mb["ref_logp"], "k3") * m).sum() if "ref_logp" in mb else torch.zeros(()),
            "clipped_sum": (terms["clipped"] * m).sum(),
            "tokens": m.sum(),
            "ratio_sum": (ratio * m).sum(),
            "ratio_min": ratio[valid].min() if valid.any() else torch.tensor(math.inf),
            "ratio_max": ratio[valid].max() if valid.any() else torch.tensor(-math.inf),
            "is_weight_sum": (is_weight * m).sum() if is_weight is not None else m.sum(),
            "is_capped_sum": ((is_weight >= a.engine_is_cap) * m).sum() if is_weight is not None else torch.zeros(()),
            "extreme": algo.has_extreme_ratio(logp, mb["old_logp"], mask, a.early_stop_imp_ratio).float()
            if a.early_stop_imp_ratio else torch.zeros(()),
        }
    return loss, stats


def _micro(b=6, t=9, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    mb = {
        "old_logp": old,
        "ref_logp": old + torch.randn(b, t, generator=g, dtype=dtype) * 0.3,
        "engine_logp": old + torch.randn(b, t, generator=g, dtype=dtype) * 0.3,
        "advantages": torch.randn(b, generator=g, dtype=dtype),
        "mask": torch.arange(t).unsqueeze(0) < torch.randint(0, t + 1, (b, 1), generator=g),
    }
    logits = torch.randn(b, t, generator=g, dtype=dtype) * 0.4  # stands in for the model's output
    return mb, logits, torch.rand(b, t, generator=g, dtype=dtype) * 2, torch.rand(b, t, generator=g, dtype=dtype)


def _stats_from(logits, old_logp, entropy_base, full_base):
    """Token statistics with a gradient path back to `logits`, as the trainer's come from the model's."""
    logp = old_logp + logits
    entropy = entropy_base + logits.square()
    full_kl = full_base + 0.5 * logits.square()
    return logp, entropy, full_kl


def _run(fn, obj, mb, logits0, entropy_base, full_base, normaliser):
    logits = logits0.clone().requires_grad_(True)
    logp, entropy, full_kl = _stats_from(logits, mb["old_logp"], entropy_base, full_base)
    loss, stats = fn(obj, mb, logp, entropy, full_kl, normaliser)
    loss.backward()
    return loss.detach(), stats, logits.grad


def _via_registry(obj, mb, logp, entropy, full_kl, normaliser):
    return POLICY_LOSSES.get("ppo_clip")(
        obj, logp=logp, old_logp=mb["old_logp"], advantages=mb["advantages"], mask=mb["mask"], normaliser=normaliser,
        entropy=entropy, ref_logp=mb.get("ref_logp"), full_kl=full_kl, engine_logp=mb.get("engine_logp"))


def test_registry_lookup_and_unknown_name():
    assert POLICY_LOSSES.get("ppo_clip") is ppo_clip and "ppo_clip" in POLICY_LOSSES
    with pytest.raises(ValueError, match=r"unknown policy loss 'gspo9'; valid: bypass_ppo_clip, bypass_reinforce, "
                                         r"cispo, clip_cov, dppo_kl, dppo_tv, dro, geo_mean, gpg, gspo, gspo_token, "
                                         r"kl_cov, ppo_clip, sapo"):
        POLICY_LOSSES.get("gspo9")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ppo_clip_is_bit_identical_to_the_actors_loss(dtype):
    mb, logits, ent, full = _micro(dtype=dtype)
    settings = itertools.product(
        ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        (0.0, 0.05), ("k1", "k3", "full"), (False, True), (0.0, 0.01), (False, True), (None, 2.0), (None, 3.0),
        (None, 1.5),
    )
    for agg, kl_coef, est, kir, ent_coef, dapo, is_cap, dual, early in settings:
        if kir and est == "full":
            continue
        obj = Objective(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=dual, kl_coef=kl_coef, kl_estimator=est,
                        kl_in_reward=kir, entropy_coef=ent_coef, loss_agg_mode=agg, dapo_token_scale=dapo,
                        engine_is_cap=is_cap, early_stop_imp_ratio=early)
        normaliser = algo.local_normaliser(agg, mb["mask"], 9).float()
        got = _run(_via_registry, obj, mb, logits, ent, full, normaliser)
        want = _run(_actor_loss, obj, mb, logits, ent, full, normaliser)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        assert got[1].keys() >= want[1].keys()
        assert set(got[1]) == set(policy_loss.METRIC_SUMS + policy_loss.METRIC_MINS + policy_loss.METRIC_MAXS)
        for k in want[1]:
            assert torch.equal(got[1][k], want[1][k]), k


def test_an_empty_micro_batch():
    mb, logits, ent, full = _micro()
    mb["mask"] = torch.zeros_like(mb["mask"])
    obj = Objective(kl_coef=0.1)
    loss, stats, grad = _run(_via_registry, obj, mb, logits, ent, full, torch.tensor(0.0))
    assert float(loss) == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert stats["ratio_min"] == math.inf and stats["ratio_max"] == -math.inf and stats["tokens"] == 0


def test_ppo_clip_by_hand_from_the_algo_functions():
    """token-mean of the clipped surrogate + beta k3 - c_H H, written out with algo.loss's pieces."""
    mb, logits, ent, _ = _micro(dtype=torch.float64)
    logp = mb["old_logp"] + logits
    obj = Objective(clip_ratio_low=0.2, clip_ratio_high=0.3, kl_coef=0.04, kl_estimator="k3", entropy_coef=0.01)
    n = mb["mask"].sum()
    loss, stats = ppo_clip(obj, logp=logp, old_logp=mb["old_logp"], advantages=mb["advantages"], mask=mb["mask"],
                           normaliser=n, entropy=ent, ref_logp=mb["ref_logp"])
    pg, clipped = algo.clipped_surrogate(logp, mb["old_logp"], mb["advantages"], 0.2, 0.3)
    kl = algo.kl_penalty(logp, mb["ref_logp"], "k3")
    m = mb["mask"].double()
    expected = ((pg + 0.04 * kl + algo.entropy_bonus(ent, 0.01)) * m).sum() / n
    assert float(loss) == pytest.approx(float(expected), rel=1e-12)
    assert float(stats["pg_loss_sum"]) == pytest.approx(float((pg * m).sum()), rel=1e-12)
    assert float(stats["kl_sum"]) == pytest.approx(float((kl * m).sum()), rel=1e-12)
    assert float(stats["clipped_sum"]) == float((clipped * m).sum())


def _loss(obj, mb, logp, entropy, full_kl=None, ref=True, engine=False):
    return ppo_clip(obj, logp=logp, old_logp=mb["old_logp"], advantages=mb["advantages"], mask=mb["mask"],
                    normaliser=mb["mask"].sum(), entropy=entropy, ref_logp=mb["ref_logp"] if ref else None,
                    full_kl=full_kl, engine_logp=mb["engine_logp"] if engine else None)


def test_the_objective_includes_and_excludes_terms_per_settings():
    mb, logits, ent, full = _micro(dtype=torch.float64)
    logp = mb["old_logp"] + logits
    bare = _loss(Objective(), mb, logp, ent)[0]
    # KL: in the loss with beta != 0; not with beta = 0, nor when it went into the reward
    with_kl = _loss(Objective(kl_coef=0.1, kl_estimator="k1"), mb, logp, ent)[0]
    k1 = ((logp - mb["ref_logp"]) * mb["mask"]).sum() / mb["mask"].sum()
    assert float(with_kl - bare) == pytest.approx(float(0.1 * k1), rel=1e-9)
    assert torch.equal(_loss(Objective(kl_coef=0.0, kl_estimator="k1"), mb, logp, ent)[0], bare)
    assert torch.equal(_loss(Objective(kl_coef=0.1, kl_in_reward=True), mb, logp, ent)[0], bare)
    assert Objective(kl_coef=0.1).kl_in_loss and not Objective(kl_coef=0.1, kl_in_reward=True).kl_in_loss
    # without the KL in the loss, ref_logp is only for the metric (k3); without it the metric is 0
    assert float(_loss(Objective(), mb, logp, ent, ref=False)[1]["kl_sum"]) == 0.0
    assert torch.equal(_loss(Objective(), mb, logp, ent, ref=False)[0], bare)
    # full KL: the per-token values passed in are the term
    fk = _loss(Objective(kl_coef=0.1, kl_estimator="full"), mb, logp, ent, full_kl=full, ref=False)[0]
    assert float(fk - bare) == pytest.approx(float(0.1 * (full * mb["mask"]).sum() / mb["mask"].sum()), rel=1e-9)
    assert Objective(kl_coef=0.1, kl_estimator="full").full_kl_in_loss
    assert not Objective(kl_coef=0.1, kl_estimator="full", kl_in_reward=True).full_kl_in_loss
    # entropy bonus: only with entropy_coef != 0 (and then entropy carries gradient)
    e, lg = ent.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    _loss(Objective(), mb, lg, e)[0].backward()
    assert e.grad is None and lg.grad is not None
    _loss(Objective(entropy_coef=0.01), mb, lg, e)[0].backward()
    assert e.grad is not None and e.grad.abs().sum() > 0
    with_ent = _loss(Objective(entropy_coef=0.01), mb, logp, ent)[0]
    h = (ent * mb["mask"]).sum() / mb["mask"].sum()
    assert float(bare - with_ent) == pytest.approx(float(0.01 * h), rel=1e-9)
    # importance correction: weights of 1 (engine == old) leave the loss; others change it
    same = dict(mb, engine_logp=mb["old_logp"])
    assert torch.equal(_loss(Objective(engine_is_cap=2.0), same, logp, ent, engine=True)[0], bare)
    assert not torch.equal(_loss(Objective(engine_is_cap=2.0), mb, logp, ent, engine=True)[0], bare)
    assert kl_term(Objective(), logp, mb["ref_logp"], None) is None


def test_missing_inputs_say_what_is_needed():
    mb, logits, ent, _ = _micro()
    logp = mb["old_logp"] + logits
    with pytest.raises(ValueError, match="kl_estimator='k3' needs ref_logp"):
        _loss(Objective(kl_coef=0.1), mb, logp, ent, ref=False)
    with pytest.raises(ValueError, match="kl_estimator='full' with algo.kl_coef != 0 needs the per-token full KL"):
        _loss(Objective(kl_coef=0.1, kl_estimator="full"), mb, logp, ent)
    with pytest.raises(ValueError, match="engine_is_cap needs the engine's logprobs"):
        _loss(Objective(engine_is_cap=2.0), mb, logp, ent)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        Objective(kl_estimator="k9")
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        Objective(loss_agg_mode="mean")
