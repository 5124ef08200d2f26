"""The rollout ratio's quantiles (grpo_mega.algo.correction.histogram_quantiles) against the exact order
statistics of the values (torch.sort): within the bin that holds the exact one, over ratios near 1 (a healthy
engine), spread ones (a perturbed engine) and values beyond the clamp."""

import math

import pytest
import torch

from grpo_mega.algo.correction import QUANTILES, histogram_bin, histogram_quantiles, log_ratio_histogram


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 0.3, 3.0, 30.0])
def test_quantiles_are_within_one_bin_of_the_order_statistic(scale):
    g = torch.Generator().manual_seed(int(scale * 1e6) % 1000)
    lr = torch.randn(5003, generator=g, dtype=torch.float64) * scale
    parts = lr.split([1000, 2003, 2000])  # as three ranks' tokens, summed
    counts = sum(log_ratio_histogram(p) for p in parts)
    assert counts.sum() == lr.numel()
    got = histogram_quantiles(counts)
    exact = lr.clamp(-20, 20).sort().values
    for q, rho in zip(QUANTILES, got):
        true = float(exact[math.ceil(q * lr.numel()) - 1])
        lo, hi = histogram_bin(true)
        assert lo <= math.log(rho) <= hi, (q, true, math.log(rho), lo, hi)
        assert hi - lo <= max(2e-6, 0.007 * abs(true))  # the resolution the docstring promises


def test_empty_is_nan():
    assert all(math.isnan(v) for v in histogram_quantiles(log_ratio_histogram(torch.zeros(0))))
