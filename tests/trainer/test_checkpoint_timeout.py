"""A save that is slow to hash, under a small collective timeout (dist.timeout_s): with rank 0 hashing the whole
checkpoint alone (the design before issue 28) the other ranks wait in the next collective past the timeout and
the save fails; with every rank hashing its own share it completes. Hashing is slowed on purpose (a sleep per
piece), so the same arithmetic as a 70B save (rank 0 alone ~2,000 s against a 600 s timeout) runs in seconds."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest


PIECES, PIECE_BYTES, SLEEP_S, TIMEOUT_S, WORLD = 8, 4096, 0.5, 3.0, 4  # alone 4 s; sharded 2 pieces = 1 s


def _save(root: str, mode: str):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from grpo_mega.parallel import comm
    from grpo_mega.trainer import checkpoint, checkpoint_store
    from grpo_mega.trainer.checkpoint_store import CheckpointStore

    rank = dist.get_rank()
    dist.barrier()
    _set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S), None)  # the world group's, as dist.timeout_s sets it
    slow = checkpoint_store._sha256

    def slow_sha256(*args, **kwargs):
        time.sleep(SLEEP_S)
        return slow(*args, **kwargs)

    checkpoint_store._sha256 = slow_sha256
    store = CheckpointStore(root, keep_last=1, piece_bytes=PIECE_BYTES)
    tmp = Path(comm.broadcast_object(str(store.begin(1)) if rank == 0 else None))
    (tmp / "model").mkdir(exist_ok=True)
    dist.barrier()
    for w in range(PIECES):  # one piece-sized file per writer, written by the ranks in turn
        if w % WORLD == rank:
            (tmp / "model" / f"__{w}_0.distcp").write_bytes(bytes([w]) * PIECE_BYTES)
    if rank == 0:
        (tmp / "loop_state.json").write_text(json.dumps({"step": 1}))
    dist.barrier()
    t0 = time.monotonic()
    try:
        if mode == "sharded":
            checkpoint.seal(store, 1, tmp, meta={"step": 1})
        else:  # before issue 28: rank 0 lists and hashes every file alone while the others wait
            final = str(store.seal(1, tmp, meta={"step": 1})) if rank == 0 else None
            comm.broadcast_object(final)
        return "ok", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(e).__name__}: {e}"[:300], time.monotonic() - t0


@pytest.mark.parametrize("mode", ["rank0_alone", "sharded"])
def test_a_slow_save_times_out_only_when_rank_0_hashes_alone(mode, tmp_path):
    from grpo_mega.parallel.forked import run_ranks

    results = run_ranks(_save, WORLD, str(tmp_path / "ckpt"), mode, timeout=120)
    outcomes = [r[0] for r in results]
    if mode == "sharded":
        assert outcomes == ["ok"] * WORLD, outcomes
        assert max(r[1] for r in results) < TIMEOUT_S
        assert (tmp_path / "ckpt" / "step_00000001" / "manifest.json").is_file()
    else:
        waiting = outcomes[1:]  # the ranks left in the collective while rank 0 hashes 4 s of pieces
        assert all(o != "ok" and ("timed out" in o.lower() or "timeout" in o.lower()) for o in waiting), outcomes
