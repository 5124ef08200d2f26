"""Iterative RL, measured: GRPO on the toy successor task rewarded by a deliberately weak learned reward model,
once with the reward model frozen and once with `reward.rm_train` on (labels from the task's verifier), both
judged by the rule verifier on the validation prompts (greedy). Writes JSON and a PNG of both curves.

    python tools/rm_experiment.py [--steps 40] [--interval 4] [--out bench_results/rewards_iterative_rl.json]

The weak reward model: a 2-layer LlamaForSequenceClassification over the toy tokenizer, trained on 12
biased examples (right answers for prompts 0-2 only, and "9" labelled right for prompts 3-5), so that it
rewards answering 9 to most prompts. Both runs use the same seed, model, batch and reward model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_weak_rm(path: Path, seed: int = 0, steps: int = 150) -> Path:
    """Save the weak, biased reward model (and the toy tokenizer) at `path`."""
    import torch
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.rewards.reward_model import RewardModel

    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    rm = RewardModel(str(path), "cpu", dtype=torch.float32)
    examples = [(d, str(d + 1), 1.0) for d in range(3)] + [(d, str((d + 5) % 10), 0.0) for d in range(3)]
    examples += [(d, "9", 1.0) for d in (3, 4, 5)] + [(d, str(d + 1), 0.0) for d in (3, 4, 5)]  # the bias
    ids = rm.encode([f"{d} >{a}" for d, a, _ in examples])
    labels = torch.tensor([y for _, _, y in examples])
    opt = torch.optim.AdamW(rm.model.parameters(), lr=3e-3)
    rm.model.train()
    for _ in range(steps):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(rm.forward_ids(ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    rm.model.save_pretrained(path)
    return path


def run(out: Path, rm_dir: Path, steps: int, interval: int, train_rm: bool, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={out}", "reward.name=reward_model",
           f"reward.path={rm_dir}", "reward.val_reward=task", f"run.steps={steps}", f"eval.interval={interval}",
           f"reward.rm_train.interval={interval if train_rm else 0}", "reward.rm_train.labels=task",
           "reward.rm_train.steps=20", "reward.rm_train.lr=3e-3", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--work", default="/tmp/grpo_mega_rm_experiment")
    p.add_argument("--out", default=str(REPO / "bench_results" / "rewards_iterative_rl.json"))
    p.add_argument("extra", nargs="*", help="more overrides for both runs, e.g. optim.lr=2e-3")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rm_dir = make_weak_rm(work / "weak_rm")
    t0 = time.time()
    load_before = os.getloadavg()
    curves = {}
    for name, on in (("frozen", False), ("rm_train", True)):
        rows = run(work / name, rm_dir, a.steps, a.interval, on, a.extra)
        curves[name] = rows
    result = {"loadavg_before": load_before, "loadavg_after": os.getloadavg(), "seconds": time.time() - t0,
              "steps": a.steps, "interval": a.interval, "extra": a.extra}
    for name, rows in curves.items():
        evals = [(r["step"], r["val_reward"]) for r in rows if r["step"] % a.interval == 0 or r["step"] == a.steps]
        result[name] = {"val_reward_by_step": evals, "final_val_reward": rows[-1]["val_reward"],
                        "train_reward_by_step": [(r["step"], r["reward"]) for r in rows]}
        if name == "rm_train":
            result[name]["rm_updates"] = [{k: r[k] for k in ("step", "rm/accuracy_before", "rm/accuracy_after",
                                                             "rm/loss", "rm/replay_size", "rm/label_mean")}
                                          for r in rows if r.get("rm/updated")]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name in curves:
        xs, ys = zip(*result[name]["val_reward_by_step"])
        ax.plot(xs, ys, marker=".", label=f"{name} (final {result[name]['final_val_reward']:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation reward (rule verifier, greedy)")
    ax.set_title("weak reward model: frozen vs trained every %d steps" % a.interval)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(a.out).with_suffix(".png"), dpi=100)
    print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if "by_step" not in kk})
                      for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
