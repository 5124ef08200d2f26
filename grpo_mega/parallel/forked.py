"""Fork N gloo ranks from a warm process: the multi-rank test harness and the benchmarks' launcher.

torch and megatron-core are imported once, in the parent (`warm`: what a rank needs is ~5 s of imports);
`run_ranks` forks `world_size` children that inherit those modules, join one gloo process group through a
FileStore, run the function and send back its return value or its traceback. A rank that has not finished within
`timeout` seconds is a failure, and every child still alive is ended by its PID, so a hang never stalls CI.
On GPU machines use torchrun instead: CUDA cannot be used in a forked child once the parent touched it.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


# What every rank imports whatever it runs: megatron-core's model, optimizer, pipeline schedules and
# dist_checkpointing, and torch's compiler stack (megatron's fused kernels and torch.optim load it). Imported
# once in the parent before the first fork, they are inherited; otherwise each rank imports ~2,300 modules
# itself (wandb, tensorboard, inductor, sympy come with them), which at 4 ranks on 2 cores is most of a run.
_WARM = ("megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
         "megatron.core.dist_checkpointing", "torch._dynamo")
_warmed = False


def warm() -> None:
    """Import _WARM in this process (once; megatron-core through the CPU compatibility layer, as every rank
    does): the ranks forked from it afterwards start with those modules loaded."""
    global _warmed
    if _warmed:
        return
    from grpo_mega.parallel import cpu_compat

    cpu_compat.apply()
    for name in _WARM:
        importlib.import_module(name)
    _warmed = True


class RankFailed(AssertionError):
    """A forked rank raised, died, or ran past its timeout."""


# After the first failure, how long the other ranks still have to report or die before they are ended; longer
# (PEER_LOST_GRACE_S) while a reported failure is a lost connection to a peer: that peer most likely died, and a
# loaded machine can take seconds to let its exit reach us.
GRACE_S = 1.0
PEER_LOST_GRACE_S = 10.0
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _child(rank: int, world_size: int, store_path: str, conn, fn: Callable, args: tuple, kwargs: dict):
    # Own process group, so that the parent can end this rank together with anything it started
    # (dist_checkpointing's Manager, a server) by this PID alone.
    os.setpgid(0, 0)
    # One intra-op thread per rank: the ranks share 2 cores, and a forked child must not touch the
    # parent's OpenMP pool.
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload = ("error", traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(payload))
    except Exception:  # an unpicklable result is itself a failure
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    conn.close()
    # Returning lets multiprocessing run its finalizers (a Manager started in this rank shuts down) and
    # then os._exit: no atexit handlers, no gloo teardown that could block on peers that already left.


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group a rank created (the rank and whatever it started); gone is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` forked gloo ranks; return the per-rank results.

    Inside `fn`, torch.distributed is initialised (gloo) and RANK/WORLD_SIZE are set. Raises RankFailed
    naming the rank and carrying its traceback if any rank raises, exits without a result, or is still
    running after `timeout` seconds.
    """
    warm()
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="grpo_mega_ranks_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(rank, world_size, store_path, send, fn, args, kwargs))
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)

        results: list = [None] * world_size
        failures: list[str] = []
        died: list[int] = []
        deadline = time.monotonic() + timeout
        pending = set(range(world_size))
        grace = False
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if not grace:
                        failures.append(f"ranks {sorted(pending)} still running after {timeout:.0f} s (hang?)")
                    break
                ready = mp.connection.wait([conns[r] for r in pending], timeout=min(remaining, 0.5))
                # A rank that died may have left a child of its own (a Manager) holding the pipe open, so its
                # end of file never comes (nor does its process sentinel): also poll the exit codes.
                exited = [r for r in pending if conns[r] not in ready and procs[r].exitcode is not None]
                for rank in [conns.index(c) for c in ready] + exited:
                    pending.discard(rank)
                    if not conns[rank].poll(0):
                        died.append(rank)
                        continue
                    try:
                        status, value = pickle.loads(conns[rank].recv_bytes())
                    except EOFError:
                        died.append(rank)
                        continue
                    if status == "ok":
                        results[rank] = value
                    else:
                        failures.append(f"rank {rank} raised:\n{value}")
                if (failures or died) and not grace:
                    # One rank failed: the others are likely blocked in a collective with it. Their exits
                    # still count for a moment: a rank that died often reaches its peers' sockets before its
                    # own pipe and exit code reach us, and the death is the cause worth naming.
                    grace = True
                    peer_lost = not died and any(m in f for f in failures for m in _PEER_LOST)
                    deadline = min(deadline, time.monotonic() + (PEER_LOST_GRACE_S if peer_lost else GRACE_S))
        finally:
            # Every rank has answered or failed: end each rank's process group (the rank and anything it
            # started) before reaping, so that the PID cannot have been reused.
            for p in procs:
                _kill_group(p.pid)
            for p in procs:
                p.join(5)
            for c in conns:
                c.close()
        failures = [f"rank {r} exited with code {procs[r].exitcode} and no result" for r in died] + failures
        if failures:
            raise RankFailed("\n".join(failures))
        return results
