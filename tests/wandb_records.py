"""Reads back the history an offline wandb run logged, from its `run-*.wandb` file, so tests can check what
wandb received (wandb >= 0.2x no longer ships a Python reader). The file is a LevelDB-style log: a 7-byte
header (':W&B', magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header (crc32,
length, type: 1 full, 2 first, 3 middle, 4 last) and a serialized `wandb_internal_pb2.Record`; a block's last
< 7 bytes are padding."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a wandb transaction log (header {ident!r} {magic:#x} {version})")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero fill at the end of the file
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def history(run_dir: Path) -> list[dict]:
    """Each `wandb.log` call of the offline run in `run_dir` (wandb/offline-run-*), as {key: value}."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows
