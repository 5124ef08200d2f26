"""Every policy loss, advantage estimator and shaping option added for verl parity (issue 42) runs the demo task
end to end: one step each (2 mini-batches, so the second is off-policy: ratios != 1, the clips and caps can
act), all in one fresh process (one start-up of torch and megatron for all of them), and every logged number
is finite. No learning target: tests/algo/test_losses_learn.py holds that for gspo and cispo."""

import json
import math
import sys
import textwrap

import pytest

from tests.proc import run_tree

SEQ = "algo.loss_agg_mode=seq-mean-token-mean"
CONFIGS = {
    "geo_mean": ["algo.policy_loss=geo_mean", SEQ],
    "sapo": ["algo.policy_loss=sapo", SEQ],
    "gpg": ["algo.policy_loss=gpg"],
    "clip_cov": ["algo.policy_loss=clip_cov", "algo.clip_cov_ratio=0.05", "algo.clip_cov_lb=0.0"],
    "kl_cov": ["algo.policy_loss=kl_cov", "algo.kl_cov_ratio=0.05"],
    "dppo_tv": ["algo.policy_loss=dppo_tv", "algo.dppo_div_high=0.05"],
    "dppo_kl": ["algo.policy_loss=dppo_kl", "algo.dppo_div_high=0.01"],
    "dro": ["algo.policy_loss=dro", "algo.dro_beta=1.0"],
    "bypass_ppo_clip": ["algo.policy_loss=bypass_ppo_clip"],
    "bypass_reinforce": ["algo.policy_loss=bypass_reinforce"],
    "gspo_dual": ["algo.policy_loss=gspo", SEQ, "algo.dual_clip=3", "algo.seq_log_ratio_cap=1"],
    "rloo": ["algo.adv_estimator=rloo"],
    "rpp_baseline": ["algo.adv_estimator=reinforce_plus_plus_baseline"],
    "passk": ["algo.adv_estimator=grpo_passk"],
    "overlong_buffer": ["reward.overlong_buffer_len=2", "reward.overlong_penalty_factor=0.5"],
}
STEPS = 1
DUMP = False  # True prints each run's numbers (pytest -s)

DRIVER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from hydra import compose, initialize_config_module
    from grpo_mega.train import run

    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for name, overrides in configs.items():
        with initialize_config_module(config_module="grpo_mega.conf", version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        (out / name).mkdir()
        run(cfg, out / name)
""")


@pytest.mark.slow
def test_each_new_entry_runs_the_demo_with_finite_values(tmp_path):
    common = [f"run.steps={STEPS}", "eval.interval=0"]
    configs = {name: common + o for name, o in CONFIGS.items()}
    proc = run_tree([sys.executable, "-c", DRIVER, str(tmp_path), json.dumps(configs)], capture_output=True,
                    text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in CONFIGS:
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        assert len(rows) == STEPS, name
        for r in rows:
            bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
            assert not bad, (name, bad)
            # no mini-batch skipped as non-finite, a gradient, rows in the loss
            assert r["skipped"] == 0 and r["grad_norm"] > 0 and r["rows_in_loss"] > 0, (name, r)
        if DUMP:
            print(name, {k: rows[-1][k] for k in ("loss", "pg_loss", "grad_norm", "clip_fraction", "reward")})
