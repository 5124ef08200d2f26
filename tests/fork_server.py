"""A warm, clean process that runs `python -m grpo_mega.train ARGV` by forking: for the bad-input cases that
are refused before any training starts, each of which would otherwise pay a new interpreter's start-up and
the torch / megatron-core / Hydra imports (29 cases: about 6 minutes of the main tier).

The server is a new interpreter that imports those modules once and never runs a torch op, so a child forked
from it starts as clean as a new process would (forking pytest itself was tried: torch's OpenMP pool, once
the parent has used it, hangs the child at its first parallel op). One request at a time, JSON lines over
its stdin/stdout: {"argv", "cwd", "out", "err"} in, {"pid"} then {"rc"} back; the child writes its stdout
and stderr to the files named. `run_main` is the pytest side; the server ends with pytest (at exit, or when
its stdin closes), and a child past its timeout is SIGKILLed with everything under it, by PID.

Only for runs that do not train: a run that trains starts helper processes and relies on exit handlers
(os._exit skips them), so it is started as a new interpreter (tests/proc.run_tree)."""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---- the server (python tests/fork_server.py) ---------------------------------------------------------


def _child(req: dict) -> None:
    """In the forked child: Hydra's entry point with the request's argv; never returns."""
    code = 1
    try:
        os.setsid()  # a session of its own, like a new process: kill_tree reaches all it starts
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(os.devnull)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        os.chdir(req["cwd"])
        sys.argv = ["grpo_mega/train.py", *req["argv"]]
        from grpo_mega import train

        try:
            train.main()
            code = 0
        except SystemExit as e:  # what the interpreter would make of it
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    sys.path.insert(0, str(ROOT))
    import warnings

    warnings.simplefilter("ignore")
    import hydra  # noqa: F401 - imported once here, inherited by every child
    import megatron.core  # noqa: F401
    import torch  # noqa: F401

    import grpo_mega.train  # noqa: F401

    reply = sys.stdout
    sys.stdout = sys.stderr  # anything an import prints must not reach the protocol
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


# ---- the pytest side ------------------------------------------------------------------------------------


class _Server:
    def __init__(self, log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, cwd=ROOT)
        self._buf = b""
        atexit.register(self.close)
        self.read(timeout=300)  # {"ready"}: the imports are done

    def read(self, timeout: float) -> dict:
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"the fork server (pid {self.proc.pid}) exited: see {self.log.name}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        from grpo_mega.processes import kill_tree

        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                kill_tree(self.proc.pid)
                self.proc.wait(timeout=30)
        self.log.close()


_server = None


def run_main(argv: list[str], timeout: float, cwd, scratch: Path) -> subprocess.CompletedProcess:
    """`python -m grpo_mega.train ARGV` (in `cwd`), forked from the warm server; stdout and stderr come back
    through files in `scratch`. On a timeout the child and everything under it are SIGKILLed, by PID,
    before TimeoutExpired is raised."""
    from grpo_mega.processes import kill_tree

    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server(Path(scratch) / "fork_server.log")
    out, err = Path(scratch) / "fork.out", Path(scratch) / "fork.err"
    _server.proc.stdin.write((json.dumps(dict(argv=list(argv), cwd=str(cwd), out=str(out), err=str(err))) + "\n").encode())
    _server.proc.stdin.flush()
    pid = _server.read(timeout=60)["pid"]
    cmd = [sys.executable, "-m", "grpo_mega.train", *argv]
    try:
        rc = _server.read(timeout=timeout)["rc"]
    except TimeoutError:
        kill_tree(pid)  # the server reaps it and answers
        _server.read(timeout=60)
        raise subprocess.TimeoutExpired(cmd, timeout) from None
    return subprocess.CompletedProcess(cmd, rc, out.read_text(errors="replace"), err.read_text(errors="replace"))


if __name__ == "__main__":
    serve()
