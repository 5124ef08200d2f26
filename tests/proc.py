"""subprocess.run for commands that start process trees (torchrun and its workers, which it puts in sessions
of their own; the trainer's checkpoint helpers): on a timeout every process of the tree is SIGKILLed by PID
before the test fails, so a hung run cannot outlive the test (subprocess.run kills only the top process,
and orphaned workers were once found still running an hour later)."""

from __future__ import annotations

import signal
import subprocess


def kill_tree(pid: int) -> None:
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
    # Not the root: it is the caller's child, and psutil would reap it (Popen would then report exit 0).
    psutil.wait_procs(procs[1:], timeout=30)


def run_tree(cmd, timeout: float, capture_output: bool = False, text: bool = False, check: bool = False,
             **kwargs) -> subprocess.CompletedProcess:
    pipe = subprocess.PIPE if capture_output else None
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=text, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


def run_forked_main(argv: list[str], timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """`python -m grpo_mega.train ARGV` as a forked child of this (warm: torch and megatron-core already
    imported) process instead of a new interpreter: the same entry point (Hydra's main, its exit statuses,
    our one-line errors), without paying the imports for every case. stdout and stderr are captured through
    files; on a timeout the child's whole tree is SIGKILLed before TimeoutExpired is raised. Only for runs
    of a single rank (a multi-rank run is launched by torchrun, in a new interpreter: use run_tree)."""
    import os
    import sys
    import tempfile
    import time

    cmd = [sys.executable, "-m", "grpo_mega.train", *argv]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.setsid()  # a session of its own, like a new process: kill_tree reaches everything it starts
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False, buffering=1)
                sys.stderr = open(2, "w", closefd=False, buffering=1)
                if cwd is not None:
                    os.chdir(cwd)
                from hydra.core.global_hydra import GlobalHydra

                GlobalHydra.instance().clear()  # another test in this process may have composed a config
                sys.argv = ["grpo_mega/train.py", *argv]
                from grpo_mega import train

                try:
                    train.main()
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if not isinstance(e.code, (int, type(None))):
                        print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - what an interpreter would print for an uncaught exception
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                kill_tree(pid)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, rc, out.read().decode(errors="replace"), err.read().decode(errors="replace"))
