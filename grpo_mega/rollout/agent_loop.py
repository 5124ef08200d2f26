"""Agent loops: what drives one multi-turn trajectory, token in and token out, and the driver that runs a
batch of them against one rollout engine.

An agent loop is `async def loop(traj: Trajectory) -> None` (rollout.multi_turn.agent_loop names a user's by
dotted path; `tool_loop` is the default). It asks for the model's turns (`await traj.generate()`), finds tool
calls in them (`traj.parse(turn)`), runs them (`await traj.call(calls)`: the results appended as the chat
template renders tool turns) and may answer as a user or an environment (`traj.reply(text)`). Every id it
appends is the engine's sampled id or a rendered segment's id (grpo_mega.rollout.turns), never a re-tokenized
conversation; the model's ids carry mask 1 and their logprobs, everything else mask 0 and logprob 0.0.

The driver (`run_trajectories`) batches every pending `generate()` of the trajectories into one engine call (each
sample with its own per-turn seed, so a sample does not depend on what else is in the batch). With `async_tools` a
call runs while the engine generates other trajectories' turns (with an engine that reports each row as it ends,
the embedded engine's `on_row_done`, from the moment its own turn is decoded, while the batch's longer rows decode
on), and a trajectory goes on as soon as its own calls are answered (a free engine waits for trajectories still in
their calls at most a fifth of its last call's time: an engine call costs about as much for a few rows as for
many); without, a batch waits until every trajectory has its results (turns in lockstep, batches independent of
timing). An exception in a user's loop ends that trajectory (counted in
`agent_loop_errors`, the first traceback logged); an engine failure ends the whole call.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from grpo_mega.registry import import_async_function
from grpo_mega.engines.interface import sample_seed
from grpo_mega.toolcalls.parsers import ToolCall, parse_turn
from grpo_mega.toolcalls.pool import ToolResult

log = logging.getLogger(__name__)

AgentLoop = Callable[["Trajectory"], Awaitable[None]]

COALESCE = 0.2
"""Async tool calls: a batch waits for trajectories still in their tool calls at most this many times the last
engine call's duration (grpo_mega.rollout.agent_loop._Driver._gather)."""

COUNTS = ("calls", "errors", "timeouts", "truncated", "nonstring", "unclosed", "max_turns_reached",
          "agent_loop_errors")


def load_agent_loop(path: str) -> AgentLoop:
    """The `async def loop(traj)` at dotted path `pkg.mod:fn` (or `pkg.mod.fn`); a ValueError otherwise."""
    return import_async_function(path, "rollout.multi_turn.agent_loop")


@dataclass
class Stats:
    """One trajectory's counts (grpo_mega.rollout.multi_turn.STAT_KEYS) and its per-tool breakdown."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    truncated: int = 0
    nonstring: int = 0
    unclosed: int = 0
    max_turns_reached: int = 0
    agent_loop_errors: int = 0
    per_tool: dict = field(default_factory=dict)

    def tool(self, name: str, r: ToolResult) -> None:
        t = self.per_tool.setdefault(name or "?", {"calls": 0, "errors": 0, "timeouts": 0, "seconds": 0.0})
        t["calls"] += 1
        t["errors"] += int(r.error)
        t["timeouts"] += int(r.timeout)
        t["seconds"] += r.seconds


class Trajectory:
    """One sample's conversation after its prompt, as an agent loop sees and extends it.

    `row`: the prompt's row (data_source, extra_info with tools_kwargs, ground_truth, ...); `ids`, `logprobs`,
    `mask`: the response so far (mask 1: the model's tokens); `turns`: one dict per turn, {"role": "assistant",
    "text", "start", "end", "finish"} for the model's (text without the stop token; start/end: its ids in `ids`),
    {"role": "tool", "name", "text", "error", "start", "end"} per tool result, {"role": "user", ...} per reply;
    `finish`: None while going on, then 'stop' or 'length' (the budget: no more room)."""

    def __init__(self, driver: "_Driver", index: int, uid, prompt_ids: list[int], row: dict, seed: int):
        self._d, self.index, self.uid, self.row, self.seed = driver, index, uid, row, seed
        self.prompt_ids = list(prompt_ids)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.turns: list[dict] = []
        self.finish: Optional[str] = None
        self.model_turns = 0
        self.stats = Stats()
        self.tool_rewards: dict = {}
        self._used: list[str] = []
        self._last_token: Optional[int] = None  # how the last model turn ended; None: a segment followed it
        self._raw: dict[int, str] = {}  # a model turn's decoded text, stop token included, by its start
        kw = (row.get("extra_info") or {}).get("tools_kwargs") or row.get("tools_kwargs") or {}
        self.tools_kwargs: dict = kw if isinstance(kw, dict) else {}

    @property
    def tokenizer(self):
        return self._d.engine.tok

    @property
    def room(self) -> int:
        """Tokens left in the trajectory's budget (max_new_tokens, model and other tokens together)."""
        return self._d.max_new_tokens - len(self.ids)

    @property
    def turns_left(self) -> int:
        """Model turns left (rollout.multi_turn.max_turns)."""
        return self._d.engine.max_turns - self.model_turns

    @property
    def done(self) -> bool:
        return self.finish is not None

    async def generate(self) -> Optional[dict]:
        """The model's next turn, appended; None (nothing appended) when the trajectory is done, out of room
        (then it ends 'length') or out of turns."""
        if self.done or self.turns_left <= 0:
            return None
        if self.room <= 0:
            self.finish = "length"
            return None
        ids, lps, fin = await self._d.generate(self)
        ids, lps = ids[:self.room], lps[:self.room]
        start = len(self.ids)
        self.ids += ids
        self.logprobs += lps
        self.mask += [1] * len(ids)
        self.model_turns += 1
        eng = self._d.engine
        ended = ids[-1] if ids and fin != "length" else None
        raw = eng.tok.decode(ids)
        text = raw
        if ended is not None and ended in eng.stop_ids:  # the text without the stop token
            stop_text = eng.renderer.stop_texts[ended]
            text = raw[:-len(stop_text)] if stop_text and raw.endswith(stop_text) else eng.tok.decode(ids[:-1])
        turn = {"role": "assistant", "text": text, "start": start, "end": len(self.ids),
                "finish": "length" if ended is None else ("call" if ended in eng.call_stop else "stop")}
        self._raw[start] = raw
        self.turns.append(turn)
        self._last_token = ended
        if ended is None:
            self.finish = "length"
        return turn

    def parse(self, turn: dict) -> list[ToolCall]:
        """The tool calls in a model turn (rollout.multi_turn.parser, within its limits; never raises). Calls
        opened and never closed are not returned: counted (`unclosed`)."""
        eng = self._d.engine
        raw = self._raw.get(turn["start"])
        if raw is None:
            raw = eng.tok.decode(self.ids[turn["start"]:turn["end"]])
        parsed = parse_turn(eng.parser, raw, eng.max_calls, eng.max_call_chars)
        self.stats.unclosed += parsed.unclosed
        for c in parsed.calls:
            if eng.bare_name and not c.name and c.error is None:
                c.name = eng.bare_name
        return parsed.calls

    def _check_open(self, what: str) -> None:
        if self.done:
            raise RuntimeError(f"{what} after the trajectory ended ({self.finish})")
        if self._last_token is None:
            raise RuntimeError(f"{what} must follow a model turn (one segment of messages per turn: pass them together)")

    async def call(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run `calls` (this trajectory's own instance of each tool) and append their results as tool turns."""
        self._check_open("call()")
        eng = self._d.engine
        futures = []
        for c in calls:
            kw = self.tools_kwargs.get(c.name) or {}
            futures.append(asyncio.wrap_future(eng.pool.submit(c, self.uid, kw.get("create_kwargs"),
                                                               kw.get("execute_kwargs"))))
            if c.error is None and c.name in eng.pool.tools and c.name not in self._used:
                self._used.append(c.name)
        results: list[ToolResult] = list(await asyncio.gather(*futures))
        s = self.stats
        messages = []
        for c, r in zip(calls, results):
            s.calls += 1
            s.errors += int(r.error)
            s.timeouts += int(r.timeout)
            s.nonstring += int(r.nonstring)
            s.tool(c.name, r)
            text = r.content
            if len(text) > eng.max_chars:
                text = text[:eng.max_chars] + f"...[truncated {len(text) - eng.max_chars} chars]"
                r.truncated = True
            s.truncated += int(r.truncated)
            messages.append(("tool", text, c.name or None, r.error))
        self._append(messages)
        return results

    def reply(self, content: str, role: str = "user") -> None:
        """Append a message (a simulated user's or an environment's) as the chat template renders it, then the
        next assistant turn's generation prompt."""
        self._check_open("reply()")
        self._append([(role, str(content), None, False)])

    def end(self) -> None:
        """End the trajectory here ('stop')."""
        if not self.done:
            self.finish = "stop"

    def _append(self, messages: list) -> None:
        eng = self._d.engine
        after = "call" if self._last_token in eng.call_stop else "stop"
        seg, spans = eng.renderer.render([(r, t, n) for r, t, n, _ in messages], after,
                                         self._last_token if after == "stop" else None)
        self._last_token = None
        room = self.room
        if len(seg) >= room:  # no room left for the model: the trajectory is cut by the budget
            self.stats.truncated += int(len(seg) > room)
            seg, self.finish = seg[:room], "length"
        base = len(self.ids)
        self.ids += seg
        self.logprobs += [0.0] * len(seg)
        self.mask += [0] * len(seg)
        for (role, text, name, error), (a, b) in zip(messages, spans):
            turn = {"role": role, "text": text, "start": base + min(a, len(seg)), "end": base + min(b, len(seg))}
            if role == "tool":
                turn.update(name=name, error=bool(error))
            self.turns.append(turn)


async def tool_loop(traj: Trajectory) -> None:
    """The default agent loop: the model's turn; its tool calls run and their results appended; again, until a
    turn without calls, the budget or max_turns (the last turn's calls are not run: counted in
    max_turns_reached)."""
    while True:
        turn = await traj.generate()
        if turn is None or traj.done:
            return
        calls = traj.parse(turn)
        if not calls:
            return
        if traj.turns_left <= 0:
            traj.stats.max_turns_reached += 1
            return
        if traj.room <= 0:  # tool calls, but no room for their results
            traj.finish = "length"
            return
        await traj.call(calls)


class _Driver:
    """Runs a batch of trajectories' agent loops, batching their generate() calls into engine calls."""

    def __init__(self, engine, trajectories_args: list[tuple], max_new_tokens: int, temperature: float, top_p: float,
                 stop: list[int], seed: int, async_tools: bool):
        self.engine, self.max_new_tokens = engine, max_new_tokens
        self.temperature, self.top_p, self.seed, self.async_tools = temperature, top_p, seed, async_tools
        self.stop = stop + [t for t in engine.call_stop if t not in stop]
        self.trajectories = [Trajectory(self, *a) for a in trajectories_args]
        self.requests: list[tuple[Trajectory, asyncio.Future]] = []
        self.live = len(self.trajectories)
        self.waited = 0.0  # seconds generation waited with trajectories live and none ready (tool calls, rendering)
        self.engine_calls = 0
        self.version = engine.inner.weight_version
        self.streams_rows = "on_row_done" in inspect.signature(engine.inner.generate).parameters

    async def generate(self, traj: Trajectory):
        fut = asyncio.get_running_loop().create_future()
        if not self.requests:
            self.first_request = time.perf_counter()
        self.requests.append((traj, fut))
        self.wake.set()
        return await fut

    async def _one(self, traj: Trajectory, loop: AgentLoop) -> None:
        try:
            await loop(traj)
        except Exception as e:  # noqa: BLE001 - a user's loop failing on one sample ends that sample only
            traj.stats.agent_loop_errors += 1
            if not self.engine.loop_error_logged:
                self.engine.loop_error_logged = True
                log.exception("the agent loop raised on sample %d (%s); that trajectory ends here (counted in "
                              "multi_turn/agent_loop_errors)", traj.index, e)
        finally:
            if traj.finish is None:
                traj.finish = "stop"
            self.live -= 1
            self.wake.set()
        for name in traj._used:  # the tools' per-trajectory end: reward() and release()
            reward, error = await asyncio.wrap_future(self.engine.pool.release(traj.uid, name))
            traj.tool_rewards[name] = reward
            if error:
                log.warning("sample %d: %s", traj.index, error)

    async def _gather(self, last_call_s: float) -> None:
        """Async: the engine is free and some trajectories wait for a turn while others wait for their tools.
        Wait for more of those to join the batch, at most COALESCE x the last engine call's time after the
        first request (an engine call costs about as much for a few rows as for many: waiting a little saves
        calls), and no longer once every live trajectory is waiting."""
        deadline = self.first_request + COALESCE * last_call_s
        while len(self.requests) < self.live:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), left)
            except asyncio.TimeoutError:
                return
            for _ in range(4):
                await asyncio.sleep(0)

    async def _batcher(self) -> None:
        idle_since, last_call_s = None, 0.0
        while True:
            await self.wake.wait()
            self.wake.clear()
            for _ in range(4):  # let the trajectories just woken reach their next await
                await asyncio.sleep(0)
            if not self.requests:
                if self.live == 0:
                    return
                continue
            if not self.async_tools and len(self.requests) < self.live:
                continue  # lockstep: every live trajectory's turn goes in the same batch
            if self.async_tools and len(self.requests) < self.live:
                await self._gather(last_call_s)
            batch, self.requests = sorted(self.requests, key=lambda r: r[0].index), []
            if idle_since is not None:
                self.waited += time.perf_counter() - idle_since
            trajs = [t for t, _ in batch]
            t0 = time.perf_counter()
            kwargs = dict(row_seeds=[sample_seed(t.seed, t.model_turns, 0) % 2**31 for t in trajs])
            # An engine that reports each row as it ends (the embedded engine): with async tools the batch decodes
            # in a worker thread, and a trajectory whose turn is done starts its tool calls at once, while the
            # longer rows decode on.
            streams = self.async_tools and self.streams_rows
            if streams:
                loop = asyncio.get_running_loop()

                def row_done(r, ids, lps, fin, batch=batch):
                    loop.call_soon_threadsafe(self._answer, batch[r], list(ids), list(lps), fin)

                kwargs.update(row_max_new_tokens=[t.room for t in trajs], on_row_done=row_done)
            call = functools.partial(self.engine.inner.generate, [t.prompt_ids + t.ids for t in trajs], 1,
                                     self.temperature, self.top_p, max(t.room for t in trajs), self.stop, self.seed,
                                     **kwargs)
            # an engine that runs an event loop of its own (SGLang's Engine: run_until_complete) cannot be called
            # inside this running loop either: it runs in a worker thread while this loop waits
            threaded = streams or getattr(self.engine.inner, "runs_own_event_loop", False)
            gen = await asyncio.to_thread(call) if threaded else call()
            idle_since = time.perf_counter()
            last_call_s = idle_since - t0
            self.engine_calls += 1
            self.version = gen.weight_version
            for entry, ids, lps, fin in zip(batch, gen.token_ids, gen.logprobs, gen.finish_reasons):
                self._answer(entry, ids, lps, fin)

    @staticmethod
    def _answer(entry: tuple, ids: list[int], lps: list[float], fin: str) -> None:
        """Resolve a trajectory's generate() with its row (once: a row reported as it ended is not again)."""
        t, fut = entry
        if fut.done():
            return
        if len(ids) > t.room:  # a longer budget was asked for the batch: this sample's ends here
            ids, lps, fin = ids[:t.room], lps[:t.room], "length"
        fut.set_result((list(ids), list(lps), fin))

    async def run(self, loop: AgentLoop) -> None:
        self.wake = asyncio.Event()
        batcher = asyncio.ensure_future(self._batcher())
        tasks = [asyncio.ensure_future(self._one(t, loop)) for t in self.trajectories]
        try:
            done, _ = await asyncio.wait([batcher, *tasks], return_when=asyncio.FIRST_EXCEPTION)
            if batcher in done and batcher.exception() is not None:
                raise batcher.exception()
            await asyncio.gather(*tasks)
            self.wake.set()
            await batcher
        finally:
            for t in [batcher, *tasks]:
                if not t.done():
                    t.cancel()
            await asyncio.gather(batcher, *tasks, return_exceptions=True)


def run_trajectories(driver: _Driver, loop: AgentLoop) -> None:
    """Run `driver` to the end on a new event loop (in a thread of its own when this one already runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(driver.run(loop))
        return
    box: dict = {}

    def target():
        try:
            asyncio.run(driver.run(loop))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="grpo-mega-agent-loop")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
