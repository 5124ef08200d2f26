"""Process utilities shared by the launchers, the trainer's helpers and the tests: free ports, ending a process
tree by PID (never by name), and the last lines of a log."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for a rendezvous or a server's --port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def kill_tree(pid: int) -> None:
    """SIGKILL the process `pid` and every process under it, each by its PID, and wait for those under it
    (`pid` itself is the caller's child: its Popen reaps it; psutil reaping it would hide its exit status)."""
    import signal

    import psutil

    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs[1:], timeout=30)


def stop(proc) -> None:
    """SIGKILL a server (a server started by `grpo_mega.rollout.standin_server.launch` or
    `grpo_mega.rollout.sglang_launch.launch_sglang`) and every process it started (SGLang's
    scheduler and detokenizer), each by its PID, and reap them."""
    if proc.poll() is None:  # not reaped yet, so its PID is still its own
        kill_tree(proc.pid)
    proc.wait(timeout=30)


