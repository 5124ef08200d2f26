"""What a LoRA checkpoint adds to a training checkpoint (grpo_mega/trainer/checkpoint.py): the identity of the base
model the adapters were trained on (`base_model_identity`, kept in loop_state.json under "lora" with the adapters'
shape settings, `lora_state`; also what names a full checkpoint's unwritten reference,
grpo_mega/trainer/checkpoint.py), the refusal of a checkpoint that cannot continue this run (`check_lora`), and the
adapters as a PEFT LoRA directory (`export_peft`, `peft_refusal`) beside the merged HF export."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from grpo_mega.parallel import comm
from grpo_mega.trainer.checkpoint_store import CheckpointError


def _lora(actor):
    """The actor's LoraConfig, None when every weight trains."""
    return getattr(actor, "lora", None)


def base_model_identity(model: str, hf_dir: Optional[str], seed: int, rank: int = 0, world: int = 1,
                        gather=None) -> dict:
    """What a LoRA checkpoint's adapters were trained on: an HF directory's resolved path and `weights_sha256`, the
    sha256 over its weight files (*.safetensors, else *.bin) in name order, each file's name and the sha256 of its
    bytes; a model_configs/ model (no weights on disk) is its name and run.seed, from which its weights are
    initialised. The files are hashed by the ranks in turn (file i by rank i % world) and `gather`
    (comm.all_gather_objects; collective) joins their digests: a 70B base is ~30 files of ~5 GB, seconds per rank
    where one rank alone would hash 140 GB while the others wait in a collective."""
    if hf_dir is None:
        return {"path": model, "init_seed": seed}
    files = sorted(Path(hf_dir).glob("*.safetensors")) or sorted(Path(hf_dir).glob("*.bin"))
    mine = {f.name: _file_sha256(f) for i, f in enumerate(files) if i % world == rank}
    digests: dict[str, str] = {}
    for part in (gather(mine) if gather is not None else [mine]):
        digests.update(part)
    if len(digests) != len(files):
        raise RuntimeError(f"base model hash: {len(digests)} of {len(files)} files hashed (world={world} without gather?)")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{digests[f.name]}\n".encode())
    return {"path": str(Path(hf_dir).resolve()), "weights_sha256": h.hexdigest(), "files": len(files)}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def lora_state(actor, base_model: Optional[dict]) -> Optional[dict]:
    """What loop_state.json keeps of a LoRA run (None without LoRA): the adapters' shape settings and the base."""
    lora = _lora(actor)
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules),
            "base_model": base_model}


def describe_base(base: Optional[dict]) -> str:
    """The weights a base_model_identity names, for a message."""
    if not base:
        return "an unrecorded base model"
    digest = base.get("weights_sha256") or base.get("sha256")
    if digest:
        return f"{base['path']} (sha256 of its weights {digest[:16]}...)"
    return f"{base['path']} (random init, run.seed={base.get('init_seed')})"


def same_base(a: Optional[dict], b: Optional[dict]) -> bool:
    """Do two base_model_identity records name the same weights?"""
    for key in ("weights_sha256", "sha256"):
        if a and b and key in a and key in b:
            return a[key] == b[key]  # the same bytes, wherever they were moved
    if a and b and {"weights_sha256", "sha256"} == {k for k in (*a, *b) if "sha256" in k}:
        # a checkpoint of before weights_sha256 (one sha256 over all the bytes): the same directory and file count
        return a["path"] == b["path"] and a.get("files") == b.get("files")
    return a == b


def check_lora(path: Path, state: dict, actor, base_model: Optional[dict]) -> None:
    """A CheckpointError in one line when checkpoint `path` (its loop state `state`) cannot continue this run's
    training: a full checkpoint under LoRA or the reverse, other adapter shapes or scale, another base model."""
    saved, now = state.get("lora"), lora_state(actor, base_model)
    if saved is None and now is None:
        return
    if saved is None:
        raise CheckpointError(f"{path} is a full checkpoint (every weight trained) and this run trains LoRA adapters "
                              f"(lora.rank={now['rank']}): resume it with lora.rank=null, or start the LoRA run in "
                              "another checkpoint.dir")
    if now is None:
        raise CheckpointError(f"{path} holds LoRA adapters only (lora.rank={saved['rank']}) and this run trains every "
                              f"weight (lora.rank=null): resume with lora.rank={saved['rank']}, or start the full run "
                              "in another checkpoint.dir")
    diffs = [f"lora.{k} {saved.get(k)!r} (this run: {now[k]!r})" for k in ("rank", "alpha", "target_modules")
             if saved.get(k) != now[k]]
    if diffs:
        raise CheckpointError(f"{path} was trained with other adapters: {', '.join(diffs)}; resume with its lora "
                              "settings, or start a new run in another checkpoint.dir")
    if not same_base(saved.get("base_model"), base_model):
        trained_on, ours = describe_base(saved.get("base_model")), describe_base(base_model)
        raise CheckpointError(f"{path} holds LoRA adapters trained on base model {trained_on}, not on this run's "
                              f"{ours}: resume with the base model it was trained on (model=...), or start a new "
                              "run in another checkpoint.dir")


PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def peft_tensors(gpt, model_cfg, experts: bool = True, dense: bool = True) -> dict[str, torch.Tensor]:
    """Collective over TP: this pipeline stage's adapters as full tensors under PEFT's names
    (base_model.model.<HF module>.lora_A.weight [r, in] / .lora_B.weight [out, r]; `experts` / `dense`: those of
    this rank's experts, under their global index, / the others). A fused adapter is split per HF projection as the
    bridge splits its base weight: qkv's B rows into q/k/v (per query group), fc1's into gate/up (an expert's too,
    under transformers' on-disk per-expert names, which PEFT fuses on loading as transformers fuses the weights),
    each projection keeping the shared A, so that (alpha / r) B_q A is exactly the q rows of (alpha / r) B A."""
    from grpo_mega.models import bridge
    from grpo_mega.models.lora import adapted, adapter_state

    state, offset, out = adapter_state(gpt), bridge.layer_offset(gpt), {}
    expert_offset = bridge.expert_offset(gpt, model_cfg)
    for path, m in adapted(gpt):
        if (m._lora_target.startswith("expert_") and not experts) or (not m._lora_target.startswith("expert_")
                                                                       and not dense):
            continue
        name = bridge.global_name(f"{path}.weight", offset, expert_offset)
        a, b = state[f"{path}.lora_A"], state[f"{path}.lora_B"]
        for hf_name, part in bridge.to_hf(name, b, model_cfg):
            stem = "base_model.model." + hf_name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"], out[f"{stem}.lora_B.weight"] = a.clone(), part.contiguous()
    return out


def peft_refusal(lora, model_cfg) -> Optional[str]:
    """Why `export_peft` cannot write these adapters in a form PEFT loads back as trained, or None. PEFT (0.21) maps
    gate_proj/up_proj/down_proj targets on a transformers-5 MoE model to its fused experts, so the dense MLP layers
    of an MoE model (mlp_only_layers) cannot carry adapters there."""
    dense_mlp = [t for t in lora.target_modules if t in ("fc1", "fc2")]
    if model_cfg.is_moe and dense_mlp and any(not m for m in model_cfg.moe_layers()):
        return (f"lora.target_modules {dense_mlp} on the dense MLP layers of MoE model {model_cfg.name}: PEFT reads "
                "gate_proj/up_proj/down_proj targets of an MoE model as its experts', so a PEFT directory would load "
                "them wrongly; the merged export (hf/, W + (alpha / r) B A) carries them")
    return None


def export_peft(out_dir: Path, actor, model_cfg, dtype: torch.dtype, hf_dir: Optional[str] = None) -> None:
    """Collective: the actor's adapters as a PEFT LoRA directory at `out_dir` (rank 0 writes adapter_config.json
    and adapter_model.safetensors; PEFT's scaling lora_alpha / r is ours). Each pipeline stage's first TP rank of
    the first DP replica sends its stage's adapters to rank 0, and under EP each expert-parallel rank's first
    expert-DP replica its experts'. A router's adapter is PEFT's on the parameter (target_parameters
    mlp.gate.weight: the router is no nn.Linear in transformers)."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    lora = _lora(actor)
    why = peft_refusal(lora, model_cfg)
    if why is not None:
        raise ValueError(why)
    tp0 = ps.get_tensor_model_parallel_rank() == 0
    dense = tp0 and ps.get_data_parallel_rank() == 0
    experts = tp0 and (ps.get_expert_data_parallel_rank() == 0 if model_cfg.is_moe else dense)
    tensors = peft_tensors(actor.built.gpt, model_cfg, experts=experts, dense=dense)  # every rank: collective over TP
    gathered = comm.gather_objects({k: v.to("cpu", dtype) for k, v in tensors.items()})
    if dist.get_rank() != 0:
        return
    merged = {k: v for part in gathered for k, v in part.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(merged, str(out_dir / PEFT_FILES[1]), metadata={"format": "pt"})
    modules = {k.split(".")[-3] for k in merged}
    parameters = sorted({"mlp.gate.weight"} if "router" in lora.target_modules else set())
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": hf_dir, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": sorted(modules - {"gate"}),
              "target_parameters": parameters or None, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "inference_mode": True}
    (out_dir / PEFT_FILES[0]).write_text(json.dumps(config, indent=2))
