"""`python -m grpo_mega.train [overrides]`: the Hydra entry point.

Composes grpo_mega/conf/config.yaml with command-line overrides (`model=`, `parallel.tp=`, `batch.n=`,
`algo.kl_coef=`, `rollout.engine=`, `run.steps=`, ...), builds the typed configs (each validates its own
fields), starts torch.distributed (torchrun's environment, or a single local process), runs the loop and
writes metrics.jsonl, TensorBoard events and PNG plots into Hydra's run directory.

Today the task is the toy successor task (`task=successor`) that `make demo` runs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from pathlib import Path

from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from grpo_mega.conf.schema import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig
from grpo_mega.trainer.loop import RolloutConfig, RunConfig


@dataclass
class TrainConfig:
    """The whole run: every field of every component is overridable (`algo.entropy_coef=0.01`)."""

    model: str = "tiny"
    task: str = "successor"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    run: RunConfig = field(default_factory=RunConfig)


ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _single_process_env() -> None:
    """Without torchrun: a one-rank group on this machine."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _plots(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, title in (("reward", "train reward"), ("val_reward", "validation reward (greedy)"), ("kl", "KL to reference"),
                       ("entropy", "entropy"), ("response_length", "response length")):
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
    return paths


def run(cfg: DictConfig, out_dir: Path) -> dict:
    import torch
    from tqdm import tqdm

    from grpo_mega.conf.schema import load_model_config
    from grpo_mega.data.toy import SuccessorTask, make_tokenizer
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.rollout.embedded import EmbeddedEngine
    from grpo_mega.trainer.loop import Task, train

    c = OmegaConf.to_container(cfg, resolve=True)
    if c.get("task") != "successor":
        raise ValueError(f"task={c.get('task')!r}: only the toy task 'successor' is wired into the entry point so far")
    tok = make_tokenizer()
    model = load_model_config(c["model"])
    model.vocab_size = len(tok)  # the toy task's own vocabulary
    parallel = ParallelConfig(**c.get("parallel", {}))
    precision = PrecisionConfig(**c.get("precision", {}))
    optim = OptimConfig(**c.get("optim", {}))
    algo_cfg = AlgoConfig(**c.get("algo", {}))
    batch = BatchConfig(**c.get("batch", {}))
    rollout = RolloutConfig(**c.get("rollout", {}))
    run_cfg = RunConfig(**c.get("run", {}))
    task_impl = SuccessorTask(tok, seed=run_cfg.seed)
    task = Task(train_batch=task_impl.train_batch, validation=task_impl.validation, reward=task_impl.reward,
                stop_token_ids=[tok.eos_token_id])

    def engine_factory():
        if rollout.engine == "embedded":
            return EmbeddedEngine.from_model_config(model, seed=run_cfg.seed)
        if rollout.engine == "sglang":
            from grpo_mega.rollout.sglang_engine import SGLangEngine

            return SGLangEngine.from_model_config(model, out_dir / "engine_init")
        raise ValueError(f"rollout.engine={rollout.engine!r} must be 'embedded' or 'sglang'")

    _single_process_env()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    with cpu_compat.cpu_device_mode():
        parallel.check(model, int(os.environ["WORLD_SIZE"]))
        init_distributed(tp=parallel.tp, pp=parallel.pp, seed=run_cfg.seed)
        rank0 = torch.distributed.get_rank() == 0
        out_dir.mkdir(parents=True, exist_ok=True)
        jsonl = open(out_dir / "metrics.jsonl", "w") if rank0 else None
        writer = None
        if rank0:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out_dir / "tensorboard"))
        bar = tqdm(total=run_cfg.steps, desc="grpo", disable=not rank0, dynamic_ncols=True)

        def log(row: dict) -> None:
            if not rank0:
                return
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            for k, v in row.items():
                if k != "step":
                    writer.add_scalar(k, v, row["step"])
            bar.set_postfix(reward=f"{row['reward']:.2f}", val=f"{row['val_reward']:.2f}", kl=f"{row['kl']:.3f}",
                            step_s=f"{row['step_seconds']:.2f}")
            bar.update(1)

        history = train(model, parallel, precision, optim, algo_cfg, batch, rollout, run_cfg, task, engine_factory, log)
        bar.close()
        summary = dict(initial_val_reward=history.initial_val_reward, final_val_reward=history.rows[-1]["val_reward"],
                       steps=len(history.rows), out_dir=str(out_dir))
        if rank0:
            jsonl.close()
            writer.close()
            summary["plots"] = [str(p) for p in _plots(history.rows, out_dir)]
            with open(out_dir / "summary.json", "w") as f:
                json.dump(summary, f, indent=2)
        destroy_distributed()
    return summary


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    warnings.simplefilter("ignore", FutureWarning)
    for msg in ("full scope is deprecated", ".*CUDA_DEVICE_MAX_CONNECTIONS", "The .grad attribute of a Tensor"):
        warnings.filterwarnings("ignore", message=msg)
    out = Path(HydraConfig.get().runtime.output_dir)
    summary = run(cfg, out)
    if "plots" in summary:
        print(f"validation reward (greedy): {summary['initial_val_reward']:.2f} at step 0 -> "
              f"{summary['final_val_reward']:.2f} after {summary['steps']} steps")
        print(f"metrics: {out / 'metrics.jsonl'}; TensorBoard: {out / 'tensorboard'}")
        print("plots: " + ", ".join(summary["plots"]))


if __name__ == "__main__":
    sys.exit(main())
