"""Benchmark: weight sync of SmolLM2-135M from the trainer's shards into the embedded engine, in bytes/s,
against this machine's memcpy bandwidth measured in the same run. Writes JSON.

    python tools/bench_weight_sync.py [--tp 3] [--pp 1] [--bucket-mb 64] [--out bench_results/weight_sync.json]

The trainer is loaded straight from the prepared HF directory (`make smollm2`) at the given layout, on
forked gloo ranks; the engine lives on rank 0. Sync time covers the TP gathers, renaming, packing, the
sends and the engine's copy-in (no audit); the memcpy figure is a plain torch copy of a buffer of the
model's size.
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
    from grpo_mega.rollout.weight_sync import sync_weights

    with cpu_compat.cpu_device_mode():
        layout = init_distributed(tp=tp, pp=pp)
        _, _, cfg = read_hf_config(hf_dir)
        gpt, _ = build_gpt(cfg, ParallelConfig(tp=tp, pp=pp), PrecisionConfig(params_dtype="bf16"), init=False)
        load_hf_into_gpt(gpt, hf_dir, cfg, layout.tp_rank, tp)
        engine = EmbeddedEngine.from_hf_dir(hf_dir, dtype=torch.bfloat16) if dist.get_rank() == 0 else None
        times, stats = [], None
        for v in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            stats = sync_weights(gpt, cfg, engine, version=v + 1, bucket_mb=bucket_mb, dtype=torch.bfloat16)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if engine is None:
            return None
        memcpy = _memcpy_bytes_per_s(stats.bytes)
        return dict(bytes=stats.bytes, buckets=stats.buckets, largest_bucket=stats.largest_bucket,
                    seconds=min(times), memcpy_bytes_per_s=memcpy)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument("--tp", type=int, default=3, help="SmolLM2 has 9 heads and 3 KV groups: 1 or 3")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "weight_sync.json"))
    args = ap.parse_args()
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    from grpo_mega.parallel.forked import run_ranks
    from tests.models.hf_fixtures import smollm2_dir

    hf_dir = args.hf_dir or str(smollm2_dir())
    res = run_ranks(_rank, args.tp * args.pp, hf_dir, args.tp, args.pp, args.bucket_mb, args.repeats, timeout=1800)[0]
    rate = res["bytes"] / res["seconds"]
    out = dict(
        what="weight sync of SmolLM2-135M-Instruct (bf16) from trainer shards to the embedded engine, no audit",
        layout=dict(tp=args.tp, pp=args.pp), bucket_mb=args.bucket_mb,
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), backend="gloo (CPU)"),
        bytes=res["bytes"], buckets=res["buckets"], largest_bucket_bytes=res["largest_bucket"],
        seconds=res["seconds"], sync_bytes_per_s=rate, memcpy_bytes_per_s=res["memcpy_bytes_per_s"],
        ratio_to_memcpy=rate / res["memcpy_bytes_per_s"],
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"sync {res['bytes'] / 2**20:.1f} MiB in {res['seconds']:.3f} s = {rate / 2**30:.2f} GiB/s; "
          f"memcpy {res['memcpy_bytes_per_s'] / 2**30:.2f} GiB/s; ratio {out['ratio_to_memcpy']:.3f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
