"""Scoring a step's samples once: which rank scores which sample, the process pool that runs rule rewards
with a hard per-sample time limit, and the one collective that gives every rank every score.

`score_step` is the loop's single call. Sample i is scored on global rank i % world (a scorer that holds a
model, such as the batched reward model, scores them all on rank 0 instead); each rank writes its scores
into a zero vector and one SUM all-reduce (grpo_mega.parallel.comm) assembles the whole vector, exactly,
since every entry is x + 0 + ... + 0. Rule rewards (math-verify, user functions by dotted path) run in a
`RewardPool` of worker processes; a sample still running after `timeout_s` has its worker and every process
under it (what the reward function started) killed by PID and replaced, and is handled like a raising reward
(`on_error`). A worker found dead while idle is replaced without failing anything; `max_memory_mb` caps each
worker's address space (RLIMIT_AS, set in the worker), so a sample over it fails alone instead of waking the
node's OOM killer, which may pick a trainer rank. What the pool runs and how the reward functions
themselves behave is rewards/__init__.py's; the learned reward model is rewards/reward_model.py's.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from grpo_mega.rewards import RewardError, RewardStats, build_reward, check_reward_value, report_failure
from grpo_mega.workers import Worker, close_all, die_with_parent, limit_memory, send_or_replace

if TYPE_CHECKING:  # pool workers import this module: torch stays out of them
    import torch

log = logging.getLogger(__name__)


def default_num_workers() -> int:
    """The node's cores divided among its local ranks (LOCAL_WORLD_SIZE, set by torchrun), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _worker(conn, name: str, kwargs: dict, max_memory_mb: Optional[int] = None) -> None:
    """A pool worker: build the reward once, then score (index, response, ground truth, sample) requests
    until the parent closes the pipe. Failures go back as text; the parent reports them with the sample."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then ends us
    over = f" (over reward.max_memory_mb={max_memory_mb})" if max_memory_mb else ""
    try:
        limit_memory(max_memory_mb)
        fn = build_reward(name, **kwargs)
    except BaseException as e:  # noqa: BLE001 - a reward that cannot be built is reported by the parent
        conn.send(("fatal", -1, f"{type(e).__name__}{over if isinstance(e, MemoryError) else ''}: {e}"))
        return
    conn.send(("ready", -1, getattr(fn, "__qualname__", None) or type(fn).__name__))
    while True:
        try:
            i, response, ground_truth, sample = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", i, fn(response, ground_truth, sample))
        except MemoryError as e:  # over the cap: this sample fails, the worker (its memory freed) goes on
            reply = ("error", i, f"MemoryError{over}: {e}")
        except Exception as e:  # noqa: BLE001 - user code: reported with the sample
            reply = ("error", i, f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):  # the pool closed while this sample ran (an error elsewhere): done
            return


class RewardPool:
    """`num_workers` processes running the reward `name` (registered or dotted path, built in each worker from
    `kwargs`), one sample each at a time, every sample cut at `timeout_s` seconds.

    The workers start on first use with `start_method` ('forkserver': forked from a clean server process, not
    from a trainer rank running gloo/NCCL threads; 'spawn'; 'fork': fastest start, only safe before threads
    exist). `max_memory_mb` (0 or None: no cap) caps each worker's address space beyond its size at start; a
    sample over it fails alone. `close()` (also on `with` exit) ends them all; tests check that none outlives it.
    """

    def __init__(self, name: str, kwargs: Optional[dict] = None, *, num_workers: int = 1, timeout_s: float = 30.0,
                 start_method: str = "forkserver", what: str = "reward function",
                 max_memory_mb: Optional[int] = None):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0")
        if start_method not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"reward.start_method={start_method!r} must be 'forkserver', 'spawn' or 'fork'")
        if max_memory_mb is not None and max_memory_mb < 0:
            raise ValueError(f"reward.max_memory_mb={max_memory_mb} must be >= 0 (0 or null: no limit)")
        self.name, self.kwargs, self.what, self.max_memory_mb = name, dict(kwargs or {}), what, max_memory_mb
        self.num_workers, self.timeout_s, self.start_method = num_workers, timeout_s, start_method
        self._workers: list[Worker] = []
        self.started_pids: list[int] = []  # every worker ever started (tests check that all are gone)
        self.fn_name = name  # the function's own name once a worker has built it (for messages)

    def _spawn(self) -> Worker:
        w = Worker(mp.get_context(self.start_method), _worker, (self.name, self.kwargs, self.max_memory_mb),
                   "grpo-mega-reward")
        self.started_pids.append(w.proc.pid)
        return w

    def _await_ready(self, w: Worker) -> None:
        if not w.conn.poll(max(60.0, self.timeout_s)):
            w.kill()
            raise RewardError(f"reward worker for {self.name!r} (pid {w.proc.pid}) did not start within "
                              f"{max(60.0, self.timeout_s):.0f} s")
        try:
            kind, _, detail = w.conn.recv()
        except (EOFError, OSError):
            w.kill()
            raise RewardError(f"reward worker for {self.name!r} (pid {w.proc.pid}) exited with code "
                              f"{w.proc.exitcode} before it was ready") from None
        if kind == "fatal":
            w.kill()
            raise ValueError(f"reward {self.name!r} could not be built in a worker process: {detail}")
        w.ready = True
        self.fn_name = detail

    def start(self) -> None:
        if self._workers:
            return
        self._workers = [self._spawn() for _ in range(self.num_workers)]
        for w in self._workers:
            self._await_ready(w)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def score(self, responses: Sequence[str], ground_truths: Sequence[Any], samples: Sequence[dict],
              on_error: str = "zero", stats: Optional[RewardStats] = None, indices: Optional[Sequence[int]] = None
              ) -> list[float]:
        """Scores of every sample, in order; a failure, non-number or timeout is reported with the sample
        (`indices[k]` names sample k in messages; default k) and scored 0 (on_error=zero) or raised."""
        if on_error not in ("zero", "raise"):
            raise ValueError(f"reward.on_error={on_error!r} must be 'zero' or 'raise'")
        stats = stats if stats is not None else RewardStats()
        indices = list(indices) if indices is not None else list(range(len(responses)))
        out: list[Optional[float]] = [None] * len(responses)
        if not responses:
            return []
        self.start()
        todo = list(range(len(responses)))[::-1]

        def where(k: int) -> str:
            return (f"sample {indices[k]} (data_source={samples[k].get('data_source')!r}, "
                    f"response={responses[k][:80]!r})")

        def fail(k: int, detail: str, timeout: bool = False) -> None:
            report_failure(self.fn_name, where(k), detail, on_error, stats, timeout=timeout, what=self.what)
            out[k] = 0.0

        try:
            while todo or any(w.busy is not None for w in self._workers):
                for idx, w in enumerate(list(self._workers)):
                    if w.busy is None and todo:
                        k = todo.pop()
                        w = self._send(idx, (k, responses[k], ground_truths[k], samples[k]))
                        w.busy, w.deadline = k, time.monotonic() + self.timeout_s
                busy = [w for w in self._workers if w.busy is not None]
                wait = max(0.0, min(w.deadline for w in busy) - time.monotonic())
                ready = mp.connection.wait([w.conn for w in busy], timeout=wait)
                for idx, w in enumerate(list(self._workers)):
                    if w.busy is None:
                        continue
                    if w.conn in ready:
                        try:
                            kind, k, value = w.conn.recv()
                        except (EOFError, OSError):
                            k = w.busy
                            w.kill()
                            self._workers[idx] = self._replace()
                            fail(k, f"its worker process (pid {w.proc.pid}) died with exit code {w.proc.exitcode}")
                            continue
                        w.busy = None
                        if kind == "ok":
                            try:
                                out[k] = check_reward_value(value)
                            except TypeError as e:
                                fail(k, f"TypeError: {e}")
                        else:
                            fail(k, value)
                    elif time.monotonic() >= w.deadline:
                        k = w.busy
                        w.kill()  # stuck (math-verify on adversarial LaTeX, a user loop, C code): end its tree
                        self._workers[idx] = self._replace()
                        fail(k, f"timed out after {self.timeout_s:g} s (reward.timeout_s); its worker "
                                f"(pid {w.proc.pid}) was killed with the processes under it and replaced",
                             timeout=True)
        except BaseException:
            self.close()  # an error (on_error=raise, Ctrl-C) must not leave workers behind
            raise
        return [float(v) for v in out]

    def _replace(self) -> Worker:
        w = self._spawn()
        self._await_ready(w)
        return w

    def _send(self, idx: int, request: tuple) -> Worker:
        """Give worker `idx` a request; one that died while idle is replaced first, failing nothing."""
        return send_or_replace(self._workers, idx, request, self._replace, f"reward worker for {self.name!r}",
                               RewardError)

    def close(self) -> None:
        """End every worker (closing its pipe ends an idle one; a busy or stuck one is killed by PID)."""
        workers, self._workers = self._workers, []
        close_all(workers)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PromptReward:
    """The reward of task=prompts: a rule reward (registered name or dotted path) over decoded responses, run
    in a RewardPool. Callable per sample (validation) and a StepScorer (the step's share of samples)."""

    on_one_rank = False
    metric_keys = ("reward/errors", "reward/timeouts")

    def __init__(self, tokenizer, name: str, kwargs: Optional[dict] = None, *, on_error: str = "zero",
                 num_workers: Optional[int] = None, timeout_s: float = 30.0, start_method: str = "forkserver",
                 what: str = "reward function", max_memory_mb: Optional[int] = None):
        if on_error not in ("zero", "raise"):
            raise ValueError(f"reward.on_error={on_error!r} must be 'zero' or 'raise'")
        self.tok, self.on_error = tokenizer, on_error
        build_reward(name, **(kwargs or {}))  # fail at start-up, in this process, on a bad name or path
        self.pool = RewardPool(name, kwargs, num_workers=num_workers or default_num_workers(), timeout_s=timeout_s,
                               start_method=start_method, what=what, max_memory_mb=max_memory_mb)
        self.stats = RewardStats()

    def _inputs(self, example, response_ids, trajectory: Optional[dict] = None) -> tuple[str, Any, dict]:
        """(response text, ground truth, sample row); a toy example's `answer` is its ground truth. A multi-turn
        sample's response text is its final model turn's, and the row also holds `turns` (role, text, tool
        name, error flag), `tool_rewards` and `response` (the whole trajectory's text, special tokens dropped)."""
        text = self.tok.decode(response_ids, skip_special_tokens=True)
        sample = {"data_source": getattr(example, "data_source", ""), "extra_info": getattr(example, "extra_info", {}),
                  "prompt_text": self.tok.decode(example.prompt_ids, skip_special_tokens=True)}
        if trajectory is not None:
            turns = [{k: t.get(k) for k in ("role", "text", "name", "error")} for t in trajectory.get("turns", [])]
            sample.update(turns=turns, tool_rewards=dict(trajectory.get("tool_rewards") or {}), response=text)
            text = next((t["text"] for t in reversed(turns) if t["role"] == "assistant"), "")
        return text, getattr(example, "ground_truth", getattr(example, "answer", None)), sample

    def __call__(self, example, response_ids, trajectory: Optional[dict] = None) -> float:
        text, gt, sample = self._inputs(example, response_ids, trajectory)
        return self.pool.score([text], [gt], [sample], self.on_error, self.stats)[0]

    def score_batch(self, examples, response_ids, indices, step, trajectories: Optional[Sequence] = None):
        errors, timeouts = self.stats.errors, self.stats.timeouts
        rows = [self._inputs(examples[i], response_ids[i], trajectories[i] if trajectories is not None else None)
                for i in indices]
        values = self.pool.score([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], self.on_error,
                                 self.stats, indices=indices)
        return values, {"reward/errors": self.stats.errors - errors, "reward/timeouts": self.stats.timeouts - timeouts}

    def close(self) -> None:
        self.pool.close()


# ---- who scores what, and the collective ---------------------------------------------------------------------

class StepScorer(Protocol):
    """What `score_step` needs from a reward beyond a per-sample callable."""

    on_one_rank: bool
    """True: rank 0 scores every sample (it holds a model); False: sample i is scored on rank i % world."""
    metric_keys: tuple[str, ...]
    """The names of the counts score_batch returns, the same on every rank (the collective sums them)."""

    def score_batch(self, examples: Sequence, response_ids: Sequence[list[int]], indices: Sequence[int],
                    step: int) -> tuple[list[float], dict[str, float]]:
        """Scores of examples[i] for i in `indices`, and this rank's counts (`metric_keys` -> value) to sum over
        ranks. Called on every rank, with empty `indices` where a rank scores nothing."""


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def score_step(reward: Callable, examples: Sequence, response_ids: Sequence[list[int]], step: int,
               owned: Optional[Sequence[int]] = None,
               trajectories: Optional[Sequence[Optional[dict]]] = None) -> tuple["torch.Tensor", dict[str, float]]:
    """Every sample's reward, scored once on one rank, identical on every rank: `rewards: [N]` float32 (what
    `torch.tensor` of the per-sample floats gives), and the step's reward metrics (`reward/score_seconds`:
    this rank's wall time for the call; `reward/timeouts`, `reward/errors` and any scorer counts: sums over
    ranks). `reward` is a StepScorer, or a plain per-sample `reward(example, response_ids) -> float`
    (scored in-process, spread over ranks). `owned`: the samples this rank scores (each sample owned by exactly
    one rank, which holds its response: grpo_mega.rollout.routing); by default every world-th from this
    rank's. A scorer `on_one_rank` scores them all on rank 0, which holds every response. `reward/samples` is
    `n`, the count reward/errors is a share of. `trajectories` (multi-turn: Generation.trajectories, this rank's
    rows filled in) reach a reward that takes them (`score_batch(..., trajectories=)`, `reward(example, ids,
    trajectory=)`)."""
    import torch
    import torch.distributed as dist

    from grpo_mega.parallel import comm

    t0 = time.perf_counter()
    n = len(response_ids)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    on_one_rank = getattr(reward, "on_one_rank", False)
    if on_one_rank:
        mine = list(range(n)) if rank == 0 else []
    else:
        mine = list(owned) if owned is not None else list(range(rank, n, world))
    failure: Optional[BaseException] = None
    try:
        if hasattr(reward, "score_batch"):
            kw = {"trajectories": trajectories} if trajectories is not None and _takes(reward.score_batch, "trajectories") else {}
            values, counts = reward.score_batch(examples, response_ids, mine, step, **kw)
        elif trajectories is not None and _takes(reward, "trajectory"):
            values, counts = [float(reward(examples[i], response_ids[i], trajectory=trajectories[i])) for i in mine], {}
        else:
            values, counts = [float(reward(examples[i], response_ids[i])) for i in mine], {}
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait in the collective
        failure, values, counts = e, [0.0] * len(mine), dict.fromkeys(getattr(reward, "metric_keys", ()), 0.0)
    counts = {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/failed_ranks": 0.0, **counts}
    counts["reward/failed_ranks"] = float(failure is not None)
    keys = sorted(counts)
    local = torch.zeros(n + len(keys), dtype=torch.float64)
    local[torch.tensor(mine, dtype=torch.long)] = torch.tensor(values, dtype=torch.float64)
    local[n:] = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64)
    total = comm.world_all_reduce_sum(local)
    metrics = dict(zip(keys, total[n:].tolist()))
    if metrics.pop("reward/failed_ranks"):
        messages = comm.all_gather_objects(None if failure is None else str(failure))
        if failure is not None:
            raise failure
        raise RewardError(next(m for m in messages if m is not None))
    metrics["reward/score_seconds"] = time.perf_counter() - t0
    metrics["reward/samples"] = float(n)  # what reward/errors is a share of (grpo_mega.trainer.guards)
    return total[:n].to(torch.float32), metrics
