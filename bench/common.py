"""What every benchmark in bench/ shares: the machine it ran on (CPU model, cores, torch / megatron-core /
transformers versions, the git commit), memory probes (a process's peak RSS on Linux, CUDA's allocator on a
GPU), copy bandwidth, running one configuration in a fresh process, and writing the result to
bench_results/NAME.json. Each benchmark keeps what it measures and the shape of its own JSON.

Only the standard library is imported here (torch inside the functions that need it), so a benchmark's
`--help` stays quick; nothing here imports grpo_mega. The benchmarks run as modules from the repository's root
(`python -m bench.step`), so `from bench import common` needs no path set up; a benchmark that measures in a
fresh process starts itself the same way (`worker_cmd`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


# ---- where results go ---------------------------------------------------------------------------------------


def out_path(name: str) -> str:
    """The default --out of a benchmark: bench_results/NAME.json in this checkout."""
    return str(REPO / "bench_results" / f"{name}.json")


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


def rss_mib() -> dict[str, float]:
    """This process's resident set now (VmRSS) and its peak since the last reset_peak_rss (VmHWM), MiB (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
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

    def now(self):
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / GIB

    def reset_peak(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self):
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / GIB


def copy_bytes_per_s(nbytes: int, device="cpu", repeats: int = 5) -> float:
    """The best of `repeats` copies of an `nbytes` buffer into another on `device` (memcpy bandwidth on the CPU,
    device-to-device on a GPU), bytes/s."""
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


# ---- one configuration per process --------------------------------------------------------------------------


def measuring_env() -> dict:
    """The environment of a process whose peak RSS is measured: glibc mmaps every allocation above 64 KiB (so
    freed tensors leave the RSS at once) and torch runs one thread."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")


def worker_cmd(module: str, *args: str) -> list[str]:
    """`python -m MODULE ARGS` with this interpreter: a benchmark's own --worker mode in a fresh process (run with
    cwd=REPO, as run_worker does, so the module is this checkout's)."""
    return [sys.executable, "-m", module, *args]


def run_worker(cmd: list[str], what: str, timeout: float = 3600) -> dict:
    """Run `cmd` (a benchmark's own --worker mode) under measuring_env and return the JSON object it prints as
    its last line; its stderr is passed on and SystemExit raised if it fails."""
    out = subprocess.run(cmd, env=measuring_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if out.returncode:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"{what} failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])
