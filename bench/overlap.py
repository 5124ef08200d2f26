"""Benchmark: one-step off-policy overlap. The same dedicated run (the demo's tiny model and toy task, one
embedded rollout server) twice: `rollout.off_policy_steps=0` (generate, then train) and `=1` (the next step's
batch generated while this one trains). Generation and training get one core each (`taskset`: the server on
the last core of this process's affinity, the trainer on the first; each with one torch thread). Writes JSON.

    python -m bench.overlap [--steps 12] [--response-length 64] [--out bench_results/overlap.json]

The default shape (8 prompts x 4 responses of up to 64 tokens, micro-batches of 4) makes generation about
as long as the rest of the step, as on GPU nodes where decoding is the larger part of an RL step; with the
demo's shape (`--response-length 8 --set batch.train_batch_size=16 --set rollout.n=8 --set
batch.micro_batch_size=32`) generation is a tenth of a CPU step and overlap cannot save more than that tenth
(`step_ratio_bound` says how much it could).

Per mode (`--repeats` runs each, alternating): the median step time and the median of each phase (`timing/*`)
over the steady steps (the first two and the last, which validates, left out), `perf/overlap`, and the serial sum of the phases (generation plus
everything the trainer does: what a step would take if nothing overlapped). The headline ratios:
`step_ratio` = off-policy step / in-turn step, and `step_over_phase_sum` = the off-policy step / its own serial
phase sum (the done-when of issue 16 asks <= 0.7), and `step_ratio_bound`, the best overlap can do with the
in-turn run's phases: max(generation, the rest) / (generation + the rest). The load average is recorded: the machine is shared, and a
core is only one core when nobody else is running on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import common

REPO = common.REPO
PHASES = ("generate", "generate_wait", "reward", "old_logprobs", "ref_logprobs", "update", "weight_sync", "eval",
          "checkpoint")
SHAPE = ["batch.train_batch_size=8", "rollout.n=4", "batch.ppo_mini_batch_size=8", "batch.micro_batch_size=4"]
TRAINER_PHASES = ("reward", "old_logprobs", "ref_logprobs", "update", "weight_sync", "eval", "checkpoint")


def _pin(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


def _start_server(core, vocab: int) -> tuple[subprocess.Popen, str]:
    from grpo_mega.engines import standin_server

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    try:
        return standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(vocab)], prefix=_pin(core),
                             env=env, cwd=REPO)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def _stop(proc: subprocess.Popen) -> None:
    from grpo_mega.processes import stop

    stop(proc)


def _run(core, url: str, off_policy: int, steps: int, response_length: int, out: Path, overrides=()) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = _pin(core) + [sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={out}", f"run.steps={steps}",
                        f"eval.interval={steps}", f"batch.max_response_length={response_length}",
                        "rollout.placement=dedicated", f"rollout.servers=[{url}]", f"rollout.off_policy_steps={off_policy}", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
    if done.returncode:
        raise SystemExit(f"the off_policy_steps={off_policy} run failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def _summary(runs: list[list[dict]]) -> dict:
    """Medians over the steady steps of every repeat (the machine is shared: a median shrugs off a step that
    someone else's job slowed down)."""
    steady = [r for rows in runs for r in rows[2:-1]]
    med = lambda values: statistics.median(values)  # noqa: E731
    phases = {p: med([r[f"timing/{p}"] for r in steady]) for p in PHASES}
    serial = [r["timing/generate"] + sum(r[f"timing/{p}"] for p in TRAINER_PHASES) for r in steady]
    return dict(steps_measured=len(steady), step_s=med([r["timing/step"] for r in steady]), phases_s=phases,
                serial_phase_sum_s=med(serial),
                step_over_phase_sum=med([r["timing/step"] / s for r, s in zip(steady, serial)]),
                overlap=med([r["perf/overlap"] for r in steady]),
                weight_versions=[r["weight_version"] for r in runs[0]],
                per_step=[dict(step_s=[r["timing/step"] for r in rows], generate_s=[r["timing/generate"] for r in rows],
                               generate_wait_s=[r["timing/generate_wait"] for r in rows]) for rows in runs])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--response-length", type=int, default=64, help="batch.max_response_length: sets how long a "
                    "generation takes against an update")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating in turn / one step ahead")
    ap.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                    help="a config override for both runs (repeatable); default: " + " ".join(SHAPE))
    ap.add_argument("--out", default=common.out_path("overlap"))
    args = ap.parse_args(argv)
    args.set = SHAPE if args.set is None else args.set
    if args.steps < 5:
        raise SystemExit(f"--steps={args.steps}: at least 5 (two warm-up steps and the validating last are not measured)")
    from grpo_mega.data.toy import make_tokenizer

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    trainer_core, server_core = (cores[0], cores[-1]) if len(cores) >= 2 else (None, None)
    load_before = os.getloadavg()
    server, url = _start_server(server_core, len(make_tokenizer()))
    rows: dict[int, list] = {0: [], 1: []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_overlap_") as tmp:
            for i in range(args.repeats):
                for off in (0, 1):
                    rows[off].append(_run(trainer_core, url, off, args.steps, args.response_length,
                                          Path(tmp) / f"off{off}_{i}", args.set))
    finally:
        _stop(server)
    runs = {off: _summary(r) for off, r in rows.items()}
    result = dict(
        benchmark="one-step off-policy overlap (dedicated embedded server, tiny model, toy task)",
        machine=common.machine(trainer_core=trainer_core, server_core=server_core, loadavg_before=load_before,
                                     loadavg_after=os.getloadavg(),
                                     busy=max(load_before[0], os.getloadavg()[0]) > (os.cpu_count() or 1)),
        config=dict(steps=args.steps, repeats=args.repeats, max_response_length=args.response_length,
                    overrides=args.set),
        in_turn=runs[0], off_policy=runs[1],
        step_ratio=runs[1]["step_s"] / runs[0]["step_s"],
        # the best one step ahead can do with the in-turn run's phases: max(generation, the rest) / their sum
        step_ratio_bound=max(gen := runs[0]["phases_s"]["generate"], rest := runs[0]["serial_phase_sum_s"] - gen)
        / (gen + rest),
        step_over_phase_sum=runs[1]["step_over_phase_sum"],
    )
    common.write_json(args.out, result)
    print(f"step {runs[0]['step_s']:.3f} s in turn -> {runs[1]['step_s']:.3f} s one step ahead "
          f"({result['step_ratio']:.2f}x; at best {result['step_ratio_bound']:.2f}x with these phases); off-policy step / its serial phase sum {result['step_over_phase_sum']:.2f}; "
          f"overlap {runs[1]['overlap']:.2f}; load {result['machine']['loadavg_after'][0]:.1f} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
