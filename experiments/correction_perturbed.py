"""Does the demo still learn when the rollout engine's logprobs are perturbed? The demo run (tiny model, toy
task) on a dedicated stand-in server with IcePop's rollout correction (token-level mask outside [0.5, 5]),
twice: the server's logprobs as they are, and through experiments.proxies.NoisyProxy (N(0, sigma^2) added to
every logprob the engine reports; the samples are unchanged). Writes, per run: validation reward before and
after, the masked token/sequence shares and the ratio's quantiles (means over steps), and the wall time.

    python -m experiments.correction_perturbed [--steps 200] [--sigma 0.5] \
        [--out bench_results/correction_perturbed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.proxies import NoisyProxy

REPO = Path(__file__).resolve().parents[1]


def _run(out: Path, url: str, steps: int, extra: list[str], env: dict) -> dict:
    argv = [sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={out}", f"run.steps={steps}",
            "rollout.placement=dedicated", f"rollout.servers=[{url}]", "rollout.server_timeout_s=120",
            "algo.rollout_correction=icepop", *extra]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    keys = ("is_capped_fraction", "is_seq_capped_fraction", "is_weight_mean", "logprob_mismatch",
            "rollout_ratio/q01", "rollout_ratio/q50", "rollout_ratio/q99")
    first = next(line for line in proc.stdout.splitlines() if "validation reward (greedy)" in line)
    return {"seconds": round(time.monotonic() - t0, 1), "steps": len(rows), "summary": first.strip(),
            "val_reward_final": rows[-1].get("val_reward"),
            "val_reward_max": max(r["val_reward"] for r in rows if "val_reward" in r),
            "reward_last10": statistics.mean(r["reward"] for r in rows[-10:]),
            **{f"mean_{k}": statistics.mean(r[k] for r in rows) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sigma", type=float, default=0.5)
    ap.add_argument("--set", action="append", default=[], help="an extra override for both runs")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "correction_perturbed.json"))
    args = ap.parse_args()
    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.processes import stop
    from grpo_mega.engines import standin_server

    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    server, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(len(make_tokenizer()))],
                                        env=env, cwd=str(REPO), timeout_s=120)
    result = {"steps": args.steps, "sigma": args.sigma, "correction": "icepop (token, mask outside [0.5, 5])",
              "overrides": args.set}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result["clean"] = _run(Path(tmp) / "clean", url, args.steps, args.set, env)
            print(json.dumps(result["clean"]), flush=True)
            proxy = NoisyProxy(url, args.sigma, seed=0)
            try:
                result["perturbed"] = _run(Path(tmp) / "noisy", proxy.url, args.steps, args.set, env)
            finally:
                proxy.close()
            print(json.dumps(result["perturbed"]), flush=True)
    finally:
        stop(server)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
