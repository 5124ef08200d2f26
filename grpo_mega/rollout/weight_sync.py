"""Weight sync: the trainer's sharded Megatron weights -> full HF-named tensors -> buckets -> the engine.

Owns the path every engine is fed by. On the first DP replica, each pipeline stage walks its own
parameters in a fixed order, all-gathers each TP-sharded one over its TP group, merges the shards through
the bridge (which knows the fused QKV and gate/up layouts), renames it to HF, casts it to the engine's
dtype and packs it into flat buckets of at most `bucket_mb` (a single larger tensor gets a bucket of its
own). The stage's TP rank 0 sends its buckets to the rank that hosts the engine, stage after stage, so the
trainer's TP/PP need not match anything on the engine side. With `audit`, the sending ranks also checksum
every tensor they pack and the engine's `weight_checksums()` is compared after the update: a mismatch names
the tensor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from grpo_mega.conf.schema import ModelConfig
from grpo_mega.models import bridge
from grpo_mega.rollout.engine import Bucket, RolloutEngine, TensorMeta, tensor_checksum

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The engine does not hold what the trainer sent."""


def pack_buckets(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, audit: bool = False) -> Iterator[Bucket]:
    """Pack (name, tensor) pairs, in order, into flat uint8 buckets of at most `bucket_bytes`; a tensor
    larger than the limit travels alone in a bucket of its own size."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush():
        metas, parts, offset, sums = [], [], 0, {} if audit else None
        for name, t in pending:
            t = t.detach().contiguous()
            nbytes = t.numel() * t.element_size()
            metas.append(TensorMeta(name, t.dtype, tuple(t.shape), offset, nbytes))
            parts.append(t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8))
            offset += nbytes
            if audit:
                sums[name] = tensor_checksum(t)
        return Bucket(metas, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8), sums)

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield flush()
            pending, size = [], 0
        pending.append((name, t))
        size += nbytes
    if pending:
        yield flush()


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def stage_hf_tensors(gpt: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's parameters as full HF-named tensors, in a fixed order (every TP rank of the
    stage must iterate: the gathers are collectives; all ranks get the tensors)."""
    ps = _ps()
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    offset = bridge.layer_offset(gpt)
    for local, param in gpt.state_dict(keep_vars=True).items():
        if local.endswith("_extra_state") or not torch.is_tensor(param):
            continue
        name = bridge.global_name(local, offset)
        if name == "output_layer.weight" and cfg.tie_word_embeddings:
            continue  # the last stage's copy of the tied embedding; the first stage sends the original
        data = param.detach()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(shards, data.contiguous(), group=group)
            full = bridge.merge_tp(name, shards, cfg)
        else:
            full = data
        for hf_name, t in bridge.to_hf(name, full, cfg):
            yield hf_name, t.to(dtype)


@dataclass
class SyncStats:
    version: int
    bytes: int
    buckets: int
    largest_bucket: int
    seconds: float
    audited: bool
    checksums: Optional[dict] = None  # the trainer's, by HF name, when audited
    shapes: Optional[dict] = None  # HF name -> shape of everything sent


def sync_weights(gpt: torch.nn.Module, cfg: ModelConfig, engine: Optional[RolloutEngine], version: int,
                 bucket_mb: float = 512, audit: bool = False, engine_rank: int = 0,
                 dtype: torch.dtype = torch.float32) -> Optional[SyncStats]:
    """Send the trainer's weights to `engine`, which lives on global rank `engine_rank` (None elsewhere).

    Collective over the whole world: every rank calls it. Returns the stats on the engine's rank."""
    ps = _ps()
    rank = dist.get_rank()
    bucket_bytes = int(bucket_mb * 2**20)
    t0 = time.perf_counter()
    senders = _first_replica_pp_ranks()  # collective: every rank learns who sends each stage
    pp, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    first_replica = ps.get_data_parallel_rank() == 0
    sender = first_replica and ps.get_tensor_model_parallel_rank() == 0
    trainer_sums: dict[str, str] = {}
    sent_shapes: dict[str, tuple] = {}
    stats = dict(bytes=0, buckets=0, largest=0)

    def deliver(bucket: Bucket):
        stats["bytes"] += bucket.nbytes
        stats["buckets"] += 1
        stats["largest"] = max(stats["largest"], bucket.nbytes)
        if bucket.checksums:
            trainer_sums.update(bucket.checksums)
        sent_shapes.update({m.name: m.shape for m in bucket.metas})
        yield bucket

    def engine_buckets():
        for stage in range(pp):
            src = senders[stage]
            if src == rank:  # the engine's own stage: straight from the gather
                for bucket in pack_buckets(stage_hf_tensors(gpt, cfg, dtype), bucket_bytes, audit):
                    yield from deliver(bucket)
            else:
                while True:
                    header = [None]
                    dist.recv_object_list(header, src=src)
                    if header[0] is None:
                        break
                    metas, sums, nbytes = header[0]
                    # On the device the sender packed on (its weights'): a CUDA bucket travels by NCCL, and a
                    # host-memory receive would wait for it on gloo forever.
                    flat = torch.empty(nbytes, dtype=torch.uint8, device=_bucket_device())
                    dist.recv(flat, src=src)
                    yield from deliver(Bucket(metas, flat, sums))

    if rank == engine_rank:
        if engine is None:
            raise ValueError(f"rank {rank} hosts the engine but got none")
        engine.update_weights(version, engine_buckets())
    elif first_replica:
        for stage in range(pp):
            if stage != my_stage:
                continue
            tensors = stage_hf_tensors(gpt, cfg, dtype)
            if sender:
                for bucket in pack_buckets(tensors, bucket_bytes, audit):
                    dist.send_object_list([(bucket.metas, bucket.checksums, bucket.nbytes)], dst=engine_rank)
                    dist.send(bucket.flat.contiguous(), dst=engine_rank)
                dist.send_object_list([None], dst=engine_rank)
            else:
                for _ in tensors:  # take part in the TP gathers
                    pass
    if rank != engine_rank:
        return None
    seconds = time.perf_counter() - t0
    if audit:
        check_audit(trainer_sums, engine.weight_checksums(sent_shapes))
    log.debug("weight sync v%d: %.1f MiB in %d buckets (largest %.1f MiB) in %.3f s%s", version,
             stats["bytes"] / 2**20, stats["buckets"], stats["largest"] / 2**20, seconds, ", audited" if audit else "")
    return SyncStats(version, stats["bytes"], stats["buckets"], stats["largest"], seconds, audit,
                     trainer_sums if audit else None, sent_shapes)


def _bucket_device() -> torch.device:
    """Where buckets are packed: next to the trainer's weights (the current GPU, or the CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _first_replica_pp_ranks() -> list[int]:
    """Global ranks of each pipeline stage's (tp rank 0, dp rank 0) process, in stage order."""
    ps = _ps()
    world = dist.get_world_size()
    info = torch.tensor([ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                         ps.get_data_parallel_rank()], dtype=torch.long)
    gathered = [torch.empty_like(info) for _ in range(world)]
    dist.all_gather(gathered, info)
    out = {}
    for r, t in enumerate(gathered):
        stage, tp_rank, dp_rank = t.tolist()
        if tp_rank == 0 and dp_rank == 0:
            out[stage] = r
    return [out[s] for s in sorted(out)]


def check_audit(trainer: dict[str, str], engine: dict[str, str]) -> None:
    """Every tensor the trainer sent must be in the engine bit for bit, and the engine must hold nothing
    the trainer did not send."""
    wrong = sorted(n for n in trainer if engine.get(n) != trainer[n])
    extra = sorted(set(engine) - set(trainer))
    if wrong or extra:
        parts = []
        if wrong:
            parts.append(f"{len(wrong)} tensors differ from the trainer's: {', '.join(wrong[:5])}")
        if extra:
            parts.append(f"{len(extra)} engine tensors were never sent: {', '.join(extra[:5])}")
        raise WeightSyncError("weight sync audit failed: " + "; ".join(parts))
