"""Continual reward-model training: reservoir sampling, the replay share, BCE updates that learn, the exact
save/load of the whole state, and (end to end) a resumed run that repeats the uninterrupted one."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from grpo_mega.rewards.rm_train import RMTrainConfig, RMTrainer, replay_count, reservoir_add
from tests.fork_server import run_main

ROOT = Path(__file__).resolve().parents[2]


def test_reservoir_keeps_every_seen_sample_with_equal_chance():
    cap, n, trials = 10, 100, 3000
    kept = [0] * n
    rng = random.Random(0)
    for _ in range(trials):
        buf, seen = [], 0
        for i in range(n):
            seen = reservoir_add(buf, seen, i, cap, rng)
        assert len(buf) == cap and seen == n
        for i in buf:
            kept[i] += 1
    freq = [k / trials for k in kept]
    # each sample stays with probability cap / n = 0.1; 3000 trials: sd 0.0055, so 0.03 is > 5 sd
    assert max(abs(f - 0.1) for f in freq) < 0.03, (min(freq), max(freq))
    assert abs(sum(freq[:50]) - sum(freq[50:])) < 0.3  # early and late samples alike


def test_replay_share():
    assert replay_count(90, 1000, 0.1) == 10  # 10 of 100 replayed
    assert replay_count(90, 4, 0.1) == 4  # no more than the buffer holds
    assert replay_count(90, 1000, 0.0) == 0
    assert replay_count(30, 1000, 0.5) == 30


@pytest.mark.parametrize("field,value,pattern", [
    ("replay_fraction", 1.0, r"reward.rm_train.replay_fraction=1.0 must be in \[0, 1\)"),
    ("replay_fraction", -0.1, r"reward.rm_train.replay_fraction=-0.1 must be in \[0, 1\)"),
    ("heldout_fraction", 1.0, r"reward.rm_train.heldout_fraction=1.0 must be in \[0, 1\)"),
    ("steps", 0, r"reward.rm_train.steps=0 must be >= 1"),
    ("interval", -1, r"reward.rm_train.interval=-1 must be >= 0"),
])
def test_config_errors_name_the_field(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        RMTrainConfig(**{field: value, "labels": "task"})
    with pytest.raises(ValueError, match=r"interval > 0 needs reward.rm_train.labels"):
        RMTrainConfig(interval=2)


def _rm(tmp_path):
    from grpo_mega.rewards.reward_model import RewardModel
    from tests.rewards.test_reward_model import tiny_rm

    tiny_rm(tmp_path, seed=3)
    return RewardModel(str(tmp_path), "cpu", dtype=torch.float32)


def _data(rm, seed: int, n: int = 96):
    """Texts 'd >a' labelled 1 when a == d + 1 (mod 10): learnable from the tokens."""
    g = random.Random(seed)
    rows = []
    for _ in range(n):
        d = g.randrange(10)
        a = (d + 1) % 10 if g.random() < 0.5 else g.randrange(10)
        rows.append((f"{d} >{a}", float(a == (d + 1) % 10)))
    return rm.encode([t for t, _ in rows]), [y for _, y in rows]


def test_updates_learn_and_a_saved_state_continues_exactly(tmp_path):
    torch.set_num_threads(1)  # tiny matmuls; more threads only contend with the other tests on the cores
    cfg = RMTrainConfig(interval=1, steps=40, labels="task", lr=3e-3, batch_size=32, heldout_fraction=0.25,
                        buffer_size=50, seed=1)
    t = RMTrainer(cfg, _rm(tmp_path / "rm"))
    t.add(*_data(t.rm, 0))
    m1 = t.update()
    assert m1["rm/accuracy_after"] >= m1["rm/accuracy_before"] + 0.15, m1  # measured: 0.46 -> 0.71
    assert m1["rm/replay_size"] == 50 and t.seen > 50  # bounded: more seen than kept
    t.add(*_data(t.rm, 1))
    t.save(tmp_path / "ckpt")
    want = t.update()
    want_scores = t.rm.score_ids(_data(t.rm, 2)[0])
    # a fresh trainer on the initial weights, loaded from the checkpoint, makes the same update
    u = RMTrainer(cfg, _rm(tmp_path / "rm2"))
    u.load(tmp_path / "ckpt")
    got = u.update()
    assert got == want
    assert u.rm.score_ids(_data(u.rm, 2)[0]) == want_scores
    assert [x for x in u.buffer] == [x for x in t.buffer]


def _train(out: Path, ckpt: Path, rm_dir: Path, steps: int) -> dict:
    argv = [f"hydra.run.dir={out}", f"run.steps={steps}", "eval.interval=2",
           "reward.name=reward_model", f"reward.path={rm_dir}", "reward.val_reward=task", "reward.rm_train.interval=2",
           "reward.rm_train.labels=task", "reward.rm_train.steps=5", "reward.rm_train.lr=3e-3",
           "reward.rm_train.buffer_size=100", "batch.train_batch_size=8", "batch.ppo_mini_batch_size=8",
           "rollout.n=4", "algo.kl_coef=0.01", f"checkpoint.dir={ckpt}", "checkpoint.interval=2"]
    # forked from the warm fork server (tests/fork_server.py), not a new interpreter
    proc = run_main(argv, timeout=400, cwd=ROOT, scratch=out.parent,
                    env={**__import__("os").environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


def test_resume_with_reward_model_training_repeats_the_uninterrupted_run(tmp_path):
    """4 steps with an RM update at steps 2 and 4 (the buffer full by step 4: reservoir draws matter), vs the
    same run resumed from its step-2 checkpoint: steps 3 and 4 equal to 1e-6, rm/* included."""
    from tests.rewards.test_reward_model import tiny_rm

    rm_dir = tiny_rm(tmp_path / "rm", seed=5)
    full = _train(tmp_path / "full", tmp_path / "ck_full", rm_dir, 4)
    assert (tmp_path / "ck_full" / "step_00000004" / "task" / "reward_model" / "model.safetensors").is_file()
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck_full" / "step_00000002", ck / "step_00000002")
    resumed = _train(tmp_path / "resumed", ck, rm_dir, 4)
    assert sorted(resumed) == [3, 4]
    assert full[4]["rm/updated"] == 1 and full[4]["rm/replay_size"] == 100 and full[2]["rm/loss"] > 0
    for s in (3, 4):
        for key in ("reward", "val_reward", "loss", "grad_norm", "kl", "rm/accuracy_before", "rm/accuracy_after",
                    "rm/loss", "rm/replay_size", "rm/label_mean"):
            assert resumed[s][key] == pytest.approx(full[s][key], rel=1e-6, abs=1e-6), (s, key)


@pytest.mark.parametrize("replay", [0.1, 0.0])
def test_an_update_trains_on_the_new_samples_plus_exactly_the_replay_share(tmp_path, replay):
    """What the model is fed during the second update: every new sample, and replay_count(...) distinct samples
    of the first update's data (none with replay 0), nothing else; and the weights move."""
    torch.set_num_threads(1)
    cfg = RMTrainConfig(interval=1, steps=4, labels="task", lr=3e-3, batch_size=32, heldout_fraction=0.0,
                        buffer_size=500, replay_fraction=replay, seed=2)
    t = RMTrainer(cfg, _rm(tmp_path / "rm"))
    ids = [[3 + i % 10, 3 + (i // 10) % 10, 3 + i // 100] for i in range(300)]  # 300 distinct inputs
    old, new = ids[:200], ids[200:290]
    t.add(old, [float(i % 2) for i in range(200)])
    t.update()
    assert len(t.buffer) == 200
    t.add(new, [float(i % 3 == 0) for i in range(90)])
    fed = []
    forward = t.rm.forward_ids
    t.rm.forward_ids = lambda batch: (fed.extend(tuple(x) for x in batch), forward(batch))[1]
    before = [p.detach().clone() for p in t.rm.model.parameters()]
    t.update()
    seen = set(fed)
    want_replay = replay_count(90, 200, replay)
    assert want_replay == (10 if replay else 0)
    assert {tuple(x) for x in new} <= seen  # 4 steps x 32 >= 100: every sample of the mix is fed
    assert len(seen & {tuple(x) for x in old}) == want_replay
    assert seen <= {tuple(x) for x in old + new}
    assert len(fed) == cfg.steps * cfg.batch_size
    assert any(not torch.equal(a, b) for a, b in zip(before, t.rm.model.parameters()))
    assert len(t.buffer) == 290  # the new samples joined the buffer after the update
