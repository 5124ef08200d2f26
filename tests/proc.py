"""subprocess.run for commands that start process trees (torchrun and its workers, which it puts in sessions
of their own; the trainer's checkpoint helpers): on a timeout every process of the tree is SIGKILLed by PID
before the test fails, so a hung run cannot outlive the test (subprocess.run kills only the top process,
and orphaned workers were once found still running an hour later)."""

from __future__ import annotations

import subprocess

from grpo_mega.processes import kill_tree


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
