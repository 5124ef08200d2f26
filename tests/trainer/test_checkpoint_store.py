"""The on-disk life of a checkpoint: sealed atomically, verified, the newest good one found, old ones pruned."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.trainer.checkpoint_store import CheckpointError, CheckpointStore


def _save(store, step, files=None):
    tmp = store.begin(step)
    for name, data in (files or {"model/shard_0.bin": b"w" * 100, "rng.json": b"{}"}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    return store.seal(step, tmp, meta={"weight_version": step})


def test_seal_verify_latest_and_keep_last(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2)
    for step in (10, 20, 30):
        _save(store, step)
    assert [s for s, _ in store.complete()] == [20, 30]  # step 10 pruned
    step, path = store.latest()
    assert step == 30 and store.verify(path)["meta"] == {"weight_version": 30}
    with pytest.raises(CheckpointError, match="exists and is complete; a step is checkpointed once"):
        store.begin(30)


def test_corrupt_truncated_and_missing_files_are_named_and_skipped(tmp_path):
    store = CheckpointStore(str(tmp_path))
    _save(store, 1)
    p2 = _save(store, 2)
    shard = p2 / "model" / "shard_0.bin"
    shard.write_bytes(b"w" * 99)
    with pytest.raises(CheckpointError, match=r"model/shard_0.bin has 99 bytes, the manifest says 100 \(truncated\?\)"):
        store.verify(p2)
    step, _ = store.latest()
    assert step == 1 and "truncated" in store.skipped[0]  # resume=auto falls back to the last good one
    shard.write_bytes(b"x" * 100)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        store.verify(p2)
    shard.unlink()
    with pytest.raises(CheckpointError, match="model/shard_0.bin is missing"):
        store.verify(p2)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        store.verify(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        CheckpointStore(str(tmp_path), keep_last=0)


_KILLED_MID_WRITE = """
import os
from grpo_mega.trainer.checkpoint_store import CheckpointStore
store = CheckpointStore({root!r})
tmp = store.begin(2)
with open(tmp / "model.bin", "wb") as f:
    f.write(b"half of a shard")
    f.flush()
    os.kill(os.getpid(), 9)  # SIGKILL while the checkpoint is being written
"""


def test_a_kill_during_a_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    store = CheckpointStore(str(tmp_path))
    _save(store, 1)
    code = _KILLED_MID_WRITE.format(root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == -9
    assert any(p.name.startswith(".step_00000002.partial-") for p in tmp_path.iterdir())
    step, path = store.latest()
    assert step == 1 and store.verify(path)
    assert os.listdir(path)  # still all there


def test_one_run_per_checkpoint_directory(tmp_path, monkeypatch):
    """A second run on a directory whose holder lives is refused, naming the holder; a holder that is gone
    (dead pid on this host, an earlier attempt of the same Slurm job, a stale heartbeat elsewhere) is taken
    over; release removes the lock."""
    import json
    import os
    import subprocess
    import time

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first = CheckpointStore(str(tmp_path))
    first.acquire()
    lock = tmp_path / ".lock"
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    with pytest.raises(CheckpointError, match=r"is in use by another run \(pid \d+ on .*\).*delete .*\.lock"):
        CheckpointStore(str(tmp_path)).acquire()
    first.release()
    assert not lock.exists()

    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": dead.pid, "job": None}))
    s = CheckpointStore(str(tmp_path))
    s.acquire()
    assert "has exited" in s.taken_over
    s.release()

    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "77"}))
    with pytest.raises(CheckpointError, match="Slurm job 77"):
        CheckpointStore(str(tmp_path)).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # the same job, requeued: its earlier attempt is over
    s = CheckpointStore(str(tmp_path))
    s.acquire()
    assert "earlier attempt of Slurm job 77" in s.taken_over
    s.release()

    monkeypatch.setenv("SLURM_JOB_ID", "78")
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "77"}))
    old = time.time() - 3600
    os.utime(lock, (old, old))
    s = CheckpointStore(str(tmp_path))
    s.acquire(stale_after_s=1800)
    assert "no heartbeat for" in s.taken_over
