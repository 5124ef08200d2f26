"""The run around the update: steps and seed, checkpoints, validation, data files, torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from grpo_mega.conf.rules import positive


@dataclass(kw_only=True)
class RunConfig:
    """How long the run is and how it is seeded."""

    steps: int = 40
    """Training steps (one generation and one update each); a resumed run continues to this step."""
    seed: int = 1234
    """Seeds the model's initialisation, the data order and sampling."""
    memory_sites: int = 0
    """On CUDA: record every allocation (torch's memory history) from before the models are built through the first
    step's update, then write the Python lines (this many) holding the most memory at the peak to
    memory_sites.rank<r>.json in the run's output directory (rank 0 prints the top five): what to cut when a layout
    does not fit. Slows that step; 0: off; without a GPU nothing is recorded."""

    def __post_init__(self):
        positive("run.steps", self.steps)
        if not isinstance(self.memory_sites, int) or self.memory_sites < 0:
            raise ValueError(f"run.memory_sites={self.memory_sites!r} must be an integer >= 0 (0: off)")


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = ""
    """Checkpoint root ('' : no checkpoints)."""
    interval: int = 0
    """Save every this many steps (0: only at the end)."""
    keep_last: Optional[int] = None
    """Keep this many newest checkpoints (null: all)."""
    resume: str = "auto"
    """'auto': continue from the newest checkpoint in `dir` that verifies (start fresh when there is none; an
    error when there are some and none verifies); 'never'; or the path of one step_XXXXXXXX directory."""
    stop_file: str = ""
    """When this file appears, checkpoint after the current step and stop (slurm/train.sbatch creates it on
    USR1, before a time limit or preemption, and requeues the job; the restart loses nothing)."""
    export_hf: bool = False
    """Also write the actor as an HF directory (`hf/`, loadable by transformers/SGLang) into every checkpoint.
    Any checkpoint can be exported later: grpo-mega-convert-to-hf --ckpt DIR/step_XXXXXXXX. Under LoRA `hf/` is the
    merged model W + (alpha / r) B A and `peft/` the adapters as a PEFT LoRA directory (a LoRA checkpoint's model/
    holds the adapters alone: export it here, not later)."""
    lock_stale_s: float = 300.0
    """The run holding `dir` heartbeats its lock from a thread every lock_stale_s / 10; a lock on another host
    without a heartbeat for this long is taken over (a holder on this host or in this Slurm job is checked
    by PID). Raise it on file systems whose modification times lag by minutes."""

    def __post_init__(self):
        if self.resume not in ("auto", "never") and not self.resume.rstrip("/").split("/")[-1].startswith("step_"):
            raise ValueError(f"checkpoint.resume={self.resume!r} must be 'auto', 'never' or a checkpoint's "
                             "step_XXXXXXXX directory")
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval={self.interval} must be >= 0 (0: only at the end)")
        if self.resume not in ("auto", "never") and not self.dir:
            self.dir = str(Path(self.resume).parent)  # continue writing next to the checkpoint resumed from
        if (self.interval or self.export_hf) and not self.dir:
            raise ValueError("checkpoint.interval / checkpoint.export_hf need checkpoint.dir=PATH")
        if self.lock_stale_s <= 0:
            raise ValueError(f"checkpoint.lock_stale_s={self.lock_stale_s} must be > 0 (seconds without a "
                             "heartbeat before another run may take the lock over)")


@dataclass(kw_only=True)
class EvalConfig:
    """Validation: greedy reward and pass@k on the validation prompts."""

    interval: int = 5
    """Validate every this many steps, and before step 1 and after the last; 0: no evaluation at all."""
    pass_k: int = 4
    """Validation also samples k responses per prompt at the rollout temperature: pass@k."""
    max_prompts: int = 64
    """task=prompts without data.val_files: validate on this many training prompts (a fixed, seeded sample)."""

    def __post_init__(self):
        if not isinstance(self.interval, int) or self.interval < 0:
            raise ValueError(f"eval.interval={self.interval} must be >= 0 (0: no evaluation)")
        positive("eval.pass_k", self.pass_k)
        positive("eval.max_prompts", self.max_prompts)


@dataclass(kw_only=True)
class DataConfig:
    """Prompt files in verl's schema (task=prompts)."""

    train_files: str = ""
    """A .jsonl or .parquet file of prompts."""
    val_files: str = ""
    """Validation prompts ('': eval.max_prompts prompts sampled from the training file)."""
    cache_dir: str = ""
    """Where a .parquet file's Arrow copy is written once (keyed by its content hash) and memory-mapped by every
    rank ('': $GRPO_MEGA_CACHE/data, GRPO_MEGA_CACHE defaulting to ~/.cache/grpo_mega); a .jsonl needs none."""


@dataclass(kw_only=True)
class DistConfig:
    """torch.distributed and hang detection."""

    timeout_s: float = 1800.0
    """The world's and megatron's process groups: the longest any rank waits in one collective (a rank 0 that
    generates, scores or saves while the others wait counts against it)."""
    watchdog_factor: float = 10.0
    """Dump every thread's stack (faulthandler, into the run directory's stacks-rank<R>.txt) when a step runs
    longer than this many times the median step so far (at least watchdog_min_s); 0: no watchdog."""
    watchdog_min_s: float = 300.0
    """The watchdog never fires before a step has run this long."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"dist.timeout_s={self.timeout_s} must be > 0")
        if self.watchdog_factor != 0 and self.watchdog_factor <= 1:
            raise ValueError(f"dist.watchdog_factor={self.watchdog_factor} must be > 1 (or 0: off)")
        if not self.watchdog_min_s > 0:
            raise ValueError(f"dist.watchdog_min_s={self.watchdog_min_s} must be > 0")
