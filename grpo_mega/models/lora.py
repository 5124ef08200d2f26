"""LoRA adapters on megatron-core's tensor-parallel linears (Hu et al., 2021): y = W x + (alpha / r) B A x.

Owns: freezing the base model, putting an adapter (A [r, in], B [out, r]) on each targeted linear of this rank's
stage, sharded so that every TP size computes the same function and the same gradients, and switching the
adapters off (`adapters_disabled`: the base model, which is the KL reference under LoRA). The optimizer, DDP and
the schedule are megatron's: they see the adapters as the only trainable parameters.

Sharding (docs/design.md points here):
- column-parallel base (qkv, fc1: output rows sharded over TP): A [r, in] replicated, B [out/tp, r] sharded like
  the base weight's rows (the fused q/k/v and gate/up layouts are the base's: B's rows follow them shard by shard,
  so W + s B A per shard is exact). h = A x is computed from the full input (all-gathered under sequence
  parallelism, its backward keeping this rank's share) and passed through megatron's copy-to-TP region, whose
  backward all-reduces dh over TP: A's gradient is then whole on every rank (no extra reduction) and the input's
  low-rank gradient dh A whole too.
- row-parallel base (proj, fc2: input columns sharded): A [r, in/tp] sharded like the base's columns, B [out, r]
  replicated. The partial A x is all-reduced over TP (reduce-scattered over the sequence under sequence
  parallelism, like the base output); under sequence parallelism B's gradient is a partial sum over this rank's
  tokens, tagged `sequence_parallel` so that megatron's finalize_model_grads all-reduces it over TP.
- an MoE layer's experts (SequentialMLP's local_experts.<j>: expert_fc1 column-, expert_fc2 row-parallel over
  expert TP, sharded as above; the token dispatcher communicates, see `_expert_forward`) and its router (the
  gate's logits get s B A x; A and B replicated): each adapter takes its base weight's `allreduce` (False for an
  expert under EP: reduced over expert DP) and, for the router, `sequence_parallel` tags.
A's full tensor is drawn on the CPU from `lora.seed`, the layer's global index and, for an expert, its global index,
whatever the layout, each rank keeping its shard; B starts at 0 (step 0 is the base model).

The adapters are left out of the module's state_dict (base checkpoints, weight sync and HF conversion see the base
model alone); `adapter_state` reads them. Asked for with `ADAPTERS_METADATA`, they are in its sharded_state_dict
(megatron's distributed checkpoint), sharded as above (fc1's B of a gated MLP as megatron shards the fused gate/up
weight), so that a training checkpoint can hold the adapters alone (`ADAPTER_KEYS`) and reload them at any TP/PP
layout; without it a LoRA model's sharded_state_dict is its base model's (a base checkpoint loads into it).
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.nn.functional as F

from grpo_mega.conf.lora import LORA_TARGETS, LoraConfig

# lora.target_modules name -> the module path's ending in megatron-core's GPT layer (the dense MLP's fc1/fc2; an
# MoE layer's router; its experts, SequentialMLP's local_experts.<j>, are matched by _EXPERT)
_SUFFIX = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj", "fc1": "mlp.linear_fc1",
           "fc2": "mlp.linear_fc2", "router": "mlp.router"}
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])$")
_SEED_SLOTS = 4
"""A's seed: one slot per (layer, dense target) as before expert and router adapters existed (their seeds sit
above every dense one), so a dense model's adapters start where they always did."""


def _target_of(path: str) -> str | None:
    m = _EXPERT.search(path)
    if m:
        return f"expert_fc{m.group(2)}"
    return next((t for t, suffix in _SUFFIX.items() if path.endswith(suffix)), None)


def targets(gpt: torch.nn.Module, lora: LoraConfig) -> list[tuple[str, str, torch.nn.Module]]:
    """(module path, target name, module) of every module of `gpt` that `lora.target_modules` names."""
    return [(name, t, module) for name, module in gpt.named_modules()
            if (t := _target_of(name)) is not None and t in lora.target_modules]


def apply_lora(gpt: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Freeze every base parameter of `gpt` (this rank's stage) and add the adapters; returns the adapted paths.
    Must run before DDP and the optimizer are built (they take the parameters that require grad)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.router import Router

    gpt.requires_grad_(False)
    found = targets(gpt, lora)
    names = {t for _, t, _ in found}
    missing = [t for t in lora.target_modules if t not in names]
    if missing and len(gpt.decoder.layers):
        raise ValueError(f"lora.target_modules: {missing} not in this model (its layers have "
                         f"{sorted(names) or 'none of them'}); choose from {', '.join(LORA_TARGETS)}")
    for name, target, module in found:
        parts = name.split(".")
        layer = int(gpt.decoder.layers[int(parts[parts.index("layers") + 1])].layer_number)  # global, 1-based
        expert = _global_expert(gpt, name) if target.startswith("expert_") else None
        if isinstance(module, Router):
            _add(module, name, target, lora, layer, split=None)
        elif isinstance(module, ColumnParallelLinear):
            _add(module, name, target, lora, layer, split="B", expert=expert)
        elif isinstance(module, RowParallelLinear):
            _add(module, name, target, lora, layer, split="A", expert=expert)
        else:
            raise ValueError(f"lora: {name} is a {type(module).__name__}, not megatron-core's Column/RowParallelLinear "
                             "(Transformer Engine's fused layers are not adapted): build the model with "
                             "builder.build_gpt(..., lora=lora), which picks megatron-core's local layer spec")
    return [n for n, _, _ in found]


def _global_expert(gpt: torch.nn.Module, path: str) -> int:
    """The global index of the expert whose linear is at `path`: EP rank r's local expert j is r * (E / ep) + j."""
    experts = gpt.get_submodule(path[: path.index(".local_experts.")])
    local = int(_EXPERT.search(path).group(1))
    ep_rank = experts.ep_group.rank() if torch.distributed.is_initialized() else 0
    return ep_rank * experts.num_local_experts + local


def _seed(lora: LoraConfig, layer: int, target: str, expert: int | None) -> int:
    base = lora.seed * 1_000_003
    if target in ("qkv", "proj", "fc1", "fc2"):
        return base + layer * _SEED_SLOTS + LORA_TARGETS.index(target)
    if target == "router":
        return base + 700_001 + layer
    return base + 900_001 + (layer * 4096 + expert) * 2 + int(target == "expert_fc2")


def _add(module, name: str, target: str, lora: LoraConfig, layer_number: int, split: str | None,
         expert: int | None = None) -> None:
    """Put A [r, in] and B [out, r] on `module`; `split` names the one sharded over TP like the base weight ('B': a
    column-parallel base's rows, 'A': a row-parallel base's columns, None: the router, replicated)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    weight = module.weight
    tp, rank = _tp(module)
    if split is None:
        d_out, d_in = weight.shape
    else:
        d_in, d_out = module.input_size, module.output_size
    if lora.rank > min(d_in, d_out):
        raise ValueError(f"lora.rank={lora.rank} is larger than {name}'s smaller dimension {min(d_in, d_out)} "
                         f"({d_out} x {d_in}); choose lora.rank <= {min(d_in, d_out)}")
    # one seed per (global layer, target, global expert): the same A on every pipeline, TP and EP layout
    g = torch.Generator().manual_seed(_seed(lora, layer_number, target, expert))
    a = torch.empty(lora.rank, d_in, dtype=torch.float32)
    if lora.init == "kaiming":  # PEFT's: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
        bound = 1.0 / math.sqrt(d_in)
        a.uniform_(-bound, bound, generator=g)
    else:
        a.normal_(0.0, 1.0 / lora.rank, generator=g)
    dtype, device = weight.dtype, weight.device
    b = torch.zeros(d_out // tp if split == "B" else d_out, lora.rank)
    if split == "A":
        a = a[:, rank * (d_in // tp):(rank + 1) * (d_in // tp)]
    module.lora_A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
    module.lora_B = torch.nn.Parameter(b.to(device=device, dtype=dtype))
    if split == "B":
        set_tensor_model_parallel_attributes(module.lora_B, True, 0, 1)
    elif split == "A":
        set_tensor_model_parallel_attributes(module.lora_A, True, 1, 1)
        # an expert's B is reduced over expert TP inside its forward (_expert_forward), not by megatron's SP rule
        setattr(module.lora_B, "sequence_parallel", module.sequence_parallel and expert is None)
    else:  # the router: each TP rank routes its own tokens under sequence parallelism, as its weight says
        for p in (module.lora_A, module.lora_B):
            setattr(p, "sequence_parallel", getattr(weight, "sequence_parallel", False))
    for p in (module.lora_A, module.lora_B):  # an expert's: reduced over expert DP, as megatron's DDP reads it
        setattr(p, "allreduce", getattr(weight, "allreduce", True))
    module._lora_scale, module._lora_on, module._lora_split, module._lora_target = lora.scale, True, split, target
    if split is None:
        module._lora_base_gating = module.gating
        module.gating = _router_gating(module)
    else:
        module._lora_base_forward = module.forward
        if expert is not None:
            module.forward = _expert_forward(module)
        else:
            module.forward = _column_forward(module) if split == "B" else _row_forward(module)
    module.sharded_state_dict = _sharded_state_dict(module)
    module._register_state_dict_hook(_drop_adapters)
    module.register_load_state_dict_post_hook(_ignore_missing_adapters)


def _router_gating(m):
    def gating(input_):
        logits = m._lora_base_gating(input_)  # [tokens, E], in the router's dtype (fp32 with moe_router_dtype)
        if not m._lora_on:
            return logits
        x = input_.to(logits.dtype)
        return logits + m._lora_scale * F.linear(F.linear(x, m.lora_A.to(logits.dtype)), m.lora_B.to(logits.dtype))

    return gating


def _expert_forward(m):
    """An expert's linear: megatron's token dispatcher owns the communication (explicit_expert_comm), gathering the
    tokens over expert TP before the experts and summing the partial outputs (row) and the partial input gradients
    (column) after. The adapter follows the base: column (fc1): out_shard += s B_shard (A x), whose input gradient
    A^T dh is partial per shard like the base's, while A's own gradient needs every shard's dh: A passes through
    megatron's copy-to-TP region (identity forward, all-reduce of its gradient over expert TP). Row (fc2):
    out_partial += s B (A_shard x_shard), summed by the dispatcher; B's gradient, partial per shard, is all-reduced
    over expert TP the same way. At expert TP 1 both regions are the identity."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    def forward(input_, *args, **kwargs):
        out, bias = m._lora_base_forward(input_, *args, **kwargs)
        if not m._lora_on:
            return out, bias
        a, b = m.lora_A, m.lora_B
        if m._lora_split == "B":
            a = copy_to_tensor_model_parallel_region(a, group=m.tp_group)
        else:
            b = copy_to_tensor_model_parallel_region(b, group=m.tp_group)
        return out + m._lora_scale * F.linear(F.linear(input_, a), b), bias

    return forward


def _column_forward(m):
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    def forward(input_, *args, **kwargs):
        out, bias = m._lora_base_forward(input_, *args, **kwargs)
        if not m._lora_on:
            return out, bias
        x = input_  # [s, b, in] ([s/tp, b, in] under sequence parallelism)
        if m.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=m.tp_group)
        h = copy_to_tensor_model_parallel_region(F.linear(x, m.lora_A), group=m.tp_group)  # [s, b, r]
        return out + m._lora_scale * F.linear(h, m.lora_B), bias  # [s, b, out/tp]

    return forward


def _row_forward(m):
    from megatron.core.tensor_parallel import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    def forward(input_, *args, **kwargs):
        out, bias = m._lora_base_forward(input_, *args, **kwargs)
        if not m._lora_on:
            return out, bias
        partial = F.linear(input_, m.lora_A)  # [s, b, r]: this rank's in/tp columns
        if m.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(partial, group=m.tp_group)  # [s/tp, b, r]
        else:
            h = reduce_from_tensor_model_parallel_region(partial, group=m.tp_group)
        return out + m._lora_scale * F.linear(h, m.lora_B), bias

    return forward


ADAPTER_KEYS = ("lora_A", "lora_B")
"""The endings of the adapters' keys in a (sharded) state dict."""
ADAPTERS_METADATA = "grpo_mega_lora_adapters"
"""sharded_state_dict(metadata={ADAPTERS_METADATA: True}): the adapters too."""


def _sharded_state_dict(m):
    """The base linear's sharded_state_dict plus the adapters, TP-sharded as they are (column base: B on its rows,
    with megatron's gate/up split for a gated fc1; row base: A on its columns; the other one replicated)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    base = m.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        # (a module on MegatronModule's default, the router, reads every parameter: its adapters are dropped here)
        out = {k: v for k, v in base(prefix, sharded_offsets, metadata).items() if not k.endswith(ADAPTER_KEYS)}
        if not (metadata or {}).get(ADAPTERS_METADATA):
            return out
        adapters = make_sharded_tensors_for_checkpoint(
            {"lora_A": m.lora_A, "lora_B": m.lora_B}, prefix,
            {f"lora_{m._lora_split}": 0 if m._lora_split == "B" else 1} if m._lora_split else {},
            sharded_offsets, tp_group=m.tp_group, dp_cp_group=(metadata or {})["dp_cp_group"])
        if _gated(m):
            adapters[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(
                adapters[f"{prefix}lora_B"], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        out.update(adapters)
        return out

    return sharded_state_dict


def _drop_adapters(module, state_dict, prefix, local_metadata):
    for k in ("lora_A", "lora_B"):
        state_dict.pop(prefix + k, None)
    return state_dict


def _ignore_missing_adapters(module, incompatible):
    for key in [k for k in incompatible.missing_keys if k.endswith(("lora_A", "lora_B"))]:
        incompatible.missing_keys.remove(key)


def adapted(gpt: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every adapted linear of `gpt` (empty without LoRA)."""
    return [(n, m) for n, m in gpt.named_modules() if hasattr(m, "_lora_on")]


@contextlib.contextmanager
def adapters_disabled(gpt: torch.nn.Module):
    """Inside: `gpt` computes its base model (every adapter's term left out); nothing to do without adapters."""
    mods = [m for _, m in adapted(gpt)]
    saved = [m._lora_on for m in mods]
    for m in mods:
        m._lora_on = False
    try:
        yield gpt
    finally:
        for m, s in zip(mods, saved):
            m._lora_on = s


def adapter_params(gpt: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This rank's adapter parameters by name (`<module path>.lora_A` / `.lora_B`)."""
    return {f"{n}.{k}": getattr(m, k) for n, m in adapted(gpt) for k in ("lora_A", "lora_B")}


def _gated(module) -> bool:
    """A fused gate/up linear (fc1 of a gated MLP): each TP shard holds [gate/tp; up/tp] rows."""
    return module._lora_target in ("fc1", "expert_fc1") and bool(getattr(module.config, "gated_linear_unit", False))


def _tp(module) -> tuple[int, int]:
    if not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(module.tp_group), torch.distributed.get_rank(module.tp_group)


def _shard(module, key: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an adapter's full (TP1-layout) tensor."""
    tp, rank = _tp(module)
    if module._lora_split == "B" and key == "lora_B":
        if _gated(module):
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
        return full.chunk(tp, dim=0)[rank]
    if module._lora_split == "A" and key == "lora_A":
        return full.chunk(tp, dim=1)[rank]
    return full


def _unshard(module, key: str, local: torch.Tensor) -> torch.Tensor:
    """The full (TP1-layout) tensor from every TP rank's shard `local` (collective over TP when sharded)."""
    tp, _ = _tp(module)
    sharded = key == f"lora_{module._lora_split}"
    if tp == 1 or not sharded:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=module.tp_group)
    if key == "lora_A":
        return torch.cat(parts, dim=1)
    if _gated(module):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=0)


def adapter_state(gpt: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Collective over TP: every adapter of this stage as its full TP1-layout tensor (name -> tensor), on every TP
    rank; with `grads`, their gradients instead (megatron's `main_grad`, else `.grad`)."""
    out = {}
    for name, m in adapted(gpt):
        for key in ("lora_A", "lora_B"):
            p = getattr(m, key)
            t = (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad) if grads else p
            out[f"{name}.{key}"] = _unshard(m, key, t.detach())
    return out


def load_adapter_state(gpt: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set this stage's adapters from full TP1-layout tensors (`adapter_state`'s), each rank keeping its shard."""
    for name, m in adapted(gpt):
        for key in ("lora_A", "lora_B"):
            p = getattr(m, key)
            with torch.no_grad():
                p.copy_(_shard(m, key, state[f"{name}.{key}"]).to(p.dtype))


def merged_weight(gpt: torch.nn.Module, key: str, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (this rank's shard of state_dict key `key` of `gpt`) merged with its adapter, W + (alpha / r) B A,
    computed in fp32 and cast back; `weight` itself when the key has no adapter. Shard by shard this is exact in
    layout: a column-parallel B's rows and a row-parallel A's columns are sharded as the weight's are."""
    if not key.endswith(".weight"):
        return weight
    module = gpt.get_submodule(key[: -len(".weight")]) if "." in key else gpt
    if not hasattr(module, "_lora_on"):
        return weight
    delta = module.lora_B.detach().float() @ module.lora_A.detach().float()
    return (weight.float() + module._lora_scale * delta).to(weight.dtype)
