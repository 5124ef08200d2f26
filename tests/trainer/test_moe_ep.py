"""Training tiny-qwen3-moe with its experts split over 2 expert-parallel ranks (parallel.ep=2, dp=2) through
the Hydra entry point on 2 forked ranks: 3 steps, the weight sync audited after every update (each expert
gathered from the EP rank that holds it), and the engine's logprobs equal to the trainer's every step."""

import json
from pathlib import Path

from tests.fork_server import run_main

ROOT = Path(__file__).resolve().parents[2]
LOGP_TOL = 1e-5  # mean absolute engine/trainer logprob difference, fp32


def test_three_steps_at_ep2_with_audited_syncs(tmp_path):
    out = tmp_path / "run"
    argv = [f"hydra.run.dir={out}", "model=tiny-qwen3-moe", "parallel.ep=2", "run.steps=3", "eval.interval=0",
            "batch.train_batch_size=4", "batch.ppo_mini_batch_size=4", "rollout.n=4", "rollout.audit_weights=true"]
    proc = run_main(argv, timeout=300, cwd=ROOT, scratch=tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["logprob_mismatch"] <= LOGP_TOL, (r["step"], r["logprob_mismatch"])
        assert r["grad_norm"] > 0 and any(k.startswith("moe/") for k in r)
    assert [r["weight_version"] for r in rows] == [0, 1, 2]  # each step sampled from the last update's weights
    print("EP2 logprob mismatch per step:", [f"{r['logprob_mismatch']:.2e}" for r in rows],
          "grad_norm:", [round(r["grad_norm"], 4) for r in rows])
