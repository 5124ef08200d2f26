"""Running tool calls: up to `num_workers` worker processes (grpo_mega.toolcalls.worker), driven by one thread of
the pool, so that calls run while the caller does other work (the multi-turn engine generates other samples'
turns meanwhile): `submit` returns a Future at once.

Isolation: a worker is a new interpreter (`python -m grpo_mega.toolcalls.worker`, never a fork of the trainer
or a re-import of its main module: no torch or Hydra per worker, and a script without a `__main__` guard can
use the pool), started with a scrubbed environment (only PATH, locale, time zone and LD_LIBRARY_PATH kept,
plus the variables named in `env_keep`: no API key reaches a tool unless asked for), its own temporary directory
as working directory, HOME and TMPDIR (removed when the worker ends), one thread for OpenMP/BLAS, and a memory
cap (`max_memory_mb`, RLIMIT_AS beyond its size at start; on by default). Workers find the tools' modules
through PYTHONPATH: the caller's PYTHONPATH, working directory and main script's directory.

Lifecycle: each trajectory (an id the caller gives) has its own instance of each tool it calls, made on its
first call on one worker and kept there: its later calls go to that worker, in order; `release` ends it (the
tool's reward() and release()). A worker killed after a timeout or crash loses the instances it held (a later
call of theirs starts a fresh instance, counted in `lost_instances`).

Every failure is an answer, never an exception: a call that raises, times out (its worker and everything under
it killed by PID with grpo_mega.processes.kill_tree, and replaced), crashes its worker, cannot be pickled, or
finds no worker that can start, answers with an error message as its turn (`ToolResult.error`).

Long on purpose: the pool's thread, its workers' lifecycles and the failure answers are one state machine
(a kill, a replacement and a lost instance change the same tables).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Optional, Sequence

from grpo_mega.processes import kill_tree
from grpo_mega.toolcalls.parsers import ToolCall

DEFAULT_MEMORY_MB = 2048
"""rollout.multi_turn.tool_max_memory_mb's default: each worker's address space beyond its size at start."""

KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "TZ", "LD_LIBRARY_PATH")
"""The only variables of the trainer's environment a tool worker gets (beyond rollout.multi_turn.tool_env)."""

START_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


@dataclass
class ToolResult:
    content: str
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0
    nonstring: bool = False
    """The tool returned something other than a str (sent as str(result))."""
    truncated: bool = False
    """Cut to max_chars."""


@dataclass
class _Job:
    kind: str  # "call" or "release"
    key: tuple  # (trajectory, tool name)
    request: tuple
    future: Future
    what: str = ""


class _Worker:
    """One worker process behind a socket pair, and the job it runs."""

    def __init__(self, names: list[str], max_memory_mb: Optional[int], max_chars: int, env: dict):
        self.tmp = tempfile.mkdtemp(prefix="grpo-mega-tool-")
        ours, theirs = socket.socketpair()
        env = {**env, "HOME": self.tmp, "TMPDIR": self.tmp, "TMP": self.tmp, "TEMP": self.tmp}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "grpo_mega.toolcalls.worker", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=env, cwd=self.tmp, stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(("init", names, max_memory_mb, max_chars, os.getpid()))
        self.state = "starting"  # -> "ready" (or killed)
        self.job: Optional[_Job] = None
        self.started = time.monotonic()
        self.deadline = self.started + START_TIMEOUT_S
        self.stats: dict = {}

    def kill(self) -> None:
        """SIGKILL it and every process under it, each by PID, reap it, and remove its directory."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def close(self) -> None:
        """End an idle worker (closing its socket ends its loop), killing it if it does not exit."""
        self.conn.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


def worker_env(env_keep: Sequence[str] = ()) -> dict:
    """The environment a tool worker starts with: KEPT_ENV and `env_keep` from ours, one thread for OpenMP/BLAS,
    and PYTHONPATH = our PYTHONPATH, working directory and main script's directory (where the tools' modules are
    found); HOME and TMPDIR are set per worker."""
    env = {k: os.environ[k] for k in (*KEPT_ENV, *env_keep) if k in os.environ}
    main = sys.modules.get("__main__")
    paths = [os.getcwd()]
    if getattr(main, "__file__", None):
        paths.append(os.path.dirname(os.path.abspath(main.__file__)))
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def _close_at_exit(ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


class ToolPool:
    """Workers holding the tools `names` (rollout.multi_turn.tools). `submit(call, trajectory, create_kwargs,
    execute_kwargs)` -> Future[ToolResult]; `release(trajectory, name)` -> Future[(reward or None, error or
    None)]; `run(calls)` answers calls in order (each its own trajectory). All workers start at once; the
    constructor returns when the first is ready (its tools built); `close()` ends them all."""

    def __init__(self, names: Sequence[str], *, num_workers: int = 1, timeout_s: float = 10.0,
                 max_memory_mb: Optional[int] = DEFAULT_MEMORY_MB, max_chars: int = 1 << 20,
                 env_keep: Sequence[str] = (), start_method: Optional[str] = None):
        from grpo_mega.toolcalls import build_tools

        del start_method  # workers are always new interpreters (the fork/forkserver choice is gone)
        if num_workers < 1:
            raise ValueError(f"rollout.multi_turn.tool_workers={num_workers} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"rollout.multi_turn.tool_timeout_s={timeout_s} must be > 0")
        for n in names:
            if n.startswith("__main__"):
                raise ValueError(f"tool {n!r} is defined in the script being run; tool workers are new interpreters "
                                 f"and cannot import it: move it into a module and name it by that module's path")
        self.names = list(names)
        self.tools = build_tools(self.names)  # here too: a bad name fails at start-up, and the schemas are known
        self.num_workers, self.timeout_s, self.max_memory_mb = num_workers, timeout_s, max_memory_mb
        self.max_chars, self.env = max_chars, worker_env(env_keep)
        self._workers: list[_Worker] = []
        self.started_pids: list[int] = []
        self.worker_stats: list[dict] = []
        """Per started worker: {"import_s", "rss_mib"} as it reported them when ready, and "start_s" (wall)."""
        self.lost_instances = 0
        self._home: dict[tuple, _Worker] = {}
        self._queue: collections.deque[_Job] = collections.deque()
        self._incoming: list[_Job] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._thread: Optional[threading.Thread] = None
        self._closing = False
        self._next_anon = 0
        self._started = Future()
        atexit.register(_close_at_exit, weakref.ref(self))
        self._ensure_thread()
        error = self._started.result()
        if error is not None:
            self.close()
            raise RuntimeError(f"the tool worker could not build rollout.multi_turn.tools={self.names}: {error}")

    def schemas(self) -> list[dict]:
        """The tools' schemas, for the chat template's `tools=`."""
        return [t.schema() for t in self.tools.values()]

    # ---- the caller's side ------------------------------------------------------------------------------------

    def submit(self, call: ToolCall, trajectory=None, create_kwargs: Optional[dict] = None,
               execute_kwargs: Optional[dict] = None) -> "Future[ToolResult]":
        """Run `call` for `trajectory` (its instance of the tool made with `create_kwargs` on its first call);
        a malformed call or an unknown tool is answered at once."""
        f: Future = Future()
        if call.error is not None:
            f.set_result(ToolResult(f"Error: {call.error}", error=True))
        elif call.name not in self.tools:
            f.set_result(ToolResult(f"Error: unknown tool {call.name!r}; valid: {', '.join(sorted(self.tools))}",
                                    error=True))
        else:
            if trajectory is None:
                trajectory = self._anonymous()
            key = (trajectory, call.name)
            self._put(_Job("call", key, ("call", key, dict(create_kwargs or {}), call.arguments,
                                         dict(execute_kwargs or {})), f, call.name))
        return f

    def release(self, trajectory, name: str) -> "Future[tuple]":
        """End `trajectory`'s instance of tool `name`: (its reward() or None, an error message or None)."""
        f: Future = Future()
        self._put(_Job("release", (trajectory, name), ("release", (trajectory, name)), f, name))
        return f

    def run(self, calls: Sequence[ToolCall], trajectory=None) -> list[ToolResult]:
        """One result per call, in order (concurrently over the workers); without `trajectory`, each call is its
        own trajectory, released after."""
        keys = [trajectory if trajectory is not None else self._anonymous() for _ in calls]
        futures = [self.submit(c, k) for c, k in zip(calls, keys)]
        out = [f.result() for f in futures]
        if trajectory is None:
            for c, k in zip(calls, keys):
                if c.error is None and c.name in self.tools:
                    self.release(k, c.name).result()
        return out

    def _anonymous(self):
        with self._lock:
            self._next_anon += 1
            return ("anonymous", self._next_anon)

    def _put(self, job: _Job) -> None:
        with self._lock:
            if self._closing:
                job.future.set_result(ToolResult("Error: the tool pool is closed", error=True)
                                      if job.kind == "call" else (None, "the tool pool is closed"))
                return
            self._incoming.append(job)
        self._ensure_thread()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="grpo-mega-tool-pool", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """End every worker (an idle one by closing its socket; a busy or stuck one killed by PID); jobs still
        waiting are answered with an error."""
        with self._lock:
            self._closing = True
            thread = self._thread
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            self._closing, self._thread = False, None
            self._started = Future()
            self._started.set_result(None)

    # ---- the pool's thread --------------------------------------------------------------------------------------

    def _spawn(self) -> Optional[_Worker]:
        try:
            w = _Worker(self.names, self.max_memory_mb, self.max_chars, self.env)
        except OSError as e:  # no process could be started (out of PIDs or memory)
            self._start_failed(f"{type(e).__name__}: {e}")
            return None
        self.started_pids.append(w.proc.pid)
        self._workers.append(w)
        return w

    def _start_failed(self, message: str) -> None:
        """A worker could not start: with no other worker ready or starting, every waiting job is answered with
        the error (the next submit tries again)."""
        if not self._started.done():
            self._started.set_result(message)
        log.warning("a tool worker could not start: %s", message)
        if self._workers:
            return
        while self._queue:
            self._answer(self._queue.popleft(), f"no tool worker could start ({message})")

    def _answer(self, job: _Job, error: str, timeout: bool = False, seconds: float = 0.0) -> None:
        if job.kind == "call":
            job.future.set_result(ToolResult(f"Error: {job.what} {error}" if job.what else f"Error: {error}",
                                             error=True, timeout=timeout, seconds=seconds))
        else:
            job.future.set_result((None, error))

    def _drop(self, w: _Worker, kill: bool = True) -> None:
        """Remove worker `w` (killed), forgetting the instances it held."""
        if kill:
            w.kill()
        self._workers.remove(w)
        lost = [k for k, v in self._home.items() if v is w]
        for k in lost:
            del self._home[k]
        self.lost_instances += len(lost)

    def _dispatch(self) -> None:
        """Give each job that can run now to a worker: a trajectory's instance stays on its worker, and jobs of
        one (trajectory, tool) run one at a time, in order."""
        blocked = {w.job.key for w in self._workers if w.job is not None}
        waiting: collections.deque[_Job] = collections.deque()
        while self._queue:
            job = self._queue.popleft()
            if job.key in blocked:
                waiting.append(job)
                continue
            home = self._home.get(job.key)
            if job.kind == "release" and home is None:  # never made, or lost with its worker
                job.future.set_result((None, None))
                continue
            w = home
            if w is None:
                idle = [x for x in self._workers if x.state == "ready" and x.job is None]
                if idle:
                    w = min(idle, key=lambda x: sum(v is x for v in self._home.values()))
                elif len(self._workers) < self.num_workers:
                    self._spawn()
            if w is None or w.state != "ready" or w.job is not None:
                waiting.append(job)
                blocked.add(job.key)
                continue
            sent = w.proc.poll() is None  # one that died while idle (killed from outside) never gets it
            if sent:
                try:
                    w.conn.send(job.request)
                except (BrokenPipeError, ConnectionResetError):
                    sent = False
                except Exception as e:  # noqa: BLE001 - arguments that cannot be pickled: nothing was sent
                    self._answer(job, f"could not be sent to its worker: the arguments cannot be pickled "
                                      f"({type(e).__name__}: {str(e)[:100]})")
                    continue
            if not sent:  # replaced, failing nothing: the job waits for the new worker
                log.warning("a tool worker (pid %s) exited while idle (code %s); starting a new one", w.proc.pid,
                            w.proc.poll())
                self._drop(w)
                self._spawn()
                waiting.append(job)
                blocked.add(job.key)
                continue
            w.job, w.started = job, time.monotonic()
            w.deadline = w.started + self.timeout_s
            blocked.add(job.key)
            if job.kind == "call":
                self._home[job.key] = w
        self._queue = waiting

    def _finish(self, w: _Worker) -> None:
        """Read worker `w`'s answer (it is readable)."""
        job, now = w.job, time.monotonic()
        try:
            reply = w.conn.recv()
        except (EOFError, OSError):
            try:  # the pipe closes while the process exits: its status can lag the EOF by a moment
                code = w.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                code = None
            self._drop(w)
            if w.state == "starting":
                self._start_failed(f"it exited while starting (exit code {code})")
            elif job is not None:
                self._answer(job, f"crashed (exit code {code})", seconds=now - w.started)
            return
        if w.state == "starting":
            if reply[0] == "ready":
                w.state = "ready"
                w.stats = {**reply[2], "start_s": now - w.started}
                self.worker_stats.append(w.stats)
                if not self._started.done():
                    self._started.set_result(None)
            else:
                self._drop(w)
                self._start_failed(reply[1])
            return
        w.job = None
        if job.kind == "release":
            self._home.pop(job.key, None)
            job.future.set_result((reply[1], reply[2]))
            return
        kind, text, flags = reply
        job.future.set_result(ToolResult(text, error=kind != "ok", seconds=now - w.started,
                                         nonstring=flags.get("nonstring", False), truncated=flags.get("truncated", False)))

    def _loop(self) -> None:
        try:
            while len(self._workers) < self.num_workers:  # all started at once; callers wait for the first
                if self._spawn() is None:
                    break
            while True:
                with self._lock:
                    closing = self._closing
                    self._queue.extend(self._incoming)
                    self._incoming.clear()
                if closing:
                    break
                self._dispatch()
                active = [w for w in self._workers if w.job is not None or w.state == "starting"]
                now = time.monotonic()
                timeout = max(0.0, min(w.deadline for w in active) - now) if active else None
                ready = wait([w.conn for w in active] + [self._wake_r], timeout)
                if self._wake_r in ready:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                now = time.monotonic()
                for w in active:
                    if w.conn in ready:
                        self._finish(w)
                    elif now >= w.deadline:
                        job = w.job
                        self._drop(w)
                        if job is None:
                            self._start_failed(f"it did not start within {START_TIMEOUT_S:g} s")
                        else:
                            self._answer(job, f"timed out after {self.timeout_s:g} s", timeout=True,
                                         seconds=now - w.started)
        except BaseException as e:  # noqa: BLE001 - a bug here must not leave callers waiting forever
            log.exception("the tool pool's thread failed")
            with self._lock:
                self._queue.extend(self._incoming)
                self._incoming.clear()
            for w in list(self._workers):
                if w.job is not None:
                    self._answer(w.job, f"was lost: the tool pool failed ({type(e).__name__}: {e})")
            self._start_failed(f"the tool pool failed ({type(e).__name__}: {e})")
        finally:
            with self._lock:
                self._queue.extend(self._incoming)
                self._incoming.clear()
            for job in self._queue:
                self._answer(job, "was not run: the tool pool is closed")
            self._queue.clear()
            for w in list(self._workers):
                if w.job is not None:
                    self._answer(w.job, "was not finished: the tool pool is closed")
                    w.kill()
                else:
                    w.close()
            self._workers.clear()
            self._home.clear()
            if not self._started.done():
                self._started.set_result("the tool pool was closed while starting")
