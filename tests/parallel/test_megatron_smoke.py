"""megatron-core runs on CPU ranks: a tiny GPTModel (local spec) through get_forward_backward_func and the
DistributedOptimizer, at several layouts, against TP1xPP1 from the same weights (moved by dist_checkpointing)."""

import pytest

from grpo_mega.smoke import compare_layouts, run_layout

# fp32 on CPU: layouts differ only in the order of the reductions; measured worst 1.8e-7.
REL_TOL = 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("smoke_ckpt"))
    return ckpt, run_layout(1, 1, 1, ckpt, save=True)


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 1), (2, 1, 2), (1, 4, 1), (4, 1, 1), (1, 2, 2)])
def test_layout_matches_tp1pp1(reference, tp, pp, dp):
    ckpt, ref = reference
    got = run_layout(tp, pp, dp, ckpt, save=False)
    assert len(got["losses"]) == len(ref["losses"]) == 4
    pairs = list(zip(ref["losses"] + ref["losses_after_step"], got["losses"] + got["losses_after_step"]))
    pairs.append((ref["grad_norm"], got["grad_norm"]))
    for a, b in pairs:
        assert abs(a - b) <= REL_TOL * abs(a), (a, b)
    # the optimizer step did something: the loss moved by far more than the tolerance
    assert abs(ref["losses_after_step"][0] - ref["losses"][0]) > 1e-2


def test_compare_layouts_reports_worst_difference():
    ref, got, worst = compare_layouts(2, 2, 1)
    assert 0 <= worst < REL_TOL
