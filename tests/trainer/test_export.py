"""HF export of training checkpoints, and the SmolLM2 example (launch_scripts/smollm2_arithmetic.sh).

The trainer's logits come from a Megatron GPT loaded from the training checkpoint's distributed checkpoint;
the export's come from transformers' own modelling code on the exported directory. They must agree to
1e-4 max-abs in fp32 (eager attention: transformers' sdpa path alone differs from its eager one by 9.8e-5
on SmolLM2)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_mega.processes import free_port
from grpo_mega.conf import ParallelConfig, PrecisionConfig
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed

from tests.proc import run_tree

ROOT = Path(__file__).resolve().parents[2]
LOGIT_TOL = 1e-4  # max-abs, fp32


def _trainer_logits(model_dir: str, tokens: torch.Tensor):
    """The actor exactly as the trainer saved it: a TP1 GPT loaded from the checkpoint's `model/`
    (dist_checkpointing reshards whatever layout saved it)."""
    from megatron.core import dist_checkpointing

    from grpo_mega.models.builder import build_gpt
    from grpo_mega.models.convert import read_meta

    meta = read_meta(model_dir)
    cfg = meta["model"]
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1)
        gpt, _ = build_gpt(cfg, ParallelConfig(), PrecisionConfig(params_dtype=meta["dtype"]), init=False)
        request = gpt.sharded_state_dict()
        loaded = dist_checkpointing.load(request, model_dir, validate_access_integrity=False)
        gpt.load_state_dict({k: v for k, v in loaded.items() if k in request}, strict=False)
        gpt.eval()
        b, s = tokens.shape
        with torch.no_grad():
            logits = gpt(tokens, torch.arange(s).expand(b, s).contiguous(), None)
        destroy_distributed()
    return logits[..., : cfg.vocab_size].float()


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(tokens).logits


def _check(step_dir: Path, tokens: torch.Tensor) -> float:
    (trainer,) = run_ranks(_trainer_logits, 1, str(step_dir / "model"), tokens, timeout=300)
    exported = _hf_logits(step_dir / "hf", tokens)
    assert exported.abs().max() > 0.1  # not two near-zero tensors (the tiny model: ~0.5; SmolLM2: ~30)
    err = (trainer - exported).abs().max().item()
    assert err <= LOGIT_TOL, f"max-abs logit error {err:.2e} between the trainer and its HF export"
    return err


def test_smollm2_example_runs_and_its_export_matches_the_trainer(tmp_path):
    """The README's real-model example: 2 GRPO steps of SmolLM2-135M-Instruct from its HF directory on CPU
    (arithmetic prompts in verl's schema, math-verify reward, validation before and after), the embedded
    engine (transformers) and the trainer (Megatron) agreeing on every sampled token's logprob, then the exported
    HF checkpoint (loaded by transformers) gives the trainer's logits."""
    from transformers import AutoTokenizer

    from grpo_mega.data import arithmetic
    from tests.models.hf_fixtures import smollm2_dir

    # The script's own training set (256 rows, seed 0), written here rather than by its two data commands, and 4
    # validation prompts instead of its 16: the two validations were 2/3 of this test's time.
    arithmetic.write(arithmetic.make_rows(256, seed=0), tmp_path / "data" / "train.parquet")
    arithmetic.write(arithmetic.make_rows(4, seed=1, split="val"), tmp_path / "data" / "val.parquet")
    env = dict(os.environ, OUT=str(tmp_path), STEPS="2", MODEL=str(smollm2_dir()), PYTHON=sys.executable)
    proc = run_tree(["bash", str(ROOT / "launch_scripts" / "smollm2_arithmetic.sh"), "batch.train_batch_size=2",
                           "rollout.n=2", "batch.ppo_mini_batch_size=2", "batch.micro_batch_size=4",
                           "batch.max_response_length=16"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    # A step whose samples all got the same reward has no gradient (no KL term here); one with a group that varies
    # does, even when its on-policy loss cancels to exactly 0 (ratio 1, advantages summing to 0 per group: step 1
    # with this seed and the lazy data's order, loss 0.0, grad_norm 5.8).
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped"] == 0 for r in rows)
    assert all(r["grad_norm"] == 0 for r in rows if r["reward"] in (0.0, 1.0)) and any(r["grad_norm"] > 0 for r in rows)
    assert all(r["logprob_mismatch"] < 1e-4 for r in rows)  # engine (transformers) vs trainer (Megatron), fp32
    assert "validation reward (greedy)" in proc.stdout

    step_dir = tmp_path / "checkpoints" / "step_00000002"
    assert (step_dir / "manifest.json").is_file() and (step_dir / "hf" / "tokenizer.json").is_file()
    # The export is the trained model, not the one it started from.
    base, trained = load_file(smollm2_dir() / "model.safetensors"), load_file(step_dir / "hf" / "model.safetensors")
    assert base.keys() == trained.keys()
    assert any(not torch.equal(base[k].float(), trained[k]) for k in base)

    # One of the example's questions and an answer, without the chat template's long system prompt:
    # measured on the base model, Megatron and transformers agree exactly up to 40 tokens and by 9.3e-5 at
    # the 55 tokens the template makes (CPU BLAS blocking), too close to the tolerance to say anything.
    tok = AutoTokenizer.from_pretrained(step_dir / "hf")
    tokens = torch.tensor([tok("What is 12 * 7? Put the final answer in \\boxed{}. 12 * 7 = 84, so \\boxed{84}")["input_ids"]])
    assert tokens.shape[1] <= 40
    err = _check(step_dir, tokens)
    print(f"SmolLM2 export vs trainer: max-abs logit error {err:.2e}")


def test_export_from_a_tp2_run_and_the_offline_tool_agree(tmp_path):
    """A TP2 run (2 torchrun ranks) exports its gathered weights into the checkpoint; the offline tool
    exports the same checkpoint later, bit for bit the same; transformers gives the trainer's logits."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "grpo_mega.train", f"hydra.run.dir={tmp_path / 'run'}", "parallel.tp=2", "run.steps=2",
           "eval.interval=2", f"checkpoint.dir={ckpt}", "checkpoint.export_hf=true"]
    proc = run_tree(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step_dir = ckpt / "step_00000002"
    tool = run_tree([sys.executable, "-m", "grpo_mega.cli.convert_to_hf", "--ckpt", str(step_dir),
                     "--out", str(tmp_path / "hf_tool")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert tool.returncode == 0, tool.stderr[-3000:]
    a, b = load_file(step_dir / "hf" / "model.safetensors"), load_file(tmp_path / "hf_tool" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokens = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(0))
    _check(step_dir, tokens)


def test_offline_export_refuses_a_checkpoint_that_fails_its_manifest(tmp_path):
    from grpo_mega.trainer.checkpoint import model_dir
    from grpo_mega.trainer.checkpoint_store import CheckpointError, CheckpointStore

    store = CheckpointStore(str(tmp_path))
    tmp = store.begin(3)
    (tmp / "model").mkdir()
    (tmp / "model" / "grpo_mega.json").write_text("{}")
    (tmp / "model" / "shard.distcp").write_bytes(b"x" * 100)
    step_dir = store.seal(3, tmp)
    (step_dir / "model" / "shard.distcp").write_bytes(b"y" * 100)
    with pytest.raises(CheckpointError, match="shard.distcp fails its checksum"):
        model_dir(str(step_dir))
    unsealed = tmp_path / "step_00000009"
    (unsealed / "model").mkdir(parents=True)
    with pytest.raises(ValueError, match="interrupted while being written"):
        model_dir(str(unsealed))


def _export_at(src: str, out: str, dtype: torch.dtype) -> None:
    """The checkpoint's HF export (trainer.checkpoint.export_hf, as Run.save calls it) of an fp32 actor loaded
    from `src`, written in `dtype` (the trained precision: the actor's params_dtype)."""
    from grpo_mega.models.hf_io import load_hf_into_gpt, read_hf_config
    from grpo_mega.trainer.checkpoint import export_hf
    from tests.trainer import layouts as L

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1)
        _, _, cfg = read_hf_config(src)
        actor = L.tiny_actor(train=1, mini=1, micro=1)
        actor = type(actor)(cfg, ParallelConfig(), PrecisionConfig(params_dtype="fp32"), actor.optim, actor.algo,
                            actor.batch)
        load_hf_into_gpt(actor.built.gpt, src, cfg, 0, 1)
        with torch.no_grad():  # as if trained in fp32: values a bf16 source cannot hold
            for p in actor.built.gpt.parameters():
                p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        export_hf(Path(out), actor, cfg, dtype, src)
        destroy_distributed()


@pytest.mark.parametrize("src_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_export_config_names_the_dtype_written(tmp_path, src_dtype, out_dtype):
    """config.json of an export carries the dtype of the tensors it holds, under `dtype` (transformers 5) and
    `torch_dtype` (4.x), whatever the source's said: transformers loads the export in that dtype with the
    written values (bf16 weights from an fp32 source were loaded as fp32; fp32 weights from a bf16 source were
    rounded to bf16)."""
    from transformers import AutoModelForCausalLM

    from tests.models.hf_fixtures import tiny_hf

    src = tiny_hf(tmp_path / "src", "qwen3", dtype=src_dtype)
    assert json.loads((src / "config.json").read_text())["dtype"] == str(src_dtype).removeprefix("torch.")
    out = tmp_path / "hf"
    run_ranks(_export_at, 1, str(src), str(out), out_dtype, timeout=300)
    name = str(out_dtype).removeprefix("torch.")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == name
    written = load_file(out / "model.safetensors")
    assert {t.dtype for t in written.values()} == {out_dtype}
    model = AutoModelForCausalLM.from_pretrained(out)  # no dtype given: the config's
    assert model.dtype == out_dtype
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in written.items())
    if out_dtype == torch.float32:  # the trained values themselves, not rounded to the source's bf16
        assert any(not torch.equal(v, v.bfloat16().float()) for v in state.values())
