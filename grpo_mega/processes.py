"""Process utilities shared by the launchers, the trainer's helpers and the tests: free ports, ending a process
tree by PID (never by name), and the last lines of a log."""

from __future__ import annotations

import socket


_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", low: int = 20000) -> int:
    """A TCP port that was free on `host` a moment ago, for a rendezvous or a server's --port: a port some other
    process binds later. It is drawn below the kernel's ephemeral range (bind(0) and every outgoing connect()
    take their ports from that range, so a port drawn there can be taken by any connection opened before the
    server binds it: a CI run's second SGLang server once lost its port that way) and never handed out twice by
    this process."""
    import random

    high = _ephemeral_low() - 1
    if high - low >= 1000:
        for port in random.sample(range(low, high + 1), 64):
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    with socket.socket() as s:  # no room below the ephemeral range on this machine: the kernel's choice
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
    """SIGKILL a server (a server started by `grpo_mega.engines.standin_server.launch` or
    `grpo_mega.engines.sglang_launch.launch_sglang`) and every process it started (SGLang's
    scheduler and detokenizer), each by its PID, and reap them."""
    if proc.poll() is None:  # not reaped yet, so its PID is still its own
        kill_tree(proc.pid)
    proc.wait(timeout=30)


