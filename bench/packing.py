"""Benchmark: packed against padded micro-batches for the three passes of a GRPO step over the same rollouts
(old logprobs, reference logprobs, the update), on a long-tailed response-length distribution like reasoning
RL's. Writes JSON.

    python -m bench.packing [--responses 64] [--median 128] [--max-response 1024] [--layers 2]
                            [--out bench_results/packing.json]

Lengths: responses lognormal with the given median, sigma chosen so that `--cut` (10%) of them reach
max_response_length (and are cut there, as a rollout engine cuts them); prompts uniform in
[--prompt-min, --prompt-max]. Model: qwen2.5-0.5b's shape (hidden 896, 14 heads / 2 KV groups, FFN 4864,
tied embeddings) with `--layers` layers (default 1) and a `--vocab`-token vocabulary (default 8192, so that
the LM head does not take most of a CPU run; packing saves the same share of both), random weights, fp32,
one CPU process.
Padded: micro_batch_size rows, each micro-batch as long as its longest row; packed: the default token budget
micro_batch_size * (max_prompt + max_response), so both bound activation memory alike. The two runs start from
the same weights; their gradients are the same (tests/trainer/test_packing.py), only the time differs.
"""

from __future__ import annotations

import math
import os
from functools import partial

from bench import common


def lengths(args) -> tuple[list[int], list[int]]:
    import torch

    g = torch.Generator().manual_seed(args.seed)
    # P(L > max) = cut for L = median * exp(sigma * z):  sigma = ln(max / median) / z_(1 - cut)
    z = math.sqrt(2) * torch.erfinv(torch.tensor(1 - 2 * args.cut)).item()
    sigma = math.log(args.max_response / args.median) / z
    raw = args.median * torch.exp(sigma * torch.randn(args.responses, generator=g))
    responses = raw.round().clamp(1, args.max_response).long().tolist()
    n = args.group
    prompts = torch.randint(args.prompt_min, args.prompt_max + 1, (args.responses // n,), generator=g)
    return prompts.repeat_interleave(n).tolist(), responses


def rollout(prompt_lens, response_lens, vocab, seed):
    import torch

    from grpo_mega.trainer.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompts.append(torch.randint(0, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(0, vocab, (r,), generator=g).tolist())
    batch = RolloutBatch.from_samples(prompts, responses)
    batch.advantages = torch.randn(len(prompts), generator=g)
    return batch


def run(args) -> dict:
    import torch

    from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.train import single_process_env
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference

    torch.set_num_threads(args.threads)
    single_process_env()
    model = load_model_config("qwen2.5-0.5b")
    model.num_layers, model.vocab_size = args.layers, args.vocab
    prompt_lens, response_lens = lengths(args)
    out = dict(
        machine=common.machine(threads=args.threads),
        model=dict(shape="qwen2.5-0.5b", num_layers=model.num_layers, vocab_size=model.vocab_size,
                   hidden_size=model.hidden_size, dtype="fp32"),
        lengths=dict(responses=args.responses, median=args.median, max_response=args.max_response, cut=args.cut,
                     prompt_range=[args.prompt_min, args.prompt_max],
                     mean_response=sum(response_lens) / len(response_lens),
                     at_max=sum(r == args.max_response for r in response_lens)),
        micro_batch_size=args.micro_batch_size,
        token_budget=args.micro_batch_size * (args.prompt_max + args.max_response),
        loadavg_before=os.getloadavg(),
    )
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=args.seed)
        state = None
        for name, packing in (("padded", False), ("packed", True)):
            batch_cfg = BatchConfig(train_batch_size=args.responses // args.group,
                                    ppo_mini_batch_size=args.responses // args.group,
                                    micro_batch_size=args.micro_batch_size, max_prompt_length=args.prompt_max,
                                    max_response_length=args.max_response, packing=packing)
            precision = PrecisionConfig(params_dtype="fp32")
            actor = Actor(model, ParallelConfig(), precision, OptimConfig(lr=1e-6), AlgoConfig(kl_coef=0.001), batch_cfg)
            ref = Reference(model, ParallelConfig(), precision, batch_cfg)
            if state is None:
                state = {k: v.clone() for k, v in actor.built.gpt.state_dict().items() if torch.is_tensor(v)}
            actor.built.gpt.load_state_dict(state, strict=False)
            actor.optimizer.reload_model_params()
            ref.built.gpt.load_state_dict(state, strict=False)
            batch = rollout(prompt_lens, response_lens, model.vocab_size, args.seed)
            t = {}
            t["old_logprobs"], _, batch.old_logp = common.timed(partial(actor.logprobs, batch, 1.0))
            t["ref_logprobs"], _, batch.ref_logp = common.timed(partial(ref.logprobs, batch, 1.0))
            t["update"], _, (m,) = common.timed(partial(actor.update, batch, 1.0))
            t["total"] = sum(t.values())
            out[name] = dict(seconds=t, computed_tokens=m["computed_tokens"], useful_tokens=m["useful_tokens"],
                             pad_fraction=1 - m["useful_tokens"] / m["computed_tokens"],
                             micro_batches=m["micro_batches"], loss=m["loss"], grad_norm=m["grad_norm"])
            print(f"{name}: {t['total']:.1f} s ({m['micro_batches']} micro-batches, "
                  f"pad fraction {out[name]['pad_fraction']:.3f})", flush=True)
            del actor, ref
        destroy_distributed()
    from grpo_mega.trainer.batch import plan_packing

    seq = [p + r for p, r in zip(prompt_lens, response_lens)]
    # With PP every row of a rank is padded to its longest (one p2p shape): the plan's padding, not timed
    out["pad_fraction_with_pp_rows_equal"] = {
        f"dp{dp}": plan_packing(seq, dp, out["token_budget"], same_length=True).pad_fraction for dp in (1, 2, 4)}
    out["speedup"] = out["padded"]["seconds"]["total"] / out["packed"]["seconds"]["total"]
    out["speedup_per_pass"] = {k: out["padded"]["seconds"][k] / out["packed"]["seconds"][k]
                               for k in ("old_logprobs", "ref_logprobs", "update")}
    out["loadavg_after"] = os.getloadavg()
    out["targets"] = dict(speedup_at_least=1.8, packed_pad_fraction_at_most=0.10,
                          met=out["speedup"] >= 1.8 and out["packed"]["pad_fraction"] <= 0.10)
    return out


def main(argv=None) -> dict:
    p = common.parser(__doc__, "packing")
    p.add_argument("--responses", type=int, default=64)
    p.add_argument("--group", type=int, default=8, help="responses per prompt")
    p.add_argument("--median", type=float, default=128)
    p.add_argument("--max-response", type=int, default=1024)
    p.add_argument("--cut", type=float, default=0.10, help="fraction of responses cut at --max-response")
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=8192,
                   help="qwen2.5-0.5b has 151936; on a CPU its LM head would take most of the time (the ratio is set by the tokens)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = run(args)
    common.write_json(args.out, result)
    print(f"speedup {result['speedup']:.2f}x, packed pad fraction {result['packed']['pad_fraction']:.3f} -> {args.out}")
    return result


if __name__ == "__main__":
    main()
