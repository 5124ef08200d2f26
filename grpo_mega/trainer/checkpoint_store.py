"""Where checkpoints live on disk, and how one becomes complete: the part of checkpointing that knows
nothing about models.

A checkpoint is a directory `step_{step:08d}` under the run's checkpoint root. It is written into a
temporary sibling (`.step_{step:08d}.partial-*`) by whoever saves (every rank writes its shards there),
then sealed: every file is fsynced, a manifest with the size and the sha256 of every piece of every file
(`piece_bytes` each) is written last and fsynced, the directory is renamed into place and the root fsynced.
So a kill at any moment leaves either the previous checkpoints untouched and a partial directory nobody will
load, or a complete, verifiable checkpoint. `latest()` (resume=auto) returns the newest checkpoint whose
manifest verifies; `keep_last` prunes after a save, counting only checkpoints known to verify.

Hashing is shared out (`plan`): the files are cut into pieces, each rank takes first the pieces of the files it
wrote (torch DCP's `__R_*.distcp`, our `rank_R.*`) up to its even share, the rest go to the least-loaded rank;
each rank hashes its share (`hash_share`) and rank 0 writes the gathered digests (`seal(digests=)`). On resume
each rank checks the same kind of share of the manifest (`check_share`) and the problems are gathered
(trainer/checkpoint.py does the collectives). One process can do it all alone: `seal()`/`verify()`.

One run writes into a root at a time: `acquire()` links a complete `.lock` record (host, pid, Slurm job id, a
token, its staleness) into place, and a background thread touches it every `heartbeat_s`. A second run is
refused while the holder lives; a holder that is gone (its pid dead on this host, an earlier attempt of this
Slurm job, or no heartbeat for the holder's own `stale_after_s` on another host) is taken over, and only one
taker can win: it must first create `.lock.takeover-<digest of the stale record>` with O_EXCL. `release()`
removes the lock only when it still holds this run's token.

Long on purpose: the write protocol, its verification and the run lock are one contract on one directory
tree, kept in one file so that a change to one is read against the others.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional

MANIFEST = "manifest.json"
LOCK = ".lock"
PIECE_BYTES = 256 << 20
"""Hashing granularity: a file is hashed as pieces of this many bytes, so that a few large files still share
out evenly over many ranks."""
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_WRITER = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.[^/]*)$")
_CLAIM_STALE_S = 60.0

Piece = tuple[str, int, int]
"""(file relative to the checkpoint directory, byte offset, length)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt."""


def _sha256(path: Path, offset: int = 0, length: Optional[int] = None, chunk: int = 8 << 20) -> str:
    """sha256 of `length` bytes of `path` from `offset` (None: to the end)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = math.inf if length is None else length
        while left > 0 and (block := f.read(int(min(chunk, left)))):
            h.update(block)  # hashlib releases the GIL for large blocks
            left -= len(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writer_rank(rel: str) -> Optional[int]:
    """The rank that wrote `rel`, when its name says so (torch DCP `__R_N.distcp`, our `rank_R.*`)."""
    m = _WRITER.search(rel)
    return None if m is None else int(m.group(1) or m.group(2))


def plan(sizes: dict[str, int], world: int, piece_bytes: int = PIECE_BYTES) -> list[list[Piece]]:
    """Every rank's share of the hashing of files `sizes` (relative path -> bytes): pieces of at most
    `piece_bytes`, each file at least one piece (an empty file too, so that someone checks it exists). A rank
    first gets pieces of the files it wrote (they may still be in its page cache) up to an even share, then
    the rest go largest first to the least-loaded rank: no rank hashes more than total/world + piece_bytes.
    Deterministic: every rank computes the same plan from the same sizes."""
    pieces = [(rel, i * piece_bytes, min(piece_bytes, size - i * piece_bytes))
              for rel, size in sorted(sizes.items()) for i in range(max(1, math.ceil(size / piece_bytes)))]
    target = sum(p[2] for p in pieces) / world
    load, shares, rest = [0] * world, [[] for _ in range(world)], []
    for p in pieces:
        w = writer_rank(p[0])
        if w is not None and w < world and load[w] + p[2] <= target:
            shares[w].append(p)
            load[w] += p[2]
        else:
            rest.append(p)
    heap = [(load[r], r) for r in range(world)]
    heapq.heapify(heap)
    for p in sorted(rest, key=lambda p: (-p[2], p[0], p[1])):
        n, r = heapq.heappop(heap)
        shares[r].append(p)
        heapq.heappush(heap, (n + p[2], r))
    return shares


def hash_share(root: Path, share: Iterable[Piece], fsync: bool = True) -> dict[str, dict]:
    """Digests of one rank's pieces under `root`: {rel: {"bytes": size, "pieces": {offset: sha256}}}; each file
    is fsynced after its pieces are read (its data durable before the manifest names it)."""
    out: dict[str, dict] = {}
    for rel, offset, length in share:
        path = Path(root) / rel
        entry = out.setdefault(rel, {"bytes": path.stat().st_size, "pieces": {}})
        entry["pieces"][offset] = _sha256(path, offset, length)
    if fsync:
        for rel in out:
            _fsync(Path(root) / rel)
    return out


def merge_digests(parts: Iterable[dict[str, dict]]) -> dict[str, dict]:
    """The per-rank digests of `hash_share`, joined."""
    out: dict[str, dict] = {}
    for part in parts:
        for rel, entry in part.items():
            out.setdefault(rel, {"bytes": entry["bytes"], "pieces": {}})["pieces"].update(entry["pieces"])
    return out


def list_files(root: Path) -> dict[str, int]:
    """relative path -> bytes of every file under `root` but the manifest."""
    root = Path(root)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file() and p != root / MANIFEST}


class CheckpointStore:
    def __init__(self, root: str, keep_last: Optional[int] = None, piece_bytes: int = PIECE_BYTES):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"checkpoint.keep_last={keep_last} must be >= 1 (or null to keep all)")
        self.root = Path(root)
        self.keep_last = keep_last
        self.piece_bytes = piece_bytes
        self.skipped: list[str] = []
        self._verified: set[str] = set()  # names of step directories known to verify (sealed or checked here)
        self._bad: set[str] = set()
        self._lock: Optional[Path] = None
        self.lost: Optional[str] = None

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for checkpoint `step` (call on one rank, share the path). A complete
        checkpoint for the step is never overwritten; one that fails verification (the run resumed from
        an earlier one) is moved aside, not deleted."""
        final = self.step_dir(step)
        if final.exists():
            bad = final.name in self._bad
            if not bad and final.name not in self._verified:
                try:
                    self.verify(final)
                except CheckpointError:
                    bad = True
            if not bad:
                raise CheckpointError(f"{final} exists and is complete; a step is checkpointed once")
            aside = self.root / f".{final.name}.corrupt-{len(list(self.root.glob(f'.{final.name}.corrupt-*')))}"
            os.rename(final, aside)
            self._bad.discard(final.name)
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".step_{step:08d}.partial-", dir=self.root))

    # ---- sealing -------------------------------------------------------------------------------------------

    def plan(self, tmp: Path, world: int) -> list[list[Piece]]:
        """Every rank's share of hashing the files written into `tmp` (call once all are written)."""
        return plan(list_files(tmp), world, self.piece_bytes)

    def seal(self, step: int, tmp: Path, meta: Optional[dict] = None, digests: Optional[dict] = None) -> Path:
        """Write the manifest (last), rename the directory into place, prune. Returns the final path.
        `digests`: every file's pieces as the ranks hashed them (`merge_digests`); None: hash them here."""
        if self.lost:
            raise CheckpointError(f"not sealing checkpoint {step}: {self.lost}")
        if digests is None:
            digests = hash_share(tmp, self.plan(tmp, 1)[0])
        files = {}
        for rel in sorted(digests):
            entry = digests[rel]
            n = max(1, math.ceil(entry["bytes"] / self.piece_bytes))
            missing = [i for i in range(n) if i * self.piece_bytes not in entry["pieces"]]
            if missing:
                raise CheckpointError(f"{tmp}: {rel}: pieces {missing} were hashed by no rank")
            files[rel] = {"bytes": entry["bytes"], "sha256": [entry["pieces"][i * self.piece_bytes] for i in range(n)]}
        for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            _fsync(d)  # the files' directory entries, deepest first
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"format": 2, "step": step, "piece_bytes": self.piece_bytes, "files": files,
                       "meta": meta or {}}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        final = self.step_dir(step)
        os.rename(tmp, final)
        _fsync(self.root)  # the rename is durable before any older checkpoint is pruned
        self._verified.add(final.name)
        self._prune()
        return final

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    # ---- verifying -----------------------------------------------------------------------------------------

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

    @staticmethod
    def read_manifest(path: Path) -> dict:
        manifest_path = Path(path) / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"{path}: no {MANIFEST}; an interrupted or foreign checkpoint")
        try:
            return json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{manifest_path}: corrupt manifest ({e.msg})") from None

    def check_share(self, path: Path, rank: int = 0, world: int = 1) -> list[tuple[int, str]]:
        """Rank `rank`'s share (of `world`) of verifying checkpoint `path`: (file's position in the manifest,
        problem) for every file of its share that is missing, has the wrong size or fails a checksum. A
        manifest that cannot be read is every rank's problem (position -1)."""
        path = Path(path)
        try:
            manifest = self.read_manifest(path)
        except CheckpointError as e:
            return [(-1, str(e))]
        files = manifest["files"]
        piece = manifest.get("piece_bytes")
        if piece is None:  # format 1: one sha256 of each whole file
            piece = max([info["bytes"] for info in files.values()] + [1])
            files = {rel: {**info, "sha256": [info["sha256"]]} for rel, info in files.items()}
        order = {rel: i for i, rel in enumerate(sorted(files))}
        problems, bad = [], set()
        for rel, offset, length in plan({rel: info["bytes"] for rel, info in files.items()}, world, piece)[rank]:
            if rel in bad:
                continue
            f, info = path / rel, files[rel]
            problem = None
            try:
                if not f.is_file():
                    problem = f"{path}: {rel} is missing"
                elif f.stat().st_size != info["bytes"]:
                    problem = f"{path}: {rel} has {f.stat().st_size} bytes, the manifest says {info['bytes']} (truncated?)"
                elif _sha256(f, offset, length) != info["sha256"][offset // piece]:
                    problem = f"{path}: {rel} fails its checksum (corrupt)"
            except OSError as e:
                problem = f"{path}: {rel} cannot be read ({e})"
            if problem:
                bad.add(rel)
                problems.append((order[rel], problem))
        return problems

    def conclude(self, path: Path, problems: Iterable[tuple[int, str]]) -> dict:
        """The manifest of `path` if no rank found a problem (remembered as verified), else CheckpointError
        naming the first problem in manifest order."""
        problems = sorted(set(problems))
        if problems:
            self._bad.add(Path(path).name)
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise CheckpointError(problems[0][1] + more)
        self._verified.add(Path(path).name)
        self._bad.discard(Path(path).name)
        return self.read_manifest(path)

    def verify(self, path: Path) -> dict:
        """The manifest of `path` if every file in it is present with its size and checksums (all checked by
        this process); else CheckpointError naming the first problem."""
        return self.conclude(path, self.check_share(path))

    def verified(self, path: str, check: Optional[Callable[[Path], dict]] = None) -> tuple[int, Path]:
        """(step, path) of one named checkpoint directory, or CheckpointError saying what is wrong with it.
        `check(path)` verifies (default: `verify`, alone)."""
        p = Path(path)
        m = _STEP_DIR.match(p.name)
        if not p.is_dir() or m is None:
            raise CheckpointError(f"{path}: no such checkpoint (expected a step_XXXXXXXX directory of a checkpoint root)")
        (check or self.verify)(p)
        return int(m.group(1)), p

    def latest(self, check: Optional[Callable[[Path], dict]] = None,
               candidates: Optional[list[tuple[int, Path]]] = None) -> Optional[tuple[int, Path]]:
        """resume=auto: the newest checkpoint that verifies (a corrupt newer one is skipped and reported
        in `skipped`). `check(path)` verifies (default: `verify`, alone); `candidates`: `complete()` as one
        rank listed it, so that every rank of a collective check walks the same list."""
        self.skipped = []
        for step, path in reversed(self.complete() if candidates is None else candidates):
            try:
                (check or self.verify)(Path(path))
                return step, Path(path)
            except CheckpointError as e:
                self.skipped.append(str(e))
        return None

    # ---- one writer at a time ------------------------------------------------------------------------------

    def acquire(self, stale_after_s: float = 300.0, heartbeat_s: Optional[float] = None) -> None:
        """Take the root's lock, or CheckpointError naming the run that holds it. A background thread touches
        the lock every `heartbeat_s` (default stale_after_s / 10); another host may take it over after
        `stale_after_s` without one (the value is recorded in the lock: takers use the holder's)."""
        heartbeat_s = heartbeat_s or stale_after_s / 10
        token = uuid.uuid4().hex
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "token": token, "stale_after_s": stale_after_s,
              "heartbeat_s": heartbeat_s}
        self.root.mkdir(parents=True, exist_ok=True)
        path, mine = self.root / LOCK, self.root / f"{LOCK}.{token}"
        with open(mine, "w") as f:  # written whole, then linked into place: nobody ever reads half a lock
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        self.taken_over = None
        try:
            for _ in range(100):
                try:
                    os.link(mine, path)
                    break
                except FileExistsError:
                    pass
                raw = _read(path)
                if raw is None:
                    continue  # released meanwhile
                holder, why_free = self._lock_holder(path, raw, stale_after_s)
                if why_free is None:
                    job = f", Slurm job {holder['job']}" if holder.get("job") else ""
                    raise CheckpointError(
                        f"{self.root} is in use by another run (pid {holder.get('pid')} on {holder.get('host')}{job}, "
                        f"since {holder.get('since')}): two runs writing one checkpoint directory would mix their "
                        f"checkpoints. Use another checkpoint.dir (or --job-name), or, if that run is over, delete "
                        f"{path}") from None
                if self._take_over(path, raw, mine):
                    self.taken_over = why_free
                    break
                time.sleep(0.02)  # another run is taking this lock over right now: look again
            else:
                raise CheckpointError(f"{path}: could not take the lock (another run keeps taking it)")
        finally:
            mine.unlink(missing_ok=True)
        self._lock, self._token, self.lost = path, token, None
        for claim in self.root.glob(f"{LOCK}.takeover-*"):  # claims of take-overs that died half-way
            try:
                if time.time() - claim.stat().st_mtime > _CLAIM_STALE_S:
                    claim.unlink()
            except FileNotFoundError:
                pass
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat_loop, args=(self._stop, heartbeat_s),
                                      name="checkpoint-lock-heartbeat", daemon=True)
        self._beat.start()

    def _take_over(self, path: Path, raw: bytes, mine: Path) -> bool:
        """Replace the stale lock record `raw` by ours; False when another run got there first. Only the run
        that creates the claim file for exactly this record may replace it."""
        gen = hashlib.sha256(raw).hexdigest()[:16]
        k = 0
        while True:
            claim = self.root / f"{LOCK}.takeover-{gen}-{k}"
            try:
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                break
            except FileExistsError:
                try:
                    age = time.time() - claim.stat().st_mtime
                except FileNotFoundError:
                    return False  # that take-over just finished
                if age < _CLAIM_STALE_S:
                    return False  # another run is taking over this very record now
                k += 1  # a take-over that died half-way: claim past it
        aside = self.root / f"{LOCK}.displaced-{gen}-{uuid.uuid4().hex[:8]}"
        try:
            if _read(path) != raw:
                return False  # replaced meanwhile
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return False
            if _read(aside) != raw:  # a new holder slipped in between: put its lock back
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass
                return False
            try:
                os.link(mine, path)
            except FileExistsError:
                return False
            return True
        finally:
            aside.unlink(missing_ok=True)
            claim.unlink(missing_ok=True)

    def _lock_holder(self, path: Path, raw: bytes, stale_after_s: float) -> tuple[dict, Optional[str]]:
        """The holder, and why its lock is free to take (None: it is not)."""
        try:
            holder = json.loads(raw)
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return {}, "released meanwhile"
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return {}, "unreadable lock"
        if not isinstance(holder, dict):
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
        stale = holder.get("stale_after_s", stale_after_s)  # the holder's own promise (older locks: ours)
        if age > stale:
            return holder, f"no heartbeat for {age:.0f} s"
        return holder, None

    def owns_lock(self) -> bool:
        """Does the lock file still hold this run's record?"""
        raw = _read(self._lock) if self._lock is not None else None
        try:
            return raw is not None and json.loads(raw).get("token") == self._token
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return False

    def heartbeat(self) -> None:
        """Touch the lock if this run still holds it (the background thread does so too); a lock taken over
        by another run is recorded in `lost` and sealing refuses."""
        if self._lock is None or self.lost:
            return
        if not self.owns_lock():
            self.lost = f"{self._lock} was taken over by another run"
            return
        try:
            os.utime(self._lock)
        except FileNotFoundError:
            self.lost = f"{self._lock} was removed by someone else"

    def _heartbeat_loop(self, stop: threading.Event, every: float) -> None:
        while not stop.wait(every) and not self.lost:
            self.heartbeat()

    def release(self) -> None:
        """Remove the lock, if it is still this run's (a lock taken over by another run stays)."""
        if getattr(self, "_stop", None) is not None:
            self._stop.set()
            self._beat.join(timeout=5)
        if self._lock is not None and self.owns_lock():
            self._lock.unlink(missing_ok=True)
        self._lock = None

    # ---- housekeeping --------------------------------------------------------------------------------------

    def remove_partials(self) -> list[Path]:
        """Delete the temporary directories of writes that never completed (a run killed mid-save). Call it
        from the run that owns the root, before it writes: nothing in them could ever be loaded."""
        gone = sorted(self.root.glob(".step_*.partial-*")) if self.root.is_dir() else []
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        return gone

    def _prune(self) -> None:
        """Keep the newest `keep_last` checkpoints known to verify (sealed or verified by this store) and any
        newer ones; delete everything older than the oldest of those."""
        if self.keep_last is None:
            return
        complete = self.complete()
        good = [s for s, p in complete if p.name in self._verified]
        if len(good) < self.keep_last:
            return
        boundary = good[-self.keep_last]
        for step, path in complete:
            if step < boundary:
                shutil.rmtree(path, ignore_errors=True)


def _read(path: Path) -> Optional[bytes]:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None
