"""What a CUDA memory peak is made of (run.memory_sites): torch's allocation history, recorded from before the
models are built through the first update, is replayed to the moment the bytes allocated peaked, and the blocks
live then are summed by the Python line that asked for them, largest first. Megatron-LM's
--record-memory-history saves the raw snapshot for torch's memory viz; this writes the table a user reads when a
layout does not fit. Without CUDA nothing is recorded (rank 0 says so once).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

MAX_ENTRIES = 2_000_000
"""Allocation events kept (torch's ring buffer); a longer first step loses its oldest events (`trace_truncated`)."""


def _short(filename: str) -> str:
    """A frame's file relative to site-packages or to this repository."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    root = str(Path(__file__).resolve().parents[2]) + os.sep
    return filename[len(root):] if filename.startswith(root) else filename


def _site(frames: list) -> tuple[str, str]:
    """An allocation's site: the innermost Python frame outside torch itself (the code that asked), and the
    innermost frame of all (what allocated)."""
    if not frames:
        return "(no stack recorded)", ""
    inner = frames[0]
    via = f"{_short(inner.get('filename', '?'))}:{inner.get('line', '?')} {inner.get('name', '?')}"
    for f in frames:
        name = _short(f.get("filename", "?"))
        if not (name.startswith("torch/") or name.startswith("<")):
            return f"{name}:{f.get('line', '?')} {f.get('name', '?')}", via
    return via, via


def top_allocation_sites(snapshot: dict, n: int = 12, device: int = 0, max_entries: int = 0) -> dict:
    """torch.cuda.memory._snapshot() taken after _record_memory_history: replays the device's alloc/free trace
    to the moment the bytes allocated since recording began peaked, and sums the blocks live then by
    allocation site (`_site`), largest first. Blocks allocated before recording began are not in the trace
    (their frees are ignored)."""
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[device]
    cur = peak = 0
    peak_i = -1
    sizes = {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev["size"]
            cur += ev["size"]
            if cur > peak:
                peak, peak_i = cur, i
        elif ev["action"] == "free_requested":
            cur -= sizes.pop(ev["addr"], 0)
    live = {}
    for ev in trace[: peak_i + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    by_site: dict = {}
    for ev in live.values():
        site, via = _site(ev.get("frames") or [])
        d = by_site.setdefault(site, dict(bytes=0, blocks=0, largest_block_bytes=0, via=via))
        d["bytes"] += ev["size"]
        d["blocks"] += 1
        d["largest_block_bytes"] = max(d["largest_block_bytes"], ev["size"])
    top = sorted(by_site.items(), key=lambda kv: -kv[1]["bytes"])[:n]
    return dict(trace_events=len(trace), trace_truncated=bool(max_entries) and len(trace) >= max_entries,
                peak_gib_since_recording=peak / 2**30, sites_at_peak=len(by_site),
                top=[dict(site=k, gib=v["bytes"] / 2**30, blocks=v["blocks"],
                          largest_block_gib=v["largest_block_bytes"] / 2**30, via=v["via"]) for k, v in top])


class MemorySites:
    """Records allocations from construction (CUDA only, `top` > 0) until `report`, which writes the `top` sites
    at the peak to `out` (and returns them); later calls do nothing."""

    def __init__(self, top: int, out: Optional[Path] = None, rank: int = 0):
        self.top, self.out, self.rank = top, out, rank
        self.recording = top > 0 and torch.cuda.is_available()
        if top > 0 and not self.recording and rank == 0:
            print(f"note: run.memory_sites={top} records CUDA allocations: this run has no GPU, nothing is recorded",
                  flush=True)
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=MAX_ENTRIES)

    def report(self, step: int) -> Optional[dict]:
        if not self.recording:
            return None
        self.recording = False
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        sites = dict(step=step, **top_allocation_sites(snapshot, self.top, torch.cuda.current_device(), MAX_ENTRIES))
        if self.out is not None:
            path = self.out / f"memory_sites.rank{self.rank}.json"
            path.write_text(json.dumps(sites, indent=1))
            if self.rank == 0:
                lines = [f"  {s['gib']:8.3f} GiB  {s['site']}" for s in sites["top"][:5]]
                print(f"memory: {sites['peak_gib_since_recording']:.2f} GiB at the peak through step {step}'s update, "
                      f"by the line that allocated it (all {len(sites['top'])} in {path}):\n" + "\n".join(lines),
                      flush=True)
        return sites
