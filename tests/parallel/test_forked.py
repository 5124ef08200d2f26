import os
import time

import pytest
import torch
import torch.distributed as dist

from grpo_mega.parallel.forked import GRACE_S, RankFailed, run_ranks


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.getpid()


def test_ranks_join_one_gloo_group_and_return_results():
    res = run_ranks(_all_reduce_rank, 4, timeout=60)
    assert [r[0] for r in res] == [0, 1, 2, 3]
    assert all(r[1] == 4 and r[2] == 10.0 for r in res)
    assert len({r[3] for r in res}) == 4 and os.getpid() not in {r[3] for r in res}


def _rank1_raises_while_others_wait():
    if dist.get_rank() == 1:
        raise ValueError("bad input on rank 1")
    dist.barrier()  # never completes: rank 1 is gone


def test_a_raising_rank_fails_fast_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 raised:.*ValueError: bad input on rank 1"):
        run_ranks(_rank1_raises_while_others_wait, 3, timeout=60)
    assert time.monotonic() - t0 < 30


def _rank0_dies_after_its_peer_noticed():
    dist.barrier()  # both ranks past gloo's connection setup: rank 1's error is the test's, not a failed init
    if dist.get_rank() == 0:
        # its peer's error reaches the parent first, as when gloo sees a closed socket, and rank 0's death only
        # after forked.GRACE_S: a lost connection keeps the harness listening longer (PEER_LOST_GRACE_S)
        time.sleep(GRACE_S + 0.5)
        os._exit(3)
    raise RuntimeError("Connection closed by peer")


def test_a_dead_rank_is_named_first_even_when_its_peer_reports_first():
    with pytest.raises(RankFailed) as e:
        run_ranks(_rank0_dies_after_its_peer_noticed, 2, timeout=60)
    assert str(e.value).startswith("rank 0 exited with code 3 and no result\nrank 1 raised:")


def _hang(pid_file):
    with open(f"{pid_file}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _alive(pid, wait=5.0):
    """True if `pid` still runs after `wait` seconds (a zombie awaiting its reaper counts as ended)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.05)
    return True


def test_a_hang_times_out_and_every_rank_is_ended(tmp_path):
    pid_file = str(tmp_path / "pid")
    with pytest.raises(RankFailed, match=r"ranks \[0, 1\] still running after 3 s"):
        run_ranks(_hang, 2, pid_file, timeout=3)
    pids = [int(open(f"{pid_file}.{r}").read()) for r in range(2)]
    assert not any(_alive(p) for p in pids)


def _start_grandchild(pid_file):
    import subprocess

    p = subprocess.Popen(["sleep", "600"])
    with open(pid_file, "w") as f:
        f.write(str(p.pid))
    return p.pid


def test_processes_a_rank_started_are_ended_with_it(tmp_path):
    pid_file = str(tmp_path / "grandchild")
    (pid,) = run_ranks(_start_grandchild, 1, pid_file, timeout=30)
    assert not _alive(pid)


def _exit_hard():
    os._exit(3)


def test_a_rank_that_dies_is_reported():
    with pytest.raises(RankFailed, match="rank 0 exited with code 3 and no result"):
        run_ranks(_exit_hard, 1, timeout=30)


def _die_leaving_a_child():
    pid = os.fork()
    if pid == 0:  # like a multiprocessing Manager: a child that holds every fd of the rank, the pipe too
        time.sleep(600)
        os._exit(0)
    os._exit(5)


def test_a_dead_rank_is_seen_even_if_its_child_holds_the_pipe():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank [01] exited with code 5 and no result"):
        run_ranks(_die_leaving_a_child, 2, timeout=60)
    assert time.monotonic() - t0 < 20
