"""The rollout engine interface: what the trainer asks of SGLang or of the embedded engine.

Owns the contract only. Samples are group-contiguous (the n samples of prompt g are rows [g*n, (g+1)*n)).
Logprobs are of softmax(logits / temperature) at each sampled token, the definition the trainer uses
(docs/design.md, "Tokens, masks and logprobs"), whatever top_p did to the sampling distribution. Weights
arrive as buckets of HF-named tensors flattened into one byte buffer each (grpo_mega.engines.weight_sync
builds them).
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from grpo_mega.registry import Registry


@dataclass
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple
    offset: int  # byte offset in the bucket
    nbytes: int


@dataclass
class Bucket:
    """HF-named tensors flattened into one uint8 buffer, in a fixed order. A bucket that never leaves its rank
    and goes to an engine that loads tensor by tensor (`RolloutEngine.loads_tensors`) is not flattened:
    `flat` is None and `parts` holds the tensors themselves (copying them into a buffer only to copy them out
    again would double the bytes moved)."""

    metas: list[TensorMeta]
    flat: Optional[torch.Tensor]  # uint8 [nbytes]
    checksums: Optional[dict[str, str]] = None  # the trainer's, when auditing
    parts: Optional[list[torch.Tensor]] = None  # the tensors, in metas' order, when flat is None

    def tensors(self):
        if self.flat is None:
            for m, t in zip(self.metas, self.parts):
                yield m.name, t
            return
        for m in self.metas:
            yield m.name, self.flat[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel()) if self.flat is not None else sum(m.nbytes for m in self.metas)


@dataclass
class Generation:
    """Samples for a list of prompts, group-contiguous: n per prompt."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" (a stop token ended it; it is included) or "length"
    weight_version: int
    extra: dict = field(default_factory=dict)
    model_mask: Optional[list[list[int]]] = None
    """Multi-turn rollouts (grpo_mega.rollout.multi_turn): per token of token_ids, 1 where the model sampled it
    (its stop tokens included), 0 for tool results and chat-template glue; logprobs are 0.0 at the 0s.
    None: every token is the model's."""
    trajectories: Optional[list[dict]] = None
    """Multi-turn rollouts: per sample {"turns": [...], "tool_rewards": {...}} (grpo_mega.rollout.agent_loop.
    Trajectory.turns: role, text, tool name, error flag, token span), what the reward reads; None: single-turn
    (or a rank's placeholder row)."""
    routed_experts: Optional[list] = None
    """Rollout routing replay (algo.routing_replay=rollout or measure): per sample, int16 [P + R - 1, M, k], the top-k
    experts the engine's router chose for each token it fed its model (the P prompt tokens, then the response's
    first R - 1: the last one is never fed) in each of the model's M MoE layers, position-aligned with the
    sequence; None: not recorded (a rank's placeholder rows are None too)."""


def tensor_checksum(t: torch.Tensor) -> str:
    """Bit-exact fingerprint of a tensor: sha256 of its bytes (dtype and shape included)."""
    data = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()[:32]


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """Per-sample generator seed from (seed, prompt index, sample index) (docs/design.md, "Seeds": callers
    fold the step into `seed`). Stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class RolloutEngine(abc.ABC):
    """What every rollout engine provides."""

    weight_version: int = 0
    loads_tensors: bool = False  # True: update_weights reads only Bucket.tensors(), never Bucket.flat

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 stop_token_ids: Iterable[int], seed: int, prompt_offset: int = 0) -> Generation:
        """n samples for each prompt (token ids in, token ids out). Sample j of prompts[i] is drawn with
        sample_seed(seed, prompt_offset + i, j): a batch split over several engines samples exactly what one
        engine would."""

    @abc.abstractmethod
    def update_weights(self, version: int, buckets: Iterable[Bucket]) -> None:
        """Load HF-named tensors; after the last bucket the engine generates with them as `version`."""

    @abc.abstractmethod
    def weight_checksums(self, shapes: Optional[dict[str, tuple]] = None) -> dict[str, str]:
        """tensor_checksum of the parameters the engine generates with, by HF name: all of them, or those
        named in `shapes` (HF name -> shape) for engines that cannot list their own."""

    def health(self) -> dict:
        return {"ok": True, "weight_version": self.weight_version}

    def shutdown(self) -> None:
        pass


@dataclass
class EngineSpec:
    """What a colocated engine is built from (`ENGINES.get(rollout.engine).for_run(spec)`): the model, its
    weights' source and where it runs."""

    model: object
    """The run's ModelConfig (the architecture; weights arrive with the first sync when hf_dir is None)."""
    hf_dir: Optional[str] = None
    """An HF checkpoint to start from."""
    seed: int = 0
    device: str = "cpu"
    tp: int = 1
    """The engine's own tensor-parallel size (rollout.engine_tp)."""
    dtype: str = "float32"
    mem_fraction: Optional[float] = None
    """SGLang's mem_fraction_static (rollout.gpu_memory_fraction); None: its default."""
    workdir: str = ""
    """Where an engine that needs an HF directory on disk may write one."""
    timeout_s: float = 900.0
    """The longest one call into the engine may take (rollout.engine_timeout_s)."""
    decode: str = "auto"
    """The embedded engine's decode (rollout.embedded_decode)."""
    record_routing: bool = False
    """Return each token's routed experts (Generation.routed_experts; algo.routing_replay=rollout or measure)."""


ENGINES: Registry[type] = Registry("rollout engine")
"""Engine classes by rollout.engine name; each has `for_run(spec: EngineSpec)`."""
