"""`python -m grpo_mega.train [overrides]`: the Hydra entry point.

Composes grpo_mega/conf/config.yaml with command-line overrides (`model=`, `parallel.tp=`, `batch.n=`,
`algo.kl_coef=`, `rollout.engine=`, `run.steps=`, ...), builds the typed configs (each validates its own
fields), starts torch.distributed (torchrun's environment, or a single local process), runs the loop and
writes metrics.jsonl, TensorBoard events and PNG plots into Hydra's run directory.

`task=successor` is the toy demo; `task=prompts model=HF_DIR data.train_files=... reward.name=math` trains an
HF model on prompt files in verl's schema.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import sys
import warnings
from pathlib import Path

from dataclasses import dataclass, field
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from grpo_mega.conf.schema import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig
from grpo_mega.trainer.loop import CheckpointConfig, EvalConfig, RolloutConfig, RunConfig


@dataclass
class DataConfig:
    """Prompt files in verl's schema (task=prompts)."""

    train_files: str = ""
    """A .jsonl or .parquet file of prompts."""
    val_files: str = ""
    """Validation prompts (default: the training file)."""


@dataclass
class RewardConfig:
    """The reward (task=prompts): a registered name (math, format, mix) or a dotted path."""

    name: str = "math"
    on_error: str = "zero"
    """'zero': score a failing sample 0 and report it; 'raise': stop."""
    weights: dict = field(default_factory=dict)
    """For name=mix: {reward name: weight}."""
    path: str = ""
    """For name=reward_model: an HF sequence-classification checkpoint."""
    overlong: str = "keep"
    """A response cut at batch.max_response_length: 'keep' its reward, 'zero' it, or 'mask' it out of the loss."""


@dataclass
class TrainConfig:
    """The whole run: every field of every component is overridable (`algo.entropy_coef=0.01`)."""

    model: str = "tiny"
    """A model_configs/ name (random init), or an HF directory (weights and tokenizer loaded from it)."""
    task: str = "successor"
    """'successor' (the toy demo) or 'prompts' (data.* files scored by reward.*)."""
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: Optional[int] = None
    """Shorthand for run.seed."""


ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _input_errors() -> tuple[type, ...]:
    from grpo_mega.rewards import RewardError
    from grpo_mega.rollout.engines import RolloutError

    return (ValueError, RewardError, RolloutError)


INPUT_ERRORS = _input_errors()


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


class _NotMegatronInfo(logging.Filter):
    """Keeps megatron-core's INFO records (it logs whole configs, e.g. the OptimizerConfig) off the terminal;
    Hydra's file handler still writes them to train.log in the run directory."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith("megatron")


def _quiet_console() -> None:
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.addFilter(_NotMegatronInfo())


def _task(c: dict, tok, batch, run_cfg):
    """The Task the loop trains on: the toy successor task, or prompt files scored by a reward."""
    from grpo_mega.data.toy import SuccessorTask
    from grpo_mega.trainer.loop import Task

    if c["task"] == "successor":
        t = SuccessorTask(tok, seed=run_cfg.seed)
        return Task(train_batch=t.train_batch, validation=t.validation, reward=t.reward, stop_token_ids=[tok.eos_token_id],
                    get_state=t.get_state, set_state=t.set_state)
    if c["task"] != "prompts":
        raise ValueError(f"task={c['task']!r} must be 'successor' or 'prompts'")
    from grpo_mega.data.dataset import PromptStream, load_prompts
    from grpo_mega.rewards import RewardStats, build_reward, score_samples

    data, rew = c.get("data", {}), c.get("reward", {})
    if not data.get("train_files"):
        raise ValueError("task=prompts needs data.train_files=PATH (.jsonl or .parquet in verl's schema)")
    train, dropped = load_prompts(data["train_files"], tok, batch.max_prompt_length)
    val = load_prompts(data.get("val_files") or data["train_files"], tok, batch.max_prompt_length)[0]
    if dropped:
        print(f"dropped {dropped} prompts longer than batch.max_prompt_length={batch.max_prompt_length}")
    stream = PromptStream(train, run_cfg.seed)
    kwargs = {k: rew[k] for k in ("weights", "path") if rew.get(k)}
    fn = build_reward(rew.get("name", "math"), **kwargs)
    stats = RewardStats()

    def reward(example, response_ids):
        text = tok.decode(response_ids, skip_special_tokens=True)
        sample = {"data_source": example.data_source, "extra_info": example.extra_info,
                  "prompt_text": tok.decode(example.prompt_ids, skip_special_tokens=True)}
        return score_samples(fn, [text], [example.ground_truth], [sample], rew.get("on_error", "zero"), stats)[0]

    return Task(train_batch=stream.next_batch, validation=lambda: val, reward=reward,
                stop_token_ids=[tok.eos_token_id], get_state=stream.get_state, set_state=stream.set_state)


def run(cfg: DictConfig, out_dir: Path) -> dict:
    import torch
    from tqdm import tqdm

    from grpo_mega.conf.schema import load_model_config
    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.rollout.embedded import EmbeddedEngine
    from grpo_mega.trainer.loop import train

    _quiet_console()
    c = OmegaConf.to_container(cfg, resolve=True)
    parallel = ParallelConfig(**c.get("parallel", {}))
    precision = PrecisionConfig(**c.get("precision", {}))
    optim = OptimConfig(**c.get("optim", {}))
    algo_cfg = AlgoConfig(**c.get("algo", {}))
    batch = BatchConfig(**c.get("batch", {}))
    rollout = RolloutConfig(**c.get("rollout", {}))
    run_cfg = RunConfig(**c.get("run", {}))
    eval_cfg = EvalConfig(**c.get("eval", {}))
    ckpt_cfg = CheckpointConfig(**c.get("checkpoint", {}))
    if c.get("seed") is not None:
        run_cfg.seed = c["seed"]
    if rollout.n is not None:
        batch = BatchConfig(**{**c.get("batch", {}), "n": rollout.n})
    hf_dir = c["model"] if (Path(c["model"]) / "config.json").is_file() else None
    if hf_dir is not None:
        from transformers import AutoTokenizer

        from grpo_mega.models.hf_io import read_hf_config

        model = read_hf_config(hf_dir)[2]
        tok = AutoTokenizer.from_pretrained(hf_dir)
    else:
        tok = make_tokenizer()
        model = load_model_config(c["model"])
        model.vocab_size = len(tok)  # the toy task's own vocabulary
    task = _task(c, tok, batch, run_cfg)
    task.overlong = c.get("reward", {}).get("overlong", "keep")

    def engine_factory():
        if rollout.placement == "dedicated":
            from grpo_mega.rollout.client import ServerClient

            return ServerClient(list(rollout.servers), timeout_s=rollout.server_timeout_s, server_tp=rollout.engine_tp)
        if rollout.engine == "embedded":
            if hf_dir is not None:
                return EmbeddedEngine.from_hf_dir(hf_dir)
            return EmbeddedEngine.from_model_config(model, seed=run_cfg.seed)
        if rollout.engine == "sglang":
            from grpo_mega.rollout.sglang_engine import SGLangEngine

            if hf_dir is not None:
                extra = {"mem_fraction_static": rollout.gpu_memory_fraction} if rollout.gpu_memory_fraction else {}
                return SGLangEngine(hf_dir, tp=rollout.engine_tp,
                                    dtype="bfloat16" if precision.params_dtype == "bf16" else "float32", **extra)
            return SGLangEngine.from_model_config(model, out_dir / "engine_init")
        raise ValueError(f"rollout.engine={rollout.engine!r} must be 'embedded' or 'sglang'")

    _single_process_env()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # taskset
    torch.set_num_threads(max(1, cpus // int(os.environ["WORLD_SIZE"])))
    with cpu_compat.cpu_device_mode():
        batch.check_packing(parallel)  # before the world size: it is a property of the config alone
        batch.check_layout(parallel, parallel.check(model, int(os.environ["WORLD_SIZE"])))
        if int(os.environ["WORLD_SIZE"]) % rollout.num_engines:
            raise ValueError(f"rollout.num_engines={rollout.num_engines} must divide the number of ranks "
                             f"({os.environ['WORLD_SIZE']}): the engines sit on evenly spaced ranks (one per node)")
        init_distributed(tp=parallel.tp, pp=parallel.pp, seed=run_cfg.seed)
        rank0 = torch.distributed.get_rank() == 0
        out_dir.mkdir(parents=True, exist_ok=True)
        jsonl = open(out_dir / "metrics.jsonl", "w") if rank0 else None
        writer = None
        if rank0:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out_dir / "tensorboard"))
        bar = tqdm(total=run_cfg.steps, desc="grpo", disable=not rank0, dynamic_ncols=True)
        wandb = None
        if rank0 and _wandb_wanted():
            import wandb

            wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-mega"), config=c, dir=str(out_dir))

        def log(row: dict) -> None:
            if not rank0:
                return
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            for k, v in row.items():
                if k != "step":
                    writer.add_scalar(k, v, row["step"])
            if wandb is not None:
                wandb.log(row, step=row["step"])
            bar.set_postfix(reward=f"{row['reward']:.2f}", val=f"{row['val_reward']:.2f}", kl=f"{row['kl']:.3f}",
                            step_s=f"{row['timing/step']:.2f}", tok_s=f"{row['perf/update_tokens_per_s']:.0f}")
            bar.update(1)

        history = train(model, parallel, precision, optim, algo_cfg, batch, rollout, run_cfg, eval_cfg, task,
                        engine_factory, log, hf_dir=hf_dir, ckpt=ckpt_cfg,
                        resolved_config={k: v for k, v in c.items() if k != "hydra"})
        bar.close()
        summary = dict(initial_val_reward=history.initial_val_reward,
                       final_val_reward=history.rows[-1]["val_reward"] if history.rows else history.initial_val_reward,
                       steps=len(history.rows), out_dir=str(out_dir))
        if rank0:
            jsonl.close()
            writer.close()
            if wandb is not None:
                wandb.finish()
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
    try:
        summary = run(cfg, out)
    except INPUT_ERRORS as e:
        if os.environ.get("GRPO_MEGA_TRACEBACK"):
            raise
        # A bad input (data, config, layout, checkpoint, reward, engine): the message names it and says what
        # was expected; a traceback through the trainer would only bury it.
        print(f"error: {e}\n(GRPO_MEGA_TRACEBACK=1 shows the traceback)", file=sys.stderr, flush=True)
        sys.exit(2)
    if "plots" in summary and summary["steps"] == 0:
        print(f"nothing to do: the run resumed at run.steps={cfg.run.steps} (raise run.steps to train further)")
    elif "plots" in summary:
        print(f"validation reward (greedy): {summary['initial_val_reward']:.2f} at step 0 -> "
              f"{summary['final_val_reward']:.2f} after {summary['steps']} steps")
        print(f"metrics: {out / 'metrics.jsonl'}; TensorBoard: {out / 'tensorboard'}")
        print("plots: " + ", ".join(summary["plots"]))


if __name__ == "__main__":
    sys.exit(main())
