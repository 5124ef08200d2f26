"""Replayed rollouts (`rollout.replay_dir`): a run trains on the samples another run dumped (its rollout.dump_dir)
instead of generating them. Step s takes train_step_s.jsonl: each sample's response ids, behaviour logprobs, finish
reason and weight version (per token, as rollout.mode=async dumps them), with the prompt the task draws again in
the dumping run's order (a sample's `prompt_index`: its group's start order in async mode; a sync run's groups are
the step's draws in turn), checked against the dumped prompt ids. The engines still take the weights after every
update and run validation; the rest of the config must be the dumping run's.

What it is for: "given the same completed samples, a run resumed after a kill trains as the uninterrupted run"
(experiments/kill_campaign.py --async): in async mode which samples complete when is the servers' timing, so the
uninterrupted run to compare with is this replay of what the killed and the resumed runs trained on.

Interface: RolloutScheduler's (grpo_mega.rollout.scheduler), as the loop calls it; rank 0 reads the files and draws
the prompts, the other ranks get them with the samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from grpo_mega.engines.interface import Generation
from grpo_mega.parallel import comm
from grpo_mega.rollout.dump import read_dump
from grpo_mega.rollout.placement import RolloutError
from grpo_mega.rollout.scheduler import StepSamples


class ReplayScheduler:
    def __init__(self, engines, draw: Callable[[int], list], replay_dir: str, n: int,
                 share: Optional[Callable[[Optional[Generation], list[int]], Generation]] = None):
        self.engines, self.draw, self.dir, self.n, self.share = engines, draw, Path(replay_dir), n, share
        self.drawn: dict[int, object] = {}  # prompt index -> example drawn and not yet replayed
        self.next_index = 0

    def _example(self, index: Optional[int], prompt_ids: list[int], where: str):
        if index is None:  # a sync run's step: its groups are the next draws
            index = self.next_index
        while self.next_index <= index:
            self.drawn[self.next_index] = self.draw(1)[0]
            self.next_index += 1
        example = self.drawn.pop(index, None)
        if example is None or list(example.prompt_ids) != list(prompt_ids):
            raise ValueError(f"{where}: prompt {index} is not the one the task draws now (or was replayed twice): was "
                             "the data (data.train_files, task, run.seed) changed? Replay with the dumping run's config")
        return example

    def _read(self, step: int) -> tuple[list, Generation]:
        path = self.dir / f"train_step_{step:08d}.jsonl"
        if not path.is_file():
            raise ValueError(f"rollout.replay_dir={self.dir}: no {path.name}; the dumping run stopped before step {step} "
                             "(set run.steps to its last dumped step)")
        recs = read_dump(path)
        if not recs or len(recs) % self.n:
            raise ValueError(f"{path}: {len(recs)} samples, not whole groups of rollout.n={self.n}")
        if any("weight_version" not in r for r in recs):
            raise ValueError(f"{path}: samples without a weight_version (dumped by an older grpo_mega): it cannot be "
                             "replayed")
        examples = []
        for g in range(0, len(recs), self.n):
            group = recs[g:g + self.n]
            if len({(r.get("prompt_index"), tuple(r["prompt_ids"])) for r in group}) != 1:
                raise ValueError(f"{path}: samples {g}..{g + self.n - 1} are not one group (prompts differ)")
            index = group[0].get("prompt_index") if "token_versions" in group[0] else None
            examples.append(self._example(index, group[0]["prompt_ids"], f"{path}, sample {g}"))
        extra = {}
        if all("token_versions" in r for r in recs):
            extra = {"token_versions": [r["token_versions"] for r in recs], "prompt_index": [r["prompt_index"] for r in recs]}
        if any(x is None for r in recs for x in r["logprobs"]):
            raise ValueError(f"{path}: a non-finite behaviour logprob (written as null) cannot be replayed")
        gen = Generation(token_ids=[r["response_ids"] for r in recs], logprobs=[r["logprobs"] for r in recs],
                         finish_reasons=[r["finish_reason"] for r in recs],
                         weight_version=min(r["weight_version"] for r in recs), extra=extra)
        return examples, gen

    def result(self, step: int, submit_next: bool = True) -> StepSamples:
        """Collective: step `step`'s dumped samples."""
        examples = gen = error = None
        if dist.get_rank() == 0:
            try:
                examples, gen = self._read(step)
            except (ValueError, KeyError, TypeError) as e:
                error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        status = comm.broadcast_object({"error": error} if error else {"examples": examples}, src=0)
        if "error" in status:
            raise RolloutError(status["error"], transient=False)
        examples = status["examples"]
        if self.share is None:
            gen = comm.broadcast_object(gen, src=0)
        else:
            gen = self.share(gen, [len(e.prompt_ids) for e in examples for _ in range(self.n)])
        return StepSamples(step, examples, gen, 0.0)

    def sync_weights(self, gpt, version: int, **kwargs):
        return self.engines.sync(gpt, version=version, **kwargs)

    def reshare(self, gen: Optional[Generation], examples: list) -> Generation:
        if self.share is None:
            return gen
        return self.share(gen if dist.get_rank() == 0 else None, [len(e.prompt_ids) for e in examples for _ in range(self.n)])

    def extra(self, step: int, round: int) -> StepSamples:
        raise RuntimeError("rollout.replay_dir replays each step's trained samples: algo.dynamic_sampling=refill has "
                           "no extra rounds to replay")

    def submit_next(self, step: int) -> None:
        """Nothing is generated: the next step's samples are read when asked for."""

    def wait(self) -> None:
        """No generation in flight to wait for."""

    def take_timing(self) -> tuple[float, float]:
        return 0.0, 0.0

    def metrics(self) -> dict:
        return {}

    def rewind(self) -> None:
        """A replay does not checkpoint (refused at config time): no step to put back."""

    def task_state(self):
        return None

    def state(self) -> Optional[dict]:
        return None

    def restore(self, state: Optional[dict]) -> None:
        if state is not None:
            raise ValueError("rollout.replay_dir: a replay does not resume from a checkpoint; start it anew")

    def close(self) -> None:
        """No workers or servers of its own to end (the engines are the run's)."""
