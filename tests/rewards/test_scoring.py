"""Scoring once: the reward pool (values, time limit, worker replacement, shutdown) and score_step across
4 ranks (TP2 x DP2): each sample scored exactly once, the rewards equal every rank scoring everything."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import pytest

from grpo_mega.rewards import RewardError, RewardStats, build_reward
from grpo_mega.rewards.scoring import PromptReward, RewardPool, default_num_workers, score_step


def sleepy_reward(response, ground_truth, sample):
    """Hangs (as math-verify can on adversarial LaTeX) on a response containing 'hang'."""
    if "hang" in response:
        time.sleep(3600)
    return float(len(response))


def counting_reward(response, ground_truth, sample):
    """Appends one line per call to the file named in the sample, then scores like a verifier."""
    with open(sample["extra_info"]["log"], "a") as f:
        f.write(f"{os.getpid()} {response}\n")
    if response == "= =":
        time.sleep(3600)
    return float(sum(map(ord, response)) % 7) / 7.0 + float(ground_truth)


def _gone(pids, wait=10.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(") ")[1].startswith("Z"):  # a zombie has exited
                        continue
                alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_pool_scores_equal_in_process_math_verify():
    responses = [f"so \\boxed{{\\frac{{{i}}}{{{i + 1}}}}}" for i in range(12)] + ["no answer", "\\boxed{2}"]
    truths = [f"\\frac{{{i}}}{{{i + 1}}}" if i % 3 else "7" for i in range(12)] + ["1", "2"]
    rows = [{"data_source": "m"}] * len(responses)
    fn = build_reward("math")
    want = [fn(r, t, s) for r, t, s in zip(responses, truths, rows)]
    with RewardPool("math", num_workers=2, timeout_s=30) as pool:
        got = pool.score(responses, truths, rows)
        pids = pool.started_pids
    assert got == want and sum(want) == 9  # 8 of the 12 fractions (i % 3 != 0) and \\boxed{2}
    assert _gone(pids)


def test_a_hanging_sample_is_cut_at_the_time_limit_and_the_rest_are_scored():
    responses = ["a", "bb", "hang here", "dddd", "ee"]
    rows = [{"data_source": "s"}] * 5
    stats = RewardStats()
    with RewardPool("tests.rewards.test_scoring:sleepy_reward", num_workers=2, timeout_s=1.0) as pool:
        t0 = time.monotonic()
        got = pool.score(responses, [None] * 5, rows, on_error="zero", stats=stats)
        took = time.monotonic() - t0
        killed = pool.started_pids[:2]
        assert len(pool.started_pids) == 3  # one worker killed and replaced
        assert pool.score(["xyz"], [None], rows[:1]) == [3.0]  # the replaced pool still works
        pids = pool.started_pids
    assert got == [1.0, 2.0, 0.0, 4.0, 2.0] and stats.timeouts == 1 and stats.errors == 1
    assert 1.0 <= took < 15, took
    assert "sleepy_reward' failed on sample 2 (data_source='s', response='hang here'): timed out after 1 s" in stats.examples[0]
    assert any(f"(pid {p}) was killed" in stats.examples[0] for p in killed)
    assert _gone(pids)


def test_on_error_raise_stops_and_leaves_no_worker():
    pool = RewardPool("tests.rewards.test_scoring:sleepy_reward", num_workers=2, timeout_s=0.5)
    with pytest.raises(RewardError, match=r"failed on sample 1 .*timed out after 0.5 s"):
        pool.score(["a", "hang"], [None, None], [{}, {}], on_error="raise")
    assert pool.pids() == [] and _gone(pool.started_pids)


def forking_reward(response, ground_truth, sample):
    """Starts a process of its own (as a reward that shells out to a checker might), records its PID, then hangs
    on a response containing 'hang'."""
    import subprocess

    if "hang" in response:
        child = subprocess.Popen(["sleep", "3600"])
        with open(sample["extra_info"]["log"], "a") as f:
            f.write(f"{child.pid}\n")
        time.sleep(3600)
    return float(len(response))


def hungry_reward(response, ground_truth, sample):
    """Allocates the MiB the response names ('mb 512'), then scores its length."""
    held = bytearray(int(response.split()[1]) * 2**20)
    return float(len(response) + len(held) * 0)


def test_a_timed_out_worker_is_killed_with_the_processes_it_started(tmp_path):
    log = tmp_path / "children"
    rows = [{"data_source": "s", "extra_info": {"log": str(log)}}] * 3
    stats = RewardStats()
    with RewardPool("tests.rewards.test_scoring:forking_reward", num_workers=1, timeout_s=1.0) as pool:
        got = pool.score(["a", "hang", "ccc"], [None] * 3, rows, stats=stats)
        pids = pool.started_pids
    grandchild = int(log.read_text())
    assert got == [1.0, 0.0, 3.0] and stats.timeouts == 1
    assert "was killed with the processes under it" in stats.examples[0]
    assert _gone([grandchild]) and _gone(pids)


def test_an_idle_worker_killed_from_outside_is_replaced_and_scoring_goes_on():
    import signal

    stats = RewardStats()
    with RewardPool("tests.rewards.test_scoring:sleepy_reward", num_workers=2, timeout_s=10) as pool:
        assert pool.score(["a", "bb"], [None] * 2, [{}] * 2, stats=stats) == [1.0, 2.0]
        victim = pool.pids()[0]
        os.kill(victim, signal.SIGKILL)  # by its PID, while it waits for a sample
        assert _gone([victim])
        assert pool.score(["a", "bb", "ccc"], [None] * 3, [{}] * 3, stats=stats) == [1.0, 2.0, 3.0]
        assert victim not in pool.pids() and len(pool.started_pids) == 3
        pids = pool.started_pids
    assert stats.errors == 0 and _gone(pids)


def test_a_sample_over_the_memory_limit_fails_alone():
    stats = RewardStats()
    responses = ["mb 1", "mb 4096", "mb 2"]
    with RewardPool("tests.rewards.test_scoring:hungry_reward", num_workers=1, timeout_s=20, max_memory_mb=256) as pool:
        got = pool.score(responses, [None] * 3, [{}] * 3, stats=stats)
        assert len(pool.started_pids) == 1  # the same worker goes on after the failed allocation
        pids = pool.started_pids
    assert got == [4.0, 0.0, 4.0] and stats.errors == 1 and stats.timeouts == 0
    assert "failed on sample 1" in stats.examples[0]
    assert "MemoryError (over reward.max_memory_mb=256)" in stats.examples[0]
    with RewardPool("tests.rewards.test_scoring:hungry_reward", num_workers=1, timeout_s=20, max_memory_mb=0) as pool:
        assert pool.score(["mb 300"], [None], [{}]) == [6.0]  # 0: no limit
    assert _gone(pids)


def test_pool_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"reward.num_workers=0 must be >= 1"):
        RewardPool("math", num_workers=0)
    with pytest.raises(ValueError, match=r"reward.timeout_s=0 must be > 0"):
        RewardPool("math", timeout_s=0)
    with pytest.raises(ValueError, match=r"reward.start_method='thread' must be"):
        RewardPool("math", start_method="thread")
    with pytest.raises(ValueError, match=r"reward.max_memory_mb=-1 must be >= 0"):
        RewardPool("math", max_memory_mb=-1)


def test_default_workers_divide_the_node_among_local_ranks(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_num_workers() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert default_num_workers() == 1


# ---- four ranks ------------------------------------------------------------------------------------------------

@dataclass
class _Example:
    prompt_ids: list[int]
    ground_truth: str
    data_source: str = "toy"
    extra_info: dict = field(default_factory=dict)


def _batch(log: str, step: int, hang: bool):
    from grpo_mega.data.toy import make_tokenizer

    tok = make_tokenizer()
    examples = [_Example(tok.convert_tokens_to_ids(["<bos>", str(d), ">"]), str(d % 2), extra_info={"log": log})
                for d in range(6)]
    samples = [examples[i // 3] for i in range(18)]  # 6 prompts x n=3
    responses = [tok.convert_tokens_to_ids([str((i * 7 + step) % 10), str(i % 10)]) for i in range(18)]
    if hang:
        responses[5] = tok.convert_tokens_to_ids(["=", "="])  # counting_reward hangs on it
    return tok, samples, responses


def _four_ranks(log_dir: str):
    import torch.distributed as dist

    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import init_distributed

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=2, pp=1, seed=0)
        from megatron.core import parallel_state as ps

        layout = (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())
        out = []
        for step in (1, 2):
            log = os.path.join(log_dir, f"step{step}.log")
            tok, samples, responses = _batch(log, step, hang=False)
            reward = PromptReward(tok, "tests.rewards.test_scoring:counting_reward", num_workers=1, timeout_s=20)
            try:
                rewards, metrics = score_step(reward, samples, responses, step)
            finally:
                reward.close()
            dist.barrier()
            # today's way, for comparison: every rank scores every sample in-process (no log: not counted)
            fn = build_reward("tests.rewards.test_scoring:counting_reward")
            texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
            want = [fn(t, e.ground_truth, {"extra_info": {"log": os.devnull}}) for t, e in zip(texts, samples)]
            out.append((rewards.tolist(), want, metrics, reward.pool.started_pids))
    return dist.get_rank(), layout, out


def test_four_ranks_score_each_sample_exactly_once(tmp_path):
    from grpo_mega.parallel.forked import run_ranks

    results = run_ranks(_four_ranks, 4, str(tmp_path), timeout=240)
    assert [r[0] for r in results] == [0, 1, 2, 3] and all(r[1] == (2, 2) for r in results)
    for step in (1, 2):
        lines = (tmp_path / f"step{step}.log").read_text().splitlines()
        tok, samples, responses = _batch("", step, hang=False)
        texts = sorted(tok.decode(r, skip_special_tokens=True) for r in responses)
        assert len(lines) == 18 and sorted(line.split(" ", 1)[1] for line in lines) == texts  # once each
        assert len({line.split()[0] for line in lines}) == 4  # by four workers: one pool per rank
        got = [r[2][step - 1] for r in results]
        for rewards, want, metrics, pids in got:
            import torch

            assert rewards == torch.tensor(want).tolist()  # bit-identical to today's float32 tensor
            assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0
            assert metrics["reward/score_seconds"] > 0
            assert _gone(pids)


def _four_ranks_one_hangs(log_dir: str):
    import torch.distributed as dist

    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import init_distributed

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=2, pp=1, seed=0)
        tok, samples, responses = _batch(os.path.join(log_dir, "hang.log"), 1, hang=True)
        reward = PromptReward(tok, "tests.rewards.test_scoring:counting_reward", num_workers=1, timeout_s=2)
        t0 = time.monotonic()
        try:
            rewards, metrics = score_step(reward, samples, responses, 1)
        finally:
            reward.close()
        return dist.get_rank(), rewards.tolist(), metrics, time.monotonic() - t0, reward.pool.started_pids


def test_a_hanging_verifier_on_one_rank_is_cut_and_the_step_goes_on(tmp_path):
    from grpo_mega.parallel.forked import run_ranks

    results = run_ranks(_four_ranks_one_hangs, 4, str(tmp_path), timeout=240)
    for rank, rewards, metrics, seconds, pids in results:
        assert rewards[5] == 0.0 and sum(r != 0 for r in rewards) >= 15
        assert rewards == results[0][1]
        assert metrics["reward/timeouts"] == 1 and metrics["reward/errors"] == 1
        assert seconds < 60
        assert _gone(pids)
    assert len(results[1][4]) == 2  # sample 5 is rank 1's (5 % 4): its worker was killed and replaced


def pid_label(response, ground_truth, sample):
    """A label source that records its worker's PID (and raises when asked to), for the orphan check."""
    with open(os.environ["GRPO_TEST_PID_FILE"], "a") as f:
        f.write(f"{os.getpid()}\n")
    if os.environ.get("GRPO_TEST_LABEL_RAISES"):
        raise RuntimeError("label source failed on purpose")
    return 1.0 if response.startswith(str(ground_truth)) else 0.0


@pytest.mark.parametrize("fails", [False, True])
def test_a_run_leaves_no_reward_worker_behind(tmp_path, fails):
    """End to end (the CLI, one step, labels from a pool worker): when the run ends, normally or on an error,
    every worker that scored is gone."""
    import sys
    from pathlib import Path

    from tests.proc import run_tree
    from tests.rewards.test_reward_model import tiny_rm

    root = Path(__file__).resolve().parents[2]
    pid_file = tmp_path / "pids"
    env = {**os.environ, "WANDB_MODE": "disabled", "GRPO_TEST_PID_FILE": str(pid_file),
           **({"GRPO_TEST_LABEL_RAISES": "1"} if fails else {})}
    cmd = [sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={tmp_path / 'run'}", "reward.name=reward_model",
           f"reward.path={tiny_rm(tmp_path / 'rm')}", "reward.rm_train.interval=1", "reward.num_workers=2",
           "reward.rm_train.labels=tests.rewards.test_scoring:pid_label", "batch.train_batch_size=4", "rollout.n=2",
           "batch.ppo_mini_batch_size=4", "batch.micro_batch_size=8", "eval.pass_k=1", "run.steps=1"]
    proc = run_tree(cmd, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert proc.returncode == (2 if fails else 0), proc.stderr[-3000:]
    if fails:
        assert "label source 'pid_label' failed on sample" in proc.stderr
    pids = {int(p) for p in pid_file.read_text().split()}
    assert pids and _gone(pids)
