"""A warm, clean process that runs `python -m grpo_mega.train ARGV` by forking, alone or as the ranks of a
`torchrun --nproc-per-node N -m grpo_mega.train ARGV`: each run would otherwise pay a new interpreter's
start-up and the torch / megatron-core / Hydra imports (5-6 s a process, and torchrun's own interpreter), for
the bad-input cases refused before training (29 cases: about 6 minutes of the main tier), for the trainer
runs of the resume, engine, export and off-policy tests, and for the benchmarks' toy runs (`run_module`: any
`python -m MODULE ARGV`, run by runpy as the interpreter would).

The server is a new interpreter that imports those modules once and never runs a torch op, so a child forked
from it starts as clean as a new process would (forking pytest itself was tried: torch's OpenMP pool, once
the parent has used it, hangs the child at its first parallel op). One request at a time, JSON lines over
its stdin/stdout: {"argv", "cwd", "out", "err", "nproc", "port", "env"} in, {"pids"} then {"rc", "rcs"}
back; the children append their stdout and stderr to the files named (all ranks to the same two files, line
by line, as torchrun's console would show them). With `nproc`, every rank gets torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); as torchrun does, when a
rank fails the others are SIGKILLed (they would wait in a collective for the one that left) and the run's rc
is the failed rank's. A child runs what a new interpreter would at exit (non-daemon threads joined, atexit
handlers: the trainer's checkpoint lock release, multiprocessing's finalizers) before its os._exit.
`run_main` / `start_main` are the pytest side; the server ends with pytest (at exit, or when its stdin
closes), and a child past its timeout is SIGKILLed with everything under it, by PID.

The genuine entry path (a new interpreter, torchrun's own launcher) stays tested by tests/test_train.py's
demo run and the torchrun run in tests/trainer/test_export.py; the tests that watch for leaked processes
(tests/rewards/test_scoring.py) start new interpreters too."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---- the server (python -m tests.fork_server, from the repository's root) ----------------------------------------


def _child(req: dict, rank: int | None) -> None:
    """In the forked child: Hydra's entry point (or the request's "module", as `python -m` runs it) with the request's argv (as rank `rank` of a torchrun-like
    world, or alone when None); never returns."""
    code = 1
    try:
        os.setsid()  # a session of its own, like a new process: kill_tree reaches all it starts
        if req.get("env") is not None:
            os.environ.clear()
            os.environ.update(req["env"])
        if rank is not None:
            n = req["nproc"]
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                              GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(req["port"]), TORCHELASTIC_RUN_ID="fork_server")
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(os.devnull)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        os.chdir(req["cwd"])
        module = req.get("module") or "grpo_mega.train"
        try:
            if module == "grpo_mega.train":
                sys.argv = ["grpo_mega/train.py", *req["argv"]]
                from grpo_mega import train

                train.main()
            else:  # python -m MODULE ARGV
                import runpy

                sys.argv = [module, *req["argv"]]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
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
            _at_exit()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _at_exit() -> None:
    """What the interpreter runs at a normal exit, in its order: join non-daemon threads, then the atexit
    handlers (an exception in one is printed, as the interpreter would)."""
    import atexit
    import threading

    try:
        threading._shutdown()
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()


def _run(req: dict, reply) -> None:
    """Fork the request's process(es), report their PIDs, wait; on a rank's failure SIGKILL the rest."""
    from grpo_mega.processes import kill_tree

    for path in (req["out"], req["err"]):
        open(path, "w").close()
    ranks = [None] if not req.get("nproc") else list(range(req["nproc"]))
    pids = []
    for rank in ranks:
        pid = os.fork()
        if pid == 0:
            _child(req, rank)
        pids.append(pid)
    reply.write(json.dumps({"pids": pids}) + "\n")
    reply.flush()
    rcs, failed = {}, None
    while len(rcs) < len(pids):
        pid, status = os.wait()
        if pid not in pids:
            continue
        rcs[pid] = os.waitstatus_to_exitcode(status)
        if rcs[pid] != 0 and failed is None:
            failed = rcs[pid]
            for other in pids:  # torchrun's behaviour: the rest would wait for the failed rank forever
                if other not in rcs:
                    kill_tree(other)
    reply.write(json.dumps({"rc": failed or 0, "rcs": [rcs[p] for p in pids]}) + "\n")
    reply.flush()


def serve() -> None:
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
    import grpo_mega.processes  # noqa: F401 - kill_tree (psutil)

    # What every training run imports only once it runs (2.2 s a run here, measured with -X importtime): the
    # loop and its parts, transformers (the tokenizers, HF checkpoints) and matplotlib (the plots at the end).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import transformers  # noqa: F401

    import grpo_mega.rewards.scoring  # noqa: F401
    import grpo_mega.rollout.agent_loop  # noqa: F401
    import grpo_mega.trainer.loop  # noqa: F401
    import grpo_mega.trainer.setup  # noqa: F401

    # And what a run imports lazily: transformers' model, generation and tokenizer modules (the embedded engine,
    # the tokenizer), megatron-core's layer specs, optimizer and dist_checkpointing: a one-step demo run's child
    # 4.8 s -> 2.7 s here (274 -> 50 modules imported in the child).
    from grpo_mega.parallel.forked import warm

    warm()
    for name in ("transformers.modeling_utils", "transformers.generation", "transformers.tokenization_utils_tokenizers",
                 "transformers.models.auto.modeling_auto", "transformers.models.qwen2.modeling_qwen2",
                 "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer.attention"):
        importlib.import_module(name)

    for line in sys.stdin:
        _run(json.loads(line), reply)


# ---- the pytest side ------------------------------------------------------------------------------------


class _Server:
    def __init__(self, log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fork_server"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, cwd=ROOT)
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


class ForkedRun:
    """A started run: `pids` (one per rank), `wait` for its CompletedProcess, `kill` (SIGKILL every rank's
    tree, by PID: what a preemption does to a torchrun job). One run at a time: wait before the next."""

    def __init__(self, argv, cmd, pids, out: Path, err: Path):
        self.argv, self.cmd, self.pids, self.out, self.err = argv, cmd, pids, out, err
        self.returncode = None

    def poll(self):
        """The rc once every rank has ended (the server's answer has come), else None."""
        ready = b"\n" in _server._buf or select.select([_server.proc.stdout.fileno()], [], [], 0)[0]
        if self.returncode is None and ready:
            self.wait(timeout=60)
        return self.returncode

    def kill(self) -> None:
        from grpo_mega.processes import kill_tree

        for pid in self.pids:
            kill_tree(pid)

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        if self.returncode is None:
            try:
                self.returncode = _server.read(timeout=timeout)["rc"]
            except TimeoutError:
                self.kill()  # the server reaps them and answers
                _server.read(timeout=60)
                raise subprocess.TimeoutExpired(self.cmd, timeout) from None
        return subprocess.CompletedProcess(self.cmd, self.returncode, self.out.read_text(errors="replace"),
                                           self.err.read_text(errors="replace"))


def start_main(argv: list[str], cwd, scratch: Path, nproc: int | None = None, env: dict | None = None,
               out: Path | None = None, err: Path | None = None, module: str = "grpo_mega.train") -> ForkedRun:
    """Start `python -m grpo_mega.train ARGV` (in `cwd`), or with `nproc` the ranks of `torchrun
    --nproc-per-node NPROC --master-port <free> -m grpo_mega.train ARGV`, forked from the warm server; stdout
    and stderr go to `out` and `err` (default: files in `scratch`). `env`: the whole environment (default:
    the server's, which is pytest's at the server's start). `module`: another module to run as `python -m`
    does (a benchmark; alone, not under torchrun)."""
    from grpo_mega.processes import free_port

    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server(Path(scratch) / "fork_server.log")
    out, err = Path(out or Path(scratch) / "fork.out"), Path(err or Path(scratch) / "fork.err")
    req = dict(argv=list(argv), cwd=str(cwd), out=str(out), err=str(err), nproc=nproc, env=env, module=module)
    cmd = [sys.executable, "-m", module, *argv]
    if nproc and module != "grpo_mega.train":
        raise ValueError(f"nproc={nproc} with module={module!r}: only grpo_mega.train runs as torchrun's ranks here")
    if nproc:
        req["port"] = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m",
               "grpo_mega.train", *argv]
    _server.proc.stdin.write((json.dumps(req) + "\n").encode())
    _server.proc.stdin.flush()
    return ForkedRun(argv, cmd, _server.read(timeout=60)["pids"], out, err)


def run_module(module: str, argv: list[str], timeout: float, cwd, scratch: Path, check: bool = False,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` forked from the warm server (a benchmark at toy size: the imports are most of
    its time); `check`: a CalledProcessError, with its output, when it fails."""
    done = start_main(argv, cwd, scratch, env=env, module=module).wait(timeout)
    if check and done.returncode:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done


def run_main(argv: list[str], timeout: float, cwd, scratch: Path, nproc: int | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """`start_main(...).wait(timeout)`: on a timeout every rank and everything under it is SIGKILLed, by
    PID, before TimeoutExpired is raised."""
    return start_main(argv, cwd, scratch, nproc, env).wait(timeout)


if __name__ == "__main__":
    serve()
