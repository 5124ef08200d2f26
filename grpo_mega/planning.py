"""Memory per GPU of a training layout, before anything is allocated: the arithmetic behind grpo-mega-plan.

Owns: the exact parameter count of every pipeline stage's shard (the same modules builder.build_gpt makes),
the bytes of the actor's weights, fp32 main weights, fp32 gradient buffer and Adam state under Megatron DDP
and the DistributedOptimizer (its padded buffers included), for MoE models the router and this rank's experts
(split over EP and expert TP, their optimizer state over expert DP) and the token dispatcher's buffers, the
activations held by the 1F1B schedule, the logits and vocab-parallel loss
buffers of the last stage, the frozen reference and the share left to a colocated rollout engine, under LoRA the
frozen base and the adapters' own buffers, gradients, optimizer state and activations (no reference); whether
their sum fits a GPU, which component does not, and layouts of the same GPUs that do. `meta_stage_params`
checks the parameter arithmetic against the model built on the meta device, one rank at a time under a fake
process group. Everything else here is pure arithmetic on the model config: no torch, no process groups.

Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(arXiv 2205.05198), Table 2: per layer sbh(34 + 5as/h) bytes for GPT-3's block with 16-bit activations,
sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh/t (34 + 5as/h) with sequence parallelism, sbh 34/t
with selective recompute and 2sbh (/t with SP) with full recompute. `layer_activation_bytes` keeps the
paper's per-tensor accounting and puts in this project's block instead of GPT-3's: RMSNorm, GQA (K and V
are g*d wide, not h), SwiGLU (the fc1 output is 2f wide and kept for the gate), no dropout (no masks),
and flash attention on the GPU (TE's fused attention keeps no [a, s, s] scores, as selective recompute).

Long on purpose: one formula sheet, every byte count beside the others it is summed with (and the meta-device
check of the parameter arithmetic at its end); split, a term and its sum would sit in different files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.parallel import ParallelConfig

GIB = 2**30
H100_GIB = 81559 / 1024
"""An H100 80GB as nvidia-smi reports it: 81,559 MiB."""
RECOMPUTE = ("none", "selective", "full")
REFERENCE = ("gpu", "offload", "none")
FP32_LOSS_COPIES = 3
"""fp32 [tokens, V/tp] temporaries of the vocab-parallel logprob/entropy op (bench_results/vocab_parallel.json:
about 3.5 with the reference's logits as well, so 3 without them)."""
FUSED_CHUNK_BYTES = 256 * 2**20
"""grpo_mega.parallel.fused_output.CHUNK_BYTES (kept here without importing torch; a test holds them equal)."""
FUSED_TOKEN_BYTES = 64
"""Per token, the fused op's fp32 per-token vectors besides the hidden-state gradient (its [7, T] shard statistics,
[2, T] maxima and [5, T] sums, the saved [T] global statistics, the outputs and their upstream gradients):
measured 43-48 bytes on the CPU (tests/test_plan.py)."""


# ---- parameters ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageParams:
    """Parameters of one tensor-parallel rank of one pipeline stage (all TP ranks of a stage are equal)."""

    stage: int
    layers: int
    embedding: int
    """VocabParallelEmbedding shard: padded_vocab / tp x hidden (first stage)."""
    transformer: int
    """`layers` transformer layers' shards, norms replicated."""
    final_norm: int
    output_layer: int
    """Untied output layer shard (last stage); also on a tied model's last stage when pp > 1."""
    linear: int
    """Of all the above, the transformer layers' linear weights: the GEMMs TE runs in FP8 (megatron's output
    layer stays in bf16)."""
    expert: int = 0
    """Of `transformer`, this rank's experts (E / ep per MoE layer, each split over expert TP): their
    gradients are reduced, and the DistributedOptimizer shards them, over the expert-data-parallel group."""

    @property
    def total(self) -> int:
        return self.embedding + self.transformer + self.final_norm + self.output_layer


def moe_mlp_params(model: ModelConfig, etp: int, ep: int) -> tuple[int, int]:
    """(router, this rank's experts) of one MoE layer: the router [E, h] replicated over TP (no bias in Qwen3-MoE)
    and E / ep experts, each a SwiGLU MLP of moe_ffn_hidden_size split over the expert-TP group (megatron's
    default etp = tp): fc1 [2 f_e / etp, h], fc2 [h, f_e / etp]. No shared expert."""
    h, fe = model.hidden_size, model.moe_ffn_hidden_size
    return model.num_experts * h, model.num_experts // ep * 3 * (fe // etp) * h


def layer_params(model: ModelConfig, tp: int, moe: bool = False, ep: int = 1) -> tuple[int, int, int]:
    """(all parameters, linear weights, expert parameters) of one transformer layer's shard on one TP rank;
    `moe`: its MLP is the router and this EP rank's experts instead of a dense one."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
    qkv = (q + 2 * kv) // tp * h
    proj = h * (q // tp)
    fc1, fc2 = 2 * (f // tp) * h, h * (f // tp)
    bias = (q + 2 * kv) // tp if model.qkv_bias else 0
    norms = 2 * h  # input_layernorm and pre_mlp_layernorm: replicated over TP
    if model.qk_layernorm:
        norms += 2 * model.kv_channels  # Qwen3's per-head q/k norms, shared by all heads: replicated
    if moe:
        router, experts = moe_mlp_params(model, tp, ep)
        linear = qkv + proj + experts
        return linear + bias + norms + router, linear, experts
    linear = qkv + proj + fc1 + fc2
    return linear + bias + norms, linear, 0


def stage_params(model: ModelConfig, parallel: ParallelConfig) -> list[StageParams]:
    """Every pipeline stage's per-rank parameter counts, as megatron's GPTModel allocates them: the padded
    vocabulary (model.padded_vocab_size, the same at every tp) split over tp, the embedding on the first stage,
    the final norm and output layer on the last; with tied embeddings and pp > 1 the last stage keeps its own
    copy of the output weight (megatron synchronises the two)."""
    per_stage = parallel.layers_per_stage(model.num_layers)
    tp, pp = parallel.tp, parallel.pp
    kinds = {moe: layer_params(model, tp, moe, parallel.ep) for moe in ((False, True) if model.is_moe else (False,))}
    moe_layers = model.moe_layers()
    vocab_shard = model.padded_vocab_size // tp * model.hidden_size
    out, start = [], 0
    for stage, n in enumerate(per_stage):
        first, last = stage == 0, stage == pp - 1
        output = vocab_shard if last and (not model.tie_word_embeddings or pp > 1) else 0
        layers = [kinds[m] for m in moe_layers[start:start + n]]
        start += n
        out.append(StageParams(
            stage=stage, layers=n, embedding=vocab_shard if first else 0, transformer=sum(k[0] for k in layers),
            final_norm=model.hidden_size if last else 0, output_layer=output, linear=sum(k[1] for k in layers),
            expert=sum(k[2] for k in layers),
        ))
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _layer_sizes(model: ModelConfig, tp: int, moe: bool, ep: int) -> tuple[list[int], list[int]]:
    """(dense, expert) parameter numels of one layer's shard, one entry per megatron parameter."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.kv_channels
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    dense = [(q + 2 * kv) // tp * h, h * (q // tp), h, h]
    dense += [(q + 2 * kv) // tp] if model.qkv_bias else []
    dense += [d, d] if model.qk_layernorm else []
    if not moe:
        return dense + [2 * (f // tp) * h, h * (f // tp)], []
    fe = model.moe_ffn_hidden_size // tp
    return dense + [model.num_experts * h], [2 * fe * h, h * fe] * (model.num_experts // ep)


def grad_buffer_numel(model: ModelConfig, parallel: ParallelConfig, dp: int,
                      distributed_optimizer: bool = True) -> list[tuple[int, int]]:
    """Per pipeline stage: (dense, expert) elements of megatron DDP's parameter-and-gradient buffers on one
    rank, padding included (megatron-core 0.16.1 param_and_grad_buffer.py, one bucket per buffer as
    overlap_grad_reduce is off). With the DistributedOptimizer every parameter starts at a multiple of 64
    elements and a bucket ends at a multiple of lcm(its DP size, 128): the dense buffer's DP size is dp, the
    expert buffer's the expert-DP size dp / ep. A tied embedding shared by the first and last stage (pp > 1)
    is a bucket of its own. Without the DistributedOptimizer nothing is padded."""
    tp, ep = parallel.tp, parallel.ep
    kinds = {m: _layer_sizes(model, tp, m, ep) for m in ((False, True) if model.is_moe else (False,))}
    moe_layers, start, out = model.moe_layers(), 0, []
    vocab_shard = model.padded_vocab_size // tp * model.hidden_size
    for p in stage_params(model, parallel):
        dense, expert = [], []
        for m in moe_layers[start:start + p.layers]:
            dense += kinds[m][0]
            expert += kinds[m][1]
        start += p.layers
        dense += [n for n in (p.final_norm, ) if n]
        shared = model.tie_word_embeddings and parallel.pp > 1
        own = [n for n in (p.embedding, p.output_layer) if n]
        if not shared:
            dense, own = dense + own, []

        def buffer(sizes: list[int], group: int) -> int:
            return _buffer_numel(sizes, group, distributed_optimizer)

        dense_numel = buffer(dense, dp) + sum(buffer([n], dp) for n in own)
        out.append((dense_numel, buffer(expert, dp // ep)))
        assert sum(dense) + sum(own) + sum(expert) == p.total  # the same parameters as stage_params
    return out


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "expert_fc1", "expert_fc2", "router")
"""grpo_mega.conf.lora.LORA_TARGETS (a test holds them equal)."""


def lora_layer_sizes(model: ModelConfig, tp: int, rank: int, targets, moe: bool = False) -> list[int]:
    """Numels of one layer's LoRA adapters on one TP rank, A then B per targeted linear, as
    grpo_mega/models/lora.py shards them: a column-parallel base (qkv [q + 2k, h], fc1 [2f, h]) gets A [r, h]
    replicated and B [out / tp, r]; a row-parallel one (proj [h, q], fc2 [h, f]) A [r, in / tp] and B [h, r]
    replicated. An MoE layer has no fc1/fc2; its router's adapter (router [E, h]) is A [r, h] and B [E, r], both
    replicated; its experts' adapters are `lora_expert_layer_sizes`'."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
    dims = {"qkv": (h, q + 2 * kv, True), "proj": (q, h, False), "fc1": (h, 2 * f, True), "fc2": (f, h, False),
            "router": (h, model.num_experts or 0, None)}
    out = []
    for t in ("qkv", "proj", "fc1", "fc2", "router"):
        if t not in targets or (moe and t in ("fc1", "fc2")) or (not moe and t == "router"):
            continue
        d_in, d_out, column = dims[t]
        _check_rank(rank, t, d_in, d_out)
        if column is None:
            out += [rank * d_in, d_out * rank]
        else:
            out += [rank * d_in, d_out // tp * rank] if column else [rank * (d_in // tp), d_out * rank]
    return out


def lora_expert_layer_sizes(model: ModelConfig, rank: int, targets, ep: int, tp: int = 1) -> list[int]:
    """Numels of one MoE layer's expert adapters on one rank: for each of its num_experts / ep experts, A then B
    of expert_fc1 (A [r, h] replicated, B [2 f_moe / tp, r]) and expert_fc2 (A [r, f_moe / tp], B [h, r]
    replicated), sharded over expert TP (= tp) as the dense fc1/fc2 adapters are over TP."""
    h, f = model.hidden_size, model.moe_ffn_hidden_size
    one = []
    for t, (d_in, d_out, column) in (("expert_fc1", (h, 2 * f, True)), ("expert_fc2", (f, h, False))):
        if t in targets:
            _check_rank(rank, t, d_in, d_out)
            one += [rank * d_in, d_out // tp * rank] if column else [rank * (d_in // tp), d_out * rank]
    return one * (model.num_experts // ep)


def _check_rank(rank: int, target: str, d_in: int, d_out: int) -> None:
    if rank > min(d_in, d_out):
        raise ValueError(f"lora.rank={rank} is larger than {target}'s smaller dimension {min(d_in, d_out)} "
                         f"({d_out} x {d_in}); choose lora.rank <= {min(d_in, d_out)}")


def lora_stage_sizes(model: ModelConfig, parallel: ParallelConfig, rank: int, targets,
                     experts: bool = False) -> list[list[int]]:
    """Per pipeline stage: the numels of this rank's adapters (`lora_layer_sizes` over the stage's layers; with
    `experts`, `lora_expert_layer_sizes` over its MoE layers instead), the only parameters megatron's DDP and
    optimizer see under LoRA (the base is frozen)."""
    moe_layers, start, out = model.moe_layers(), 0, []
    for n in parallel.layers_per_stage(model.num_layers):
        layers = moe_layers[start:start + n]
        if experts:
            out.append([s for m in layers if m
                        for s in lora_expert_layer_sizes(model, rank, targets, parallel.ep, parallel.tp)])
        else:
            out.append([s for m in layers for s in lora_layer_sizes(model, parallel.tp, rank, targets, m)])
        start += n
    return out


def _buffer_numel(sizes: list[int], group: int, distributed_optimizer: bool) -> int:
    """Elements of one DDP buffer holding `sizes` (grad_buffer_numel's padding rule)."""
    if not distributed_optimizer:
        return sum(sizes)
    return _round_up(sum(_round_up(n, 64) for n in sizes), math.lcm(group, 128)) if sizes else 0


# ---- activations --------------------------------------------------------------------------------------


LAYER_SPECS = ("transformer_engine", "local")


def layer_activation_bytes(model: ModelConfig, seq: int, micro_batch: int, tp: int, sequence_parallel: bool,
                           recompute: str, flash_attention: bool = True, fp8: bool = False,
                           layer_spec: str = "transformer_engine", mlp: bool = True) -> float:
    """Bytes one transformer layer keeps for its backward, per micro-batch, on one TP rank (Korthikanti et al.
    Table 2, per tensor, for this project's block; 16-bit activations, FP8 GEMM inputs under fp8).

    Per token (h hidden, q = heads * head_dim, k = query_groups * head_dim, f = ffn width, a heads):
      kept whole on every TP rank unless sequence-parallel:
        2h + 2h   the two RMSNorms' inputs
        2h        the QKV projection's input (the norm's output; 1h as FP8)
        2h        the fc1 input (the second norm's output; 1h as FP8)
      split over TP:
        2q + 4k   Q, K and V, kept by the attention kernel
        2q + 2k   with qk_layernorm (Qwen3), the q/k norms' inputs (their outputs, RoPE'd, are the Q and K above)
        2q        the output projection's input (the attention output; 1q as FP8)
        4f + 2f   fc1's output (gate and up, kept by SwiGLU) and SwiGLU's output, fc2's input (1f as FP8)
        5as       softmax output, its dropout mask and output (the paper's 5as^2 b): only for unfused
                  attention without selective recompute; flash attention keeps none of it.
    Full recompute keeps only each layer's input, 2h per token (/tp with sequence parallelism).
    For GPT-3's block (q = k = h, f = 4h, GeLU keeping 8h + 8h, two sbh dropout masks) the same accounting
    gives the paper's sbh(34 + 5as/h). Without `mlp` (an MoE layer's attention half: `moe_activation_bytes`
    adds the rest), the fc1 input and the f terms are left out.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTE}")
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"layer_spec={layer_spec!r} must be one of {LAYER_SPECS}")
    if layer_spec == "local" and recompute != "full":
        return local_layer_activation_bytes(model, seq, micro_batch, tp, sequence_parallel, recompute, mlp)
    tokens = seq * micro_batch
    h, f = model.hidden_size, model.ffn_hidden_size
    q, k = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
    gemm_in = 1 if fp8 else 2
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return tokens * 2 * h / sp
    replicated = 4 * h + gemm_in * h + (gemm_in * h if mlp else 0)
    split = 2 * q + 4 * k + gemm_in * q + ((4 * f + gemm_in * f) if mlp else 0)
    if model.qk_layernorm:
        split += 2 * q + 2 * k
    per_token = replicated / sp + split / tp
    if not flash_attention and recompute == "none":
        per_token += 5 * model.num_attention_heads * seq / tp
    return tokens * per_token


def local_layer_activation_bytes(model: ModelConfig, seq: int, micro_batch: int, tp: int, sequence_parallel: bool,
                                 recompute: str, mlp: bool = True) -> float:
    """What one layer of megatron-core's local spec (no Transformer Engine: torch RMSNorm, attention through
    torch's scaled_dot_product_attention (grpo_mega.models.local_attention), unfused SwiGLU) keeps for its
    backward, per micro-batch, on one TP rank, with bf16 weights. Read off the tensors autograd saves
    (bench/activations.py; tests/cli/test_plan.py holds it to the byte for a Qwen2 and a Qwen3 layer). It
    keeps more than the TE layer above (its norms keep fp32 copies; on an H100 without TE, with megatron's
    unfused attention then, the update's activations were 2.0x the TE-based plan,
    bench_results/gpu_nvidia_h100_80gb_hbm3.json).

    Per token (h, q, k, f, a as above; g query groups, d head_dim, s the sequence):
      kept whole on every TP rank unless sequence-parallel:
        2 x (4h + 4h + 4)   each RMSNorm keeps its input upcast to fp32, the normalised fp32 tensor and 1/rms
        2h + 2h             the QKV and fc1 inputs
      per micro-batch, not per token: 8d x s   RoPE's cos and sin for Q and for K (bf16, [s, 1, 1, d] each)
      split over TP:
        8q + 8k + 4(a + g)  with qk_layernorm, the q/k norms as above (fp32 input, output, 1/rms per head)
        2q + 2k + 2(q + 2k) Q and K after RoPE, V as a view of the whole QKV output
        no recompute:  4a   SDPA's fp32 log-sum-exp per head (no [a, s, s] scores: selective recompute
                            saves only this, and adds the checkpoint's 4-byte RNG state per layer)
        2q                  the output projection's input
        4f + 3 x 2f         fc1's output, SwiGLU's saved halves and product (fc2's input)
    """
    tokens = seq * micro_batch
    h, f, a, g, d = (model.hidden_size, model.ffn_hidden_size, model.num_attention_heads, model.num_query_groups,
                     model.kv_channels)
    q, k = a * d, g * d
    sp = tp if sequence_parallel else 1
    replicated = 2 * (8 * h + 4) + (4 * h if mlp else 2 * h)
    split = 2 * q + ((4 * f + 6 * f) if mlp else 0)
    if model.qk_layernorm:
        split += 8 * q + 8 * k + 4 * (a + g)
    split += 2 * q + 2 * k + 2 * (q + 2 * k)
    if recompute == "none":
        split += 4 * a
    return tokens * (replicated / sp + split / tp) + 8 * d * seq + (4 if recompute == "selective" else 0)


def lora_activation_bytes(model: ModelConfig, seq: int, micro_batch: int, tp: int, sequence_parallel: bool,
                          rank: int, targets, moe: bool = False, ep: int = 1) -> float:
    """What LoRA changes in one layer's activations per micro-batch on one TP rank, against
    `local_layer_activation_bytes` (the local spec, which LoRA runs on; grpo_mega/models/lora.py's forwards, bf16;
    negative where the frozen base keeps less). Per token:
      the two RMSNorms' weights are frozen: neither keeps its normalised fp32 tensor (kept for the weight's
        gradient): -8h / sp
      the frozen base linears keep no input (megatron's linear_with_frozen_weight); each adapter keeps its own:
      column-parallel target (qkv, fc1; not an MoE layer's fc1): A x's input, the norm's output, whole on every
        rank (all-gathered under sequence parallelism, where a trained base keeps only its 1/tp shard):
        2h - 2h / sp more than the base's count; and B's input A x [tokens, r]: 2r
      row-parallel target (proj, fc2): A's input is the one the base's count has; B's input, A x all-reduced
        (reduce-scattered under sequence parallelism): 2r / sp
    Measured to the byte through autograd's saved tensors (tests/cli/test_plan.py). Still counted as kept, so an
    over-estimate: an untargeted frozen linear's input, frozen q/k norms' tensors, an MoE layer's router input.
    On an MoE layer, estimated (not measured): the router adapter keeps B's input, 2r / sp (A's input is the
    router's own); per routed copy of a token on this EP rank (top-k / ep of them, balanced; every expert-TP rank
    sees all of them), expert_fc1's adapter keeps its input and A x, 2h + 2r, expert_fc2's the activation's shard
    and A x, 2 f_moe / tp + 2r."""
    tokens = seq * micro_batch
    sp = tp if sequence_parallel else 1
    h = model.hidden_size
    per_token = -8 * h / sp
    copies = (model.moe_router_topk or 0) / ep
    for t in targets:
        if t == "qkv" or (t == "fc1" and not moe):
            per_token += 2 * h - 2 * h / sp + 2 * rank
        elif t == "proj" or (t == "fc2" and not moe):
            per_token += 2 * rank / sp
        elif moe and t == "router":
            per_token += 2 * rank / sp
        elif moe and t == "expert_fc1":
            per_token += copies * (2 * h + 2 * rank)
        elif moe and t == "expert_fc2":
            per_token += copies * (2 * model.moe_ffn_hidden_size / tp + 2 * rank)
    return tokens * per_token


def moe_activation_bytes(model: ModelConfig, seq: int, micro_batch: int, tp: int, sequence_parallel: bool,
                         fp8: bool = False) -> tuple[float, float]:
    """(kept, dispatch): what one MoE layer's MLP keeps for its backward per micro-batch on one rank, and the
    token dispatcher's transient buffers while it runs (one layer at a time). Read from megatron-core 0.16.1's
    MoELayer, TopKRouter and alltoall dispatcher, not measured (tests hold only the parameter, gradient and
    optimizer bytes to megatron's allocations); routing assumed balanced, no token dropping. Per token of this
    rank (s*b / tp under sequence parallelism, as the attention half):
        4h + 4h     the pre-MLP RMSNorm's input and output (the router's and the dispatcher's input)
        4E + 4E     the router's fp32 logits and softmax scores (aux loss and top-k backward), E experts
    per routed copy (top-k per token; after the EP all-to-all and the expert-TP all-gather each rank runs
    tokens * k copies through its experts, E/ep experts at f_e / etp width):
        2h          the experts' fc1 input (1h as FP8)
        4f_e + 2f_e fc1's output (gate and up) and SwiGLU's output, fc2's input (1f_e as FP8), over etp
        2h          the experts' output, kept for the multiplication by the routing probabilities
    dispatch: the all-to-all's send and receive copies of the permuted tokens, 2 x 2h per routed copy."""
    tokens = seq * micro_batch
    sp = tp if sequence_parallel else 1
    h, fe, e, k = model.hidden_size, model.moe_ffn_hidden_size, model.num_experts, model.moe_router_topk
    gemm_in = 1 if fp8 else 2
    local = tokens / sp
    routed = local * k * (tp if sequence_parallel else 1)  # the expert-TP group gathers its ranks' tokens
    kept = local * (8 * h + 8 * e) + routed * (gemm_in * h + (4 + gemm_in) * fe / tp + 2 * h)
    return kept, routed * 4 * h


def loss_buffer_bytes(model: ModelConfig, seq: int, micro_batch: int, tp: int, sequence_parallel: bool,
                      chunk_size: Optional[int], backward: bool = True, fused: bool = False, full_kl: bool = False,
                      act_bytes: int = 2) -> float:
    """The last stage's output side for one micro-batch.

    Unfused: the final norm's and the output layer's inputs, the logits [s*b, V/tp] in bf16 (megatron's
    transposed contiguous copy, kept by the loss; with `backward` also their gradient and the gradient before
    the transpose), and the fp32 temporaries of the vocab-parallel op over `chunk_size` tokens at a time
    (grpo_mega/parallel/vocab_parallel.py). Fused (batch.fused_output, grpo_mega/parallel/fused_output.py): the
    final norm's input (/tp under SP) and the op's input (GPTModel's transposed copy of the gathered hidden
    states, whole on every TP rank) kept for the backward, and `fused_loss_peak_bytes`: one chunk of logits and
    their temporaries at a time, no [s*b, V/tp] tensor. `act_bytes`: 2 with bf16 weights, 4 with fp32."""
    tokens = seq * micro_batch
    sp = tp if sequence_parallel else 1
    vocab = model.padded_vocab_size / tp
    if fused:
        chunk = min(tokens, chunk_size or fused_auto_chunk(model.padded_vocab_size // tp))
        kept = (2 / sp + 2) * model.hidden_size * tokens if backward else 0
        return kept + fused_loss_peak_bytes(tokens, vocab, model.hidden_size, chunk, act_bytes, full_kl and backward,
                                            backward)
    hidden = (2 + 2) * model.hidden_size / sp * tokens if backward else 0
    logits = tokens * vocab * 2 * (3 if backward else 2)
    work = min(tokens, chunk_size or tokens) * vocab * 4 * FP32_LOSS_COPIES
    return hidden + logits + work


def fused_auto_chunk(local_vocab: int) -> int:
    """grpo_mega.parallel.fused_output.auto_chunk_size: tokens per chunk without batch.logprob_chunk_size."""
    return max(1, FUSED_CHUNK_BYTES // (4 * max(1, local_vocab)))


def fused_loss_peak_bytes(tokens: int, local_vocab: float, hidden: int, chunk: int, act_bytes: int, full_kl: bool,
                          backward: bool = True) -> float:
    """The fused op's peak above its inputs over its forward and backward (grpo_mega/parallel/fused_output.py,
    vocab_parallel.local_stats / local_grads), per element of one [chunk, V/tp] chunk:
      bf16 weights: forward z 2 + its fp32 scaled copy 4 + exp 4 (the reference's z 2 alongside, its fp32 copy
        taking the first's place); backward z 2 + log p 4 + gradient 4 (+ the reference's z 2 and log q 4):
        10 bytes, 16 with the full KL; the weight gradient's bf16 GEMM output [V/tp, h] is made beside the
        chunk's bf16 gradient (2 bytes) before it is added into main_grad.
      fp32 weights: z is scaled in place: 8 bytes, 12 with the full KL; 4 more when the input is one chunk (its
        logits kept for the backward are not overwritten in the forward).
    Plus per token the hidden-state gradient (act_bytes x h, with `backward`) and FUSED_TOKEN_BYTES."""
    if act_bytes == 2:
        work = chunk * local_vocab * (16 if full_kl else 10)
        if backward:
            work = max(work, chunk * local_vocab * 2 + local_vocab * hidden * 2)
    else:
        work = chunk * local_vocab * ((12 if full_kl else 8) + (4 if backward and chunk >= tokens else 0))
    return work + tokens * ((act_bytes * hidden if backward else 0) + FUSED_TOKEN_BYTES)


# ---- the plan -----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PlanInput:
    """A layout to plan: the model, the parallel layout (ParallelConfig) on `world_size` GPUs, and what the
    update's micro-batches, precision, optimizer, reference and rollout engine put on each GPU."""

    model: ModelConfig
    parallel: ParallelConfig
    world_size: int
    gpus_per_node: int = 8
    micro_batch_size: int = 1
    """Responses per forward on one rank (batch.micro_batch_size)."""
    seq_length: int = 4096
    """Prompt + response tokens of the longest micro-batch (batch.max_prompt_length + max_response_length)."""
    num_microbatches: Optional[int] = None
    """Micro-batches per DP rank per mini-batch; the 1F1B schedule holds min(pp, this) in flight (null: pp)."""
    params_dtype: str = "bf16"
    fp8: bool = False
    distributed_optimizer: bool = True
    reference: str = "gpu"
    """The frozen KL reference: 'gpu' (resident), 'offload' (on the GPU only for its forward) or 'none'."""
    engine_gib: float = 0.0
    """Per-GPU memory held by a rollout engine colocated on the same GPUs (SGLang's mem_fraction_static x
    GPU memory: weights and KV cache)."""
    gpu_gib: float = H100_GIB
    margin: float = 0.10
    """Fraction of the GPU kept free: CUDA context, NCCL buffers, allocator fragmentation."""
    flash_attention: bool = True
    """Attention that keeps no [a, s, s] scores: TE's fused attention, and the local spec's SDPA; false for an
    unfused one (megatron's DotProductAttention)."""
    layer_spec: str = "transformer_engine"
    """The layers the actor is built with: 'transformer_engine' (GPUs with TE) or megatron-core's 'local' spec
    (no TE: torch norms, SDPA attention, unfused SwiGLU), whose activations are `local_layer_activation_bytes`."""
    logprob_chunk_size: Optional[int] = None
    fused_output: bool = True
    """batch.fused_output: the output layer fused into the loss op (`loss_buffer_bytes`)."""
    full_kl: bool = False
    """The full-vocabulary KL in the loss (algo.kl_estimator=full): the fused op's chunk holds the reference's
    logits too (the unfused term does not count them)."""
    lora_rank: Optional[int] = None
    """lora.rank: the base model frozen (its weights alone, in params_dtype, outside DDP's buffers) and adapters
    of this rank on `lora_targets`, the only parameters with gradients, fp32 main weights and Adam state; no
    reference model (the reference is the actor with its adapters off). Null: every weight trains."""
    lora_targets: tuple = LORA_TARGETS
    """lora.target_modules."""

    def __post_init__(self):
        if self.lora_rank is not None:
            if self.lora_rank <= 0:
                raise ValueError(f"lora_rank={self.lora_rank} (lora.rank, --lora-rank) must be > 0, or None: no LoRA")
            unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
            if unknown or not self.lora_targets:
                raise ValueError(f"lora_targets={list(self.lora_targets)} (lora.target_modules, --lora-targets): "
                                 f"unknown {unknown or 'empty list'}; choose from {', '.join(LORA_TARGETS)}")
            if self.reference != "none":
                raise ValueError(f"reference={self.reference!r} with lora_rank={self.lora_rank}: under LoRA the "
                                 "reference is the actor with its adapters off, so plan it with reference='none'")
            if self.layer_spec != "local" or self.fp8:
                raise ValueError(f"lora_rank={self.lora_rank} needs layer_spec='local' and no fp8: LoRA adapts "
                                 "megatron-core's local layers (Transformer Engine's fused layers are refused)")
        if self.reference not in REFERENCE:
            raise ValueError(f"reference={self.reference!r} must be one of {REFERENCE}")
        if self.params_dtype not in ("bf16", "fp32"):
            raise ValueError(f"params_dtype={self.params_dtype!r} must be 'bf16' or 'fp32'")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin={self.margin} must be in [0, 1)")
        if self.layer_spec not in LAYER_SPECS:
            raise ValueError(f"layer_spec={self.layer_spec!r} must be one of {LAYER_SPECS}")

    @property
    def dp(self) -> int:
        return self.parallel.check(self.model, self.world_size)

    @property
    def usable_gib(self) -> float:
        return self.gpu_gib * (1 - self.margin)

    @property
    def expert_dp(self) -> int:
        """Ranks sharing each expert shard (megatron's expert-data-parallel group): world / (pp * etp * ep),
        with etp = tp."""
        return self.dp // self.parallel.ep

    def describe(self) -> str:
        p = self.parallel
        ep = f" ep={p.ep}" if self.model.is_moe else ""
        return (f"tp={p.tp} pp={p.pp} dp={self.dp}{ep} sp={'on' if p.sequence_parallel else 'off'} "
                f"recompute={p.recompute} micro_batch={self.micro_batch_size}")


COMPONENTS = ("engine", "parameters", "gradients", "optimizer", "reference", "activations", "logits")
"""In the order they are allocated (the engine starts first), which is the order a refusal names them in."""


@dataclass
class StagePlan:
    stage: int
    layers: int
    param_numel: int
    in_flight: int
    gib: dict = field(default_factory=dict)
    """Component -> GiB at the update's peak (COMPONENTS)."""
    expert_numel: int = 0
    """Of param_numel, this rank's expert parameters (sharded over expert DP by the DistributedOptimizer)."""
    adapter_numel: int = 0
    """Under LoRA: this rank's adapter parameters (not in param_numel, the base's); 0 without LoRA."""
    adapter_expert_numel: int = 0
    """Under LoRA with EP > 1: the expert adapters among adapter_numel (sharded by the optimizer over expert DP)."""
    adapter_buffer_numel: int = 0
    """Under LoRA: elements of DDP's buffers of the adapters, padding included (their weights in params_dtype,
    their gradients in fp32): the only buffers DDP makes, the base being frozen (the expert adapters' apart under
    EP > 1)."""
    frozen_bytes: int = 0
    """Under LoRA: the frozen base's weights (param_numel in params_dtype), held outside DDP's buffers."""
    ref_forward_gib: float = 0.0
    """Peak while the offloaded reference runs its forward (model states + reference weights + forward-only
    buffers); 0 unless reference='offload'."""

    @property
    def total_gib(self) -> float:
        return max(sum(self.gib.values()), self.ref_forward_gib)


@dataclass
class Plan:
    input: PlanInput
    stages: list[StagePlan]
    worst: int
    """The stage with the largest total."""
    fits: bool
    reason: str = ""

    @property
    def total_gib(self) -> float:
        return self.stages[self.worst].total_gib

    def to_dict(self) -> dict:
        inp = self.input
        worst = self.stages[self.worst]
        return dict(
            model=inp.model.name, world_size=inp.world_size, gpus_per_node=inp.gpus_per_node,
            tp=inp.parallel.tp, pp=inp.parallel.pp, dp=inp.dp, ep=inp.parallel.ep, sequence_parallel=inp.parallel.sequence_parallel,
            recompute=inp.parallel.recompute, micro_batch_size=inp.micro_batch_size, seq_length=inp.seq_length,
            num_microbatches=inp.num_microbatches, params_dtype=inp.params_dtype, fp8=inp.fp8,
            distributed_optimizer=inp.distributed_optimizer, reference=inp.reference, engine_gib=inp.engine_gib,
            flash_attention=inp.flash_attention, layer_spec=inp.layer_spec, fused_output=inp.fused_output,
            full_kl=inp.full_kl, lora_rank=inp.lora_rank,
            lora_targets=list(inp.lora_targets) if inp.lora_rank is not None else None,
            gpu_gib=inp.gpu_gib, margin=inp.margin,
            usable_gib=inp.usable_gib,
            worst_stage=worst.stage, per_gpu_gib=dict(worst.gib), total_gib=self.total_gib,
            headroom_gib=inp.usable_gib - self.total_gib, fits=self.fits, reason=self.reason,
            stages=[dict(stage=s.stage, layers=s.layers, param_numel=s.param_numel, expert_numel=s.expert_numel,
                         param_bytes=s.param_numel * _weight_bytes(inp), adapter_numel=s.adapter_numel,
                         adapter_expert_numel=s.adapter_expert_numel, adapter_buffer_numel=s.adapter_buffer_numel, frozen_bytes=s.frozen_bytes,
                         in_flight=s.in_flight, gib=dict(s.gib),
                         ref_forward_gib=s.ref_forward_gib, total_gib=s.total_gib) for s in self.stages],
        )


def _weight_bytes(inp: PlanInput) -> int:
    return 2 if inp.params_dtype == "bf16" else 4


def plan(inp: PlanInput) -> Plan:
    """Memory per GPU of every pipeline stage at the update's peak; fits when the worst stage's total is
    within the GPU's memory less the margin. Raises ValueError for a layout that is invalid, not too big."""
    model, parallel = inp.model, inp.parallel
    dp = inp.dp
    bf16 = inp.params_dtype == "bf16"
    tp, pp = parallel.tp, parallel.pp
    in_flight_max = pp if inp.num_microbatches is None else min(pp, inp.num_microbatches)
    args = (model, inp.seq_length, inp.micro_batch_size, tp, parallel.sequence_parallel)
    per_layer = layer_activation_bytes(*args, parallel.recompute, inp.flash_attention, inp.fp8, inp.layer_spec)
    moe_kept, dispatch = moe_activation_bytes(*args, inp.fp8) if model.is_moe else (0.0, 0.0)
    if model.is_moe and parallel.recompute != "full":
        per_moe_layer = layer_activation_bytes(*args, parallel.recompute, inp.flash_attention, inp.fp8,
                                               inp.layer_spec, mlp=False) + moe_kept
    else:
        per_moe_layer = per_layer  # full recompute keeps each layer's input whatever its MLP
    lora = inp.lora_rank is not None
    if lora:  # each adapter's own saved inputs, on top of the layer's
        lora_args = (*args, inp.lora_rank, inp.lora_targets)
        per_layer += lora_activation_bytes(*lora_args) if parallel.recompute != "full" else 0
        per_moe_layer += lora_activation_bytes(*lora_args, moe=True, ep=parallel.ep) if parallel.recompute != "full" else 0
        adapters = lora_stage_sizes(model, parallel, inp.lora_rank, inp.lora_targets)
        expert_adapters = lora_stage_sizes(model, parallel, inp.lora_rank, inp.lora_targets, experts=True)
    moe_layers, start = model.moe_layers(), 0
    stages = []
    buffers = grad_buffer_numel(model, parallel, dp, inp.distributed_optimizer)
    wbytes = 2 if bf16 else 4
    for sp_, (dense_buf, expert_buf) in zip(stage_params(model, parallel), buffers):
        n, ne = sp_.total, sp_.expert
        adapter_numel = adapter_expert = adapter_buf = frozen = 0
        if lora:
            # the frozen base: its own parameters, outside DDP; DDP's buffers (and the optimizer) hold only the
            # adapters: the experts' in an expert buffer over expert DP under EP > 1 (megatron's allreduce=False
            # parameters, which lora.py gives them), in the dense one at EP1
            sizes, experts = adapters[sp_.stage], expert_adapters[sp_.stage]
            adapter_numel, adapter_expert = sum(sizes) + sum(experts), sum(experts) if parallel.ep > 1 else 0
            if parallel.ep > 1:
                adapter_buf = (_buffer_numel(sizes, dp, inp.distributed_optimizer)
                               + _buffer_numel(experts, inp.expert_dp, inp.distributed_optimizer))
            else:
                adapter_buf = _buffer_numel(sizes + experts, dp, inp.distributed_optimizer)
            frozen = n * wbytes
            weights = frozen + adapter_buf * wbytes
            trained, trained_expert, grad_buf = adapter_numel, adapter_expert, adapter_buf
        else:
            # with the DistributedOptimizer the weights live in DDP's padded parameter buffer, as the gradients do
            weights = (dense_buf + expert_buf if inp.distributed_optimizer else n) * wbytes
            trained, trained_expert, grad_buf = n, ne, dense_buf + expert_buf
        if inp.fp8:  # TE caches each linear weight and its transpose as FP8 across the micro-batches
            weights += 2 * sp_.linear
        # fp32 main weights (bf16 training), Adam m and v: sharded by the DistributedOptimizer, the dense
        # parameters over DP, the experts over expert DP (dp / ep); per rank the mean (a rank's shard of the
        # padded buffer holds a few elements more or fewer; summed over the DP group they are exact)
        if inp.distributed_optimizer:
            sharded = (trained - trained_expert) / dp + trained_expert / inp.expert_dp
        else:
            sharded = trained
        main = 4 * sharded if bf16 else 0
        adam = 8 * sharded
        in_flight = max(1, min(in_flight_max, pp - sp_.stage))
        n_moe = sum(moe_layers[start:start + sp_.layers])
        start += sp_.layers
        acts = in_flight * ((sp_.layers - n_moe) * per_layer + n_moe * per_moe_layer)
        if n_moe:
            acts += dispatch  # one layer's dispatcher buffers at a time
        if sp_.stage == 0:
            acts += in_flight * 16 * inp.seq_length * inp.micro_batch_size  # token and position ids
        if parallel.recompute == "full":  # one layer's activations rebuilt at a time during the backward
            rebuilt = layer_activation_bytes(*args, "selective", inp.flash_attention, inp.fp8, inp.layer_spec)
            rebuilt += lora_activation_bytes(*lora_args) if lora else 0
            if n_moe:
                rebuilt = max(rebuilt, layer_activation_bytes(*args, "selective", inp.flash_attention, inp.fp8,
                                                              inp.layer_spec, mlp=False) + moe_kept
                              + (lora_activation_bytes(*lora_args, moe=True, ep=parallel.ep) if lora else 0))
            acts += rebuilt
        last = sp_.stage == pp - 1
        loss_kw = dict(fused=inp.fused_output, full_kl=inp.full_kl, act_bytes=2 if bf16 else 4)
        logits = loss_buffer_bytes(model, inp.seq_length, inp.micro_batch_size, tp, parallel.sequence_parallel,
                                   inp.logprob_chunk_size, **loss_kw) if last else 0.0
        ref_weights = n * (2 if bf16 else 4)
        gib = dict(
            engine=inp.engine_gib,
            parameters=(weights + main) / GIB,
            gradients=4 * grad_buf / GIB,  # DDP's grad buffers (dense, expert), grad_reduce_in_fp32
            optimizer=adam / GIB,
            reference=ref_weights / GIB if inp.reference == "gpu" else 0.0,
            activations=acts / GIB,
            logits=logits / GIB,
        )
        ref_forward = 0.0
        if inp.reference == "offload":
            fwd = loss_buffer_bytes(model, inp.seq_length, inp.micro_batch_size, tp, parallel.sequence_parallel,
                                    inp.logprob_chunk_size, backward=False, **loss_kw) if last else 0.0
            fwd += layer_activation_bytes(model, inp.seq_length, inp.micro_batch_size, tp, False, "selective",
                                          inp.flash_attention, inp.fp8, inp.layer_spec)  # one layer's temporaries
            states = sum(gib[k] for k in ("engine", "parameters", "gradients", "optimizer"))
            ref_forward = states + (ref_weights + fwd) / GIB
        stages.append(StagePlan(stage=sp_.stage, layers=sp_.layers, param_numel=n, in_flight=in_flight, gib=gib,
                                ref_forward_gib=ref_forward, expert_numel=ne, adapter_numel=adapter_numel,
                                adapter_expert_numel=adapter_expert, adapter_buffer_numel=adapter_buf, frozen_bytes=frozen))
    worst = max(range(len(stages)), key=lambda i: stages[i].total_gib)
    result = Plan(input=inp, stages=stages, worst=worst, fits=stages[worst].total_gib <= inp.usable_gib)
    if not result.fits:
        result.reason = _reason(inp, stages[worst])
    return result


def _reason(inp: PlanInput, stage: StagePlan) -> str:
    """Names the first component, in allocation order, that no longer fits in what the ones before it left."""
    budget = inp.usable_gib
    head = (f"{inp.model.name} at {inp.describe()} does not fit: pipeline stage {stage.stage} needs "
            f"{stage.total_gib:.1f} GiB per GPU, {budget:.1f} GiB usable ({inp.gpu_gib:.1f} GiB less the "
            f"{inp.margin:.0%} margin)")
    used, before = 0.0, []
    for name in COMPONENTS:
        need = stage.gib[name]
        if need and used + need > budget:
            left = max(budget - used, 0.0)
            after = f" after {' + '.join(before)} ({used:.1f} GiB)" if before else ""
            return f"{head}; {name} ({need:.1f} GiB) does not fit: only {left:.1f} GiB are left{after}"
        used += need
        if need:
            before.append(name)
    return (f"{head}; the offloaded reference's forward (model states + its weights + buffers = "
            f"{stage.ref_forward_gib:.1f} GiB) does not fit")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(inp: PlanInput, batch=None, n: int = 0) -> list[PlanInput]:
    """Every layout of the same GPUs worth trying: tp within a node dividing heads, query groups, ffn and the
    padded vocabulary; pp splitting the layers evenly; sequence parallel with tp > 1; each recompute;
    micro-batch sizes from the requested one down to 1. With `batch` (a BatchConfig) and `n` (rollout.n), only
    layouts whose DP size splits a mini-batch (BatchConfig.check_dp)."""
    model, out = inp.model, []
    for tp in _divisors(inp.gpus_per_node):
        if any(n % tp for n in (model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size,
                                model.padded_vocab_size)):
            continue
        if model.is_moe and model.moe_ffn_hidden_size % tp:
            continue
        for pp, ep in [(pp, ep) for pp in _divisors(model.num_layers) for ep in _divisors(inp.world_size)]:
            if inp.world_size % (tp * pp):
                continue
            dp = inp.world_size // (tp * pp)
            if dp % ep or (model.num_experts or 1) % ep or (ep > 1 and not model.is_moe):
                continue
            for recompute in RECOMPUTE:
                if recompute == "selective" and inp.flash_attention:
                    continue  # flash attention already keeps no scores: selective recompute saves nothing
                for mbs in range(inp.micro_batch_size, 0, -1):
                    if batch is not None:
                        try:
                            replace(batch, micro_batch_size=mbs).check_dp(dp, n)
                        except ValueError:
                            continue
                        m = batch.ppo_mini_batch_size * n // (dp * mbs)
                    else:
                        m = None
                    par = ParallelConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1, recompute=recompute)
                    out.append(replace(inp, parallel=par, micro_batch_size=mbs, num_microbatches=m))
    return out


def suggest(inp: PlanInput, batch=None, n: int = 0, limit: int = 5) -> list[Plan]:
    """Layouts of the same GPUs that fit, cheapest first: least recompute, then least model parallelism
    (tp * pp), then the largest micro-batch, then the smaller tp."""
    order = {r: i for i, r in enumerate(RECOMPUTE)}
    fits = [p for p in map(plan, candidate_layouts(inp, batch, n)) if p.fits]
    fits.sort(key=lambda p: (order[p.input.parallel.recompute], p.input.parallel.tp * p.input.parallel.pp,
                             -p.input.micro_batch_size, p.input.parallel.tp, p.input.parallel.ep))
    return fits[:limit]


# ---- check against megatron ---------------------------------------------------------------------------


def meta_stage_params(model: ModelConfig, parallel: ParallelConfig, world_size: int, lora=None) -> dict[int, dict]:
    """Parameter numel and bytes of each pipeline stage's shard as megatron builds it, on the meta device.

    For each rank in turn (until every stage is seen): a fake process group of `world_size` ranks
    (torch.testing's FakeStore backend: collectives return at once, nothing is sent), megatron's
    parallel_state for the layout, builder.build_gpt(meta=True) for that rank's stage, numel summed, all torn
    down again. Megatron's gloo side groups are not created: the fake store cannot back a real gloo group.
    Needs a process with no torch.distributed group of its own; leaves none behind. With `lora` (a LoraConfig)
    the adapters are added as grpo_mega.models.lora adds them and counted apart ("adapter_numel").
    Returns {stage: {"rank", "tp_rank", "numel", "bytes", "adapter_numel"}}.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from grpo_mega.conf.optim import PrecisionConfig
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.parallel import cpu_compat

    if dist.is_initialized():
        raise RuntimeError("meta_stage_params needs a process without a torch.distributed group; run it in a fresh one")
    from megatron.core import parallel_state as ps

    parallel.check(model, world_size)
    found: dict[int, dict] = {}
    with cpu_compat.cpu_device_mode():
        for rank in range(world_size):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            try:
                ps.initialize_model_parallel(tensor_model_parallel_size=parallel.tp,
                                             pipeline_model_parallel_size=parallel.pp,
                                             expert_model_parallel_size=parallel.ep,
                                             create_gloo_process_groups=False)
                stage = ps.get_pipeline_model_parallel_rank()
                if stage not in found:
                    gpt, _ = build_gpt(model, parallel, PrecisionConfig(params_dtype="bf16"), meta=True)
                    if lora is not None:
                        from grpo_mega.models.lora import apply_lora

                        apply_lora(gpt, lora)
                    named = list(gpt.named_parameters())
                    is_adapter = [n.endswith((".lora_A", ".lora_B")) for n, _ in named]
                    params = [p for (_, p), a in zip(named, is_adapter) if not a]
                    found[stage] = dict(rank=rank, tp_rank=ps.get_tensor_model_parallel_rank(),
                                        numel=sum(p.numel() for p in params),
                                        bytes=sum(p.numel() * p.element_size() for p in params),
                                        adapter_numel=sum(p.numel() for (_, p), a in zip(named, is_adapter) if a))
                    del gpt, params
            finally:
                ps.destroy_model_parallel()
                dist.destroy_process_group()
            if len(found) == parallel.pp:
                break
    return found


def compare_with_meta(model: ModelConfig, parallel: ParallelConfig, world_size: int, lora=None) -> list[dict]:
    """Per stage: the planner's parameter numel and bf16 bytes next to the meta-device build's; with `lora` (a
    LoraConfig) also this rank's adapter numel, both ways (rel_diff is then the larger of the two differences)."""
    meta = meta_stage_params(model, parallel, world_size, lora)
    adapters = None
    if lora is not None:
        adapters = [a + e for a, e in zip(lora_stage_sizes(model, parallel, lora.rank, lora.target_modules),
                                          lora_stage_sizes(model, parallel, lora.rank, lora.target_modules, True))]
    rows = []
    for s in stage_params(model, parallel):
        m = meta[s.stage]
        row = dict(stage=s.stage, rank=m["rank"], planner_numel=s.total, meta_numel=m["numel"],
                   planner_bytes=2 * s.total, meta_bytes=m["bytes"],
                   rel_diff=abs(2 * s.total - m["bytes"]) / m["bytes"])
        if adapters is not None:
            planned = sum(adapters[s.stage])
            row.update(planner_adapter_numel=planned, meta_adapter_numel=m["adapter_numel"])
            row["rel_diff"] = max(row["rel_diff"], abs(planned - m["adapter_numel"]) / max(m["adapter_numel"], 1))
        rows.append(row)
    return rows


