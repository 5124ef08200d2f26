"""Does LoRA learn the CPU demo? The demo (tiny model from random init, toy successor task, the demo's settings)
with lora.rank=8 over several seeds, at the rollout temperature the LoRA demo uses (`make demo-lora`) and at the
demo's temperature 1, and the reason the second cannot learn: the bound on the frozen random model's logits.

Under LoRA the word embedding, the final RMSNorm and the output layer stay as initialised. The norm's output has
RMS 1 (norm sqrt(h)) times gamma, so every logit is at most B = max|gamma| sqrt(h) max_v ||w_v|| in size
(`logit_bound`; the tiny model: h = 64, init std 0.02, B about 1.6): two logits differ by at most 2B, so whatever
the adapters do, the policy at temperature T puts at most e^(2B/T) / (e^(2B/T) + V - 1) on one of the V = 16
tokens: 0.60 at T = 1 (and nearer a quarter while the other rows, random, sit near 0), 0.99995 at T = 0.25.
The demo's entropy at T = 1 stays near log 16 under LoRA; sampling at 0.25 gives the adapters the range a
pretrained model's logits have. Validation is greedy (temperature plays no part in it).

    python -m experiments.lora_demo [--seeds 0 1 2] [--steps 200] [--out bench_results/lora_demo.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LORA_DEMO = ["lora.rank=8", "optim.lr=0.002", "rollout.temperature=0.25"]
"""`make demo-lora`'s overrides of the demo."""


def logit_bound(seed: int) -> dict:
    """The largest logit the frozen random tiny model can give whatever its adapters: max|gamma| * sqrt(h) *
    max_v ||w_v|| over the real vocabulary, of a model built as the run builds it (its config, init and seed), and
    the largest probability a token can then have at temperatures 1 and 0.25."""
    from grpo_mega.conf import ParallelConfig, PrecisionConfig
    from grpo_mega.conf.model import load_model_config
    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.parallel.state import destroy_distributed, init_distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    init_distributed(tp=1, pp=1, seed=seed)
    try:
        vocab = len(make_tokenizer())
        model = load_model_config("tiny")
        gpt, _ = build_gpt(model, ParallelConfig(), PrecisionConfig(params_dtype="fp32"))
        gamma = float(gpt.decoder.final_layernorm.weight.abs().max())
        rows = float(gpt.output_layer.weight[:vocab].norm(dim=1).max())
        bound = gamma * model.hidden_size ** 0.5 * rows
        p_max = {t: math.exp(2 * bound / t) / (math.exp(2 * bound / t) + vocab - 1) for t in (1.0, 0.25)}
        return {"hidden_size": model.hidden_size, "max_abs_norm_gamma": gamma, "max_output_row_norm": rows,
                "logit_bound": bound, "vocab": vocab, "max_token_probability_at_temperature": p_max}
    finally:
        destroy_distributed()


def _run(out: Path, overrides: list[str], env: dict, interval: int) -> dict:
    argv = [sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={out}", *overrides]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    # (each row repeats the last validation: the evaluated steps alone)
    val = {r["step"]: r["val_reward"] for r in rows if "val_reward" in r and (r["step"] % interval == 0
                                                                              or r is rows[-1])}
    return {"command": " ".join(argv[1:]), "seconds": round(time.monotonic() - t0, 1), "val_reward": val,
            "val_reward_end": val[max(val)], "first_step_at_0.9": next((s for s, v in sorted(val.items()) if v >= 0.9), None),
            "entropy_end": rows[-1]["entropy"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "lora_demo.json"))
    args = ap.parse_args()
    from bench import common

    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    common_overrides = [f"run.steps={args.steps}", f"eval.interval={args.interval}"]
    result = {"experiment": "the CPU demo with LoRA rank 8 (make demo-lora) over seeds, and at the demo's "
                            "temperature 1", "machine": common.machine(loadavg_before=list(os.getloadavg())),
              "lora_demo_overrides": LORA_DEMO, "bound": logit_bound(0), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            name = f"temperature_0.25_seed{seed}"
            result["runs"][name] = _run(Path(tmp) / name, [*common_overrides, *LORA_DEMO, f"run.seed={seed}"], env,
                                        args.interval)
            print(name, result["runs"][name]["val_reward_end"], flush=True)
        name = "temperature_1_seed0"
        at_one = [o for o in LORA_DEMO if not o.startswith("rollout.temperature")]
        result["runs"][name] = _run(Path(tmp) / name, [*common_overrides, *at_one, "run.seed=0"], env, args.interval)
        print(name, result["runs"][name]["val_reward_end"], flush=True)
    ends = [r["val_reward_end"] for n, r in result["runs"].items() if n.startswith("temperature_0.25")]
    result["val_reward_end_min_over_seeds"] = min(ends)
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    common.write_json(args.out, result)
    print(f"LoRA demo: final validation reward over seeds {ends} (min {min(ends)}); logit bound "
          f"{result['bound']['logit_bound']:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
