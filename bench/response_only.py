"""Benchmark: the response-only output layer (batch.response_only_logits) against every position. Writes JSON.

    python -m bench.response_only [--model smollm2-135m] [--groups 2] [--n 4] [--prompt-len 64]
        [--response-len 64] [--steps 3] [--warmup 1] [--threads 2] [--out bench_results/response_only.json]

With batch.fused_output=false: the fused output layer (the default) never makes the logits whole, so this
measures the switch where it changes memory. One process, TP1, fp32, random weights, packed rows (`--micro-batch` sequences per row). One actor; its
update (grpo_mega.trainer.actor.Actor.update on one mini-batch: forward, the GRPO loss with the k3 KL and an
entropy bonus, backward, optimizer step) and its logprob pass (Actor.logprobs) are timed with the switch off
and on, alternated step by step so that load from other processes falls on both alike; the median of
--steps after --warmup, in wall seconds and in this process's CPU seconds (time.process_time: less
sensitive to other processes on a loaded machine than wall time). Logits memory: the bytes of the [tokens, V/tp] logits the output layer returns (a
forward hook on it), the largest one micro-batch makes and the sum over a step. lr = 0 keeps the weights where
they are, so every update's loss with either setting must agree (recorded: the largest difference). The machine's load averages are recorded before
and after: on a shared machine the times are indicative. `head_only`: the output layer's matmul and the op
alone (forward and backward) on all tokens against the loss positions, the part the switch changes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics

from bench import common
from bench.step import _with_logprob_inputs, synthetic_rollout


def run(model: str, groups: int, n: int, prompt_len: int, response_len: int, micro: int, steps: int,
        warmup: int) -> dict:
    from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
    from grpo_mega.parallel.state import init_distributed
    from grpo_mega.trainer.actor import Actor

    init_distributed(tp=1, pp=1, seed=1234)
    cfg = load_model_config(model)
    batch = BatchConfig(train_batch_size=groups, ppo_mini_batch_size=groups, micro_batch_size=micro,
                        max_prompt_length=prompt_len, max_response_length=response_len,
                        fused_output=False)  # the switch's effect on the output layer's whole logits
    actor = Actor(cfg, ParallelConfig(), precision=PrecisionConfig(params_dtype="fp32"),
                  optim=OptimConfig(lr=0.0, weight_decay=0.0, clip_grad=1.0),  # weights stay put
                  algo_cfg=AlgoConfig(kl_coef=0.01, kl_estimator="k3", entropy_coef=0.01, loss_agg_mode="token-mean"),
                  batch=batch)
    logits_bytes: list[int] = []
    actor.built.gpt.output_layer.register_forward_hook(
        lambda m, args, out: logits_bytes.append(out[0].numel() * out[0].element_size()))
    rb = _with_logprob_inputs(actor, synthetic_rollout(cfg.vocab_size, groups, n, prompt_len, response_len), 1.0)

    def step(on: bool, update: bool):  # the switch set, then the update or the logprob pass and its logits' bytes
        actor.batch = dataclasses.replace(batch, response_only_logits=on)
        logits_bytes.clear()
        return (actor.update(rb, 1.0)[0] if update else actor.logprobs(rb, 1.0)), list(logits_bytes)

    runs = common.alternate({(on, p): functools.partial(step, on, p == "update") for on in (False, True)
                             for p in ("update", "logprob")}, warmup + steps)
    tokens = int((rb.prompt_lens + rb.response_lens).sum())
    out = dict(head_only=_head_only(actor, tokens, int(rb.loss_mask().sum()), cfg.vocab_size, steps))
    for on in (False, True):
        r = out["response_only" if on else "all_positions"] = dict(
            update_loss=[m["loss"] for _, _, (m, _) in runs[on, "update"]])
        for p in ("update", "logprob"):
            r[f"{p}_s"], r[f"{p}_cpu_s"] = ([t[i] for t in runs[on, p][warmup:]] for i in (0, 1))
            r[f"{p}_median_s"], r[f"{p}_cpu_median_s"] = (statistics.median(r[f"{p}{k}"]) for k in ("_s", "_cpu_s"))
        ub, lb = runs[on, "update"][0][2][1], runs[on, "logprob"][0][2][1]
        r.update(logits_bytes_per_micro_batch_max=max(ub), logits_bytes_per_update=sum(ub),
                 logits_bytes_per_logprob_pass=sum(lb), micro_batches=len(ub))
    a, b = out["all_positions"], out["response_only"]
    return dict(
        model=model, params=sum(p.numel() for p in actor.built.gpt.parameters()), vocab=cfg.vocab_size,
        responses=rb.size, prompt_len=prompt_len, response_len=response_len, tokens_per_step=tokens,
        loss_positions=int(rb.loss_mask().sum()), **out,
        update_speedup=a["update_median_s"] / b["update_median_s"],
        logprob_speedup=a["logprob_median_s"] / b["logprob_median_s"],
        update_cpu_speedup=a["update_cpu_median_s"] / b["update_cpu_median_s"],
        logprob_cpu_speedup=a["logprob_cpu_median_s"] / b["logprob_cpu_median_s"],
        logits_bytes_ratio=b["logits_bytes_per_micro_batch_max"] / a["logits_bytes_per_micro_batch_max"],
        update_loss_max_abs_diff=max(abs(x - y) for x, y in zip(a["update_loss"], b["update_loss"])),
    )


def _head_only(actor, tokens: int, positions: int, vocab: int, repeats: int) -> dict:
    """The part the switch changes, alone: the output layer's matmul and the logprob/entropy op, forward and
    backward, on `tokens` random hidden states against `positions` of them (median CPU seconds)."""
    import torch

    from grpo_mega.parallel.vocab_parallel import vocab_parallel_stats

    weight = actor.built.gpt.output_layer.weight if actor.built.gpt.output_layer.weight is not None else \
        actor.built.gpt.shared_embedding_or_output_weight()
    w = weight.detach().clone().requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, t in (("all_positions", tokens), ("response_only", positions)):
        h = torch.randn(t, w.shape[1], generator=g).requires_grad_(True)
        target = torch.randint(0, vocab, (t,), generator=g)

        def step():
            logp, entropy, _ = vocab_parallel_stats(h @ w.t(), target, vocab_size=vocab)
            (logp.sum() + 0.01 * entropy.sum()).backward()

        cpu = [common.timed(step)[1] for _ in range(repeats + 1)]
        out[name] = dict(tokens=t, cpu_median_s=statistics.median(cpu[1:]))
    out["cpu_speedup"] = out["all_positions"]["cpu_median_s"] / out["response_only"]["cpu_median_s"]
    return out


def main() -> int:
    ap = common.parser(__doc__, "response_only")
    ap.add_argument("--model", default="smollm2-135m", help="a model_configs name")
    ap.add_argument("--groups", type=int, default=2, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per packed row")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting (the median is reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = ap.parse_args()

    import torch

    from grpo_mega.parallel import cpu_compat
    from grpo_mega.train import single_process_env

    torch.set_num_threads(args.threads)
    single_process_env()
    load_before = os.getloadavg()
    with cpu_compat.cpu_device_mode():
        result = run(args.model, args.groups, args.n, args.prompt_len, args.response_len, args.micro_batch,
                     args.steps, args.warmup)
    data = dict(
        benchmark="response_only_logits", settings=vars(args), result=result,
        machine=common.machine(threads=args.threads, loadavg_before=load_before, loadavg_after=os.getloadavg()),
        note="times on a shared, loaded machine: indicative; the logits bytes are exact",
    )
    path = common.write_json(args.out, data)
    r = result
    print(f"{r['model']}: update {r['all_positions']['update_median_s']:.2f} s -> {r['response_only']['update_median_s']:.2f} s "
          f"({r['update_speedup']:.2f}x; CPU time {r['update_cpu_speedup']:.2f}x), logprob pass {r['logprob_speedup']:.2f}x, logits per micro-batch "
          f"{r['all_positions']['logits_bytes_per_micro_batch_max'] / 2**20:.0f} -> "
          f"{r['response_only']['logits_bytes_per_micro_batch_max'] / 2**20:.0f} MiB, output layer and op alone "
          f"{r['head_only']['cpu_speedup']:.2f}x (CPU time); wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
