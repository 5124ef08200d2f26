"""What an engine returns, checked where it enters the trainer: nothing a server (or an engine in this process)
sends is trusted. The dedicated servers' client (grpo_mega.engines.client) checks each sample of SGLang's JSON
(or the stand-in server's, which speaks it) before it narrows anything, and raises ServerError naming the server
and the field; grpo_mega.rollout.placement.Engines checks every Generation an engine hands it (the embedded and
SGLang engines in this process, the multi-turn engine over either) with the same functions.

Per sample: token ids are integers (never a float: 6.7 would become 6) in [0, vocab_size); exactly one logprob
per token, each a finite number <= LOGPROB_TOLERANCE; the finish reason is "stop" or "length" (SGLang's "abort",
a request it gave up, is an error, not a stop); routed experts (routing replay) are [P + R - 1, M, k] with k the
model's top-k and every id in [0, num_experts) or -1 (no route), the k ids of a token distinct, all checked on
the values as sent (int32), before they are narrowed to int16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

LOGPROB_TOLERANCE = 1e-3
"""The largest logprob taken: log-softmax rounds to a little above 0 for a token of probability ~1 (in float32,
a few ulps of the logits' scale: ~1e-5 for logits of order 100); anything above this is not a probability."""

FINISH_REASONS = ("stop", "length")


class BadOutput(ValueError):
    """A sample an engine returned breaks the contract; the message names the field and the value."""


@dataclass(frozen=True)
class OutputSpec:
    """What a sample is checked against: the model's real vocabulary, and for routed experts its expert count
    and top-k (None: not checked)."""

    vocab_size: Optional[int] = None
    num_experts: Optional[int] = None
    top_k: Optional[int] = None

    @classmethod
    def of(cls, model) -> "OutputSpec":
        """From a ModelConfig."""
        return cls(vocab_size=model.vocab_size, num_experts=model.num_experts, top_k=model.moe_router_topk)


def _show(values: Sequence, index: int) -> str:
    return f"[{index}] = {values[index]!r}"


def token_ids(ids, spec: OutputSpec, field: str = "output_ids") -> list[int]:
    """`ids` as a list of ints: a list of integers (not bools, not floats) in [0, vocab_size)."""
    if not isinstance(ids, (list, tuple)):
        raise BadOutput(f"{field} is {type(ids).__name__}, not a list of token ids")
    if set(map(type, ids)) - {int}:  # exact types: a bool (an int subclass) or a float is refused
        i = next(i for i, t in enumerate(ids) if type(t) is not int)  # noqa: E721
        raise BadOutput(f"{field}{_show(ids, i)} is not an integer token id")
    if ids:
        lo, hi = min(ids), max(ids)
        limit = spec.vocab_size
        if lo < 0 or (limit is not None and hi >= limit):
            i = ids.index(lo if lo < 0 else hi)
            raise BadOutput(f"{field}{_show(ids, i)} is outside the vocabulary [0, {limit if limit is not None else 'V'})")
    return list(ids)


def logprobs(values, count: int, field: str = "output_token_logprobs") -> list[float]:
    """`values` as floats: exactly `count` of them (one per token), each finite and <= LOGPROB_TOLERANCE."""
    if not isinstance(values, (list, tuple)):
        raise BadOutput(f"{field} is {type(values).__name__}, not a list")
    if len(values) != count:
        raise BadOutput(f"{field} has {len(values)} logprobs for {count} tokens (one per token)")
    if set(map(type, values)) - {float, int}:
        i = next(i for i, v in enumerate(values) if type(v) not in (float, int))
        raise BadOutput(f"{field}{_show(values, i)} is not a number")
    try:
        out = [float(v) for v in values]
    except OverflowError:  # an integer beyond a float's range: infinite, for the check below
        out = [_float(v) for v in values]
    # in Python: a response's few logprobs cost more as a tensor (rank 0 checks one request per response in flight)
    i = next((i for i, v in enumerate(out) if not (math.isfinite(v) and v <= LOGPROB_TOLERANCE)), None)
    if i is not None:
        raise BadOutput(f"{field}{_show(values, i)} is not a finite logprob <= {LOGPROB_TOLERANCE:g}")
    return out


def _float(v) -> float:
    try:
        return float(v)
    except OverflowError:
        return float("inf")


def finish_reason(reason, field: str = "finish_reason") -> str:
    """"stop" or "length"; anything else (SGLang's "abort" with its message, None) is an error."""
    if reason not in FINISH_REASONS:
        raise BadOutput(f"{field} is {reason!r}, not one of {FINISH_REASONS} (an aborted or unfinished request)")
    return reason


def routed_experts(routes: torch.Tensor, positions: int, spec: OutputSpec, field: str = "routed_experts") -> torch.Tensor:
    """`routes` [positions, M, k] of any integer dtype, checked on its own values (before any narrowing): k equal
    to the model's top-k, every id in [0, num_experts) or -1, and per (position, layer) either all k ids -1 (no
    route) or k distinct real ones. Returns them as int16 (what Generation.routed_experts holds)."""
    if routes.dtype.is_floating_point or routes.dtype == torch.bool or routes.dim() != 3:
        raise BadOutput(f"{field}: {routes.dtype} of shape {tuple(routes.shape)}, not integers [positions, layers, k]")
    if routes.shape[0] != positions:
        raise BadOutput(f"{field} covers {routes.shape[0]} positions, not the {positions} fed to the model")
    k = routes.shape[2]
    if spec.top_k is not None and k != spec.top_k:
        raise BadOutput(f"{field} has {k} experts per token, not the model's top-k {spec.top_k}")
    wide = routes.to(torch.int64)
    limit = spec.num_experts if spec.num_experts is not None else torch.iinfo(torch.int16).max + 1
    out_of_range = (wide < -1) | (wide >= limit)
    if bool(out_of_range.any()):
        p, m, j = (int(x) for x in out_of_range.nonzero()[0])
        raise BadOutput(f"{field}[{p}, {m}, {j}] = {int(wide[p, m, j])} is not an expert id in [0, {limit}) or -1")
    none = wide == -1
    mixed = none.any(-1) & ~none.all(-1)
    ordered = wide.sort(-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1) & ~none.all(-1)
    bad = mixed | repeated
    if bool(bad.any()):
        p, m = (int(x) for x in bad.nonzero()[0])
        raise BadOutput(f"{field}[{p}, {m}] = {wide[p, m].tolist()}: the k experts of a token must be distinct "
                        f"(or all -1)")
    return routes.to(torch.int16)


def sglang_sample(out, spec: OutputSpec, aborted_ok: bool = False) -> tuple[list[int], list[float], str]:
    """(token ids, logprobs, finish reason) of one output of SGLang's /generate (`return_logprob`, token ids in and
    out: what SGLang 0.5.23's server and its Engine return, and the stand-in server too), every field checked;
    the token id each logprob entry names must be the output's token at that position. `aborted_ok`: an output
    that /pause_generation (mode abort) ended is its tokens so far with reason "abort" (else an error)."""
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        raise BadOutput(f"an output of {type(out).__name__} {str(out)[:80]!r}, not {{output_ids, meta_info}}")
    meta = out["meta_info"]
    ids = token_ids(out.get("output_ids"), spec)
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise BadOutput(f"meta_info.output_token_logprobs is {type(entries).__name__}, not a list (return_logprob)")
    values = []
    for t, e in enumerate(entries):
        if not isinstance(e, (list, tuple)) or len(e) < 2:
            raise BadOutput(f"meta_info.output_token_logprobs{_show(entries, t)} is not [logprob, token id, ...]")
        if e[1] is not None and t < len(ids) and e[1] != ids[t]:
            raise BadOutput(f"meta_info.output_token_logprobs[{t}] is for token {e[1]!r}, output_ids[{t}] = {ids[t]}")
        values.append(e[0])
    lps = logprobs(values, len(ids), "meta_info.output_token_logprobs")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if aborted_ok and kind == "abort":  # interrupted by /pause_generation: the tokens so far, to be continued
        return ids, lps, "abort"
    if kind not in FINISH_REASONS and isinstance(reason, dict) and reason.get("message"):
        kind = f"{kind}: {str(reason['message'])[:200]}"
    return ids, lps, finish_reason(kind, "meta_info.finish_reason.type")


def token_versions(meta: dict, n: int) -> list[int]:
    """The weight version of each of an output's `n` tokens: SGLang 0.5.23's meta_info["weight_versions"] spans
    ([{version, start, end}], contiguous from 0 to n; several where the request was retracted across a weight update),
    else meta_info["weight_version"] for every token. Versions are integers that never decrease."""
    spans = meta.get("weight_versions")
    if not spans:
        try:
            return [int(meta.get("weight_version"))] * n
        except (TypeError, ValueError):
            raise BadOutput(f"meta_info.weight_version {meta.get('weight_version')!r} is not an integer (a server "
                            "that never took this trainer's weights: start SGLang with --weight-version 0)") from None
    out: list[int] = []
    for i, span in enumerate(spans):
        try:
            v, start, end = int(span["version"]), int(span["start"]), int(span["end"])
        except (TypeError, ValueError, KeyError):
            raise BadOutput(f"meta_info.weight_versions[{i}] = {str(span)[:80]!r} is not "
                            "{version, start, end}") from None
        if start != len(out) or end < start or (out and v < out[-1]):
            raise BadOutput(f"meta_info.weight_versions{_show(spans, i)} do not run from token 0 on in order of "
                            "non-decreasing integer versions")
        out += [v] * (end - start)
    if len(out) != n:
        raise BadOutput(f"meta_info.weight_versions cover {len(out)} tokens, the output has {n}")
    return out


def check_generation(gen, spec: OutputSpec, prompt_lens: Optional[Sequence[int]] = None) -> None:
    """Every sample of a Generation (an engine in this process, or the multi-turn engine): BadOutput naming the
    sample and the field otherwise. `prompt_lens` (per sample): the positions routed experts must cover."""
    n = len(gen.token_ids)
    if len(gen.logprobs) != n or len(gen.finish_reasons) != n:
        raise BadOutput(f"{n} samples with {len(gen.logprobs)} logprob lists and {len(gen.finish_reasons)} finish "
                        "reasons")
    for i in range(n):
        try:
            token_ids(gen.token_ids[i], spec, "token_ids")
            logprobs(gen.logprobs[i], len(gen.token_ids[i]), "logprobs")
            finish_reason(gen.finish_reasons[i], "finish_reason")
            routes = gen.routed_experts[i] if gen.routed_experts is not None else None
            if routes is not None:
                positions = prompt_lens[i] + len(gen.token_ids[i]) - 1 if prompt_lens is not None else routes.shape[0]
                routed_experts(routes, positions, spec)
        except BadOutput as e:
            raise BadOutput(f"sample {i}: {e}") from None
