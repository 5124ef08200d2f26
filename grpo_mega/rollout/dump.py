"""Rollout dumps (rollout.dump_dir, verl's rollout_data_dir): every trajectory a step trained on, or a
validation generated, as one JSON line, written by rank 0 (which holds every sample), one file per step:
`train_step_XXXXXXXX.jsonl` and `val_step_XXXXXXXX.jsonl`.

A line: step, sample index, the prompt's index and data_source, `prompt_ids`, `response_ids`, `model_mask` (1: the
model's token; 0: tool results and template glue; all 1s single-turn), `logprobs` (the engine's; 0.0 off the model's
tokens), `finish_reason`, `prompt` and `response` text (decoded with special tokens), `turns` (role, text, tool
name, error flag, token span in response_ids), `tool_calls` (the tool turns' names and error flags, in order),
`tool_rewards`, the sample's counts (`multi_turn`), `reward`, `weight_version` (the oldest of the sample's batch)
and, for training steps, `advantage`; in rollout.mode=async also `token_versions` (each response token's) and
`prompt_index` is the group's start order over the run (what rollout.replay_dir draws again). `read_dump` gives the
lines back; `RolloutBatch.from_samples` of their prompt_ids, response_ids and model_mask is exactly the batch the
trainer built (tests/rollout/test_dump.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence


def _number(x) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None  # strict JSON: no NaN or Infinity literals


def records(step: int, examples: Sequence, gen, rewards: Sequence[float], advantages: Optional[Sequence[float]] = None,
            tokenizer=None) -> list[dict]:
    """One dict per sample of `gen` (group-contiguous over `examples`, n per example)."""
    n = max(1, len(gen.token_ids) // max(1, len(examples)))
    stats = gen.extra.get("multi_turn") or {}
    per_sample = {k: v for k, v in stats.items() if isinstance(v, list) and k != "tool_rewards"}
    out = []
    for i, ids in enumerate(gen.token_ids):
        e = examples[i // n]
        traj = gen.trajectories[i] if gen.trajectories is not None else None
        turns = (traj or {}).get("turns", [])
        rec = {"step": step, "sample": i, "prompt_index": getattr(e, "index", i // n),
               "data_source": getattr(e, "data_source", ""), "prompt_ids": list(e.prompt_ids), "response_ids": list(ids),
               "model_mask": list(gen.model_mask[i]) if gen.model_mask is not None else [1] * len(ids),
               "logprobs": [_number(x) for x in gen.logprobs[i]], "finish_reason": gen.finish_reasons[i],
               "turns": turns,
               "tool_calls": [{"name": t.get("name"), "error": t.get("error", False)} for t in turns if t["role"] == "tool"],
               "tool_rewards": (traj or {}).get("tool_rewards", {}),
               "multi_turn": {k: v[i] for k, v in per_sample.items() if i < len(v)},
               "reward": _number(rewards[i]), "weight_version": gen.weight_version}
        if "token_versions" in gen.extra:  # rollout.mode=async: each token's version, the group's start order
            rec["token_versions"] = list(gen.extra["token_versions"][i])
            rec["prompt_index"] = gen.extra["prompt_index"][i]
        if advantages is not None:
            rec["advantage"] = _number(advantages[i])
        if tokenizer is not None:
            rec["prompt"] = tokenizer.decode(list(e.prompt_ids))
            rec["response"] = tokenizer.decode(list(ids))
        out.append(rec)
    return out


def write_dump(path, step: int, examples: Sequence, gen, rewards: Sequence[float],
               advantages: Optional[Sequence[float]] = None, tokenizer=None) -> Path:
    """`records(...)` as jsonl at `path` (written to a temporary name, then renamed: a reader never sees half a
    file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for rec in records(step, examples, gen, rewards, advantages, tokenizer):
            f.write(json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def read_dump(path) -> list[dict]:
    """The records of a dump file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
