"""Benchmark: the GRPO update with the full-vocabulary KL in the loss (`algo.kl_estimator=full`: the reference
runs in lockstep with the actor inside the schedule) against the update with Schulman's k3 (reference
logprobs computed beforehand, in a separate forward pass), at tp=2 on CPU.

Each estimator runs in its own process (its tp ranks forked from it). Per rank: the peak RSS of the update
above the RSS just before it (Linux VmHWM, reset through /proc/self/clear_refs; glibc told to mmap every
allocation above 64 KiB so that freed tensors leave the RSS at once), the update's time, and for k3 the time
of the reference-logprob pass that `full` does without. The size of one micro-batch's gathered [tokens, vocab]
fp32 logits is recorded next to the peaks: `full` must not hold one. Writes JSON.

    python -m bench.full_kl --out bench_results/full_kl.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench import common
from bench.step import synthetic_rollout


def _rank_body(estimator: str, args):
    import torch

    from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=args.tp, pp=1, seed=1)
        cfg = load_model_config("tiny")  # resized
        cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers = args.hidden, 2 * args.hidden, args.layers
        cfg.vocab_size = args.vocab
        parallel = ParallelConfig(tp=args.tp)
        precision = PrecisionConfig(params_dtype="fp32")
        batch_cfg = BatchConfig(train_batch_size=args.prompts, ppo_mini_batch_size=args.prompts,
                                micro_batch_size=1, max_prompt_length=args.prompt_len,
                                max_response_length=args.response_len, max_tokens_per_micro_batch=args.budget,
                                logprob_chunk_size=args.chunk)
        actor = Actor(cfg, parallel, precision, OptimConfig(lr=1e-6),
                      AlgoConfig(kl_estimator=estimator, kl_coef=0.01), batch_cfg)
        ref = Reference(cfg, parallel, precision, batch_cfg)
        ref.load_from(actor)
        batch = synthetic_rollout(cfg.vocab_size, args.prompts, 4, args.prompt_len, args.response_len)
        batch.old_logp = actor.logprobs(batch, 1.0)
        peaks, times, ref_times = [], [], []
        for _ in range(args.iters + 1):  # the first: warm-up (the optimizer's state appears)
            if estimator != "full":
                dt, _, batch.ref_logp = common.timed(lambda: ref.logprobs(batch, 1.0))
                ref_times.append(dt)
            torch.distributed.barrier()
            base = common.rss_mib()["VmRSS"]
            common.reset_peak_rss()
            dt, _, (m,) = common.timed(lambda: actor.update(batch, 1.0, reference=ref))
            times.append(dt)
            peaks.append(common.rss_mib()["VmHWM"] - base)
            assert m["skipped"] == 0.0, m
        destroy_distributed()
        return dict(peak_update_mib=max(peaks[1:]), update_s=min(times[1:]),
                    ref_logprobs_s=min(ref_times[1:]) if ref_times else 0.0, kl=m["kl"],
                    micro_batches=m["micro_batches"], computed_tokens=m["computed_tokens"])


def worker(args) -> None:
    """One estimator, in this fresh process: fork its tp ranks and print one JSON line."""
    from grpo_mega.parallel.forked import run_ranks

    res = run_ranks(_rank_body, args.tp, args.estimator, args, timeout=1800)
    worst = {k: max(r[k] for r in res) for k in ("peak_update_mib", "update_s", "ref_logprobs_s")}
    print(json.dumps(dict(estimator=args.estimator, tp=args.tp, **worst, kl=res[0]["kl"],
                          micro_batches=res[0]["micro_batches"], computed_tokens=res[0]["computed_tokens"])))


def main() -> int:
    ap = common.parser(__doc__, "full_kl")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000, help="real vocabulary (padded to a multiple of 128)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per mini-batch (4 responses each)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--budget", type=int, default=1024, help="tokens per packed micro-batch")
    ap.add_argument("--chunk", type=int, default=None, help="batch.logprob_chunk_size (default: none)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--estimator", default="k3", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    loadavg_before = os.getloadavg()
    rows = {}
    for estimator in ("k3", "full"):
        knobs = common.flags(args, "tp", "hidden", "layers", "vocab", "prompts", "prompt_len", "response_len",
                             "budget", "chunk", "iters")
        cmd = common.worker_cmd("bench.full_kl", "--worker", "--estimator", estimator, *knobs)
        rows[estimator] = common.run_worker(cmd, f"estimator {estimator}")
        r = rows[estimator]
        print(f"{estimator:>4}: update peak {r['peak_update_mib']:8.1f} MiB per rank, update {r['update_s']:.3f} s, "
              f"ref logprobs {r['ref_logprobs_s']:.3f} s", flush=True)
    k3, full = rows["k3"], rows["full"]
    padded_vocab = -(-args.vocab // 128) * 128
    result = dict(
        what="one GRPO mini-batch update (forward + backward + optimizer step), fp32, packed micro-batches; "
             "k3: reference logprobs from a separate forward pass before the update; full: the reference in "
             "lockstep inside the update",
        shapes=dict(tp=args.tp, hidden=args.hidden, layers=args.layers, vocab=args.vocab, padded_vocab=padded_vocab,
                    responses=args.prompts * 4, prompt_len=args.prompt_len, response_len=args.response_len,
                    tokens_per_micro_batch=args.budget, logprob_chunk_size=args.chunk),
        machine=common.machine(backend="gloo (CPU)"),
        loadavg=dict(before=loadavg_before, after=os.getloadavg()),
        memory="peak RSS during the update above the RSS just before it, per rank (max over ranks), MiB "
               "(VmHWM reset via /proc/self/clear_refs)",
        time="min over iterations, max over ranks, seconds",
        gathered_logits_mib=args.budget * padded_vocab * 4 / 2**20,
        sharded_logits_mib=args.budget * padded_vocab // args.tp * 4 / 2**20,
        results=[k3, full],
        full_vs_k3_peak=full["peak_update_mib"] / k3["peak_update_mib"],
        full_vs_k3_update_time=full["update_s"] / k3["update_s"],
        full_vs_k3_update_plus_ref_pass_time=full["update_s"] / (k3["update_s"] + k3["ref_logprobs_s"]),
    )
    common.write_json(args.out, result)
    print(f"full/k3: peak {result['full_vs_k3_peak']:.3f}x, update time {result['full_vs_k3_update_time']:.2f}x, "
          f"update time vs k3's update + reference pass {result['full_vs_k3_update_plus_ref_pass_time']:.2f}x; "
          f"one micro-batch's gathered [tokens, vocab] logits: {result['gathered_logits_mib']:.1f} MiB")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
