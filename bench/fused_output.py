"""Benchmark: the loss side's peak memory and time, fused output layer (grpo_mega/parallel/fused_output.py) against
the output layer's logits followed by the vocab-parallel op; and the SmolLM2-135M CPU update with each. Writes JSON.

    python -m bench.fused_output [--tokens 4096] [--loss-steps 1] [--steps 5] [--out PATH]

Loss side (one process, TP1, fp32 on the CPU, SmolLM2-135M's shapes: padded vocabulary 49152, hidden 576): hidden
states [T, h] and the output weight [V, h] (and, with the full KL, the reference's), forward and backward of
logprob + entropy + KL with fixed upstream weights. Unfused is what the trainer runs with batch.fused_output=false:
logits = hidden @ W^T (ColumnParallelLinear's GEMM), vocab_parallel_stats with the reference logits donated, the
GEMM's backward (the weight gradient allocated as .grad, which megatron DDP's hook then adds into main_grad).
Fused: fused_output_stats, its weight gradient added into a main_grad that exists beforehand (as under DDP).
Memory: the peak of the sum of torch's CPU allocations and frees recorded by torch.profiler (profile_memory=True)
during one forward + backward, above what existed before it (the inputs, the weights, main_grad): the allocator's
own account, not the process's RSS. Each configuration's peak is also given in units of one fp32 [chunk, V]
tensor (chunk = T unfused).

Update: bench/step.py's SmolLM2-135M CPU update (2 prompts x 4 responses of 32 + 32 tokens, one mini-batch,
fp32, random weights) with batch.fused_output off and on, alternating step by step in this one process; the
median of --steps timed steps after one warm-up each.

Time is given twice: wall seconds, and the CPU seconds of this process. On a shared, loaded machine (the load
average is recorded) wall time measures the other processes as much as this one; with --threads 1 (the default)
the process's CPU time is the work done, whatever else runs.
"""

from __future__ import annotations

import os
import statistics
import sys

from bench import common as bench_common

MODEL = "smollm2-135m"  # the default --model


def profiled_peak(fn) -> int:
    """Peak bytes above the start of torch's CPU allocations during fn(), from torch.profiler's memory events."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak


def loss_side(model: str, tokens: int, steps: int) -> list[dict]:
    """Peak and time of the loss side's forward + backward, per configuration."""
    import torch

    from grpo_mega.conf import load_model_config
    from grpo_mega.parallel.fused_output import auto_chunk_size, fused_output_stats
    from grpo_mega.parallel.vocab_parallel import vocab_parallel_stats

    cfg = load_model_config(model)
    v, h = cfg.padded_vocab_size, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(tokens, h, generator=g)
    ref_hidden = torch.randn(tokens, h, generator=g)
    weight = torch.nn.Parameter(torch.randn(v, h, generator=g) * 0.05)
    ref_weight = (weight.detach() + 0.01 * torch.randn(v, h, generator=g))
    weight.main_grad = torch.zeros(v, h)
    target = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    up = torch.randn(3, tokens, generator=g)
    auto = auto_chunk_size(v)

    def run(impl: str, chunk, with_ref: bool):
        hidden = hidden0.clone().requires_grad_(True)

        def step():
            if impl == "unfused":
                logits = torch.matmul(hidden, weight.t())
                ref_logits = torch.matmul(ref_hidden, ref_weight.t()) if with_ref else None
                lp, ent, kl = vocab_parallel_stats(logits, target, ref_logits=ref_logits, vocab_size=cfg.vocab_size,
                                                   chunk_size=chunk, donate_ref_logits=with_ref)
                del logits, ref_logits
            else:
                lp, ent, kl = fused_output_stats(hidden, weight, target, ref_hidden=ref_hidden if with_ref else None,
                                                 ref_weight=ref_weight if with_ref else None,
                                                 vocab_size=cfg.vocab_size, chunk_size=chunk)
            loss = (up[0] * lp + up[1] * ent + (up[2] * kl if with_ref else 0)).sum()
            loss.backward()
            hidden.grad = None
            weight.grad = None

        step()  # warm-up
        peak = profiled_peak(step)
        wall, cpu = zip(*[bench_common.timed(step)[:2] for _ in range(steps)])
        unit = 4 * (tokens if impl == "unfused" else chunk) * v
        return dict(impl=impl, full_kl=with_ref, chunk=chunk if impl == "fused" else None, tokens=tokens,
                    peak_mib=peak / 2**20, peak_in_fp32_chunk_vocab=peak / unit,
                    fp32_chunk_vocab_mib=unit / 2**20, seconds=statistics.median(wall),
                    cpu_seconds=statistics.median(cpu))

    rows = []
    for with_ref in (False, True):
        for impl, chunk in (("unfused", None), ("fused", auto), ("fused", 256)):
            row = run(impl, chunk, with_ref)
            rows.append(row)
            print(f"{impl:>8} full_kl={with_ref!s:>5} chunk={str(row['chunk']):>5}: peak {row['peak_mib']:8.1f} MiB "
                  f"({row['peak_in_fp32_chunk_vocab']:.2f} x fp32 [chunk, V]), {row['seconds']:.2f} s wall, "
                  f"{row['cpu_seconds']:.2f} s CPU", flush=True)
    o_tokens = dict(hidden_grad_mib=4 * tokens * h / 2**20, per_token_stats_mib=4 * tokens * 13 / 2**20)
    return rows, dict(padded_vocab=v, hidden=h, vocab_size=cfg.vocab_size, auto_chunk=auto, o_tokens=o_tokens)


def update_times(model: str, steps: int) -> dict:
    """bench_step's SmolLM2-135M CPU update, fused off and on, alternating in this process."""
    import dataclasses

    import torch

    from bench import step as bench_step
    from grpo_mega.conf import ParallelConfig, load_model_config
    from grpo_mega.parallel.state import init_distributed
    from grpo_mega.train import single_process_env
    from grpo_mega.trainer.actor import Actor

    single_process_env()
    init_distributed(tp=1, pp=1, seed=1234)
    cfg = load_model_config(model)
    groups, n, prompt_len, response_len = 2, 4, 32, 32
    c = bench_step._configs(groups, n, response_len, micro=groups * n, dtype="fp32")
    actor = Actor(cfg, ParallelConfig(), **c)  # one actor, the switch flipped between steps
    batches = {fused: dataclasses.replace(c["batch"], fused_output=fused) for fused in (False, True)}
    rb = bench_step.synthetic_rollout(cfg.vocab_size, groups, n, prompt_len, response_len)
    rb = bench_step._with_logprob_inputs(actor, rb, 1.0)
    logp = {}
    for fused in (False, True):  # the same weights: the same logprobs either way
        actor.batch = batches[fused]
        logp[fused] = actor.logprobs(rb, 1.0)
    wall, cpu = {False: [], True: []}, {False: [], True: []}
    for i in range(steps + 1):  # alternating, so load from other processes falls on both alike
        for fused in (False, True):
            actor.batch = batches[fused]
            w, c, _ = bench_common.timed(lambda: actor.update(rb, 1.0))
            if i:  # the first of each is a warm-up
                wall[fused].append(w)
                cpu[fused].append(c)
    tokens = int((rb.prompt_lens + rb.response_lens).sum())
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return dict(model=model, tokens_per_step=tokens, loss_positions=int(rb.loss_mask().sum()),
                threads=torch.get_num_threads(), unfused_seconds=wall[False], fused_seconds=wall[True],
                unfused_cpu_seconds=cpu[False], fused_cpu_seconds=cpu[True],
                unfused_median_s=med[False], fused_median_s=med[True], fused_over_unfused=med[True] / med[False],
                unfused_median_cpu_s=med_cpu[False], fused_median_cpu_s=med_cpu[True],
                fused_over_unfused_cpu=med_cpu[True] / med_cpu[False],
                logprob_max_abs_diff=float((logp[True] - logp[False]).abs().max()))


def main() -> int:
    ap = bench_common.parser(__doc__, "fused_output")
    ap.add_argument("--model", default=MODEL, help="model_configs name (its shapes and its update)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens through the loss side")
    ap.add_argument("--loss-steps", type=int, default=1, help="timed loss-side repetitions (the median is reported)")
    ap.add_argument("--steps", type=int, default=5, help="timed update steps of each (the median is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from grpo_mega.parallel import cpu_compat

    cpu_compat.apply()
    load_start = os.getloadavg()
    rows, shapes = loss_side(args.model, args.tokens, args.loss_steps)
    with cpu_compat.cpu_device_mode():
        update = update_times(args.model, args.steps)
    print(f"update: unfused {update['unfused_median_s']:.3f} s, fused {update['fused_median_s']:.3f} s wall "
          f"({update['fused_over_unfused']:.3f}x); CPU {update['unfused_median_cpu_s']:.3f} s vs "
          f"{update['fused_median_cpu_s']:.3f} s ({update['fused_over_unfused_cpu']:.3f}x)")
    result = dict(
        what="loss side (output layer + logprob/entropy/KL, forward + backward) peak memory and time, fused vs "
             "unfused; and the SmolLM2-135M CPU update with each",
        model=args.model, shapes=shapes,
        machine=bench_common.machine(backend="none (one process)", loadavg_start=load_start,
                                     loadavg_end=os.getloadavg()),
        memory="peak of torch's CPU allocations minus frees during one forward + backward, above the start "
               "(torch.profiler memory events), MiB; also in units of one fp32 [chunk, V] (chunk = tokens unfused)",
        time="median over --loss-steps (loss side) or --steps (update) repetitions after a warm-up: wall seconds "
             "(seconds, *_median_s) and this process's CPU seconds (cpu_seconds, *_cpu_s); a shared, loaded "
             "machine (load averages above): with one thread the CPU seconds are the work done",
        threads=args.threads,
        loss_side=rows, update=update,
    )
    bench_common.write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
