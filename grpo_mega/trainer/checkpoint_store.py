"""Where checkpoints live on disk, and how one becomes complete: the part of checkpointing that knows
nothing about models.

A checkpoint is a directory `step_{step:08d}` under the run's checkpoint root. It is written into a
temporary sibling (`.step_{step:08d}.partial-*`) by whoever saves (every rank writes its shards there),
then sealed: a manifest with the size and sha256 of every file is written last, and the directory is
renamed into place. So a kill at any moment leaves either the previous checkpoints untouched and a
partial directory nobody will load, or a complete, verifiable checkpoint. `latest()` (resume=auto) returns
the newest checkpoint whose manifest verifies; `keep_last` prunes older complete ones after a save.

One run writes into a root at a time: `acquire()` takes `.lock` (host, pid, Slurm job id), refreshed by
`heartbeat()` after every step. A second run (the same job submitted twice, say) is refused while the holder
lives; a holder that is gone (its pid dead on this host, an earlier attempt of this Slurm job, or a heartbeat
older than `stale_after_s` on another host) is taken over.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"
LOCK = ".lock"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt."""


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class CheckpointStore:
    def __init__(self, root: str, keep_last: Optional[int] = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last} must be >= 1 (or null to keep all)")
        self.root = Path(root)
        self.keep_last = keep_last

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for checkpoint `step` (call on one rank, share the path). A complete
        checkpoint for the step is never overwritten; one that fails verification (the run resumed from
        an earlier one) is moved aside, not deleted."""
        final = self.step_dir(step)
        if final.exists():
            try:
                self.verify(final)
            except CheckpointError:
                aside = self.root / f".{final.name}.corrupt-{len(list(self.root.glob(f'.{final.name}.corrupt-*')))}"
                os.rename(final, aside)
            else:
                raise CheckpointError(f"{final} exists and is complete; a step is checkpointed once")
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".step_{step:08d}.partial-", dir=self.root))

    def seal(self, step: int, tmp: Path, meta: Optional[dict] = None) -> Path:
        """Write the manifest (last), rename the directory into place, prune. Returns the final path."""
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = str(path.relative_to(tmp))
            files[rel] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"step": step, "files": files, "meta": meta or {}}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = self.step_dir(step)
        os.rename(tmp, final)
        self._prune()
        return final

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of every sealed checkpoint directory, oldest first (not yet verified)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / MANIFEST).is_file():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def verify(self, path: Path) -> dict:
        """The manifest of `path` if every file in it is present with its size and checksum; else
        CheckpointError naming the first problem."""
        manifest_path = Path(path) / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"{path}: no {MANIFEST}; an interrupted or foreign checkpoint")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{manifest_path}: corrupt manifest ({e.msg})") from None
        for rel, info in manifest["files"].items():
            f = Path(path) / rel
            if not f.is_file():
                raise CheckpointError(f"{path}: {rel} is missing")
            if f.stat().st_size != info["bytes"]:
                raise CheckpointError(f"{path}: {rel} has {f.stat().st_size} bytes, the manifest says {info['bytes']} (truncated?)")
            if _sha256(f) != info["sha256"]:
                raise CheckpointError(f"{path}: {rel} fails its checksum (corrupt)")
        return manifest

    def verified(self, path: str) -> tuple[int, Path]:
        """(step, path) of one named checkpoint directory, or CheckpointError saying what is wrong with it."""
        p = Path(path)
        m = _STEP_DIR.match(p.name)
        if not p.is_dir() or m is None:
            raise CheckpointError(f"{path}: no such checkpoint (expected a step_XXXXXXXX directory of a checkpoint root)")
        self.verify(p)
        return int(m.group(1)), p

    def latest(self) -> Optional[tuple[int, Path]]:
        """resume=auto: the newest checkpoint that verifies (a corrupt newer one is skipped and reported
        through the returned list of `skipped`)."""
        self.skipped: list[str] = []
        for step, path in reversed(self.complete()):
            try:
                self.verify(path)
                return step, path
            except CheckpointError as e:
                self.skipped.append(str(e))
        return None

    # ---- one writer at a time ------------------------------------------------------------------------------

    def acquire(self, stale_after_s: float = 1800.0) -> None:
        """Take the root's lock, or CheckpointError naming the run that holds it."""
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, why_free = self._lock_holder(path, stale_after_s)
                if why_free is None:
                    job = f", Slurm job {holder['job']}" if holder.get("job") else ""
                    raise CheckpointError(
                        f"{self.root} is in use by another run (pid {holder.get('pid')} on {holder.get('host')}{job}, "
                        f"since {holder.get('since')}): two runs writing one checkpoint directory would mix their "
                        f"checkpoints. Use another checkpoint.dir (or --job-name), or, if that run is over, delete "
                        f"{path}") from None
                path.unlink(missing_ok=True)
                self.taken_over = why_free
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self._lock = path
            return
        raise CheckpointError(f"{path}: could not take the lock (another run keeps taking it)")

    def _lock_holder(self, path: Path, stale_after_s: float) -> tuple[dict, Optional[str]]:
        """The holder, and why its lock is free to take (None: it is not)."""
        try:
            holder = json.loads(path.read_text())
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return {}, "released meanwhile"
        except (json.JSONDecodeError, OSError):
            return {}, "unreadable lock"
        job = os.environ.get("SLURM_JOB_ID")
        if job and holder.get("job") == job:
            return holder, f"an earlier attempt of Slurm job {job}"
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder["pid"]), 0)
            except ProcessLookupError:
                return holder, f"pid {holder['pid']} on this host has exited"
            except (PermissionError, KeyError, ValueError, TypeError):
                pass
            return holder, None
        if age > stale_after_s:
            return holder, f"no heartbeat for {age:.0f} s"
        return holder, None

    def heartbeat(self) -> None:
        if getattr(self, "_lock", None) is not None:
            os.utime(self._lock)

    def release(self) -> None:
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.unlink(missing_ok=True)

    def remove_partials(self) -> list[Path]:
        """Delete the temporary directories of writes that never completed (a run killed mid-save). Call it
        from the run that owns the root, before it writes: nothing in them could ever be loaded."""
        gone = sorted(self.root.glob(".step_*.partial-*")) if self.root.is_dir() else []
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        return gone

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for _, path in self.complete()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
