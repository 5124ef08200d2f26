"""gspo, cispo, geo_mean (GMPO), sapo and gpg, each with a rollout correction, are the same under TP2 + sequence
parallelism, PP2 and DP2 as in one process: loss, grad norm, the full gradient and the correction's metrics
(tests/trainer/layouts.py); clip_cov and kl_cov (their token selection per micro-batch), dro, dppo_tv, dppo_kl and the
two bypass losses (on the engine's logprobs) are, at TP2 x PP2.

GSPO's and GMPO's sequence ratios and the sequence-level correction reduce over a whole response: this checks that every
response reaches the loss whole (packed rows unpacked per sequence, the sequence gathered before the output layer
under SP, the vocab-parallel ops reduced over TP, each sequence on one DP rank and on the last stage)."""

import os

import pytest

from grpo_mega.parallel.forked import run_ranks
from tests.trainer import layouts as L

REL_TOL = 1e-5
LOSSES = {  # name: (combo (mode, micro-batch size), AlgoConfig fields)
    "gspo": (("seq-mean-token-mean", 1),
             dict(policy_loss="gspo", dual_clip=None, gspo_clip_low=0.02, gspo_clip_high=0.03,
                  rollout_correction="sequence", rollout_correction_low=0.8, rollout_correction_high=1.2)),
    "cispo": (("token-mean", 1),
              dict(policy_loss="cispo", dual_clip=None, cispo_eps_low=0.2, cispo_eps_high=0.3,
                   rollout_correction="geometric", rollout_correction_mode="mask", rollout_correction_low=0.9,
                   rollout_correction_high=1.1)),
    "geo_mean": (("seq-mean-token-mean", 1),
                 dict(policy_loss="geo_mean", dual_clip=None, gmpo_clip_low=0.02, gmpo_clip_high=0.03,
                      rollout_correction="sequence", rollout_correction_low=0.8, rollout_correction_high=1.2)),
    "sapo": (("seq-mean-token-mean", 1),
             dict(policy_loss="sapo", dual_clip=None, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                  rollout_correction="geometric", rollout_correction_mode="mask", rollout_correction_low=0.9,
                  rollout_correction_high=1.1)),
    "gpg": (("token-mean", 1),
            dict(policy_loss="gpg", dual_clip=None, rollout_correction="geometric", rollout_correction_mode="mask",
                 rollout_correction_low=0.9, rollout_correction_high=1.1)),
}
CORRECTED = tuple(LOSSES)
"""The losses above run with a rollout correction whose caps the reference must hit."""
LOSSES.update({  # the token-level entries: one TP2 x PP2 run each (their reductions are the ones checked above)
    "clip_cov": (("token-mean", 1), dict(policy_loss="clip_cov", dual_clip=None, clip_cov_ratio=0.1, clip_cov_lb=-1.0,
                                         clip_cov_ub=5.0, rollout_correction="token", rollout_correction_high=1.2)),
    "kl_cov": (("token-mean", 1), dict(policy_loss="kl_cov", dual_clip=None, kl_cov_ratio=0.1, kl_cov_coef=0.5,
                                       rollout_correction="token", rollout_correction_high=1.2)),
    "dro": (("token-mean", 1), dict(policy_loss="dro", dual_clip=None, dro_beta=1.0)),
    "bypass_ppo_clip": (("token-mean", 1), dict(policy_loss="bypass_ppo_clip", dual_clip=None)),
    "bypass_reinforce": (("token-mean", 1), dict(policy_loss="bypass_reinforce", dual_clip=None)),
    "dppo_tv": (("token-mean", 1), dict(policy_loss="dppo_tv", dual_clip=None, dppo_div_high=0.05)),
    "dppo_kl": (("token-mean", 1), dict(policy_loss="dppo_kl", dual_clip=None, dppo_div_high=0.01)),
})
CLIPPING = ("gspo", "cispo", "geo_mean")
"""The losses with a clip whose both sides the reference must take (sapo's gate and gpg have none)."""
LAYOUTS = {"TP2-SP": (2, 1, 1, True), "PP2": (1, 2, 1, False), "DP2": (1, 1, 2, False), "TP2xPP2": (2, 2, 1, False)}
CASES = [(name, layout) for name in CORRECTED for layout in ("TP2-SP", "PP2", "DP2")] + \
    [(name, "TP2xPP2") for name in LOSSES if name not in CORRECTED]
METRICS = ("is_weight_mean", "is_capped_fraction", "is_seq_capped_fraction", "clip_fraction", "pg_loss")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("loss_layouts"))
    out = {}
    for name, (combo, algo_kw) in LOSSES.items():
        spec = dict(algo_kw=algo_kw, engine=True)
        (out[name],) = run_ranks(L.make_reference, 1, os.path.join(tmp, name, "w0"), False, [combo], "adam", spec,
                                 timeout=600)
    return tmp, out


def test_references_exercise_the_bounds(references):
    for name in CORRECTED:
        combo = LOSSES[name][0]
        m, _ = references[1][name][3][combo]
        assert 0 < m["is_seq_capped_fraction"] < 1, (name, {k: m[k] for k in METRICS})
        assert name not in CLIPPING or 0 < m["clip_fraction"] < 1, (name, {k: m[k] for k in METRICS})


@pytest.mark.parametrize("name,layout", CASES)
def test_policy_loss_layout_matches_single_process(references, name, layout):
    tmp, refs = references
    (combo, algo_kw), (tp, pp, dp, sp) = LOSSES[name], LAYOUTS[layout]
    w0, logp, inputs, per_combo = refs[name]
    out = os.path.join(tmp, name, layout)
    spec = dict(algo_kw=algo_kw)
    res = run_ranks(L.run_layout, tp * pp * dp, tp, pp, sp, os.path.join(tmp, name, "w0"), out, inputs, False,
                    [combo], "adam", None, spec, timeout=600)
    (states,) = run_ranks(L.load_combos, 1, out, [combo], timeout=300)
    state = states[combo]
    m_ref, g_ref = per_combo[combo]
    for r in res:
        m = r[1][combo]
        assert abs(m["loss"] - m_ref["loss"]) <= REL_TOL * abs(m_ref["loss"]), (m["loss"], m_ref["loss"])
        assert abs(m["grad_norm"] - m_ref["grad_norm"]) <= REL_TOL * m_ref["grad_norm"]
        for k in METRICS:
            assert abs(m[k] - m_ref[k]) <= 1e-6 + REL_TOL * abs(m_ref[k]), (k, m[k], m_ref[k])
    num = sum(float(((w0[k] - state[k]) - g_ref[k]).norm()) ** 2 for k in w0) ** 0.5
    den = sum(float(g_ref[k].norm()) ** 2 for k in w0) ** 0.5
    assert num / den <= REL_TOL, f"gradient relative error {num / den:.2e}"
