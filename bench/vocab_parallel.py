"""Benchmark: peak memory and time of per-token logprob + entropy + full KL, forward and backward.

Compares grpo_mega.parallel.vocab_parallel (vocab-sharded logits, two [k, T] all-reduces) with the
straightforward implementation: all-gather the logits to [T, V] and call torch.log_softmax. Each
configuration runs in its own process (its tp ranks forked from it), so peak resident memory is that
configuration's alone. Memory is measured per rank as the peak RSS above the RSS once the inputs exist
(Linux VmHWM, reset through /proc/self/clear_refs), with glibc told to mmap every allocation above 64 KiB
so that freed tensors leave the RSS at once. Writes JSON.

    python -m bench.vocab_parallel --out bench_results/vocab_parallel.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench import common


def _rank_body(impl: str, T: int, V: int, vocab_size: int, chunk: int | None, temperature: float, iters: int):
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dfn

    from grpo_mega.parallel.vocab_parallel import vocab_parallel_stats

    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    w = V // tp
    g = torch.Generator().manual_seed(rank)
    logits = (torch.randn(T, w, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    ref = (torch.randn(T, w, generator=g) * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab_size, (T,), generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(3, T, generator=torch.Generator().manual_seed(1))

    def ours():
        lp, ent, kl = vocab_parallel_stats(
            logits, target, group, ref_logits=ref, temperature=temperature, vocab_size=vocab_size, chunk_size=chunk
        )
        (upstream[0] * lp + upstream[1] * ent + upstream[2] * kl).sum().backward()

    def gathered():
        full = torch.cat(dfn.all_gather(logits, group=group), dim=1) if tp > 1 else logits
        ref_parts = [torch.empty_like(ref) for _ in range(tp)]
        if tp > 1:
            dist.all_gather(ref_parts, ref, group=group)
        full_ref = torch.cat(ref_parts, dim=1) if tp > 1 else ref
        logp = torch.log_softmax(full[:, :vocab_size].float() / temperature, dim=-1)
        logq = torch.log_softmax(full_ref[:, :vocab_size].float() / temperature, dim=-1)
        lp = logp.gather(1, target[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        (upstream[0] * lp + upstream[1] * ent + upstream[2] * kl).sum().backward()

    step = ours if impl == "vocab_parallel" else gathered
    input_mib = 2 * logits.numel() * logits.element_size() / 2**20
    step()  # warm-up (also allocates logits.grad, which stays: it is part of the peak)
    logits.grad = None
    dist.barrier()
    base = common.rss_mib()["VmRSS"]
    common.reset_peak_rss()
    times = []
    for _ in range(iters):
        logits.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = common.rss_mib()["VmHWM"] - base
    return dict(rank=rank, peak_above_inputs_mib=peak, input_mib=input_mib, seconds=min(times))


def worker(args) -> None:
    """One configuration, in this fresh process: fork its tp ranks and print one JSON line."""
    from grpo_mega.parallel.forked import run_ranks

    res = run_ranks(_rank_body, args.tp, args.impl, args.T, args.V, args.vocab_size, args.chunk, args.temperature,
                    args.iters, timeout=1800)
    worst = {k: max(r[k] for r in res) for k in ("peak_above_inputs_mib", "seconds")}
    print(json.dumps(dict(impl=args.impl, tp=args.tp, chunk=args.chunk, input_mib_per_rank=res[0]["input_mib"],
                          **worst)))


CONFIGS = [(impl, tp, chunk) for tp in (1, 2, 4)
           for impl, chunk in (("gathered", None), ("vocab_parallel", None), ("vocab_parallel", 64))]


def main() -> int:
    ap = common.parser(__doc__, "vocab_parallel")
    ap.add_argument("--T", type=int, default=512, help="tokens")
    ap.add_argument("--V", type=int, default=128256, help="padded vocabulary (columns of the logits)")
    ap.add_argument("--vocab-size", type=int, default=128200, help="real vocabulary (the rest is padding)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--tp-sizes", default="1,2,4", help="the TP sizes to measure, comma-separated")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="vocab_parallel", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    rows, tp_sizes = [], {int(t) for t in args.tp_sizes.split(",")}
    for impl, tp, chunk in [c for c in CONFIGS if c[1] in tp_sizes]:
        cmd = common.worker_cmd("bench.vocab_parallel", "--worker", "--impl", impl, "--tp", str(tp),
                                *(["--chunk", str(chunk)] if chunk else []),
                                *common.flags(args, "T", "V", "vocab_size", "temperature", "iters"))
        row = common.run_worker(cmd, f"configuration {impl} tp={tp} chunk={chunk}")
        rows.append(row)
        print(f"{impl:>15} tp={tp} chunk={str(chunk):>4}: peak above inputs {row['peak_above_inputs_mib']:8.1f} MiB"
              f" per rank, {row['seconds'] * 1e3:8.1f} ms", flush=True)
    baseline = {r["tp"]: r for r in rows if r["impl"] == "gathered"}
    for r in rows:
        b = baseline[r["tp"]]
        # toy sizes can stay below the page granularity of RSS: no ratio then
        base = b["peak_above_inputs_mib"]
        r["memory_vs_gathered"] = r["peak_above_inputs_mib"] / base if base > 0 else None
        r["time_vs_gathered"] = r["seconds"] / b["seconds"]
    result = dict(
        what="per-token logprob + entropy + full KL(p||q), forward + backward, bf16 logits, fp32 math",
        shapes=dict(tokens=args.T, padded_vocab=args.V, vocab_size=args.vocab_size, temperature=args.temperature),
        machine=common.machine(backend="gloo (CPU)"),
        memory="peak RSS above the RSS with inputs present, per rank (max over ranks), MiB",
        time="min over iterations of one forward+backward, max over ranks, seconds",
        results=rows,
    )
    common.write_json(args.out, result)
    for r in rows:
        if r["impl"] == "vocab_parallel":
            mem = "n/a" if r["memory_vs_gathered"] is None else f"{r['memory_vs_gathered']:.3f}x"
            print(f"tp={r['tp']} chunk={r['chunk']}: memory {mem}, time {r['time_vs_gathered']:.2f}x of gathered")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
