import math

import pytest
import torch

from grpo_mega.algo import (
    AGG_MODES,
    aggregate,
    clipped_surrogate,
    entropy_bonus,
    grpo_token_loss,
    has_extreme_ratio,
    kl_penalty,
    local_normaliser,
    megatron_loss_scale,
    response_mask,
    valid_token_scale,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _ratio_logps(ratios):
    old = torch.zeros(len(ratios))
    return torch.tensor([math.log(r) for r in ratios]), old


def test_surrogate_hand_computed():
    # (ratio, advantage) -> loss with eps_low=0.2, eps_high=0.28 (clip-higher)
    cases = [
        (1.5, 1.0, -1.28, True),  # above 1+eps_high with A>0: clipped
        (1.5, -1.0, 1.5, False),  # A<0, ratio up: the unclipped (larger) loss
        (0.5, 1.0, -0.5, False),  # A>0, ratio down: unclipped
        (0.5, -1.0, 0.8, True),  # A<0 below 1-eps_low: clipped
        (1.1, 2.0, -2.2, False),  # inside the trust region
    ]
    logp, old = _ratio_logps([c[0] for c in cases])
    adv = torch.tensor([c[1] for c in cases])
    loss, clipped = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([c[2] for c in cases]), rtol=0, atol=1e-14)
    assert clipped.tolist() == [c[3] for c in cases]


def test_dual_clip_bounds_negative_advantages():
    logp, old = _ratio_logps([5.0, 1.5, 5.0])
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, _ = clipped_surrogate(logp, old, adv, 0.2, 0.2, dual_clip=3.0)
    # ratio 5, A=-1: max(5, 1.2) = 5, dual-clipped to 3; ratio 1.5 stays 1.5; A>0 untouched: -1.2
    torch.testing.assert_close(loss, torch.tensor([3.0, 1.5, -1.2]), rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="dual_clip=1.0 must be > 1"):
        clipped_surrogate(logp, old, adv, 0.2, 0.2, dual_clip=1.0)


def test_log_ratio_clamped_before_exp():
    loss, _ = clipped_surrogate(torch.tensor([100.0]), torch.tensor([0.0]), torch.tensor([-1.0]), 0.2, 0.2)
    assert loss.item() == pytest.approx(math.exp(20.0))


def test_surrogate_loop_vs_vectorised():
    g = torch.Generator().manual_seed(3)
    logp, old = -torch.rand(5, 9, generator=g) * 3, -torch.rand(5, 9, generator=g) * 3
    adv = torch.randn(5, generator=g)
    loss, _ = clipped_surrogate(logp, old, adv, 0.2, 0.3, dual_clip=3.0)
    for i in range(5):
        for t in range(9):
            r = math.exp(logp[i, t].item() - old[i, t].item())
            a = adv[i].item()
            l = max(-a * r, -a * min(max(r, 0.8), 1.3))
            if a < 0:
                l = min(l, -3.0 * a)
            assert loss[i, t].item() == pytest.approx(l, abs=1e-13)


L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode,normaliser,expected",
    [
        ("token-mean", 3.0, 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 2.0, 7 / 2),  # (3 + 4) / 2 sequences
        ("seq-mean-token-mean", 2.0, (3 / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", 6.0, 7 / 6),  # / (2 sequences * max_response_length 3)
    ],
)
def test_aggregation_hand_computed(mode, normaliser, expected):
    assert local_normaliser(mode, M, max_response_length=3).item() == normaliser
    assert aggregate(L, M, mode, normaliser).item() == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_loop_vs_vectorised(mode):
    g = torch.Generator().manual_seed(4)
    loss = torch.randn(6, 8, generator=g)
    mask = response_mask(torch.tensor([8, 1, 3, 0, 5, 7]), 8)
    norm = local_normaliser(mode, mask, 8)
    total = 0.0
    for i in range(6):
        seq_sum = sum(loss[i, t].item() for t in range(8) if mask[i, t])
        n_tok = sum(1 for t in range(8) if mask[i, t])
        total += seq_sum / max(n_tok, 1) if mode == "seq-mean-token-mean" else seq_sum
    assert aggregate(loss, mask, mode, norm).item() == pytest.approx(total / norm.item(), abs=1e-13)


def test_dapo_valid_token_scale():
    s = valid_token_scale(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]))
    torch.testing.assert_close(s, torch.tensor([[0.5, 0.5, 0, 0], [0.25] * 4, [0.0] * 4]), rtol=0, atol=0)


def test_entropy_bonus_and_token_loss_composition():
    logp, old = _ratio_logps([1.0, 1.0])
    adv = torch.tensor([1.0, -2.0])
    kl, ent = torch.tensor([0.3, 0.1]), torch.tensor([2.0, 1.0])
    assert entropy_bonus(ent, 0.01).tolist() == pytest.approx([-0.02, -0.01])
    loss, terms = grpo_token_loss(logp, old, adv, 0.2, 0.2, kl=kl, kl_coef=0.5, entropy=ent, entropy_coef=0.01)
    torch.testing.assert_close(loss, torch.tensor([-1.0 + 0.15 - 0.02, 2.0 + 0.05 - 0.01]), rtol=0, atol=1e-15)
    torch.testing.assert_close(terms["pg_loss"], torch.tensor([-1.0, 2.0]), rtol=0, atol=1e-15)


def test_early_stop_on_extreme_ratio():
    logp, old = _ratio_logps([1.0, 2.5, 1.0])
    mask = torch.tensor([1, 1, 1])
    assert bool(has_extreme_ratio(logp, old, mask, threshold=2.0))
    assert not bool(has_extreme_ratio(logp, old, torch.tensor([1, 0, 1]), threshold=2.0))  # masked out
    assert not bool(has_extreme_ratio(logp, old, mask, threshold=3.0))
    logp, old = _ratio_logps([0.3])
    assert bool(has_extreme_ratio(logp, old, torch.tensor([1]), threshold=3.0))  # 0.3 < 1/3
    with pytest.raises(ValueError, match="must be > 1"):
        has_extreme_ratio(logp, old, torch.tensor([1]), threshold=1.0)


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'seq-mean'; valid: seq-mean-token-mean"):
        aggregate(L, M, "seq-mean", 1.0)
    assert sorted(MODES) == AGG_MODES.names()


# ---- micro-batch and DP invariance of the gradient ---------------------------------------------------


def _problem(seed=5, B=8, T=6, V=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([6, 1, 3, 2, 6, 4, 5, 2])
    mask = response_mask(lengths, T)
    old = torch.log_softmax(logits + 0.3 * torch.randn(B, T, V, generator=g), -1).gather(-1, tokens[..., None])[..., 0]
    ref = torch.log_softmax(logits + 0.5 * torch.randn(B, T, V, generator=g), -1).gather(-1, tokens[..., None])[..., 0]
    adv = torch.randn(B, generator=g)
    return logits, tokens, mask, old, ref, adv


def _minibatch_loss(theta, tokens, mask, old, ref, adv, mode, normaliser, dapo_scale):
    logprobs = torch.log_softmax(theta, -1)
    logp = logprobs.gather(-1, tokens[..., None])[..., 0]
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    loss, _ = grpo_token_loss(
        logp, old, adv, 0.2, 0.28, dual_clip=3.0, kl=kl_penalty(logp, ref, "k3"), kl_coef=0.1,
        entropy=entropy, entropy_coef=0.01, token_scale=valid_token_scale(mask) if dapo_scale else None,
    )
    return aggregate(loss, mask, mode, normaliser)


@pytest.mark.parametrize("dapo_scale", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_microbatch_and_dp_split_gives_minibatch_gradient(mode, dapo_scale):
    logits, tokens, mask, old, ref, adv = _problem()
    T = mask.shape[1]
    theta = logits.clone().requires_grad_(True)
    whole_norm = local_normaliser(mode, mask, T)
    _minibatch_loss(theta, tokens, mask, old, ref, adv, mode, whole_norm, dapo_scale).backward()
    expected = theta.grad.clone()

    for dp in (1, 2):
        for mbs in (1, 2, 4):
            per_rank = 8 // dp
            n_micro = per_rank // mbs
            # The normaliser: every micro-batch's share, summed over micro-batches and DP ranks.
            norm = sum(local_normaliser(mode, mask[i : i + mbs], T) for i in range(0, 8, mbs))
            rank_grads = []
            for rank in range(dp):
                theta = logits.clone().requires_grad_(True)
                for k in range(n_micro):
                    sl = slice(rank * per_rank + k * mbs, rank * per_rank + (k + 1) * mbs)
                    mb = _minibatch_loss(theta[sl], tokens[sl], mask[sl], old[sl], ref[sl], adv[sl], mode, norm, dapo_scale)
                    # what Megatron does with it: divide by the number of micro-batches, accumulate
                    (mb * megatron_loss_scale(n_micro, dp) / n_micro).backward()
                rank_grads.append(theta.grad)
            got = sum(rank_grads) / dp  # DDP's average over DP ranks
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10, msg=f"{mode} dp={dp} micro={mbs}")


def test_truncated_importance_weight():
    from grpo_mega.algo import truncated_is_weight

    old = torch.tensor([math.log(0.5), math.log(0.9), math.log(0.1)])
    eng = torch.tensor([math.log(0.25), math.log(0.9), math.log(0.5)])
    w = truncated_is_weight(old, eng, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([1.5, 1.0, 0.2]), rtol=0, atol=1e-12)  # 2.0 capped at 1.5
    assert not w.requires_grad
