"""Where a run's metrics go, on rank 0: metrics.jsonl (one row per step), TensorBoard
events, wandb (when it has somewhere to write), a progress bar, and PNG plots at the end.

metrics.jsonl is strict JSON (RFC 8259, what jq and every JSON parser read): a non-finite value (a NaN grad_norm
when every mini-batch of a step was skipped) is written as null, and the row's `nonfinite_metrics` counts them."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path


def strict_json_row(row: dict) -> str:
    """`row` as one line of strict JSON: NaN and infinities as null, counted in `nonfinite_metrics` (only present
    when some were)."""
    out = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    nonfinite = sum(v is None and row[k] is not None for k, v in out.items())
    if nonfinite:
        out["nonfinite_metrics"] = nonfinite
    return json.dumps(out, allow_nan=False)


class MetricSinks:
    """Opened on every rank; only rank 0 writes. `log(row)` after each step, `close(rows)` at the end."""

    def __init__(self, out_dir: Path, steps: int, config: dict, rank0: bool):
        from tqdm import tqdm

        self.out_dir, self.rank0 = out_dir, rank0
        self.jsonl = self.writer = self.wandb = None
        self.bar = tqdm(total=steps, desc="grpo", disable=not rank0, dynamic_ncols=True)
        if not rank0:
            return
        from torch.utils.tensorboard import SummaryWriter

        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / "metrics.jsonl", "a")  # a rerun into the same directory adds to it
        self.writer = SummaryWriter(str(out_dir / "tensorboard"))
        if _wandb_wanted():
            import wandb

            wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-mega"), config=config, dir=str(out_dir))
            self.wandb = wandb

    def log(self, row: dict) -> None:
        if not self.rank0:
            return
        self.jsonl.write(strict_json_row(row) + "\n")
        self.jsonl.flush()
        for k, v in row.items():
            if k != "step":
                self.writer.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(row, step=row["step"])
        val = {"val": f"{row['val_reward']:.2f}"} if "val_reward" in row else {}
        self.bar.set_postfix(reward=f"{row['reward']:.2f}", **val, kl=f"{row['kl']:.3f}",
                             step_s=f"{row['timing/step']:.2f}", tok_s=f"{row['perf/update_tokens_per_s']:.0f}")
        self.bar.update(1)

    def abort(self) -> None:
        """The run failed: end the progress bar's line (the error is printed on a line of its own) and flush
        what was written."""
        self.bar.close()
        if self.rank0:
            self.jsonl.flush()
            self.writer.flush()

    def close(self, rows: list[dict]) -> list[Path]:
        """Close every sink; rank 0 returns the plots it wrote."""
        self.bar.close()
        if not self.rank0:
            return []
        self.jsonl.close()
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        return _plots(rows, self.out_dir)


def _plots(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, title in (("reward", "train reward"), ("val_reward", "validation reward (greedy)"), ("kl", "KL to reference"),
                       ("entropy", "entropy"), ("response_length", "response length")):
        if not rows or key not in rows[0]:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker=".")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    if rows and "timing/step" in rows[0]:
        from grpo_mega.trainer.timing import WALL_PHASES as PHASES  # they add up to the step

        fig, ax = plt.subplots(figsize=(6, 3.6))
        steps = [r["step"] for r in rows]
        ax.stackplot(steps, *[[r[f"timing/{p}"] for r in rows] for p in PHASES], labels=PHASES)
        ax.plot(steps, [r["timing/step"] for r in rows], color="black", lw=1, label="step")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.set_title("where each step's time went (max over ranks)")
        ax.legend(fontsize=7, loc="upper left", ncol=3)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / "timing.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _wandb_wanted() -> bool:
    """wandb logs the run when it is installed and has somewhere to write: WANDB_MODE=offline, or an API key
    (WANDB_API_KEY, or `wandb login`'s ~/.netrc entry). WANDB_MODE=disabled turns it off. Without either, a
    run never stops to ask for a login."""
    if importlib.util.find_spec("wandb") is None or os.environ.get("WANDB_MODE") == "disabled":
        return False
    if os.environ.get("WANDB_MODE") == "offline" or os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False
