"""`rollout.off_policy_steps=1` end to end on 2 trainer ranks and a dedicated embedded server: step 1 trains on
version 0 and step k >= 2 on version k-2 (generated while step k-1 trained), with the importance correction on
and reported; a checkpoint taken while the next batch is generated resumes to the uninterrupted run's metrics
(1e-6); a server that dies in the middle of the background generation stops both ranks with one line naming
it, after the client's retries, with exit status 75 (transient: slurm/train.sbatch requeues the job)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from experiments.proxies import ForwardingProxy
from grpo_mega.processes import free_port, stop
from grpo_mega.engines import standin_server
from tests.fork_server import run_main
from tests.proc import kill_tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-6
ENV = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled"}


def _start_server() -> tuple[subprocess.Popen, str]:
    from grpo_mega.data.toy import make_tokenizer

    return standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(len(make_tokenizer()))], env=ENV,
                                 cwd=REPO, timeout_s=120)


def _stop(proc: subprocess.Popen) -> None:
    stop(proc)


@pytest.fixture(scope="module")
def server():
    proc, url = _start_server()
    try:
        yield url
    finally:
        _stop(proc)


def _args(out, url, *extra):
    return [f"hydra.run.dir={out}", "run.steps=4", "eval.interval=2", "rollout.placement=dedicated",
            f"rollout.servers=[{url}]", "rollout.off_policy_steps=1", "rollout.server_timeout_s=60", *extra]


def _train(out, url, *extra):
    """2 ranks forked from the warm fork server with torchrun's environment (tests/fork_server.py)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    done = run_main(_args(out, url, *extra), timeout=400, cwd=REPO, scratch=out.parent, nproc=2, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


@pytest.fixture(scope="module")
def uninterrupted(server, tmp_path_factory):
    d = tmp_path_factory.mktemp("offpolicy")
    stdout, rows = _train(d / "run", server, f"checkpoint.dir={d / 'ckpt'}", "checkpoint.interval=2")
    return d, stdout, rows


def test_step_k_trains_on_version_k_minus_2_with_importance_correction(uninterrupted):
    d, stdout, rows = uninterrupted
    assert "truncated importance correction on (algo.engine_is_cap=2.0)" in stdout
    assert [rows[k]["weight_version"] for k in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert rows[1]["logprob_mismatch"] < 1e-5  # step 1: the engine held the trainer's weights
    for k in (2, 3, 4):  # generated on the weights before the last update: engine and trainer now differ
        assert rows[k]["logprob_mismatch"] > 1e-4, (k, rows[k]["logprob_mismatch"])
        assert rows[k]["is_weight_mean"] != 1.0 and 0 <= rows[k]["is_capped_fraction"] <= 1
        assert 0 <= rows[k]["perf/overlap"] <= 1 and rows[k]["timing/generate_wait"] >= 0
    state = json.loads((d / "ckpt" / "step_00000002" / "loop_state.json").read_text())
    assert state["rollout"]["step"] == 3 and state["rollout"]["weight_version"] == 1  # the batch in flight


def test_resume_from_a_checkpoint_taken_with_a_batch_in_flight_is_exact(uninterrupted, server, tmp_path):
    d, _, full = uninterrupted
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(d / "ckpt" / "step_00000002", ckpt / "step_00000002")
    _, resumed = _train(tmp_path / "run", server, f"checkpoint.dir={ckpt}", "checkpoint.interval=2")
    assert sorted(resumed) == [3, 4]
    for k in (3, 4):
        for key in ("reward", "val_reward", "loss", "grad_norm", "entropy", "pg_loss", "is_weight_mean",
                    "logprob_mismatch", "weight_version"):
            assert resumed[k][key] == pytest.approx(full[k][key], rel=TOL, abs=TOL), (k, key)


def test_one_step_ahead_skips_the_old_logprob_pass_and_forcing_it_changes_nothing(server, tmp_path):
    """One optimizer step per batch (one mini-batch of 16): the update runs on the weights the old-logprob pass would
    (the proximal policy, a version ahead of the engine's), so the pass is skipped; forcing it
    (algo.recompute_old_logprobs) trains the same run, importance weights and engine/trainer mismatch included."""
    _, skipped = _train(tmp_path / "skipped", server, "batch.ppo_mini_batch_size=16")
    _, forced = _train(tmp_path / "forced", server, "batch.ppo_mini_batch_size=16", "algo.recompute_old_logprobs=true")
    assert sorted(forced) == sorted(skipped) == [1, 2, 3, 4]
    for k in (1, 2, 3, 4):
        assert skipped[k].get("timing/old_logprobs", 0.0) == 0.0 < forced[k]["timing/old_logprobs"], k
        for key in ("reward", "loss", "grad_norm", "entropy", "pg_loss", "is_weight_mean", "is_capped_fraction",
                    "logprob_mismatch", "weight_version"):
            assert skipped[k][key] == pytest.approx(forced[k][key], rel=TOL, abs=TOL), (k, key)
    assert skipped[4]["val_reward"] == pytest.approx(forced[4]["val_reward"], abs=TOL)


class _DyingProxy(ForwardingProxy):
    """Forwards HTTP to a server; on the `nth` /generate it SIGKILLs that server and drops the connection, as a
    server that dies in the middle of a generation would."""

    def __init__(self, target: str, server: subprocess.Popen, nth: int):
        self.server, self.nth, self.count = server, nth, 0
        super().__init__(target, timeout_s=120.0)

    def before(self, handler, path: str) -> bool:
        if path == "/generate":
            self.count += 1
            if self.count == self.nth:
                os.kill(self.server.pid, signal.SIGKILL)
                return False
        return True


def test_a_server_dying_mid_generation_in_the_background_stops_every_rank_naming_it(tmp_path):
    proc, url = _start_server()
    # /generate calls: the start-up validation's two, step 1's batch, then step 2's, generated in the
    # background thread while step 1 trains: that one dies.
    proxy = _DyingProxy(url, proc, nth=4)
    port, ranks = free_port(), []
    try:
        t0 = time.monotonic()
        for rank in (0, 1):
            env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
            ranks.append(subprocess.Popen([sys.executable, "-m", "grpo_mega.train", *_args(tmp_path, proxy.url),
                                           "rollout.server_retry_backoff_s=0.1"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env))
        errs = [r.communicate(timeout=300)[1] for r in ranks]
        seconds = time.monotonic() - t0
    finally:
        for r in ranks:
            if r.poll() is None:
                kill_tree(r.pid)
                r.wait(timeout=30)
        proxy.close()
        _stop(proc)
    assert proxy.count == 4 + 3  # the 4th killed the server; rollout.server_retries=3 tries after it
    for rank, (r, err) in enumerate(zip(ranks, errs)):
        assert r.returncode == 75, (rank, r.returncode, err[-2000:])
        lines = re.findall(r"error: [^\r\n]*", err)  # (the progress bar may precede it on its line)
        assert len(lines) == 1 and proxy.url in lines[0] and "generating step 2" in lines[0], (rank, err[-2000:])
        assert "(tried 4 times; rollout.server_retries=3)" in lines[0], (rank, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
    assert proxy.url in (tmp_path / "REQUEUE").read_text()
    assert seconds < 200  # start-up included; the failure itself is seen at the next wait, not after a timeout
