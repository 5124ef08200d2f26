"""algo.dynamic_sampling=refill end to end on the toy task: an untrained model answers right about 1 time in
16, so with n=8 about 60% of the groups score all zero (uninformative). Refill draws more rounds of prompts
until every step holds train_batch_size informative groups; the loss's own filter (grpo_mega.algo.shaping,
which does not know about refill) then keeps every row. With one round it is the filter, exactly; a run
stopped after a checkpoint and resumed gives the uninterrupted run's metrics (1e-6), extra rounds and data
cursor included. The runs are forked from the warm server (tests/fork_server.py)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.fork_server import run_main

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-6
GROUPS, N = 16, 8  # the default run's batch.train_batch_size and rollout.n
KEYS = ("reward", "val_reward", "loss", "grad_norm", "entropy", "pg_loss", "rows_in_loss",
        "dynamic_sampling/extra_rounds", "dynamic_sampling/groups_dropped", "dynamic_sampling/surplus_groups")


def _train(out: Path, steps: int, *extra, nproc=None):
    argv = [f"hydra.run.dir={out}", f"run.steps={steps}", "eval.interval=2", *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = run_main(argv, timeout=300, cwd=ROOT, scratch=out.parent, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


@pytest.fixture(scope="module")
def refilled(tmp_path_factory):
    d = tmp_path_factory.mktemp("refill")
    rows = _train(d / "run", 4, "algo.dynamic_sampling=refill", "algo.max_gen_rounds=8",
                  f"checkpoint.dir={d / 'ckpt'}", "checkpoint.interval=2")
    return d, rows


def test_every_step_trains_on_exactly_train_batch_size_informative_groups(refilled, tmp_path):
    _, rows = refilled
    for k, r in rows.items():
        assert r["rows_in_loss"] == GROUPS * N, (k, r["rows_in_loss"])  # the loss's filter drops nothing
        assert r["dynamic_sampling/informative_groups"] == GROUPS
        assert r["dynamic_sampling/masked_groups"] == 0
        generated = r["dynamic_sampling/generated_groups"]
        assert generated == GROUPS * (1 + r["dynamic_sampling/extra_rounds"])
        assert generated == GROUPS + r["dynamic_sampling/groups_dropped"] + r["dynamic_sampling/surplus_groups"]
    assert all(r["dynamic_sampling/extra_rounds"] >= 1 for r in rows.values())  # round 0 alone is never enough
    dropped = sum(r["dynamic_sampling/groups_dropped"] for r in rows.values())
    generated = sum(r["dynamic_sampling/generated_groups"] for r in rows.values())
    assert 0.3 < dropped / generated < 0.8, dropped / generated  # about half uninformative
    filtered = _train(tmp_path / "filter", 2, "algo.dynamic_sampling=filter")
    assert all(r["rows_in_loss"] < GROUPS * N for r in filtered.values())  # the filter trains on fewer
    assert "dynamic_sampling/extra_rounds" not in filtered[1]


def test_refill_with_one_round_is_the_filter(tmp_path):
    one = _train(tmp_path / "one", 2, "algo.dynamic_sampling=refill", "algo.max_gen_rounds=1")
    old = _train(tmp_path / "old", 2, "algo.dynamic_sampling=true")  # the setting's boolean form: filter
    for k in (1, 2):
        assert one[k]["dynamic_sampling/extra_rounds"] == 0
        assert one[k]["dynamic_sampling/masked_groups"] == GROUPS - one[k]["dynamic_sampling/informative_groups"] > 0
        for key in KEYS[:7]:
            assert one[k][key] == old[k][key], (k, key)


def test_resume_replays_the_extra_rounds_and_the_data_cursor_exactly(refilled, tmp_path):
    d, full = refilled
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(d / "ckpt" / "step_00000002", ckpt / "step_00000002")  # the state when it stopped
    resumed = _train(tmp_path / "run", 4, "algo.dynamic_sampling=refill", "algo.max_gen_rounds=8",
                     f"checkpoint.dir={ckpt}", "checkpoint.interval=2")
    assert sorted(resumed) == [3, 4]
    for k in (3, 4):
        for key in KEYS:
            assert resumed[k][key] == pytest.approx(full[k][key], rel=TOL, abs=TOL), (k, key)


@pytest.fixture(scope="module")
def server():
    import os

    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.processes import stop
    from grpo_mega.engines import standin_server

    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(len(make_tokenizer()))],
                                      env=env, cwd=str(ROOT), timeout_s=120)
    try:
        yield url
    finally:
        stop(proc)


def test_refill_one_step_ahead_on_a_dedicated_server_resumes_exactly(server, tmp_path):
    """rollout.off_policy_steps=1, 2 ranks, one dedicated server: the next step's prompts are drawn after this
    step's extra rounds (so the checkpoint's in-flight batch and data cursor replay the serial order), and a
    resume from step 2's checkpoint (taken with step 3's batch in flight) gives step 3 to 1e-6."""
    args = ["rollout.placement=dedicated", f"rollout.servers=[{server}]", "rollout.off_policy_steps=1",
            "rollout.server_timeout_s=60", "algo.dynamic_sampling=refill", "algo.max_gen_rounds=8",
            "checkpoint.interval=2"]
    full = _train(tmp_path / "full", 3, *args, f"checkpoint.dir={tmp_path / 'ckpt'}", nproc=2)
    for k, r in full.items():
        assert r["rows_in_loss"] == GROUPS * N and r["dynamic_sampling/informative_groups"] == GROUPS, k
    assert sum(r["dynamic_sampling/extra_rounds"] for r in full.values()) >= 1
    assert [full[k]["weight_version"] for k in (1, 2, 3)] == [0, 0, 1]  # round 0 one version behind
    state = json.loads((tmp_path / "ckpt" / "step_00000002" / "loop_state.json").read_text())
    assert state["rollout"]["step"] == 3  # the batch in flight
    ckpt = tmp_path / "ckpt2"
    ckpt.mkdir()
    shutil.copytree(tmp_path / "ckpt" / "step_00000002", ckpt / "step_00000002")
    resumed = _train(tmp_path / "resumed", 3, *args, f"checkpoint.dir={ckpt}", nproc=2)
    assert sorted(resumed) == [3]
    for k in (3,):
        for key in KEYS + ("is_weight_mean", "logprob_mismatch", "weight_version"):
            assert resumed[k][key] == pytest.approx(full[k][key], rel=TOL, abs=TOL), (k, key)
