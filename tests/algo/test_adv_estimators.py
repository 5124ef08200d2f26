"""The advantage estimators (grpo_mega.algo.advantages.ADV_ESTIMATORS) against references written here from the
published definitions, group by group in Python loops over float64 lists (nothing from grpo_mega.algo is called
for the expected values): RLOO (Ahmadian et al. 2024, eq. 6), REINFORCE++ with baseline (Hu et al. 2025; verl's
token-level whitening), GRPO pass@k (arXiv 2503.19595; verl's grpo_passk), and GRPO unchanged. Tolerance 1e-12:
the references and the code do the same few float64 operations per response on O(1) values."""

import math
import random

import pytest
import torch

from grpo_mega.algo.advantages import ADV_ESTIMATORS, advantages, group_advantages
from grpo_mega.algo.shaping import StepShaping, shape_step

TOL = 1e-12
N = 5


def _scores(seed, groups=6, n=N):
    """Rewards with a uniform group (group 1), a group with a tie at the top (group 2) and random ones."""
    rnd = random.Random(seed)
    r = [[rnd.choice([0.0, 0.5, 1.0]) + rnd.random() * 0.1 for _ in range(n)] for _ in range(groups)]
    r[1] = [0.7] * n
    r[2] = [1.0, 0.2, 1.0, 0.3, 0.1][:n]
    lengths = [rnd.randint(1, 30) for _ in range(groups * n)]
    return r, lengths


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_rloo(r):
    """A_i = r_i - mean of the other n - 1 rewards of the group."""
    return [x - (sum(g) - x) / (len(g) - 1) for g in r for x in g]


def ref_rpp_baseline(r, lengths):
    """c_i = r_i - group mean, broadcast over the response's L_i tokens; whitened over all tokens of the batch
    with the unbiased variance: (c - mean) / sqrt(var + 1e-8)."""
    c = [x - _mean(g) for g in r for x in g]
    tokens = [ci for ci, L in zip(c, lengths) for _ in range(L)]
    mu = _mean(tokens)
    var = sum((t - mu) ** 2 for t in tokens) / (len(tokens) - 1)
    return [(ci - mu) / math.sqrt(var + 1e-8) for ci in c]


def ref_passk(r, norm_by_std, eps=1e-6):
    """The best response of a group gets r_max - r_second_max (over std + eps), the others 0."""
    out = []
    for g in r:
        order = sorted(range(len(g)), key=lambda i: -g[i])
        margin = g[order[0]] - g[order[1]]
        if norm_by_std:
            margin /= _std(g) + eps
        out += [margin if i == order[0] else 0.0 for i in range(len(g))]
    return out


def _flat(r):
    return torch.tensor([x for g in r for x in g], dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_matches_the_definition(seed):
    r, _ = _scores(seed)
    got = advantages("rloo", _flat(r), N)
    assert (got - torch.tensor(ref_rloo(r), dtype=torch.float64)).abs().max() <= TOL
    assert torch.equal(got[N:2 * N], torch.zeros(N))  # a uniform group: exactly 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_plus_plus_baseline_matches_the_definition(seed):
    r, lengths = _scores(seed)
    got = advantages("reinforce_plus_plus_baseline", _flat(r), N, lengths=torch.tensor(lengths))
    want = torch.tensor(ref_rpp_baseline(r, lengths), dtype=torch.float64)
    assert (got - want).abs().max() <= TOL
    # token-weighted: the lengths matter (equal lengths would give another answer)
    other = advantages("reinforce_plus_plus_baseline", _flat(r), N, lengths=torch.ones(len(lengths), dtype=torch.long))
    assert (other - got).abs().max() > 1e-3
    with pytest.raises(ValueError, match="needs the responses' lengths"):
        advantages("reinforce_plus_plus_baseline", _flat(r), N)


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_passk_matches_the_definition(seed, norm_by_std):
    r, _ = _scores(seed)
    got = advantages("grpo_passk", _flat(r), N, norm_by_std=norm_by_std)
    assert (got - torch.tensor(ref_passk(r, norm_by_std), dtype=torch.float64)).abs().max() <= TOL
    assert torch.equal(got[N:3 * N], torch.zeros(2 * N))  # uniform group; a tie at the top
    assert int((got != 0).sum()) <= len(r)  # at most one response per group


@pytest.mark.parametrize("norm,glob", [(True, False), (False, False), (True, True), (False, True)])
def test_grpo_is_group_advantages_bit_for_bit(norm, glob):
    """algo.adv_estimator=grpo (the default) gives today's numbers, DrGRPO and the global norm included; the
    global norm acts on any estimator the same way: A / (std_batch(A) + eps)."""
    r, _ = _scores(3)
    x = _flat(r)
    assert torch.equal(advantages("grpo", x, N, norm_by_std=norm, global_norm=glob), group_advantages(x, N, norm, glob))
    if glob:
        a = advantages("rloo", x, N)
        want = [v / (_std(a.tolist()) + 1e-6) for v in a.tolist()]
        assert (advantages("rloo", x, N, global_norm=True) - torch.tensor(want, dtype=torch.float64)).abs().max() <= TOL


def test_shape_step_uses_the_estimator():
    r, lengths = _scores(4)
    x = _flat(r)
    mask = torch.arange(32).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    for name in ADV_ESTIMATORS.names():
        shaped = shape_step(StepShaping(n=N, adv_estimator=name), x, torch.zeros(len(x), dtype=torch.bool),
                            response_mask=mask)
        assert torch.equal(shaped.advantages, advantages(name, x, N, lengths=torch.tensor(lengths)))
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gae'; valid: grpo, grpo_passk, "
                                         r"reinforce_plus_plus_baseline, rloo"):
        StepShaping(n=N, adv_estimator="gae")
