"""Running tool calls: worker processes that each build the run's tools once, one call at a time per worker,
every call cut at `timeout_s` seconds (the worker and anything it started are killed by PID with
grpo_mega.processes.kill_tree, and replaced). A tool that raises, times out, is unknown, or is given malformed
arguments answers with an error message as its turn (`ToolResult.error`): the rollout goes on and the
multi-turn driver counts it."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import signal
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from grpo_mega.toolcalls.parsers import ToolCall
from grpo_mega.workers import Worker, close_all, die_with_parent, limit_memory, send_or_replace


@dataclass
class ToolResult:
    content: str
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0


def _worker(conn, names: list[str], max_memory_mb: Optional[int] = None) -> None:
    from grpo_mega.toolcalls import ToolError, build_tools

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    over = f" (over rollout.multi_turn.tool_max_memory_mb={max_memory_mb})" if max_memory_mb else ""
    try:
        limit_memory(max_memory_mb)
        tools = build_tools(names)
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", sorted(tools)))
    while True:
        try:
            name, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out = tools[name].call(args, **kwargs) if kwargs else tools[name].call(args)
            reply = ("ok", out if isinstance(out, str) else str(out))
        except ToolError as e:
            reply = ("error", f"Error: {e}")
        except MemoryError as e:  # over the cap: this call fails, the worker (its memory freed) goes on
            reply = ("error", f"Error: {name} ran out of memory{over}: {e}")
        except Exception as e:  # noqa: BLE001 - user code: its message is the tool's turn
            reply = ("error", f"Error: {name} raised {type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


class ToolPool:
    """`num_workers` processes holding the tools `names` (rollout.multi_turn.tools). `run(calls)` answers a
    batch of calls in order. Workers start on first use; `close()` ends them."""

    def __init__(self, names: Sequence[str], *, num_workers: int = 1, timeout_s: float = 10.0,
                 start_method: str = "forkserver", max_memory_mb: Optional[int] = None):
        from grpo_mega.toolcalls import build_tools

        if num_workers < 1:
            raise ValueError(f"rollout.multi_turn.tool_workers={num_workers} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"rollout.multi_turn.tool_timeout_s={timeout_s} must be > 0")
        self.names = list(names)
        self.tools = build_tools(self.names)  # here too: a bad name fails at start-up, and the schemas are known
        self.num_workers, self.timeout_s, self.start_method = num_workers, timeout_s, start_method
        self.max_memory_mb = max_memory_mb
        self._workers: list[Worker] = []
        self.started_pids: list[int] = []

    def schemas(self) -> list[dict]:
        """The tools' schemas, for the chat template's `tools=`."""
        return [t.schema() for t in self.tools.values()]

    def _spawn(self) -> Worker:
        w = Worker(mp.get_context(self.start_method), _worker, (self.names, self.max_memory_mb), "grpo-mega-tool")
        self.started_pids.append(w.proc.pid)
        if not w.conn.poll(60.0):
            w.kill()
            raise RuntimeError("a tool worker did not start within 60 s")
        kind, detail = w.conn.recv()
        if kind != "ready":
            w.kill()
            raise RuntimeError(f"the tool worker could not build rollout.multi_turn.tools={self.names}: {detail}")
        return w

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order (concurrently over the workers)."""
        out: list[Optional[ToolResult]] = [None] * len(calls)
        todo = []
        for k, c in enumerate(calls):
            if c.error is not None:
                out[k] = ToolResult(f"Error: {c.error}", error=True)
            elif c.name not in self.tools:
                out[k] = ToolResult(f"Error: unknown tool {c.name!r}; valid: {', '.join(sorted(self.tools))}", error=True)
            else:
                todo.append(k)
        if not todo:
            return out
        while len(self._workers) < min(self.num_workers, len(todo)):
            self._workers.append(self._spawn())
        todo.reverse()
        try:
            while todo or any(w.busy is not None for w in self._workers):
                for i, w in enumerate(self._workers):
                    if w.busy is None and todo:
                        k = todo.pop()
                        w = send_or_replace(self._workers, i, (calls[k].name, calls[k].arguments, calls[k].kwargs),
                                            self._spawn, "tool worker")
                        w.busy, w.started = k, time.monotonic()
                        w.deadline = w.started + self.timeout_s
                busy = [w for w in self._workers if w.busy is not None]
                wait = max(0.0, min(w.deadline for w in busy) - time.monotonic())
                ready = mp.connection.wait([w.conn for w in busy], timeout=wait)
                for i, w in enumerate(list(self._workers)):
                    if w.busy is None:
                        continue
                    k, now = w.busy, time.monotonic()
                    if w.conn in ready:
                        try:
                            kind, text = w.conn.recv()
                        except (EOFError, OSError):
                            w.kill()
                            self._workers[i] = self._spawn()
                            out[k] = ToolResult(f"Error: {calls[k].name} crashed (exit code {w.proc.exitcode})",
                                                error=True, seconds=now - w.started)
                            continue
                        w.busy = None
                        out[k] = ToolResult(text, error=kind != "ok", seconds=now - w.started)
                    elif now >= w.deadline:
                        w.kill()
                        self._workers[i] = self._spawn()
                        out[k] = ToolResult(f"Error: {calls[k].name} timed out after {self.timeout_s:g} s",
                                            error=True, timeout=True, seconds=now - w.started)
        except BaseException:
            self.close()
            raise
        return out

    def close(self) -> None:
        workers, self._workers = self._workers, []
        close_all(workers)
