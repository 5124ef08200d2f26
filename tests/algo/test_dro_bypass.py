"""dro and verl's bypass mode (bypass_ppo_clip, bypass_reinforce) against dense float64 references written here
from the published definitions (verl core_algos: DRO L_t = -(A log pi - beta/2 (log pi - log pi_old)^2); bypass
mode sets pi_old = pi_rollout: ppo_clip on r = pi / pi_rollout with no IS weight, reinforce L_t = -A w log pi with
w the truncated IS weight of sg[pi] / pi_rollout; the rejection judged on pi / pi_rollout), token by token with
autograd on a fresh leaf: loss and gradient to 1e-12, with log-ratios of +-25, a one-token response, a
zero-advantage row and an all-masked row."""

import math

import pytest
import torch

from grpo_mega.algo import correction as C
from grpo_mega.algo.policy_loss import POLICY_LOSSES, Objective
from grpo_mega.conf.algo import AlgoConfig

B, T = 6, 8


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    eng = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    lens = torch.randint(2, T + 1, (B, 1), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lens) & (torch.rand(B, T, generator=g) > 0.15)
    mask[0, 0] = True
    mask[2] = False  # all masked
    mask[4] = False
    mask[4, 1] = True  # one token
    logp[1, 0], mask[1, 0] = eng[1, 0] + 25.0, True  # log(pi / pi_engine) = +25
    logp[5, 0], mask[5, 0] = eng[5, 0] - 25.0, True  # -25
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[3] = 0.0
    return old, eng, logp, mask, adv


def _run(name, obj, old, eng, logp0, mask, adv):
    logp = logp0.clone().requires_grad_(True)
    loss, stats = POLICY_LOSSES.get(name)(obj, logp=logp, old_logp=old, advantages=adv, mask=mask,
                                          normaliser=mask.sum().double(), entropy=torch.zeros_like(old),
                                          engine_logp=eng)
    loss.backward()
    return loss.detach(), logp.grad, stats


def _dense(per_token, logp0, mask):
    """token-mean of per_token(i, t, logp) over the valid tokens, with autograd."""
    logp = logp0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                total = total + per_token(i, t, logp)
    total = total / float(mask.sum())
    total.backward()
    return total.detach(), logp.grad


def _close(got, want):
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-14)
    assert torch.isfinite(got[1]).all()


@pytest.mark.parametrize("beta", [0.0, 0.1, 2.0])
def test_dro(beta):
    old, eng, logp0, mask, adv = _inputs(0)
    got = _run("dro", Objective(dro_beta=beta), old, eng, logp0, mask, adv)
    want = _dense(lambda i, t, lp: -(float(adv[i]) * lp[i, t] - 0.5 * beta * (lp[i, t] - old[i, t]) ** 2),
                  logp0, mask)
    _close(got, want)


def _clip_term(a, r):
    return torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))


@pytest.mark.parametrize("rejection", [None, ("seq_max_k3", 0.3)])
def test_bypass_ppo_clip_is_ppo_against_the_engine(rejection):
    old, eng, logp0, mask, adv = _inputs(1)
    kw = dict(rollout_rejection=rejection[0], rollout_rejection_threshold=rejection[1]) if rejection else {}
    got = _run("bypass_ppo_clip", Objective(**kw), old, eng, logp0, mask, adv)
    keep = torch.ones(B, dtype=torch.bool)
    if rejection:  # seq_max_k3 of log(pi / pi_engine), pi detached
        for i in range(B):
            vals = [math.exp(min(max(float(logp0[i, t] - eng[i, t]), -20), 20)) - 1
                    - min(max(float(logp0[i, t] - eng[i, t]), -20), 20) for t in range(T) if mask[i, t]]
            keep[i] = max(vals, default=0.0) <= rejection[1]
        assert 0 < int(keep.sum()) < B

    def term(i, t, lp):
        r = torch.exp((lp[i, t] - eng[i, t]).clamp(-20, 20))
        return _clip_term(float(adv[i]), r) * float(keep[i])

    _close(got, _dense(term, logp0, mask))
    # the trainer's old logprobs are not read
    _close(_run("bypass_ppo_clip", Objective(**kw), old + 5.0, eng, logp0, mask, adv), got[:2])
    # metrics against the engine: ppo_kl = mean(log pi_engine - log pi)
    n = float(mask.sum())
    assert float(got[2]["ppo_kl_sum"]) / n == pytest.approx(float(((eng - logp0) * mask).sum()) / n, rel=1e-12)


@pytest.mark.parametrize("level,mode", [(None, None), ("token", "truncate"), ("sequence", "truncate"),
                                        ("token", "mask")])
def test_bypass_reinforce_weights_log_pi_by_the_engine_ratio(level, mode):
    old, eng, logp0, mask, adv = _inputs(2)
    obj = Objective(rollout_correction=level, rollout_correction_mode=mode,
                    rollout_correction_high=2.0 if level else None,
                    rollout_correction_low=0.5 if mode == "mask" else None)

    def w(i, t):
        if level is None:
            return 1.0
        if level == "token":
            lr = float(logp0[i, t] - eng[i, t])
        else:
            # grpo-mega clamps each token's log-ratio at +-20 before the sum (verl only the sum; docs/verl.md)
            lr = sum(min(max(float(logp0[i, s] - eng[i, s]), -20.0), 20.0) for s in range(T) if mask[i, s])
        rho = math.exp(min(max(lr, -20.0), 20.0))
        if mode == "mask":
            return rho if 0.5 <= rho <= 2.0 else 0.0
        return min(rho, 2.0)

    got = _run("bypass_reinforce", obj, old, eng, logp0, mask, adv)
    _close(got, _dense(lambda i, t, lp: -float(adv[i]) * w(i, t) * lp[i, t], logp0, mask))


def test_bypass_settings_are_refused_with_one_line():
    for kw, words in [(dict(policy_loss="bypass_ppo_clip", rollout_correction="token"), "its own importance"),
                      (dict(policy_loss="bypass_ppo_clip", engine_is_cap=2.0), "its own importance"),
                      (dict(policy_loss="bypass_reinforce", rollout_correction="token", rollout_is_batch_norm=True),
                       "bypass mode does not use"),
                      (dict(policy_loss="dro", dro_beta=-0.5), "dro_beta")]:
        with pytest.raises(ValueError, match=words) as e:
            AlgoConfig(**kw)
        assert "\n" not in str(e.value)
    old, eng, logp0, mask, adv = _inputs(3)
    with pytest.raises(ValueError, match="needs them"):
        POLICY_LOSSES.get("bypass_reinforce")(Objective(), logp=logp0, old_logp=old, advantages=adv, mask=mask,
                                              normaliser=torch.tensor(1.0), entropy=torch.zeros_like(old))
    assert C.REJECTIONS  # the rejection names the bypass losses accept are the correction family's
