"""Where checkpoints live on disk, and how one becomes complete: the part of checkpointing that knows
nothing about models.

A checkpoint is a directory `step_{step:08d}` under the run's checkpoint root. It is written into a
temporary sibling (`.step_{step:08d}.partial-*`) by whoever saves (every rank writes its shards there),
then sealed: a manifest with the size and sha256 of every file is written last, and the directory is
renamed into place. So a kill at any moment leaves either the previous checkpoints untouched and a
partial directory nobody will load, or a complete, verifiable checkpoint. `latest()` (resume=auto) returns
the newest checkpoint whose manifest verifies; `keep_last` prunes older complete ones after a save.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"
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
