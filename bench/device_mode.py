"""Benchmark: what the CPU shim's device mode costs a training step on the embedded default. Writes JSON.

    python -m bench.device_mode [--steps 12] [--repeats 3] [--set KEY=VALUE ...] [--out bench_results/device_mode.json]

On a machine without CUDA the trainer's thread runs under cpu_compat's CudaToCpuMode (megatron's CUDA literals
mapped to the CPU), which sees every torch call the thread makes. Code that names no CUDA device runs outside it
(`cpu_compat.without_device_mode`: the embedded engine's generation and weight loading, the model's forward). Two
sides, the same `python -m grpo_mega.train` (the demo's configuration, `--steps` steps, `--set` overrides added),
alternated `--repeats` times, each pinned to this process's first core with one torch thread: `lifted` (as it
runs) and `under_mode` (`without_device_mode` replaced by a null context before grpo_mega loads: every torch call
under the mode, as before 2026-12-04). Per side over the steps after the first two: trained tokens per second (the
update's tokens over the sum of the step times), the median step and the median of each phase; `same_training`:
both sides' per-step rewards and losses are equal (the mode changes no number); `lifted_over_under_mode`, the
throughput ratio.
"""

from __future__ import annotations

import json
import runpy
import statistics
import sys
import tempfile

from bench import common

SIDES = ("lifted", "under_mode")


def _train_under_mode(argv: list[str]) -> None:
    """The worker of side `under_mode`: grpo_mega.train with every torch call under the device mode."""
    import contextlib

    from grpo_mega.parallel import cpu_compat

    cpu_compat.without_device_mode = contextlib.nullcontext  # before the modules that import it load
    sys.argv = ["grpo_mega.train", *argv]
    runpy.run_module("grpo_mega.train", run_name="__main__")


def _run(side: str, run_dir: str, overrides: list[str], core) -> list[dict]:
    entry = ("-m", "grpo_mega.train") if side == "lifted" else ("-m", "bench.device_mode", "--worker")
    return common.train(run_dir, overrides, f"the {side} run", prefix=common.pin(core), env={"OMP_NUM_THREADS": "1"},
                        entry=entry)


def _summary(runs: list[list[dict]]) -> dict:
    from grpo_mega.trainer.timing import PHASES

    steady = [r for rows in runs for r in rows[2:]]
    med = statistics.median
    tokens = sum(r["perf/update_tokens_per_s"] * r["timing/update"] for r in steady)
    return dict(steps_measured=len(steady), trained_tokens_per_s=tokens / sum(r["timing/step"] for r in steady),
                step_s=med(r["timing/step"] for r in steady),
                phases_s={p: med(r[f"timing/{p}"] for r in steady) for p in PHASES})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _train_under_mode(argv[1:])
        return 0
    ap = common.parser(__doc__, "device_mode")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="a training override (repeatable)")
    args = ap.parse_args(argv)
    core = common.trainer_and_server_cores()[0]
    overrides = [f"run.steps={args.steps}", f"eval.interval={args.steps}", *args.set]
    rows = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench_device_mode_") as tmp:
        for i in range(args.repeats):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                rows[side].append(_run(side, f"{tmp}/{side}_{i}", overrides, core))
    keys = ("reward", "loss", "response_length")
    same = all([[r[k] for r in a] for k in keys] == [[r[k] for r in b] for k in keys]
               for a, b in zip(rows["lifted"], rows["under_mode"]))
    sides = {s: _summary(rows[s]) for s in SIDES}
    common.write_json(args.out, dict(
        benchmark="the CPU shim's device mode: the embedded default trained with code that names no CUDA device "
                  "outside it (lifted) and with every torch call under it (under_mode)",
        machine=common.machine(trainer_core=core), config=dict(steps=args.steps, repeats=args.repeats,
                                                               overrides=args.set),
        sides=sides, same_training=same,
        lifted_over_under_mode=sides["lifted"]["trained_tokens_per_s"] / sides["under_mode"]["trained_tokens_per_s"]))
    print(json.dumps({s: round(v["trained_tokens_per_s"]) for s, v in sides.items()}), "same_training", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
