"""The MoE update is the same under every expert-parallel split: loss, grad norm and every parameter's
gradient (router and each expert included) equal the single-process run's, for tiny-qwen3-moe (8 experts,
top-2) at EP2 (2 ranks), TP2xEP2, PP2xEP2 and DP2xEP2 (4 ranks: dp4, experts over 2, each expert on 2
expert-data-parallel ranks), through the packed path, in two aggregation modes.

The load-balancing loss is on (coefficient 1e-2; it moves the gradient by 1e-3 relative, 100x the tolerance)
where it can be equal by construction. megatron-core computes it per micro-batch and rank (summed over the TP
group, so TP with sequence parallelism keeps it whole): tokens_per_expert times the mean router probability
over the micro-batch's tokens, a non-linear function of which tokens share a micro-batch, padding included
(the trainer passes no padding mask). Its gradient is equal to one process's when every micro-batch holds the
same tokens in both runs: rows of one full-length sequence each (batch "full", micro_batch_size 1). With
several sequences to a row, DP balancing pairs other sequences than one process does, and the CPU EP path pads
each DP rank's i-th row to one length: measured at EP2 with PACKING_LENGTHS and micro_batch_size 2, the
gradient differs by 1.8e-3 relative with the coefficient 1e-3 (the policy-loss part alone matches to 5e-7);
those rows are tested with the aux loss off.
"""

import os

import pytest

from grpo_mega.parallel.forked import run_ranks
from tests.trainer import layouts as L
from tests.trainer.test_layout_invariance import REL_TOL, _check

LAYOUTS = {"EP2": (1, 1, 2), "TP2xEP2": (2, 1, 2), "PP2xEP2": (1, 2, 2), "DP2xEP2": (1, 1, 4)}  # tp, pp, dp; ep=2
AUX = dict(variant="tiny-qwen3-moe-aux", lengths="full", combos=[("token-mean", 1), ("seq-mean-token-sum", 1)])
PACKED = dict(variant="tiny-qwen3-moe", lengths="packing", combos=[("token-mean", 2), ("seq-mean-token-sum", 1)])


def _spec(case):
    return dict(variant=case["variant"], lengths=case["lengths"])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe"))


def _reference(tmp, case, name):
    (ref,) = run_ranks(L.make_reference, 1, os.path.join(tmp, name), False, case["combos"], "adam", _spec(case),
                       timeout=300)
    return ref


@pytest.fixture(scope="module")
def aux_reference(tmp):
    return _reference(tmp, AUX, "w0_aux")


@pytest.fixture(scope="module")
def packed_reference(tmp):
    return _reference(tmp, PACKED, "w0_packed")


def _run_and_check(tmp, ref, case, w0, name, tp, pp, dp):
    out = os.path.join(tmp, name)
    res = run_ranks(L.run_layout, tp * pp * dp, tp, pp, tp > 1, os.path.join(tmp, w0), out, ref[2], False,
                    case["combos"], "adam", dict(ep=2), _spec(case), timeout=300)
    (states,) = run_ranks(L.load_combos, 1, out, case["combos"], False, case["variant"], timeout=300)
    _check(ref, res, states)
    w0_state, per_combo = ref[0], ref[3]
    for combo, state in states.items():  # every tensor on its own, not only the whole gradient
        g_ref = per_combo[combo][1]
        names = [k for k in w0_state if float(g_ref[k].norm()) > 0]
        assert any("router" in k for k in names) and sum("local_experts" in k for k in names) >= 2 * 8
        # W0 - W1 is read back in fp32: each tensor's error also carries the rounding of W1 (an ulp of the
        # weight, 2^-23 |W| per element), which dominates for the q/k norms (weights ~1, gradients ~1e-3)
        errs = {k: float(((w0_state[k] - state[k]) - g_ref[k]).norm())
                / (REL_TOL * float(g_ref[k].norm()) + 2 * 2**-23 * float(w0_state[k].norm())) for k in names}
        worst = max(errs.values())
        assert worst <= 1.0, (combo, max(errs, key=errs.get), worst)
        print(f"{name} {case['variant']} {combo}: loss {res[0][1][combo]['loss']:.8f} vs "
              f"{per_combo[combo][0]['loss']:.8f}, grad_norm {res[0][1][combo]['grad_norm']:.8f} vs "
              f"{per_combo[combo][0]['grad_norm']:.8f}, worst tensor at {worst:.2f} of its tolerance, {len(names)} tensors")


def test_aux_loss_moves_the_gradient(aux_reference, tmp):
    """Without the load-balancing loss the single-process gradient differs by far more than the tolerance."""
    (noaux,) = run_ranks(L.make_reference, 1, os.path.join(tmp, "w0_noaux"), False, AUX["combos"], "adam",
                         dict(_spec(AUX), variant="tiny-qwen3-moe"), timeout=300)
    for combo in AUX["combos"]:
        g, g0 = aux_reference[3][combo][1], noaux[3][combo][1]
        rel = sum(float((g[k] - g0[k]).norm()) ** 2 for k in g) ** 0.5 / sum(float(g[k].norm()) ** 2 for k in g) ** 0.5
        assert rel > 50 * REL_TOL, (combo, rel)
        print(f"aux loss share of the gradient {combo}: {rel:.1e}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_with_aux_loss_matches_single_process(aux_reference, tmp, name):
    _run_and_check(tmp, aux_reference, AUX, "w0_aux", name, *LAYOUTS[name])


@pytest.mark.parametrize("name", ["TP2xEP2", "PP2xEP2"])
def test_moe_layout_with_packed_rows_matches_single_process(packed_reference, tmp, name):
    """Several sequences to a packed row (PACKING_LENGTHS: up to 4 in a 44-token row), aux loss off."""
    _run_and_check(tmp, packed_reference, PACKED, "w0_packed", "packed_" + name, *LAYOUTS[name])
