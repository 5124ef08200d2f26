"""Multi-turn rollouts with tool calls, token in and token out: `MultiTurnEngine` wraps a rollout engine so
that each sample is generated turn by turn (the model's turn until a stop token or the budget; tool calls
parsed from it, run in grpo_mega.toolcalls.pool, their results appended as the chat template's ids for the NEW
segment only; again, up to `max_turns` model turns), while the trainer still sees one RolloutEngine.

Token in, token out: a sample's context is always the prompt ids followed by exactly the ids the engine
sampled and the ids of the tool segments, in order; earlier turns are never re-rendered or re-tokenized (a
template that rewrites earlier assistant turns, e.g. one stripping <think>...</think>, would change them).
The output Generation's token_ids are the whole trajectory after the prompt, within max_new_tokens (model +
tool tokens); `model_mask` marks the model's tokens (1, stop tokens included) against tool results and
template glue (0, logprob 0.0), and the loss sees only the 1s (grpo_mega.trainer.batch.RolloutBatch.model_mask).
A trajectory cut by the budget ends "length". Every engine call batches all unfinished samples, whatever
turn each is at. Per-sample seeds derive from (seed, prompt index, sample index, turn), so a sample does not
depend on what else is in the batch or on how prompts are spread over engines.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from grpo_mega.rollout.interface import Generation, RolloutEngine, sample_seed
from grpo_mega.toolcalls.parsers import PARSERS, ToolCall
from grpo_mega.toolcalls.pool import ToolPool, ToolResult

_MARK = "GRPOMEGAASSISTANTMARK"


class ToolTurnRenderer:
    """The token ids that follow a model turn ending in a stop token and holding tool calls: the tool results
    as the tokenizer's chat template renders them (role "tool"), then the next assistant turn's generation
    prompt. Rendered against a fixed stand-in conversation and cut after the stand-in assistant turn's
    end-of-turn text (which the model sampled itself as its stop token), so only the new segment is tokenized."""

    def __init__(self, tokenizer, stop_token_ids: Iterable[int]):
        self.tok = tokenizer
        self.stop_texts = sorted({tokenizer.decode([i]) for i in stop_token_ids}, key=len, reverse=True)
        self.text(["probe"])  # a template that cannot render tool turns fails here, at start-up

    def text(self, results: Sequence[str]) -> str:
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        full = self.tok.apply_chat_template(base + [{"role": "tool", "content": r} for r in results],
                                            tokenize=False, add_generation_prompt=True)
        if _MARK not in full:
            raise ValueError("the chat template dropped the assistant turn's content; cannot find the tool segment")
        rest = full[full.index(_MARK) + len(_MARK):]
        for s in self.stop_texts:
            if s and rest.startswith(s):
                return rest[len(s):]
        raise ValueError(f"the chat template ends an assistant turn with {rest[:30]!r}, which starts with none of "
                         f"the stop tokens {self.stop_texts}: the model's own stop token could not end its turn")

    def ids(self, results: Sequence[str]) -> list[int]:
        return list(self.tok.encode(self.text(results), add_special_tokens=False))


@dataclass
class _Sample:
    context: list[int]
    tools_kwargs: dict
    seed: int
    ids: list[int]
    logps: list[float]
    mask: list[int]
    turns: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    truncated: int = 0
    finish: Optional[str] = None


STAT_KEYS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_truncated", "model_tokens", "tool_tokens")


def clip_result(text: str, max_chars: int) -> tuple[str, bool]:
    """A tool result of at most `max_chars` characters (then '...[truncated N chars]' marks what was cut)."""
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + f"...[truncated {len(text) - max_chars} chars]", True


def join_stats(parts: Sequence[Optional[dict]]) -> dict:
    """Several engines' Generation.extra["multi_turn"] as one (per-sample lists joined, seconds summed)."""
    parts = [p for p in parts if p]
    out = {k: [v for p in parts for v in p.get(k, [0] * len(p["turns"]))] for k in STAT_KEYS}
    out["tool_seconds"] = sum(p["tool_seconds"] for p in parts)
    return out


class MultiTurnEngine(RolloutEngine):
    """`inner` (an engine whose generate takes per-row seeds: the embedded engine, in-process SGLang, or the
    dedicated servers' client) driven turn by turn.
    Weights, checksums and health are the inner engine's. A tool result longer than `max_tool_response_chars`
    is cut to it and marked; one longer than the trajectory's remaining token budget is cut there and the
    trajectory ends "length" (reward.overlong); both are counted in `tool_truncated`.
    `call_stop_ids`: tokens that also end a model turn (to run its calls; e.g. `</tool_call>`), beside the
    trajectory's stop tokens. `row_tools_kwargs(prompt_ids)`: the prompt row's verl tools_kwargs
    ({tool: {"create_kwargs": {...}, "execute_kwargs": {...}}}, or None), given to that tool's calls."""

    def __init__(self, inner, tokenizer, pool: ToolPool, parser: str = "hermes", max_turns: int = 4,
                 stop_token_ids: Optional[Iterable[int]] = None, max_tool_response_chars: int = 4096,
                 call_stop_ids: Iterable[int] = (),
                 row_tools_kwargs: Optional[Callable[[Sequence[int]], Optional[dict]]] = None):
        if "row_seeds" not in inspect.signature(inner.generate).parameters:
            raise ValueError(f"rollout.multi_turn needs an engine that samples with per-row seeds (the embedded "
                             f"engine, SGLang, the servers' client); {type(inner).__name__} does not")
        if max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns={max_turns} must be >= 1")
        if max_tool_response_chars < 1:
            raise ValueError(f"rollout.multi_turn.max_tool_response_chars={max_tool_response_chars} must be >= 1")
        self.inner, self.tok, self.pool, self.max_turns = inner, tokenizer, pool, max_turns
        self.max_chars = max_tool_response_chars
        self.call_stop, self.row_tools_kwargs = list(call_stop_ids), row_tools_kwargs
        self.parse: Callable[[str], list[ToolCall]] = PARSERS.get(parser)
        self.renderer = ToolTurnRenderer(tokenizer, stop_token_ids or [tokenizer.eos_token_id])
        self.bare_name = None  # the parser=bare calls' tool: the run's only one
        if parser == "bare":
            if len(pool.tools) != 1:
                raise ValueError(f"rollout.multi_turn.parser=bare calls the run's only tool; "
                                 f"rollout.multi_turn.tools has {len(pool.tools)}: {sorted(pool.tools)}")
            self.bare_name = next(iter(pool.tools))

    # the inner engine's weights
    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @property
    def loads_tensors(self) -> bool:
        return getattr(self.inner, "loads_tensors", False)

    def update_weights(self, version, buckets) -> None:
        self.inner.update_weights(version, buckets)

    def weight_checksums(self, shapes=None):
        return self.inner.weight_checksums(shapes)

    def health(self) -> dict:
        return {**self.inner.health(), "multi_turn": True}

    def shutdown(self) -> None:
        self.pool.close()
        self.inner.shutdown()

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 stop_token_ids: Iterable[int], seed: int, prompt_offset: int = 0) -> Generation:
        """As RolloutEngine.generate, each sample a multi-turn trajectory of at most max_new_tokens tokens."""
        stop = list(stop_token_ids)
        rows = [(self.row_tools_kwargs(p) if self.row_tools_kwargs else None) or {} for p in prompts]
        samples = [_Sample(list(prompts[p]), rows[p], sample_seed(seed, prompt_offset + p, j), [], [], [])
                   for p in range(len(prompts)) for j in range(n)]
        tool_seconds, version = 0.0, self.inner.weight_version
        for turn in range(self.max_turns):
            active = [s for s in samples if s.finish is None]
            if not active:
                break
            budget = max(max_new_tokens - len(s.ids) for s in active)
            gen = self.inner.generate([s.context for s in active], 1, temperature, top_p, budget,
                                      stop + [t for t in self.call_stop if t not in stop], seed,
                                      row_seeds=[sample_seed(s.seed, turn, 0) % 2**31 for s in active])
            version = gen.weight_version
            want: list[tuple[_Sample, list[ToolCall]]] = []
            for s, ids, lps, fin in zip(active, gen.token_ids, gen.logprobs, gen.finish_reasons):
                room = max_new_tokens - len(s.ids)
                if len(ids) > room:  # a longer budget was asked for the batch: this sample's ends here
                    ids, lps, fin = ids[:room], lps[:room], "length"
                s.ids += ids
                s.logps += lps
                s.mask += [1] * len(ids)
                s.context += ids
                s.turns += 1
                if fin == "length":
                    s.finish = "length"
                    continue
                calls = self.parse(self.tok.decode(ids))
                if not calls or turn + 1 == self.max_turns:
                    s.finish = "stop"
                    continue
                if len(s.ids) >= max_new_tokens:  # tool calls, but no room for their results
                    s.finish = "length"
                    continue
                for c in calls:
                    if self.bare_name and not c.name and c.error is None:
                        c.name = self.bare_name
                    kw = s.tools_kwargs.get(c.name) or {}
                    c.kwargs = {**(kw.get("create_kwargs") or {}), **(kw.get("execute_kwargs") or {})}
                want.append((s, calls))
            if not want:
                continue
            t0 = time.perf_counter()
            results: list[ToolResult] = self.pool.run([c for _, calls in want for c in calls])
            tool_seconds += time.perf_counter() - t0
            k = 0
            for s, calls in want:
                mine, k = results[k:k + len(calls)], k + len(calls)
                s.calls += len(calls)
                s.errors += sum(r.error for r in mine)
                s.timeouts += sum(r.timeout for r in mine)
                clipped = [clip_result(r.content, self.max_chars) for r in mine]
                s.truncated += sum(cut for _, cut in clipped)
                seg = self.renderer.ids([text for text, _ in clipped])
                room = max_new_tokens - len(s.ids)
                if len(seg) >= room:  # no room left for the model: the trajectory is cut by the budget
                    s.truncated += len(seg) > room
                    seg, s.finish = seg[:room], "length"
                s.ids += seg
                s.logps += [0.0] * len(seg)
                s.mask += [0] * len(seg)
                s.context += seg
        stats = {"turns": [s.turns for s in samples], "tool_calls": [s.calls for s in samples],
                 "tool_errors": [s.errors for s in samples], "tool_timeouts": [s.timeouts for s in samples],
                 "tool_truncated": [s.truncated for s in samples],
                 "model_tokens": [sum(s.mask) for s in samples], "tool_tokens": [len(s.mask) - sum(s.mask) for s in samples],
                 "tool_seconds": tool_seconds}
        return Generation(token_ids=[s.ids for s in samples], logprobs=[s.logps for s in samples],
                          finish_reasons=[s.finish or "stop" for s in samples], weight_version=version,
                          extra={"multi_turn": stats}, model_mask=[s.mask for s in samples])


def rollout_metrics(gen: Generation) -> dict:
    """The step's multi-turn metrics (empty for single-turn rollouts): turns per sample, tool calls, errors,
    timeouts and truncated results per sample, seconds in tools (summed over engines), and tokens per sample by
    kind. The same on every rank (from the per-sample counts every rank receives)."""
    stats = gen.extra.get("multi_turn")
    if not stats:
        return {}
    count = max(1, len(stats["turns"]))
    mean = lambda k: sum(stats.get(k, ())) / count  # noqa: E731 (a key an older engine lacks: 0)
    return {"multi_turn/turns": mean("turns"), "multi_turn/tool_calls": mean("tool_calls"),
            "multi_turn/tool_errors": mean("tool_errors"), "multi_turn/tool_timeouts": mean("tool_timeouts"),
            "multi_turn/tool_truncated": mean("tool_truncated"),
            "timing/tools": stats["tool_seconds"], "multi_turn/model_tokens": mean("model_tokens"),
            "multi_turn/tool_tokens": mean("tool_tokens")}
