"""bench/checkpoint.py runs end to end at a toy size and writes the JSON it promises (the numbers are the
benchmark's own output, bench_results/checkpoint.json)."""

import json
import os
import sys

import pytest

from tests.bench import run_bench

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_checkpoint_writes_json(tmp_path):
    out = tmp_path / "checkpoint.json"
    cmd = [sys.executable, "-m", "bench.checkpoint", "--mb", "2", "--repeats", "1",
           "--piece-mb", "0.25", "--worlds", "1", "2", "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    data = json.loads(out.read_text())
    assert [(r["world"], r["mode"]) for r in data["rows"]] == [(1, "sharded"), (2, "rank0"), (2, "sharded")]
    assert all(r["total_bytes"] == 2_000_000 and r["hash_s_max"] > 0 and r["verify_s"] > 0 for r in data["rows"])
    assert data["summary"]["world2"]["hash_bytes_vs_rank0"] < 0.7
    p = data["projection_70b"]
    assert p["ranks"] == 64 and 1.0e12 < p["total_bytes"] < 1.3e12 and p["per_rank_s"] < p["rank0_alone_s"] / 50
    assert p["total_bytes"] - p["total_without_reference_gb"] * 1e9 == pytest.approx(p["reference_bf16_once_reset"])
    assert p["reference_bf16_once_reset"] == 2 * p["params"]
