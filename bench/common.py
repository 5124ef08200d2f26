"""What every benchmark in bench/ shares, one section below each: where results go (--out, bench_results/NAME.json),
the machine it ran on, memory probes, wall and CPU time (and A/B sides in turn), one configuration in a fresh
process, training runs and stand-in servers in child processes. Each benchmark keeps what it measures and the
shape of its own JSON.

Only the standard library is imported here (torch, and grpo_mega's stand-in server, inside the functions that
need them), so a benchmark's `--help` stays quick. The benchmarks run as modules from the repository's root
(`python -m bench.step`), so `from bench import common` needs no path set up; a benchmark that measures in a
fresh process starts itself the same way (`worker_cmd`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


# ---- where results go ---------------------------------------------------------------------------------------


def parser(doc: str, name: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: the first line of its docstring `doc` as the description, and --out
    (default bench_results/NAME.json; with no `name`, none: the benchmark picks its file)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=name and out_path(name))
    return ap


def out_path(name: str) -> str:
    """The default --out of a benchmark: bench_results/NAME.json in this checkout."""
    return str(REPO / "bench_results" / f"{name}.json")


def names(value: str, allowed, flag: str) -> list[str]:
    """A comma-separated knob's names; SystemExit naming `flag` when one is not in `allowed`."""
    picked = [x for x in value.split(",") if x]
    if unknown := [x for x in picked if x not in allowed]:
        raise SystemExit(f"{flag}: unknown {unknown}; pick from {list(allowed)}")
    return picked


def write_json(path, data: dict) -> Path:
    """`data` as indented JSON at `path` (its folder made if missing), with a final newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


# ---- the machine --------------------------------------------------------------------------------------------


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor(), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def git_commit() -> str | None:
    """HEAD of this checkout, with `-dirty` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"], capture_output=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.returncode else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(**extra) -> dict:
    """Where a benchmark ran: platform, CPU model and count, package versions, git commit, and the CUDA device
    when torch is loaded and sees one; `extra` (the backend, pinned cores, load averages, ...) is added last."""
    out = dict(platform=platform.platform(), processor=platform.processor(), cpu_model=cpu_model(),
               cpus=os.cpu_count(), torch=_version("torch"), megatron_core=_version("megatron-core"),
               transformers=_version("transformers"), git_commit=git_commit())
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        out.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    out.update(extra)
    return out


# ---- memory -------------------------------------------------------------------------------------------------


def rss_mib(*fields: str, path: str = "/proc/self/status") -> dict[str, float]:
    """`fields` (kB) of a /proc file, MiB (Linux); by default this process's resident set now (VmRSS) and its peak
    since the last reset_peak_rss (VmHWM)."""
    fields, out = fields or ("VmRSS", "VmHWM"), {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[key] = int(value.split()[0]) / 1024.0
    return out


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class CudaMemory:
    """torch.cuda.memory_allocated / max_memory_allocated in GiB, synchronised first; None off CUDA."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def _synchronised(self, what: str):
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return getattr(torch.cuda, what)()

    def now(self):
        return None if not self.cuda else self._synchronised("memory_allocated") / GIB

    def reset_peak(self):
        self._synchronised("reset_peak_memory_stats")

    def peak(self):
        return None if not self.cuda else self._synchronised("max_memory_allocated") / GIB


def copy_bytes_per_s(nbytes: int, device="cpu", repeats: int = 5) -> float:
    """The best of `repeats` copies of an `nbytes` buffer into another on `device` (memcpy bandwidth on the CPU,
    device-to-device on a GPU), bytes/s."""
    import torch

    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / min(timed(lambda: dst.copy_(src), device.type == "cuda")[0] for _ in range(repeats))


# ---- time ---------------------------------------------------------------------------------------------------


def timed(fn, cuda: bool = False) -> tuple[float, float, object]:
    """(wall seconds, this process's CPU seconds, fn()'s result) of fn(); with `cuda` the device is synchronised
    before and after, so that the wall time covers the kernels fn() queued."""
    if cuda:
        import torch

        torch.cuda.synchronize()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - w0, time.process_time() - c0, out


def alternate(sides: dict, rounds: int) -> dict:
    """Each of `sides` (name -> fn) run in turn, `rounds` times, so that load from other processes falls on all
    alike: per name, timed(fn) (wall s, CPU s, result) of every round."""
    runs = {k: [] for k in sides}
    for _ in range(rounds):
        for k, fn in sides.items():
            runs[k].append(timed(fn))
    return runs


# ---- one configuration per process --------------------------------------------------------------------------


def measuring_env() -> dict:
    """The environment of a process whose peak RSS is measured: glibc mmaps every allocation above 64 KiB (so
    freed tensors leave the RSS at once) and torch runs one thread."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")


def worker_cmd(module: str, *args: str) -> list[str]:
    """`python -m MODULE ARGS` with this interpreter: a benchmark's own --worker mode in a fresh process (run with
    cwd=REPO, as run_worker does, so the module is this checkout's)."""
    return [sys.executable, "-m", module, *args]


def flags(args, *names: str) -> list[str]:
    """`--NAME VALUE` for each of `names` (argparse dests) that `args` holds a value for: a benchmark's knobs
    passed on to its own --worker."""
    values = {k: getattr(args, k) for k in names}
    return [a for k, v in values.items() if v is not None for a in (f"--{k.replace('_', '-')}", str(v))]


def run_worker(cmd: list[str], what: str, timeout: float = 3600, env=None, **kw) -> dict:
    """Run `cmd` (a benchmark's own --worker mode) under `env` (default measuring_env; `kw` to subprocess.run) and
    return the JSON object it prints as its last line; its stderr is passed on and SystemExit raised if it fails."""
    out = subprocess.run(cmd, env=env or measuring_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                         **kw)
    if out.returncode:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"{what} failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- training runs and stand-in servers in child processes --------------------------------------------------


def pin(core) -> list[str]:
    """A command prefix pinning it to `core` (`taskset -c CORE`); nothing without a core or taskset."""
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


def trainer_and_server_cores() -> tuple:
    """The first and the last core this process may run on (the trainer's and a stand-in server's), or (None,
    None) with fewer than two."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (cores[0], cores[-1]) if len(cores) >= 2 else (None, None)


def standin_server(core, *args: str):
    """A stand-in server (grpo_mega.engines.standin_server: the tiny model, the toy tokenizer's vocabulary, `args`
    added) pinned to `core`, one torch thread: (process, url); SystemExit if it does not come up."""
    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.engines import standin_server

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    try:
        return standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(len(make_tokenizer())),
                                      *args], prefix=pin(core), env=env, cwd=REPO)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def train(run_dir, overrides, what: str, prefix=(), env=None, timeout: float = 1800, entry=("-m", "grpo_mega.train"),
          **kw) -> list[dict]:
    """`python -m grpo_mega.train hydra.run.dir=RUN_DIR OVERRIDES` (after `prefix`, from the repository's root,
    with this checkout on PYTHONPATH, wandb off and `env` added; `entry` in place of `-m grpo_mega.train` for a
    benchmark's own worker that runs it; `kw` to subprocess.run): the rows of its metrics.jsonl. SystemExit naming
    `what` and the command, its output's tail on stderr, if it fails."""
    cmd = [*prefix, sys.executable, *entry, f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", **(env or {})}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout, **kw)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"{what} failed (exit {done.returncode}): {' '.join(cmd)}")
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
