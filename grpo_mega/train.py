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
from grpo_mega.rewards.rm_train import RMTrainConfig
from grpo_mega.trainer.loop import CheckpointConfig, EvalConfig, RolloutConfig, RunConfig


@dataclass
class DataConfig:
    """Prompt files in verl's schema (task=prompts)."""

    train_files: str = ""
    """A .jsonl or .parquet file of prompts."""
    val_files: str = ""
    """Validation prompts (default: the training file)."""


@dataclass(kw_only=True)
class RewardConfig:
    """The reward (task=prompts): a registered name (math, format, mix, reward_model) or a dotted path.
    Rule rewards run in a process pool, each sample on one rank (grpo_mega/rewards/scoring.py)."""

    name: str = "math"
    on_error: str = "zero"
    """'zero': score a failing or timed-out sample 0 and report it; 'raise': stop."""
    weights: dict = field(default_factory=dict)
    """For name=mix: {reward name: weight}."""
    path: str = ""
    """For name=reward_model: an HF sequence-classification checkpoint (scored in batches on rank 0)."""
    device: str = ""
    """For name=reward_model: where it runs ('cuda:1', 'cpu'); '': the trainer's device (bf16 on GPUs)."""
    rm_batch_size: int = 64
    """For name=reward_model: samples per forward."""
    rm_train: RMTrainConfig = field(default_factory=RMTrainConfig)
    """For name=reward_model: keep training it on the policy's labelled samples (iterative RL)."""
    val_reward: str = ""
    """What scores validation: '' the training reward; 'task' the task's own verifier (task=successor); or a
    rule / dotted path. With a learned reward model, a rule judges the policy rather than the model."""
    overlong: str = "keep"
    """A response cut at batch.max_response_length: 'keep' its reward, 'zero' it, or 'mask' it out of the loss."""
    num_workers: Optional[int] = None
    """Reward worker processes per rank; null: the node's cores divided among its ranks (at least 1)."""
    timeout_s: float = 30.0
    """Per-sample time limit: a sample still being scored is cut (its worker killed) and handled by on_error."""
    start_method: str = "forkserver"
    """How workers start: 'forkserver' (forked from a clean server, never from a rank's gloo/NCCL threads),
    'spawn', or 'fork'."""

    def __post_init__(self):
        if self.on_error not in ("zero", "raise"):
            raise ValueError(f"reward.on_error={self.on_error!r} must be 'zero' or 'raise'")
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers} must be >= 1 (or null: cores per rank)")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0")
        if self.start_method not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"reward.start_method={self.start_method!r} must be 'forkserver', 'spawn' or 'fork'")
        if isinstance(self.rm_train, dict):
            self.rm_train = RMTrainConfig(**self.rm_train)
        if self.rm_train.interval and self.name != "reward_model":
            raise ValueError(f"reward.rm_train.interval={self.rm_train.interval} trains a learned reward model: it "
                             f"needs reward.name=reward_model (got {self.name!r})")
        if self.rm_batch_size < 1:
            raise ValueError(f"reward.rm_batch_size={self.rm_batch_size} must be >= 1")


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
    from grpo_mega.rollout.placement import RolloutError

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


def _reward_model(rew: RewardConfig, tok, verifier):
    """reward.name=reward_model: the batched reward model, with its label source and validation judge.
    `verifier`: the task's own rule reward (task=successor), or None."""
    from grpo_mega.rewards.reward_model import RewardModelReward
    from grpo_mega.rewards.scoring import PromptReward

    pool = dict(num_workers=rew.num_workers, timeout_s=rew.timeout_s, start_method=rew.start_method)
    owned = []

    def rule(name: str, what: str, on_error: str):
        if name == "task":
            if verifier is None:
                raise ValueError(f"{what}=task needs task=successor (a task with its own verifier); with prompt "
                                 "files name a rule such as math, or a dotted path")
            return lambda examples, ids: [verifier(e, r) for e, r in zip(examples, ids)]
        r = PromptReward(tok, name, on_error=on_error, what="label source" if "labels" in what else "reward function",
                         **pool)
        owned.append(r)
        return lambda examples, ids: r.score_batch(examples, ids, list(range(len(examples))), 0)[0]

    labeler = rule(rew.rm_train.labels, "reward.rm_train.labels", "raise") if rew.rm_train.interval else None
    validate = None
    if rew.val_reward:
        judge = rule(rew.val_reward, "reward.val_reward", rew.on_error)
        validate = lambda example, ids: judge([example], [ids])[0]  # noqa: E731
    return RewardModelReward(tok, rew.path, rew.device, rew.rm_batch_size, rm_train=rew.rm_train, labeler=labeler,
                             label_name=rew.rm_train.labels, validate=validate, owned=owned)


def _task(c: dict, tok, batch, run_cfg):
    """The Task the loop trains on: the toy successor task, or prompt files scored by a reward."""
    from grpo_mega.data.toy import SuccessorTask
    from grpo_mega.trainer.loop import Task

    rew = RewardConfig(**c.get("reward", {}))
    if c["task"] == "successor":
        t = SuccessorTask(tok, seed=run_cfg.seed)
        reward = _reward_model(rew, tok, t.reward) if rew.name == "reward_model" else t.reward
        return Task(train_batch=t.train_batch, validation=t.validation, reward=reward, stop_token_ids=[tok.eos_token_id],
                    get_state=t.get_state, set_state=t.set_state, save_files=getattr(reward, "save_files", None),
                    load_files=getattr(reward, "load_files", None))
    if c["task"] != "prompts":
        raise ValueError(f"task={c['task']!r} must be 'successor' or 'prompts'")
    from grpo_mega.data.dataset import PromptStream, load_prompts
    from grpo_mega.rewards.scoring import PromptReward

    data = c.get("data", {})
    if not data.get("train_files"):
        raise ValueError("task=prompts needs data.train_files=PATH (.jsonl or .parquet in verl's schema)")
    train, dropped = load_prompts(data["train_files"], tok, batch.max_prompt_length)
    val = load_prompts(data.get("val_files") or data["train_files"], tok, batch.max_prompt_length)[0]
    if dropped:
        print(f"dropped {dropped} prompts longer than batch.max_prompt_length={batch.max_prompt_length}")
    stream = PromptStream(train, run_cfg.seed)
    kwargs = {k: getattr(rew, k) for k in ("weights", "path") if getattr(rew, k)}
    if rew.name == "reward_model":
        reward = _reward_model(rew, tok, None)
    else:
        reward = PromptReward(tok, rew.name, kwargs, on_error=rew.on_error, num_workers=rew.num_workers,
                              timeout_s=rew.timeout_s, start_method=rew.start_method)

    return Task(train_batch=stream.next_batch, validation=lambda: val, reward=reward,
                stop_token_ids=[tok.eos_token_id], get_state=stream.get_state, set_state=stream.set_state,
                save_files=getattr(reward, "save_files", None), load_files=getattr(reward, "load_files", None))


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
    rm_interval = c.get("reward", {}).get("rm_train", {}).get("interval", 0)
    if rm_interval and algo_cfg.ref_update_interval is None:  # Algorithm 1: the reference follows the RM update
        algo_cfg.ref_update_interval = rm_interval
    task.overlong = c.get("reward", {}).get("overlong", "keep")

    def engine_factory():
        if rollout.placement == "dedicated":
            from grpo_mega.rollout.client import ServerClient

            return ServerClient(list(rollout.servers), timeout_s=rollout.server_timeout_s, server_tp=rollout.engine_tp)
        if rollout.engine == "embedded":
            # On the rank's own GPU where there is one (colocated, as SGLang would be), else the CPU.
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            if hf_dir is not None:
                return EmbeddedEngine.from_hf_dir(hf_dir, device=device)
            return EmbeddedEngine.from_model_config(model, seed=run_cfg.seed, device=device)
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

        try:
            history = train(model, parallel, precision, optim, algo_cfg, batch, rollout, run_cfg, eval_cfg, task,
                            engine_factory, log, hf_dir=hf_dir, ckpt=ckpt_cfg,
                            resolved_config={k: v for k, v in c.items() if k != "hydra"})
        finally:  # the reward's worker processes end with the run, also when it fails
            getattr(task.reward, "close", lambda: None)()
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
