"""Process utilities shared by the launchers, the trainer's helpers and the tests: free ports, ending a process
tree by PID (never by name), the last lines of a log, and room for open files."""

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




def open_files_for(needed: int) -> int:
    """This process's soft limit on open files (RLIMIT_NOFILE) raised to its hard limit when it is below `needed`
    (a connection is a file: many clusters start jobs at a soft limit of 1024); returns the soft limit now.
    ValueError naming both limits when the hard limit is below `needed`: only the job's or the node's settings
    (ulimit -Hn, Slurm's or the container's limits) can raise it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft == infinite or soft >= needed:
        return soft
    if hard != infinite and hard < needed:
        raise ValueError(f"needs about {needed} open files and this process may open {soft} (soft limit), at most "
                         f"{hard} (hard limit, ulimit -Hn)")
    target = max(needed, 65536) if hard == infinite else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target
