"""Rollout rejection on k2/k3 statistics (token, seq_sum, seq_mean, seq_max), its combination with the
correction's IS weights, and the IS batch normalisation, against references written here from verl's published
definitions (rollout_corr_helper: lr = log pi_old - log pi_rollout clamped to +-20, k2 = lr^2/2, k3 = e^lr - 1 - lr,
a token or response rejected when its statistic exceeds the threshold; batch normalisation divides the weights by
their mean over valid tokens, or over responses at sequence level), in float64 Python loops: the weights, and the
loss and gradient of ppo_clip with them, to 1e-12; log-ratios of +-25, a one-token response, an all-masked row."""

import math

import pytest
import torch

from grpo_mega.algo import correction as C
from grpo_mega.algo.policy_loss import POLICY_LOSSES, Objective
from grpo_mega.conf.algo import AlgoConfig

B, T = 7, 10


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    eng = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    lens = torch.randint(2, T + 1, (B, 1), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lens) & (torch.rand(B, T, generator=g) > 0.15)
    mask[0, 0] = True
    mask[2] = False  # all masked
    mask[4] = False
    mask[4, 3] = True  # a one-token response
    eng[1, 1] = old[1, 1] + 25.0  # log rho = -25
    eng[5, 0] = old[5, 0] - 25.0  # log rho = +25
    mask[1, 1] = mask[5, 0] = True
    return old, eng, mask


def _valid(mask, i):
    return [t for t in range(T) if mask[i, t]]


def _stat(old, eng, mask, i, t, name):
    """The statistic of token t of response i (of the whole response at the seq_* levels), from the definition."""
    level, k = name.rsplit("_", 1)

    def d(tt):
        lr = min(max(float(old[i, tt] - eng[i, tt]), -20.0), 20.0)
        return 0.5 * lr * lr if k == "k2" else math.exp(lr) - 1.0 - lr

    ts = _valid(mask, i)
    if level == "token":
        return d(t)
    vals = [d(tt) for tt in ts] or [0.0]
    return {"seq_sum": sum(vals), "seq_mean": sum(vals) / max(len(ts), 1), "seq_max": max(vals)}[level]


def _is_weight(old, eng, mask, i, t, level, high):
    """Truncated IS weight min(rho, high) at token or sequence level (rho of the sum of the response's log-ratios)."""
    if level == "token":
        lr = float(old[i, t] - eng[i, t])
    else:
        lr = sum(float(old[i, tt] - eng[i, tt]) for tt in _valid(mask, i))
    return min(math.exp(min(max(lr, -20.0), 20.0)), high)


@pytest.mark.parametrize("name", C.REJECTIONS)
@pytest.mark.parametrize("is_level", [None, "token", "sequence"])
def test_rejection_with_and_without_is_weights(name, is_level):
    old, eng, mask = _inputs(0)
    values = sorted({_stat(old, eng, mask, i, t, name) for i in range(B) for t in _valid(mask, i)})
    thr = values[len(values) // 2]  # the median value: some kept, some rejected
    c = C.resolve(is_level, high=2.0) if is_level else None
    r = C.resolve_rejection(name, thr)
    got, _, hit = C.rollout_weight(old, eng, mask, c, r)
    kept = rejected = 0
    for i in range(B):
        for t in _valid(mask, i):
            keep = _stat(old, eng, mask, i, t, name) <= thr
            w = _is_weight(old, eng, mask, i, t, is_level, 2.0) if is_level else 1.0
            assert float(got[i, t]) == pytest.approx(w if keep else 0.0, rel=1e-12, abs=0), (i, t)
            raw = _is_weight(old, eng, mask, i, t, is_level, 1e300) if is_level else 1.0
            assert bool(hit[i, t]) == (not keep or raw > 2.0)
            kept += keep
            rejected += not keep
    assert kept and rejected  # the threshold cuts through the data


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_batch_normalisation_divides_by_the_mean_weight(level):
    old, eng, mask = _inputs(1)
    c = C.resolve(level, high=2.0)
    w = C.correction_weight(old, eng, mask, c)[0]
    # the definition: token level, mean over valid tokens; sequence levels, mean over responses with a valid token
    if level == "token":
        vals = [float(w[i, t]) for i in range(B) for t in _valid(mask, i)]
    else:
        vals = [float(w[i, _valid(mask, i)[0]]) for i in range(B) if _valid(mask, i)]
    mean = sum(vals) / len(vals)
    parts = [C.batch_mean_sums(old[s], eng[s], mask[s], c) for s in (slice(0, 3), slice(3, B))]  # two ranks
    assert C.batch_mean(sum(parts)) == pytest.approx(mean, rel=1e-13)
    got = C.rollout_weight(old, eng, mask, c, None, mean)[0]
    for i in range(B):
        for t in _valid(mask, i):
            assert float(got[i, t]) == pytest.approx(float(w[i, t]) / mean, rel=1e-13)
    assert C.batch_mean(torch.zeros(2, dtype=torch.float64)) == 1.0  # nothing valid: no scaling


def test_ppo_clip_with_correction_rejection_and_batch_norm_matches_a_dense_loss():
    """token-mean PPO loss, each token weighted by min(rho, 2) / mean * keep(seq_max_k3 <= 0.2); loss and
    gradient against autograd through the Python-loop loss."""
    old, eng, mask = _inputs(2)
    g = torch.Generator().manual_seed(9)
    logp0 = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[3] = 0.0
    n = float(mask.sum())
    c = C.resolve("token", high=2.0)
    sums = C.batch_mean_sums(old, eng, mask, c)
    mean = C.batch_mean(sums)
    obj = Objective(rollout_correction="token", rollout_correction_high=2.0, rollout_rejection="seq_max_k3",
                    rollout_rejection_threshold=0.2, rollout_is_batch_norm=True, is_batch_mean=mean)
    logp = logp0.clone().requires_grad_(True)
    loss, stats = POLICY_LOSSES.get("ppo_clip")(obj, logp=logp, old_logp=old, advantages=adv, mask=mask,
                                                normaliser=torch.tensor(n, dtype=torch.float64),
                                                entropy=torch.zeros_like(old), engine_logp=eng)
    loss.backward()
    ref = logp0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    rejected = 0
    for i in range(B):
        ts = _valid(mask, i)
        keep = _stat(old, eng, mask, i, ts[0], "seq_max_k3") <= 0.2 if ts else True
        rejected += (not keep) * len(ts)
        for t in ts:
            w = (_is_weight(old, eng, mask, i, t, "token", 2.0) / mean) if keep else 0.0
            r = torch.exp((ref[i, t] - old[i, t]).clamp(-20, 20))
            a = float(adv[i])
            total = total + w * torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    (total / n).backward()
    assert float(loss.detach()) == pytest.approx(float(total.detach() / n), rel=1e-12)
    torch.testing.assert_close(logp.grad, ref.grad, rtol=1e-12, atol=1e-15)
    assert 0 < rejected < n and float(stats["is_capped_sum"]) >= rejected


def test_settings_are_refused_with_one_line():
    for kw, words in [(dict(rollout_rejection="seq_max_k1", rollout_rejection_threshold=1.0), "must be one of"),
                      (dict(rollout_rejection="token_k3"), "needs algo.rollout_rejection_threshold > 0"),
                      (dict(rollout_rejection="token_k3", rollout_rejection_threshold=0.0), "> 0"),
                      (dict(rollout_rejection_threshold=0.5), "without algo.rollout_rejection"),
                      (dict(rollout_is_batch_norm=True), "rollout_is_batch_norm=true normalises")]:
        with pytest.raises(ValueError, match=words) as e:
            AlgoConfig(**kw)
        assert "\n" not in str(e.value)
    obj = Objective(rollout_correction="token", rollout_is_batch_norm=True)  # no batch mean given at run time
    old, eng, mask = _inputs(3)
    with pytest.raises(ValueError, match="is_batch_mean"):
        POLICY_LOSSES.get("ppo_clip")(obj, logp=old.clone(), old_logp=old, advantages=torch.zeros(B), mask=mask,
                                      normaliser=torch.tensor(1.0), entropy=torch.zeros_like(old), engine_logp=eng)
    assert AlgoConfig(rollout_rejection="seq_max_k2", rollout_rejection_threshold=1.0).objective().rejection == \
        C.Rejection("seq_max", "k2", 1.0)
