"""geo_mean (GMPO), sapo (SAPO), gpg (GPG), clip_cov and kl_cov (Cui et al. 2025), dppo_tv and dppo_kl (DPPO)
against dense references written
here from the published formulas (and verl's conventions where the papers leave a choice: its micro-batch covariance
means, GMPO's sign trick), token by token in Python loops over float64 scalars (nothing from grpo_mega.algo is
called for the expected values). Loss and gradient to 1e-6 relative to the loss's scale (float64 sums of O(10)
terms: ~1e-15 apart), with KL/entropy terms and a rollout correction, and at the edges: log-ratios of +-25, a
zero-advantage row, all-masked rows, one-token rows."""

import math

import pytest
import torch

from grpo_mega.algo.policy_loss import POLICY_LOSSES, Objective, check_settings
from tests.algo.test_policy_losses_dense import B, T, TOL, _inputs, _run, dense_weights

SEQ = "seq-mean-token-mean"


def _valid(x, i):
    return [t for t in range(T) if x["mask"][i, t]]


def _const(v):
    return torch.tensor(v, dtype=torch.float64)


def _k3(d):
    """Schulman's k3 = e^d - d - 1, d = log(q/p), with verl's clamps: d to [-20, 20], the value to [-10, 10]
    (constants beyond them: no gradient)."""
    if abs(float(d.detach())) > 20:
        d = _const(math.copysign(20.0, float(d.detach())))
    k = torch.exp(d) - d - 1
    return k if abs(float(k.detach())) <= 10 else _const(math.copysign(10.0, float(k.detach())))


def dense(x, pg, agg, kl_coef=0.0, ent_coef=0.0, w=None):
    """sum over responses i and valid tokens t of w_t (pg(i, t, logp) + beta k3_t - c_H H_t), divided by |y_i| B
    (seq-mean-token-mean) or by the valid tokens N (token-mean); autograd on a fresh logp leaf."""
    logp = x["logp"].clone().requires_grad_(True)
    n = int(x["mask"].sum())
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        ts = _valid(x, i)
        for t in ts:
            term = pg(i, t, logp) + kl_coef * _k3(x["ref"][i, t] - logp[i, t]) - ent_coef * x["entropy"][i, t]
            term = term * (1.0 if w is None else w[i, t])
            total = total + (term / len(ts) / B if agg == SEQ else term / n)
    total.backward()
    return total.detach(), logp.grad


def ref_geo_mean(x, lo=0.4, hi=0.4, cap=10.0):
    """GMPO: l~_t = sgn(A) min(sgn(A) l_t, sgn(A) clip(l_t, -lo, hi)); s_i = exp(min(mean_t l~_t, cap));
    the response's term -A_i s_i on each of its tokens."""
    def pg(i, t, logp):
        a = float(x["adv"][i])
        sgn = (a > 0) - (a < 0)
        total = torch.zeros((), dtype=torch.float64)
        ts = _valid(x, i)
        for u in ts:
            lu = logp[i, u] - x["old"][i, u]
            c = min(max(float(lu.detach()), -lo), hi)
            total = total + (lu if sgn * float(lu.detach()) <= sgn * c else c) * (sgn != 0)
        log_s = total / len(ts)
        s = torch.exp(log_s) if float(log_s.detach()) <= cap else torch.tensor(math.exp(cap), dtype=torch.float64)
        return -a * s
    return pg


def ref_sapo(x, tau_pos=1.0, tau_neg=1.05):
    """SAPO: -(4/tau) sigmoid(tau (r - 1)) A, tau by the sign of A, r = exp(l) with l clamped to +-20."""
    def pg(i, t, logp):
        a = float(x["adv"][i])
        tau = tau_pos if a > 0 else tau_neg
        lr = logp[i, t] - x["old"][i, t]
        r = _ratio(x, i, t, logp)
        return -(4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * a
    return pg


def ref_gpg(x):
    return lambda i, t, logp: -float(x["adv"][i]) * logp[i, t]


def _ratio(x, i, t, logp):
    lr = logp[i, t] - x["old"][i, t]
    v = float(lr.detach())
    return torch.exp(lr) if abs(v) <= 20 else torch.tensor(math.exp(math.copysign(20, v)), dtype=torch.float64)


def _cov(x):
    """Cov_t = (A - mean A)(logp - mean logp) over the valid tokens, as a dict (i, t) -> value."""
    toks = [(i, t) for i in range(B) for t in _valid(x, i)]
    ma = sum(float(x["adv"][i]) for i, t in toks) / len(toks)
    ml = sum(float(x["logp"][i, t]) for i, t in toks) / len(toks)
    return {(i, t): (float(x["adv"][i]) - ma) * (float(x["logp"][i, t]) - ml) for i, t in toks}


def _ppo(x, i, t, logp, eps_low=0.2, eps_high=0.2):
    a = float(x["adv"][i])
    r = _ratio(x, i, t, logp)
    return -torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)


def _ppo_clipped(x, i, t, eps_low=0.2, eps_high=0.2):
    a = float(x["adv"][i])
    r = math.exp(max(min(float(x["logp"][i, t] - x["old"][i, t]), 20), -20))
    return -a * min(max(r, 1 - eps_low), 1 + eps_high) > -a * r


def ref_clip_cov(x, dropped):
    """PPO's clipped surrogate, 0 on the dropped tokens."""
    return lambda i, t, logp: 0.0 * logp[i, t] if (i, t) in dropped else _ppo(x, i, t, logp)


def clip_cov_candidates(x, lb, ub):
    cov = _cov(x)
    return {k for k, c in cov.items() if lb < c < ub and not _ppo_clipped(x, *k)}


def ref_kl_cov(x, ratio, coef):
    """-A r_t on every token, + coef |l_t| on the max(1, floor(ratio N)) tokens of largest Cov_t."""
    cov = _cov(x)
    k = max(1, int(ratio * len(cov)))
    top = set(sorted(cov, key=lambda key: -cov[key])[:k])

    def pg(i, t, logp):
        out = -float(x["adv"][i]) * _ratio(x, i, t, logp)
        return out + coef * (logp[i, t] - x["old"][i, t]).abs() if (i, t) in top else out
    return pg


def ref_dppo(x, kind, low=0.2, high=0.2, cap=20.0):
    """DPPO-Binary-TV/KL: -A sg(min(r, cap)) log pi * keep; keep from the sampled token's probability change: TV
    p - p_old <= high (A > 0) or >= -low (A <= 0); KL: the binary KL D <= high or p <= p_old (A > 0), D <= low or
    p >= p_old (A <= 0), D = p_old log(p_old/p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))."""
    def pg(i, t, logp):
        a = float(x["adv"][i])
        lv, lo = float(logp[i, t].detach()), float(x["old"][i, t])
        p, po = math.exp(lv), math.exp(lo)
        if kind == "tv":
            keep = (p - po <= high) if a > 0 else (p - po >= -low)
        else:
            d = po * (lo - lv) + (1 - po) * math.log((1 - po + 1e-8) / (1 - p + 1e-8))
            keep = (d <= high or p <= po) if a > 0 else (d <= low or p >= po)
        w = min(math.exp(max(min(lv - lo, 20.0), -20.0)), cap)
        return -a * w * logp[i, t] * float(keep)
    return pg


CORR = ("token", "truncate", 0.0, 1.5)
CASES = {  # name -> (Objective settings, reference pg, aggregation)
    "geo_mean": (dict(loss_agg_mode=SEQ), lambda x: ref_geo_mean(x), SEQ),
    "geo_mean_narrow": (dict(loss_agg_mode=SEQ, gmpo_clip_low=0.1, gmpo_clip_high=0.05, seq_log_ratio_cap=0.3),
                        lambda x: ref_geo_mean(x, 0.1, 0.05, 0.3), SEQ),
    "sapo": (dict(loss_agg_mode=SEQ), lambda x: ref_sapo(x), SEQ),
    "sapo_taus": (dict(loss_agg_mode=SEQ, sapo_tau_pos=3.0, sapo_tau_neg=0.5), lambda x: ref_sapo(x, 3.0, 0.5), SEQ),
    "gpg": (dict(), lambda x: ref_gpg(x), "token-mean"),
    "gpg_seq": (dict(loss_agg_mode=SEQ), lambda x: ref_gpg(x), SEQ),
    "kl_cov": (dict(kl_cov_ratio=0.1, kl_cov_coef=0.5), lambda x: ref_kl_cov(x, 0.1, 0.5), "token-mean"),
    "kl_cov_default": (dict(), lambda x: ref_kl_cov(x, 2e-4, 0.1), "token-mean"),
    "dppo_tv": (dict(), lambda x: ref_dppo(x, "tv"), "token-mean"),
    "dppo_tv_narrow": (dict(dppo_div_low=0.02, dppo_div_high=0.05, dppo_is_cap=1.3),
                       lambda x: ref_dppo(x, "tv", 0.02, 0.05, 1.3), "token-mean"),
    "dppo_kl": (dict(), lambda x: ref_dppo(x, "kl"), "token-mean"),
    "dppo_kl_narrow": (dict(dppo_div_low=0.01, dppo_div_high=0.03, dppo_is_cap=1.3),
                       lambda x: ref_dppo(x, "kl", 0.01, 0.03, 1.3), "token-mean"),
}


def _normaliser(x, agg):
    return torch.tensor(float(B)) if agg == SEQ else x["mask"].sum()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kl_coef,ent_coef,corr", [(0.0, 0.0, None), (0.05, 0.01, CORR)])
@pytest.mark.parametrize("scale", [0.3, "extreme"])
def test_loss_matches_the_formula(case, kl_coef, ent_coef, corr, scale):
    name = case.split("_narrow")[0].split("_taus")[0].split("_seq")[0].split("_default")[0]
    assert name in POLICY_LOSSES
    settings, ref, agg = CASES[case]
    x = _inputs(7, 0.3 if scale == "extreme" else scale)
    if scale == "extreme":  # +-25 log-ratios, a zero-advantage row, all-masked rows, a one-token row
        g = torch.Generator().manual_seed(13)
        big = torch.rand(B, T, generator=g, dtype=torch.float64) < 0.25
        sign = torch.where(torch.rand(B, T, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
        # +25: old = logp - 25; -25: logp = old - 25 (both log-probabilities stay <= 0, as DPPO's p = e^logp needs)
        x["logp"] = torch.where(big & (sign > 0), -x["logp"].abs() - 0.01, x["logp"])  # <= 0, no ties
        drift = x["engine"] - x["old"]  # the engine stays near old (rho's own +-20 clamp is not under test here)
        x["old"] = torch.where(big & (sign > 0), x["logp"] - 25.0, x["old"])
        x["engine"] = x["old"] + drift
        x["logp"] = torch.where(big & (sign < 0), x["old"] - 25.0, x["logp"])
        x["adv"][4] = 0.0
        x["mask"][5] = False
        x["mask"][6] = False
        x["mask"][6, 1] = True
    rc = dict(rollout_correction=corr[0], rollout_correction_mode=corr[1], rollout_correction_low=corr[2],
              rollout_correction_high=corr[3]) if corr else {}
    obj = Objective(kl_coef=kl_coef, entropy_coef=ent_coef, **settings, **rc)
    loss, grad, stats = _run(name, obj, x, _normaliser(x, agg))
    w = dense_weights(x, *corr)[0] if corr else None
    want, want_grad = dense(x, ref(x), agg, kl_coef, ent_coef, w)
    scale_ = max(1.0, abs(float(want)))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert abs(float(loss - want)) <= TOL * scale_ and (grad - want_grad).abs().max() <= TOL * scale_
    if scale == "extreme" and kl_coef == 0 and ent_coef == 0 and name != "kl_cov":
        assert float(grad[4].abs().max()) == 0.0  # the zero-advantage row has no gradient
    assert float(stats["tokens"]) == int(x["mask"].sum())


@pytest.mark.parametrize("scale", [0.3, "extreme"])
def test_clip_cov_drops_the_candidates(scale):
    """With clip_cov_ratio large enough every candidate (Cov in (lb, ub), not clipped by PPO) is dropped: the loss is
    the formula's with those tokens' PPO term removed; with a small ratio exactly max(1, floor(ratio N)) candidates are
    dropped (no gradient), the same ones on a second call, and the loss is the formula's with them."""
    x = _inputs(8, 0.3)
    if scale == "extreme":
        x["logp"][0, 0] = x["old"][0, 0] + 25.0
        x["logp"][1, :3] = x["old"][1, :3] - 25.0
        x["adv"][2] = 0.0
        x["mask"][5] = False
    lb, ub = 0.1, 5.0
    cand = clip_cov_candidates(x, lb, ub)
    assert len(cand) >= 3
    n = int(x["mask"].sum())
    obj = Objective(kl_coef=0.0, clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
    loss, grad, stats = _run("clip_cov", obj, x, x["mask"].sum())
    want, want_grad = dense(x, ref_clip_cov(x, cand), "token-mean")
    assert abs(float(loss - want)) <= TOL and (grad - want_grad).abs().max() <= TOL
    ppo_clipped = {(i, t) for i in range(B) for t in _valid(x, i) if _ppo_clipped(x, i, t)}
    assert float(stats["clipped_sum"]) == len(cand) + len(ppo_clipped)
    ratio = 2.5 / n  # floor(2.5) = 2 tokens
    obj = Objective(kl_coef=0.0, clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub)
    loss, grad, _ = _run("clip_cov", obj, x, x["mask"].sum())
    again = _run("clip_cov", obj, x, x["mask"].sum())
    assert torch.equal(loss, again[0]) and torch.equal(grad, again[1])
    dropped = {k for k in cand if float(grad[k]) == 0.0}
    assert len(dropped) == 2
    want, want_grad = dense(x, ref_clip_cov(x, dropped), "token-mean")
    assert abs(float(loss - want)) <= TOL and (grad - want_grad).abs().max() <= TOL


@pytest.mark.parametrize("name", ["geo_mean", "sapo"])
def test_sequence_level_losses_refuse_token_aggregation(name):
    with pytest.raises(ValueError, match=rf"algo\.policy_loss='{name}' needs algo\.loss_agg_mode=seq-mean-token-mean "
                                         r"\(got 'token-mean'\): its objective is the mean over responses"):
        check_settings(name, "token-mean")
    for other in ("gpg", "clip_cov", "kl_cov"):
        check_settings(other, "token-mean")
    with pytest.raises(ValueError, match=r"algo\.dual_clip=3\.0 .* algo\.policy_loss='geo_mean' does not define it"):
        check_settings("geo_mean", SEQ, 3.0)


@pytest.mark.parametrize("kw,message", [
    (dict(gmpo_clip_low=-0.1), r"algo\.gmpo_clip_low=-0\.1 and algo\.gmpo_clip_high=0\.4 must be >= 0"),
    (dict(sapo_tau_neg=0.0), r"algo\.sapo_tau_pos=1\.0 and algo\.sapo_tau_neg=0\.0 must be > 0"),
    (dict(clip_cov_ratio=0.0), r"algo\.clip_cov_ratio=0\.0 and algo\.kl_cov_ratio=0\.0002 must be in \(0, 1\]"),
    (dict(clip_cov_lb=5.0), r"algo\.clip_cov_lb=5\.0 must be < algo\.clip_cov_ub=5\.0"),
    (dict(kl_cov_coef=-1.0), r"algo\.kl_cov_coef=-1\.0 must be >= 0"),
    (dict(seq_log_ratio_cap=0.0), r"algo\.seq_log_ratio_cap=0\.0 must be > 0"),
    (dict(dppo_is_cap=0.0), r"algo\.dppo_div_low=0\.2 and algo\.dppo_div_high=0\.2 must be >= 0 and "
                            r"algo\.dppo_is_cap=0\.0 > 0"),
])
def test_bad_loss_settings_are_one_line_errors(kw, message):
    from grpo_mega.conf.algo import AlgoConfig

    for make in (Objective, AlgoConfig):
        with pytest.raises(ValueError, match=message) as e:
            make(**kw)
        assert "\n" not in str(e.value)


def test_every_loss_setting_is_an_algo_field_with_the_same_default():
    """The Objective's settings are declared once more in AlgoConfig (the user's names): same names, same defaults
    (kl_coef aside: the config's 0.001 is the run's default, the Objective's 0 the pure function's)."""
    from dataclasses import fields

    from grpo_mega.conf.algo import AlgoConfig

    cfg = AlgoConfig()
    settings = [f for f in fields(Objective) if not f.metadata.get("runtime")]  # is_batch_mean: set per update
    assert [f.name for f in fields(Objective) if f not in settings] == ["is_batch_mean"]
    for f in settings:
        assert hasattr(cfg, f.name), f.name
        if f.name != "kl_coef":
            assert getattr(cfg, f.name) == f.default, f.name
    assert cfg.objective() == Objective(**{f.name: getattr(cfg, f.name) for f in settings})
    assert set(POLICY_LOSSES.names()) >= {"geo_mean", "sapo", "gpg", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl"}
