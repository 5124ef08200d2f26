"""The tool-use task, measured (issue 26): GRPO on task=lookup_tool (the letter a-j stored under a 3-digit key,
drawn at random per key: only the `lookup` tool knows it; validation keys are never trained on), once with the
tool (rollout.multi_turn on: a turn ending <tool_call> gets the tool's turn `<tool>x`) and once without it
(multi-turn off: the model must guess), from the same start, with the same seed, batch and steps. Validation
reward (greedy, 64 keys) by step for both; JSON and a PNG of both curves.

    python tools/tool_task.py [--warm-steps 30] [--steps 150] [--interval 10] [--out bench_results/tool_task.json]

The start: a warm-up run with a shaping reward, task=lookup_call (1.0 for calling the tool, whatever the
answer; the tiny model from random init, 30 steps), exported as an HF directory: it calls the tool (93-99% of
samples) but cannot read its result. Both measured runs start from it and their reward is the answer's only,
nothing for calling: the shaping is gone.

Measured (by hand, the same commands; bench_results/tool_task_lookup_attempts.json): it does NOT learn. After
the warm-up the reward after a call stays at 0.01-0.08 (below guessing, 1 in 10) and calls fall 0.99 -> 0.1
within 30 steps; from random init (also with half the training prompts already ending with the tool's turn)
calls fall 0.1 -> 0 within 20-40 steps; task=tens_tool the same (bench_results/tool_task_tens.json). The
policy abandons calling whenever reading is not already more rewarding than guessing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MT = ["rollout.multi_turn.enable=true", "rollout.multi_turn.parser=bare", "rollout.multi_turn.call_stop=['<tool_call>']"]
TOOLS = {"with_tool": "grpo_mega.data.toy_tools:KeyLookup", "tool_unavailable": "grpo_mega.data.toy_tools:UnavailableLookup"}
COMMON = ["task=lookup_tool", "batch.max_response_length=28", *MT, "rollout.multi_turn.max_turns=2"]
WARM = ["task=lookup_call", "batch.max_response_length=28", *MT, "rollout.multi_turn.max_turns=1",
        f"rollout.multi_turn.tools=['{TOOLS['with_tool']}']"]
"""The warm-up runs one turn: the model's turn ends at its call, no tool runs, nothing after a result is trained."""
TIED_TINY = "model_configs/tiny.yaml with tie_word_embeddings: true"


def start(argv: list[str]):
    cmd = [sys.executable, "-m", "grpo_mega.train", *argv]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    return cmd, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(cmd, proc) -> None:
    _, err = proc.communicate(timeout=7200)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{err[-3000:]}")


def curves(run: Path, interval: int, steps: int) -> dict:
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    summary = json.loads((run / "summary.json").read_text())
    evals = [(0, summary["initial_val_reward"])] + [(r["step"], r["val_reward"]) for r in rows
                                                    if r["step"] % interval == 0 or r["step"] == steps]
    return {"initial_val_reward": summary["initial_val_reward"], "final_val_reward": rows[-1]["val_reward"],
            "best_val_reward": max(v for _, v in evals), "val_reward_by_step": evals,
            "train_reward_by_step": [(r["step"], round(r["reward"], 4)) for r in rows],
            "tool_calls_by_step": [(r["step"], round(r.get("multi_turn/tool_calls", 0.0), 3)) for r in rows],
            "seconds_per_step": sum(r["timing/step"] for r in rows) / len(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--tied", type=int, default=1, help="1: the tiny model with tied embeddings (0: model=tiny)")
    p.add_argument("--runs", default="with_tool,tool_unavailable")
    p.add_argument("--work", default="/tmp/grpo_mega_tool_task")
    p.add_argument("--out", default=str(REPO / "bench_results" / "tool_task.json"))
    p.add_argument("extra", nargs="*", help="more overrides for both measured runs, e.g. rollout.n=16")
    a = p.parse_args()
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    t0, load_before = time.time(), os.getloadavg()
    model = "tiny"
    if a.tied:  # the tiny model, its input and output embeddings one matrix
        import yaml

        cfg = yaml.safe_load((REPO / "model_configs" / "tiny.yaml").read_text())
        model = str(work / "tiny-tied.yaml")
        Path(model).write_text(yaml.safe_dump({**cfg, "tie_word_embeddings": True}))

    # 1. the warm-up (shaping: 1.0 for a call, one turn); exported with its tokenizer
    warm = WARM + [f"model={model}", f"optim.lr={a.lr}", f"hydra.run.dir={work / 'warm'}", f"run.steps={a.warm_steps}",
                   f"eval.interval={a.interval}", f"checkpoint.dir={work / 'warm_ckpt'}", "checkpoint.export_hf=true"]
    finish(*start(warm))
    hf = work / "warm_hf"
    shutil.copytree(work / "warm_ckpt" / f"step_{a.warm_steps:08d}" / "hf", hf)
    from grpo_mega.data.toy_tools import make_lookup_tokenizer

    make_lookup_tokenizer().save_pretrained(str(hf))
    t_warm = time.time() - t0

    # 2. the measured runs, both at once (the same machine load for both): the same command, the tool differs
    result = {"loadavg_before": load_before, "warm_steps": a.warm_steps, "steps": a.steps, "interval": a.interval,
              "lr": a.lr, "model": TIED_TINY if a.tied else "tiny", "extra": a.extra,
              "commands": {"warm_up": "python -m grpo_mega.train " + " ".join(warm)},
              "warm_up": curves(work / "warm", a.interval, a.warm_steps), "warm_up_seconds": round(t_warm, 1)}
    runs = {}
    for name in a.runs.split(","):
        argv = [f"hydra.run.dir={work / name}", f"model={hf}", f"run.steps={a.steps}", f"eval.interval={a.interval}",
                f"optim.lr={a.lr}", *COMMON, f"rollout.multi_turn.tools=['{TOOLS[name]}']", *a.extra]
        runs[name] = start(argv)
        result["commands"][name] = "python -m grpo_mega.train " + " ".join(argv)
    for name, (cmd, proc) in runs.items():
        finish(cmd, proc)
        result[name] = curves(work / name, a.interval, a.steps)
    result.update(seconds=round(time.time() - t0, 1), loadavg_after=os.getloadavg())
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in a.runs.split(","):
        xs, ys = zip(*result[name]["val_reward_by_step"])
        ax.plot(xs, ys, marker="o", label=name.replace("_", " "))
    xs, ys = zip(*result[a.runs.split(",")[0]]["tool_calls_by_step"])
    ax.plot(xs, ys, color="grey", lw=0.8, label=f"tool calls per sample ({a.runs.split(',')[0]})")
    ax.axhline(0.1, color="grey", ls=":", label="chance (1 in 10)")
    ax.set(xlabel="step", ylabel="validation reward (greedy)", title="task=lookup_tool, tiny model, CPU",
           ylim=(0, 1.05))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if "by_step" not in kk} if isinstance(v, dict) else v
                      for k, v in result.items() if k != "commands"}, indent=1))


if __name__ == "__main__":
    main()
