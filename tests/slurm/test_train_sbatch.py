"""slurm/train.sbatch, unchanged, on a real two-node Slurm cluster started on this machine (tests/slurm/cluster.py):
2 nodes x 2 ranks (CPU, gloo) at parallel.tp=2, so TP2 x DP2 across the two launchers' c10d rendezvous.

What a cluster user relies on: the job's exit code is the training's, metrics land in the per-job run directory,
a second job of the same name resumes from the first one's newest checkpoint, and USR1 (what `--signal=B:USR1@...`
sends near the time limit) makes the training checkpoint the step it is in and stop, and the job is requeued;
its restart resumes from exactly that step.
Only the environment differs from a GPU cluster: GRPO_MEGA_NPROC_PER_NODE or fake GPUs give the ranks per node.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import INSTALL_HINT, LocalSlurm, free_ports, missing_requirements

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "train.sbatch"
TRAIN = ["parallel.tp=2", "eval.interval=2", "checkpoint.interval=2"]
JOB_TIMEOUT = 240  # one tiny 4-rank job takes ~20 s on 2 idle cores


@pytest.fixture(scope="module")
def cluster():
    missing = missing_requirements()
    if missing:
        pytest.fail(f"the slurm tests start a real Slurm cluster, but {'; '.join(missing)}. To fix: {INSTALL_HINT}")
    with LocalSlurm(nodes=2, cpus=4, gpus=4) as c:
        print(f"local Slurm cluster ready in {c.ready_seconds:.1f} s")
        pids = c.running_pids()
        yield c
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not alive, f"cluster daemons still running after stop: {alive}"
    assert not c.leftovers, f"job processes outlived their jobs and were ended: {c.leftovers}"


def _submit(cluster: LocalSlurm, tmp: Path, name: str, overrides: list[str], nproc_env: bool) -> int:
    env = {"GRPO_MEGA_LOG_ROOT": str(tmp / "logs"), "GRPO_MEGA_PYTHON": sys.executable,
           "MASTER_PORT": str(free_ports(1)[0]), "OMP_NUM_THREADS": "1"}
    if nproc_env:
        env["GRPO_MEGA_NPROC_PER_NODE"] = "2"  # the CPU way; otherwise the 2 (fake) GPUs per node decide
    args = ["--nodes=2", "--gpus-per-node=2", f"--job-name={name}", f"--output={tmp}/slurm-%j.out", str(SBATCH)]
    return cluster.sbatch(args + TRAIN + overrides, env=env, cwd=tmp)


def _finished(cluster: LocalSlurm, tmp: Path, job: int, restarts: int = 0) -> str:
    t0 = time.monotonic()
    info = cluster.wait(job, JOB_TIMEOUT)
    out = (tmp / f"slurm-{job}.out").read_text(errors="replace")
    print(f"job {job}: {info['JobState']} {info['ExitCode']} in {time.monotonic() - t0:.1f} s (waited)")
    tail = "\n".join(line for line in out.splitlines() if not line.startswith("grpo:"))[-4000:]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", str(restarts)), tail
    assert "2 x 2 ranks" in out, tail
    return out


def _metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in (json.loads(line) for line in open(run_dir / "metrics.jsonl"))}


def test_moe_at_tp2_ep2_across_two_nodes(cluster, tmp_path):
    """tiny-qwen3-moe at TP2 x EP2 (dp2: each node's TP pair is one EP rank, so the experts are split across the
    nodes): 2 steps with audited weight syncs, every expert gathered from the node that holds it."""
    job = _submit(cluster, tmp_path, "grpo-moe", ["model=tiny-qwen3-moe", "parallel.ep=2",
                                                  "parallel.sequence_parallel=true", "run.steps=2",
                                                  "rollout.audit_weights=true"],
                  nproc_env=True)
    _finished(cluster, tmp_path, job)
    rows = _metrics(tmp_path / "logs" / "grpo-moe" / str(job))
    assert sorted(rows) == [1, 2] and all(r["logprob_mismatch"] <= 1e-5 and r["grad_norm"] > 0 for r in rows.values())
    print("TP2xEP2 on 2 nodes: logprob mismatch", [f"{r['logprob_mismatch']:.1e}" for r in rows.values()])


def test_usr1_requeues_the_job_its_restart_resumes_and_a_second_job_continues(cluster, tmp_path):
    """TP2 x DP2 across the two nodes: USR1 makes the training checkpoint the step it is in and stop, the job is
    requeued and its restart resumes from exactly that step; then a second job of the same name (its ranks per
    node from the fake GPUs this time) continues from the first one's last checkpoint."""
    t0 = time.monotonic()
    job = _submit(cluster, tmp_path, "grpo-requeue", ["run.steps=10"], nproc_env=True)
    job_root = tmp_path / "logs" / "grpo-requeue"
    metrics = job_root / str(job) / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT
    # Step 3 logged: the run is well under way (10 steps) when the signal comes.
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        state = cluster.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"job {job} {state} before step 3:\n" + \
            (tmp_path / f"slurm-{job}.out").read_text(errors="replace")[-4000:]
        assert time.monotonic() < deadline, f"job {job} not at step 3 after {JOB_TIMEOUT} s"
        time.sleep(0.2)
    # What Slurm does `--signal=B:USR1@300` before the time limit: USR1 to the batch shell only.
    cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])
    out = _finished(cluster, tmp_path, job, restarts=1)
    assert "requeueing job" in out and "stopping after step" in out

    # The training checkpointed the step it was in and stopped; the restart continued from exactly there.
    before, after = _metrics(job_root / str(job)), _metrics(job_root / f"{job}.restart1")
    resumed_from = min(after) - 1
    assert resumed_from == max(before) and 3 <= resumed_from < 10, (sorted(before), sorted(after))
    assert sorted(before) == list(range(1, resumed_from + 1)) and sorted(after) == list(range(resumed_from + 1, 11))
    assert (job_root / "checkpoints" / f"step_{resumed_from:08d}" / "manifest.json").is_file()
    print(f"requeue: first attempt ran steps 1-{max(before)}, restart resumed after step {resumed_from}; "
          f"{time.monotonic() - t0:.1f} s submit to completion")

    # The same job name, more steps: resume=auto continues from the first job's step 10.
    t1 = time.monotonic()
    second = _submit(cluster, tmp_path, "grpo-requeue", ["run.steps=12"], nproc_env=False)
    _finished(cluster, tmp_path, second)
    assert sorted(_metrics(job_root / str(second))) == [11, 12]
    print(f"second job {time.monotonic() - t1:.1f} s (submit to completion)")


def test_a_failing_training_fails_the_job_with_its_exit_code(cluster, tmp_path):
    job = _submit(cluster, tmp_path, "grpo-bad", ["parallel.tp=3", "run.steps=2"], nproc_env=True)
    info = cluster.wait(job, JOB_TIMEOUT)
    out = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    code = info["ExitCode"].split(":")[0]  # torchrun's status when a rank fails, passed on by srun and the script
    assert info["JobState"] == "FAILED" and code != "0", out[-4000:]
    assert "parallel.tp=3" in out and f"training exited with {code}" in out, out[-4000:]


def test_one_node_trains_and_one_serves(cluster, tmp_path):
    """GRPO_MEGA_ROLLOUT_NODES=1: the allocation's last node runs a rollout server (the embedded engine's HTTP
    server, the CPU stand-in for sglang.launch_server) as a step of its own, the first node trains (2 ranks,
    TP2) against it once it is healthy, and the server is stopped when the training ends."""
    from grpo_mega.data.toy import make_tokenizer

    vocab = len(make_tokenizer())
    env = {"GRPO_MEGA_LOG_ROOT": str(tmp_path / "logs"), "GRPO_MEGA_PYTHON": sys.executable,
           "MASTER_PORT": str(free_ports(1)[0]), "OMP_NUM_THREADS": "1", "GRPO_MEGA_NPROC_PER_NODE": "2",
           "GRPO_MEGA_ROLLOUT_NODES": "1", "GRPO_MEGA_SERVER_PORT": str(free_ports(1)[0]),
           "GRPO_MEGA_SERVER_CMD": f"{sys.executable} -m grpo_mega.engines.standin_server --model tiny --vocab-size {vocab} "
                                   "--host 0.0.0.0 --port $GRPO_MEGA_SERVER_PORT"}
    args = ["--nodes=2", "--gpus-per-node=2", "--job-name=grpo-dedicated", f"--output={tmp_path}/slurm-%j.out",
            str(SBATCH), "parallel.tp=2", "eval.interval=2", "run.steps=3"]
    t0 = time.monotonic()
    job = cluster.sbatch(args, env=env, cwd=tmp_path)
    info = cluster.wait(job, JOB_TIMEOUT)
    out = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    tail = "\n".join(line for line in out.splitlines() if not line.startswith("grpo:"))[-4000:]
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), tail
    assert "1 x 2 ranks" in out and "rollout servers healthy" in out, tail
    rows = _metrics(tmp_path / "logs" / "grpo-dedicated" / str(job))
    assert sorted(rows) == [1, 2, 3]
    assert all(r["logprob_mismatch"] < 1e-5 for r in rows.values())  # the server had the trainer's weights
    print(f"dedicated: {time.monotonic() - t0:.1f} s submit to completion")
