"""The hang watchdog: a step that runs past its threshold leaves every thread's stack in the dump file, naming
the call it is blocked in; a step within it leaves none."""

from __future__ import annotations

import time

from grpo_mega.trainer.watchdog import StepWatchdog


def blocked_in_a_collective(seconds: float) -> None:
    time.sleep(seconds)


def test_a_slow_step_dumps_the_blocked_call(tmp_path):
    dog = StepWatchdog(tmp_path / "stacks-rank0.txt", factor=3.0, min_s=0.3)
    dog.begin()
    blocked_in_a_collective(0.02)  # a quick step: nothing dumped
    dog.end()
    assert (tmp_path / "stacks-rank0.txt").read_text() == ""
    (quick,) = dog.durations  # ~0.02 s; more on a loaded machine (a CI run saw a 0.05 s sleep take 0.115 s)
    assert quick >= 0.02 and dog.threshold() == max(0.3, 3 * quick)  # the floor, unless the machine crawled
    dog.begin()
    blocked_in_a_collective(max(1.0, 2 * dog.threshold()))  # past the threshold, whatever it came to
    dog.end()
    dog.close()
    dump = (tmp_path / "stacks-rank0.txt").read_text()
    assert "blocked_in_a_collective" in dump and "test_a_slow_step_dumps_the_blocked_call" in dump, dump
    quiet = StepWatchdog(tmp_path / "quiet.txt", factor=3.0, min_s=5.0)
    quiet.begin()
    quiet.end()
    quiet.close()
    assert not (tmp_path / "quiet.txt").exists()  # nothing hung: no file left behind


def test_the_threshold_follows_the_median_step():
    dog = StepWatchdog("unused", factor=10.0, min_s=1.0)
    dog.durations = [2.0, 3.0, 100.0]
    assert dog.threshold() == 30.0
    assert not StepWatchdog("unused", factor=0.0, min_s=1.0).enabled
