"""Multi-turn rollouts with tool calls, token in and token out: `MultiTurnEngine` wraps a rollout engine so
that each sample is a trajectory driven by an agent loop (grpo_mega.rollout.agent_loop: by default the model's
turn until a stop token or the budget, its tool calls run in grpo_mega.toolcalls.pool, their results appended
as the chat template's ids for the NEW segment only, grpo_mega.rollout.turns; again, up to `max_turns` model
turns), while the trainer still sees one RolloutEngine.

Token in, token out: a sample's context is always the prompt ids followed by exactly the ids the engine
sampled and the ids of the segments between its turns, in order; earlier turns are never re-rendered or
re-tokenized (a template that rewrites earlier assistant turns, e.g. one stripping <think>...</think>, would
change them). The output Generation's token_ids are the whole trajectory after the prompt, within
max_new_tokens (model + tool tokens); `model_mask` marks the model's tokens (1, stop tokens included) against
tool results and template glue (0, logprob 0.0), and the loss sees only the 1s
(grpo_mega.trainer.batch.RolloutBatch.model_mask); `trajectories` gives each sample's turns (role, text, tool
name, error flag) and its tools' rewards, what the reward function reads. A trajectory cut by the budget ends
"length". Every engine call batches all trajectories waiting for a model turn, whatever turn each is at;
per-sample seeds derive from (seed, prompt index, sample index, turn), so a sample does not depend on what
else is in the batch or on how prompts are spread over engines. Tool calls run while other trajectories
generate (rollout.multi_turn.async_tools; off: turns in lockstep).
"""

from __future__ import annotations

import inspect
import itertools
from typing import Callable, Iterable, Optional, Sequence

from grpo_mega.rollout.agent_loop import COUNTS, _Driver, load_agent_loop, run_trajectories, tool_loop
from grpo_mega.engines.interface import Generation, RolloutEngine, sample_seed
from grpo_mega.rollout.turns import MessageRenderer
from grpo_mega.toolcalls.parsers import PARSERS
from grpo_mega.toolcalls.pool import ToolPool

STAT_KEYS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_truncated", "tool_nonstring",
             "unclosed_calls", "max_turns_reached", "agent_loop_errors", "model_tokens", "tool_tokens")
"""Per-sample counts in Generation.extra["multi_turn"] (lists, one entry per sample); beside them per sample
"tool_rewards" ({tool: reward or None}), and for the whole call "tool_seconds" (generation waiting on tools)
and "per_tool" ({tool: {"calls", "errors", "timeouts", "seconds"}})."""

_FROM = {"tool_calls": "calls", "tool_errors": "errors", "tool_timeouts": "timeouts", "tool_truncated": "truncated",
         "tool_nonstring": "nonstring", "unclosed_calls": "unclosed", "max_turns_reached": "max_turns_reached",
         "agent_loop_errors": "agent_loop_errors"}
assert set(_FROM.values()) == set(COUNTS)


def clip_result(text: str, max_chars: int) -> tuple[str, bool]:
    """A tool result of at most `max_chars` characters (then '...[truncated N chars]' marks what was cut)."""
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + f"...[truncated {len(text) - max_chars} chars]", True


def _add_per_tool(into: dict, more: dict) -> dict:
    for name, t in (more or {}).items():
        d = into.setdefault(name, {"calls": 0, "errors": 0, "timeouts": 0, "seconds": 0.0})
        for k in d:
            d[k] += t.get(k, 0)
    return into


def join_stats(parts: Sequence[Optional[dict]]) -> dict:
    """Several engines' Generation.extra["multi_turn"] as one (per-sample lists joined, seconds and per-tool
    counts summed)."""
    parts = [p for p in parts if p]
    out = {k: [v for p in parts for v in p.get(k, [0] * len(p["turns"]))] for k in STAT_KEYS}
    out["tool_rewards"] = [v for p in parts for v in p.get("tool_rewards", [{}] * len(p["turns"]))]
    out["tool_seconds"] = sum(p["tool_seconds"] for p in parts)
    out["per_tool"] = {}
    for p in parts:
        _add_per_tool(out["per_tool"], p.get("per_tool"))
    return out


def select_stats(parts: Sequence[dict], rows: Sequence[tuple[int, int]]) -> dict:
    """The (part, sample) `rows` of several generations' stats (algo.dynamic_sampling=refill's rounds) as one;
    seconds and per-tool counts are of all the rounds."""
    out = {k: [parts[r].get(k, [0] * len(parts[r]["turns"]))[i] for r, i in rows] for k in STAT_KEYS}
    out["tool_rewards"] = [parts[r].get("tool_rewards", [{}] * len(parts[r]["turns"]))[i] for r, i in rows]
    out["tool_seconds"] = sum(p["tool_seconds"] for p in parts)
    out["per_tool"] = {}
    for p in parts:
        _add_per_tool(out["per_tool"], p.get("per_tool"))
    return out


def check_multi_turn(mt, tokenizer, stop_token_ids: Sequence[int]) -> list[int]:
    """rollout.multi_turn against the tokenizer, before any model is built: the call-stop tokens (each one
    token; returned as ids), the chat template's tool (and, with an agent loop, user) turns after each stop
    token; a ValueError naming what does not fit."""
    call_stop = []
    for t in mt.call_stop:
        i = tokenizer.convert_tokens_to_ids(t)
        if not isinstance(i, int) or tokenizer.convert_ids_to_tokens(i) != t:
            raise ValueError(f"rollout.multi_turn.call_stop: {t!r} is not one token of the tokenizer")
        if i in stop_token_ids:
            raise ValueError(f"rollout.multi_turn.call_stop: {t!r} is already a stop token of the trajectory")
        call_stop.append(i)
    MessageRenderer(tokenizer, stop_token_ids, ("tool", "user") if mt.agent_loop else ("tool",))
    return call_stop


class MultiTurnEngine(RolloutEngine):
    """`inner` (an engine whose generate takes per-row seeds: the embedded engine, in-process SGLang, or the
    dedicated servers' client) driven by an agent loop (`agent_loop`: an `async def loop(traj)` or its dotted
    path; None: grpo_mega.rollout.agent_loop.tool_loop).
    Weights, checksums and health are the inner engine's. A tool result longer than `max_tool_response_chars`
    is cut to it and marked; one longer than the trajectory's remaining token budget is cut there and the
    trajectory ends "length" (reward.overlong); both are counted in `tool_truncated`.
    `call_stop_ids`: tokens that also end a model turn (to run its calls; e.g. `</tool_call>`), beside the
    trajectory's stop tokens. A prompt's row (generate's `rows`; without them `row_tools_kwargs(prompt_ids)`)
    gives its verl tools_kwargs ({tool: {"create_kwargs": {...}, "execute_kwargs": {...}}}) to that
    trajectory's tool instances."""

    def __init__(self, inner, tokenizer, pool: ToolPool, parser: str = "hermes", max_turns: int = 4,
                 stop_token_ids: Optional[Iterable[int]] = None, max_tool_response_chars: int = 4096,
                 call_stop_ids: Iterable[int] = (),
                 row_tools_kwargs: Optional[Callable[[Sequence[int]], Optional[dict]]] = None,
                 agent_loop=None, async_tools: bool = True, max_tool_calls_per_turn: int = 8,
                 max_tool_call_chars: int = 8192):
        if "row_seeds" not in inspect.signature(inner.generate).parameters:
            raise ValueError(f"rollout.multi_turn needs an engine that samples with per-row seeds (the embedded "
                             f"engine, SGLang, the servers' client); {type(inner).__name__} does not")
        if max_turns < 1:
            raise ValueError(f"rollout.multi_turn.max_turns={max_turns} must be >= 1")
        if max_tool_response_chars < 1:
            raise ValueError(f"rollout.multi_turn.max_tool_response_chars={max_tool_response_chars} must be >= 1")
        PARSERS.get(parser)  # an unknown name raises, listing the valid ones
        self.inner, self.tok, self.pool, self.max_turns = inner, tokenizer, pool, max_turns
        self.max_chars, self.parser = max_tool_response_chars, parser
        self.max_calls, self.max_call_chars = max_tool_calls_per_turn, max_tool_call_chars
        self.call_stop, self.row_tools_kwargs = list(call_stop_ids), row_tools_kwargs
        self.stop_ids = set(stop_token_ids or [tokenizer.eos_token_id])
        if isinstance(agent_loop, str):
            agent_loop = load_agent_loop(agent_loop)
        self.agent_loop = agent_loop or tool_loop
        self.async_tools = async_tools
        self.renderer = MessageRenderer(tokenizer, self.stop_ids, ("tool",) if agent_loop is None else ("tool", "user"))
        self.bare_name = None  # the parser=bare calls' tool: the run's only one
        if parser == "bare":
            if len(pool.tools) != 1:
                raise ValueError(f"rollout.multi_turn.parser=bare calls the run's only tool; "
                                 f"rollout.multi_turn.tools has {len(pool.tools)}: {sorted(pool.tools)}")
            self.bare_name = next(iter(pool.tools))
        self._uids = itertools.count()
        self.loop_error_logged = False
        self.last_engine_calls = 0

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
                 stop_token_ids: Iterable[int], seed: int, prompt_offset: int = 0,
                 rows: Optional[Sequence[Optional[dict]]] = None) -> Generation:
        """As RolloutEngine.generate, each sample a multi-turn trajectory of at most max_new_tokens tokens;
        `rows[p]`: prompt p's row (its tools_kwargs, what an agent loop reads)."""
        stop = list(stop_token_ids)
        if rows is None:
            rows = [{"extra_info": {"tools_kwargs": (self.row_tools_kwargs(p) if self.row_tools_kwargs else None) or {}}}
                    for p in prompts]
        args = [(p * n + j, (id(self), next(self._uids)), prompts[p], rows[p] or {},
                 sample_seed(seed, prompt_offset + p, j)) for p in range(len(prompts)) for j in range(n)]
        driver = _Driver(self, args, max_new_tokens, temperature, top_p, stop, seed, self.async_tools)
        run_trajectories(driver, self.agent_loop)
        self.last_engine_calls = driver.engine_calls
        trajs = driver.trajectories
        stats = {k: [getattr(t.stats, _FROM[k]) for t in trajs] for k in _FROM}
        stats.update(turns=[t.model_turns for t in trajs], model_tokens=[sum(t.mask) for t in trajs],
                     tool_tokens=[len(t.mask) - sum(t.mask) for t in trajs],
                     tool_rewards=[dict(t.tool_rewards) for t in trajs], tool_seconds=driver.waited, per_tool={})
        for t in trajs:
            _add_per_tool(stats["per_tool"], t.stats.per_tool)
        return Generation(token_ids=[t.ids for t in trajs], logprobs=[t.logprobs for t in trajs],
                          finish_reasons=[t.finish or "stop" for t in trajs], weight_version=driver.version,
                          extra={"multi_turn": stats}, model_mask=[t.mask for t in trajs],
                          trajectories=[{"turns": t.turns, "tool_rewards": dict(t.tool_rewards)} for t in trajs])


def rollout_metrics(gen: Generation, prefix: str = "") -> dict:
    """The step's multi-turn metrics (empty for single-turn rollouts), each name after `prefix` ('val/' for
    validation): per sample, model turns, tool calls, errors, timeouts, truncated and non-string results,
    calls opened and never closed, trajectories whose last turn's calls max_turns left unrun, agent-loop
    errors, tokens by kind; `timing/tools`, the seconds generation waited on tools (summed over engines); per
    tool, `tool/<name>/calls`, `errors`, `timeouts` (totals) and `latency_s` (mean seconds a call). The same on
    every rank (from the counts every rank receives)."""
    stats = gen.extra.get("multi_turn")
    if not stats:
        return {}
    count = max(1, len(stats["turns"]))
    mean = lambda k: sum(stats.get(k, ())) / count  # noqa: E731 (a key an older engine lacks: 0)
    out = {f"multi_turn/{k}": mean(k) for k in STAT_KEYS}
    out["timing/tools"] = stats["tool_seconds"]
    for name, t in sorted((stats.get("per_tool") or {}).items()):
        out.update({f"tool/{name}/calls": t["calls"], f"tool/{name}/errors": t["errors"],
                    f"tool/{name}/timeouts": t["timeouts"], f"tool/{name}/latency_s": t["seconds"] / max(1, t["calls"])})
    return {prefix + k: v for k, v in out.items()}
