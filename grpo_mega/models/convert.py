"""Checkpoint conversion between HF directories and Megatron distributed checkpoints.

hf_to_mcore: every rank of the target TP x PP layout builds its stage uninitialised, reads only its own
slices of the safetensors and writes its shard with dist_checkpointing. mcore_to_hf: two processes load
the checkpoint one layer at a time (a meta-device model describes the layout, dist_checkpointing reads just
that layer, resharded to TP1) and streams the HF tensors into sharded safetensors: memory for about one
layer, not the model. Both write to a temporary directory renamed into place at the end, and validate the
layout before writing anything. A Megatron checkpoint carries grpo_mega.json: the model config and the
source HF config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.conf.optim import PrecisionConfig
from grpo_mega.models import bridge
from grpo_mega.models.hf_io import HFWriter, SafetensorsReader, check_tensors, hf_dtype, load_hf_into_gpt, read_hf_config

META_FILE = "grpo_mega.json"
_PRECISION = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _precision_for(dtype: torch.dtype) -> PrecisionConfig:
    if dtype not in _PRECISION:
        raise ValueError(f"checkpoint dtype {dtype} is not supported: bf16 or fp32")
    return PrecisionConfig(params_dtype=_PRECISION[dtype])


def read_meta(ckpt_dir: str) -> dict:
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise ValueError(f"{ckpt_dir}: no {META_FILE}; not a grpo-mega Megatron checkpoint (or an interrupted one)")
    with open(path) as f:
        meta = json.load(f)
    meta["model"] = ModelConfig(**meta["model"])
    return meta


def write_meta(ckpt_dir: str, cfg: ModelConfig, hf_config: dict, dtype: torch.dtype, **extra) -> None:
    meta = dict(model=dataclasses.asdict(cfg), hf_config=hf_config, dtype=_PRECISION[dtype], **extra)
    with open(Path(ckpt_dir) / META_FILE, "w") as f:
        json.dump(meta, f, indent=2)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS to its current RSS (Linux); return the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def _peak_rss() -> int:
    return _status_bytes("VmHWM")


# ---- HF -> Megatron -----------------------------------------------------------------------------------


def plan_hf_to_mcore(hf_dir: str, out_dir: str, tp: int, pp: int, ep: int = 1) -> tuple[dict, ModelConfig, torch.dtype]:
    """Everything that can be checked before a file is written: the source, the layout, the destination."""
    hf, _, cfg = read_hf_config(hf_dir)
    check_tensors(SafetensorsReader(hf_dir), cfg, hf_dir)  # safetensors present, index consistent, names complete
    ParallelConfig(tp=tp, pp=pp, ep=ep).check(cfg, world_size=tp * pp * ep)
    if Path(out_dir).exists():
        raise ValueError(f"{out_dir} exists; refusing to overwrite a checkpoint (remove it or choose another path)")
    return hf, cfg, hf_dtype(hf)


def hf_to_mcore_rank(hf_dir: str, tmp_dir: str, tp: int, pp: int, ep: int = 1) -> dict:
    """One rank of hf_to_mcore (torch.distributed already initialised with tp * pp * ep ranks: each expert-parallel
    rank loads and saves its own experts; the rest is replicated over ep and dist_checkpointing saves it once)."""
    from megatron.core import dist_checkpointing

    from grpo_mega.models.builder import build_gpt
    from grpo_mega.parallel.state import init_distributed

    start = _reset_peak_rss()
    hf, _, cfg = read_hf_config(hf_dir)
    layout = init_distributed(tp=tp, pp=pp, ep=ep)
    gpt, _ = build_gpt(cfg, ParallelConfig(tp=tp, pp=pp, ep=ep), _precision_for(hf_dtype(hf)), init=False)
    reader = SafetensorsReader(hf_dir)
    load_hf_into_gpt(gpt, hf_dir, cfg, layout.tp_rank, tp, reader)
    del reader  # unmap the safetensors files before the save allocates its buffers
    dist_checkpointing.save(gpt.sharded_state_dict(), tmp_dir)
    expert = {n for n, _ in gpt.named_parameters() if bridge.expert_of(n) is not None}
    # counted once: the non-expert parameters are replicated over the EP ranks
    counted = [p for n, p in gpt.named_parameters() if n in expert or layout.ep_rank == 0]
    return dict(rank=torch.distributed.get_rank(), params=sum(p.numel() for p in counted),
                param_bytes=sum(p.numel() * p.element_size() for p in counted),
                peak_rss_above_start=_peak_rss() - start)


def hf_to_mcore(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, timeout: float = 3600, ep: int = 1) -> dict:
    """Convert an HF directory to a Megatron distributed checkpoint saved at layout tp x pp (x ep for MoE).

    Forks tp * pp * ep gloo ranks on this machine (a dist checkpoint loads at any layout later). Returns the
    output path, the parameter bytes and the largest per-rank peak RSS above that rank's start."""
    from grpo_mega.parallel.forked import run_ranks

    hf, cfg, dtype = plan_hf_to_mcore(hf_dir, out_dir, tp, pp, ep)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        ranks = run_ranks(hf_to_mcore_rank, tp * pp * ep, hf_dir, str(tmp), tp, pp, ep, timeout=timeout)
        layout = dict(tp=tp, pp=pp) | (dict(ep=ep) if ep > 1 else {})
        write_meta(str(tmp), cfg, hf, dtype, source=str(hf_dir), saved_layout=layout)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dict(
        out=str(out),
        param_bytes=sum(r["param_bytes"] for r in ranks) // 1,
        peak_rss_above_start=max(r["peak_rss_above_start"] for r in ranks),
    )


# ---- Megatron -> HF -----------------------------------------------------------------------------------


def _materialise(entry):
    """A sharded-state-dict entry of a meta model with real (empty, CPU) storage to load into."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensor):
        return dataclasses.replace(entry, data=torch.empty(entry.local_shape, dtype=entry.dtype))
    if isinstance(entry, ShardedTensorFactory):
        return dataclasses.replace(entry, data=torch.empty(entry.data.shape, dtype=entry.data.dtype))
    return None  # ShardedObject (_extra_state): nothing HF needs


def _groups(names: list[str], num_layers: int) -> list[list[str]]:
    """Embedding, then one group per layer, then the final norm and output layer."""
    layer_of = {}
    for n in names:
        parts = n.split(".")
        if n.startswith("decoder.layers."):
            layer_of.setdefault(int(parts[2]), []).append(n)
    first = [n for n in names if n.startswith("embedding.")]
    last = [n for n in names if not n.startswith(("embedding.", "decoder.layers."))]
    return [first] + [layer_of.get(i, []) for i in range(num_layers)] + [last]


def mcore_to_hf_rank(ckpt_dir: str, out_dir: str, tokenizer_from: Optional[str], max_shard_bytes: int) -> dict:
    """The export, on a 2-rank group where both ranks read the same layer and rank 0 writes.

    Two ranks because dist_checkpointing's torch backend describes the shards a rank does not hold as
    belonging to "another rank", (rank + 1) % world_size: with one rank that is itself, and loading a single
    layer of a layer-stacked tensor fails ("Number of local shards (1) does not match ... (4)")."""
    from megatron.core import dist_checkpointing

    from grpo_mega.models.builder import build_gpt
    from grpo_mega.parallel.state import init_distributed

    meta = read_meta(ckpt_dir)
    cfg: ModelConfig = meta["model"]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[meta["dtype"]]
    family = bridge.FAMILIES.get(cfg.family)
    init_distributed(tp=1, pp=1)
    writes = torch.distributed.get_rank() == 0
    gpt, _ = build_gpt(cfg, ParallelConfig(), _precision_for(dtype), meta=True)
    layout = gpt.sharded_state_dict()
    writer = HFWriter(out_dir, max_shard_bytes) if writes else None
    largest = 0
    try:
        for group in _groups(list(layout), cfg.num_layers):
            request = {k: e for k in group if (e := _materialise(layout[k])) is not None}
            if not request:
                continue
            # One layer of tensors that are stored stacked over all layers: the access check would
            # (rightly, for a training load) complain that the other layers are never read.
            loaded = dist_checkpointing.load(request, ckpt_dir, validate_access_integrity=False)
            # A training checkpoint's common state (the optimizer's param groups, ...) comes back too.
            loaded = {k: v for k, v in loaded.items() if k in request}
            largest = max(largest, sum(t.numel() * t.element_size() for t in loaded.values()))
            for name in group:
                if name in loaded and writes:
                    for hf_name, t in bridge.to_hf(name, loaded[name], cfg):
                        writer.add(hf_name, t.to(dtype).clone())
            del loaded
        if writes:
            hf_config = dict(meta.get("hf_config") or {})
            hf_config.update(family.hf_config(cfg, dtype={"bf16": "bfloat16", "fp32": "float32"}[meta["dtype"]]))
            writer.close(hf_config, tokenizer_from or meta.get("source"))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return dict(bytes=writer.total_bytes if writes else 0, largest_group_bytes=largest)


def mcore_to_hf(ckpt_dir: str, out_dir: str, tokenizer_from: Optional[str] = None,
                max_shard_bytes: int = 2 * 2**30, timeout: float = 3600) -> dict:
    """Export a Megatron checkpoint written by this project to an HF directory (sharded safetensors, index,
    config.json, tokenizer files from `tokenizer_from` or the original HF source)."""
    from grpo_mega.parallel.forked import run_ranks

    read_meta(ckpt_dir)
    if Path(out_dir).exists():
        raise ValueError(f"{out_dir} exists; refusing to overwrite an HF checkpoint (remove it or choose another path)")
    res, _ = run_ranks(mcore_to_hf_rank, 2, ckpt_dir, out_dir, tokenizer_from, max_shard_bytes, timeout=timeout)
    return res
