"""How the ranks are split (tensor, pipeline, data, expert parallel) and checked against the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from grpo_mega.conf.rules import positive

if TYPE_CHECKING:
    from grpo_mega.conf.model import ModelConfig


@dataclass(kw_only=True)
class ParallelConfig:
    """How the actor and reference are placed: tp x pp x dp = world size, dp derived."""

    tp: int = 1
    """Tensor-parallel size: must divide heads, query groups, ffn width and the padded vocabulary."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE models): the experts of each layer are split over ep ranks of the data-parallel
    group; must divide num_experts and dp."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers on the first stage (null: even split)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline: layers on the last stage (null: even split)."""
    recompute: str = "none"
    """Activation recompute: 'none', 'selective' (attention core) or 'full' (whole layers)."""

    def __post_init__(self):
        positive("parallel.tp", self.tp)
        positive("parallel.pp", self.pp)
        positive("parallel.ep", self.ep)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"parallel.recompute={self.recompute!r} must be 'none', 'selective' or 'full'")

    def layers_per_stage(self, num_layers: int) -> list[int]:
        """Layers on each pipeline stage, or ValueError naming the numbers that do not add up."""
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if self.pp == 1:
            if first is not None or last is not None:
                raise ValueError("parallel.num_layers_in_first/last_pipeline_stage need parallel.pp > 1")
            return [num_layers]
        rest, middle = num_layers - (first or 0) - (last or 0), self.pp - (first is not None) - (last is not None)
        for n, v in (("first", first), ("last", last)):
            if v is not None and v < 1:
                raise ValueError(f"parallel.num_layers_in_{n}_pipeline_stage={v} must be >= 1")
        if middle == 0:
            if rest != 0:
                raise ValueError(
                    f"pipeline stages hold {first} + {last} layers but the model has {num_layers}: "
                    f"with pp=2 the first and last stage counts must add up to num_layers"
                )
            return [first, last]
        if rest < middle or rest % middle:
            raise ValueError(
                f"model.num_layers={num_layers} does not split over parallel.pp={self.pp} stages"
                + (f" with first={first}, last={last}" if first or last else "")
                + f": {rest} layers remain for {middle} stages and must divide evenly"
            )
        per = rest // middle
        return ([first] if first is not None else []) + [per] * middle + ([last] if last is not None else [])

    def check(self, model: ModelConfig, world_size: Optional[int] = None) -> int:
        """Validate this layout against a model (and a world size); return dp."""
        for what, n in (("num_attention_heads", model.num_attention_heads), ("num_query_groups", model.num_query_groups),
                        ("ffn_hidden_size", model.ffn_hidden_size), ("padded vocabulary", model.padded_vocab_size)):
            if n % self.tp:
                raise ValueError(f"parallel.tp={self.tp} must divide {what}={n} (model {model.name})")
        self.layers_per_stage(model.num_layers)
        if self.ep > 1 and not model.is_moe:
            raise ValueError(f"parallel.ep={self.ep} needs an MoE model; model {model.name} is dense (no num_experts)")
        if model.is_moe and model.num_experts % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide num_experts={model.num_experts} (model {model.name})")
        if model.is_moe and model.moe_ffn_hidden_size % self.tp:
            raise ValueError(f"parallel.tp={self.tp} must divide moe_ffn_hidden_size={model.moe_ffn_hidden_size} "
                             f"(model {model.name})")
        if world_size is None:
            return 1
        if world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {self.tp} * {self.pp}; "
                f"launch a multiple of {self.tp * self.pp} ranks or change the layout"
            )
        dp = world_size // (self.tp * self.pp)
        if dp % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide the data-parallel size dp={dp} "
                             f"(world {world_size} / (tp {self.tp} * pp {self.pp})): experts are split over DP ranks")
        return dp
