"""Benchmark: sealing and verifying a checkpoint with the hashing shared out over the ranks
(grpo_mega.trainer.checkpoint.seal/verify) against rank 0 hashing everything alone while the others wait (the
sealing before issue 28). Writes JSON (default bench_results/checkpoint.json), with the projection to
Llama-3.1-70B on 64 GPUs.

    python -m bench.checkpoint [--mb 320] [--worlds 1 2 4] [--repeats 2] [--out bench_results/checkpoint.json]

The same `--mb` MB at every world size: four Megatron-like writer files (`model/__R_0.distcp`, writer R's share
0.4/0.2/0.2/0.2, as a DP-rank-0 replica writes more than the others) plus rank 0's loop state; at fewer ranks
than four, rank R % world writes writer R's file. Per repeat, from a barrier: every rank writes its files
(page cache; sealing fsyncs them), then seals (`sharded`: plan, hash a share, gather, manifest, rename; or
`rank0`: rank 0 lists and hashes all, the others wait in a broadcast), then the checkpoint is verified the
sharded way. Hash time is each rank's wall time in its hashing (and its thread CPU time: on a machine with
fewer cores than ranks the ranks' wall times include waiting for a core). Medians over repeats.
The 70B projection: bytes of the actor's bf16 weights, fp32 main weights, Adam m and v, and the bf16 reference
(written once algo.ref_update_interval has reset it; until then it is the model path's weights, not written:
`total_without_reference_gb`), parameter count from grpo_mega.planning, shared evenly over 64 ranks, at the
measured single-rank hash rate (the times are those with the reference: the worst case).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench import common

WRITER_SHARES = (0.4, 0.2, 0.2, 0.2)
TIMEOUT_S = 600.0
NOTE = ("hash_wall_vs_rank0 needs a core per rank: with fewer cores than ranks the sharded ranks queue for them "
        "(best case cores/ranks); hash_cpu_vs_rank0 and hash_bytes_vs_rank0 are each rank's share of the work")  # torch.distributed's default collective timeout for the world group (gloo and NCCL)


def _rank(root: str, total_bytes: int, mode: str, repeats: int, piece_bytes: int):
    import numpy as np
    import torch.distributed as dist

    from grpo_mega.parallel import comm
    from grpo_mega.trainer import checkpoint
    from grpo_mega.trainer.checkpoint_store import CheckpointStore

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {w: np.random.default_rng(w).bytes(int(total_bytes * s)) for w, s in enumerate(WRITER_SHARES)
            if w % world == rank}
    store = CheckpointStore(root, keep_last=1, piece_bytes=piece_bytes)
    rows = []
    for step in range(1, repeats + 1):
        tmp = Path(comm.broadcast_object(str(store.begin(step)) if rank == 0 else None))
        (tmp / "model").mkdir(exist_ok=True)
        dist.barrier()
        t0 = time.perf_counter()
        for w, data in mine.items():
            with open(tmp / "model" / f"__{w}_0.distcp", "wb") as f:
                f.write(data)
        if rank == 0:
            (tmp / "loop_state.json").write_text(json.dumps({"step": step}))
        dist.barrier()
        t1 = time.perf_counter()
        if mode == "sharded":
            final = checkpoint.seal(store, step, tmp, meta={"step": step})
            hash_s, hash_cpu_s, hash_bytes = store.hash_s, store.hash_cpu_s, store.hash_bytes
        else:  # before issue 28: rank 0 lists and hashes every file alone, the others wait
            hash_s = hash_cpu_s = hash_bytes = 0.0
            if rank == 0:
                c0, w0 = time.thread_time(), time.perf_counter()
                final = str(store.seal(step, tmp, meta={"step": step}))
                hash_s, hash_cpu_s = time.perf_counter() - w0, time.thread_time() - c0
                hash_bytes = sum(p.stat().st_size for p in Path(final).rglob("*") if p.name != "manifest.json")
            final = Path(comm.broadcast_object(final if rank == 0 else None))
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        checkpoint.verify(CheckpointStore(root), final)
        store_verify = time.perf_counter() - t3
        dist.barrier()
        t4 = time.perf_counter()
        rows.append(dict(write_s=t1 - t0, seal_s=t2 - t1, hash_s=hash_s, hash_cpu_s=hash_cpu_s,
                         hash_bytes=hash_bytes, verify_s=t4 - t3, verify_rank_s=store_verify))
    return rows


def run_world(world: int, mode: str, total_bytes: int, repeats: int, piece_bytes: int) -> dict:
    from grpo_mega.parallel.forked import run_ranks

    with tempfile.TemporaryDirectory(prefix="bench_ckpt_", dir=os.environ.get("BENCH_CKPT_DIR")) as root:
        per_rank = run_ranks(_rank, world, root, total_bytes, mode, repeats, piece_bytes, timeout=1200)
    reps = []
    for i in range(repeats):
        r = [per_rank[k][i] for k in range(world)]
        w = {k: max(x[k] for x in r) for k in r[0]}  # the slowest rank's
        reps.append(dict(write_s=w["write_s"], seal_s=w["seal_s"], save_s=w["write_s"] + w["seal_s"],
                         hash_s_max=w["hash_s"], hash_cpu_s_max=w["hash_cpu_s"], hash_bytes_max=w["hash_bytes"],
                         verify_s=w["verify_s"], hash_s_per_rank=[round(x["hash_s"], 4) for x in r]))
    out = {k: statistics.median([rep[k] for rep in reps]) for k in reps[0] if k != "hash_s_per_rank"}
    out["hash_s_per_rank"] = reps[len(reps) // 2]["hash_s_per_rank"]
    out["hash_share_of_save"] = out["hash_s_max"] / out["save_s"]
    return dict(world=world, mode=mode, total_bytes=total_bytes, repeats=repeats, **out)


def projection_70b(rate_bytes_s: float, cpu_rate_bytes_s: float, ranks: int = 64, piece_bytes: int = 256 << 20) -> dict:
    from grpo_mega import planning
    from grpo_mega.conf.parallel import ParallelConfig
    from grpo_mega.conf.model import load_model_config

    model = load_model_config("llama-3.1-70b")
    n = sum(s.total for s in planning.stage_params(model, ParallelConfig(tp=1, pp=1)))
    # the reference is written only once algo.ref_update_interval has reset it (before, it is the model path's)
    parts = {"weights_bf16": 2 * n, "main_fp32": 4 * n, "adam_m_v_fp32": 8 * n}
    total = sum(parts.values()) + 2 * n
    per_rank = total / ranks + piece_bytes  # the plan's bound: an even share plus at most one piece
    return dict(model="llama-3.1-70b", params=n, ranks=ranks, bytes=parts, reference_bf16_once_reset=2 * n,
                total_bytes=total, total_without_reference_gb=sum(parts.values()) / 1e9,
                total_gb=total / 1e9, per_rank_bytes_bound=per_rank, per_rank_gb=per_rank / 1e9,
                hash_rate_gb_s=rate_bytes_s / 1e9, hash_rate_cpu_gb_s=cpu_rate_bytes_s / 1e9,
                rank0_alone_s=total / rate_bytes_s, per_rank_s=per_rank / rate_bytes_s, timeout_s=TIMEOUT_S,
                rank0_alone_vs_timeout=total / rate_bytes_s / TIMEOUT_S,
                per_rank_vs_timeout=per_rank / rate_bytes_s / TIMEOUT_S,
                rank0_alone_s_at_cpu_rate=total / cpu_rate_bytes_s, per_rank_s_at_cpu_rate=per_rank / cpu_rate_bytes_s,
                note="hash_rate: one rank's sha256 of page-cached files, wall time on this shared machine (the "
                     "seconds use it: conservative); hash_rate_cpu: the same per CPU second (an unloaded core). On a "
                     "cluster each rank also reads its share back from the filesystem: 64 readers instead of one")


def main(argv=None) -> None:
    ap = common.parser(__doc__, "checkpoint")
    ap.add_argument("--mb", type=float, default=320.0, help="checkpoint size (MB), the same at every world size")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--piece-mb", type=float, default=16.0, help="hashing piece (MB); the trainer uses 256")
    args = ap.parse_args(argv)
    total, piece = int(args.mb * 1e6), int(args.piece_mb * (1 << 20))
    load_before = os.getloadavg()
    rows = []
    for world in args.worlds:
        for mode in ("rank0", "sharded") if world > 1 else ("sharded",):
            row = run_world(world, mode, total, args.repeats, piece)
            rows.append(row)
            print(f"world {world} {mode:8s} save {row['save_s']:.2f} s (hash {row['hash_s_max']:.2f} s max, cpu "
                  f"{row['hash_cpu_s_max']:.2f} s, {row['hash_bytes_max'] / 1e6:.0f} MB max per rank), verify "
                  f"{row['verify_s']:.2f} s", flush=True)
    one = next(r for r in rows if r["world"] == min(args.worlds))
    rate, cpu_rate = one["hash_bytes_max"] / one["hash_s_max"], one["hash_bytes_max"] / one["hash_cpu_s_max"]
    summary = {}
    for world in args.worlds:
        sh = next(r for r in rows if r["world"] == world and r["mode"] == "sharded")
        base = next((r for r in rows if r["world"] == world and r["mode"] == "rank0"), one)
        summary[f"world{world}"] = dict(
            hash_wall_vs_rank0=sh["hash_s_max"] / base["hash_s_max"],
            hash_cpu_vs_rank0=sh["hash_cpu_s_max"] / base["hash_cpu_s_max"],
            hash_bytes_vs_rank0=sh["hash_bytes_max"] / base["hash_bytes_max"],
            save_vs_rank0=sh["save_s"] / base["save_s"],
            verify_vs_world1=sh["verify_s"] / one["verify_s"])
    data = dict(bench="checkpoint", python=platform.python_version(), cores=os.cpu_count(), mb=args.mb,
                piece_mb=args.piece_mb, loadavg={"before": load_before, "after": os.getloadavg()}, rows=rows,
                summary=summary, target="4 ranks: hashing at most 0.35x of rank-0-only hashing",
                projection_70b=projection_70b(rate, cpu_rate),
                note=NOTE)
    common.write_json(args.out, data)
    print(json.dumps({"summary": summary, "projection_70b": data["projection_70b"]}, indent=1))


if __name__ == "__main__":
    main()
