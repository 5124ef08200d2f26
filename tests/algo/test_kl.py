import math

import pytest
import torch

from grpo_mega.algo import KL_ESTIMATORS, full_kl, kl_penalty


LN2 = math.log(2.0)


@pytest.mark.parametrize(
    "name,p_over_q_half,p_over_q_two",
    [
        # (estimator, value at p=0.25,q=0.5 (log p/q = -ln2), value at p=0.5,q=0.25 (log p/q = ln2))
        ("k1", -LN2, LN2),
        ("abs", LN2, LN2),
        ("k2", 0.5 * LN2**2, 0.5 * LN2**2),
        ("mse", 0.5 * LN2**2, 0.5 * LN2**2),
        ("k3", 2 - LN2 - 1, 0.5 + LN2 - 1),  # q/p - log(q/p) - 1
        ("low_var_kl", 2 - LN2 - 1, 0.5 + LN2 - 1),
    ],
)
def test_hand_computed_estimators(name, p_over_q_half, p_over_q_two):
    logp = torch.tensor([[math.log(0.25), math.log(0.5)]])
    ref = torch.tensor([[math.log(0.5), math.log(0.25)]])
    got = kl_penalty(logp, ref, name)
    torch.testing.assert_close(got, torch.tensor([[p_over_q_half, p_over_q_two]]), rtol=0, atol=1e-15)


def test_k3_clamps():
    logp = torch.tensor([0.0, -30.0, -1.0])
    ref = torch.tensor([-30.0, 0.0, -1.0])
    # log(q/p) = -30 -> clamped to -20: e^-20 + 20 - 1 = 19.000000002 -> value clamp 10.
    # log(q/p) = +30 -> clamped to 20: e^20 - 21 -> 10.   Equal: exactly 0.
    assert kl_penalty(logp, ref, "k3").tolist() == [10.0, 10.0, 0.0]


def test_full_kl_hand_computed():
    p = torch.tensor([[0.5, 0.5]]).log()
    q = torch.tensor([[0.25, 0.75]]).log()
    assert full_kl(p, q).item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), abs=1e-15)
    # kl_penalty passes the precomputed per-token value through
    pre = torch.tensor([[0.3]])
    assert kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "full", full=pre) is pre
    with pytest.raises(ValueError, match="needs the per-token full-vocabulary KL"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "full")


def test_loop_vs_vectorised_estimators():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 7, generator=g) * 5
    ref = -torch.rand(4, 7, generator=g) * 5
    scalar = {
        "k1": lambda a, b: a - b,
        "abs": lambda a, b: abs(a - b),
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: min(max(math.exp(b - a) - (b - a) - 1, -10), 10),
    }
    for name, f in scalar.items():
        got = kl_penalty(logp, ref, name)
        for i in range(4):
            for t in range(7):
                assert got[i, t].item() == pytest.approx(f(logp[i, t].item(), ref[i, t].item()), abs=1e-14)


def test_full_kl_matches_sampled_k3_mean_in_expectation():
    # k1 and k3 are unbiased for KL(p||q) under samples from p: their p-weighted sums equal full KL.
    g = torch.Generator().manual_seed(2)
    p = torch.log_softmax(torch.randn(3, 11, generator=g), -1)
    q = torch.log_softmax(torch.randn(3, 11, generator=g), -1)
    exact = full_kl(p, q)
    for name in ("k1", "k3"):
        expect = (p.exp() * KL_ESTIMATORS.get(name)(p, q)).sum(-1)
        assert torch.allclose(expect, exact, atol=1e-12)


def test_unknown_estimator_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; valid: abs, full, k1, k2, k3, low_var_kl, mse"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
