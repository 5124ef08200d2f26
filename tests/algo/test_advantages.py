import math

import pytest
import torch

from grpo_mega.algo import group_advantages, kl_in_reward, nonuniform_groups, response_mask



def _loop_advantages(rewards, n, norm_by_std, eps=1e-6):
    out = []
    for g in range(len(rewards) // n):
        grp = rewards[g * n : (g + 1) * n]
        mean = sum(grp) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (n - 1))
        for r in grp:
            if all(x == grp[0] for x in grp):
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if norm_by_std else r - mean)
    return out


def test_hand_computed_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, n=4)
    s = math.sqrt(1 / 3)  # sample std (N-1) of [1, 0, 0, 1]
    expected = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0, 0, 0, 0]
    assert a.tolist() == pytest.approx(expected, abs=1e-12)
    assert group_advantages(r, n=4, norm_by_std=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], abs=1e-15)


def test_equal_rewards_give_exactly_zero_despite_rounding():
    # mean(0.1, 0.1, 0.1) is 0.10000000000000002 in float64: centring alone would leave -2.8e-17.
    r = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.7, 0.2, 0.9])
    for norm in (True, False):
        for glob in (True, False):
            a = group_advantages(r, n=3, norm_by_std=norm, global_norm=glob)
            assert torch.equal(a[:6], torch.zeros(6))
            assert (a[6:] != 0).all()


def test_global_norm_is_group_mean_batch_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    a = group_advantages(r, n=2, norm_by_std=False, global_norm=True)
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0])
    batch_std = math.sqrt((0.25 + 0.25) / 3)
    assert a.tolist() == pytest.approx((centred / (batch_std + 1e-6)).tolist(), abs=1e-12)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_loop_vs_vectorised(norm_by_std):
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (40,), generator=g).double() / 2
    r[:5] = 1.0  # one uniform group
    got = group_advantages(r, n=5, norm_by_std=norm_by_std)
    assert got.tolist() == pytest.approx(_loop_advantages(r.tolist(), 5, norm_by_std), abs=1e-12)


def test_bad_group_shapes_raise():
    with pytest.raises(ValueError, match="rollout.n=1 must be >= 2"):
        group_advantages(torch.zeros(4), n=1)
    with pytest.raises(ValueError, match="do not split into groups"):
        group_advantages(torch.zeros(5), n=2)


def test_nonuniform_groups_filter():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert nonuniform_groups(r, n=2).tolist() == [False, True, False]


def test_response_mask_from_lengths_not_pad_ids():
    m = response_mask(torch.tensor([3, 0, 5]), 5)
    assert m.tolist() == [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="exceeds max_len"):
        response_mask(torch.tensor([6]), 5)


def test_kl_in_reward_hand_computed():
    scores = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tok, seq = kl_in_reward(scores, kl, mask, beta=0.5)
    torch.testing.assert_close(tok, torch.tensor([[-0.05, 1 - 0.1, 0.0], [-0.25, -0.25, -0.25]]), rtol=0, atol=1e-15)
    assert seq.tolist() == pytest.approx([1 - 0.15, -0.75], abs=1e-15)
