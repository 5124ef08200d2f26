"""Exact resume: a run killed with SIGKILL (after a checkpoint, or in the middle of writing one) and resumed with
resume=auto, at its own layout or at another one, gives the same per-step metrics as the run that never
stopped.

The runs are forked from a warm server (tests/fork_server.py: `python -m grpo_mega.train`, and at TP2 two
ranks with torchrun's environment), not new interpreters: about 5-10 s of start-up and imports less per run;
a kill SIGKILLs every rank's process tree by PID, as a preemption of a torchrun job does."""

import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.fork_server import run_main, start_main

TOL = 1e-6
ROOT = Path(__file__).resolve().parents[2]


def _train(out: Path, ckpt: Path, steps: int, tp: int, *extra):
    argv = [f"hydra.run.dir={out}", f"parallel.tp={tp}", f"run.steps={steps}", "eval.interval=2",
            f"checkpoint.dir={ckpt}", "checkpoint.interval=2", *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = run_main(argv, timeout=300, cwd=ROOT, scratch=out.parent, nproc=tp if tp > 1 else None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


def _same(a: dict, b: dict, steps):
    for s in steps:
        for key in ("reward", "val_reward", "loss", "grad_norm", "entropy", "pg_loss"):
            assert b[s][key] == pytest.approx(a[s][key], rel=TOL, abs=TOL), (s, key, a[s][key], b[s][key])


def _start(out: Path, ckpt: Path, steps: int, tp: int, *extra):
    """A TP`tp` run on `tp` ranks (each in a session of its own), to be killed."""
    argv = [f"hydra.run.dir={out}", f"parallel.tp={tp}", f"run.steps={steps}", "eval.interval=2",
            f"checkpoint.dir={ckpt}", *extra]
    out.mkdir(parents=True)
    proc = start_main(argv, cwd=ROOT, scratch=out, nproc=tp, out=out / "stdout.txt", err=out / "stderr.txt")
    proc.stderr_path = out / "stderr.txt"
    return proc


def _sigkill_tree(proc) -> None:
    """SIGKILL every rank and everything under it, as a preemption or an OOM killer would: by PID."""
    proc.kill()
    proc.wait(timeout=30)


def _wait_for(proc, found, timeout: float = 240.0, poll: float = 0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = found()
        if hit:
            return hit
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before the kill: {proc.stderr_path.read_text()[-3000:]}")
        time.sleep(poll)
    _sigkill_tree(proc)
    raise AssertionError("timed out waiting for the moment to kill")


@pytest.fixture(scope="module")
def uninterrupted_tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("full_tp2")
    return _train(d / "run", d / "ckpt", 6, 2)


@pytest.fixture(scope="module")
def killed_after_step_k(tmp_path_factory):
    """A TP2 run checkpointing every step, SIGKILLed right after its step-2 checkpoint is sealed."""
    d = tmp_path_factory.mktemp("killed")
    ckpt = d / "ckpt"
    proc = _start(d / "run", ckpt, 6, 2, "checkpoint.interval=1")
    _wait_for(proc, lambda: (ckpt / "step_00000002" / "manifest.json").is_file())
    _sigkill_tree(proc)
    assert proc.returncode == -signal.SIGKILL
    from grpo_mega.trainer.checkpoint_store import CheckpointStore

    k = CheckpointStore(str(ckpt)).latest()[0]
    assert 2 <= k <= 3, k  # killed within milliseconds of the seal; step 3 cannot have been saved, barely
    return d, ckpt, k


@pytest.mark.parametrize("resume_tp", [2, 1])
def test_sigkill_after_step_k_then_resume_is_exact(uninterrupted_tp2, killed_after_step_k, tmp_path, resume_tp):
    """Killed with SIGKILL at TP2 after step k; resumed at TP2, and at TP1 (resharded by dist_checkpointing):
    steps k+1..k+3 equal the uninterrupted run's."""
    full = uninterrupted_tp2
    _, ckpt_killed, k = killed_after_step_k
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpt_killed, ckpt)
    resumed = _train(tmp_path / "run", ckpt, 6, resume_tp)
    assert sorted(resumed)[:3] == [k + 1, k + 2, k + 3]
    _same(full, resumed, [k + 1, k + 2, k + 3])


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(uninterrupted_tp2, tmp_path):
    """SIGKILL while step 3's checkpoint is being written (its temporary directory exists, unsealed): the
    step-2 checkpoint stays loadable, resume=auto picks it, and the interrupted write is cleaned up."""
    for attempt in range(3):  # the write lasts ~0.1 s and is watched every 1 ms; a miss is retried, not passed
        run_dir = tmp_path / f"attempt{attempt}"
        ckpt = run_dir / "ckpt"
        proc = _start(run_dir / "run", ckpt, 6, 2, "checkpoint.interval=1")
        _wait_for(proc, lambda: ckpt.is_dir() and next(ckpt.glob(".step_00000003.partial-*"), None))
        _sigkill_tree(proc)
        if not (ckpt / "step_00000003").exists():
            break
    else:
        pytest.fail("three attempts all sealed step 3 before the kill landed")
    assert list(ckpt.glob(".step_00000003.partial-*"))
    from grpo_mega.trainer.checkpoint_store import CheckpointStore

    assert CheckpointStore(str(ckpt)).latest()[0] == 2
    resumed = _train(run_dir / "resumed", ckpt, 6, 2)
    assert sorted(resumed) == [3, 4, 5, 6]
    _same(uninterrupted_tp2, resumed, [3, 4, 5])
    assert not list(ckpt.glob(".step_*.partial-*"))


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


def test_a_stop_request_checkpoints_the_current_step_and_the_resume_loses_nothing(uninterrupted, tmp_path):
    """checkpoint.stop_file (what slurm/train.sbatch creates on USR1 before a time limit or preemption): the
    run saves after the step it is in and stops; resumed, it continues from exactly that step."""
    full_dir, full = uninterrupted
    ckpt, stop = tmp_path / "ckpt", tmp_path / "STOP"
    stop.touch()  # already requested: the run stops after its first step
    first = _train(tmp_path / "run", ckpt, 5, 1, f"checkpoint.stop_file={stop}")
    assert sorted(first) == [1] and (ckpt / "step_00000001" / "manifest.json").is_file()
    assert not stop.exists() and (tmp_path / "STOP.stopped").is_file()  # taken, and marked as acted on
    resumed = _train(tmp_path / "resumed", ckpt, 5, 1, f"checkpoint.stop_file={stop}")
    assert sorted(resumed) == [2, 3, 4, 5]
    _same(full, {**first, **resumed}, [1, 2, 3, 4])


def test_resume_reports_changed_settings_and_a_changed_lr_takes_effect(uninterrupted, tmp_path):
    """A resumed run may change settings on purpose (here optim.lr): the change is printed, takes effect
    (Megatron's scheduler would silently keep the checkpoint's by default), and is saved in the checkpoint."""
    full_dir, full = uninterrupted
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(full_dir / "ckpt" / "step_00000002", ckpt / "step_00000002")
    argv = [f"hydra.run.dir={tmp_path / 'run'}", "run.steps=3", "eval.interval=2", f"checkpoint.dir={ckpt}",
            "optim.lr=0.002"]
    proc = run_main(argv, timeout=300, cwd=ROOT, scratch=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "changed since the checkpoint: optim.lr: 0.001 -> 0.002" in proc.stdout
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [3] and rows[0]["lr"] == pytest.approx(0.002) and full[2]["lr"] == pytest.approx(0.001)
    saved = json.loads((ckpt / "step_00000003" / "loop_state.json").read_text())
    assert saved["config"]["optim"]["lr"] == 0.002 and saved["weight_version"] == 3
    again = run_main(argv, timeout=300, cwd=ROOT, scratch=tmp_path)  # already at run.steps
    assert again.returncode == 0 and "nothing to do: the run resumed at run.steps=3" in again.stdout


# ---- the reference of a model path is not written while it is that path's weights ---------------------------------

def _tensors(step: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step / "model")).read_metadata()
    return [k for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")]


def test_the_reference_of_a_model_path_is_checked_not_written_until_it_is_reset(tmp_path):
    """An HF model with a KL term (algo.kl_coef) and algo.ref_update_interval=2: the step-1 checkpoint holds no
    reference tensor and names the model's weights (its sha256); step 2 reset the reference to the policy, so its
    checkpoint holds it. Resumed from step 1 with a model of other weights (same shapes), the run is refused in one
    line naming both. (A resume from such a checkpoint trains as the run that never stopped:
    tests/trainer/test_guards.py's failed-rewards resume, with a KL term.)"""
    from grpo_mega.trainer.lora_checkpoint import base_model_identity
    from tests.models.hf_fixtures import demo_settings, tiny_chat_hf

    model, other = tiny_chat_hf(tmp_path / "model"), tiny_chat_hf(tmp_path / "other", seed=1)
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
                                        "reward_model": {"ground_truth": str(a + b)}}) + "\n"
                            for a, b in [(2, 3), (4, 4), (7, 1), (3, 5)]))
    ckpt = tmp_path / "ckpt"

    def train(out: str, path: Path, steps: int):
        argv = [f"hydra.run.dir={tmp_path / out}", "task=prompts", *demo_settings(), f"model={path}",
                f"data.train_files={data}", "batch.train_batch_size=2", "rollout.n=2", "batch.ppo_mini_batch_size=2",
                "batch.micro_batch_size=4", "batch.max_response_length=4", "eval.interval=0", f"run.steps={steps}",
                "algo.kl_coef=0.01", "algo.ref_update_interval=2", f"checkpoint.dir={ckpt}", "checkpoint.interval=1",
                "checkpoint.keep_last=null"]
        (tmp_path / out).mkdir()
        return run_main(argv, timeout=300, cwd=ROOT, scratch=tmp_path)

    proc = train("run", model, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = ckpt / "step_00000001", ckpt / "step_00000002"
    state = json.loads((first / "loop_state.json").read_text())
    assert state["has_reference"] and state["reference_from"] == base_model_identity(str(model), str(model), 0)
    assert state["reference_from"]["weights_sha256"] and not [k for k in _tensors(first) if k.startswith("reference.")]
    assert json.loads((second / "loop_state.json").read_text())["reference_from"] is None
    written = [k for k in _tensors(second) if k.startswith("reference.")]
    actor = [k for k in _tensors(second) if not k.startswith(("reference.", "optimizer."))]
    assert written and len(written) == len(actor)
    shutil.rmtree(second)
    proc = train("other_run", other, 2)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "holds no reference model" in line]
    assert len(errors) == 1 and f"the weights of {model.resolve()} (sha256 of its weights " in errors[0] \
        and f"this run's model is {other.resolve()} (sha256" in errors[0], proc.stderr[-3000:]
