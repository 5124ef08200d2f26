"""`python -m grpo_mega.train [overrides]`: the Hydra entry point.

Composes grpo_mega/conf/config.yaml (the defaults, then the task's settings: conf/task/<task>.yaml) with
command-line overrides (`model=`, `parallel.tp=`, `rollout.n=`,
`algo.kl_coef=`, `rollout.engine=`, `run.steps=`, ...) into one TrainConfig (grpo_mega/conf/schema.py and its components beside it: every
component checks itself, the root checks the combinations, all before any model is built; docs/config.md
lists every field), starts torch.distributed (torchrun's environment, or a single local process), builds
the run (grpo_mega.trainer.setup), trains (grpo_mega.trainer.loop) and writes metrics.jsonl, TensorBoard
events and PNG plots into Hydra's run directory.

`task=successor` is the toy demo; `task=prompts model=HF_DIR data.train_files=... reward.name=math` trains an
HF model on prompt files in verl's schema.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from grpo_mega.conf.schema import TrainConfig, check_renamed, register_schema
from grpo_mega.processes import free_port


register_schema()


def _input_errors() -> tuple[type, ...]:
    from grpo_mega.rewards import RewardError
    from grpo_mega.rollout.placement import RolloutError
    from grpo_mega.trainer.guards import RunStopped

    return (ValueError, RewardError, RolloutError, RunStopped)


INPUT_ERRORS = _input_errors()

EXIT_INPUT = 2
"""Exit status of a run refused for a bad input (data, config, layout, checkpoint, reward, engine), after one line
that names it."""
SAY_ONCE_WAIT_S = 30.0
"""How long a rank other than 0 holds back an error that every rank meets before torch.distributed starts (a config,
a layout): rank 0 says it, torchrun then ends the others. Said after this wait, it was this rank's own (a model
directory that only this node lacks), and rank 0 is waiting in the rendezvous."""

EXIT_REQUEUE = 75
"""Exit status of a run ended by a transient failure (a rollout server that did not answer, or answered 5xx,
through every retry): sysexits' EX_TEMPFAIL. torchrun passes on 1 for any failed rank, so the run also leaves
REQUEUE_FILE in its run directory; slurm/train.sbatch requeues the job on either (docs/slurm.md)."""
REQUEUE_FILE = "REQUEUE"


def single_process_env() -> None:
    """Without torchrun: a one-rank group on this machine (the benchmarks that build an actor in-process use it too)."""
    if "WORLD_SIZE" in os.environ:
        return
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


class _NotMegatronInfo(logging.Filter):
    """Keeps megatron-core's INFO records (it logs whole configs, e.g. the OptimizerConfig) off the terminal;
    Hydra's file handler still writes them to train.log in the run directory."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith("megatron")


def _quiet_console() -> None:
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.addFilter(_NotMegatronInfo())


def run(cfg: DictConfig, out_dir: Path) -> dict:
    """One training run from Hydra's composed config; returns its summary (rank 0 also writes summary.json)."""
    import torch

    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.loop import train
    from grpo_mega.trainer.setup import build_run, resolve_model, threads_per_rank
    from grpo_mega.trainer.sinks import MetricSinks

    _quiet_console()
    try:  # every rank meets the same config and layout: an error here is said once (_said_by_rank0)
        config = TrainConfig.from_hydra(cfg)
        model, tok, hf_dir = resolve_model(config)
        single_process_env()
        config.check_layout(model, int(os.environ["WORLD_SIZE"]))  # before any process group or model
    except INPUT_ERRORS as e:
        e.before_distributed = True
        raise
    torch.set_num_threads(threads_per_rank())
    init_distributed(tp=config.parallel.tp, pp=config.parallel.pp, seed=config.run.seed,
                     timeout_s=config.dist.timeout_s, ep=config.parallel.ep)
    rank0 = torch.distributed.get_rank() == 0
    sinks = MetricSinks(out_dir, config.run.steps, config.to_dict(), rank0)
    try:
        built = build_run(config, model, tok, hf_dir, out_dir)
        try:
            history = train(built, sinks.log)
        finally:  # the engines and the reward's worker processes end with the run, also when it fails
            built.close()
            getattr(built.task.reward, "close", lambda: None)()
    except BaseException:
        sinks.abort()  # the progress bar's line ends before the error is printed
        raise
    plots = sinks.close(history.rows)
    final = history.rows[-1].get("val_reward") if history.rows else None
    summary = dict(initial_val_reward=history.initial_val_reward,
                   final_val_reward=final if final is not None else history.initial_val_reward,
                   steps=len(history.rows), out_dir=str(out_dir))
    if rank0:
        summary["plots"] = [str(p) for p in plots]
        with open(out_dir / "summary.json", "w") as f:
            json.dump(summary, f, indent=2)
    destroy_distributed()
    return summary


def _fallback_note() -> None:
    """megatron-core warns four times at import, in eight lines, that it falls back to torch's optimizers and
    kernels without Transformer Engine and Apex. On a CPU that is the only way it runs: nothing is said. On a GPU
    rank 0 says it once, in one line (`pip install -e .[gpu]` brings Transformer Engine)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available() or os.environ.get("RANK", "0") != "0":
        return
    if importlib.util.find_spec("transformer_engine") is None and importlib.util.find_spec("apex") is None:
        print("note: Transformer Engine and Apex are not installed: megatron-core falls back to torch's optimizers "
              "and kernels (pip install -e .[gpu] installs Transformer Engine)", file=sys.stderr, flush=True)


def main() -> None:
    """Refuses a setting's old name (one line, naming the new one) and an override Hydra cannot apply (a misspelt
    key, a value of the wrong type, an unknown task) before Hydra starts the run: one line, exit status 2, said by
    rank 0 alone (every rank has the same command line)."""
    try:
        check_renamed(sys.argv[1:])
        check_overrides(sys.argv[1:])
    except ValueError as e:
        if os.environ.get("RANK", "0") != "0":
            time.sleep(SAY_ONCE_WAIT_S)  # rank 0 says it, and torchrun ends this rank first
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_INPUT)
    _hydra_main()


def check_overrides(argv: list[str]) -> None:
    """Composes the command line's overrides as Hydra will (grpo_mega/conf/config.yaml); Hydra's or OmegaConf's
    error becomes a ValueError of one line. A command line with Hydra's own flags (--cfg, --help, -m, ...) is left
    to Hydra; hydra.* overrides only place the run's files."""
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="grpo_mega.conf", version_base=None):
            compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()


def one_line(e: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages, with their causes', in one line: what failed and why, without
    the full_key / object_type trailers OmegaConf adds (they repeat the override)."""
    lines, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).split("\nConfig search path:")[0]  # where Hydra looked: its own paths, not the user's
        head, _, options = text.partition("\nAvailable options in ")  # a config group's choices, one a line
        if options:
            group, _, names = options.partition(":")
            head += f"\nchoose one of {group}: " + ", ".join(n.strip() for n in names.split() if n.strip())
        for ln in head.splitlines():
            ln = ln.strip().rstrip(".")
            if ln and not ln.startswith(("full_key:", "object_type=", "reference_type=", "To append to your config")) \
                    and "$VALUE" not in ln \
                    and ln not in lines:
                lines.append(ln)
        e = e.__cause__ or e.__context__
    return "; ".join(lines) or "invalid override"


@hydra.main(version_base=None, config_path="conf", config_name="config")
@record  # under torchrun, a rank's exception goes to its error file: the root cause of a failed job
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    warnings.simplefilter("ignore", FutureWarning)
    for msg in ("full scope is deprecated", ".*CUDA_DEVICE_MAX_CONNECTIONS", "The .grad attribute of a Tensor",
                "Transformer Engine and Apex are not installed"):  # megatron-core, once per module: see _fallback_note
        warnings.filterwarnings("ignore", message=msg)
    _fallback_note()
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = run(cfg, out)
    except INPUT_ERRORS as e:
        if os.environ.get("GRPO_MEGA_TRACEBACK"):
            raise
        if getattr(e, "transient", False):  # every rank leaves the mark: torchrun may end the others first
            tmp = out / f".{REQUEUE_FILE}.{os.getpid()}"
            tmp.write_text(f"{e}\n")
            os.replace(tmp, out / REQUEUE_FILE)
            print(f"error: {e}\n(transient: exit status {EXIT_REQUEUE}; slurm/train.sbatch requeues the job, which "
                  f"resumes from its newest checkpoint)", file=sys.stderr, flush=True)
            sys.exit(EXIT_REQUEUE)
        # A bad input (data, config, layout, checkpoint, reward, engine): the message names it and says what
        # was expected; a traceback through the trainer would only bury it.
        if getattr(e, "before_distributed", False) and os.environ.get("RANK", "0") != "0":
            time.sleep(SAY_ONCE_WAIT_S)  # rank 0 says it, and torchrun ends this rank first
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_INPUT)
    if "plots" in summary and summary["steps"] == 0:
        print(f"nothing to do: the run resumed at run.steps={cfg.run.steps} (raise run.steps to train further)")
    elif "plots" in summary and summary["initial_val_reward"] is None:
        print(f"trained {summary['steps']} steps (eval.interval=0: no evaluation)")
    elif "plots" in summary:
        print(f"validation reward (greedy): {summary['initial_val_reward']:.2f} at step 0 -> "
              f"{summary['final_val_reward']:.2f} after {summary['steps']} steps")
        print(f"metrics: {out / 'metrics.jsonl'}; TensorBoard: {out / 'tensorboard'}")
        print("plots: " + ", ".join(summary["plots"]))


if __name__ == "__main__":
    sys.exit(main())
