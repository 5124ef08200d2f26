"""Benchmark: in turn (rollout.off_policy_steps=0), one step ahead (=1) and fully asynchronous training
(rollout.mode=async, staleness bound k = 1, 2, 4), the same processes and split for every mode: one stand-in
server (the demo's tiny model and toy task) pinned to the last core of this process's affinity, the trainer
(`common.train`) to the first, each one torch thread. Runs alternate between the modes (`--repeats` rounds): the
machine is shared, and a core is only one core when nobody else is running on it (the load average is recorded).

    python -m bench.async_rl [--steps 30] [--median 8] [--sigma 0.9] [--decode-ms 0] [--repeats 1] [--out bench_results/async.json]
    python -m bench.async_rl --modes in_turn,one_step_ahead --natural-lengths --response-length 64 --repeats 3 \
        --out bench_results/overlap.json

Two workloads. Heavy-tailed lengths (the default): the server's `--simulate-lengths MEDIAN,SIGMA` ends each
response after a lognormal number of tokens drawn from its seed, the longest cut at batch.max_response_length =
8x the median. Natural lengths (`--natural-lengths`): the toy model stops or reaches batch.max_response_length
(`--response-length`); with overlap.json's command, 8 prompts x 4 responses of up to 64 tokens in micro-batches
of 4, generation is about as long as the rest of the step, as on GPU nodes where decoding is the larger part of
an RL step. With the demo's shape (`--response-length 8 --set batch.train_batch_size=16 --set rollout.n=8 --set
batch.ppo_mini_batch_size=8 --set batch.micro_batch_size=32 --repeats 2`, overlap_demo_shape.json) generation is
a tenth of a CPU step and overlap cannot save more than that tenth. `--decode-ms MS` makes each of the server's
decode steps MS ms longer (a larger model's step): the generation-bound regime of reasoning RL, which the tiny
model on a CPU core is not (bench_results/async_decode3ms.json: 3 ms).

Per mode, over the steady steps (the first two and the validating last left out): trained tokens per second (the
update's tokens, prompt and response of the rows in the loss, over the sum of the step times), the trainer's idle
fraction (generate_wait / step), the median step and the median of each phase (`timing/*`, `phases_s`), the serial
phase sum (generation plus everything the trainer does: what a step would take if nothing overlapped),
`step_over_phase_sum` (the median of step / its own serial sum), `perf/overlap`, and in async mode the async/*
metrics (server idle fraction, lag histogram, dropped samples, and `room_held_by_staleness` /
`room_held_by_fresh`: the share of the server's time its worker had room for a group and the staleness cap, or
rollout.fresh_groups, kept it from starting one). Headlines: `k2_over_one_step_ahead` (the target is
>= 1.5), beside `trainer_bound_over_one_step_ahead`: 1 / (1 - one step ahead's trainer idle fraction), the most that
ending the trainer's wait can give on this workload while the trainer's own work per step stays the same;
`server_bound_over_one_step_ahead`, one step ahead's step over the time its tokens a step take at the best rate the
async runs kept their server at (generated tokens per busy second: what their requests got out of it, not what it
can do); `server_idle_bound_over_one_step_ahead`, 1 / one step ahead's `server_decode_fraction` (the stand-in's
decode loop's seconds in its steps over the trainer's step time, from GET /grpo_mega/decode_stats read around each
run: whole runs, their validations included, beside `server_rows_per_decode_step` and `server_ms_per_decode_step`
for every mode): the most that keeping the server busy can give when a token costs what it cost one step ahead;
and `decode_full_bound_over_one_step_ahead`, the same at the rate of the stand-in's decode loop alone with
a batch's rows decoding at once (`decode_rate`: measured in this process on the server's core before the runs, at 1
row and at that many). Per async mode, `rows_bound_over_one_step_ahead` (headline `k2_rows_bound_over_one_step_ahead`):
its trained tokens per generated token (prompts in, drops out) times the decode loop's rate alone at the rows a step
that mode kept decoding (`decode_rate_at_rows`, measured after the runs on the server's core), over one step ahead's
trained tokens/s: the most that mode could train were its server's steps to cost no more than the loop's own at
those rows (no join, prefill, compaction, HTTP or neighbour) and its trainer never to wait. With in turn and one step ahead, `step_ratio` (one step ahead's step / in turn's),
`step_ratio_bound` (the best overlap can do with the in-turn run's phases: max(generation, the rest) / (generation +
the rest)) and one step ahead's `step_over_phase_sum` (issue 16 asks <= 0.7). With in turn and its busy-neighbour
twin (`in_turn_busy_neighbour`: in turn beside a nice-19 copy of the server's decode loop on the server's core),
`trainer_busy_neighbour_over_idle`, the median of the trainer's own phases (all but generation and its wait) over in
turn's: the two cores of a small VM share more than their caches, and an async server decodes nearly all the time;
`trainer_bound_busy_neighbour_over_one_step_ahead` is the trainer-bound ceiling with the trainer's work that much
slower (one step ahead's trainer already ran partly beside a decoding server: an estimate, not a bound).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

from bench import common

SHAPE = ["batch.train_batch_size=8", "rollout.n=4", "batch.ppo_mini_batch_size=8", "batch.micro_batch_size=4"]
MODES = {"in_turn": ["rollout.off_policy_steps=0"], "one_step_ahead": ["rollout.off_policy_steps=1"],
         "async_k1": ["rollout.mode=async", "rollout.off_policy_steps=1"],
         "async_k2": ["rollout.mode=async", "rollout.off_policy_steps=2"],
         "async_k4": ["rollout.mode=async", "rollout.off_policy_steps=4"],
         "async_k2_retract": ["rollout.mode=async", "rollout.off_policy_steps=2", "rollout.pause_mode=retract"],
         "async_k2_in_place": ["rollout.mode=async", "rollout.off_policy_steps=2", "rollout.pause_mode=in_place"],
         "async_k2_keep_stale": ["rollout.mode=async", "rollout.off_policy_steps=2", "rollout.drop_stale=false"],
         "in_turn_busy_neighbour": ["rollout.off_policy_steps=0"]}
BUSY = "in_turn_busy_neighbour"
"""In turn with the server's core kept busy by a nice-19 copy of the stand-in's decode loop (`_burn`): how much slower
the trainer's own phases are while the other core decodes, as it does nearly all the time in async mode."""


def _standin_batcher(decode_ms: float):
    """The benchmark server's decode loop in this process: the stand-in's continuous batcher on the tiny model at the
    toy tokenizer's vocabulary, each decode step `decode_ms` longer (--decode-ms), one torch thread."""
    import torch

    from grpo_mega.conf import load_model_config
    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.engines.continuous import ContinuousBatcher, call_tokens
    from grpo_mega.engines.embedded import EmbeddedEngine
    from grpo_mega.engines.standin_server import slow_decode

    torch.set_num_threads(1)
    cfg = load_model_config("tiny")
    cfg.vocab_size = len(make_tokenizer())
    engine = EmbeddedEngine.from_model_config(cfg, seed=0)
    if decode_ms > 0:
        slow_decode(engine, decode_ms / 1000)
    return ContinuousBatcher(engine, call_tokens=call_tokens(decode_ms / 1000))


def _burn(decode_ms: float, rows: int) -> None:
    """The benchmark server's decode loop, `rows` rows of 32 tokens at a time, until killed: the load a decoding
    server puts beside the trainer (BUSY's neighbour)."""
    from grpo_mega.engines.continuous import Row

    batcher = _standin_batcher(decode_ms)
    print("decoding", flush=True)
    while True:
        batcher.run([Row([3, 4, 5], 32, i) for i in range(rows)])


def _run(core, url: str, mode: str, steps: int, length: int, out: Path, overrides, neighbour=None) -> list[dict]:
    """One training run; mode BUSY with `neighbour` = (core, decode_ms, rows): `_burn` beside it on that core."""
    import select
    import subprocess

    from grpo_mega.processes import stop

    burner = None
    if mode == BUSY and neighbour is not None:
        core_b, decode_ms, rows = neighbour
        burner = subprocess.Popen(["nice", "-n", "19", *common.pin(core_b), sys.executable, "-c",
                                   f"from bench.async_rl import _burn; _burn({decode_ms}, {rows})"],
                                  cwd=common.REPO, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(common.REPO), "OMP_NUM_THREADS": "1"})
        if not select.select([burner.stdout], [], [], 120)[0] or burner.stdout.readline().strip() != "decoding":
            stop(burner)
            raise SystemExit(f"the {mode} run's neighbour (bench.async_rl._burn) did not start decoding within 120 s")
    try:
        return common.train(out, [f"run.steps={steps}", f"eval.interval={steps}", f"batch.max_response_length={length}",
                                  "rollout.placement=dedicated", f"rollout.servers=[{url}]", *MODES[mode], *overrides],
                            f"the {mode} run", prefix=common.pin(core), env={"OMP_NUM_THREADS": "1"})
    finally:
        if burner is not None:
            stop(burner)


def _summary(runs: list[list[dict]]) -> dict:
    """Over the steady steps of every repeat: sums for the throughput, medians for the times (the machine is
    shared: a median shrugs off a step that someone else's job slowed down)."""
    from grpo_mega.trainer.timing import PHASES, WALL_PHASES

    steady = [r for rows in runs for r in rows[2:-1]]
    med = statistics.median
    tokens = sum(r["perf/update_tokens_per_s"] * r["timing/update"] for r in steady)
    seconds = sum(r["timing/step"] for r in steady)
    # generation, then the trainer's own phases one after the other (waiting for generation left out)
    serial = [r["timing/generate"] + sum(r[f"timing/{p}"] for p in WALL_PHASES if p != "generate_wait")
              for r in steady]
    out = dict(steps_measured=len(steady), trained_tokens_per_s=tokens / seconds,
               step_s=med(r["timing/step"] for r in steady),
               trainer_idle_fraction=sum(r["timing/generate_wait"] for r in steady) / seconds,
               phases_s={p: med(r[f"timing/{p}"] for r in steady) for p in PHASES}, serial_phase_sum_s=med(serial),
               step_over_phase_sum=med(r["timing/step"] / s for r, s in zip(steady, serial)),
               overlap=med(r["perf/overlap"] for r in steady),
               response_length=statistics.mean(r["response_length"] for r in steady),
               generated_tokens_per_step=statistics.mean(r["perf/generated_tokens_per_s"] * r["timing/generate"]
                                                         for r in steady),
               val_reward_last=[rows[-1].get("val_reward") for rows in runs],
               weight_versions=[r["weight_version"] for r in runs[0]],
               per_step=[dict(step_s=[r["timing/step"] for r in rows], generate_s=[r["timing/generate"] for r in rows],
                              generate_wait_s=[r["timing/generate_wait"] for r in rows]) for rows in runs])
    if "async/server_idle_fraction" in steady[0]:
        mean = lambda k: statistics.mean(r[k] for r in steady)  # noqa: E731
        out.update(server_idle_fraction=mean("async/server_idle_fraction"),
                   generated_tokens_per_s=mean("async/generated_tokens_per_s"),
                   dropped_stale_samples=sum(r["async/dropped_stale_samples"] for r in steady),
                   continued_samples_per_step=mean("async/continued_samples"),
                   room_held_by_staleness=mean("async/room_held_by_staleness"),
                   room_held_by_fresh=mean("async/room_held_by_fresh"),
                   token_lag={k[len("async/token_lag_"):]: mean(k) for k in sorted(steady[0])
                              if k.startswith("async/token_lag_")})
    return out


def main(argv=None) -> int:
    ap = common.parser(__doc__, "async")
    ap.add_argument("--steps", type=int, default=30,
                    help="per run; 30: the first steps of an async run (servers filling their queue) are not steady")
    ap.add_argument("--median", type=float, default=8.0, help="the median response length (tokens)")
    ap.add_argument("--sigma", type=float, default=0.9, help="the lognormal's sigma")
    ap.add_argument("--natural-lengths", action="store_true",
                    help="no simulated lengths: each response ends when the toy model stops or at --response-length")
    ap.add_argument("--response-length", type=int, default=None,
                    help="batch.max_response_length (default 8x --median)")
    ap.add_argument("--decode-ms", type=float, default=0.0,
                    help="the stand-in's --simulate-decode-ms: each decode step this much longer (generation-bound)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all modes, alternating")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                    help="a config override for every run (repeatable); default: " + " ".join(SHAPE))
    args = ap.parse_args(argv)
    args.set = SHAPE if args.set is None else args.set
    modes = common.names(args.modes, MODES, "--modes")
    if args.steps < 5:
        raise SystemExit(f"--steps={args.steps}: at least 5 (two warm-up steps and the validating last are not measured)")
    from grpo_mega.processes import stop

    length = args.response_length or int(round(8 * args.median))
    lengths = [] if args.natural_lengths else ["--simulate-lengths", f"{args.median},{args.sigma}"]
    trainer_core, server_core = common.trainer_and_server_cores()
    load_before = os.getloadavg()
    rate = decode_rate(server_core, rows=_rows(args.set), decode_ms=args.decode_ms)
    server, url = common.standin_server(server_core, *lengths, "--simulate-decode-ms", str(args.decode_ms))
    rows: dict[str, list] = {m: [] for m in modes}
    decoded: dict[str, list] = {m: [] for m in modes}  # per run: the server's decode-loop counters over it
    order = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
            for i in range(args.repeats):
                for m in modes if i % 2 == 0 else modes[::-1]:
                    before = _decode_stats(url)
                    rows[m].append(_run(trainer_core, url, m, args.steps, length, Path(tmp) / f"{m}_{i}", args.set,
                                        neighbour=(server_core, args.decode_ms, _rows(args.set))))
                    after = _decode_stats(url)
                    decoded[m].append({k: after[k] - before[k] for k in after})
                    order.append(m)
                    result = _result(args, rows, order, length, trainer_core, server_core, load_before, rate, decoded)
                    common.write_json(args.out, result)  # after every run: a cut-short benchmark leaves what it measured
    finally:
        stop(server)
    kept = {_kept_rows(r) for m, r in result["modes"].items() if m.startswith("async")}
    if kept:  # the decode loop alone at the rows each async mode kept decoding, on the server's core now idle
        at = decode_rate(server_core, 0, args.decode_ms, counts=sorted(kept))
        result = _result(args, rows, order, length, trainer_core, server_core, load_before, rate, decoded, at)
        common.write_json(args.out, result)
    print("trained tokens/s: " + ", ".join(f"{m} {r['trained_tokens_per_s']:.0f} (idle {r['trainer_idle_fraction']:.2f},"
                                           f" step {r['step_s']:.3f} s)" for m, r in result["modes"].items())
          + (f"; one step ahead / in turn {result['step_ratio']:.2f}x (at best {result['step_ratio_bound']:.2f}x)"
             if result["step_ratio"] else "") + f"; load {result['machine']['loadavg_after'][0]:.1f} -> {args.out}")
    return 0


def _decode_stats(url: str) -> dict:
    """The stand-in's decode-loop counters so far (GET /grpo_mega/decode_stats: steps, rows over them, seconds)."""
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/grpo_mega/decode_stats", timeout=30) as r:
        return json.loads(r.read())


def _server_use(runs: list[list[dict]], decoded: list[dict]) -> dict:
    """A mode's server over its runs (every step of them: the counters cover whole runs, validations included):
    the fraction of the trainer's step time its decode loop was stepping, its rows a step and ms a step."""
    steps, rows, busy = (sum(d[k] for d in decoded) for k in ("steps", "row_steps", "busy_s"))
    wall = sum(r["timing/step"] for rows_ in runs for r in rows_)
    return dict(server_decode_fraction=busy / wall if wall else None,
                server_rows_per_decode_step=rows / steps if steps else None,
                server_ms_per_decode_step=1e3 * busy / steps if steps else None)


def _kept_rows(mode: dict) -> int:
    """The rows a decode step a mode's server kept, rounded (where `decode_rate_at_rows` is measured and read)."""
    return max(1, round(mode["server_rows_per_decode_step"] or 0))


def _rows(overrides: list[str]) -> int:
    """The responses of a batch (train_batch_size x rollout.n), what one server decodes at once in async mode."""
    got = dict(o.split("=", 1) for o in overrides)
    return int(got.get("batch.train_batch_size", 8)) * int(got.get("rollout.n", 4))


def decode_rate(core, rows: int, decode_ms: float, tokens: int = 32, counts=None) -> dict:
    """Generated tokens per second of the stand-in's decode loop (grpo_mega.engines.continuous, the benchmark
    server's model) at 1 row and at `rows` rows decoding together (or at each of `counts`), `tokens` each, in this
    process pinned to `core` with one torch thread (the server's settings) and each decode step `decode_ms` longer
    (--decode-ms)."""
    import time

    import torch

    from grpo_mega.engines.continuous import Row

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, before if core is None else {core})
    batcher, out = _standin_batcher(decode_ms), {}
    try:
        for n in counts or (1, rows):
            batcher.run([Row([3, 4, 5], tokens, i) for i in range(n)])  # warm-up
            t0 = time.perf_counter()
            for _ in range(3):
                batcher.run([Row([3, 4, 5], tokens, i) for i in range(n)])
            out[str(n)] = 3 * n * tokens / (time.perf_counter() - t0)
    finally:
        batcher.close()
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
    return out


def _server_bound(runs: dict) -> Optional[float]:
    """One step ahead's step over the time its tokens a step take at the best rate the async runs kept their server
    at (generated tokens per second over their busy fraction). None without one step ahead and an async run."""
    rates = [r["generated_tokens_per_s"] / (1 - r["server_idle_fraction"]) for m, r in runs.items()
             if m.startswith("async") and r["server_idle_fraction"] < 1]
    if "one_step_ahead" not in runs or not rates:
        return None
    one = runs["one_step_ahead"]
    return one["step_s"] / (one["generated_tokens_per_step"] / max(rates))


def _result(args, rows, order, length, trainer_core, server_core, load_before, rate, decoded, at_rows=None) -> dict:
    modes = [m for m in rows if rows[m]]
    runs = {m: {**_summary(rows[m]), **_server_use(rows[m], decoded[m])} for m in modes}
    tps = {m: runs[m]["trained_tokens_per_s"] for m in modes}
    for m, r in runs.items():  # an async mode's ceiling were its server as fast as its decode loop alone
        n = _kept_rows(r)
        if m.startswith("async") and at_rows and str(n) in at_rows and "one_step_ahead" in tps:
            r["decode_rate_at_rows"] = at_rows[str(n)]
            r["rows_bound_over_one_step_ahead"] = (r["trained_tokens_per_s"] / r["generated_tokens_per_s"]
                                                   * at_rows[str(n)] / tps["one_step_ahead"])
    pair = {"in_turn", "one_step_ahead"} <= set(runs)
    if pair:  # what overlap can do at best with the in-turn run's phases: max(generation, the rest) / their sum
        gen = runs["in_turn"]["phases_s"]["generate"]
        bound = max(gen, runs["in_turn"]["serial_phase_sum_s"] - gen) / runs["in_turn"]["serial_phase_sum_s"]
    slow = None
    if {BUSY, "in_turn"} <= set(runs):
        own = lambda r: sum(v for p, v in r["phases_s"].items() if p not in ("generate", "generate_wait"))  # noqa: E731
        slow = own(runs[BUSY]) / own(runs["in_turn"])
    return dict(
        complete=len(order) == args.repeats * len(rows),
        benchmark="in turn vs one step ahead vs fully asynchronous (one stand-in server, tiny model, toy task, "
                  + ("natural response lengths)" if args.natural_lengths else "lognormal response lengths)"),
        machine=common.machine(trainer_core=trainer_core, server_core=server_core, loadavg_before=load_before,
                               loadavg_after=os.getloadavg(),
                               busy=max(load_before[0], os.getloadavg()[0]) > (os.cpu_count() or 1)),
        config=dict(steps=args.steps, repeats=args.repeats, natural_lengths=args.natural_lengths,
                    median=None if args.natural_lengths else args.median,
                    sigma=None if args.natural_lengths else args.sigma, decode_ms=args.decode_ms,
                    max_response_length=length, overrides=args.set, run_order=order),
        modes=runs,
        speedup_over_one_step_ahead={m: tps[m] / tps["one_step_ahead"] for m in modes if "one_step_ahead" in tps},
        k2_over_one_step_ahead=(tps["async_k2"] / tps["one_step_ahead"]
                                if {"async_k2", "one_step_ahead"} <= set(tps) else None),
        # one step ahead's throughput if its trainer never waited (the same work per step): what removing the wait
        # for generation can give at most on this workload, as long as the trainer's step is the one-step-ahead one's
        trainer_bound_over_one_step_ahead=(1 / (1 - runs["one_step_ahead"]["trainer_idle_fraction"])
                                           if "one_step_ahead" in runs else None),
        server_bound_over_one_step_ahead=_server_bound(runs),
        # what filling one step ahead's server's idle time could give, were a token to cost what it cost there
        server_idle_bound_over_one_step_ahead=(1 / runs["one_step_ahead"]["server_decode_fraction"]
                                               if "one_step_ahead" in runs
                                               and runs["one_step_ahead"]["server_decode_fraction"] else None),
        decode_rate=rate,
        decode_full_bound_over_one_step_ahead=(runs["one_step_ahead"]["step_s"] * max(rate.values())
                                               / runs["one_step_ahead"]["generated_tokens_per_step"]
                                               if "one_step_ahead" in runs else None),
        k2_rows_bound_over_one_step_ahead=runs.get("async_k2", {}).get("rows_bound_over_one_step_ahead"),
        # the trainer's own phases with the other core decoding (BUSY) over in turn's, where it is idle meanwhile
        trainer_busy_neighbour_over_idle=slow,
        trainer_bound_busy_neighbour_over_one_step_ahead=(1 / (1 - runs["one_step_ahead"]["trainer_idle_fraction"])
                                                          / slow if slow and "one_step_ahead" in runs else None),
        step_ratio=runs["one_step_ahead"]["step_s"] / runs["in_turn"]["step_s"] if pair else None,
        step_ratio_bound=bound if pair else None,
        step_over_phase_sum=runs["one_step_ahead"]["step_over_phase_sum"] if "one_step_ahead" in runs else None,
    )


if __name__ == "__main__":
    sys.exit(main())
