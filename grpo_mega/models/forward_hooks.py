"""Forward-time switches on a built GPTModel, set per micro-batch by grpo_mega.trainer.forward and reset after it.

RoPE at per-token positions (packed rows on the local spec), logits at picked positions only, and the output
layer's input instead of its logits (the fused loss, grpo_mega.parallel.fused_output): each wraps the module's
own forward once and is a no-op while unset.
"""

from __future__ import annotations

import torch


def set_rope_positions(gpt: torch.nn.Module, positions: "torch.Tensor | None") -> None:
    """RoPE at the given per-token positions ([S] int64) instead of 0..S-1 along the row, until reset (None).

    Packed rows on megatron-core's local layer spec: GPTModel builds its rotary embedding for positions
    0..S-1 of the row, so a sequence packed at offset o would be rotated as if it started at o. Attention
    scores under RoPE depend only on relative positions, so that is the same in exact arithmetic, but not
    in fp32 (the angle o * theta rounds differently for every o): positions restart at 0 per sequence
    here, which gives the padded path's numbers. (Transformer Engine's THD path restarts them itself, from
    cu_seqlens.)"""
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None:
        return
    if not hasattr(rope, "_unpositioned_forward"):
        rope._unpositioned_forward = rope.forward

        def forward(max_seq_len, *args, **kwargs):
            pos = rope._positions
            if pos is None:
                return rope._unpositioned_forward(max_seq_len, *args, **kwargs)
            emb = rope._unpositioned_forward(int(pos.max()) + 1, *args, **kwargs)  # [P, 1, 1, dim]
            return emb[pos.to(emb.device)]  # [S, 1, 1, dim]

        rope.forward = forward
    rope._positions = positions


def set_output_positions(gpt: torch.nn.Module, positions: "tuple[torch.Tensor, torch.Tensor] | None") -> None:
    """The output layer on this rank (the last pipeline stage) computes logits at `positions` only, until
    reset (None): (sequence index [K], batch index [K]) into the decoder's [s, b, h] hidden states; the model
    then returns logits [1, K, V/tp] (GPTModel's [s, b] -> [b, s] transpose of [K, 1, V/tp]).

    The positions are picked from the full [s, b, h] hidden states: under sequence parallelism (each rank
    holding s/tp of them) they are all-gathered first, as ColumnParallelLinear would, and the layer then
    runs as without sequence parallelism (its input gradient all-reduced over TP, the gather's backward
    keeping this rank's s/tp share): megatron-core 0.16.1's own last-token-logits path in
    `GPTModel._postprocess` does the same. Weight gradient and logits at the picked positions are those of
    the full layer's; no [s, b, V/tp] tensor is made."""
    layer = _patched_output_layer(gpt)
    if layer is not None:
        layer._positions = positions


def set_output_hidden(gpt: torch.nn.Module, on: bool) -> None:
    """With `on` (batch.fused_output), until reset: the output layer on this rank (the last pipeline stage)
    returns its input after ColumnParallelLinear's tensor-parallel mapping instead of logits, at the positions
    of `set_output_positions` if set; the model then returns [b, s, h] (or [1, K, h]) for
    grpo_mega.parallel.fused_output, whose weight is `output_weight(gpt)`. Its backward reduces the input
    gradient over TP as the layer's would (grpo_mega.parallel.fused_output.output_layer_input)."""
    layer = _patched_output_layer(gpt)
    if layer is not None:
        layer._return_input = on


def output_weight(gpt: torch.nn.Module) -> "torch.Tensor | None":
    """The weight GPTModel hands its output layer on this rank: the embedding's when tied on a stage that holds
    it, else the output layer's own (the last stage's copy of a tied embedding with pp > 1); None off the last
    stage."""
    if getattr(gpt, "output_layer", None) is None:
        return None
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _patched_output_layer(gpt: torch.nn.Module):
    """This rank's output layer with its forward wrapped for `set_output_positions` and `set_output_hidden`
    (once); None off the last pipeline stage."""
    layer = getattr(gpt, "output_layer", None)
    if layer is None:  # not the last pipeline stage
        return None
    if hasattr(layer, "_all_positions_forward"):
        return layer
    layer._all_positions_forward = layer.forward
    layer._positions, layer._return_input = None, False

    def forward(hidden, *args, **kwargs):
        picked = layer._positions
        if picked is None and not layer._return_input:
            return layer._all_positions_forward(hidden, *args, **kwargs)
        if layer._return_input:
            from grpo_mega.parallel.fused_output import output_layer_input

            sp = layer.sequence_parallel
            if picked is not None:
                hidden, sp = _pick(layer, hidden, picked), False
            return output_layer_input(hidden, layer.tp_group, sp), None
        if not layer.sequence_parallel:
            seq, row = picked
            return layer._all_positions_forward(hidden[seq, row].unsqueeze(1), *args, **kwargs)
        picked_hidden = _pick(layer, hidden, picked)
        layer.sequence_parallel, layer.allreduce_dgrad = False, True
        try:
            return layer._all_positions_forward(picked_hidden, *args, **kwargs)
        finally:
            layer.sequence_parallel, layer.allreduce_dgrad = True, False

    layer.forward = forward
    return layer


def _pick(layer, hidden: torch.Tensor, picked) -> torch.Tensor:
    """[K, 1, h] hidden states at the picked (sequence, batch) positions of the full [s, b, h]: all-gathered
    first under sequence parallelism (backward: this rank's share of the gradient)."""
    seq, row = picked
    if layer.sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=layer.tp_group)
    return hidden[seq, row].unsqueeze(1)
