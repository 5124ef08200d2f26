"""Reward functions by name, and the wrapper that applies one to a step's samples.

A reward function takes (response_text, ground_truth, sample) and returns a real number: a Python int or
float, a numpy scalar or a 0-d array or tensor; a bool counts as 1.0 / 0.0 (a verifier's verdict, what
math_verify.verify returns); NaN and infinities are failures. `sample` is the data row (data_source,
extra_info, ...). Registered: `math` (math-verify: the response's final answer against the
ground truth), `format` (the response matches a regex), `mix` (a weighted sum of others), and any
function given by dotted path (`my_pkg.rewards:score` or `my_pkg.rewards.score`). A function that raises
or returns a non-number is reported with the sample that caused it; `on_error=zero` scores it 0 and goes
on (until more than `reward.max_error_fraction` of the samples fail: grpo_mega.trainer.guards), `on_error=raise`
stops the run.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from grpo_mega.registry import Registry

log = logging.getLogger(__name__)

RewardFn = Callable[..., float]
REWARDS: Registry[Callable[..., RewardFn]] = Registry("reward function")


class RewardError(RuntimeError):
    """A reward function failed on a sample."""


@REWARDS.register("math")
def math_reward(**_) -> RewardFn:
    """1.0 when math-verify finds the response's answer equal to the ground truth, else 0.0.

    math-verify's default timeout uses signal.alarm: call it from the main thread (the loop does)."""
    from math_verify import parse, verify

    def score(response: str, ground_truth: Any, sample: Optional[dict] = None) -> float:
        gold = parse(str(ground_truth) if "$" in str(ground_truth) else f"${ground_truth}$")
        answer = parse(response)
        return 1.0 if answer and gold and verify(gold, answer) else 0.0

    return score


@REWARDS.register("format")
def format_reward(pattern: str = r"(?s).*\\boxed\{.+\}.*", **_) -> RewardFn:
    """1.0 when the whole response matches `pattern` (default: it contains a \\boxed{...} answer)."""
    regex = re.compile(pattern)

    def score(response: str, ground_truth: Any = None, sample: Optional[dict] = None) -> float:
        return 1.0 if regex.fullmatch(response) else 0.0

    return score


@REWARDS.register("mix")
def mix_reward(weights: Optional[dict[str, float]] = None, **kwargs) -> RewardFn:
    """sum_i w_i * reward_i, e.g. weights={"math": 1.0, "format": 0.1}."""
    if not weights:
        raise ValueError("reward=mix needs reward.weights, e.g. {math: 1.0, format: 0.1}")
    parts = [(build_reward(name, **(kwargs.get(name) or {})), w) for name, w in weights.items()]

    def score(response: str, ground_truth: Any = None, sample: Optional[dict] = None) -> float:
        return sum(w * f(response, ground_truth, sample) for f, w in parts)

    return score


@REWARDS.register("reward_model")
def reward_model(path: str = "", device: str = "cpu", **_) -> RewardFn:
    """A learned reward model: an HF sequence-classification checkpoint at `path`, scoring the prompt and
    response re-tokenised with the reward model's own tokenizer (its vocabulary need not be the policy's).
    The score is the first logit at the last token. Per sample; a run scores a step's samples in batches
    (rewards/reward_model.py)."""
    if not path:
        raise ValueError("reward=reward_model needs reward.path=DIR (an HF AutoModelForSequenceClassification)")
    from grpo_mega.rewards.reward_model import RewardModel

    rm = RewardModel(path, device)

    def score(response: str, ground_truth: Any = None, sample: Optional[dict] = None) -> float:
        return rm.score_texts([(sample or {}).get("prompt_text", "") + response])[0]

    return score


def _from_path(path: str) -> RewardFn:
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {path!r}: cannot import {attr!r} from {module!r} ({e})") from None
    if not callable(fn):
        raise ValueError(f"reward {path!r} is not callable")
    return fn


def build_reward(name: str, **kwargs) -> RewardFn:
    """A registered reward by name, or a user function by dotted path."""
    if name in REWARDS:
        return REWARDS.get(name)(**kwargs)
    if "." in name or ":" in name:
        return _from_path(name)
    REWARDS.get(name)  # raises, listing the valid names
    raise AssertionError("unreachable")


@dataclass
class RewardStats:
    errors: int = 0
    """Samples whose reward raised, returned a non-number or timed out (scored 0 under on_error=zero)."""
    timeouts: int = 0
    """Of those, samples cut at reward.timeout_s."""
    examples: list[str] = field(default_factory=list)
    """The first few messages, for the report."""


def check_reward_value(value) -> float:
    """`value` as a float: a real number (int, float, bool as 1.0/0.0, a numpy scalar, a 0-d numpy array or
    torch tensor); a TypeError for anything else (a string, a list, a complex, a tensor of more than one
    value) and for NaN or an infinity."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy scalar or 0-d array, 0-d tensor
        value = value.item()
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise TypeError(f"returned {shown}; a reward must be a finite number (a Python, numpy or 0-d tensor real)")
    return float(value)


def report_failure(name: str, where: str, detail: str, on_error: str, stats: RewardStats,
                   timeout: bool = False, cause: Optional[BaseException] = None, what: str = "reward function") -> None:
    """One failed sample: raise RewardError (on_error=raise) or count it, keep the message and log it.
    `what` names the role of the function ('reward function', 'label source')."""
    msg = f"{what} {name!r} failed on {where}: {detail}"
    if on_error == "raise":
        raise RewardError(msg) from cause
    stats.errors += 1
    stats.timeouts += int(timeout)
    if len(stats.examples) < 5:
        stats.examples.append(msg)
    log.warning("%s; scored 0 (reward.on_error=zero)", msg)


def score_samples(fn: RewardFn, responses: list[str], ground_truths: list[Any], samples: list[dict],
                  on_error: str = "zero", stats: Optional[RewardStats] = None) -> list[float]:
    """Apply `fn` to every sample in this process. A raise or a non-number names the sample; on_error=zero|raise.
    (rewards/scoring.py's RewardPool does the same in worker processes, with a time limit.)"""
    if on_error not in ("zero", "raise"):
        raise ValueError(f"reward.on_error={on_error!r} must be 'zero' or 'raise'")
    stats = stats if stats is not None else RewardStats()
    out = []
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    for i, (resp, gt, sample) in enumerate(zip(responses, ground_truths, samples)):
        where = f"sample {i} (data_source={sample.get('data_source')!r}, response={resp[:80]!r})"
        try:
            out.append(check_reward_value(fn(resp, gt, sample)))
        except Exception as e:  # noqa: BLE001 - user code: report it with the sample
            report_failure(name, where, f"{type(e).__name__}: {e}", on_error, stats, cause=e)
            out.append(0.0)
    return out
