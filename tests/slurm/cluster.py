"""A real Slurm cluster on this machine for the `slurm` tests: munged, slurmctld and one slurmd per node, every
daemon started in the foreground by this module, tracked by PID and stopped by PID.

Two (or more) nodes share this host: each slurmd runs under its own node name and port, the nodes' names resolve
to 127.0.0.1 through /etc/hosts (added once, idempotently), and each node declares fake GPUs (symlinks to
/dev/null) so `--gpus-per-node` works. Config, state, spool, logs and the munge socket live in one temporary
directory; nothing global (/etc/slurm, /etc/munge, the system munge socket) is changed or used, except /etc/hosts
and the munge key, which is only read. Accounting is off: jobs are followed with `scontrol show job -o`.

Needs Debian's slurmctld, slurmd, slurm-client and munge (`make slurm-packages`) and root.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
INSTALL_HINT = "run `make slurm-packages` (as root: apt-get install slurmctld slurmd slurm-client munge)"
MUNGE_KEY = Path("/etc/munge/munge.key")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def missing_requirements() -> list[str]:
    """What this machine lacks to run a local cluster (empty: nothing)."""
    missing = [f"`{n}` not found" for n in DAEMONS if _which(n) is None]
    if os.geteuid() != 0:
        missing.append("not root (slurmd and munged need root)")
    return missing


def free_ports(n: int) -> list[int]:
    """`n` distinct ports for the daemons to bind (below the ephemeral range: grpo_mega.processes.free_port)."""
    from grpo_mega.processes import free_port

    return [free_port() for _ in range(n)]


def _ensure_hosts(names: list[str]) -> None:
    """Make the node names resolve to 127.0.0.1 (one line per name, added once)."""
    hosts = Path("/etc/hosts")
    text = hosts.read_text()
    known = {w for line in text.splitlines() if not line.lstrip().startswith("#") for w in line.split()[1:]}
    missing = [n for n in names if n not in known]
    if missing:
        with open(hosts, "a") as f:
            f.write(("" if text.endswith("\n") else "\n") + f"127.0.0.1 {' '.join(missing)}  # grpo-mega slurm tests\n")


class LocalSlurm:
    """`with LocalSlurm(nodes=2, cpus=4, gpus=4) as c: job = c.sbatch([...]); c.wait(job)`."""

    def __init__(self, nodes: int = 2, cpus: int = 4, gpus: int = 4, prefix: str = "n", start_timeout: float = 60.0,
                 keep_dir: bool = False):
        self.names = [f"{prefix}{i + 1}" for i in range(nodes)]
        self.cpus, self.gpus, self.start_timeout, self.keep_dir = cpus, gpus, start_timeout, keep_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.dir: Path | None = None
        self.leftovers: list[int] = []
        """PIDs of job processes found alive after their jobs ended (and then ended by stop())."""

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        missing = missing_requirements()
        if missing:
            raise RuntimeError(f"cannot start a local Slurm cluster: {'; '.join(missing)}. To fix: {INSTALL_HINT}")
        if not MUNGE_KEY.is_file():
            raise RuntimeError(f"{MUNGE_KEY} is missing: create it with `mungekey --create` (package munge)")
        t0 = time.monotonic()
        self.dir = Path(tempfile.mkdtemp(prefix="grpo-mega-slurm-"))
        self.dir.chmod(0o755)  # munged (user munge) must reach its socket directory
        _ensure_hosts(self.names)
        self._start_munged()
        self.conf = self._write_config()
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for k in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del self.env[k]  # nothing from an outer allocation leaks into this cluster's commands
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        for name in self.names:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self._wait_idle()
        self.ready_seconds = time.monotonic() - t0

    def _spawn(self, key: str, cmd: list[str], **kw) -> None:
        log = open(self.dir / f"{key}.out", "w")
        self.procs[key] = subprocess.Popen([_which(cmd[0]), *cmd[1:]], stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        log.close()

    def _start_munged(self) -> None:
        mdir = self.dir / "munge"
        mdir.mkdir()
        mdir.chmod(0o755)  # munged: clients need execute permission on the socket directory
        shutil.chown(mdir, "munge", "munge")
        self.munge_socket = mdir / "munge.socket"
        self._spawn("munged", ["munged", "-F", f"--socket={self.munge_socket}", f"--key-file={MUNGE_KEY}",
                               f"--log-file={mdir / 'munged.log'}", f"--pid-file={mdir / 'munged.pid'}",
                               f"--seed-file={mdir / 'munged.seed'}"], user="munge", group="munge", extra_groups=[])
        self._until(lambda: self.munge_socket.exists(), 20, "munged to create its socket", "munged")

    def _write_config(self) -> Path:
        d = self.dir
        for sub in ("state", "spool", "dev"):
            (d / sub).mkdir()
        ctl_port, *node_ports = free_ports(1 + len(self.names))
        for i in range(self.gpus):
            os.symlink("/dev/null", d / "dev" / f"gpu{i}")
        host = socket.gethostname()
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} "
                          f"RealMemory=1000 Gres=gpu:{self.gpus} State=UNKNOWN" for n, p in zip(self.names, node_ports))
        (d / "plugstack.conf").write_text("")
        (d / "gres.conf").write_text(f"Name=gpu File={d}/dev/gpu[0-{self.gpus - 1}]\n")
        conf = d / "slurm.conf"
        conf.write_text(f"""\
ClusterName=grpomega
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctl_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={self.munge_socket},cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# the main scheduling loop also runs every second, so a requeued job starts as soon as it is eligible
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
GresTypes=gpu
KillWait=5
MinJobAge=600
InactiveLimit=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        return conf

    def _until(self, ok, timeout: float, what: str, *watch: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            for key in watch or self.procs:
                p = self.procs.get(key)
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"{key} exited with {p.returncode} while waiting for {what}:\n{self.logs(key)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def _wait_idle(self) -> None:
        def idle():
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return r.returncode == 0 and all(states.get(n) == "idle" for n in self.names)

        self._until(idle, self.start_timeout, f"nodes {self.names} to be idle")

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every job, wait for them to end, then end the daemons this object started, by PID."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", f"--user={getpass.getuser()}"], check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.active_jobs():
                time.sleep(0.5)
        for key in [k for k in self.procs if k.startswith("slurmd")] + ["slurmctld", "munged"]:
            p = self.procs.get(key)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)
        self._end_leftover_job_processes()
        if self.dir is not None and not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _end_leftover_job_processes(self) -> None:
        """Processes whose environment names this cluster's SLURM_CONF (slurmstepd children: job scripts,
        launchers, ranks) that outlived their job: ended by PID."""
        if self.dir is None:
            return
        needle = f"SLURM_CONF={self.dir}/slurm.conf".encode()
        for _ in range(2):
            pids = []
            for p in Path("/proc").iterdir():
                if p.name.isdigit() and int(p.name) != os.getpid():
                    try:
                        if needle in (p / "environ").read_bytes().split(b"\0"):
                            pids.append(int(p.name))
                    except OSError:
                        pass
            self.leftovers += pids
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not pids:
                return
            time.sleep(0.5)

    def running_pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]

    # ---- commands ---------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        env = {**self.env, **kw.pop("env", {})}
        r = subprocess.run([_which(cmd[0]) or cmd[0], *cmd[1:]], capture_output=True, text=True, timeout=timeout,
                           env=env, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | Path | None = None) -> int:
        r = self.run(["sbatch", "--parsable", *args], env=env or {}, cwd=cwd)
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, ExitCode, Restarts, Command, ...)."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def active_jobs(self) -> list[str]:
        r = self.run(["squeue", "-h", "-o", "%i %T"], check=False)
        return [line for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else []

    def wait(self, job_id: int, timeout: float, poll: float = 0.5) -> dict[str, str]:
        """Poll until the job reaches a terminal state; its `scontrol show job` fields. A timeout cancels it."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL:
                return info
            if time.monotonic() > deadline:
                self.run(["scancel", str(job_id)], check=False)
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s "
                                   f"(cancelled):\n{self.logs()}")
            time.sleep(poll)

    def logs(self, *keys: str, tail: int = 3000) -> str:
        if self.dir is None:
            return ""
        files = [self.dir / f"{k}.out" for k in keys] or sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out"))
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}" for f in files if f.exists())
