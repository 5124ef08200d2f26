"""Running micro-batches through Megatron's pipeline schedule (`get_forward_backward_func`) and turning each
micro-batch's vocab-parallel logits (or, with batch.fused_output, its last hidden states) into token statistics:
logprobs, entropy, and with the full KL in the loss the frozen reference run in lockstep inside the same
schedule, so that both models' vocab-sharded logits meet in the loss of every micro-batch.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from grpo_mega.conf.batch import BatchConfig
from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.parallel import comm
from grpo_mega.parallel.cpu_compat import without_device_mode
from grpo_mega.parallel.fused_output import fused_output_stats
from grpo_mega.parallel.vocab_parallel import vocab_parallel_stats
from grpo_mega.trainer.batch import RolloutBatch, unpack
from grpo_mega.trainer.dp_layout import chunk_of, layout, parallel_state


def run_schedule(module, micro: list[dict], length: int, forward_step, forward_only: bool, lockstep: int = 1) -> list:
    """`micro` through Megatron's schedule for this layout (1F1B with PP); returns the loss dicts of the
    last stage (empty elsewhere). With `lockstep` models run on each micro-batch (the actor and the
    reference: 2), the hidden states sent between pipeline stages hold `lockstep` times its rows
    ([s, lockstep * b, h]: megatron sizes its receive buffers from micro_batch_size)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=[module],
        num_microbatches=len(micro),
        seq_length=length,
        micro_batch_size=micro[0]["tokens"].shape[0] * lockstep,
        forward_only=forward_only,
    )


def to_device(mb: dict) -> dict:
    """A micro-batch's tensors (built in host memory) on the model's device: the current GPU, or the CPU.
    Moved one micro-batch at a time, as the schedule asks for it."""
    if not torch.cuda.is_available():
        return mb
    dev = torch.device("cuda", torch.cuda.current_device())
    return {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in mb.items()}


def unwrap(model):
    """The GPTModel inside a (DDP-)wrapped module."""
    while hasattr(model, "module"):
        model = model.module
    return model


def with_positions(mb: dict, batch: BatchConfig) -> dict:
    """With batch.response_only_logits: the micro-batch's `out_positions`, the positions the loss reads
    (its `mask`, row-major over the padded [n, L'] layout) as (sequence index [K], batch index [K]) into
    the model's [s, b]; `out_mask`, the mask they came from. A micro-batch without any (a packed row of
    padding, rows all out of the loss) gets the model's first position, unused, so that its loss keeps a
    graph."""
    if not batch.response_only_logits:
        return mb
    mask = mb["mask"].bool()
    rows, cols = mask.nonzero(as_tuple=True)
    if "unpack_index" in mb:  # a packed row: batch index 0, its flat position
        positions = (mb["unpack_index"][rows, cols], torch.zeros_like(rows))
    else:
        positions = (cols, rows)
    if not len(rows):
        positions = (torch.zeros(1, dtype=torch.long, device=mask.device),) * 2
    return {**mb, "out_positions": positions, "out_mask": mask}


def forward_micro(model, mb: dict) -> torch.Tensor:
    """Logits [b, s, V/tp] on the last stage (hidden states elsewhere); with mb["out_positions"] (K of
    them, see `with_positions`) logits [1, K, V/tp] at those positions alone; with mb["output_weights"]
    (`with_fused_output`) the output layer's input instead of its logits, [b, s, h] or [1, K, h]. A packed row ([1, S])
    reaches the model as THD with cu_seqlens under Transformer Engine; on megatron-core's local spec its
    cu_seqlens go where the attention mask would (SDPACoreAttention attends within each sequence) and RoPE
    positions restart per sequence. With mb["routes"] the MoE
    layers route to the rollout engine's experts (grpo_mega.models.routing_replay)."""
    from grpo_mega.models.forward_hooks import set_output_hidden, set_output_positions
    from grpo_mega.models.routing_replay import set_routes

    gpt = unwrap(model)
    set_output_positions(gpt, mb.get("out_positions"))
    set_output_hidden(gpt, "output_weights" in mb)
    set_routes(gpt, mb.get("routes"), gpt.config.sequence_parallel)  # the engine's experts (routing replay)
    try:
        with without_device_mode():  # the model's forward names no CUDA device on megatron's local spec
            return forward_rows(model, gpt, mb)
    finally:
        set_output_positions(gpt, None)
        set_output_hidden(gpt, False)
        set_routes(gpt, None)


def forward_rows(model, gpt, mb: dict) -> torch.Tensor:
    """`forward_micro`'s model call, padded rows or a packed one."""
    from grpo_mega.models.builder import uses_transformer_engine
    from grpo_mega.models.forward_hooks import set_rope_positions
    from grpo_mega.models.local_attention import packed_row_mask

    if "cu_seqlens" not in mb:
        set_rope_positions(gpt, None)
        return model(mb["tokens"], mb["position_ids"], None)
    if not uses_transformer_engine(gpt):  # the spec it was built on (local under LoRA, TE or not)
        set_rope_positions(gpt, mb["position_ids"][0])
        return model(mb["tokens"], mb["position_ids"], packed_row_mask(mb["cu_seqlens"], len(mb["rows"])))
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb["cu_seqlens"]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=mb["max_seqlen"], max_seqlen_kv=mb["max_seqlen"])
    set_rope_positions(gpt, None)
    return model(mb["tokens"], mb["position_ids"], None, packed_seq_params=params)


def lockstep_forward(model, ref_gpt, mb: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """This stage of the actor (`model`, with grad) and of the frozen reference (`ref_gpt`, no grad, no saved
    activations) on the same micro-batch of b rows.

    Between pipeline stages the two travel as one tensor [s, 2b, h] (s/tp under sequence parallelism): actor
    rows first, then the reference's. The schedule has handed the received tensor to the actor
    (set_input_tensor); it is split here, the reference's half detached, so its gradient is zero and the
    backward pass stops there. Returns (actor logits [b, s, V/tp], reference logits [b, s, V/tp]) on the last
    stage (with the fused output layer both models' output-layer inputs, [b, s, h]), else (the [s, 2b, h]
    tensor to send on, None)."""
    from grpo_mega.models.lora import adapters_disabled

    ps = parallel_state()
    b = mb["tokens"].shape[0]
    gpt = unwrap(model)
    first = ps.is_pipeline_first_stage()
    if not first:
        both = gpt.decoder.input_tensor
        gpt.decoder.set_input_tensor(both[:, :b].contiguous())
    out = forward_micro(model, mb)
    if not first:  # after the actor's forward: under LoRA the reference is the same module (adapters off)
        ref_gpt.decoder.set_input_tensor(both[:, b:].detach().contiguous())
    with torch.no_grad(), adapters_disabled(ref_gpt):
        ref_out = forward_micro(ref_gpt, mb)
    if ps.is_pipeline_last_stage():
        return out, ref_out
    return torch.cat([out, ref_out], dim=1), None


def token_stats(logits: torch.Tensor, mb: dict, model_cfg: ModelConfig, batch: BatchConfig, temperature: float,
                 ref_logits: Optional[torch.Tensor] = None):
    """(logprob, entropy, full KL or None) of the micro-batch's response positions, in its padded [n, L']
    layout, from vocab-parallel logits (a packed row's per-token results gathered back through
    `unpack_index`; with mb["out_positions"], logits [1, K, V/tp] at those positions, placed back through
    `out_mask`: 0 at every other position, as the loss masks them anyway). `ref_logits` (the reference's, for the full KL) are given up: the backward pass writes
    the gradient of `logits` into their memory. With mb["output_weights"] (`with_fused_output`), `logits` and
    `ref_logits` are the output layer's inputs [..., h] and the fused op makes the logits chunk by chunk."""
    labels = mb["labels"]
    if "out_positions" in mb:  # logits [1, K, V/tp] at the loss's positions only
        seq, row = mb["out_positions"]
        labels = labels[row, seq].unsqueeze(0)
    if "output_weights" in mb:
        logp, entropy, kl = fused_token_stats(logits, labels, mb["output_weights"], model_cfg, batch, temperature,
                                               ref_logits)
    else:
        logp, entropy, kl = vocab_parallel_stats(
            logits, labels, parallel_state().get_tensor_model_parallel_group(), ref_logits=ref_logits,
            temperature=temperature, vocab_size=model_cfg.vocab_size, chunk_size=batch.logprob_chunk_size,
            donate_ref_logits=ref_logits is not None and logits.requires_grad,
        )
    if "out_positions" in mb:
        place = partial(_place, mb["out_mask"])
    else:
        place = partial(unpack, mb)
    return place(logp), place(entropy), (place(kl) if kl is not None else None)


# ---- the fused output layer (batch.fused_output; grpo_mega/parallel/fused_output.py) -----------------------


def with_fused_output(mb: dict, batch: BatchConfig, model, ref_gpt=None) -> dict:
    """With batch.fused_output: the micro-batch carries mb["output_weights"], (this stage's output weight, the
    reference's or None; None off the last stage): `forward_micro` then has the models return the output layer's
    input instead of logits, and `token_stats` runs the fused op with these weights."""
    if not batch.fused_output:
        return mb
    from grpo_mega.models.forward_hooks import output_weight

    ref = output_weight(ref_gpt) if ref_gpt is not None else None
    return {**mb, "output_weights": (output_weight(unwrap(model)), ref)}


def fused_token_stats(hidden: torch.Tensor, labels: torch.Tensor, weights: tuple, model_cfg: ModelConfig,
                       batch: BatchConfig, temperature: float, ref_hidden: Optional[torch.Tensor]):
    """`token_stats`' vocab-parallel op, fused with the output layer: hidden (and ref_hidden) [..., h]."""
    weight, ref_weight = weights
    return fused_output_stats(
        hidden, weight, labels, parallel_state().get_tensor_model_parallel_group(), ref_hidden=ref_hidden,
        ref_weight=ref_weight if ref_hidden is not None else None, temperature=temperature,
        vocab_size=model_cfg.vocab_size, chunk_size=batch.logprob_chunk_size,
    )


# -----------------------------------------------------------------------------------------------------------


def _place(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-token values [1, K] at the True positions of `mask` [n, L'] (row-major; the first of them if K is
    larger: `with_positions`' unused position), 0 elsewhere (differentiable)."""
    return torch.zeros(mask.shape, dtype=t.dtype, device=t.device).masked_scatter(mask, t.reshape(-1))


def forward_logprobs(module, model_cfg: ModelConfig, parallel: ParallelConfig, batch: BatchConfig,
                     rollout: RolloutBatch, temperature: float) -> torch.Tensor:
    """Position-aligned logprobs [N, L] (fp32, no grad) of every response token under `module`, on every rank.

    Each DP rank runs its share in micro-batches (packed or padded, see `layout`); the last stage computes
    the vocab-parallel logprobs; every row comes from exactly one DP rank, so one SUM over DP assembles
    them, and the last stage sends the result to every pipeline stage.
    """
    rollout.check_vocab(model_cfg.vocab_size)
    micro, length, _ = layout(rollout, parallel, batch, chunk_of(rollout.size, batch))

    def loss_func(mb, logits):
        lp = token_stats(logits, mb, model_cfg, batch, temperature)[0] * mb["mask"]
        return torch.zeros((), device=logits.device), {"logp": lp, "rows": mb["rows"]}

    def forward_step(data_iterator, model):
        mb = with_fused_output(with_positions(to_device(next(data_iterator)), batch), batch, model)
        return forward_micro(model, mb), partial(loss_func, mb)

    with torch.no_grad():
        out = run_schedule(module, micro, length, forward_step, forward_only=True)
    return assemble_logprobs(out, rollout)


def assemble_logprobs(out: list[dict], rollout: RolloutBatch) -> torch.Tensor:
    """[N, L] on every rank from the last stage's per-micro-batch {"logp", "rows"}: every row comes from exactly
    one DP rank, so one SUM over DP assembles them; the last stage sends the result to every pipeline stage."""
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    full = torch.zeros(rollout.size, rollout.tokens.shape[1], dtype=torch.float32, device=dev)
    if parallel_state().is_pipeline_last_stage():
        for d in out:
            lp = d["logp"].float()
            width = min(lp.shape[1], full.shape[1])
            full[d["rows"].to(dev), :width] = lp[:, :width]
    return comm.broadcast_from_last_stage(comm.dp_all_reduce(full)).cpu()
