"""LoRA checkpoints (grpo_mega/trainer/checkpoint.py under lora.rank): they hold the adapters and their optimizer
state, not the frozen base (which comes from the model path), and a run resumed from one (checkpoint.resume=auto)
gives the same per-step metrics as the run that never stopped, bit for bit at TP1, TP2, PP2 and (an MoE model with
expert and router adapters) EP2, and at TP1 from
a TP2 checkpoint to 1e-6 on the first resumed step. A checkpoint of another
base model, other adapters, or a full checkpoint under LoRA (and the reverse) is refused in one line.

The runs are forked from the warm server (tests/fork_server.py), as in tests/trainer/test_resume.py."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.fork_server import run_main

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-6
LORA = ("lora.rank=4", "optim.lr=0.01", "algo.kl_coef=0.01")  # the adapters move measurably; the KL uses the base
KEYS = ("reward", "val_reward", "loss", "grad_norm", "entropy", "pg_loss", "kl")


def _train(out: Path, ckpt: Path, steps: int, tp: int = 1, *extra, ok: bool = True):
    argv = [f"hydra.run.dir={out}", f"parallel.tp={tp}", f"run.steps={steps}", "eval.interval=2",
            f"checkpoint.dir={ckpt}", "checkpoint.interval=2", *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = run_main(argv, timeout=300, cwd=ROOT, scratch=out.parent, nproc=tp if tp > 1 else None)
    if not ok:
        return proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


def _max_diff(a: dict, b: dict, steps) -> float:
    worst = 0.0
    for s in steps:
        for key in KEYS:
            assert b[s][key] == pytest.approx(a[s][key], rel=TOL, abs=TOL), (s, key, a[s][key], b[s][key])
            worst = max(worst, abs(b[s][key] - a[s][key]))
    return worst


def _bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_full")
    return d, _train(d / "run", d / "ckpt", 5, 1, *LORA, "checkpoint.export_hf=true")


def _resumed_from_step_2(full_dir: Path, tmp_path: Path, tp: int):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(full_dir / "ckpt" / "step_00000002", ckpt / "step_00000002")  # the state when it stopped
    return _train(tmp_path / "run", ckpt, 5, tp, *LORA)


def _check_exact_resume(uninterrupted_run, tmp_path, tp: int) -> dict:
    """Resumed at TP`tp` from the TP`tp` run's step-2 checkpoint: steps 3-5 equal the uninterrupted run's, bit for
    bit; returns the uninterrupted run's metrics."""
    full_dir, full = uninterrupted_run
    resumed = _resumed_from_step_2(full_dir, tmp_path, tp)
    assert sorted(resumed) == [3, 4, 5]
    worst = _max_diff(full, resumed, [3, 4, 5])
    print(f"LoRA resume TP{tp} -> TP{tp}: largest per-step metric difference {worst:.3g}")
    assert worst == 0.0, "the same layout and RNG states: bit for bit"
    return full


def test_lora_resume_at_the_same_layout_is_exact(uninterrupted, tmp_path):
    full = _check_exact_resume(uninterrupted, tmp_path, 1)
    assert full[3]["kl"] > 0, "the adapters had moved the policy away from the base by step 2"


@pytest.fixture(scope="module")
def uninterrupted_tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_full_tp2")
    return d, _train(d / "run", d / "ckpt", 5, 2, *LORA)


def test_lora_resume_at_tp2_is_exact(uninterrupted_tp2, tmp_path):
    """At TP2 the adapters are sharded (B of qkv/fc1 by rows, fc1's by megatron's gate/up factory; A of proj/fc2
    by columns), and so are their Adam moments."""
    _check_exact_resume(uninterrupted_tp2, tmp_path, 2)


def test_lora_resume_across_layouts(uninterrupted_tp2, tmp_path):
    """The TP2 checkpoint resumed at TP1 (resharded by dist_checkpointing). Step 3 depends on the adapters alone:
    equal to 1e-6. Step 4 depends on the Adam moments too, and the layouts themselves drift apart by then (two
    uninterrupted LoRA runs at TP1 and TP2, measured on this CPU: grad_norm 3.8e-9 apart at step 1, 7.1e-8 at
    step 3, 7.6e-5 of 0.285 at step 4, 0.062 at step 5: optim.lr=0.01 amplifies rounding): 1e-3 relative there,
    which wrongly loaded moments (zero, or another parameter's) would exceed by far."""
    full_dir, full = uninterrupted_tp2
    resumed = _resumed_from_step_2(full_dir, tmp_path, 1)
    worst = _max_diff(full, resumed, [3])
    print(f"LoRA resume TP2 -> TP1: largest step-3 metric difference {worst:.3g}; step 4 grad_norm "
          f"{full[4]['grad_norm']} vs {resumed[4]['grad_norm']}")
    for key in KEYS:
        assert resumed[4][key] == pytest.approx(full[4][key], rel=1e-3, abs=1e-6), (key, full[4][key], resumed[4][key])


def test_lora_checkpoint_holds_the_adapters_alone(uninterrupted, tmp_path):
    """No base weight is written: every tensor of model/ is an adapter or an adapter's optimizer state, B has
    trained (non-zero), and the checkpoint is a small fraction of a full one of the same model."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    full_dir, _ = uninterrupted
    step = full_dir / "ckpt" / "step_00000002"
    meta = FileSystemReader(str(step / "model")).read_metadata()
    tensors = [k for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")]
    assert tensors and all(k.endswith(("lora_A", "lora_B")) for k in tensors), \
        [k for k in tensors if not k.endswith(("lora_A", "lora_B"))][:5]
    adapters = [k for k in tensors if not k.startswith("optimizer.")]
    assert len(adapters) == 4 * 2, adapters  # 4 targets x (A, B), megatron stacking the layers on a first axis
    assert all(meta.state_dict_metadata[k].size[0] == 4 for k in adapters)  # the tiny model's 4 layers
    from torch.distributed.checkpoint import load as dcp_load

    key = next(k for k in adapters if k.endswith("linear_fc2.lora_B"))
    b = {key: torch.empty(meta.state_dict_metadata[key].size)}
    dcp_load(b, storage_reader=FileSystemReader(str(step / "model")), no_dist=True)
    assert float(b[key].abs().max()) > 0, "B starts at 0 and has trained"
    from grpo_mega.trainer.checkpoint import model_dir

    with pytest.raises(ValueError, match=r"is a LoRA checkpoint: its model/ holds the adapters alone"):
        model_dir(str(step))  # grpo-mega-convert-to-hf's reading of a checkpoint
    peft = load_file(step / "peft" / "adapter_model.safetensors")  # checkpoint.export_hf: merged hf/ and peft/
    assert len(peft) == 4 * 7 * 2 and (step / "peft" / "adapter_config.json").is_file()  # tests/trainer/test_lora_export.py
    assert (step / "hf" / "model.safetensors").is_file()
    loop = json.loads((step / "loop_state.json").read_text())
    assert loop["lora"] == {"rank": 4, "alpha": 16.0, "target_modules": ["qkv", "proj", "fc1", "fc2"],
                            "base_model": {"path": "tiny", "init_seed": loop["config"]["run"]["seed"]}}
    base = _train(tmp_path / "base_run", tmp_path / "base_ckpt", 2, 1)  # every weight trains
    lora_b, full_b = _bytes(step / "model"), _bytes(tmp_path / "base_ckpt" / "step_00000002" / "model")
    print(f"checkpoint model/: LoRA {lora_b} bytes, full {full_b} bytes ({lora_b / full_b:.3f})")
    assert lora_b < 0.2 * full_b, (lora_b, full_b)
    assert sorted(base) == [1, 2]


def test_lora_resume_on_another_base_model_is_refused(uninterrupted, tmp_path):
    full_dir, _ = uninterrupted
    ckpt = tmp_path / "ckpt"
    shutil.copytree(full_dir / "ckpt" / "step_00000002", ckpt / "step_00000002")
    proc = _train(tmp_path / "run", ckpt, 5, 1, *LORA, "run.seed=7", ok=False)  # another random base
    assert proc.returncode != 0
    line = next(l for l in proc.stderr.splitlines() if "holds LoRA adapters trained on base model" in l)
    assert "tiny (random init, run.seed=1234)" in line and "this run's tiny (random init, run.seed=7)" in line, line


def _actor(rank):
    from grpo_mega.conf.lora import LoraConfig

    return SimpleNamespace(lora=LoraConfig(rank=rank) if rank else None)


def test_check_lora_refuses_what_cannot_continue(tmp_path):
    from grpo_mega.trainer.checkpoint_store import CheckpointError
    from grpo_mega.trainer.lora_checkpoint import base_model_identity, check_lora, lora_state

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"abc" * 1000)
    (hf / "model-00002-of-00002.safetensors").write_bytes(b"def" * 1000)
    (hf / "config.json").write_text("{}")
    base = base_model_identity("x", str(hf), 0)
    assert base["files"] == 2 and len(base["weights_sha256"]) == 64
    import hashlib

    files = sorted(hf.glob("*.safetensors"))  # each file's name and sha256, in name order (hashlib's, not ours)
    want = hashlib.sha256("".join(f"{f.name}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n" for f in files).encode())
    assert base["weights_sha256"] == want.hexdigest()
    # the files shared out over 2 ranks (file i on rank i % 2), their digests joined: the same identity
    import threading
    from concurrent.futures import ThreadPoolExecutor

    parts, met = [None, None], threading.Barrier(2, timeout=30)

    def rank(r):
        def gather(mine):  # all_gather_objects between two threads
            parts[r] = mine
            met.wait()
            return list(parts)
        return base_model_identity("x", str(hf), 0, r, 2, gather=gather)

    with ThreadPoolExecutor(2) as pool:
        ranks = list(pool.map(rank, (0, 1)))
    assert [sorted(p) for p in parts] == [[files[0].name], [files[1].name]] and ranks == [base, base]
    with pytest.raises(RuntimeError, match="1 of 2 files hashed"):
        base_model_identity("x", str(hf), 0, 0, 2)
    moved = tmp_path / "moved"
    shutil.copytree(hf, moved)
    assert base_model_identity("y", str(moved), 0)["weights_sha256"] == base["weights_sha256"]  # the bytes, not the path
    state = {"lora": lora_state(_actor(4), base)}
    check_lora(Path("ck"), state, _actor(4), base_model_identity("y", str(moved), 0))  # the same base, moved

    (moved / "model-00002-of-00002.safetensors").write_bytes(b"deg" * 1000)  # one byte changed
    other = base_model_identity("y", str(moved), 0)
    with pytest.raises(CheckpointError, match=rf"holds LoRA adapters trained on base model {hf.resolve()} \(sha256 of "
                                              rf"its weights {base['weights_sha256'][:16]}\.\.\.\), not on this run's "
                                              rf"{moved.resolve()} \(sha256 of its weights {other['weights_sha256'][:16]}"):
        check_lora(Path("ck"), state, _actor(4), other)
    with pytest.raises(CheckpointError, match=r"lora\.rank 4 \(this run: 8\)"):
        check_lora(Path("ck"), state, _actor(8), base)
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters only \(lora\.rank=4\) and this run trains every "
                                              r"weight \(lora\.rank=null\)"):
        check_lora(Path("ck"), state, _actor(None), None)
    with pytest.raises(CheckpointError, match=r"is a full checkpoint .* this run trains LoRA adapters \(lora\.rank=4\)"):
        check_lora(Path("ck"), {}, _actor(4), base)
    check_lora(Path("ck"), {}, _actor(None), None)  # full on full: nothing to check here
    # a checkpoint of before weights_sha256 (one sha256 over the bytes) resumes on the same directory, not another
    old = {"lora": lora_state(_actor(4), {"path": base["path"], "sha256": "0" * 64, "files": 2})}
    check_lora(Path("ck"), old, _actor(4), base)
    with pytest.raises(CheckpointError, match="holds LoRA adapters trained on base model"):
        check_lora(Path("ck"), old, _actor(4), other)


def test_lora_resume_at_pp2_is_exact(tmp_path):
    """PP2 (two stages, each saving its layers' adapters under their global layer index): resumed from step 2,
    steps 3-4 equal the uninterrupted PP2 run's bit for bit. (Across world sizes the rollouts themselves differ
    from step 1 on, so only the same layout is compared here.)"""
    def run(name, ckpt):
        argv = [f"hydra.run.dir={tmp_path / name}", "parallel.pp=2", "run.steps=4", "eval.interval=2",
                f"checkpoint.dir={ckpt}", "checkpoint.interval=2", *LORA]
        proc = run_main(argv, timeout=300, cwd=ROOT, scratch=tmp_path, nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {r["step"]: r for r in (json.loads(line) for line in open(tmp_path / name / "metrics.jsonl"))}

    full = run("full", tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt_resumed"
    ckpt.mkdir()
    shutil.copytree(tmp_path / "ckpt" / "step_00000002", ckpt / "step_00000002")
    resumed = run("resumed", ckpt)
    assert sorted(resumed) == [3, 4]
    worst = _max_diff(full, resumed, [3, 4])
    print(f"LoRA resume PP2 -> PP2: largest per-step metric difference {worst:.3g}")
    assert worst == 0.0


def test_lora_resume_of_an_moe_model_with_expert_adapters_is_exact(tmp_path):
    """tiny-qwen3-moe at EP2 with adapters on every target (experts and routers included): the checkpoint holds
    the adapters (each expert's under its global index) and their optimizer state, and `hf/` only (its dense
    layer 2's fc1/fc2 adapters have no PEFT form on an MoE model: lora_checkpoint.peft_refusal); resumed from step
    2, steps 3-4 equal the uninterrupted run's bit for bit."""
    moe = ("model=tiny-qwen3-moe", "lora.target_modules=[qkv,proj,fc1,fc2,expert_fc1,expert_fc2,router]",
           "checkpoint.export_hf=true")

    def run(name: str, steps: int, ckpt: Path) -> dict:
        argv = [f"hydra.run.dir={tmp_path / name}", "parallel.ep=2", f"run.steps={steps}", "eval.interval=2",
                f"checkpoint.dir={ckpt}", "checkpoint.interval=2", *LORA, *moe]
        proc = run_main(argv, timeout=300, cwd=ROOT, scratch=tmp_path, nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {r["step"]: r for r in (json.loads(line) for line in open(tmp_path / name / "metrics.jsonl"))}

    full = run("full", 4, tmp_path / "ckpt_full")
    saved = tmp_path / "ckpt_full" / "step_00000002"
    assert (saved / "hf" / "config.json").is_file() and not (saved / "peft").exists()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(saved, ckpt / "step_00000002")
    resumed = run("resumed", 4, ckpt)
    assert sorted(resumed) == [3, 4] and full[3]["kl"] > 0
    assert _max_diff(full, resumed, [3, 4]) == 0.0
