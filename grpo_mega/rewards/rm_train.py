"""Iterative RL's other half (DeepSeekMath, Algorithm 1, line 12): the reward model keeps training on the
policy's own samples, labelled by a rule, with a replay share of older data.

Every step, rank 0 labels the step's samples (`reward.rm_train.labels`) and keeps them: a `heldout_fraction`
for measuring, the rest for training. Every `interval` steps the reward model takes `steps` AdamW steps of
pointwise BCE on the samples of the last `interval` steps mixed with a `replay_fraction` share drawn from a
bounded replay buffer of all earlier ones (reservoir sampling, so every sample seen had the same chance to
stay); `rm/accuracy` is measured on the held-out split before and after. Then the new samples join the
buffer. The reference reset that follows is the loop's (algo.ref_update_interval, tied to `interval`).

Why pointwise BCE and not Bradley-Terry pairs within a group: the labels are a verifier's absolute
judgements (right or wrong), not preferences; BCE learns from every sample, including the groups whose G
responses are all right or all wrong (no pairs at all, and they are most groups early and late in training),
and it keeps scores comparable across prompts, which group normalisation of the advantages does not need but
the held-out accuracy and the replay of other prompts' samples do.

The whole state (weights, optimizer, pending samples, buffer, both RNGs) is saved into every checkpoint and
restored exactly, so a resumed run repeats the uninterrupted run's metrics.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Sequence

import torch

from grpo_mega.conf.reward import RMTrainConfig
from grpo_mega.rewards import check_reward_value

Item = tuple[list[int], float]  # (reward-model token ids, label)


def check_label(value, source: str, where: str) -> float:
    """A label in [0, 1]; else a ValueError naming the label source and the sample."""
    try:
        label = check_reward_value(value)
    except TypeError as e:
        raise ValueError(f"label source {source!r} on {where}: {e}") from None
    if not 0 <= label <= 1:
        raise ValueError(f"label source {source!r} on {where}: returned {label}; a label must be in [0, 1]")
    return label


def reservoir_add(buffer: list, seen: int, item, capacity: int, rng: random.Random) -> int:
    """Algorithm R: add `item` as the `seen + 1`-th sample; every sample seen stays with probability
    capacity / seen. Returns the new count seen."""
    seen += 1
    if len(buffer) < capacity:
        buffer.append(item)
    else:
        j = rng.randrange(seen)
        if j < capacity:
            buffer[j] = item
    return seen


def replay_count(n_new: int, n_buffer: int, fraction: float) -> int:
    """How many buffered samples to mix with `n_new` new ones so that they are `fraction` of the mix (at most
    the buffer's size): n_new * f / (1 - f), rounded."""
    return min(n_buffer, round(n_new * fraction / (1 - fraction)))


class RMTrainer:
    """Holds the labelled samples and trains `model` (a reward_model.RewardModel) every `cfg.interval` steps."""

    METRICS = ("rm/accuracy_before", "rm/accuracy_after", "rm/loss", "rm/replay_size", "rm/updated", "rm/label_mean")

    def __init__(self, cfg: RMTrainConfig, rm):
        self.cfg, self.rm = cfg, rm
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.optimizer = torch.optim.AdamW(rm.model.parameters(), lr=cfg.lr)
        self.pending: list[Item] = []  # labelled samples since the last update, for training
        self.heldout: list[Item] = []  # and for measuring
        self.buffer: list[Item] = []
        self.seen = 0
        self.last = dict.fromkeys(self.METRICS, 0.0)

    def add(self, ids: Sequence[list[int]], labels: Sequence[float]) -> None:
        for x, y in zip(ids, labels):
            (self.heldout if self.rng.random() < self.cfg.heldout_fraction else self.pending).append((list(x), float(y)))

    @torch.no_grad()
    def accuracy(self, items: Sequence[Item]) -> float:
        """Share of `items` whose score has the label's side: score > 0 exactly when label >= 0.5."""
        if not items:
            return 0.0
        self.rm.model.eval()
        scores = self.rm.score_ids([x for x, _ in items])
        return sum((s > 0) == (y >= 0.5) for s, (_, y) in zip(scores, items)) / len(items)

    def update(self) -> dict[str, float]:
        """`cfg.steps` BCE steps on the pending samples plus a replay share; the pending ones then join the buffer."""
        new = self.pending
        n_replay = replay_count(len(new), len(self.buffer), self.cfg.replay_fraction)
        data = new + self.rng.sample(self.buffer, n_replay)
        before = self.accuracy(self.heldout)
        losses = []
        if data:
            self.rm.model.train()
            order = torch.empty(0, dtype=torch.long)
            for _ in range(self.cfg.steps):
                if len(order) < min(self.cfg.batch_size, len(data)):
                    order = torch.cat([order, torch.randperm(len(data), generator=self.gen)])
                idx, order = order[: self.cfg.batch_size].tolist(), order[self.cfg.batch_size:]
                scores = self.rm.forward_ids([data[i][0] for i in idx])
                labels = torch.tensor([data[i][1] for i in idx], device=scores.device)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, labels)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                losses.append(float(loss.detach()))
            self.rm.model.eval()
        after = self.accuracy(self.heldout)
        for item in new:
            self.seen = reservoir_add(self.buffer, self.seen, item, self.cfg.buffer_size, self.rng)
        label_mean = sum(y for _, y in new + self.heldout) / max(1, len(new) + len(self.heldout))
        self.pending, self.heldout = [], []
        self.last = {"rm/accuracy_before": before, "rm/accuracy_after": after,
                     "rm/loss": sum(losses) / len(losses) if losses else 0.0, "rm/replay_size": float(len(self.buffer)),
                     "rm/updated": 1.0, "rm/label_mean": label_mean}
        return dict(self.last)

    def metrics(self, updated: bool) -> dict[str, float]:
        return {**self.last, "rm/updated": float(updated), "rm/replay_size": float(len(self.buffer))}

    # ---- checkpoint ------------------------------------------------------------------------------------------

    def save(self, d: Path) -> None:
        """Weights and optimizer (safetensors / torch.save of tensors only), samples and RNGs (JSON)."""
        from safetensors.torch import save_file

        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.rm.model.state_dict().items()},
                  str(d / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), d / "optimizer.pt")
        torch.save({"gen": self.gen.get_state()}, d / "generator.pt")
        version, internal, gauss = self.rng.getstate()
        (d / "state.json").write_text(json.dumps({
            "pending": self.pending, "heldout": self.heldout, "buffer": self.buffer, "seen": self.seen,
            "last": self.last, "rng": [version, list(internal), gauss]}))

    def load(self, d: Path) -> None:
        from safetensors.torch import load_file

        if not (d / "state.json").is_file():
            raise ValueError(f"{d}: no reward-model training state in this checkpoint (saved with "
                             "reward.rm_train.interval=0?); resume with the same reward settings")
        sd = load_file(str(d / "model.safetensors"), device=str(self.rm.device))
        self.rm.model.load_state_dict(sd)
        self.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
        self.gen.set_state(torch.load(d / "generator.pt", weights_only=True)["gen"])
        s = json.loads((d / "state.json").read_text())
        conv = lambda items: [(list(x), float(y)) for x, y in items]  # noqa: E731
        self.pending, self.heldout, self.buffer = conv(s["pending"]), conv(s["heldout"]), conv(s["buffer"])
        self.seen, self.last = s["seen"], s["last"]
        self.rng.setstate((s["rng"][0], tuple(s["rng"][1]), s["rng"][2]))


Labeler = Callable[[Sequence, Sequence[list[int]]], list[float]]
"""(examples, response ids) -> labels in [0, 1], one per sample."""
