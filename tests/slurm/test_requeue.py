"""slurm/train.sbatch's requeue rule for a transient failure (no Slurm needed: the script runs unchanged under bash,
with stand-in `scontrol` and `srun`): a training that gave up on a rollout server exits 75 and leaves REQUEUE in its
run directory (torchrun passes 1 on for any failed rank, hence the file); the job is requeued, at most
GRPO_MEGA_TRANSIENT_REQUEUES times in a row; any other failure fails the job, and a success resets the count.
The real cluster's requeue (USR1, a restart resuming) is tests/slurm/test_train_sbatch.py's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "train.sbatch"

SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show job") echo "JobId=$SLURM_JOB_ID Command=$FAKE_SBATCH" ;;
  "show hostnames") echo node1 ;;
  requeue*) echo "$2" >> "$FAKE_REQUEUES" ;;
esac
"""
# the training step: leave REQUEUE in the run directory (hydra.run.dir=...) when asked, exit with FAKE_RC
SRUN = """#!/bin/bash
for a in "$@"; do
  case "$a" in hydra.run.dir=*) dir=${a#hydra.run.dir=} ;; esac
done
[[ -n $FAKE_MARK ]] && echo "rollout server http://10.0.0.9:30000 gone" > "$dir/REQUEUE"
exit "$FAKE_RC"
"""


def _job(tmp: Path, rc: int, mark: bool, restart: int = 0) -> tuple[int, str, list[str]]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    requeues = tmp / "requeues.txt"
    requeues.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SBATCH": str(SBATCH), "FAKE_RC": str(rc),
           "FAKE_MARK": "1" if mark else "", "FAKE_REQUEUES": str(requeues), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NAME": "transient", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1",
           "SLURM_SUBMIT_DIR": str(tmp), "SLURM_RESTART_COUNT": str(restart), "GRPO_MEGA_NPROC_PER_NODE": "1",
           "GRPO_MEGA_LOG_ROOT": str(tmp / "logs"), "MASTER_PORT": "29999"}
    proc = subprocess.run(["bash", str(SBATCH), "run.steps=2"], env=env, cwd=tmp, capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stdout + proc.stderr, requeues.read_text().split() if requeues.is_file() else []


def test_a_transient_failure_requeues_the_job_a_bounded_number_of_times_in_a_row(tmp_path):
    counter = tmp_path / "logs" / "transient" / ".transient_requeues"
    for restart in range(3):  # torchrun's 1, and the run's REQUEUE file
        rc, out, requeued = _job(tmp_path, 1, mark=True, restart=restart)
        assert rc == 1 and requeued == ["7"], out
        assert f"training failed transiently (exit 1: rollout server http://10.0.0.9:30000 gone): requeueing job 7 " \
               f"({restart + 1} of 3 in a row)" in out, out
    rc, out, requeued = _job(tmp_path, 1, mark=True, restart=3)
    assert rc == 1 and requeued == [] and "training failed transiently again (4 in a row" in out, out
    assert not counter.exists()
    rc, out, requeued = _job(tmp_path, 75, mark=False)  # one process, no torchrun: the exit status alone
    assert requeued == ["7"] and counter.read_text().strip() == "1", out
    rc, out, requeued = _job(tmp_path, 0, mark=False)  # a success ends the streak
    assert rc == 0 and requeued == [] and not counter.exists(), out


def test_any_other_failure_fails_the_job(tmp_path):
    rc, out, requeued = _job(tmp_path, 2, mark=False)
    assert rc == 2 and requeued == [] and "training exited with 2" in out, out
