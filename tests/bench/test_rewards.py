"""bench/rewards.py runs end to end at toy sizes and writes the JSON it promises (the speed targets are
judged on the full run's bench_results/rewards.json, recorded with the machine's load)."""

import json
import os
import sys

from tests.bench import run_bench

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_rewards_writes_json(tmp_path):
    out = tmp_path / "rewards.json"
    cmd = [sys.executable, "-m", "bench.rewards", "--math-samples", "6", "--rm-samples", "3",
           "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    data = json.loads(out.read_text())
    assert data["pool"]["samples"] == 6 and data["pool"]["workers_1_seconds"] > 0 and data["pool"]["speedup_2_vs_1"] > 0
    assert set(data["pool"]["worker_start_seconds"]) == {"forkserver", "spawn", "fork"}
    for key in ("reward_model", "reward_model_compute_bound"):
        assert data[key]["max_abs_score_diff"] < 1e-5 and data[key]["speedup"] > 0
    assert len(data["loadavg_before"]) == 3 and len(data["loadavg_after"]) == 3
