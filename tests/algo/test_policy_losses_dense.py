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

def dense_gspo(x, eps_low, eps_high, kl_coef, ent_coef, w=None, cap=10.0, dual=None):
    """-(1/G) sum_i [min(s_i A_i, clip(s_i) A_i) - (1/|y_i|) sum_t (beta k3_t - c_H H_t)], each token's part
    times w_t; s_i = exp(min((1/|y_i|) sum_t (logp - old), cap)) (Zheng et al. 2025, eq. 5-7; verl's cap of 10 on
    log s_i); with dual = c, the pg term of A_i < 0 is min(pg, -c A_i); k3 = e^(ref-logp) - (ref-logp) - 1."""
    def per_seq(i, ts, logp):
        a = float(x["adv"][i])
        log_s = sum(logp[i, t] - x["old"][i, t] for t in ts) / len(ts)
        s = torch.exp(log_s) if float(log_s.detach()) <= cap else torch.exp(log_s.detach() * 0 + cap)
        pg = -torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)
        if dual is not None and a < 0:
            pg = torch.minimum(pg, torch.tensor(-dual * a, dtype=torch.float64))
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
                                         rf"\(got '{mode}'\): its objective is the mean over responses"):
        check_settings(name, mode)
    x = _inputs(0, 1e-3)
    with pytest.raises(ValueError, match="needs algo.loss_agg_mode=seq-mean-token-mean"):
        _run(name, Objective(loss_agg_mode=mode), x, x["mask"].sum())
    with pytest.raises(ValueError, match=r"algo\.dual_clip=3\.0 bounds a clipped ratio surrogate .*"
                                         r"algo\.policy_loss='cispo' does not define it"):
        check_settings("cispo", "token-mean", 3.0)
    check_settings(name, "seq-mean-token-mean", 3.0)  # GSPO's sequence surrogate takes the dual clip


GSPO_MODES = [("gspo", None), ("gspo_token", None), ("gspo", 3.0), ("gspo_token", 3.0)]


def _one_token(log_ratio, adv):
    """One response of one valid token (the rest of its row masked) with the given log-ratio and advantage."""
    x = _inputs(0, 0.0)
    x["mask"] = torch.zeros(B, T, dtype=torch.bool)
    x["mask"][0, 0] = True
    x["adv"] = torch.zeros(B, dtype=torch.float64)
    x["adv"][0] = adv
    x["logp"] = x["old"].clone()
    x["logp"][0, 0] += log_ratio
    return x


@pytest.mark.parametrize("name,dual", GSPO_MODES)
def test_gspo_is_bounded_for_a_one_token_response(name, dual):
    """The issue's case: one token, log s_i = 12, A = -0.9. Uncapped, the loss is 0.9 e^12 = 146,479 with gradient
    24,413; capped at verl's 10 it is 0.9 e^10 = 19,823.9 with gradient 0; with dual_clip 3 it is 2.7, gradient 0.
    The other 6 rows have no valid token (all-masked rows), so G = 1 response of B rows: normaliser 1."""
    x = _one_token(12.0, -0.9)
    obj = Objective(loss_agg_mode="seq-mean-token-mean", kl_coef=0.0, dual_clip=dual)
    loss, grad, stats = _run(name, obj, x, torch.tensor(1.0))
    want = 0.9 * math.exp(10.0) if dual is None else 2.7
    assert math.isfinite(float(loss)) and abs(float(loss) - want) <= 1e-9 * want
    assert torch.isfinite(grad).all() and float(grad.abs().max()) == 0.0
    want_d, want_g = dense_gspo(x, 3e-4, 4e-4, 0.0, 0.0, dual=dual)
    assert abs(float(loss - want_d * B)) <= 1e-9 * want and (grad - want_g * B).abs().max() <= TOL
    # below the cap the gradient is the formula's s A / |y| = -0.9 e^9.5, and the loss 0.9 e^9.5
    x = _one_token(9.5, -0.9)
    loss, grad, _ = _run(name, Objective(loss_agg_mode="seq-mean-token-mean", kl_coef=0.0), x, torch.tensor(1.0))
    assert abs(float(loss) - 0.9 * math.exp(9.5)) <= 1e-9 * 0.9 * math.exp(9.5)
    assert abs(float(grad[0, 0]) - 0.9 * math.exp(9.5)) <= 1e-9 * 0.9 * math.exp(9.5)


@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("cap", [10.0, 2.0])
def test_gspo_and_gspo_token_agree_at_extreme_log_ratios(dual, cap):
    """Token log-ratios of +-25 (beyond the old per-token clamp of +-20), a zero-advantage row, all-masked rows
    and one-token rows: gspo and gspo_token equal each other in value and gradient, and the float64 formula
    (dense_gspo) to 1e-6 relative to the loss's scale; everything finite."""
    x = _inputs(6, 0.5)
    g = torch.Generator().manual_seed(11)
    big = torch.rand(B, T, generator=g, dtype=torch.float64) < 0.3
    sign = torch.where(torch.rand(B, T, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    x["logp"] = torch.where(big, x["old"] + 25.0 * sign, x["logp"])
    x["logp"][1] = x["old"][1] + 25.0  # all of row 1's tokens at +25: log s_1 = 25 > cap
    x["logp"][2] = x["old"][2] - 25.0  # row 2 at -25: s_2 = e^-25
    x["adv"][1], x["adv"][2] = -0.9, 0.7
    x["adv"][4] = 0.0  # a zero-advantage row
    x["mask"][5] = False  # a second all-masked row (row 3 is one)
    x["mask"][6] = False
    x["mask"][6, 2] = True  # a one-token row
    obj = Objective(loss_agg_mode="seq-mean-token-mean", kl_coef=0.0, dual_clip=dual, seq_log_ratio_cap=cap)
    a = _run("gspo", obj, x, torch.tensor(float(B)))
    b = _run("gspo_token", obj, x, torch.tensor(float(B)))
    want, want_grad = dense_gspo(x, 3e-4, 4e-4, 0.0, 0.0, cap=cap, dual=dual)
    scale = max(1.0, abs(float(want)))
    for loss, grad, _ in (a, b):
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert abs(float(loss - want)) <= TOL * scale and (grad - want_grad).abs().max() <= TOL * scale
    assert abs(float(a[0] - b[0])) <= 1e-12 * scale and (a[1] - b[1]).abs().max() <= 1e-12 * scale
    assert float(a[1][4].abs().max()) == 0.0 and float(a[1][1].abs().max()) == 0.0  # A = 0; log s_1 above the cap


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
