"""Exact resume: a run stopped after a checkpoint and resumed (at its own layout, or at another one) gives the
same per-step metrics as the run that never stopped."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOL = 1e-6


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(out: Path, ckpt: Path, steps: int, tp: int, *extra):
    # torchrun with --master-port 0 hung here: give it a real free port.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
           str(_free_port()), "-m", "grpo_mega.train"] if tp > 1 else [sys.executable, "-m", "grpo_mega.train"]
    cmd += [f"hydra.run.dir={out}", f"parallel.tp={tp}", f"run.steps={steps}", "eval.interval=2",
            f"checkpoint.dir={ckpt}", "checkpoint.interval=2", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


def _same(a: dict, b: dict, steps):
    for s in steps:
        for key in ("reward", "val_reward", "loss", "grad_norm", "entropy", "pg_loss"):
            assert b[s][key] == pytest.approx(a[s][key], rel=TOL, abs=TOL), (s, key, a[s][key], b[s][key])


@pytest.fixture(scope="module")
def uninterrupted_tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("full_tp2")
    return d, _train(d / "run", d / "ckpt", 5, 2)


@pytest.mark.parametrize("resume_tp", [2, 1])
def test_resume_at_tp2_and_at_another_layout(uninterrupted_tp2, tmp_path, resume_tp):
    """Saved by a TP2 run (2 torchrun ranks); resumed at TP2, and at TP1 (resharded by dist_checkpointing)."""
    full_dir, full = uninterrupted_tp2
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(full_dir / "ckpt" / "step_00000002", ckpt / "step_00000002")
    resumed = _train(tmp_path / "run", ckpt, 5, resume_tp)
    assert sorted(resumed) == [3, 4, 5]
    _same(full, resumed, [3, 4, 5])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    return d, _train(d / "run", d / "ckpt", 5, 1)


def test_resume_at_the_same_layout_is_exact(uninterrupted, tmp_path):
    full_dir, full = uninterrupted
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(full_dir / "ckpt" / "step_00000002", ckpt / "step_00000002")  # the state when it stopped
    resumed = _train(tmp_path / "run", ckpt, 5, 1)
    assert sorted(resumed) == [3, 4, 5]
    _same(full, resumed, [3, 4, 5])


def test_resume_skips_a_corrupt_newest_checkpoint(uninterrupted, tmp_path):
    full_dir, full = uninterrupted
    ckpt = tmp_path / "ckpt"
    shutil.copytree(full_dir / "ckpt", ckpt)
    newest = sorted(ckpt.iterdir())[-1]
    victim = next(p for p in (newest / "model").iterdir() if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:-10])  # truncated: resume=auto must fall back to the one before
    resumed = _train(tmp_path / "run", ckpt, 5, 1)
    assert sorted(resumed) == [5]  # resumed from step 4
    _same(full, resumed, [5])
    assert list(ckpt.glob(".step_00000004.corrupt-*")) or list(ckpt.glob(".step_00000005.corrupt-*"))
