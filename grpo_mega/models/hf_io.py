"""HF checkpoints on disk: reading config.json and safetensors (never pickle), loading an HF directory
straight into a running sharded GPTModel, and writing sharded safetensors with an index, atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from grpo_mega.conf.model import ModelConfig
from grpo_mega.models import bridge

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)


def read_hf_config(hf_dir: str) -> tuple[dict, object, ModelConfig]:
    """(config.json as a dict, the model family, our ModelConfig) of an HF model directory."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir}: no config.json; expected an HF model directory (save_pretrained output)")
    with open(path) as f:
        hf = json.load(f)
    family = bridge.family_of_hf(hf)
    return hf, family, family.model_config(hf, name=Path(hf_dir).name)


def hf_dtype(hf: dict) -> torch.dtype:
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(str(name), torch.float32)


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class _LazyTensor:
    """One tensor of a safetensors file, read with plain file reads on slicing: `t[a:b]` reads only those
    rows, `t[:, a:b]` reads the tensor and keeps those columns, `t[:]` reads it all. Plain reads (not mmap)
    keep the file's pages out of this process's memory: a conversion holds the model plus one tensor."""

    def __init__(self, path: Path, name: str, dtype: torch.dtype, shape: tuple, start: int, end: int):
        self.path, self.name, self.dtype, self.shape, self.start, self.end = path, name, dtype, shape, start, end

    def get_shape(self) -> tuple:
        return self.shape

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def _read_rows(self, lo: int, hi: int) -> torch.Tensor:
        rows = self.shape[0] if self.shape else 1
        lo, hi = max(0, lo), min(rows, hi)
        row_elems = 1
        for d in self.shape[1:]:
            row_elems *= d
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        nbytes = (hi - lo) * row_elems * itemsize
        buf = bytearray(nbytes)
        with open(self.path, "rb") as f:
            f.seek(self.start + lo * row_elems * itemsize)
            if f.readinto(buf) != nbytes:
                raise ValueError(f"{self.path}: tensor {self.name} is truncated (file shorter than its header says)")
        t = torch.frombuffer(buf, dtype=self.dtype) if nbytes else torch.empty(0, dtype=self.dtype)
        return t.reshape((hi - lo, *self.shape[1:]) if self.shape else ())

    def __getitem__(self, key) -> torch.Tensor:
        if not self.shape:
            return self._read_rows(0, 1)
        if isinstance(key, slice) and key.step in (None, 1):
            lo, hi, _ = key.indices(self.shape[0])
            return self._read_rows(lo, hi)
        if isinstance(key, tuple):
            return self._read_rows(0, self.shape[0])[key]
        raise TypeError(f"unsupported index {key!r} for {self.name}")


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(raw, "little")
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{path}: corrupt safetensors header (length {n} for a {size}-byte file)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        if not 0 <= lo <= hi or base + hi > size:
            raise ValueError(f"{path}: tensor {name} lies outside the file (truncated or corrupt)")
        out[name] = _LazyTensor(path, name, _ST_DTYPES[info["dtype"]], tuple(info["shape"]), base + lo, base + hi)
    return out


class SafetensorsReader:
    """Tensors of an HF directory by name, from model.safetensors or an index of shards, read lazily:
    `open(name)` returns a sliceable handle, so a TP rank reads only its rows. Never pickle."""

    def __init__(self, hf_dir: str):
        d = Path(hf_dir)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif (d / "model.safetensors").is_file():
            weight_map = None
        else:
            pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
            hint = f" (found {', '.join(pickles)}: pickle files are never loaded; re-save with safe_serialization)" if pickles else ""
            raise ValueError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json{hint}")
        self._tensors: dict[str, _LazyTensor] = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            if not (d / name).is_file():
                raise ValueError(f"{hf_dir}: the index names {name}, which is missing")
            self._tensors.update(_read_header(d / name))
        if weight_map:
            missing = sorted(k for k in weight_map if k not in self._tensors)
            if missing:
                raise ValueError(f"{hf_dir}: index lists tensors missing from their shard files: {missing[:5]}")

    def keys(self) -> list[str]:
        return list(self._tensors)

    def open(self, name: str) -> _LazyTensor:
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return self._tensors[name]

    def get(self, name: str) -> torch.Tensor:
        return self.open(name)[:]


def check_tensors(reader: SafetensorsReader, cfg: ModelConfig, hf_dir: str) -> None:
    """Every tensor the config implies is in the checkpoint, and no expert beyond the config's num_experts."""
    want = set(bridge.hf_names(cfg))
    missing = sorted(want - set(reader.keys()))
    if missing:
        raise ValueError(f"{hf_dir}: tensors missing for a {cfg.family} model with this config: {missing[:5]}")
    extra = sorted(k for k in reader.keys() if ".mlp.experts." in k and k not in want)
    if extra:
        raise ValueError(f"{hf_dir}: holds experts its config does not have (num_experts={cfg.num_experts}): {extra[:3]}")


def zero_pad_row(hf_dir: str) -> Optional[int]:
    """config.json's pad_token_id when that row of the input embedding is all zeros, else None. transformers
    builds `nn.Embedding(..., padding_idx=pad_token_id)`: a model it initialised has that row zeroed, and its
    backward never trains it; megatron's embedding trains every row (reads one row of the file)."""
    pad = read_hf_config(hf_dir)[0].get("pad_token_id")
    if not isinstance(pad, int) or pad < 0:
        return None
    row = SafetensorsReader(hf_dir).open("model.embed_tokens.weight")[pad:pad + 1]
    return pad if row.numel() and not row.any() else None


def load_hf_into_gpt(gpt: torch.nn.Module, hf_dir: str, cfg: ModelConfig, tp_rank: int, tp: int,
                     reader: Optional[SafetensorsReader] = None) -> None:
    """Fill this rank's stage/shard of a GPTModel from an HF directory, reading only its own slices."""
    reader = reader or SafetensorsReader(hf_dir)
    check_tensors(reader, cfg, hf_dir)
    offset, first_expert = bridge.layer_offset(gpt), bridge.expert_offset(gpt, cfg)
    if cfg.is_moe:
        from megatron.core import parallel_state as ps

        # experts are split over the expert-tensor-parallel group (megatron's default: the same size as tp)
        etp_rank, etp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    with torch.no_grad():
        for local, param in gpt.state_dict(keep_vars=True).items():
            if local.endswith("_extra_state"):
                continue
            name = bridge.global_name(local, offset, first_expert)
            if name == "output_layer.weight" and cfg.tie_word_embeddings:
                name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
            if bridge.expert_of(name) is not None:
                shard = bridge.shard_from_hf(name, reader.open, cfg, etp_rank, etp)
            else:
                shard = bridge.shard_from_hf(name, reader.open, cfg, tp_rank, tp)
            if shard is None:
                continue
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"{hf_dir}: {name} has shape {tuple(shard.shape)} for this rank, the model expects {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))


class HFWriter:
    """Writes an HF checkpoint as sharded safetensors with an index, streaming: each shard is written when
    full. Everything goes to a temporary directory renamed into place by `close()`, so an interrupted
    export never leaves an output that looks complete."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 2 * 2**30):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists():
            raise ValueError(f"{out_dir} exists; refusing to overwrite an HF checkpoint (remove it or choose another path)")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.partial-", dir=self.out_dir.parent))
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0
        self.float_dtypes: set[torch.dtype] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.is_floating_point():
            self.float_dtypes.add(tensor.dtype)
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(self.tmp / name), metadata={"format": "pt"})
        self._shards.append((name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self, config: dict, tokenizer_from: Optional[str] = None) -> Path:
        """Writes the index, config.json (its `dtype` and `torch_dtype` those of the tensors written, whatever
        `config` says: transformers 5 loads in `dtype`, 4.x in `torch_dtype`) and the tokenizer files, and
        renames the directory into place."""
        if len(self.float_dtypes) > 1:
            raise ValueError(f"{self.out_dir}: tensors of several dtypes were written "
                             f"({sorted(map(str, self.float_dtypes))}); an HF config.json names one")
        if self.float_dtypes:
            name = _DTYPE_NAMES[next(iter(self.float_dtypes))]
            config = {**config, "dtype": name, "torch_dtype": name}
        if self._pending:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, (tmp_name, keys) in enumerate(self._shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.tmp / tmp_name, self.tmp / final)
            weight_map.update({k: final for k in keys})
        if n > 1:
            with open(self.tmp / "model.safetensors.index.json", "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        with open(self.tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        if tokenizer_from:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_from) / name
                if src.is_file():
                    shutil.copy2(src, self.tmp / name)
        os.rename(self.tmp, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
