import itertools
import math

import pytest
import torch

from grpo_mega import algo
from grpo_mega.algo.shaping import ShapedStep, StepShaping, loss_rows, overlong_rewards, shape_step


def _inline(rewards, overlong, n, mode, kl_in_reward, kl_coef, kl_estimator, norm_by_std, global_norm, dynamic,
            old_logp=None, ref_logp=None, mask=None):
    """The trainer loop's inline shaping before it moved into algo.shaping (grpo_mega/trainer/loop.py at
    ab5b7bc), verbatim but for the names: shape_step must give exactly these tensors."""
    if mode == "zero":
        rewards = torch.where(overlong, 0.0, rewards)
    scores = rewards
    if kl_in_reward:
        kl = algo.kl_penalty(old_logp, ref_logp, kl_estimator)
        scores = algo.kl_in_reward(rewards, kl, mask, kl_coef)[1]
    advantages = algo.group_advantages(scores, n, norm_by_std, global_norm)
    in_loss = torch.ones(len(rewards), dtype=torch.bool)
    if mode == "mask":
        in_loss &= ~overlong
    if dynamic:
        in_loss &= algo.nonuniform_groups(scores, n).repeat_interleave(n)
    return rewards, scores, advantages, in_loss


def _step(num_prompts=4, n=4, length=7, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (num_prompts * n,), generator=g).to(dtype) / 2
    rewards[:n] = 1.0  # a uniform group
    overlong = torch.rand(num_prompts * n, generator=g) < 0.3
    old_logp = -torch.rand(num_prompts * n, length, generator=g, dtype=dtype) * 3
    ref_logp = old_logp + torch.randn(num_prompts * n, length, generator=g, dtype=dtype) * 0.2
    lens = torch.randint(0, length + 1, (num_prompts * n,), generator=g)
    start = torch.randint(0, 2, (num_prompts * n, 1), generator=g)
    pos = torch.arange(length).unsqueeze(0)
    mask = (pos >= start) & (pos < start + lens.unsqueeze(1).clamp(max=length - 1))
    return rewards, overlong, old_logp, ref_logp, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bit_identical_to_the_loops_inline_shaping(dtype):
    rewards, overlong, old_logp, ref_logp, mask = _step(dtype=dtype)
    for mode, kir, est, norm, glob, dyn in itertools.product(
        ("keep", "zero", "mask"), (False, True), ("k1", "k3"), (True, False), (False, True), (False, True)
    ):
        s = StepShaping(n=4, overlong=mode, kl_in_reward=kir, kl_coef=0.05, kl_estimator=est, norm_adv_by_std=norm,
                        global_adv_norm=glob, dynamic_sampling=dyn)
        got = shape_step(s, rewards, overlong, old_logp, ref_logp, mask)
        want = _inline(rewards, overlong, 4, mode, kir, 0.05, est, norm, glob, dyn, old_logp, ref_logp, mask)
        for a, b in zip((got.rewards, got.scores, got.advantages, got.in_loss), want):
            assert a.dtype == b.dtype and torch.equal(a, b), (mode, kir, est, norm, glob, dyn)


def test_overlong_keep_zero_mask():
    r = torch.tensor([1.0, 0.5, 1.0, 0.0])
    over = torch.tensor([True, False, False, True])
    keep = shape_step(StepShaping(n=2, overlong="keep"), r, over)
    assert torch.equal(keep.rewards, r) and keep.in_loss.all()
    zero = shape_step(StepShaping(n=2, overlong="zero"), r, over)
    assert zero.rewards.tolist() == [0.0, 0.5, 1.0, 0.0] and zero.in_loss.all()
    assert torch.equal(zero.advantages, algo.group_advantages(torch.tensor([0.0, 0.5, 1.0, 0.0]), 2))
    mask = shape_step(StepShaping(n=2, overlong="mask"), r, over)
    assert torch.equal(mask.rewards, r) and mask.in_loss.tolist() == [False, True, True, False]
    assert torch.equal(mask.advantages, keep.advantages)  # masked rows still count in their group's baseline
    assert torch.equal(overlong_rewards(r, over, "zero"), zero.rewards)


def test_bad_overlong_mode_names_the_field():
    with pytest.raises(ValueError, match=r"reward\.overlong='drop' must be 'keep', 'zero' or 'mask'"):
        StepShaping(n=4, overlong="drop")
    with pytest.raises(ValueError, match=r"reward\.overlong"):
        overlong_rewards(torch.zeros(2), torch.zeros(2, dtype=torch.bool), "drop")
    with pytest.raises(ValueError, match=r"reward\.overlong"):
        loss_rows(torch.zeros(2), torch.zeros(2, dtype=torch.bool), 2, "drop", False)


def test_other_bad_settings():
    with pytest.raises(ValueError, match=r"rollout\.n=1 must be >= 2"):
        StepShaping(n=1)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        StepShaping(n=2, kl_estimator="k9")
    with pytest.raises(ValueError, match="kl_estimator='full' with algo.kl_in_reward"):
        StepShaping(n=2, kl_in_reward=True, kl_estimator="full")
    with pytest.raises(ValueError, match="kl_in_reward=true needs old_logp, ref_logp"):
        shape_step(StepShaping(n=2, kl_in_reward=True, kl_coef=0.1), torch.zeros(2), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="both need one entry per response"):
        shape_step(StepShaping(n=2), torch.zeros(4), torch.zeros(2, dtype=torch.bool))


def test_kl_in_reward_by_hand():
    """Two groups of two, k1 and beta = 0.5: score - beta * sum over the response tokens of (old - ref)."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0], [-0.1, -0.2, -0.3], [-3.0, -1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -1.2, -9.0], [-0.1, -0.2, -0.3], [-2.0, -1.0, -2.0]])
    mask = torch.tensor([[True, True, False], [False, True, False], [True, True, True], [True, False, False]])
    # response KL sums: row 0: 0.5 + (-1.0) = -0.5; row 1: 0.2 (position 2's -8 is outside the mask);
    # row 2: 0; row 3: -1.0
    s = StepShaping(n=2, kl_in_reward=True, kl_coef=0.5, kl_estimator="k1", norm_adv_by_std=False)
    got = shape_step(s, rewards, torch.zeros(4, dtype=torch.bool), old, ref, mask)
    expected = [1.0 + 0.25, 0.0 - 0.1, 1.0, 1.0 + 0.5]
    assert got.scores.tolist() == pytest.approx(expected, abs=1e-12)
    assert torch.equal(got.rewards, rewards)  # the task's rewards are reported unshaped
    # DrGRPO centring of the shaped scores: group 2 is no longer uniform
    assert got.advantages.tolist() == pytest.approx([0.675, -0.675, -0.25, 0.25], abs=1e-12)


def test_dynamic_sampling_drops_uniform_groups():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    over = torch.zeros(9, dtype=torch.bool)
    off = shape_step(StepShaping(n=3), r, over)
    on = shape_step(StepShaping(n=3, dynamic_sampling=True), r, over)
    assert off.in_loss.all()
    assert on.in_loss.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert torch.equal(on.advantages, off.advantages)  # the filter changes the rows, never the advantages


def test_dynamic_sampling_looks_at_the_shaped_scores():
    """A group of equal task rewards whose KL penalties differ is not uniform after KL-in-reward."""
    rewards = torch.ones(2)
    old = torch.tensor([[-1.0], [-1.0]])
    ref = torch.tensor([[-1.0], [-2.0]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    s = StepShaping(n=2, kl_in_reward=True, kl_coef=0.1, kl_estimator="k1", dynamic_sampling=True)
    assert shape_step(s, rewards, torch.zeros(2, dtype=torch.bool), old, ref, mask).in_loss.all()


def test_overlong_mask_and_dynamic_sampling_combine():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 1.0, 0.0])
    over = torch.tensor([False, True, True, False, False, False, False, True])
    s = StepShaping(n=2, overlong="mask", dynamic_sampling=True)
    got = shape_step(s, r, over)
    # groups: (1, 1) uniform; (0, 1) kept, its first row overlong; (0.5, 0.5) uniform; (1, 0) kept, row 7 overlong
    assert got.in_loss.tolist() == [False, False, False, True, False, False, True, False]
    # with 'zero' the overlong rewards become 0 first, and the filter sees the zeroed groups
    z = shape_step(StepShaping(n=2, overlong="zero", dynamic_sampling=True), r, over)
    assert z.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 1.0, 0.0]
    assert z.in_loss.tolist() == [True, True, True, True, False, False, True, True]


def test_global_adv_norm_and_result_type():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    got = shape_step(StepShaping(n=3, global_adv_norm=True), r, torch.zeros(6, dtype=torch.bool))
    assert isinstance(got, ShapedStep)
    assert torch.equal(got.advantages, algo.group_advantages(r, 3, True, True))
    assert math.isclose(float(got.advantages.std()), 1.0, rel_tol=1e-5)


def _dapo_r_length(y, l_max, l_cache):
    """DAPO eq. 13, written from the paper: 0, then a linear ramp over the last l_cache tokens, -1 beyond."""
    if y <= l_max - l_cache:
        return 0.0
    if y <= l_max:
        return ((l_max - l_cache) - y) / l_cache
    return -1.0


def test_soft_overlong_penalty_is_dapos():
    """reward.overlong_buffer_len: score = reward + factor * R_length(|y|) (DAPO, Yu et al. 2025, eq. 13; verl's
    penalty_factor), the advantages from it; the logged rewards stay the task's. 1e-12: a few float64 operations."""
    from grpo_mega.algo.shaping import overlong_penalty

    lengths = torch.tensor([10, 40, 41, 50, 60, 64, 3, 63])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    for factor in (1.0, 0.5):
        want_pen = [factor * _dapo_r_length(int(y), 64, 24) for y in lengths]
        got_pen = overlong_penalty(lengths, 64, 24, factor)
        assert max(abs(a - b) for a, b in zip(got_pen.tolist(), want_pen)) <= 1e-12
        assert overlong_penalty(torch.tensor([65]), 64, 24, factor).item() == -factor
        s = StepShaping(n=4, overlong_buffer_len=24, overlong_penalty_factor=factor, max_response_length=64)
        got = shape_step(s, rewards, lengths == 64, response_lengths=lengths)
        assert torch.equal(got.rewards, rewards)
        want_scores = rewards + torch.tensor(want_pen, dtype=torch.float64)
        assert (got.scores - want_scores).abs().max() <= 1e-12
        assert torch.equal(got.advantages, algo.group_advantages(got.scores, 4))
    assert sum(p != 0 for p in want_pen) == 5  # both sides of the buffer's start are exercised
    with pytest.raises(ValueError,
                       match=r"reward\.overlong_buffer_len=80 must be in \[1, batch\.max_response_length=64\]"):
        StepShaping(n=4, overlong_buffer_len=80, max_response_length=64)
    with pytest.raises(ValueError, match="needs the responses' lengths"):
        shape_step(StepShaping(n=4, overlong_buffer_len=8, max_response_length=64), rewards, lengths == 64)


def test_overlong_buffer_settings_reach_the_shaping():
    from grpo_mega.conf.batch import BatchConfig
    from grpo_mega.conf.reward import RewardConfig
    from grpo_mega.conf.schema import TrainConfig

    with pytest.raises(ValueError, match=r"reward\.overlong_buffer_len=1000 must be <= batch\.max_response_length=256"):
        TrainConfig(reward=RewardConfig(overlong_buffer_len=1000), batch=BatchConfig(max_response_length=256))
    s = TrainConfig(reward=RewardConfig(overlong_buffer_len=16, overlong_penalty_factor=0.5)).shaping()
    assert (s.overlong_buffer_len, s.overlong_penalty_factor, s.max_response_length) == (16, 0.5, 256)
