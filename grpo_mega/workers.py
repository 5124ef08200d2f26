"""Worker processes behind a pipe, shared by the reward pool (rewards/scoring.py) and the tool pool
(toolcalls/pool.py): each worker builds its user code once and answers one request at a time.

What both pools rely on: a worker dies with the process that started it (PR_SET_PDEATHSIG); `limit_memory`
caps its address space so an allocation over `max_memory_mb` fails that request alone instead of waking the
node's OOM killer (which may pick a trainer rank); `Worker.kill` ends it and every process under it by PID,
never by name; `send_or_replace` replaces a worker found dead while idle (killed from outside, a crash
between requests) without failing anything, since the request had not reached it. This module imports
no torch: the workers import it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from typing import Callable, Optional

from grpo_mega.processes import kill_tree

log = logging.getLogger(__name__)


def _forget_inherited_forkserver() -> None:
    """In a forked child: the parent's forkserver is not this process's child (waitpid on it fails), so start
    a server of our own on first use. Python keeps the server in a module-level singleton that fork copies."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is None:
        return
    try:
        os.close(server._forkserver_alive_fd)  # our copy: the parent's server ends when the parent closes its own
    except (OSError, TypeError):
        pass
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


os.register_at_fork(after_in_child=_forget_inherited_forkserver)


def die_with_parent() -> None:
    """Linux: SIGKILL this worker when the process that started it exits (a rank killed mid-step must not
    leave a worker spinning in C code). Best effort: a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def limit_memory(max_memory_mb: Optional[int]) -> None:
    """Cap this process's address space (RLIMIT_AS) at its size now plus `max_memory_mb` MiB (0 or None: no
    cap). Relative to the start, so a worker forked from a large rank ('fork') gets the same room as one from
    the forkserver; an allocation over it raises MemoryError (or kills this worker, in C code that aborts)."""
    if not max_memory_mb:
        return
    import resource

    try:
        with open("/proc/self/statm") as f:
            start = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        start = 0
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = start + max_memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


class Worker:
    """`target(conn, *args)` in a daemon process of context `ctx`, behind a duplex pipe; `busy` holds the
    request in flight (None: idle), `deadline` and `started` its times."""

    def __init__(self, ctx, target: Callable, args: tuple, name: str):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=name)
        self.proc.start()
        child.close()
        self.busy: Optional[int] = None
        self.deadline = self.started = 0.0
        self.ready = False

    def send(self, request) -> bool:
        """Give the worker a request; False when it is dead (it never received the request)."""
        if not self.proc.is_alive():
            return False
        try:
            self.conn.send(request)
            return True
        except OSError:  # BrokenPipeError, ConnectionResetError: it died since the check
            return False

    def kill(self) -> None:
        """SIGKILL this worker and every process under it (what its user code started), each by its PID
        (never by name), and reap it."""
        if self.proc.is_alive():
            kill_tree(self.proc.pid)
        self.proc.join(10)
        self.conn.close()


def send_or_replace(workers: list[Worker], idx: int, request, replace: Callable[[], Worker], what: str,
                    error: type = RuntimeError) -> Worker:
    """Give `workers[idx]` a request; one that died while idle is killed (its children too) and replaced by
    `replace()` first, logged, without failing anything. A replacement that dies at once raises `error`."""
    for attempt in range(2):
        w = workers[idx]
        if w.send(request):
            return w
        if attempt:
            break
        w.kill()
        log.warning("%s (pid %s) exited while idle (code %s); starting a new one", what, w.proc.pid, w.proc.exitcode)
        workers[idx] = replace()
    raise error(f"{what} (pid {workers[idx].proc.pid}) exited right after it started "
                f"(code {workers[idx].proc.exitcode})")


def close_all(workers: list[Worker]) -> None:
    """End every worker: closing its pipe ends an idle one; a busy or stuck one is killed by PID."""
    for w in workers:
        if w.busy is not None:  # mid-request (the pool is closing on an error): no answer is wanted
            w.kill()
        w.conn.close()
    for w in workers:
        w.proc.join(2)
        if w.proc.is_alive():
            kill_tree(w.proc.pid)
            w.proc.join(10)
