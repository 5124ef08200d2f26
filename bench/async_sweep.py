"""Benchmark: fully asynchronous training (k = 2) over one step ahead as the server's decode step gets costlier,
from the tiny model's own CPU step to a GPU-like one: where does the issue's target (k2 >= 1.5x) start to hold?

    python -m bench.async_sweep [--decode-ms 0,0.5,1,2,3,5] [--repeats 2] [--out bench_results/async_sweep.json]

Each point is one `bench.async_rl` run (its own stand-in server, the same heavy-tailed lengths, split and cores,
modes alternating) with the server's decode steps `--decode-ms` longer (`--simulate-decode-ms`: a fixed cost a
step whatever its rows, as a memory-bound decode on a GPU, which reads every weight once a step for 1 row or 32).
Per point: `generation_share`, the share of a step's serial work that is generation (one step ahead's generation
over generation plus the trainer's own phases, medians: what generation would be of an in-turn step), the decode
step's cost at the batch's rows over its cost at one row (`decode_step_rows_over_one`, from the stand-in's decode
loop alone: 1.0 is a flat, GPU-like cost), `k2_over_one_step_ahead` and each side's trainer idle fraction, and
the share of k2's completed samples it dropped as stale; with the mode async_k2_keep_stale in --modes, its ratio
too (rollout.drop_stale=false) and the share of its tokens trained past k. `runs` holds each point's whole
`bench.async_rl` JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench import async_rl, common

TARGET = 1.5
"""Issue 39: fully async with k = 2 at least this many times one step ahead's trained tokens per second."""


def point(result: dict) -> dict:
    """One `bench.async_rl` result's summary (module docstring)."""
    one, k2 = result["modes"]["one_step_ahead"], result["modes"]["async_k2"]
    rate = result["decode_rate"]  # generated tokens/s of the decode loop alone at 1 row and at the batch's rows
    rows = max(int(n) for n in rate)
    trained = k2["steps_measured"] * async_rl._rows(result["config"]["overrides"])  # samples: the batch's a step
    return dict(decode_ms=result["config"]["decode_ms"],
                generation_share=one["phases_s"]["generate"] / one["serial_phase_sum_s"],
                decode_step_rows_over_one=(rows / rate[str(rows)]) / (1 / rate["1"]),
                k2_over_one_step_ahead=result["k2_over_one_step_ahead"],
                meets_target=result["k2_over_one_step_ahead"] >= TARGET,
                one_step_ahead_trainer_idle=one["trainer_idle_fraction"], k2_trainer_idle=k2["trainer_idle_fraction"],
                k2_dropped_share=k2["dropped_stale_samples"] / (k2["dropped_stale_samples"] + trained),
                trainer_bound_over_one_step_ahead=result["trainer_bound_over_one_step_ahead"],
                **({"k2_keep_stale_over_one_step_ahead": result["speedup_over_one_step_ahead"]["async_k2_keep_stale"],
                    "k2_keep_stale_token_lag_over_k": result["modes"]["async_k2_keep_stale"]["token_lag"]["over_k"]}
                   if "async_k2_keep_stale" in result["modes"] else {}))


def _cpu_capability() -> str:
    """The instruction set torch's CPU kernels dispatch to here (AVX2 / AVX512, or what ATEN_CPU_CAPABILITY held them
    to): the runs' children inherit this process's environment."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def main(argv=None) -> int:
    ap = common.parser(__doc__, "async_sweep")
    ap.add_argument("--decode-ms", default="0,0.5,1,2,3,5", help="comma-separated: the points' --decode-ms")
    ap.add_argument("--repeats", type=int, default=2, help="per point: rounds over its modes, alternating")
    ap.add_argument("--steps", type=int, default=30, help="per run (bench.async_rl --steps)")
    ap.add_argument("--median", type=float, default=8.0, help="the median response length (bench.async_rl --median)")
    ap.add_argument("--modes", default="one_step_ahead,async_k2",
                    help="per point (bench.async_rl --modes); one_step_ahead and async_k2 at least")
    args = ap.parse_args(argv)
    try:
        points = [float(x) for x in args.decode_ms.split(",") if x]
    except ValueError:
        raise SystemExit(f"--decode-ms={args.decode_ms!r}: comma-separated milliseconds, e.g. 0,1,3") from None
    modes = common.names(args.modes, async_rl.MODES, "--modes")
    if not {"one_step_ahead", "async_k2"} <= set(modes):
        raise SystemExit(f"--modes={args.modes}: a point compares async_k2 with one_step_ahead; name both")
    runs, summary = {}, []
    with tempfile.TemporaryDirectory(prefix="bench_async_sweep_") as tmp:
        for ms in points:
            out = Path(tmp) / f"{ms}.json"
            async_rl.main(["--decode-ms", str(ms), "--modes", ",".join(modes), "--repeats", str(args.repeats),
                           "--steps", str(args.steps), "--median", str(args.median), "--out", str(out)])
            result = json.loads(out.read_text())
            runs[str(ms)] = result
            summary.append(point(result))
            common.write_json(args.out, dict(  # after every point: a cut-short sweep leaves what it measured
                benchmark="fully async (k=2) over one step ahead as the stand-in's decode step gets costlier",
                target=TARGET, machine=common.machine(cpu_capability=_cpu_capability()), points=summary, runs=runs))
    print("k2 / one step ahead: " + ", ".join(f"{p['decode_ms']:g} ms (generation {p['generation_share']:.2f}) "
                                               f"{p['k2_over_one_step_ahead']:.2f}x" for p in summary)
          + f" -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
