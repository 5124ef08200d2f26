"""The GRPO update is the same under every TP/PP/DP split: loss, grad norm and the full gradient (after
Megatron's grad finalisation) equal the single-process ones, for every aggregation mode and micro-batch size.

The gradient is read back through the optimizer (see layouts.OPTIMS): the updated weights are saved with
dist_checkpointing at the layout, loaded at TP1PP1, and W0 - W1 is compared with the single-process run's.
"""

import os

import pytest

import grpo_mega.algo
from grpo_mega.parallel.forked import run_ranks
from tests.trainer import layouts as L

REL_TOL = 1e-5  # fp32 on CPU; measured 4e-7 at worst
LAYOUTS = {  # name: (tp, pp, dp, sequence_parallel)
    "TP2": (2, 1, 1, False),
    "TP2-SP": (2, 1, 1, True),
    "PP2": (1, 2, 1, False),
    "DP2": (1, 1, 2, False),
    "TP2xPP2": (2, 2, 1, False),
    "TP2xDP2": (2, 1, 2, False),
    "PP2xDP2": (1, 2, 2, False),
    "TP4": (4, 1, 1, False),
    "PP4": (1, 4, 1, False),
}


def _rel_grad(w0, state, g_ref):
    num = sum(float(((w0[k] - state[k]) - g_ref[k]).norm()) ** 2 for k in w0) ** 0.5
    den = sum(float(g_ref[k].norm()) ** 2 for k in w0) ** 0.5
    return num / den


def _run(tmp, ref, name, tp, pp, dp, sp, combos=None, tied=False, optim="adam", parallel_kw=None):
    w0, logp, inputs, _ = ref
    out = os.path.join(tmp, name)
    res = run_ranks(L.run_layout, tp * pp * dp, tp, pp, sp, os.path.join(tmp, "w0"), out, inputs, tied, combos, optim,
                    parallel_kw, timeout=600)
    combos = combos or [(m, b) for m in L.MODES for b in L.MICRO]
    (states,) = run_ranks(L.load_combos, 1, out, combos, tied, timeout=300)
    return res, states


def _check(ref, res, states):
    w0, logp, _, per_combo = ref
    for r in res:  # every rank: the same logprobs (after the pipeline broadcast) and metrics
        assert (r[0] - logp).abs().max().item() <= REL_TOL
    for combo, state in states.items():
        m_ref, g_ref = per_combo[combo]
        for r in res:
            m = r[1][combo]
            assert abs(m["loss"] - m_ref["loss"]) <= REL_TOL * abs(m_ref["loss"]), (combo, m["loss"], m_ref["loss"])
            assert abs(m["grad_norm"] - m_ref["grad_norm"]) <= REL_TOL * m_ref["grad_norm"], combo
            assert m["tokens"] == m_ref["tokens"]
        rel = _rel_grad(w0, state, g_ref)
        assert rel <= REL_TOL, f"{combo}: gradient relative error {rel:.2e}"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("layouts"))


@pytest.fixture(scope="module")
def reference(tmp):
    (ref,) = run_ranks(L.make_reference, 1, os.path.join(tmp, "w0"), timeout=600)
    return ref


def test_reference_is_nontrivial(reference):
    w0, logp, _, per_combo = reference
    for combo, (m, g) in per_combo.items():
        norm = sum(float(t.norm()) ** 2 for t in g.values()) ** 0.5
        assert norm > 1e-3 and abs(norm - m["grad_norm"]) <= 1e-4 * norm  # W0 - W1 is the gradient
        assert 0 < m["clip_fraction"] < 1  # the clipped branch is exercised
    # the modes and micro-batch sizes differ in loss but not within a mode
    losses = {mode: {round(per_combo[(mode, b)][0]["loss"], 6) for b in L.MICRO} for mode in L.MODES}
    assert all(len(v) == 1 for v in losses.values()) and len({next(iter(v)) for v in losses.values()}) == 4


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(reference, tmp, name):
    tp, pp, dp, sp = LAYOUTS[name]
    res, states = _run(tmp, reference, name, tp, pp, dp, sp)
    _check(reference, res, states)


def test_non_distributed_optimizer_path(tmp):
    """The all-reduce (non-distributed optimizer) path, read back with SGD lr=1."""
    combos = [("token-mean", 2), ("seq-mean-token-sum-norm", 1)]
    (ref,) = run_ranks(L.make_reference, 1, os.path.join(tmp, "w0_sgd"), False, combos, "sgd", timeout=600)
    for name, (tp, pp, dp) in {"sgd_TP2xDP2": (2, 1, 2), "sgd_PP2xDP2": (1, 2, 2)}.items():
        out = os.path.join(tmp, name)
        res = run_ranks(L.run_layout, tp * pp * dp, tp, pp, False, os.path.join(tmp, "w0_sgd"), out, ref[2], False,
                        combos, "sgd", timeout=600)
        (states,) = run_ranks(L.load_combos, 1, out, combos, timeout=300)
        _check(ref, res, states)


def test_tied_embeddings_across_pipeline_stages(tmp):
    """Tied input/output embeddings live on the first and the last stage; their grads must be summed."""
    combos = [("token-mean", 2), ("seq-mean-token-mean", 4)]
    (ref,) = run_ranks(L.make_reference, 1, os.path.join(tmp, "w0_tied"), True, combos, timeout=600)
    w0_dir = os.path.join(tmp, "w0_tied")
    for name, (tp, pp, dp) in {"tied_PP2": (1, 2, 1), "tied_TP2xPP2": (2, 2, 1)}.items():
        out = os.path.join(tmp, name)
        res = run_ranks(L.run_layout, tp * pp * dp, tp, pp, False, w0_dir, out, ref[2], True, combos, timeout=600)
        (states,) = run_ranks(L.load_combos, 1, out, combos, True, timeout=300)
        _check(ref, res, states)


def test_dropping_the_loss_scale_is_caught(reference, tmp, monkeypatch):
    """Without the num_microbatches * dp factor, Megatron's averaging shrinks the gradient: the check fails."""
    monkeypatch.setattr(grpo_mega.algo, "megatron_loss_scale", lambda num_microbatches, dp_size: 1)
    combos = [("token-mean", 2)]
    res, states = _run(tmp, reference, "unscaled", 1, 1, 2, False, combos)
    w0, _, _, per_combo = reference
    rel = _rel_grad(w0, states[combos[0]], per_combo[combos[0]][1])
    assert rel > 0.5  # the gradient is 1/4 of the right one: relative error 0.75
    with pytest.raises(AssertionError):
        _check(reference, res, states)


@pytest.mark.parametrize(
    "name,tp,pp,parallel_kw",
    [
        ("PP2-uneven-1+3", 1, 2, dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)),
        ("PP3-uneven-first1", 1, 3, dict(num_layers_in_first_pipeline_stage=2)),
        ("TP2-recompute-full", 2, 1, dict(recompute="full")),
        ("TP2-recompute-selective", 2, 1, dict(recompute="selective")),
    ],
)
def test_uneven_pipeline_and_recompute(reference, tmp, name, tp, pp, parallel_kw):
    combos = [("token-mean", 2), ("seq-mean-token-sum", 1)]
    res, states = _run(tmp, reference, name, tp, pp, 1, False, combos, parallel_kw=parallel_kw)
    _check(reference, res, states)
