"""gspo, gspo_token, cispo and the rollout correction against dense references written here from the published
formulas, token by token in Python loops (nothing from grpo_mega.algo is called for the expected values): loss
and gradient to 1e-6 on random inputs with responses of differing lengths, masked tokens inside responses and
one response with no valid token."""

import itertools
import math

import pytest
import torch

from grpo_mega.algo import correction as C
from grpo_mega.algo.policy_loss import POLICY_LOSSES, Objective, check_settings

TOL = 1e-6
B, T = 7, 11


def _inputs(seed: int, scale: float):
    """old/ref/engine logprobs, advantages [B], a mask with differing lengths and holes (row 3 empty), and a
    policy logp = old + scale * noise (a leaf, for its gradient)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    lens = torch.randint(1, T + 1, (B, 1), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lens) & (torch.rand(B, T, generator=g, dtype=torch.float64) > 0.2)
    mask[0, 0] = True
    mask[3] = False
    return dict(
        old=old,
        ref=old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3,
        engine=old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4,
        adv=torch.randn(B, generator=g, dtype=torch.float64),
        mask=mask,
        entropy=torch.rand(B, T, generator=g, dtype=torch.float64) * 2,
        logp=old + torch.randn(B, T, generator=g, dtype=torch.float64) * scale,
    )


def _run(name, obj, x, normaliser):
    logp = x["logp"].clone().requires_grad_(True)
    loss, stats = POLICY_LOSSES.get(name)(
        obj, logp=logp, old_logp=x["old"], advantages=x["adv"], mask=x["mask"], normaliser=normaliser,
        entropy=x["entropy"], ref_logp=x["ref"], engine_logp=x["engine"])
    loss.backward()
    return loss.detach(), logp.grad, stats


def _dense(x, per_seq):
    """Sum of per_seq(i, valid positions, logp) over responses, with autograd on a fresh logp leaf."""
    logp = x["logp"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        ts = [t for t in range(T) if x["mask"][i, t]]
        if ts:
            total = total + per_seq(i, ts, logp)
    return total, logp


def _finish(total, logp):
    total.backward()
    return total.detach(), logp.grad


# ---- the rollout correction -------------------------------------------------------------------------------

def dense_weights(x, level, mode, low, high):
    """w[i][t] from the formulas: rho_t = pi_old/pi_engine; sequence: prod_t rho_t; geometric: its |y_i|-th root;
    truncate: clip(rho, low, high); mask: rho inside [low, high], else 0. Also which tokens the bound hit."""
    w, hit = {}, {}
    for i in range(B):
        ts = [t for t in range(T) if x["mask"][i, t]]
        logs = {t: float(x["old"][i, t] - x["engine"][i, t]) for t in ts}
        for t in ts:
            if level == "token":
                rho = math.exp(logs[t])
            elif level == "sequence":
                rho = math.exp(sum(logs.values()))
            else:
                rho = math.exp(sum(logs.values()) / len(ts))
            out = rho < low or rho > high
            w[i, t] = min(max(rho, low), high) if mode == "truncate" else (0.0 if out else rho)
            hit[i, t] = out
    return w, hit


def dense_ppo(x, w, eps_low, eps_high):
    """token-mean of w_t * -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i) (PPO/GRPO)."""
    n = int(x["mask"].sum())

    def per_seq(i, ts, logp):
        a = float(x["adv"][i])
        out = 0.0
        for t in ts:
            r = torch.exp(logp[i, t] - x["old"][i, t])
            out = out + w[i, t] * -torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)
        return out / n
    return _finish(*_dense(x, per_seq))


CORRECTIONS = [(lvl, mode) for lvl in C.LEVELS for mode in C.MODES]
BOUNDS = {  # chosen so that on _inputs(1) both sides of each bound are taken
    ("token", "truncate"): (0.0, 1.5), ("token", "mask"): (0.6, 1.8),
    ("sequence", "truncate"): (0.0, 2.0), ("sequence", "mask"): (0.96, 2.05),
    ("geometric", "truncate"): (0.99, 1.1), ("geometric", "mask"): (0.99, 1.1),
}


@pytest.mark.parametrize("level,mode", CORRECTIONS)
def test_rollout_correction_matches_the_formula(level, mode):
    x = _inputs(1, 0.3)
    low, high = BOUNDS[level, mode]
    obj = Objective(rollout_correction=level, rollout_correction_mode=mode, rollout_correction_low=low,
                    rollout_correction_high=high, kl_coef=0.0)
    loss, grad, stats = _run("ppo_clip", obj, x, x["mask"].sum())
    w, hit = dense_weights(x, level, mode, low, high)
    want, want_grad = dense_ppo(x, w, 0.2, 0.2)
    assert abs(float(loss - want)) <= TOL and (grad - want_grad).abs().max() <= TOL
    # metrics: the mean weight, the share of tokens and of responses where the bound acted
    n = int(x["mask"].sum())
    assert float(stats["is_weight_sum"]) == pytest.approx(sum(w.values()), abs=TOL)
    assert float(stats["is_capped_sum"]) == sum(hit.values())
    assert float(stats["is_seq_capped_sum"]) == len({i for (i, t), h in hit.items() if h})
    assert float(stats["seqs"]) == int(x["mask"].any(-1).sum()) and float(stats["tokens"]) == n
    hits, kept = sum(hit.values()), n - sum(hit.values())
    assert 0 < hits and 0 < kept  # both sides of the bound are exercised


def test_icepop_and_engine_is_cap_are_named_corrections():
    assert C.resolve("icepop") == C.Correction("token", "mask", 0.5, 5.0)
    assert C.resolve(None, engine_is_cap=2.0) == C.Correction("token", "truncate", 0.0, 2.0)
    assert C.resolve("token") == C.Correction("token", "truncate", 0.0, 2.0)
    assert C.resolve("geometric", "mask", high=4.0) == C.Correction("geometric", "mask", 0.25, 4.0)
    x = _inputs(2, 0.3)
    x["engine"] = x["old"] + torch.randn(B, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    loss, grad, stats = _run("ppo_clip", Objective(rollout_correction="icepop"), x, x["mask"].sum())
    w, hit = dense_weights(x, "token", "mask", 0.5, 5.0)
    want, want_grad = dense_ppo(x, w, 0.2, 0.2)
    assert abs(float(loss - want)) <= TOL and (grad - want_grad).abs().max() <= TOL and any(hit.values())
    a = _run("ppo_clip", Objective(engine_is_cap=1.5), x, x["mask"].sum())
    b = _run("ppo_clip", Objective(rollout_correction="token", rollout_correction_high=1.5), x, x["mask"].sum())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kw,message", [
    (dict(name="token", low=2.0, high=2.0), r"algo\.rollout_correction_low=2\.0 and algo\.rollout_correction_high=2\.0 "
                                            r"must satisfy 0 <= low < high"),
    (dict(name="tokens"), r"algo\.rollout_correction='tokens' must be one of token, sequence, geometric, icepop"),
    (dict(name="token", mode="clip"), r"algo\.rollout_correction_mode='clip' must be 'truncate' or 'mask'"),
    (dict(name="icepop", mode="truncate"), r"'icepop' is token-level mask"),
    (dict(name="token", engine_is_cap=2.0), r"both set a rollout correction"),
    (dict(name=None, high=3.0), r"algo\.rollout_correction_high=3\.0 without algo\.rollout_correction"),
])
def test_bad_correction_settings_are_one_line_errors(kw, message):
    with pytest.raises(ValueError, match=message) as e:
        C.resolve(**kw)
    assert "\n" not in str(e.value)


# ---- GSPO -------------------------------------------------------------------------------------------------

def dense_gspo(x, eps_low, eps_high, kl_coef, ent_coef, w=None):
    """-(1/G) sum_i [min(s_i A_i, clip(s_i) A_i) - (1/|y_i|) sum_t (beta k3_t - c_H H_t)], each token's part
    times w_t; s_i = exp((1/|y_i|) sum_t (logp - old)) (Zheng et al. 2025, eq. 5-7);
    k3 = e^(ref-logp) - (ref-logp) - 1."""
    def per_seq(i, ts, logp):
        a = float(x["adv"][i])
        s = torch.exp(sum(logp[i, t] - x["old"][i, t] for t in ts) / len(ts))
        pg = -torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)
        out = 0.0
        for t in ts:
            d = x["ref"][i, t] - logp[i, t]
            term = pg + kl_coef * (torch.exp(d) - d - 1) - ent_coef * x["entropy"][i, t]
            out = out + (1.0 if w is None else w[i, t]) * term
        return out / len(ts) / B
    return _finish(*_dense(x, per_seq))


def dense_cispo(x, eps_low, eps_high, kl_coef, ent_coef, w=None):
    """(1/N) sum_i,t [-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_i logp_t + beta k3_t - c_H H_t]
    (MiniMax-M1, eq. 4)."""
    n = int(x["mask"].sum())

    def per_seq(i, ts, logp):
        a = float(x["adv"][i])
        out = 0.0
        for t in ts:
            r = math.exp(float(logp[i, t] - x["old"][i, t]))
            d = x["ref"][i, t] - logp[i, t]
            term = -min(max(r, 1 - eps_low), 1 + eps_high) * a * logp[i, t] + kl_coef * (torch.exp(d) - d - 1) \
                - ent_coef * x["entropy"][i, t]
            out = out + (1.0 if w is None else w[i, t]) * term
        return out / n
    return _finish(*_dense(x, per_seq))


SETTINGS = list(itertools.product((0.0, 0.05), (0.0, 0.01), (None, ("geometric", "mask", 0.9, 1.1))))


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("kl_coef,ent_coef,corr", SETTINGS)
def test_gspo_matches_the_formula(name, kl_coef, ent_coef, corr):
    x = _inputs(3, 1.5e-3)  # |s_i - 1| ~ 1e-4..1e-3: both sides of the 3e-4 / 4e-4 clip
    rc = dict(rollout_correction=corr[0], rollout_correction_mode=corr[1], rollout_correction_low=corr[2],
              rollout_correction_high=corr[3]) if corr else {}
    obj = Objective(loss_agg_mode="seq-mean-token-mean", kl_coef=kl_coef, entropy_coef=ent_coef, **rc)
    loss, grad, stats = _run(name, obj, x, torch.tensor(float(B)))
    w = dense_weights(x, *corr)[0] if corr else None
    want, want_grad = dense_gspo(x, 3e-4, 4e-4, kl_coef, ent_coef, w)
    assert abs(float(loss - want)) <= TOL and (grad - want_grad).abs().max() <= TOL
    s, clipped_tokens = [], 0
    for i in range(B):
        m = x["mask"][i]
        if m.any():
            s.append(math.exp(float(((x["logp"][i] - x["old"][i]) * m).sum() / m.sum())))
            a = float(x["adv"][i])
            clipped_tokens += int(m.sum()) * (-a * min(max(s[-1], 1 - 3e-4), 1 + 4e-4) > -a * s[-1])
    assert float(stats["clipped_sum"]) == clipped_tokens
    assert any(1 - 3e-4 < v < 1 + 4e-4 for v in s) and any(not 1 - 3e-4 < v < 1 + 4e-4 for v in s)


def test_gspo_token_takes_per_token_advantages():
    """gspo_token with A_i,t: (1/G) sum_i (1/|y_i|) sum_t -min(s_i,t A_i,t, clip(s_i,t) A_i,t), whose gradient
    per token is s_i A_i,t grad logp_t / |y_i| where unclipped (Zheng et al. 2025, eq. 14)."""
    x = _inputs(4, 1.5e-3)
    adv_t = torch.randn(B, T, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    logp = x["logp"].clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES.get("gspo_token")(
        Objective(loss_agg_mode="seq-mean-token-mean", kl_coef=0.0), logp=logp, old_logp=x["old"], advantages=adv_t,
        mask=x["mask"], normaliser=torch.tensor(float(B)), entropy=x["entropy"])
    loss.backward()
    want, want_grad = torch.zeros((), dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        ts = [t for t in range(T) if x["mask"][i, t]]
        if not ts:
            continue
        s = math.exp(sum(float(x["logp"][i, t] - x["old"][i, t]) for t in ts) / len(ts))
        for t in ts:
            a = float(adv_t[i, t])
            want -= min(s * a, min(max(s, 1 - 3e-4), 1 + 4e-4) * a) / len(ts) / B
            if s * a <= min(max(s, 1 - 3e-4), 1 + 4e-4) * a:  # the unclipped branch is the min
                want_grad[i, t] = -s * a / len(ts) / B
    assert abs(float(loss.detach()) - float(want)) <= TOL and (logp.grad - want_grad).abs().max() <= TOL


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gspo_refuses_aggregations_it_does_not_define(name, mode):
    with pytest.raises(ValueError, match=rf"algo\.policy_loss='{name}' needs algo\.loss_agg_mode=seq-mean-token-mean "
                                         rf"\(got '{mode}'\): GSPO's objective is the mean over responses"):
        check_settings(name, mode)
    x = _inputs(0, 1e-3)
    with pytest.raises(ValueError, match="needs algo.loss_agg_mode=seq-mean-token-mean"):
        _run(name, Objective(loss_agg_mode=mode), x, x["mask"].sum())
    with pytest.raises(ValueError, match=r"algo\.dual_clip=3\.0 is ppo_clip's"):
        check_settings("cispo", "token-mean", 3.0)


# ---- CISPO ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kl_coef,ent_coef,corr", SETTINGS)
def test_cispo_matches_the_formula(kl_coef, ent_coef, corr):
    x = _inputs(5, 0.3)
    rc = dict(rollout_correction=corr[0], rollout_correction_mode=corr[1], rollout_correction_low=corr[2],
              rollout_correction_high=corr[3]) if corr else {}
    obj = Objective(kl_coef=kl_coef, entropy_coef=ent_coef, cispo_eps_low=0.1, cispo_eps_high=0.2, **rc)
    loss, grad, stats = _run("cispo", obj, x, x["mask"].sum())
    w = dense_weights(x, *corr)[0] if corr else None
    want, want_grad = dense_cispo(x, 0.1, 0.2, kl_coef, ent_coef, w)
    assert abs(float(loss - want)) <= TOL and (grad - want_grad).abs().max() <= TOL
    r = (x["logp"] - x["old"]).exp()[x["mask"]]
    assert float(stats["clipped_sum"]) == int(((r < 0.9) | (r > 1.2)).sum()) > 0
    # every valid token keeps a gradient, clipped ones included (where PPO's clip would zero it)
    if kl_coef == 0 and ent_coef == 0 and corr is None:
        assert bool((grad[x["mask"]] != 0).all())
