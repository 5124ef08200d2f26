"""Benchmark: handing a step's samples from rank 0 to the trainer ranks, every sample to every rank (the
broadcast every rank used to get) against rollout routing (each DP replica only the rows it runs:
grpo_mega.rollout.routing). Writes JSON (default bench_results/routing.json).

    python -m bench.routing [--world 4] [--prompts 64] [--n 8] [--max-response 1024] [--mini-prompts 16]

`--world` forked gloo ranks at TP1 (so DP = world: the case where each rank needs least). A synthetic step of
`--prompts` x `--n` samples with response lengths uniform in [1, --max-response] and engine logprobs, on
rank 0; the plan is the trainer's (packing, mini-batches of `--mini-prompts` prompts). Timed alternately
`--repeats` times from a barrier to the last rank holding its samples (median reported), with the bytes each
rank receives (pickled). The machine's load average goes into the JSON.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import time

from bench import common


def _rank(prompts: int, n: int, max_response: int, mini_prompts: int, repeats: int):
    import random

    import torch.distributed as dist

    from grpo_mega.conf import BatchConfig, ParallelConfig
    from grpo_mega.parallel import comm, cpu_compat
    from grpo_mega.parallel.state import init_distributed
    from grpo_mega.engines.interface import Generation
    from grpo_mega.rollout.routing import Routing
    from grpo_mega.trainer.dp_layout import dp_rows

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1)
        rank, world = dist.get_rank(), dist.get_world_size()
        batch = BatchConfig(train_batch_size=prompts, ppo_mini_batch_size=mini_prompts, micro_batch_size=4,
                            max_prompt_length=256, max_response_length=max_response)
        routing = Routing(lambda lens: dp_rows(lens, ParallelConfig(), batch, world))
        rng = random.Random(0)
        prompt_lens = [rng.randint(32, 256) for _ in range(prompts) for _ in range(n)]
        gen = None
        if rank == 0:
            lens = [rng.randint(1, max_response) for _ in prompt_lens]
            gen = Generation(token_ids=[[rng.randrange(32000) for _ in range(k)] for k in lens],
                             logprobs=[[-rng.random() for _ in range(k)] for k in lens],
                             finish_reasons=["stop"] * len(lens), weight_version=1)
        times = {"broadcast": [], "routed": []}
        received = {}
        for rep in range(repeats + 1):
            for label in times:
                dist.barrier()
                t0 = time.perf_counter()
                got = comm.broadcast_object(gen) if label == "broadcast" else routing.share(gen, prompt_lens)
                dist.barrier()
                if rep:
                    times[label].append(time.perf_counter() - t0)
                if rep == 0 and rank:
                    held = got.extra.get("held", range(len(got.token_ids)))
                    received[label] = (len(held), len(pickle.dumps({i: (got.token_ids[i], got.logprobs[i]) for i in held})))
        everyone = comm.all_gather_objects(received)
        if rank:
            return None
        return dict(times={k: statistics.median(v) for k, v in times.items()}, all_times=times,
                    received=everyone[1:], samples=len(prompt_lens),
                    tokens=sum(len(t) for t in gen.token_ids))


def main() -> int:
    ap = common.parser(__doc__, "routing")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-response", type=int, default=1024)
    ap.add_argument("--mini-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import warnings

    warnings.simplefilter("ignore", FutureWarning)
    from grpo_mega.parallel.forked import run_ranks

    load_before = os.getloadavg()
    res = run_ranks(_rank, args.world, args.prompts, args.n, args.max_response, args.mini_prompts, args.repeats,
                    timeout=1800)[0]
    b, r = res["times"]["broadcast"], res["times"]["routed"]
    rows_routed = [x["routed"][0] for x in res["received"]]
    bytes_b = sum(x["broadcast"][1] for x in res["received"])
    bytes_r = sum(x["routed"][1] for x in res["received"])
    out = dict(
        what="a step's samples from rank 0 to every trainer rank: broadcast of all samples vs rollout routing "
             "(each DP replica the rows it runs), TP1 so DP = world",
        machine=common.machine(backend="gloo (CPU)", loadavg_before=load_before, loadavg_after=os.getloadavg()),
        world=args.world, samples=res["samples"], response_tokens=res["tokens"], mini_batch_prompts=args.mini_prompts,
        broadcast=dict(seconds=b, all_seconds=res["all_times"]["broadcast"], bytes_to_other_ranks=bytes_b),
        routed=dict(seconds=r, all_seconds=res["all_times"]["routed"], bytes_to_other_ranks=bytes_r,
                    rows_per_other_rank=rows_routed),
        routed_over_broadcast_seconds=r / b, routed_over_broadcast_bytes=bytes_r / bytes_b,
        timing="median of --repeats rounds, both ways alternately, from a barrier to a barrier after the last rank "
               "holds its samples; bytes: the pickled responses and logprobs each non-zero rank ends up holding",
    )
    common.write_json(args.out, out)
    print(f"{res['samples']} samples ({res['tokens']} response tokens) to {args.world} ranks: broadcast {b:.3f} s, "
          f"routed {r:.3f} s ({r / b:.2f}x); bytes to the other ranks {bytes_r / bytes_b:.2f}x; rows per rank "
          f"{rows_routed} of {res['samples']}; load {load_before[0]:.1f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
