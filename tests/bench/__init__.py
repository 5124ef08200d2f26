"""The benchmarks' end-to-end tests at toy sizes."""

import os
import sys
from pathlib import Path

from tests.fork_server import run_module

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(cmd: list, scratch, timeout: float, env: dict | None = None):
    """`cmd` ([python, (-W ignore,) -m, bench.X, ARGS...]) forked from the warm server (tests/fork_server.py): at toy sizes
    the imports are most of a benchmark's time. A CalledProcessError with its output when it fails."""
    cmd = list(cmd)
    while cmd[1:2] == ["-W"]:  # a warnings filter: the server runs with warnings ignored
        del cmd[1:3]
    assert cmd[0] == sys.executable and cmd[1] == "-m", cmd
    own = Path(scratch).parent / f"{Path(scratch).name}-fork"  # its output files beside the test's directory
    own.mkdir(exist_ok=True)
    return run_module(cmd[2], [str(a) for a in cmd[3:]], timeout, REPO, own, check=True, env=env)
