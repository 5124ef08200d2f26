"""The rollout scheduler on 2 gloo ranks with a stand-in engine on rank 0: one step ahead, step k >= 2 trains
on samples of version k-2 drawn from the prompts the serial loop would draw, the weights never change while a
generation is in flight, the generation is hidden behind training, a generated batch survives a checkpoint
(JSON) exactly, and a failure in the background thread stops every rank with the server's URL."""

import json
import random
import threading
import time

import pytest

from grpo_mega.parallel.forked import run_ranks
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.placement import RolloutError
from grpo_mega.rollout.scheduler import RolloutScheduler, SamplingArgs

GEN_S, TRAIN_S = 0.3, 0.5  # seconds a stand-in generation and a stand-in training step take (sleeps, not CPU)


class _Example:
    def __init__(self, prompt_ids):
        self.prompt_ids = prompt_ids


class _Task:
    """Prompts from a seeded RNG, with a JSON state (as the toy task's)."""

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def draw(self, size):
        return [_Example([self.rng.randrange(100) for _ in range(3)]) for _ in range(size)]

    def get_state(self):
        version, internal, gauss = self.rng.getstate()
        return [version, list(internal), gauss]

    def set_state(self, state):
        self.rng.setstate((state[0], tuple(state[1]), state[2]))


class _Engine:
    """Samples token ids from its seeds; records every weight update that lands during a generation."""

    def __init__(self, fail_at_step=None):
        self.weight_version, self.generating, self.violations = 0, threading.Event(), []
        self.fail_at_step = fail_at_step

    def generate(self, prompts, n, temperature, top_p, max_new, stop, seed, prompt_offset=0):
        if self.fail_at_step is not None and seed % 1_000_003 == self.fail_at_step:
            raise ConnectionError("rollout server http://127.0.0.1:9 did not answer /generate within 5 s: reset")
        self.generating.set()
        try:
            version = self.weight_version
            time.sleep(GEN_S)
            rng = random.Random(seed)
            tokens = [[rng.randrange(100) for _ in range(2)] for _ in range(len(prompts) * n)]
            return Generation(tokens, [[-0.5, -0.25]] * len(tokens), ["stop"] * len(tokens), version)
        finally:
            self.generating.clear()

    def update_weights(self, version):
        if self.generating.is_set():
            self.violations.append(version)
        self.weight_version = version


class _Engines:
    """grpo_mega.rollout.placement.Engines' interface, without a model: one engine on rank 0."""

    def __init__(self, engine):
        import torch.distributed as dist

        from grpo_mega.engines.validate import OutputSpec

        self.ranks = [0]
        self.local = engine if dist.get_rank() == 0 else None
        self.spec = OutputSpec()

    def generate(self, *args):
        from grpo_mega.parallel import comm

        return comm.broadcast_object(self.local.generate(*args) if self.local is not None else None)

    def sync(self, gpt, version):
        if self.local is not None:
            self.local.update_weights(version)


def _scheduler(engine, ahead, task, steps=5):
    return RolloutScheduler(_Engines(engine), task.draw, 2, SamplingArgs(2, 1.0, 1.0, 2, [0], seed=3), ahead, steps,
                            task.get_state, task.set_state)


def _loop(ahead, steps=5, checkpoint_at=None):
    """The training loop's calls, with sleeps for training: per step (prompts, tokens, version, waited, generated)."""
    task, engine = _Task(), _Engine()
    rollouts = _scheduler(engine, ahead, task, steps)
    rows, saved = [], None
    for step in range(1, steps + 1):
        got = rollouts.result(step)
        time.sleep(TRAIN_S)  # training
        rollouts.wait()
        rollouts.sync_weights(None, version=step)
        generated, waited = rollouts.take_timing()
        rows.append(([e.prompt_ids for e in got.examples], got.gen.token_ids, got.gen.weight_version, waited, generated))
        if step == checkpoint_at:
            saved = json.loads(json.dumps({"task": rollouts.task_state(), "rollout": rollouts.state()}))
    return rows, saved, engine.violations


def _resume(saved, from_step, steps=5):
    """A fresh scheduler from a checkpoint's JSON (the engine holds version from_step, as after the start-up sync)."""
    task, engine = _Task(seed=99), _Engine()
    task.set_state(saved["task"])
    engine.weight_version = from_step
    rollouts = _scheduler(engine, 1, task, steps)
    rollouts.restore(saved["rollout"])
    rows = []
    for step in range(from_step + 1, steps + 1):
        got = rollouts.result(step)
        rollouts.wait()
        rollouts.sync_weights(None, version=step)
        rows.append(([e.prompt_ids for e in got.examples], got.gen.token_ids, got.gen.weight_version))
    return rows


def _ranks_loop():
    serial = _loop(0)
    ahead = _loop(1, checkpoint_at=2)
    return serial, ahead, _resume(ahead[1], 2)


def test_one_step_ahead_versions_prompts_overlap_and_resume():
    results = run_ranks(_ranks_loop, 2, timeout=120)
    for (serial, _, serial_violations), (ahead, saved, violations), resumed in results:  # every rank the same
        assert [r[2] for r in serial] == [0, 1, 2, 3, 4]  # in turn: step k trains on version k-1
        assert [r[2] for r in ahead] == [0, 0, 1, 2, 3]  # one ahead: step 1 on 0, step k >= 2 on k-2
        assert [r[0] for r in ahead] == [r[0] for r in serial]  # the same prompts, drawn in the same order
        assert violations == [] and serial_violations == []  # no weight update during a generation
        assert saved["rollout"]["step"] == 3 and saved["rollout"]["weight_version"] == 1
        assert resumed == [r[:3] for r in ahead[2:]]  # the resumed steps 3..5: same prompts, samples, versions
    serial, ahead = results[0][0][0], results[0][1][0]  # rank 0 saw the generation seconds and the waits
    for step, (_, _, _, waited, generated) in enumerate(ahead[1:-1], start=2):
        assert generated >= GEN_S * 0.9, (step, generated)
    # hidden behind the training sleep: summed over the steps, as a loaded machine may wake one generation late
    waits = [(r[3], r[4]) for r in ahead[1:-1]]
    assert sum(w for w, _ in waits) < 0.5 * sum(g for _, g in waits), waits
    assert all(r[3] >= 0.9 * GEN_S for r in serial)  # in turn, every generation is waited for


def _ranks_fail():
    rollouts = _scheduler(_Engine(fail_at_step=3), 1, _Task())
    seen = []
    t0 = time.monotonic()
    try:
        for step in range(1, 6):
            rollouts.result(step)
            seen.append(step)
            rollouts.wait()
            rollouts.sync_weights(None, version=step)
    except RolloutError as e:
        return seen, str(e), time.monotonic() - t0
    return seen, None, time.monotonic() - t0


def test_a_failure_in_the_background_thread_stops_every_rank_naming_the_server():
    for seen, message, seconds in run_ranks(_ranks_fail, 2, timeout=120):
        assert seen == [1, 2], seen  # step 3's batch, generated while step 2 trained, failed in the wait
        assert message is not None and "http://127.0.0.1:9" in message and "generating step 3" in message
        assert "\n" not in message and seconds < 30


def _ranks_stale():
    engine = _Engine()
    rollouts = _scheduler(engine, 1, _Task())
    rollouts.result(1)
    rollouts.wait()
    rollouts.sync_weights(None, version=1)
    rollouts.result(2)
    rollouts.wait()
    rollouts.sync_weights(None, version=2)
    rollouts.ready.gen.weight_version = 0  # step 3's samples as if generated on version 0: two behind version 2
    with pytest.raises(RolloutError, match=r"step 3 got samples of weight version 0; the trainer holds version 2"):
        rollouts.result(3)
    return True


def test_samples_more_than_one_version_old_are_refused():
    assert run_ranks(_ranks_stale, 2, timeout=120) == [True, True]
