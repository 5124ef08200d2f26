"""Does fully asynchronous training learn as fast, per step, as training in turn? The demo (tiny model, toy successor
task, the demo's settings) three times from the same start: in turn on the embedded engine (`make demo`), in turn
on a dedicated stand-in server (generate, then train, every step on the newest weights), and fully asynchronous on
such a server (rollout.mode=async, staleness bound k = --k, partial rollouts: responses generated in segments of
--segment-tokens tokens, continued under newer weights). Validation reward (greedy) every --interval steps for
each, over --seeds (run.seed: the model's initialisation and the prompts; one trajectory decides a 0.05 step of
a 20-prompt validation); the headline is each run's median first step at --target over the seeds (a seed that never
reaches it counts as the slowest), async's over each in-turn run's (issue 39's bar: at most 1.3x), and the tokens'
version lag (async/token_lag_*: tokens from more than one version).

    python -m experiments.async_parity [--steps 200] [--k 2] [--segment-tokens 2] [--seeds 0,1,2,3,4] \
        [--async-set rollout.fresh_groups=false] [--out bench_results/async_parity.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(out: Path, overrides: list[str], env: dict) -> dict:
    """One demo run on a fresh stand-in server: the validation curve, the wall time and the async metrics."""
    import subprocess

    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.engines import standin_server
    from grpo_mega.processes import stop

    server, argv = None, [sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={out}", *overrides]
    if "rollout.placement=dedicated" in overrides:
        server, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size",
                                             str(len(make_tokenizer()))],
                                            env={**env, "OMP_NUM_THREADS": "1"}, cwd=str(REPO), timeout_s=120)
        argv += [f"rollout.servers=[{url}]", "rollout.server_timeout_s=120"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    finally:
        if server is not None:
            stop(server)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    first = next(line for line in proc.stdout.splitlines() if "validation reward (greedy)" in line)
    lags = sorted({k for r in rows for k in r if k.startswith("async/token_lag_")})
    return {"command": " ".join(argv[1:]), "seconds": round(time.monotonic() - t0, 1), "steps": len(rows),
            "summary": first.strip(),
            "val_reward": {r["step"]: r["val_reward"] for r in rows if "val_reward" in r},
            **({"mean_token_lag": {k[len("async/token_lag_"):]: statistics.mean(r.get(k, 0.0) for r in rows)
                                   for k in lags},
                "steps_with_lagged_tokens": sum(any(r.get(k, 0.0) > 0 for k in lags if not k.endswith("_0"))
                                                for r in rows)} if lags else {})}


def _first_at(curve: dict, target: float):
    return next((step for step, v in sorted(curve.items()) if v >= target), None)


def _median_first(firsts: list):
    """The median over seeds of the first step at the target, a seed that never reached it the slowest (None when
    the median is such a seed)."""
    m = statistics.median(float("inf") if f is None else f for f in firsts)
    return None if m == float("inf") else m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--k", type=int, default=2, help="rollout.off_policy_steps of the async run")
    ap.add_argument("--segment-tokens", type=int, default=2, help="rollout.segment_tokens of the async run")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--seeds", default="0,1,2,3,4", help="run.seed of each trio of runs, comma-separated")
    ap.add_argument("--async-set", action="append", default=[], help="an extra override for the async run only, "
                    "e.g. rollout.fresh_groups=false (bench_results/async_parity_run_to_cap.json)")
    ap.add_argument("--set", action="append", default=[], help="an extra override for both runs")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "async_parity.json"))
    args = ap.parse_args()
    from bench import common

    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    both = [f"run.steps={args.steps}", f"eval.interval={args.interval}", *args.set]
    dedicated = [*both, "rollout.placement=dedicated"]
    runs = {"in_turn_embedded": both, "in_turn": dedicated,
            "async": [*dedicated, "rollout.mode=async", f"rollout.off_policy_steps={args.k}",
                      f"rollout.segment_tokens={args.segment_tokens}", *args.async_set]}
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"experiment": "the demo in turn vs fully asynchronous on a dedicated stand-in server",
              "machine": common.machine(loadavg_before=list(os.getloadavg())), "k": args.k, "segment_tokens": args.segment_tokens,
              "target": args.target, "seeds": seeds, "async_overrides": args.async_set}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in runs.items():
            by_seed = {}
            for seed in seeds:
                r = by_seed[seed] = _run(Path(tmp) / f"{name}_{seed}", [*overrides, f"run.seed={seed}"], env)
                r["first_step_at_target"] = _first_at(r["val_reward"], args.target)
                print(name, seed, json.dumps({k: v for k, v in r.items() if k != "val_reward"}), flush=True)
            firsts = [by_seed[s]["first_step_at_target"] for s in seeds]
            result[name] = {"steps": args.steps, "first_step_at_target": firsts, "median_first_step": _median_first(firsts),
                            "by_seed": by_seed}
    lags = [r["mean_token_lag"] for r in result["async"]["by_seed"].values()]
    result["async"]["mean_token_lag"] = {k: statistics.mean(x.get(k, 0.0) for x in lags) for k in sorted(set().union(*lags))}
    a = result["async"]["median_first_step"]
    for base in ("in_turn", "in_turn_embedded"):
        b = result[base]["median_first_step"]
        result[f"async_over_{base}_steps"] = a / b if a is not None and b else None
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    common.write_json(args.out, result)
    print(f"first step at validation reward >= {args.target} (seeds {seeds}): "
          + ", ".join(f"{k} {result[k]['first_step_at_target']}" for k in runs) + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
