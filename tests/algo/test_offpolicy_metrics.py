"""verl's off-policy diagnostics (grpo_mega.algo.correction.offpolicy_sums / offpolicy_metrics) and the policy
loss's ppo_kl and pg_clipfrac_lower, against references written here from the published definitions (verl's
rollout_corr_helper.compute_offpolicy_metrics and compute_is_metrics, core_algos' ppo_kl and pg_clipfrac_lower),
in float64 Python loops over the valid tokens: random inputs with holes, an empty response, log-ratios of +-25
(beyond the e^+-20 clamp), and rows split over "ranks" (the sums add up)."""

import math

import pytest
import torch

from grpo_mega.algo import correction as C
from grpo_mega.algo.policy_loss import POLICY_LOSSES, Objective, mini_batch_metrics

B, T = 6, 9


def _inputs(seed, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    eng = old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    lens = torch.randint(1, T + 1, (B, 1), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lens) & (torch.rand(B, T, generator=g) > 0.2)
    mask[0, 0] = True
    mask[2] = False  # a response without a valid token
    return old, eng, mask


def _reference(old, eng, mask, weight=None):
    """verl's definitions, token by token: KL(engine || old) by k1 and k3, chi2 at token and sequence level,
    per-sequence perplexities and their ratio, and the effective sample size 1 / mean((w / mean w)^2)."""
    toks, seqs = [], []
    for i in range(B):
        ts = [t for t in range(T) if mask[i, t]]
        if not ts:
            continue
        lrs = [float(old[i, t] - eng[i, t]) for t in ts]
        for t, lr in zip(ts, lrs):
            safe = min(max(lr, -20.0), 20.0)
            w = math.exp(safe) if weight is None else float(weight[i, t])
            toks.append(dict(k1=-lr, k3=math.exp(safe) - 1 - safe, rho2=math.exp(2 * safe), w=w))
        mo = sum(float(old[i, t]) for t in ts) / len(ts)
        me = sum(float(eng[i, t]) for t in ts) / len(ts)
        seqs.append(dict(rho2=math.exp(2 * min(max(sum(lrs), -20.0), 20.0)), tp=math.exp(-mo), rp=math.exp(-me),
                         tl=-mo, rl=-me, d=me - mo))
    n, q = len(toks), len(seqs)
    mean_w = sum(x["w"] for x in toks) / n
    return {
        "kl": sum(x["k1"] for x in toks) / n,
        "k3_kl": sum(x["k3"] for x in toks) / n,
        "chi2_token": sum(x["rho2"] for x in toks) / n - 1,
        "chi2_seq": sum(s["rho2"] for s in seqs) / q - 1,
        "training_ppl": sum(s["tp"] for s in seqs) / q,
        "rollout_ppl": sum(s["rp"] for s in seqs) / q,
        "training_log_ppl": sum(s["tl"] for s in seqs) / q,
        "rollout_log_ppl": sum(s["rl"] for s in seqs) / q,
        "log_ppl_diff": sum(s["d"] for s in seqs) / q,
        "log_ppl_abs_diff": sum(abs(s["d"]) for s in seqs) / q,
        "ppl_ratio": sum(math.exp(s["d"]) for s in seqs) / q,
        "ess": 1.0 / (sum((x["w"] / mean_w) ** 2 for x in toks) / n),
    }


def _check(got, want, rel=1e-12):
    assert set(got) == {f"rollout_corr/{k}" for k in want}
    for k, v in want.items():
        assert got[f"rollout_corr/{k}"] == pytest.approx(v, rel=rel, abs=1e-12), k


@pytest.mark.parametrize("seed,spread", [(0, 0.4), (1, 0.01), (2, 3.0)])
def test_offpolicy_metrics_match_the_definitions(seed, spread):
    old, eng, mask = _inputs(seed, spread)
    _check(C.offpolicy_metrics(C.offpolicy_sums(old, eng, mask)), _reference(old, eng, mask))
    # with the correction's weights (truncated at 2), the ESS is theirs; the divergences are unchanged
    c = C.resolve("token", high=2.0)
    w = C.correction_weight(old, eng, mask, c)[0]
    _check(C.offpolicy_metrics(C.offpolicy_sums(old, eng, mask, w)), _reference(old, eng, mask, w))


def test_sums_add_over_ranks_and_float32_inputs():
    old, eng, mask = _inputs(3)
    parts = [C.offpolicy_sums(old[s], eng[s], mask[s]) for s in (slice(0, 2), slice(2, 5), slice(5, B))]
    _check(C.offpolicy_metrics(sum(parts)), _reference(old, eng, mask))
    got32 = C.offpolicy_metrics(C.offpolicy_sums(old.float(), eng.float(), mask))
    _check(got32, _reference(old.float().double(), eng.float().double(), mask))


def test_extreme_log_ratios_stay_finite_and_identical_inputs_give_zero():
    old, eng, mask = _inputs(4)
    eng = old.clone()
    eng[0, 0], eng[1, :] = old[0, 0] + 25.0, old[1, :] - 25.0  # log rho = -25 and +25
    got = C.offpolicy_metrics(C.offpolicy_sums(old, eng, mask))
    assert all(math.isfinite(v) for v in got.values())
    _check(got, _reference(old, eng, mask))
    same = C.offpolicy_metrics(C.offpolicy_sums(old, old.clone(), mask))
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff"):
        assert same[f"rollout_corr/{k}"] == 0.0
    assert same["rollout_corr/ppl_ratio"] == 1.0 and same["rollout_corr/ess"] == pytest.approx(1.0, abs=1e-15)
    assert C.offpolicy_metrics(C.offpolicy_sums(old, eng, torch.zeros_like(mask))) == {}


def _stats(name, obj, logp, old, adv, mask):
    loss, stats = POLICY_LOSSES.get(name)(obj, logp=logp, old_logp=old, advantages=adv, mask=mask,
                                          normaliser=mask.sum().double(), entropy=torch.zeros_like(logp))
    sums = {k: float(v) for k, v in stats.items() if k.endswith("_sum") or k in ("loss", "tokens", "seqs",
                                                                                  "extreme")}
    mins = {k: float(stats[k]) for k in ("ratio_min", "is_ratio_min")}
    maxs = {k: float(stats[k]) for k in ("ratio_max", "is_ratio_max")}
    return mini_batch_metrics(sums, mins, maxs)


@pytest.mark.parametrize("dual_clip", [None, 3.0, 1.5])
def test_ppo_kl_and_pg_clipfrac_lower(dual_clip):
    """verl: ppo_kl = masked mean of log pi_old - log pi; pg_clipfrac_lower = masked mean of
    [max(-A r, -A clip(r)) > -c A] * [A < 0], the share of tokens the dual clip bounded."""
    g = torch.Generator().manual_seed(5)
    old, _, mask = _inputs(5)
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 1.0
    logp[1, 0] = old[1, 0] + 25.0  # beyond the ratio clamp
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[4] = 0.0  # a zero-advantage row
    kl, low, n = 0.0, 0.0, 0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            n += 1
            kl += float(old[i, t] - logp[i, t])
            r = math.exp(min(max(float(logp[i, t] - old[i, t]), -20.0), 20.0))
            a = float(adv[i])
            surrogate = max(-a * r, -a * min(max(r, 0.8), 1.2))
            low += dual_clip is not None and a < 0 and surrogate > -a * dual_clip
    got = _stats("ppo_clip", Objective(dual_clip=dual_clip), logp, old, adv, mask)
    assert got["ppo_kl"] == pytest.approx(kl / n, rel=1e-12)
    assert got["pg_clipfrac_lower"] == low / n
    if dual_clip == 1.5:
        assert 0 < low < n  # the test sees both sides


def test_gspo_pg_clipfrac_lower_counts_the_responses_the_dual_clip_bounded():
    g = torch.Generator().manual_seed(6)
    old, _, mask = _inputs(6)
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8
    adv = torch.tensor([-1.0, -0.5, 1.0, -2.0, 0.0, -0.3], dtype=torch.float64)
    c = 1.2
    low, n = 0, 0
    for i in range(B):
        ts = [t for t in range(T) if mask[i, t]]
        if not ts:
            continue
        s = math.exp(min(sum(float(logp[i, t] - old[i, t]) for t in ts) / len(ts), 10.0))
        n += len(ts)
        low += len(ts) * (float(adv[i]) < 0 and s > c)
    for name in ("gspo", "gspo_token"):
        got = _stats(name, Objective(dual_clip=c, loss_agg_mode="seq-mean-token-mean"), logp, old, adv, mask)
        assert got["pg_clipfrac_lower"] == pytest.approx(low / n, rel=1e-12), name
    assert 0 < low < n
