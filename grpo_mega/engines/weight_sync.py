"""Weight sync: the trainer's sharded Megatron weights -> full HF-named tensors -> buckets -> every engine.

Owns the path every engine is fed by. On the first DP replica, each pipeline stage walks its own
parameters in a fixed order, all-gathers each TP-sharded one over its TP group (each expert from the EP
rank that holds it, over the EP group), merges the shards through
the bridge (which knows the fused QKV and gate/up layouts), renames it to HF, casts it to the engine's
dtype and packs it into flat buckets of at most `bucket_mb` (a single larger tensor gets a bucket of its
own). Each bucket is gathered and packed once per sync, however many engines there are: the stage's TP
rank 0 broadcasts it, in one collective, to every engine rank outside its TP group (an engine inside it
packs the same bucket from the same gathered shards; without TP, an engine on another DP replica packs its
own identical copy and nothing is sent), stage after stage, so the trainer's TP/PP need not match anything
on the engine side. The next bucket is gathered while the last one is on the wire, and received while the
engine loads the last one. A bucket that stays on its rank, for an engine that loads tensor by tensor, is
never flattened; host-memory bucket buffers are reused between syncs (`Staging`). With
`audit`, the sending ranks also checksum every tensor they pack and each engine's `weight_checksums()` is
compared after the update: a mismatch names the tensor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from grpo_mega.conf.model import ModelConfig
from grpo_mega.models import bridge
from grpo_mega.engines.interface import Bucket, RolloutEngine, TensorMeta, tensor_checksum

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The engine does not hold what the trainer sent."""


class Staging:
    """Reusable flat buffers for packing and receiving buckets on host memory. A fresh 64 MiB buffer per bucket
    costs its page faults every sync (measured here: packing SmolLM2-135M's 269 MB took 0.18 s into new buffers,
    0.04 s into reused ones); on CUDA the caching allocator already reuses blocks, so none are kept there (they
    would hold GPU memory between syncs). Two buffers alternate: a bucket may still be on the wire while the
    next one is packed, never two."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes, self.device = nbytes, device
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes`: the older of the two kept ones when it fits, else a fresh one."""
        if self.device.type != "cpu" or nbytes > self.nbytes:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if len(self._buffers) < 2:
            self._buffers.append(torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
        buf = self._buffers[self._next % len(self._buffers)]
        self._next += 1
        return buf[:nbytes]


def pack_buckets(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, audit: bool = False,
                 staging: Optional[Staging] = None, flatten: bool = True) -> Iterator[Bucket]:
    """Pack (name, tensor) pairs, in order, into flat uint8 buckets of at most `bucket_bytes`; a tensor
    larger than the limit travels alone in a bucket of its own size. With `staging`, a bucket's buffer is
    reused two buckets later: the consumer must be done with a bucket (and its send) by then. Without
    `flatten`, the buckets keep their tensors as they are (`Bucket.parts`; for a consumer on this rank that
    loads tensor by tensor)."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush():
        metas, whole, parts, offset, sums = [], [], [], 0, {} if audit else None
        for name, t in pending:
            t = t.detach()
            nbytes = t.numel() * t.element_size()
            metas.append(TensorMeta(name, t.dtype, tuple(t.shape), offset, nbytes))
            whole.append(t)  # unflattened, a strided view (a slice of a fused QKV) is copied once, into the engine
            if flatten:
                t = t.contiguous()
                parts.append(t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8))
            offset += nbytes
            if audit:
                sums[name] = tensor_checksum(t)
        if not flatten:
            return Bucket(metas, None, sums, parts=whole)
        if not parts:
            return Bucket(metas, torch.empty(0, dtype=torch.uint8), sums)
        if staging is None:
            return Bucket(metas, torch.cat(parts), sums)
        flat = staging.take(offset)
        torch.cat(parts, out=flat)
        return Bucket(metas, flat, sums)

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
    """This pipeline stage's parameters as full HF-named tensors (under LoRA each adapted weight merged with its
    adapter), in a fixed order (every TP rank of the
    stage, and with expert parallelism every EP rank of those, must iterate: the gathers are collectives;
    all ranks get the tensors). Each expert is first merged over the expert-tensor-parallel group (megatron's
    default: the size of tp, so TP x EP splits every expert's matrices like the dense MLP's) and then comes
    from the EP rank that holds it."""
    ps = _ps()
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    ep = ps.get_expert_model_parallel_world_size() if cfg.is_moe else 1
    etp = ps.get_expert_tensor_parallel_world_size() if cfg.is_moe else 1
    offset = bridge.layer_offset(gpt)
    from grpo_mega.models.lora import merged_weight

    for local, param in gpt.state_dict(keep_vars=True).items():
        if local.endswith("_extra_state") or not torch.is_tensor(param):
            continue
        data = merged_weight(gpt, local, param.detach())  # LoRA: W + s B A of this shard (exact per shard)
        if (ep > 1 or etp > 1) and bridge.expert_of(local) is not None:
            if etp > 1 and getattr(param, "tensor_model_parallel", False):
                shards = [torch.empty_like(data) for _ in range(etp)]
                dist.all_gather(shards, data.contiguous(), group=ps.get_expert_tensor_parallel_group())
                data = bridge.merge_tp(bridge.global_name(local, offset), shards, cfg)
            copies = [data]
            if ep > 1:  # EP rank r's local expert j is expert r * (E / ep) + j
                copies = [torch.empty_like(data) for _ in range(ep)]
                dist.all_gather(copies, data.contiguous(), group=ps.get_expert_model_parallel_group())
            for r, full in enumerate(copies):
                name = bridge.global_name(local, offset, r * (cfg.num_experts // ep))
                for hf_name, t in bridge.to_hf(name, full, cfg):
                    yield hf_name, t.to(dtype)
            continue
        name = bridge.global_name(local, offset)
        if name == "output_layer.weight" and cfg.tie_word_embeddings:
            continue  # the last stage's copy of the tied embedding; the first stage sends the original
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


class SyncRoute:
    """Who gathers each pipeline stage and how its buckets reach the engines; built once per set of engine
    ranks (collective over the whole world: it all-gathers every rank's position and creates the groups).

    Stage s is gathered by the TP group of its first DP replica, and with expert parallelism by that group's
    EP partners too, each all-gathering the experts it holds (`tp_ranks[s]`); its TP rank 0 (`senders[s]`)
    packs the buckets. An engine rank among those gatherers packs the same buckets itself from the same
    all-gathered shards. Without tensor or expert parallelism a stage is whole on every DP replica, with
    nothing to gather: an engine rank holding stage s on another replica packs it from its own copy
    (`local[s]`), as it would the sender's bytes, and nothing crosses ranks (`local_replicas=False` sends it over the wire
    instead; the benchmark compares the two). Every other engine rank receives stage s, one broadcast per
    bucket over `groups[s]` (the sender and those engines), with the bucket's header (names, shapes,
    checksums) on a second group of the same ranks so that it does not queue behind the previous bucket's
    bytes."""

    def __init__(self, engine_ranks, local_replicas: bool = True):
        ps = _ps()
        self.engine_ranks = sorted(set(int(r) for r in engine_ranks))
        world = dist.get_world_size()
        if not self.engine_ranks or not all(0 <= r < world for r in self.engine_ranks):
            raise ValueError(f"engine ranks {list(engine_ranks)} must be global ranks in [0, {world})")
        ep = ps.get_expert_model_parallel_world_size()
        # the expert-data-parallel rank: 0 on the first DP replica's TP group and, with EP, its EP partners
        first = ps.get_expert_data_parallel_rank() if ep > 1 else ps.get_data_parallel_rank()
        info = torch.tensor([ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                             ps.get_data_parallel_rank(), first], dtype=torch.long)
        gathered = [torch.empty_like(info) for _ in range(world)]
        dist.all_gather(gathered, info)
        whole = local_replicas and ps.get_tensor_model_parallel_world_size() == 1 and ep == 1
        tp_ranks: dict[int, list[int]] = {}
        senders: dict[int, int] = {}
        stage_of = {}
        for r, t in enumerate(gathered):
            stage, tp_rank, dp_rank, first_rank = t.tolist()
            stage_of[r] = stage
            if first_rank == 0:
                tp_ranks.setdefault(stage, []).append(r)
                if dp_rank == 0 and tp_rank == 0:
                    senders[stage] = r
        stages = sorted(tp_ranks)
        self.tp_ranks = [sorted(tp_ranks[s]) for s in stages]
        self.senders = [senders[s] for s in stages]
        self.local = [[r for r in self.engine_ranks if whole and stage_of[r] == s and r not in self.tp_ranks[s]]
                      for s in stages]
        self.receivers = [[r for r in self.engine_ranks if r not in ranks and r not in local]
                          for ranks, local in zip(self.tp_ranks, self.local)]
        self.groups, self.header_groups = [], []
        for sender, receivers in zip(self.senders, self.receivers):  # the same order on every rank
            members = [sender] + receivers
            self.groups.append(dist.new_group(members) if receivers else None)
            self.header_groups.append(dist.new_group(members) if receivers else None)
        self._staging: Optional[Staging] = None

    def staging(self, nbytes: int, device: torch.device) -> Staging:
        """This rank's reusable bucket buffers (kept between syncs)."""
        if self._staging is None or self._staging.nbytes != nbytes or self._staging.device != device:
            self._staging = Staging(nbytes, device)
        return self._staging


def sync_weights(gpt: torch.nn.Module, cfg: ModelConfig, engine: Optional[RolloutEngine], version: int,
                 bucket_mb: float = 512, audit: bool = False, engine_ranks=(0,),
                 dtype: torch.dtype = torch.float32, route: Optional[SyncRoute] = None) -> Optional[SyncStats]:
    """Send the trainer's weights to every engine: `engine` lives on each global rank of `engine_ranks`
    (None elsewhere). Each bucket is gathered and packed once, whatever the number of engines.

    Collective over the whole world: every rank calls it (with the same `route`, or none: then one is
    built, itself a collective). Returns the stats on the engine ranks, None elsewhere. If the engine
    fails part-way, this rank still takes part in every remaining collective before raising, so that the
    other ranks are not left waiting."""
    route = route or SyncRoute(engine_ranks)
    rank = dist.get_rank()
    hosts = rank in route.engine_ranks
    if hosts and engine is None:
        raise ValueError(f"rank {rank} hosts an engine but got none")
    bucket_bytes = int(bucket_mb * 2**20)
    device = next(gpt.parameters()).device
    staging = route.staging(bucket_bytes, device)
    t0 = time.perf_counter()
    trainer_sums: dict[str, str] = {}
    sent_shapes: dict[str, tuple] = {}
    stats = dict(bytes=0, buckets=0, largest=0)

    def deliver(bucket: Bucket) -> Bucket:
        stats["bytes"] += bucket.nbytes
        stats["buckets"] += 1
        stats["largest"] = max(stats["largest"], bucket.nbytes)
        if bucket.checksums:
            trainer_sums.update(bucket.checksums)
        sent_shapes.update({m.name: m.shape for m in bucket.metas})
        return bucket

    def flow() -> Iterator[Bucket]:
        """Every stage in order: gather (and send) our own, receive the others'; yields what this rank's
        engine loads."""
        for stage, (sender, group, headers) in enumerate(zip(route.senders, route.groups, route.header_groups)):
            if rank in route.tp_ranks[stage] or rank in route.local[stage]:
                tensors = stage_hf_tensors(gpt, cfg, dtype)
                if rank != sender and not hosts:
                    for _ in tensors:  # take part in the TP gathers
                        pass
                    continue
                in_flight = None
                flatten = (rank == sender and group is not None) or not getattr(engine, "loads_tensors", False)
                for bucket in pack_buckets(tensors, bucket_bytes, audit, staging, flatten):
                    if rank == sender and group is not None:
                        dist.broadcast_object_list([(bucket.metas, bucket.checksums, bucket.nbytes)], src=sender,
                                                   group=headers)
                        if in_flight is not None:  # at most two buckets in flight
                            in_flight.wait()
                        in_flight = dist.broadcast(bucket.flat, src=sender, group=group, async_op=True)
                    if hosts:  # the local engine copies this bucket while the next one is gathered
                        yield deliver(bucket)
                if in_flight is not None:
                    in_flight.wait()
                if rank == sender and group is not None:
                    dist.broadcast_object_list([None], src=sender, group=headers)
            elif rank in route.receivers[stage]:
                arrived = None  # the bucket on the wire while the engine loads the one before it
                while True:
                    header = [None]
                    dist.broadcast_object_list(header, src=sender, group=headers)
                    nxt = None
                    if header[0] is not None:
                        metas, sums, nbytes = header[0]
                        flat = staging.take(nbytes)  # two buffers: this one's, and the one the engine reads
                        nxt = (Bucket(metas, flat, sums), dist.broadcast(flat, src=sender, group=group, async_op=True))
                    if arrived is not None:
                        arrived[1].wait()
                        yield deliver(arrived[0])
                    if nxt is None:
                        break
                    arrived = nxt

    if not hosts:
        for _ in flow():
            pass
        return None
    buckets = flow()
    try:
        engine.update_weights(version, buckets)
    finally:
        for _ in buckets:  # the engine stopped early (it raised): finish the collectives for the others
            pass
    seconds = time.perf_counter() - t0
    if audit:
        check_audit(trainer_sums, engine.weight_checksums(sent_shapes))
    log.debug("weight sync v%d: %.1f MiB in %d buckets (largest %.1f MiB) in %.3f s%s", version,
             stats["bytes"] / 2**20, stats["buckets"], stats["largest"] / 2**20, seconds, ", audited" if audit else "")
    return SyncStats(version, stats["bytes"], stats["buckets"], stats["largest"], seconds, audit,
                     trainer_sums if audit else None, sent_shapes)


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
