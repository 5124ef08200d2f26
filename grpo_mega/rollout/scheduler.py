"""When each step's samples are generated: in turn with training (`rollout.off_policy_steps=0`), or one step
ahead (`=1`, dedicated placement): the batch of step k+1 is generated on the rollout servers, by a background
thread on global rank 0, while step k trains on the weights synced before it.

Owns the in-flight request and the order around it: `submit(step)` draws the step's prompts from the task (on
every rank, so the draws are those of the serial loop) and, one step ahead, starts the generation;
`wait()` (collective) waits for it and hands the samples, or the failure, from rank 0 to every rank (with
`share`, grpo_mega.rollout.routing: each rank only its DP replica's samples);
`sync_weights` refuses to run while a generation is in flight, so that a server's weights never change while it
generates; `result(step)` is the batch to train on. Versions (docs/design.md, "Versions and
off-policy"): version v is the trainer's weights after v steps, synced as `version=v`; step k trains from
version k-1. In turn, step k's samples carry k-1; one
step ahead, step 1's carry 0 and step k >= 2's carry k-2 (the weights step k-1 trained from: one version
behind the trainer's). `state()` / `restore()` carry a generated, not yet trained batch through a checkpoint.
What the samples are made of (the client, the engines, the weight transfer) is grpo_mega.engines'.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

from grpo_mega.parallel import comm
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.placement import Engines, RolloutError
from grpo_mega.engines.validate import check_generation


@dataclass
class SamplingArgs:
    """What every training generation asks for (the loop's config, resolved once)."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: list[int]
    seed: int
    """The run's seed: step k samples with seed * 1_000_003 + k (the per-sample seeds derive from it)."""

    rows: bool = False
    """Give each prompt's row (example_row) to the engines: multi-turn engines read its tools_kwargs."""

    def step_seed(self, step: int, round: int = 0) -> int:
        """Round `round` of step `step` (algo.dynamic_sampling=refill's extra rounds: 1, 2, ...)."""
        return self.seed * 1_000_003 + step + round * (1 << 40)

    def rows_of(self, examples: list) -> dict:
        """{"rows": [example_row(e), ...]} when the engines take rows, else {}."""
        return {"rows": [example_row(e) for e in examples]} if self.rows else {}


def example_row(example) -> dict:
    """A prompt's row as the multi-turn engine and agent loops see it: data_source, extra_info (tools_kwargs
    among it), ground_truth (a toy example's answer) and index."""
    return {"data_source": getattr(example, "data_source", ""), "extra_info": dict(getattr(example, "extra_info", None) or {}),
            "ground_truth": getattr(example, "ground_truth", getattr(example, "answer", None)),
            "index": getattr(example, "index", None)}


@dataclass
class StepSamples:
    """One step's prompts and their samples."""

    step: int
    examples: list
    gen: Generation
    seconds: float = 0.0
    """Seconds the engines spent generating it."""


@dataclass
class _Pending:
    step: int
    examples: list
    task_state: object  # the task's state before these examples were drawn (what a checkpoint resumes from)
    thread: Optional[threading.Thread] = None
    out: dict = field(default_factory=dict)  # rank 0's thread: {"gen": Generation, "seconds": s} or {"error": str}


class RolloutScheduler:
    """The loop's source of samples. `draw(size)` is the task's prompt sampler, `get_state`/`set_state` its
    state (or None). Collective where noted: every rank calls every method in the same order."""

    def __init__(self, engines: Engines, draw: Callable[[int], list], batch_size: int, sampling: SamplingArgs,
                 off_policy_steps: int = 0, last_step: Optional[int] = None, get_state: Optional[Callable[[], object]] = None,
                 set_state: Optional[Callable[[object], None]] = None,
                 share: Optional[Callable[[Optional[Generation], list[int]], Generation]] = None):
        if off_policy_steps not in (0, 1):
            raise ValueError(f"rollout.off_policy_steps={off_policy_steps} must be 0 or 1")
        if off_policy_steps and (len(engines.ranks) != 1 or engines.ranks[0] != 0):
            raise ValueError("rollout.off_policy_steps=1 needs one client on rank 0 (rollout.placement=dedicated)")
        self.engines, self.draw, self.batch_size, self.sampling = engines, draw, batch_size, sampling
        self.ahead, self.last_step = off_policy_steps, last_step
        self.get_state, self.set_state = get_state, set_state
        self.share = share  # rank 0's samples -> what each rank needs (grpo_mega.rollout.routing); None: all to all
        self.pending: Optional[_Pending] = None  # drawn, maybe generating
        self.ready: Optional[StepSamples] = None  # generated, not yet handed out
        self.ready_task_state = None
        self.last: Optional[StepSamples] = None  # what result() handed out last, and the task's state before it
        self.last_task_state = None
        self.waited = self.generated = 0.0  # seconds, since the last take_timing()

    # ---- the step's samples -----------------------------------------------------------------------

    def submit(self, step: int) -> None:
        """Draw step `step`'s prompts (every rank); one step ahead, start generating them on rank 0's thread."""
        if self.pending is not None:
            raise RuntimeError(f"submit({step}) while step {self.pending.step}'s batch is still pending")
        state = copy.deepcopy(self.get_state()) if self.get_state is not None else None
        self.pending = _Pending(step, self.draw(self.batch_size), state)
        if self.ahead and dist.get_rank() == 0:
            pending, client, s = self.pending, self.engines.local, self.sampling

            def run():
                t0 = time.perf_counter()
                try:
                    prompts = [e.prompt_ids for e in pending.examples]
                    gen = client.generate(prompts, s.n, s.temperature, s.top_p, s.max_new_tokens, s.stop_token_ids,
                                          s.step_seed(pending.step), **s.rows_of(pending.examples))
                    check_generation(gen, self.engines.spec, [len(p) for p in prompts for _ in range(s.n)])
                    pending.out.update(gen=gen, seconds=time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - handed to every rank by wait()
                    pending.out["error"] = (f"the rollout engine ({type(client).__name__}, on rank 0) failed "
                                            f"generating step {pending.step}: {type(e).__name__}: {e}")
                    pending.out["transient"] = bool(getattr(e, "transient", False))

            pending.thread = threading.Thread(target=run, name=f"rollout-step{step}", daemon=True)
            pending.thread.start()

    def wait(self) -> None:
        """Collective: finish the pending batch (wait for rank 0's thread, or generate it now when in turn)
        and give its samples to every rank; a failed generation raises RolloutError on every rank."""
        if self.pending is None:
            return
        p, t0 = self.pending, time.perf_counter()
        to_all = self.share is None
        if not self.ahead:
            gen = self._generate(p.examples, self.sampling.step_seed(p.step))
            seconds = time.perf_counter() - t0
        else:
            if p.thread is not None:
                p.thread.join()
            out = p.out if dist.get_rank() == 0 else None
            if not to_all:  # the status to every rank; the samples are shared out below
                out = out if out is None else {k: v for k, v in out.items() if k != "gen"}
            out = comm.broadcast_object(out, src=0)
            if "error" in out:
                self.pending = None
                raise RolloutError(out["error"], transient=out.get("transient", False))
            gen, seconds = out["gen"] if to_all else p.out.get("gen"), out["seconds"]
        if not to_all:
            gen = self.reshare(gen, p.examples)
        self.waited += time.perf_counter() - t0
        self.generated += seconds
        self.ready, self.ready_task_state, self.pending = StepSamples(p.step, p.examples, gen, seconds), p.task_state, None

    def result(self, step: int, submit_next: bool = True) -> StepSamples:
        """Collective: the batch step `step` trains on (the trainer holds version step-1); its samples are
        checked to be at most `off_policy_steps` versions older. One step ahead, the next step's generation
        starts before this returns, on the weights the engines hold now (`submit_next=False`: when the caller
        calls `submit_next(step)`, after drawing more of this step's prompts with `extra`)."""
        if self.ready is None or self.ready.step != step:
            if self.pending is None or self.pending.step != step:
                self.ready = None
                self.submit(step)
            self.wait()
        out, self.ready = self.ready, None
        self.last, self.last_task_state = out, self.ready_task_state
        lag = (step - 1) - out.gen.weight_version
        if not 0 <= lag <= self.ahead:
            raise RolloutError(f"step {step} got samples of weight version {out.gen.weight_version}; the trainer holds "
                               f"version {step - 1} and rollout.off_policy_steps={self.ahead} allows versions "
                               f"{step - 1 - self.ahead}..{step - 1}: a server was updated by someone else, or restarted "
                               "without its weights")
        if submit_next:
            self.submit_next(step)
        return out

    def submit_next(self, step: int) -> None:
        """One step ahead: draw step `step`+1's prompts and start generating them (in turn: nothing)."""
        if self.ahead and (self.last_step is None or step < self.last_step):
            self.submit(step + 1)

    def extra(self, step: int, round: int) -> StepSamples:
        """Collective: round `round` (>= 1) of step `step` (algo.dynamic_sampling=refill): batch_size more
        prompts drawn from the task (the same data cursor, so a resume draws the same ones), generated now on
        the weights the engines hold, with the round's own seed. One step ahead, call it before
        `submit_next(step)`, so that the draws keep the serial loop's order."""
        if self.pending is not None:
            raise RuntimeError(f"extra round {round} of step {step} while step {self.pending.step}'s batch is pending")
        t0 = time.perf_counter()
        examples = self.draw(self.batch_size)
        gen = self._generate(examples, self.sampling.step_seed(step, round))
        seconds = time.perf_counter() - t0
        if self.share is not None:
            gen = self.reshare(gen, examples)
        self.waited += time.perf_counter() - t0
        self.generated += seconds
        return StepSamples(step, examples, gen, seconds)

    def _generate(self, examples: list, seed: int) -> Optional[Generation]:
        """Collective: generate `examples` now (all ranks get the samples; with `share`, rank 0 only)."""
        s = self.sampling
        return self.engines.generate([e.prompt_ids for e in examples], s.n, s.temperature, s.top_p,
                                     s.max_new_tokens, s.stop_token_ids, seed, **s.rows_of(examples),
                                     **({} if self.share is None else {"to_all": False}))

    def reshare(self, gen: Optional[Generation], examples: list) -> Generation:
        """Collective: rank 0's whole `gen` for `examples` (ignored elsewhere) as every rank needs it (`share`);
        without `share`, `gen` itself (every rank holds it all)."""
        if self.share is None:
            return gen
        return self.share(gen if dist.get_rank() == 0 else None,
                          [len(e.prompt_ids) for e in examples for _ in range(self.sampling.n)])

    def sync_weights(self, gpt, version: int, **kwargs):
        """Collective: the trainer's weights into every engine as `version` (grpo_mega.rollout.placement.Engines.
        sync). The caller waits first: weights never change under a generation."""
        if self.pending is not None and self.ahead:  # the same on every rank: all raise, none waits
            raise RuntimeError(f"weight sync (version {version}) while step {self.pending.step}'s generation is in "
                               "flight: call wait() first")
        return self.engines.sync(gpt, version=version, **kwargs)

    def metrics(self) -> dict:
        """The step's scheduler metrics (rollout.mode=async has some: grpo_mega.rollout.async_scheduler)."""
        return {}

    def close(self) -> None:
        pass

    def take_timing(self) -> tuple[float, float]:
        """(seconds generating, seconds the trainer waited for samples) since the last call."""
        out = (self.generated, self.waited)
        self.generated = self.waited = 0.0
        return out

    # ---- checkpoints ------------------------------------------------------------------------------

    def rewind(self) -> None:
        """Collective: back to before the last `result(step)`, so that a checkpoint now is one of step - 1 whose
        resume trains step `step` again (the loop stops a run there: grpo_mega.trainer.guards). A next batch in
        flight (one step ahead) is waited for and dropped; the step's own batch is the generated, not yet trained
        one again (one step ahead; in turn its prompts are drawn again), the task's state the one before it."""
        last, before = self.last, self.last_task_state
        if self.pending is not None:
            try:
                self.wait()
            except RolloutError:  # raised on every rank alike; the batch is dropped either way
                pass
        self.ready = last if self.ahead else None
        self.ready_task_state = before
        if not self.ahead and self.set_state is not None:
            self.set_state(copy.deepcopy(before))

    def task_state(self):
        """The task's state to checkpoint: from before the batch that is generated but not yet trained on (its
        prompts are drawn again on resume), else the task's own."""
        if self.pending is not None:
            raise RuntimeError(f"checkpoint while step {self.pending.step}'s batch is pending: call wait() first")
        if self.ready is not None:
            return self.ready_task_state
        return self.get_state() if self.get_state is not None else None

    def state(self) -> Optional[dict]:
        """The generated, not yet trained batch (its step, prompts and samples; JSON but for routed_experts, int16
        tensors [positions, M, k] or None per sample, which grpo_mega.trainer.checkpoint stores apart; for a
        multi-turn batch its model mask, turns and tool counts), or None."""
        if self.ready is None:
            return None
        g = self.ready.gen
        out = dict(step=self.ready.step, prompts=[list(e.prompt_ids) for e in self.ready.examples],
                   token_ids=g.token_ids, logprobs=g.logprobs, finish_reasons=g.finish_reasons,
                   weight_version=g.weight_version, seconds=self.ready.seconds,
                   routed_experts=g.routed_experts)
        if g.model_mask is not None:  # a multi-turn batch: which tokens are the model's, its turns and tool counts
            out.update(model_mask=g.model_mask, multi_turn=g.extra.get("multi_turn"), trajectories=g.trajectories)
        return out

    def restore(self, state: Optional[dict]) -> None:
        """After the task's state is restored (task_state()): draw the saved batch's prompts again and take its
        samples, so that the resumed run trains on exactly what the interrupted one would have. In turn
        (off_policy_steps=0) the saved samples are dropped: the prompts are drawn and generated afresh."""
        if state is not None and state.get("mode") == "async":
            raise ValueError("the checkpoint was written with rollout.mode=async (its groups in flight); resume it with "
                             "rollout.mode=async, or start a new run")
        if state is None or not self.ahead:
            return
        before = copy.deepcopy(self.get_state()) if self.get_state is not None else None
        examples = self.draw(self.batch_size)
        prompts = [list(e.prompt_ids) for e in examples]
        if prompts != state["prompts"]:
            raise ValueError(f"the checkpoint's in-flight batch (step {state['step']}) was drawn from other prompts "
                             "than the task now gives: was the data (data.train_files, seed) changed? Resume with "
                             "the same data, or start a new run")
        gen = Generation(token_ids=state["token_ids"], logprobs=state["logprobs"], finish_reasons=state["finish_reasons"],
                         weight_version=int(state["weight_version"]), routed_experts=state.get("routed_experts"),
                         model_mask=state.get("model_mask"), trajectories=state.get("trajectories"),
                         extra={"multi_turn": state["multi_turn"]} if state.get("multi_turn") else {})
        self.ready = StepSamples(int(state["step"]), examples, gen, float(state.get("seconds", 0.0)))
        self.ready_task_state = before
