"""Benchmark: scoring a step's rewards. Writes JSON (default bench_results/rewards.json).

    python -m bench.rewards [--math-samples 256] [--rm-samples 64] [--out bench_results/rewards.json]

1. Rule rewards in the pool: `--math-samples` math-verify samples (LaTeX answers in a form other than the
   ground truth's, so that verify does real symbolic work; half right) scored by a RewardPool with 1 worker and
   with 2 workers, workers started before the clock, timed alternately `--repeats` times (the best of each is
   kept: other work on the cores comes and goes); the ratio is the speed-up. Each worker's start-up cost is
   recorded per start method (forkserver, spawn, fork).
2. The learned reward model: `--rm-samples` prompt+response texts scored by RewardModel in batches vs
   transformers' one-at-a-time forward, fp32 on the CPU, torch on 1 thread both ways, the largest absolute
   score difference recorded; at two sizes: the CPU experiment's small model on short texts, and a wider model
   on 40-160 tokens (compute-bound on one CPU thread: batching has little to win there).
The machine's load average before and after goes into the JSON: other work on the cores slows the 2-worker
run most, so a busy machine understates the speed-up.
"""

from __future__ import annotations

import json
import os
import platform
import random
import tempfile

from bench import common


def math_samples(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(responses, ground truths): sums of surds and fractions, answered over a common denominator."""
    rng = random.Random(seed)
    responses, truths = [], []
    for i in range(n):
        a, b, c = rng.randint(1, 9), rng.choice([2, 3, 5, 6, 7, 10]), rng.randint(2, 9)
        d, e = rng.randint(1, 9), rng.randint(2, 9)
        kind = i % 3
        if kind == 0:
            gold = f"\\frac{{{a}\\sqrt{{{b}}}}}{{{c}}} + \\frac{{{d}}}{{{e}}}"
            num = f"{a * e}\\sqrt{{{b}}} + {d * c + (i % 2)}"
            ans = f"\\frac{{{num}}}{{{c * e}}}"
        elif kind == 1:
            gold = f"{a}x^2 + {a * (d + e)}x + {a * d * e}"
            ans = f"{a}(x + {d})(x + {e + (i % 2)})"
        else:
            gold = f"\\left({d}, {d + e}\\right]"
            ans = f"({d}, {d + e}]" if i % 2 == 0 else f"[{d}, {d + e}]"
        responses.append(f"Step 1: simplify. Step 2: collect the terms. Therefore the answer is $\\boxed{{{ans}}}$.")
        truths.append(gold)
    return responses, truths


def _cpu_seconds(pids) -> float:
    import psutil

    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def bench_pool(n: int, repeats: int) -> dict:
    from grpo_mega.rewards import build_reward
    from grpo_mega.rewards.scoring import RewardPool

    responses, truths = math_samples(n)
    rows = [{"data_source": "bench"}] * n
    out: dict = {"samples": n}
    fn = build_reward("math")
    out["in_process_seconds"], _, want = common.timed(lambda: [fn(r, t, s) for r, t, s in zip(responses, truths, rows)])
    out["right_fraction"] = sum(want) / n
    pools = {w: RewardPool("math", num_workers=w, timeout_s=60) for w in (1, 2)}
    try:
        for pool in pools.values():
            pool.start()
            pool.score(responses[:4], truths[:4], rows[:4])  # warm each worker's caches a little
        for _ in range(repeats):  # interleaved, best of `repeats`: other load on the cores comes and goes
            for workers, pool in pools.items():
                cpu0 = _cpu_seconds(pool.pids())
                seconds, _, got = common.timed(lambda: pool.score(responses, truths, rows))
                # the workers' CPU time over the wall time: how many cores the machine actually gave them
                out.setdefault(f"workers_{workers}_cores_used", []).append((_cpu_seconds(pool.pids()) - cpu0) / seconds)
                key = f"workers_{workers}_seconds"
                out[key] = min(out.get(key, float("inf")), seconds)
                out.setdefault(f"workers_{workers}_all_seconds", []).append(seconds)
                if got != want:
                    raise SystemExit(f"pool with {workers} workers scored differently from the in-process reward")
    finally:
        for pool in pools.values():
            pool.close()
    out["speedup_2_vs_1"] = out["workers_1_seconds"] / out["workers_2_seconds"]
    starts = {}
    for method in ("forkserver", "spawn", "fork"):
        pool = RewardPool("math", num_workers=1, timeout_s=60, start_method=method)
        starts[method] = common.timed(pool.start)[0]
        pool.close()
    out["worker_start_seconds"] = starts
    return out


def bench_rm(n: int, hidden: int, layers: int, min_len: int, max_len: int, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.rewards.reward_model import RewardModel

    torch.set_num_threads(1)
    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64), num_labels=1,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg)
    rng = random.Random(1)
    texts = ["".join(rng.choice("0123456789+=>") for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        tok.save_pretrained(d)
        rm = RewardModel(d, "cpu", dtype=torch.float32, batch_size=batch_size)
        rm.score_texts(texts[:2])
        rm.score_one_by_one(texts[:2])  # warm-up
        t_one, _, one = common.timed(lambda: rm.score_one_by_one(texts))
        t_batched, _, batched = common.timed(lambda: rm.score_texts(texts))
    return {"samples": n, "hidden_size": hidden, "layers": layers, "tokens": [min_len, max_len], "batch_size": batch_size,
            "dtype": "float32", "torch_threads": 1,
            "one_at_a_time_seconds": t_one, "batched_seconds": t_batched, "speedup": t_one / t_batched,
            "max_abs_score_diff": max(abs(a - b) for a, b in zip(one, batched)),
            "score_std": float(torch.tensor(one).std())}


def main() -> None:
    p = common.parser(__doc__, "rewards")
    p.add_argument("--math-samples", type=int, default=256)
    p.add_argument("--rm-samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="pool timings, interleaved 1/2 workers; the best is kept")
    p.add_argument("--rm-batch-size", type=int, default=64)
    a = p.parse_args()
    load_before = os.getloadavg()
    result = {"machine": platform.node(), "cpus": os.cpu_count(), "host": common.machine(),
              "loadavg_before": load_before}
    result["pool"] = bench_pool(a.math_samples, a.repeats)
    # The size of the CPU experiment's reward model (README), where per-call overhead dominates; and a wider,
    # longer one, where one CPU thread is busy with arithmetic either way and padding costs extra.
    result["reward_model"] = bench_rm(a.rm_samples, 64, 2, 4, 24, a.rm_batch_size)
    result["reward_model_compute_bound"] = bench_rm(a.rm_samples, 256, 4, 40, 160, a.rm_batch_size)
    result["loadavg_after"] = os.getloadavg()
    result["targets"] = {"pool_speedup_2_vs_1": 1.6, "rm_batched_speedup": 4.0, "rm_max_abs_score_diff": 1e-5}
    common.write_json(a.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
