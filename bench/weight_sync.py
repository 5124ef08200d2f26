"""Benchmark: weight sync of SmolLM2-135M from the trainer's shards into one and into two embedded engines,
in bytes/s, against a plain gloo broadcast of the same buckets between the same ranks and this machine's
memcpy bandwidth, all measured in the same run. Writes JSON.

    python -m bench.weight_sync [--tp 3] [--pp 1] [--dp 2] [--bucket-mb 64] [--trials 3] [--out bench_results/weight_sync.json]

The trainer is loaded straight from the prepared HF directory (`make smollm2`) at the given layout, on
forked gloo ranks (tp * pp * dp of them). One engine lives on rank 0; the second on rank world/2 (another
DP replica, or another stage: where `rollout.num_engines=2` puts it). Sync time covers the TP gathers,
renaming, packing, the broadcasts and the engines' copy-in (no audit); a bucket is gathered once whatever
the number of engines, so two engines should cost little more than one. At TP1 the second engine's DP
replica holds the whole model, so by default it packs its own copy and nothing is sent: the JSON then also
times the same sync over the wire (`two_engines_over_the_wire`). The broadcast figure is
`dist.broadcast` of buffers of the same sizes as the buckets, from rank 0 to rank world/2, over a group
of those two ranks: the transport's own limit. The load average is recorded: the machine is shared.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from bench import common


def _rank(hf_dir: str, tp: int, pp: int, bucket_mb: float, repeats: int):
    import torch
    import torch.distributed as dist

    from grpo_mega.conf import ParallelConfig, PrecisionConfig
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.models.hf_io import load_hf_into_gpt, read_hf_config
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import init_distributed
    from grpo_mega.engines.embedded import EmbeddedEngine
    from grpo_mega.engines.weight_sync import SyncRoute, sync_weights

    with cpu_compat.cpu_device_mode():
        layout = init_distributed(tp=tp, pp=pp)
        rank, world = dist.get_rank(), dist.get_world_size()
        second = world // 2
        _, _, cfg = read_hf_config(hf_dir)
        gpt, _ = build_gpt(cfg, ParallelConfig(tp=tp, pp=pp), PrecisionConfig(params_dtype="bf16"), init=False)
        load_hf_into_gpt(gpt, hf_dir, cfg, layout.tp_rank, tp)
        engine = EmbeddedEngine.from_hf_dir(hf_dir, dtype=torch.bfloat16) if rank in (0, second) else None
        res = {}
        runs = [("one_engine", [0], True), ("two_engines", [0, second], True)]
        if tp == 1:  # the default route reads the second replica's own copy; also time it sent over the wire
            runs.append(("two_engines_over_the_wire", [0, second], False))
        routes = {label: (ranks, SyncRoute(ranks, local_replicas=local_replicas)) for label, ranks, local_replicas in runs}
        times = {label: [] for label in routes}
        stats, version = None, 0
        for rep in range(repeats + 1):  # interleaved, so that a slow spell of the machine hits every mode alike
            for label, (ranks, route) in routes.items():
                version += 1
                dist.barrier()
                t0 = time.perf_counter()
                stats = sync_weights(gpt, cfg, engine if rank in ranks else None, version=version, bucket_mb=bucket_mb,
                                     dtype=torch.bfloat16, route=route) or stats
                dist.barrier()
                if rep:  # the first round allocates the staging buffers and warms the engines' pages
                    times[label].append(time.perf_counter() - t0)
        for label, (ranks, route) in routes.items():
            res[label] = dict(seconds=statistics.median(times[label]), min_seconds=min(times[label]), all_seconds=times[label],
                              received_by=route.receivers[0], packed_from_own_replica=route.local[0])
        if rank == 0:
            res.update(bytes=stats.bytes, buckets=stats.buckets, largest_bucket=stats.largest_bucket)
        # the machine's own limit for two engines loading at once: each engine rank copies a copy of its
        # engine's weights into the engine, rank 0 alone and then both at once (2 vCPUs share one memory bus)
        src = [p.detach().clone() for p in engine.params.values()] if engine is not None else []
        copy_times = {"alone": [], "both": []}
        for rep in range(repeats + 1):
            for label, ranks in (("alone", [0]), ("both", [0, second])):
                dist.barrier()
                t0 = time.perf_counter()
                if rank in ranks:
                    with torch.no_grad():
                        for dst, t in zip(engine.params.values(), src):
                            dst.copy_(t)
                dist.barrier()
                if rep:
                    copy_times[label].append(time.perf_counter() - t0)
        del src
        res["copy_in"] = {k: statistics.median(v) for k, v in copy_times.items()}
        group = dist.new_group([0, second])
        nbytes = [res.get("bytes")]
        dist.broadcast_object_list(nbytes, src=0)
        buckets = torch.ones(nbytes[0], dtype=torch.uint8).split(int(bucket_mb * 2**20)) if rank in (0, second) else []
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank in (0, second):
                for buf in buckets:
                    dist.broadcast(buf, src=0, group=group)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank != 0:
            return None
        res["broadcast_seconds"] = statistics.median(times)
        res["memcpy_bytes_per_s"] = common.copy_bytes_per_s(res["bytes"])
        return res


def _trial(args, world: int, hf_dir: str) -> dict:
    """One measurement in fresh forked ranks: the JSON of one trial."""
    from grpo_mega.parallel.forked import run_ranks

    load_before = os.getloadavg()
    res = run_ranks(_rank, world, hf_dir, args.tp, args.pp, args.bucket_mb, args.repeats, timeout=1800)[0]
    one, two = res["one_engine"]["seconds"], res["two_engines"]["seconds"]

    def mode(label: str, **more) -> dict:
        r = res[label]
        return dict(seconds=r["seconds"], bytes_per_s=res["bytes"] / r["seconds"], min_seconds=r["min_seconds"],
                    all_seconds=r["all_seconds"], **more)

    out = dict(
        what="weight sync of SmolLM2-135M-Instruct (bf16) from trainer shards into 1 and 2 embedded engines, no audit",
        layout=dict(tp=args.tp, pp=args.pp, dp=args.dp, engine_ranks=[0, world // 2]), bucket_mb=args.bucket_mb,
        machine=common.machine(backend="gloo (CPU)", loadavg_before=load_before, loadavg_after=os.getloadavg()),
        bytes=res["bytes"], buckets=res["buckets"], largest_bucket_bytes=res["largest_bucket"],
        timing="median of --repeats rounds, the modes interleaved within each round, after a warm-up round",
        one_engine=mode("one_engine"),
        two_engines=mode("two_engines", ranks_receiving_stage_0=res["two_engines"]["received_by"],
                         ranks_packing_stage_0_from_own_replica=res["two_engines"]["packed_from_own_replica"]),
        two_over_one=two / one,
        broadcast=dict(seconds=res["broadcast_seconds"], bytes_per_s=res["bytes"] / res["broadcast_seconds"],
                       what="dist.broadcast of the same bytes in buckets of bucket_mb, rank 0 -> the second engine's rank"),
        two_engine_sync_over_broadcast_seconds=two / res["broadcast_seconds"],
        memcpy_bytes_per_s=res["memcpy_bytes_per_s"],
        copy_in=dict(alone_seconds=res["copy_in"]["alone"], both_seconds=res["copy_in"]["both"],
                     two_over_one=res["copy_in"]["both"] / res["copy_in"]["alone"],
                     what="each engine's parameters copied from a same-shaped copy, by rank 0 alone and by both engine "
                          "ranks at once: what two engines loading at once cost each other on this machine's shared memory bus"),
        ratio_to_memcpy=res["bytes"] / one / res["memcpy_bytes_per_s"],
    )
    if "two_engines_over_the_wire" in res:
        out["two_engines_over_the_wire"] = mode(
            "two_engines_over_the_wire", two_over_one=res["two_engines_over_the_wire"]["seconds"] / one,
            what="the same sync with SyncRoute(local_replicas=False): the second engine receives every bucket from "
            "rank 0 instead of packing its own replica's copy (the route a TP>1 layout takes)")
    return out


def main() -> int:
    ap = common.parser(__doc__, "weight_sync")
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument("--tp", type=int, default=3, help="SmolLM2 has 9 heads and 3 KV groups: 1 or 3")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=2, help="the second engine is on rank tp*pp*dp/2")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (medians reported), after one warm-up round")
    ap.add_argument("--trials", type=int, default=3, help="whole measurements, each in fresh ranks; the median is reported")
    args = ap.parse_args()
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    from grpo_mega.cli.prepare_model import prepared_dir

    world = args.tp * args.pp * args.dp
    if world < 2:
        raise SystemExit(f"--tp {args.tp} --pp {args.pp} --dp {args.dp}: two engines need at least 2 ranks")
    hf_dir = args.hf_dir or str(prepared_dir())
    trials = []
    for i in range(args.trials):
        trials.append(_trial(args, world, hf_dir))
        t = trials[-1]
        print(f"trial {i + 1}: 1 engine {t['one_engine']['seconds']:.3f} s, 2 engines {t['two_engines']['seconds']:.3f} s, "
              f"ratio {t['two_over_one']:.2f}; copy-in alone/both at once {t['copy_in']['two_over_one']:.2f}x; "
              f"load {t['machine']['loadavg_before'][0]:.1f}", flush=True)
    out = sorted(trials, key=lambda t: t["two_over_one"])[(len(trials) - 1) // 2]  # the median trial, in full
    out["trials"] = [dict(two_over_one=t["two_over_one"], one_engine_seconds=t["one_engine"]["seconds"],
                          two_engines_seconds=t["two_engines"]["seconds"], copy_in_two_over_one=t["copy_in"]["two_over_one"],
                          loadavg_before=t["machine"]["loadavg_before"]) for t in trials]
    out["timing"] += f"; the median of {len(trials)} trials (fresh ranks each) is reported in full, every trial under 'trials'"
    nbytes, bcast = out["bytes"], out["broadcast"]["seconds"]
    one, two, load_before = out["one_engine"]["seconds"], out["two_engines"]["seconds"], out["machine"]["loadavg_before"]
    common.write_json(args.out, out)
    gib = common.GIB
    print(f"sync {nbytes / 2**20:.1f} MiB: 1 engine {one:.3f} s ({nbytes / one / gib:.2f} GiB/s), "
          f"2 engines {two:.3f} s ({nbytes / two / gib:.2f} GiB/s), ratio {two / one:.2f}; plain broadcast "
          f"{bcast:.3f} s ({nbytes / bcast / gib:.2f} GiB/s); "
          f"copy-in alone/both at once {out['copy_in']['two_over_one']:.2f}x; "
          f"load {load_before[0]:.1f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
