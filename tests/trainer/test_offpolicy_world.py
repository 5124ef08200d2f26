"""The step's rollout_corr/* metrics (grpo_mega.trainer.loop.world_offpolicy) on two gloo ranks, each owning every
other row, equal those of one process owning them all: the sums (SUM over the world) to 1e-12, the extremes
(log_ppl_diff_max / _min, rollout_rs_*_max / _min: MAX over the world) exactly; with a correction (rollout_is_std)
and a rejection (rollout_rs_*), a response without a valid token among the rows."""

import pytest
import torch
import torch.distributed as dist

from grpo_mega.algo.policy_loss import Objective
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.trainer.batch import RolloutBatch
from grpo_mega.trainer.loop import world_offpolicy

NEW = ("log_ppl_diff_max", "log_ppl_diff_min", "rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction")


def _batch(seed=0, n=9):
    g = torch.Generator().manual_seed(seed)
    prompts = [[1] * int(torch.randint(1, 5, (1,), generator=g)) for _ in range(n)]
    responses = [[2] * int(torch.randint(1, 8, (1,), generator=g)) for _ in range(n)]
    responses[3] = []  # no valid token
    rb = RolloutBatch.from_samples(prompts, responses)
    rb.old_logp = -torch.rand(rb.tokens.shape, generator=g) * 3 - 0.05
    rb.engine_logp = rb.old_logp + torch.randn(rb.tokens.shape, generator=g) * 0.4
    return rb


def _metrics(rb, objective, dp):
    rank = dist.get_rank() if dist.is_initialized() else 0
    return world_offpolicy(rb, list(range(rb.size))[rank::dp], objective)


@pytest.mark.parametrize("objective,names", [
    (Objective(rollout_correction="sequence", rollout_correction_high=2.0, rollout_rejection="token_k3",
               rollout_rejection_threshold=0.05), ("rollout_is_std", "rollout_rs_token_k3_std")),
    (Objective(rollout_rejection="seq_max_k2", rollout_rejection_threshold=0.3), ("rollout_rs_seq_max_k2_seq_std",)),
])
def test_dp2_equals_one_process(objective, names):
    rb = _batch()
    one = _metrics(rb, objective, 1)
    assert {f"rollout_corr/{k}" for k in NEW + names} <= set(one)
    assert ("rollout_corr/rollout_is_std" in one) == (objective.correction is not None)
    assert 0 < one["rollout_corr/rollout_rs_masked_fraction"] < 1
    for got in run_ranks(_metrics, 2, rb, objective, 2, timeout=60):
        assert set(got) == set(one)
        for k, v in one.items():
            exact = k.endswith(("_max", "_min", "_max_deviation"))
            assert got[k] == (v if exact else pytest.approx(v, rel=1e-12, abs=1e-15)), k
