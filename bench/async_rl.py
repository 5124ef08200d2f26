"""Benchmark: fully asynchronous training (rollout.mode=async, staleness bound k = 1, 2, 4) against one step ahead
(rollout.off_policy_steps=1) and in turn (=0), on a workload with heavy-tailed response lengths. The same
processes and split for every mode: one stand-in server (the demo's tiny model, `--simulate-lengths MEDIAN,SIGMA`:
each response ends after a lognormal number of tokens drawn from its seed, the longest cut at
batch.max_response_length = 8x the median) pinned to the last core of this process's affinity, the trainer to the
first (each one torch thread). Runs alternate between the modes (`--repeats` rounds): the machine is shared.

    python -m bench.async_rl [--steps 12] [--median 8] [--sigma 0.9] [--decode-ms 0] [--repeats 1] [--out bench_results/async.json]

`--decode-ms MS` makes each of the server's decode steps MS ms longer (a larger model's step): the generation-bound
regime of reasoning RL, which the tiny model on a CPU core is not (bench_results/async_decode3ms.json: 3 ms).

Per mode: trained tokens per second (the update's tokens, prompt and response of the rows in the loss, summed over
the steady steps, the first two and the validating last left out, over the sum of their step times), the
trainer's idle fraction (generate_wait / step), and in async mode the async/* metrics (server idle fraction, lag
histogram, dropped samples). Headline: `k2_over_one_step_ahead` (the target is >= 1.5), beside
`trainer_bound_over_one_step_ahead`: 1 / (1 - one step ahead's trainer idle fraction), the most that ending the
trainer's wait can give on this workload while the trainer's own work per step stays the same.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench import common

SHAPE = ["batch.train_batch_size=8", "rollout.n=4", "batch.ppo_mini_batch_size=8", "batch.micro_batch_size=4"]
MODES = {"in_turn": ["rollout.off_policy_steps=0"], "one_step_ahead": ["rollout.off_policy_steps=1"],
         "async_k1": ["rollout.mode=async", "rollout.off_policy_steps=1"],
         "async_k2": ["rollout.mode=async", "rollout.off_policy_steps=2"],
         "async_k4": ["rollout.mode=async", "rollout.off_policy_steps=4"]}


def _run(core, url: str, mode: str, steps: int, length: int, out: Path, overrides) -> list[dict]:
    return common.train(out, [f"run.steps={steps}", f"eval.interval={steps}", f"batch.max_response_length={length}",
                              "rollout.placement=dedicated", f"rollout.servers=[{url}]", *MODES[mode], *overrides],
                        f"the {mode} run", prefix=common.pin(core), env={"OMP_NUM_THREADS": "1"})


def _summary(runs: list[list[dict]]) -> dict:
    steady = [r for rows in runs for r in rows[2:-1]]
    tokens = sum(r["perf/update_tokens_per_s"] * r["timing/update"] for r in steady)
    seconds = sum(r["timing/step"] for r in steady)
    out = dict(steps_measured=len(steady), trained_tokens_per_s=tokens / seconds,
               step_s=statistics.median(r["timing/step"] for r in steady),
               trainer_idle_fraction=sum(r["timing/generate_wait"] for r in steady) / seconds,
               response_length=statistics.mean(r["response_length"] for r in steady),
               val_reward_last=[rows[-1].get("val_reward") for rows in runs])
    if "async/server_idle_fraction" in steady[0]:
        mean = lambda k: statistics.mean(r[k] for r in steady)  # noqa: E731
        out.update(server_idle_fraction=mean("async/server_idle_fraction"),
                   generated_tokens_per_s=mean("async/generated_tokens_per_s"),
                   dropped_stale_samples=sum(r["async/dropped_stale_samples"] for r in steady),
                   continued_samples_per_step=mean("async/continued_samples"),
                   token_lag={k.rsplit("_", 1)[1]: mean(k) for k in sorted(steady[0]) if k.startswith("async/token_lag_")})
    return out


def main(argv=None) -> int:
    ap = common.parser(__doc__, "async")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--median", type=float, default=8.0, help="the median response length (tokens)")
    ap.add_argument("--sigma", type=float, default=0.9, help="the lognormal's sigma")
    ap.add_argument("--decode-ms", type=float, default=0.0,
                    help="the stand-in's --simulate-decode-ms: each decode step this much longer (generation-bound)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all modes, alternating")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                    help="a config override for every run (repeatable); default: " + " ".join(SHAPE))
    args = ap.parse_args(argv)
    args.set = SHAPE if args.set is None else args.set
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: unknown {unknown}; pick from {list(MODES)}")
    if args.steps < 5:
        raise SystemExit(f"--steps={args.steps}: at least 5 (two warm-up steps and the validating last are not measured)")
    from grpo_mega.processes import stop

    length = int(round(8 * args.median))
    trainer_core, server_core = common.trainer_and_server_cores()
    load_before = os.getloadavg()
    server, url = common.standin_server(server_core, "--simulate-lengths", f"{args.median},{args.sigma}",
                                        "--simulate-decode-ms", str(args.decode_ms))
    rows: dict[str, list] = {m: [] for m in modes}
    order = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
            for i in range(args.repeats):
                for m in modes if i % 2 == 0 else modes[::-1]:
                    rows[m].append(_run(trainer_core, url, m, args.steps, length, Path(tmp) / f"{m}_{i}", args.set))
                    order.append(m)
                    result = _result(args, rows, order, length, trainer_core, server_core, load_before)
                    common.write_json(args.out, result)  # after every run: a cut-short benchmark leaves what it measured
    finally:
        stop(server)
    tps = {m: r["trained_tokens_per_s"] for m, r in result["modes"].items()}
    print("trained tokens/s: " + ", ".join(f"{m} {tps[m]:.0f} (idle {result['modes'][m]['trainer_idle_fraction']:.2f})"
                                           for m in tps) + f"; load {result['machine']['loadavg_after'][0]:.1f} -> {args.out}")
    return 0


def _result(args, rows, order, length, trainer_core, server_core, load_before) -> dict:
    modes = [m for m in rows if rows[m]]
    runs = {m: _summary(rows[m]) for m in modes}
    tps = {m: runs[m]["trained_tokens_per_s"] for m in modes}
    return dict(
        complete=len(order) == args.repeats * len(rows),
        benchmark="fully asynchronous vs one step ahead vs in turn (one stand-in server, tiny model, toy task, "
                  "lognormal response lengths)",
        machine=common.machine(trainer_core=trainer_core, server_core=server_core, loadavg_before=load_before,
                               loadavg_after=os.getloadavg(),
                               busy=max(load_before[0], os.getloadavg()[0]) > (os.cpu_count() or 1)),
        config=dict(steps=args.steps, repeats=args.repeats, median=args.median, sigma=args.sigma, decode_ms=args.decode_ms,
                    max_response_length=length, overrides=args.set, run_order=order),
        modes=runs,
        speedup_over_one_step_ahead={m: tps[m] / tps["one_step_ahead"] for m in modes if "one_step_ahead" in tps},
        k2_over_one_step_ahead=(tps["async_k2"] / tps["one_step_ahead"]
                                if {"async_k2", "one_step_ahead"} <= set(tps) else None),
        # one step ahead's throughput if its trainer never waited (the same work per step): what removing the wait
        # for generation can give at most on this workload, as long as the trainer's step is the one-step-ahead one's
        trainer_bound_over_one_step_ahead=(1 / (1 - runs["one_step_ahead"]["trainer_idle_fraction"])
                                           if "one_step_ahead" in runs else None),
    )


if __name__ == "__main__":
    sys.exit(main())
