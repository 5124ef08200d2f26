"""The tool-use task, measured (issue 26): GRPO on task=tens_tool (the tens digit of a 2-digit product; the
tiny model, random init) once with the calculator (rollout.multi_turn on: a turn ending <tool_call> gets the
product as the tool's turn) and once without it (multi-turn off: the same model must guess), the same seed,
model, batch and steps. Validation reward (greedy, 64 prompts) by step for both; JSON and a PNG of both curves.

    python tools/tool_task.py [--steps 60] [--interval 10] [--out bench_results/tool_task.json] [OVERRIDE ...]

Measured (bench_results/tool_task.json): it does not learn yet. From a random start the guessing path (a digit
as the first token, then <eos>) reaches chance (0.1) within ~20 steps, as fast as the tool path could, and the
policy stops calling the tool (tool calls per sample 0.3 -> 0.0) before the copy from the tool's turn is
learned. Tried and not enough (80-100 steps each): the result as '<tool>2146</tool>' or '<tool>4', budgets
8/12/16, lr 1e-3/2e-3, reward.overlong=zero, algo.entropy_coef=0.02, algo.kl_coef=0.1, tied embeddings, and
rollout.n=16 with lr 3e-3 and kl_coef 0.05 (calls 0.48 -> 0.07 by step 22). A copy learned from ~1.5 rewarded
tool samples a step needs far more steps than these CPU runs had; the next things to try are a larger batch
on a GPU, or a warm start that already copies.
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

TOOL = ["rollout.multi_turn.enable=true", "rollout.multi_turn.parser=bare", "rollout.multi_turn.call_stop=['<tool_call>']",
        "rollout.multi_turn.max_turns=2"]
COMMON = ["task=tens_tool", "batch.max_response_length=8", "optim.lr=2e-3", "reward.overlong=zero"]


def start(out: Path, steps: int, interval: int, with_tool: bool, extra: list[str]):
    cmd = [sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={out}", f"run.steps={steps}",
           f"eval.interval={interval}", *COMMON, *(TOOL if with_tool else []), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    return cmd, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--work", default="/tmp/grpo_mega_tool_task")
    p.add_argument("--out", default=str(REPO / "bench_results" / "tool_task.json"))
    p.add_argument("--summarize", action="store_true", help="only re-read the runs already in --work")
    p.add_argument("extra", nargs="*", help="more overrides for both runs, e.g. optim.lr=2e-3")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0, load_before = time.time(), os.getloadavg()
    if a.summarize:
        runs = {name: ([sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={work / name}", f"run.steps={a.steps}",
                        f"eval.interval={a.interval}", *COMMON, *(TOOL if on else []), *a.extra], None)
                for name, on in (("with_tool", True), ("without_tool", False))}
    else:
        runs = {name: start(work / name, a.steps, a.interval, on, a.extra) for name, on in (("with_tool", True),
                                                                                              ("without_tool", False))}
    result = {"loadavg_before": load_before, "steps": a.steps, "interval": a.interval, "extra": a.extra,
              "commands": {}}
    for name, (cmd, proc) in runs.items():  # both at once: the same machine load for both
        if proc is not None:
            _, err = proc.communicate(timeout=7200)
            if proc.returncode != 0:
                raise SystemExit(f"run failed ({' '.join(cmd)}):\n{err[-3000:]}")
        rows = [json.loads(line) for line in open(work / name / "metrics.jsonl")]
        summary = json.loads((work / name / "summary.json").read_text())
        evals = [(0, summary["initial_val_reward"])] + [(r["step"], r["val_reward"]) for r in rows
                                                        if r["step"] % a.interval == 0 or r["step"] == a.steps]
        result["commands"][name] = "python -m grpo_mega.train " + " ".join(cmd[4:])
        result[name] = {"initial_val_reward": summary["initial_val_reward"], "final_val_reward": rows[-1]["val_reward"],
                        "best_val_reward": max(v for _, v in evals), "val_reward_by_step": evals,
                        "train_reward_by_step": [(r["step"], round(r["reward"], 4)) for r in rows],
                        "tool_calls_by_step": [(r["step"], round(r.get("multi_turn/tool_calls", 0.0), 3)) for r in rows],
                        "seconds_per_step": sum(r["timing/step"] for r in rows) / len(rows)}
    result.update(seconds=time.time() - t0, loadavg_after=os.getloadavg())
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in ("with_tool", "without_tool"):
        xs, ys = zip(*result[name]["val_reward_by_step"])
        ax.plot(xs, ys, marker="o", label=name.replace("_", " "))
    ax.axhline(0.1, color="grey", ls=":", label="chance (1 in 10)")
    ax.set(xlabel="step", ylabel="validation reward (greedy)", title="task=tens_tool, tiny model, CPU", ylim=(0, 1.05))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if "by_step" not in kk} if isinstance(v, dict) else v
                      for k, v in result.items() if k != "commands"}, indent=1))


if __name__ == "__main__":
    main()
