"""DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): which groups a step trains on.

A group whose n rewards are all equal has zero advantage and adds no gradient. `algo.dynamic_sampling=filter`
keeps such groups out of the loss (grpo_mega.algo.shaping's `loss_rows`): the step trains on fewer groups.
`refill` generates more rounds of prompts until the step holds `want` informative groups (or
`algo.max_gen_rounds` rounds were generated) and trains on exactly those; DAPO's recipe. This module owns the
pure part: the mode's name, which groups are informative, when to stop, and which groups fill the step's slots.
Generating and scoring the rounds is the trainer's (grpo_mega.trainer.sampling).

The slot rule: the step has `want` slots, filled by round 0's groups in order; each uninformative slot is
taken, in order, by the next informative group of the later rounds. Slots no later group could fill keep
their uninformative group, which the filter then masks out of the loss. With one round (or an all-informative
round 0) the step is round 0 unchanged: refill with max_gen_rounds=1 is filter.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from grpo_mega.algo.advantages import nonuniform_groups

MODES = ("filter", "refill")


def resolve_mode(value: Union[bool, str, None]) -> Optional[str]:
    """algo.dynamic_sampling as None (off), 'filter' or 'refill'. true/false (the setting's earlier boolean
    form) still mean filter/off. Raises a ValueError naming the field for anything else."""
    if value is None or value is False:
        return None
    if value is True:
        return "filter"
    text = str(value).strip().lower()
    if text in ("false", "off", "none", "null"):
        return None
    if text == "true":
        return "filter"
    if text not in MODES:
        raise ValueError(f"algo.dynamic_sampling={value!r} must be 'filter', 'refill' or null (true: filter, false: null)")
    return text


def informative(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """rewards: [G * n], group-contiguous -> [G] bool: the groups whose rewards are not all equal."""
    return nonuniform_groups(rewards, n)


def enough(rounds: list[torch.Tensor], want: int) -> bool:
    """Do the rounds' informative masks ([G_r] bool each) hold `want` informative groups?"""
    return sum(int(m.sum()) for m in rounds) >= want


def refill_slots(rounds: list[torch.Tensor], want: int) -> list[tuple[int, int]]:
    """The step's groups as (round, group) pairs, by the slot rule (module docstring).

    rounds: [G_r] bool per round (round 0 has G_0 = want groups), True where informative. Returns `want` pairs."""
    if rounds[0].numel() != want:
        raise ValueError(f"round 0 has {rounds[0].numel()} groups; the step wants {want}")
    spare = ((r, g) for r, m in enumerate(rounds[1:], start=1) for g in m.nonzero().flatten().tolist())
    out = []
    for g, ok in enumerate(rounds[0].tolist()):
        nxt: Optional[tuple[int, int]] = None if ok else next(spare, None)
        out.append(nxt if nxt is not None else (0, g))
    return out


def refill_counts(rounds: list[torch.Tensor], picks: list[tuple[int, int]]) -> dict[str, float]:
    """The step's dynamic-sampling metrics: extra rounds generated, groups generated, informative groups
    trained on, uninformative groups dropped (generated, not trained, or trained fully masked), and informative
    groups generated beyond the step's need (not trained)."""
    taken = set(picks)
    informative_taken = sum(int(rounds[r][g]) for r, g in picks)
    generated = sum(m.numel() for m in rounds)
    informative_all = sum(int(m.sum()) for m in rounds)
    return {"dynamic_sampling/extra_rounds": float(len(rounds) - 1),
            "dynamic_sampling/generated_groups": float(generated),
            "dynamic_sampling/informative_groups": float(informative_taken),
            "dynamic_sampling/groups_dropped": float(generated - informative_all),
            "dynamic_sampling/surplus_groups": float(informative_all - informative_taken),
            "dynamic_sampling/masked_groups": float(len(taken) - informative_taken)}
