"""Build the actor and reference GPTModel for this rank from a ModelConfig and a ParallelConfig.

Owns: the one adapter from our configs to megatron's TransformerConfig (never megatron's argparse), the
layer-spec choice (Transformer Engine spec and FP8 where transformer_engine and CUDA exist, megatron-core's
local spec elsewhere and under LoRA), this rank's pipeline stage, Megatron DDP around the actor, and freezing the
reference. Parallelism is applied to the model here, not written into it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from dataclasses import dataclass

import torch

from grpo_mega.conf.lora import LoraConfig
from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.conf.optim import PrecisionConfig
from grpo_mega.parallel import cpu_compat

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

LAYER_SPECS = ("transformer_engine", "local")
"""The layer specs build_gpt chooses from (spec_choice)."""

_said_lora_local = False


def have_transformer_engine() -> bool:
    """TE's layer spec needs both the package and a GPU (TE cannot even import without one)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def spec_choice(lora: "LoraConfig | None" = None) -> str:
    """The layer spec build_gpt uses: 'transformer_engine' where transformer_engine and CUDA exist, else 'local'
    (megatron-core's local layers). LoRA adapts megatron-core's Column/RowParallelLinear, not TE's fused layers,
    so with lora.rank set it is 'local' even where TE exists (said once, in one log line on rank 0)."""
    global _said_lora_local
    if not have_transformer_engine():
        return "local"
    if lora is None or not lora.enabled:
        return "transformer_engine"
    if not _said_lora_local:
        _said_lora_local = True
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            log.info("lora.rank=%s: megatron-core's local layer spec (LoRA adapts its linears, not Transformer "
                     "Engine's fused ones), although Transformer Engine is installed", lora.rank)
    return "local"


def uses_transformer_engine(gpt: torch.nn.Module) -> bool:
    """Whether build_gpt built this GPTModel on Transformer Engine's layer spec."""
    spec = getattr(gpt, "grpo_mega_layer_spec", None)
    return (spec or spec_choice()) == "transformer_engine"


def check_fp8(precision: PrecisionConfig) -> None:
    """FP8 runs only through Transformer Engine on a GPU: say so, with the fix, before building anything."""
    if precision.fp8 is None:
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"precision.fp8={precision.fp8!r} needs a CUDA GPU with Transformer Engine; this machine has no GPU. "
            f"Set precision.fp8=null to train in {precision.params_dtype}."
        )
    if importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(
            f"precision.fp8={precision.fp8!r} needs Transformer Engine: pip install -e '.[gpu]' "
            "(transformer-engine[pytorch]), or set precision.fp8=null"
        )


def transformer_config(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, spec: "str | None" = None):
    """The single adapter from (model, parallel, precision) to megatron's TransformerConfig, for layer spec `spec`
    (spec_choice()'s by default): the fused kernels are Transformer Engine's spec's."""
    from megatron.core.transformer import TransformerConfig

    parallel.check(model)
    check_fp8(precision)
    spec = spec or spec_choice()
    if spec not in LAYER_SPECS:
        raise ValueError(f"layer spec {spec!r} must be one of {LAYER_SPECS}")
    if precision.fp8 is not None and spec != "transformer_engine":
        raise ValueError(f"precision.fp8={precision.fp8!r} runs only on Transformer Engine's layer spec, and this "
                         "model is built on megatron-core's local one (lora.rank is set): set precision.fp8=null")
    dtype = _DTYPES[precision.params_dtype]
    recompute = {}
    if parallel.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    elif parallel.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    fp8 = {}
    if precision.fp8 is not None:
        fp8 = dict(fp8=precision.fp8, fp8_recipe=precision.fp8_recipe)
    te = spec == "transformer_engine"
    return TransformerConfig(
        **moe_config(model, parallel, te),
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        layernorm_epsilon=model.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        sequence_parallel=parallel.sequence_parallel,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        autocast_dtype=dtype,
        # Initialise full weights on the CPU from one seed and split them: layouts start identical.
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        # The fused kernels are CUDA-only; on CPU their unfused equivalents run.
        bias_activation_fusion=te,
        bias_dropout_fusion=te,
        masked_softmax_fusion=te,
        persist_layer_norm=te,
        gradient_accumulation_fusion=te,
        apply_rope_fusion=te,
        **recompute,
        **fp8,
    )


def moe_config(model: ModelConfig, parallel: ParallelConfig, te: bool) -> dict:
    """TransformerConfig fields for megatron-core's MoE layer (empty for a dense model).

    Qwen3-MoE routing (transformers' Qwen3MoeTopKRouter): softmax over all experts, top-k, then, with
    norm_topk_prob, renormalise the k probabilities. Megatron's softmax router does exactly the latter with
    `moe_router_pre_softmax=False` (top-k of the logits, softmax over those k) and the former with
    `pre_softmax=True` (softmax over all, keep the top k). No router bias, no shared expert, no token dropping.
    The token dispatcher is cpu_compat.moe_token_dispatcher()'s."""
    if not model.is_moe:
        return {}
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_layer_freq=[int(m) for m in model.moe_layers()],
        moe_router_pre_softmax=not model.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff,
        moe_token_dispatcher_type=cpu_compat.moe_token_dispatcher(),
        moe_grouped_gemm=te,
        expert_model_parallel_size=parallel.ep,
    )


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for the local spec, usable under sequence parallelism.

    megatron's WrappedTorchNorm refuses sequence_parallel ("not supported by torch LayerNorm") because it
    does not tag its weight; tagged `sequence_parallel`, the weight's gradient (a partial sum over this
    rank's sequence shard) is all-reduced over TP by finalize_model_grads, as for TE's and Apex's norms.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


def layer_spec(config, spec: "str | None" = None):
    """The decoder block spec for this rank's stage: Transformer Engine layers for spec='transformer_engine',
    megatron-core's local layers (with LocalRMSNorm) for 'local'; spec_choice()'s by default."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if (spec or spec_choice()) == "transformer_engine":
        if config.num_moe_experts:
            return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    dense = _local_layer(config, None)
    if not config.num_moe_experts:
        return TransformerBlockSubmodules(layer_specs=[dense] * get_num_layers_to_build(config), layer_norm=LocalRMSNorm)
    # MoE: SequentialMLP experts (one local MLP per expert) on the layers moe_layer_freq marks, this stage's slice.
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    moe = _local_layer(config, config.num_moe_experts)
    offset = get_transformer_layer_offset(config)
    pattern = config.moe_layer_freq[offset : offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=[moe if m else dense for m in pattern], layer_norm=LocalRMSNorm)


def _local_layer(config, num_experts):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from grpo_mega.models.local_attention import SDPACoreAttention

    layer = specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                           qk_layernorm=config.qk_layernorm)
    layer.submodules.input_layernorm = LocalRMSNorm
    layer.submodules.pre_mlp_layernorm = LocalRMSNorm
    # SDPA, and packed rows attended per sequence (megatron's DotProductAttention needs a dense S x S mask)
    layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if config.qk_layernorm:
        # Per-head norms over kv_channels, after linear_qkv. Their weight gradient is a partial sum over this
        # rank's heads; finalize_model_grads all-reduces it over TP by name (q_layernorm/k_layernorm).
        attn = layer.submodules.self_attention.submodules
        attn.q_layernorm = attn.k_layernorm = LocalRMSNorm
    return layer


@dataclass
class Built:
    """One rank's stage of a model: the module handed to Megatron's schedule, and the config."""

    module: torch.nn.Module  # DDP-wrapped for the actor; the bare GPTModel for the reference
    gpt: torch.nn.Module  # the GPTModel itself
    config: object


@contextlib.contextmanager
def _meta_device():
    """Build parameters on the meta device: megatron allocates them at `torch.cuda.current_device()`."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("meta")
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.cuda.current_device = saved


def build_gpt(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, init: bool = True,
              meta: bool = False, lora: "LoraConfig | None" = None):
    """This rank's pipeline stage of a GPTModel (no DDP), on spec_choice(lora)'s layer spec.

    init=False skips the random initialisation (the weights are about to be loaded); meta=True builds
    shapes only, no memory (for the layout description that dist_checkpointing needs)."""
    from megatron.core import parallel_state as ps

    rope = model.rope_scaling
    if rope is not None and (rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) != (1.0, 4.0, 8192):
        raise ValueError(
            f"model.rope_scaling={rope}: megatron-core applies llama3 scaling with low_freq_factor=1, "
            "high_freq_factor=4, original_max_position_embeddings=8192 only"
        )
    spec = spec_choice(lora)
    config = transformer_config(model, parallel, precision, spec)
    if model.is_moe:
        cpu_compat.define_te_general_gemm()  # GPUs without Transformer Engine too
    if not init or meta:
        config.perform_initialization = False
        config.use_cpu_initialization = False
    with _meta_device() if meta else contextlib.nullcontext():
        gpt = _gpt_model(config, model, rope, ps, spec)
    gpt.grpo_mega_layer_spec = spec
    if not config.perform_initialization:
        _restore_tp_attributes(gpt)
    if meta:
        return gpt.to(dtype=config.params_dtype), config
    if not torch.cuda.is_available():
        gpt = gpt.to(dtype=config.params_dtype)
    else:
        gpt = gpt.cuda()
    return gpt, config


def _restore_tp_attributes(gpt) -> None:
    """megatron-core 0.16.1 tags a layer's weight as tensor-parallel (`tensor_model_parallel`,
    `partition_dim`) only inside its random initialisation; with perform_initialization=False the weights of
    column/row-parallel layers and the vocab-parallel embedding come out untagged, and the grad-norm and
    weight-sync code would treat TP shards as replicated copies. Tag them as initialisation would have."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in gpt.modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)


def _gpt_model(config, model: ModelConfig, rope, ps, spec: str):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, spec),
        vocab_size=model.padded_vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        rope_scaling=rope is not None,
        rope_scaling_factor=rope.factor if rope is not None else 8.0,
    )


def build_actor(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, use_distributed_optimizer: bool = True,
                lora: "LoraConfig | None" = None) -> Built:
    """The trainable policy: this rank's stage wrapped in Megatron DDP (contiguous grad buffers, fp32 grads).
    With `lora` enabled the base weights are frozen and only the adapters (grpo_mega.models.lora) train."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    gpt, config = build_gpt(model, parallel, precision, lora=lora)
    if lora is not None and lora.enabled:
        from grpo_mega.models.lora import apply_lora

        apply_lora(gpt, lora)
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=use_distributed_optimizer, grad_reduce_in_fp32=True, overlap_grad_reduce=False
        ),
        module=gpt,
    )
    # Called by the schedule after the last backward: DP reduction of the grad buffers, the embedding grad
    # sync between first and last stage (tied embeddings), layernorm grads under sequence parallelism.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return Built(module=ddp, gpt=gpt, config=config)


def build_reference(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig) -> Built:
    """The frozen reference: same placement as the actor, no grads, never given to an optimizer."""
    gpt, config = build_gpt(model, parallel, precision)
    gpt.requires_grad_(False)
    gpt.eval()
    return Built(module=gpt, gpt=gpt, config=config)


def move_module(module: torch.nn.Module, device: str) -> None:
    """Move a (frozen) module's parameters and buffers to `device` between uses (reference CPU offload)."""
    module.to(device)


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy the actor's weights into the reference (iterative RL); same layout on both, so shard by shard."""
    src_state = src.state_dict()
    with torch.no_grad():
        for name, t in dst.state_dict().items():
            if name in src_state and torch.is_tensor(t) and not name.endswith("_extra_state"):
                t.copy_(src_state[name])
