"""verl's rejection-sampling metrics (rollout_corr/rollout_rs_*), rollout_is_std and log_ppl_diff_max / _min
(grpo_mega.algo.correction.rejection_sums / rejection_metrics, is_std_sums / is_std, offpolicy_maxs), against
references written here from verl's published definitions (verl/trainer/ppo/rollout_corr_helper.py:
compute_rs_metrics and compute_rollout_rejection_mask for rollout_rs_*, compute_is_metrics for rollout_is_std,
compute_offpolicy_metrics for log_ppl_diff_max / _min), in float64 Python loops over the valid tokens, with two-pass
variances (not the sums the code reduces): random inputs with holes, an all-masked row, a one-token response,
log-ratios of +-25 (beyond the e^+-20 clamp), and the rows split over three "ranks" (the sums add, the maxima max,
a rank without a valid token included)."""

import math

import pytest
import torch

from grpo_mega.algo import correction as C
from tests.algo.test_rollout_rejection import B, T, _inputs  # the same edge-case inputs (+-25 log-ratios, empty rows)

THRESHOLDS = {"token": 0.1, "seq_sum": 1.0, "seq_mean": 0.12, "seq_max": 0.5}


def _std(xs, ddof):
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - ddof))


def _rs_reference(old, eng, mask, name, thr):
    """compute_rs_metrics + compute_rollout_rejection_mask for one k2/k3 option, token by token."""
    level, k = name.rsplit("_", 1)

    def d(i, t):
        lr = min(max(float(old[i, t] - eng[i, t]), -20.0), 20.0)
        return 0.5 * lr * lr if k == "k2" else math.exp(lr) - 1.0 - lr

    tok, seq_v, seq_rej = [], [], []  # (statistic, rejected) per valid token; v_i and "has a rejected token"
    for i in range(B):
        ts = [t for t in range(T) if mask[i, t]]
        if not ts:
            continue
        ds = [d(i, t) for t in ts]
        if level == "token":
            stats, v = ds, sum(ds) / len(ds)  # seq values: the masked mean of the token statistic
        else:
            v = {"seq_sum": sum(ds), "seq_mean": sum(ds) / len(ds), "seq_max": max(ds)}[level]
            stats = [v] * len(ts)  # the response's statistic on each of its tokens
        rej = [s > thr for s in stats]
        tok += list(zip(stats, rej))
        seq_v.append(v)
        seq_rej.append(any(rej))
    n, q = len(tok), len(seq_v)
    stats = [s for s, _ in tok]
    p = f"rollout_rs_{name}"
    return {
        f"{p}_mean": sum(stats) / n,
        f"{p}_max": max(stats), f"{p}_min": min(stats),
        f"{p}_fraction_high": (sum(s > thr for s in stats) / n if level == "token"
                               else sum(v > thr for v in seq_v) / q),
        f"{p}_fraction_low": 0.0,
        f"{p}_std": _std([min(max(s, 0.0), thr) for s in stats], 0) if n > 1 else 0.0,
        f"{p}_seq_mean": sum(seq_v) / q,
        f"{p}_seq_std": _std(seq_v, 1) if q > 1 else 0.0,
        f"{p}_seq_max": max(seq_v), f"{p}_seq_min": min(seq_v),
        f"{p}_seq_max_deviation": max(abs(v) for v in seq_v),
        f"{p}_seq_fraction_high": sum(v > thr for v in seq_v) / q,
        f"{p}_masked_fraction": sum(r for _, r in tok) / n,
        f"{p}_seq_masked_fraction": sum(seq_rej) / q,
        "rollout_rs_masked_fraction": sum(r for _, r in tok) / n,
        "rollout_rs_seq_masked_fraction": sum(seq_rej) / B,  # verl: the mean over every row
    }


def _check(got, want, rel=1e-12):
    assert set(got) == {f"rollout_corr/{k}" for k in want}
    for k, v in want.items():
        assert got[f"rollout_corr/{k}"] == pytest.approx(v, rel=rel, abs=1e-13), k


SPLITS = (slice(0, 2), slice(2, 3), slice(3, 5), slice(5, B))  # row 2 alone: a rank without a valid token


@pytest.mark.parametrize("name", C.REJECTIONS)
def test_rollout_rs_metrics_match_verl_definitions(name):
    old, eng, mask = _inputs(0)
    r = C.resolve_rejection(name, THRESHOLDS[name.rsplit("_", 1)[0]])
    want = _rs_reference(old, eng, mask, name, r.threshold)
    assert 0 < want["rollout_rs_masked_fraction"] < 1  # the threshold rejects some tokens and keeps others
    _check(C.rejection_metrics(name, r, *C.rejection_sums(old, eng, mask, r)), want, rel=1e-10)
    parts = [C.rejection_sums(old[s], eng[s], mask[s], r) for s in SPLITS]
    sums = sum(p[0] for p in parts)
    maxs = torch.stack([p[1] for p in parts]).max(dim=0).values
    _check(C.rejection_metrics(name, r, sums, maxs), want, rel=1e-10)
    empty = torch.zeros_like(mask)
    assert C.rejection_metrics(name, r, *C.rejection_sums(old, eng, empty, r)) == {}


def _is_std_reference(old, eng, mask, level, high):
    """compute_is_metrics' rollout_is_std: the token-masked population std of the IS weights (token: exp(lr_t),
    sequence: exp(sum_t lr_t), geometric: exp(mean_t lr_t), log-ratios clamped to +-20) clamped to [1/high, high]."""
    ws = []
    for i in range(B):
        ts = [t for t in range(T) if mask[i, t]]
        lrs = [float(old[i, t] - eng[i, t]) for t in ts]
        for lr in lrs:
            x = {"token": lr, "sequence": sum(lrs), "geometric": sum(lrs) / max(len(lrs), 1)}[level]
            ws.append(min(max(math.exp(min(max(x, -20.0), 20.0)), 1.0 / high), high))
    return _std(ws, 0) if len(ws) > 1 else 0.0


@pytest.mark.parametrize("level,mode,high", [("token", "truncate", 2.0), ("sequence", "truncate", 2.0),
                                             ("geometric", "mask", 1.1), ("token", "mask", 5.0)])
def test_rollout_is_std_matches_verl_definition(level, mode, high):
    old, eng, mask = _inputs(1)
    eng[6] = old[6] + 1e-4 * torch.randn(T, dtype=torch.float64)  # weights near 1
    c = C.resolve(level, mode=mode, high=high)
    want = _is_std_reference(old, eng, mask, level, high)
    assert want > 0
    assert C.is_std(C.is_std_sums(old, eng, mask, c)) == pytest.approx(want, rel=1e-10)
    assert C.is_std(sum(C.is_std_sums(old[s], eng[s], mask[s], c) for s in SPLITS)) == pytest.approx(want, rel=1e-10)
    one = torch.zeros_like(mask)
    one[0, 0] = True  # one valid token: verl's guard gives 0
    assert C.is_std(C.is_std_sums(old, eng, one, c)) == 0.0
    # weights within 1e-7 of 1: the std is still the definition's to 1e-6, the shifted sums keep it clear of rounding
    near = old + 1e-7 * torch.randn(B, T, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    tiny = _is_std_reference(old, near, mask, level, high)
    assert C.is_std(C.is_std_sums(old, near, mask, c)) == pytest.approx(tiny, rel=1e-6, abs=0)


def test_log_ppl_diff_max_and_min_match_verl_definition():
    old, eng, mask = _inputs(2)
    diffs = []
    for i in range(B):
        ts = [t for t in range(T) if mask[i, t]]
        if ts:  # as the other per-response metrics here, over the responses with a valid token
            diffs.append(sum(float(eng[i, t]) for t in ts) / len(ts) - sum(float(old[i, t]) for t in ts) / len(ts))
    got = C.offpolicy_metrics(C.offpolicy_sums(old, eng, mask), C.offpolicy_maxs(old, eng, mask))
    assert got["rollout_corr/log_ppl_diff_max"] == pytest.approx(max(diffs), rel=1e-12)
    assert got["rollout_corr/log_ppl_diff_min"] == pytest.approx(min(diffs), rel=1e-12)
    assert min(diffs) < 0 < max(diffs)
    sums = sum(C.offpolicy_sums(old[s], eng[s], mask[s]) for s in SPLITS)
    maxs = torch.stack([C.offpolicy_maxs(old[s], eng[s], mask[s]) for s in SPLITS]).max(dim=0).values
    split = C.offpolicy_metrics(sums, maxs)
    assert split["rollout_corr/log_ppl_diff_max"] == got["rollout_corr/log_ppl_diff_max"]
    assert split["rollout_corr/log_ppl_diff_min"] == got["rollout_corr/log_ppl_diff_min"]
    assert "rollout_corr/log_ppl_diff_max" not in C.offpolicy_metrics(C.offpolicy_sums(old, eng, mask))
