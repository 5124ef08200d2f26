"""What a run trains on (a Task: prompts, the reward, a validation set, the stop token) and the registry of tasks
by name, `task=`: each entry names the function that builds its Task from the config and a tokenizer, and the
tokenizer a model_configs/ model (random init, no tokenizer of its own) runs with. The config checks `task=`
against this registry; setup builds through it. A task of your own: `TASKS.register("mine")(TaskSpec(...))`
in a module your run imports, or `task=pkg.module:build` (a function (cfg, tokenizer) -> Task) on the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from grpo_mega.registry import Registry, import_path


@dataclass(kw_only=True)
class Task:
    """What the loop trains on: prompts, a reward, a validation set, the stop token."""

    train_batch: Callable[[int], list]  # size -> examples with .prompt_ids
    validation: Callable[[], list]
    reward: Callable[[object, list[int]], float]
    """Per sample (validation): reward(example, response_ids), with `trajectory=` (Generation.trajectories) for
    multi-turn rollouts when it takes one; a rewards.scoring.StepScorer also scores a step's samples, once each."""
    stop_token_ids: list[int]
    get_state: Optional[Callable[[], object]] = None
    """The task's own state (data cursor, sampler RNG) for checkpoints; JSON-serialisable."""
    set_state: Optional[Callable[[object], None]] = None
    save_files: Optional[Callable[[Path], None]] = None
    """Rank 0 writes the task's non-JSON state (a reward model in training) into a checkpoint's directory."""
    load_files: Optional[Callable[[Path], None]] = None
    """Every rank is given that directory on resume."""


@dataclass(frozen=True)
class TaskSpec:
    build: str
    """`module:function`, (cfg: TrainConfig, tokenizer) -> Task; imported when the task is built."""
    tokenizer: str = "grpo_mega.data.toy:make_tokenizer"
    """`module:function`, () -> the tokenizer of a model_configs/ model (an HF directory brings its own)."""


TASKS: Registry[TaskSpec] = Registry("task")
TASKS.register("successor")(TaskSpec(build="grpo_mega.trainer.task:successor_task"))
TASKS.register("prompts")(TaskSpec(build="grpo_mega.trainer.task:prompts_task"))
for _name in ("product_tool", "tens_tool", "lookup_tool", "lookup_call"):  # the toy tool tasks (docs/agents.md)
    TASKS.register(_name)(TaskSpec(build=f"grpo_mega.data.toy_tools:{_name}_task",
                                   tokenizer=f"grpo_mega.data.toy_tools:{_name}_tokenizer"))


def task_spec(name: str) -> TaskSpec:
    """The registered task `name`, or a TaskSpec for `pkg.module:function`; a ValueError listing the names."""
    if ":" in name:
        return TaskSpec(build=name)
    return TASKS.get(name)


def build_task(cfg, tok) -> Task:
    """The Task of cfg.task."""
    return import_path(task_spec(cfg.task).build, "task")(cfg, tok)


def task_tokenizer(name: str):
    """The tokenizer a model_configs/ model runs with under task `name`."""
    return import_path(task_spec(name).tokenizer, "task")()
