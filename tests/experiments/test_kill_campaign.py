"""experiments/kill_campaign.py with its 2 targeted moments (CI's share of the campaign; the random moments are the
campaign's own, run by hand): a dedicated, one-step off-policy run is SIGKILLed mid-generation and mid-sync, and
every resume reproduces the uninterrupted run's per-step metrics to 1e-6."""

import json
import os
import sys

from tests.proc import run_tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kill_campaign_mid_generation_and_mid_sync(tmp_path):
    out = tmp_path / "kill.json"
    cmd = [sys.executable, "-m", "experiments.kill_campaign", "--moments", "2", "--steps", "5",
           "--seed", "1", "--out", str(out)]
    done = run_tree(cmd, timeout=900, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    data = json.loads(out.read_text())
    assert done.returncode == 0 and data["ok"], done.stdout[-3000:] + done.stderr[-3000:]
    moments = data["moments"]
    assert [m["kind"] for m in moments] == ["generate", "sync"]
    assert moments[0]["in_flight_at_kill"]["generate"] and moments[1]["in_flight_at_kill"]["sync"]
    for m in moments:
        assert m["hit"] and m["step"] >= 2 and m["max_abs_diff"] <= 1e-6
        assert m["steps_compared"] == list(range(m["resumed_from_step"] + 1, 6))
