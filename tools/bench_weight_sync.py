"""Benchmark: weight sync of SmolLM2-135M from the trainer's shards into one and into two embedded engines,
in bytes/s, against a plain gloo broadcast of the same buckets between the same ranks and this machine's
memcpy bandwidth, all measured in the same run. Writes JSON.

    python tools/bench_weight_sync.py [--tp 3] [--pp 1] [--dp 2] [--bucket-mb 64] [--out bench_results/weight_sync.json]

The trainer is loaded straight from the prepared HF directory (`make smollm2`) at the given layout, on
forked gloo ranks (tp * pp * dp of them). One engine lives on rank 0; the second on rank world/2 (another
DP replica, or another stage: where `rollout.num_engines=2` puts it). Sync time covers the TP gathers,
renaming, packing, the broadcasts and the engines' copy-in (no audit); a bucket is gathered once whatever
the number of engines, so two engines should cost little more than one. The broadcast figure is
`dist.broadcast` of buffers of the same sizes as the buckets, from rank 0 to rank world/2, over a group
of those two ranks: the transport's own limit. The load average is recorded: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _memcpy_bytes_per_s(nbytes: int, repeats: int = 5) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _rank(hf_dir: str, tp: int, pp: int, bucket_mb: float, repeats: int):
    import torch
    import torch.distributed as dist

    from grpo_mega.conf import ParallelConfig, PrecisionConfig
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.models.hf_io import load_hf_into_gpt, read_hf_config
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import init_distributed
    from grpo_mega.rollout.embedded import EmbeddedEngine
    from grpo_mega.rollout.weight_sync import SyncRoute, sync_weights

    with cpu_compat.cpu_device_mode():
        layout = init_distributed(tp=tp, pp=pp)
        rank, world = dist.get_rank(), dist.get_world_size()
        second = world // 2
        _, _, cfg = read_hf_config(hf_dir)
        gpt, _ = build_gpt(cfg, ParallelConfig(tp=tp, pp=pp), PrecisionConfig(params_dtype="bf16"), init=False)
        load_hf_into_gpt(gpt, hf_dir, cfg, layout.tp_rank, tp)
        engine = EmbeddedEngine.from_hf_dir(hf_dir, dtype=torch.bfloat16) if rank in (0, second) else None
        res = {}
        for label, ranks in (("one_engine", [0]), ("two_engines", [0, second])):
            route = SyncRoute(ranks)
            times, stats = [], None
            for v in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                stats = sync_weights(gpt, cfg, engine if rank in ranks else None, version=v + 1, bucket_mb=bucket_mb,
                                     dtype=torch.bfloat16, route=route) or stats
                dist.barrier()
                times.append(time.perf_counter() - t0)
            res[label] = dict(seconds=min(times), all_seconds=times)
            if rank == 0:
                res.update(bytes=stats.bytes, buckets=stats.buckets, largest_bucket=stats.largest_bucket)
        group = dist.new_group([0, second])
        nbytes = [res.get("bytes")]
        dist.broadcast_object_list(nbytes, src=0)
        buffers = _split(nbytes[0], int(bucket_mb * 2**20)) if rank in (0, second) else []
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank in (0, second):
                for buf in buffers:
                    dist.broadcast(buf, src=0, group=group)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank != 0:
            return None
        res["broadcast_seconds"] = min(times)
        res["memcpy_bytes_per_s"] = _memcpy_bytes_per_s(res["bytes"])
        return res


def _split(nbytes: int, bucket_bytes: int):
    import torch

    out = []
    while nbytes > 0:
        out.append(torch.ones(min(nbytes, bucket_bytes), dtype=torch.uint8))
        nbytes -= out[-1].numel()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument("--tp", type=int, default=3, help="SmolLM2 has 9 heads and 3 KV groups: 1 or 3")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=2, help="the second engine is on rank tp*pp*dp/2")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "weight_sync.json"))
    args = ap.parse_args()
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    from grpo_mega.parallel.forked import run_ranks
    from tests.models.hf_fixtures import smollm2_dir

    world = args.tp * args.pp * args.dp
    if world < 2:
        raise SystemExit(f"--tp {args.tp} --pp {args.pp} --dp {args.dp}: two engines need at least 2 ranks")
    hf_dir = args.hf_dir or str(smollm2_dir())
    load_before = os.getloadavg()
    res = run_ranks(_rank, world, hf_dir, args.tp, args.pp, args.bucket_mb, args.repeats, timeout=1800)[0]
    one, two = res["one_engine"]["seconds"], res["two_engines"]["seconds"]
    out = dict(
        what="weight sync of SmolLM2-135M-Instruct (bf16) from trainer shards into 1 and 2 embedded engines, no audit",
        layout=dict(tp=args.tp, pp=args.pp, dp=args.dp, engine_ranks=[0, world // 2]), bucket_mb=args.bucket_mb,
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), backend="gloo (CPU)",
                     loadavg_before=load_before, loadavg_after=os.getloadavg()),
        bytes=res["bytes"], buckets=res["buckets"], largest_bucket_bytes=res["largest_bucket"],
        one_engine=dict(seconds=one, bytes_per_s=res["bytes"] / one, all_seconds=res["one_engine"]["all_seconds"]),
        two_engines=dict(seconds=two, bytes_per_s=res["bytes"] / two, all_seconds=res["two_engines"]["all_seconds"]),
        two_over_one=two / one,
        broadcast=dict(seconds=res["broadcast_seconds"], bytes_per_s=res["bytes"] / res["broadcast_seconds"],
                       what="dist.broadcast of the same bytes in buckets of bucket_mb, rank 0 -> the second engine's rank"),
        two_engine_sync_over_broadcast_seconds=two / res["broadcast_seconds"],
        memcpy_bytes_per_s=res["memcpy_bytes_per_s"],
        ratio_to_memcpy=res["bytes"] / one / res["memcpy_bytes_per_s"],
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    gib = 2**30
    print(f"sync {res['bytes'] / 2**20:.1f} MiB: 1 engine {one:.3f} s ({res['bytes'] / one / gib:.2f} GiB/s), "
          f"2 engines {two:.3f} s ({res['bytes'] / two / gib:.2f} GiB/s), ratio {two / one:.2f}; plain broadcast "
          f"{res['broadcast_seconds']:.3f} s ({res['bytes'] / res['broadcast_seconds'] / gib:.2f} GiB/s); "
          f"load {load_before[0]:.1f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
