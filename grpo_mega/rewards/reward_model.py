"""The learned reward model: an HF decoder with a sequence-classification head, scoring many samples in one
padded forward on one device.

`RewardModel` loads the checkpoint (refusing a directory without a classification head, which transformers
would otherwise fill with a random one), tokenizes prompt + response with the reward model's own tokenizer,
right-pads a length-sorted batch with an attention mask, runs the backbone once and reads the head at each
text's last token: the same number as transformers' one-sample forward (tested to 1e-5 in fp32). On GPUs it
runs in bf16. `RewardModelReward` is the StepScorer of `reward.name=reward_model`: rank 0 scores the whole
step. Training it further (iterative RL) is rewards/rm_train.py's.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)


def finite_scores(values: list[float], where: Sequence[str]) -> tuple[list[float], list[str]]:
    """(the scores with every non-finite one as 0.0, a message for each of those naming its sample `where[i]`):
    a reward model in bf16 can overflow to inf or NaN, which would otherwise reach the advantages."""
    bad = [f"the reward model scored {w} {v} (not finite); scored 0" for v, w in zip(values, where)
           if not math.isfinite(v)]
    return [v if math.isfinite(v) else 0.0 for v in values], bad


def default_device() -> str:
    """The trainer's device: this rank's GPU, or the CPU."""
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def check_reward_model_dir(path: str) -> str:
    """The architecture named in `path`/config.json, which must be a *ForSequenceClassification; else a ValueError."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise ValueError(f"reward.path={path}: no config.json; expected an HF AutoModelForSequenceClassification "
                         "directory (save_pretrained of e.g. LlamaForSequenceClassification)")
    archs = json.loads(cfg.read_text()).get("architectures") or []
    heads = [a for a in archs if a.endswith("ForSequenceClassification")]
    if not heads:
        raise ValueError(f"reward.path={path}: architectures {archs} has no sequence-classification head; a reward "
                         "model must be saved as *ForSequenceClassification (num_labels=1), e.g. "
                         "AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(DIR)")
    return heads[0]


class RewardModel:
    """An HF sequence-classification reward model; the score of a text is the first logit at its last token.

    `device`: default the trainer's; `dtype`: default bf16 on a GPU, fp32 on the CPU; `batch_size`: texts per
    forward (sorted by length, so that a batch pads little)."""

    def __init__(self, path: str, device: str = "", dtype: Optional[torch.dtype] = None, batch_size: int = 64):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model_dir(path)
        self.device = torch.device(device or default_device())
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if batch_size < 1:
            raise ValueError(f"reward.rm_batch_size={batch_size} must be >= 1")
        self.batch_size = batch_size
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.head = getattr(self.model, "score", None)
        if not isinstance(self.head, torch.nn.Module):
            raise ValueError(f"reward.path={path}: {type(self.model).__name__} has no `score` head; batched scoring "
                             "supports decoder reward models (Llama, Qwen2, Mistral, ... ForSequenceClassification)")

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tok(t)["input_ids"] for t in texts]

    def forward_ids(self, ids: Sequence[list[int]]) -> torch.Tensor:
        """Scores of token sequences, one padded forward: `ids` B lists -> `[B]` float32 (with autograd when enabled)."""
        lens = torch.tensor([len(x) for x in ids])
        if int(lens.min()) < 1:
            raise ValueError("a reward-model input is empty (no tokens)")
        tokens = torch.zeros(len(ids), int(lens.max()), dtype=torch.long)
        for i, x in enumerate(ids):
            tokens[i, : len(x)] = torch.tensor(x)
        mask = (torch.arange(tokens.shape[1])[None, :] < lens[:, None]).long()
        hidden = self.model.base_model(input_ids=tokens.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        last = hidden[torch.arange(len(ids), device=self.device), (lens - 1).to(self.device)]  # [B, H]
        return self.head(last)[:, 0].float()

    @torch.no_grad()
    def score_ids(self, ids: Sequence[list[int]]) -> list[float]:
        """Scores in input order, `batch_size` sequences per forward, sorted by length."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, v in zip(chunk, self.forward_ids([ids[i] for i in chunk]).tolist()):
                out[i] = v
        return out

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        return self.score_ids(self.encode(texts))

    @torch.no_grad()
    def score_one_by_one(self, texts: Sequence[str]) -> list[float]:
        """transformers' own forward, one unpadded text at a time (the reference the batched path must equal)."""
        out = []
        for t in texts:
            enc = self.tok(t, return_tensors="pt").to(self.device)
            out.append(float(self.model(**enc).logits[0, 0]))
        return out


class RewardModelReward:
    """`reward.name=reward_model` for a run: the reward model, loaded on first use on rank 0, scores a step's
    samples there in batches (StepScorer, on_one_rank). With `rm_train` (its interval > 0) and a `labeler`,
    it also labels them and trains the model every interval steps (rewards/rm_train.py), after scoring: the
    step's rewards come from the model as it was. Called per sample (validation) it scores with `validate`
    when given (e.g. the rule verifier, so that validation judges the policy and not the reward model)."""

    on_one_rank = True

    def __init__(self, tokenizer, path: str, device: str = "", batch_size: int = 64, rm_train=None,
                 labeler: Optional[Callable] = None, label_name: str = "", validate: Optional[Callable] = None,
                 owned: Sequence = ()):
        if not path:
            raise ValueError("reward.name=reward_model needs reward.path=DIR (an HF AutoModelForSequenceClassification)")
        check_reward_model_dir(path)
        self.tok, self.path, self.device, self.batch_size = tokenizer, path, device, batch_size
        self.rm_train = rm_train if rm_train is not None and rm_train.interval > 0 else None
        if self.rm_train is not None and labeler is None:
            raise ValueError("reward.rm_train.interval > 0 needs a label source (reward.rm_train.labels)")
        self.labeler, self.label_name, self.validate = labeler, label_name, validate
        self.owned = list(owned)  # things to close with this one (the label source's worker pool)
        self._rm: Optional[RewardModel] = None
        self._trainer = None
        self._resume_from: Optional[Path] = None

    @property
    def metric_keys(self) -> tuple[str, ...]:
        from grpo_mega.rewards.rm_train import RMTrainer

        return RMTrainer.METRICS if self.rm_train is not None else ()

    @property
    def rm(self) -> RewardModel:
        if self._rm is None:
            self._rm = RewardModel(self.path, self.device, batch_size=self.batch_size)
        return self._rm

    @property
    def trainer(self):
        if self._trainer is None:
            from grpo_mega.rewards.rm_train import RMTrainer

            self._trainer = RMTrainer(self.rm_train, self.rm)
            if self._resume_from is not None:
                self._trainer.load(self._resume_from)
        return self._trainer

    def text(self, example, response_ids) -> str:
        """What the reward model reads: the prompt and the response, decoded by the policy's tokenizer."""
        return (self.tok.decode(example.prompt_ids, skip_special_tokens=True)
                + self.tok.decode(response_ids, skip_special_tokens=True))

    def __call__(self, example, response_ids) -> float:
        if self.validate is not None:
            return self.validate(example, response_ids)
        values, bad = finite_scores(self.rm.score_texts([self.text(example, response_ids)]), ["a validation sample"])
        for msg in bad:
            log.warning(msg)
        return values[0]

    def score_batch(self, examples, response_ids, indices, step):
        """Rank 0's scores; a non-finite score counts in reward/errors and is scored 0 (the run stops when more
        than reward.max_error_fraction of the samples fail: grpo_mega.trainer.guards)."""
        if not indices:  # not the scoring rank: zeros for the counts rank 0 reports
            return [], dict.fromkeys(self.metric_keys, 0.0)
        trainer = self.trainer if self.rm_train is not None else None  # first use after a resume: loads its state
        ids = self.rm.encode([self.text(examples[i], response_ids[i]) for i in indices])
        values, bad = finite_scores(self.rm.score_ids(ids), [f"sample {i}" for i in indices])
        for msg in bad[:5]:
            log.warning(msg)
        errors = {"reward/errors": float(len(bad))}
        if self.rm_train is None:
            return values, errors
        from grpo_mega.rewards.rm_train import check_label

        labels = self.labeler([examples[i] for i in indices], [response_ids[i] for i in indices])
        labels = [check_label(v, self.label_name, f"sample {i} (response={self.tok.decode(response_ids[i])[:80]!r})")
                  for i, v in zip(indices, labels)]
        trainer.add(ids, labels)
        if step % self.rm_train.interval == 0:
            trainer.update()
            return values, {**trainer.metrics(updated=True), **errors}
        return values, {**trainer.metrics(updated=False), **errors}

    # ---- checkpoint (rank 0 saves; every rank is told where to load from, rank 0 loads on first use) -------

    def save_files(self, d: Path) -> None:
        if self.rm_train is not None:
            self.trainer.save(Path(d) / "reward_model")

    def load_files(self, d: Path) -> None:
        if self.rm_train is not None:
            self._resume_from = Path(d) / "reward_model"
            if self._trainer is not None:
                self._trainer.load(self._resume_from)

    def close(self) -> None:
        for thing in self.owned:
            thing.close()
        self._rm = self._trainer = None
