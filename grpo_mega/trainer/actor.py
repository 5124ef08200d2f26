"""The actor and the reference under Megatron: logprobs of the step's responses, and the GRPO update.

Owns: running batches through Megatron's pipeline schedule (`get_forward_backward_func`) in micro-batches;
the token statistics from vocab-parallel logits, which the policy loss (`grpo_mega.algo.POLICY_LOSSES`, that
also decides the loss's terms) turns into each micro-batch's loss; the mini-batch normaliser, computed once
per mini-batch over DP ranks, and the loss scaling that makes Megatron's own per-micro-batch division and
DP averaging cancel (docs/design.md, "Loss aggregation"); the optimizer step, LR schedule and per-mini-batch
metrics. With the full KL in the loss (`algo.kl_estimator=full`), the frozen reference runs in lockstep with the actor inside the
same schedule, so that both models' vocab-sharded logits meet in the loss of every micro-batch.
The math is grpo_mega.algo's, the collectives grpo_mega.parallel's.
"""

from __future__ import annotations

import contextlib
import logging
import math
from functools import partial
from typing import Optional

import torch

from grpo_mega import algo
from grpo_mega.conf.algo import AlgoConfig
from grpo_mega.conf.batch import BatchConfig
from grpo_mega.conf.lora import LoraConfig
from grpo_mega.conf.model import ModelConfig
from grpo_mega.conf.optim import OptimConfig, PrecisionConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.models.builder import Built, build_actor, build_reference, copy_weights, move_module
from grpo_mega.parallel import comm
from grpo_mega.parallel.fused_output import fused_output_stats
from grpo_mega.parallel.vocab_parallel import vocab_parallel_stats
from grpo_mega.trainer.batch import RolloutBatch, micro_batches, unpack

log = logging.getLogger(__name__)


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def _pad_multiple(parallel: ParallelConfig) -> int:
    return parallel.tp if parallel.sequence_parallel else 1


def _same_over_ranks(parallel: ParallelConfig) -> bool:
    """Every DP rank's i-th micro-batch has one shape: megatron's allgather token dispatcher (expert
    parallelism without CUDA; see grpo_mega.models.builder.moe_config) gathers equal token counts."""
    return parallel.ep > 1 and not torch.cuda.is_available()


def _chunk_of(size: int, batch: BatchConfig) -> Optional[int]:
    """The update's mini-batch size in responses when a batch of `size` is several of them, else None: a pass
    over the whole step batch then gives each DP rank the rows it trains (the logprob passes)."""
    if size % batch.mini_batches_per_step:
        return None
    per_mini = batch.mini_batch_responses(size)
    return per_mini if size > per_mini else None


def _padded_shares(size: int, dp: int, chunk: Optional[int]) -> list[list[int]]:
    """Without packing: contiguous DP shares of each chunk (of the whole batch without one), joined per rank."""
    chunk = chunk or size
    if chunk % dp:
        raise ValueError(f"{chunk} responses do not split over dp={dp} ranks")
    per = chunk // dp
    return [[i for start in range(0, size, chunk) for i in range(start + r * per, start + (r + 1) * per)]
            for r in range(dp)]


def dp_shares(seq_lens: list[int], parallel: ParallelConfig, batch: BatchConfig, dp: int,
              chunk: Optional[int] = None) -> list[list[int]]:
    """The rows (sequence indices) each DP rank runs in one pass over `seq_lens`, as `layout` assigns them:
    from the lengths alone, the same on every rank."""
    from grpo_mega.trainer.batch import plan_packing

    if batch.packing:
        plan = plan_packing(seq_lens, dp, batch.token_budget, _pad_multiple(parallel), same_length=parallel.pp > 1,
                            chunk=chunk, same_over_ranks=_same_over_ranks(parallel))
        return [sorted(i for row in plan.rows[r] for i in row) for r in range(dp)]
    return _padded_shares(len(seq_lens), dp, chunk)


def dp_rows(seq_lens: list[int], parallel: ParallelConfig, batch: BatchConfig, dp: int
            ) -> tuple[list[list[int]], list[list[int]]]:
    """Actor.dp_rows for `dp` DP ranks."""
    first = dp_shares(seq_lens, parallel, batch, dp, _chunk_of(len(seq_lens), batch))
    needs = [set(rows) for rows in first]
    per_mini = _chunk_of(len(seq_lens), batch) or len(seq_lens)
    for start in range(0, len(seq_lens), per_mini):
        for r, rows in enumerate(dp_shares(seq_lens[start:start + per_mini], parallel, batch, dp)):
            needs[r].update(start + i for i in rows)
    return first, [sorted(n) for n in needs]


def layout(rollout: RolloutBatch, parallel: ParallelConfig, batch: BatchConfig,
           chunk: Optional[int] = None) -> tuple[list[dict], int, dict]:
    """This DP rank's micro-batches of `rollout`, their (longest) length, and the layout's figures on every
    rank: micro_batches (per rank), computed and useful tokens (all ranks), dp_token_imbalance.

    Packed (batch.packing): sequences balanced over DP ranks by tokens and packed into rows of at most
    batch.token_budget tokens (docs/design.md, "Batch semantics"); with pipeline parallelism every row of a
    rank is padded to the
    rank's longest (one tensor shape for the schedule's point-to-point sends). Padded: contiguous DP shares
    in micro_batch_size rows, each trimmed to its share's longest. With `chunk`, the DP shares are those of
    each run of `chunk` rows (the update's mini-batches) joined: each rank runs the rows it will train. Every
    micro-batch carries `rows`, the indices of its sequences in `rollout`."""
    from grpo_mega.trainer.batch import packed_micro_batches, plan_packing

    ps = _ps()
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    seq_lens = (rollout.prompt_lens + rollout.response_lens).tolist()
    pad = _pad_multiple(parallel)
    if batch.packing:
        plan = plan_packing(seq_lens, dp, batch.token_budget, pad, same_length=parallel.pp > 1, chunk=chunk,
                            same_over_ranks=_same_over_ranks(parallel))
        micro = packed_micro_batches(rollout, plan, rank)
        stats = dict(micro_batches=plan.micro_batches, computed_tokens=plan.computed, useful_tokens=plan.useful,
                     dp_token_imbalance=plan.dp_token_imbalance(seq_lens))
        return micro, max(plan.lengths[rank]), stats
    shares = _padded_shares(rollout.size, dp, chunk)
    computed, per_rank = 0, []
    for rows in shares:
        longest = max(seq_lens[i] for i in rows)
        computed += len(rows) * max(pad, -(-longest // pad) * pad)
        per_rank.append(sum(seq_lens[i] for i in rows))
    index = torch.tensor(shares[rank], dtype=torch.long)
    longest = max(seq_lens) if _same_over_ranks(parallel) else None
    micro, length = micro_batches(rollout.rows_at(index), batch.micro_batch_size, pad, longest)
    for mb in micro:
        mb["rows"] = index[mb["rows"]]
    mean = sum(per_rank) / dp
    stats = dict(micro_batches=len(micro), computed_tokens=computed, useful_tokens=sum(seq_lens),
                 dp_token_imbalance=max(per_rank) / mean if mean else 1.0)
    return micro, length, stats


def torch_optimizers(optimizer) -> list:
    """The torch optimizers under megatron's `optimizer`: one, or with expert parallelism two (megatron chains
    an optimizer for the dense parameters and one for the experts)."""
    return [part.optimizer for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]]


def fuse_cpu_adam(optimizer) -> None:
    """Without Transformer Engine or Apex megatron-core falls back to torch.optim.AdamW, which on CPU tensors
    runs its per-parameter loop (a dozen elementwise kernels per parameter per step: 5.5 of the 34 s of a
    SmolLM2-135M update here). torch's fused AdamW does the same update in one pass per parameter, and is
    what transformers' Trainer (hence TRL) uses on torch >= 2.8: set it on every torch Adam under megatron's
    optimizer whose parameters are on the CPU (on GPUs TE's FusedAdam is used, or torch's foreach default)."""
    for inner in torch_optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam
            continue
        for group in inner.param_groups:
            if all(p.device.type == "cpu" for p in group["params"]):
                group["fused"], group["foreach"] = True, False


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


def _on_device(mb: dict) -> dict:
    """A micro-batch's tensors (built in host memory) on the model's device: the current GPU, or the CPU.
    Moved one micro-batch at a time, as the schedule asks for it."""
    if not torch.cuda.is_available():
        return mb
    dev = torch.device("cuda", torch.cuda.current_device())
    return {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in mb.items()}


def _unwrap(model):
    """The GPTModel inside a (DDP-)wrapped module."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _with_positions(mb: dict, batch: BatchConfig) -> dict:
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


def _forward(model, mb: dict) -> torch.Tensor:
    """Logits [b, s, V/tp] on the last stage (hidden states elsewhere); with mb["out_positions"] (K of
    them, see `_with_positions`) logits [1, K, V/tp] at those positions alone; with mb["output_weights"]
    (`_with_fused_output`) the output layer's input instead of its logits, [b, s, h] or [1, K, h]. A packed row ([1, S])
    reaches the model as THD with cu_seqlens under Transformer Engine; on megatron-core's local spec its
    cu_seqlens go where the attention mask would (SDPACoreAttention attends within each sequence) and RoPE
    positions restart per sequence. With mb["routes"] the MoE
    layers route to the rollout engine's experts (grpo_mega.models.routing_replay)."""
    from grpo_mega.models.builder import set_output_hidden, set_output_positions
    from grpo_mega.models.routing_replay import set_routes

    gpt = _unwrap(model)
    set_output_positions(gpt, mb.get("out_positions"))
    set_output_hidden(gpt, "output_weights" in mb)
    set_routes(gpt, mb.get("routes"), gpt.config.sequence_parallel)  # the engine's experts (routing replay)
    try:
        return _forward_rows(model, gpt, mb)
    finally:
        set_output_positions(gpt, None)
        set_output_hidden(gpt, False)
        set_routes(gpt, None)


def _forward_rows(model, gpt, mb: dict) -> torch.Tensor:
    """`_forward`'s model call, padded rows or a packed one."""
    from grpo_mega.models.builder import have_transformer_engine, set_rope_positions
    from grpo_mega.models.local_attention import packed_row_mask

    if "cu_seqlens" not in mb:
        set_rope_positions(gpt, None)
        return model(mb["tokens"], mb["position_ids"], None)
    if not have_transformer_engine():
        set_rope_positions(gpt, mb["position_ids"][0])
        return model(mb["tokens"], mb["position_ids"], packed_row_mask(mb["cu_seqlens"], len(mb["rows"])))
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb["cu_seqlens"]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=mb["max_seqlen"], max_seqlen_kv=mb["max_seqlen"])
    set_rope_positions(gpt, None)
    return model(mb["tokens"], mb["position_ids"], None, packed_seq_params=params)


def _lockstep_forward(model, ref_gpt, mb: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """This stage of the actor (`model`, with grad) and of the frozen reference (`ref_gpt`, no grad, no saved
    activations) on the same micro-batch of b rows.

    Between pipeline stages the two travel as one tensor [s, 2b, h] (s/tp under sequence parallelism): actor
    rows first, then the reference's. The schedule has handed the received tensor to the actor
    (set_input_tensor); it is split here, the reference's half detached, so its gradient is zero and the
    backward pass stops there. Returns (actor logits [b, s, V/tp], reference logits [b, s, V/tp]) on the last
    stage (with the fused output layer both models' output-layer inputs, [b, s, h]), else (the [s, 2b, h]
    tensor to send on, None)."""
    from grpo_mega.models.lora import adapters_disabled

    ps = _ps()
    b = mb["tokens"].shape[0]
    gpt = _unwrap(model)
    first = ps.is_pipeline_first_stage()
    if not first:
        both = gpt.decoder.input_tensor
        gpt.decoder.set_input_tensor(both[:, :b].contiguous())
    out = _forward(model, mb)
    if not first:  # after the actor's forward: under LoRA the reference is the same module (adapters off)
        ref_gpt.decoder.set_input_tensor(both[:, b:].detach().contiguous())
    with torch.no_grad(), adapters_disabled(ref_gpt):
        ref_out = _forward(ref_gpt, mb)
    if ps.is_pipeline_last_stage():
        return out, ref_out
    return torch.cat([out, ref_out], dim=1), None


def _token_stats(logits: torch.Tensor, mb: dict, model_cfg: ModelConfig, batch: BatchConfig, temperature: float,
                 ref_logits: Optional[torch.Tensor] = None):
    """(logprob, entropy, full KL or None) of the micro-batch's response positions, in its padded [n, L']
    layout, from vocab-parallel logits (a packed row's per-token results gathered back through
    `unpack_index`; with mb["out_positions"], logits [1, K, V/tp] at those positions, placed back through
    `out_mask`: 0 at every other position, as the loss masks them anyway). `ref_logits` (the reference's, for the full KL) are given up: the backward pass writes
    the gradient of `logits` into their memory. With mb["output_weights"] (`_with_fused_output`), `logits` and
    `ref_logits` are the output layer's inputs [..., h] and the fused op makes the logits chunk by chunk."""
    labels = mb["labels"]
    if "out_positions" in mb:  # logits [1, K, V/tp] at the loss's positions only
        seq, row = mb["out_positions"]
        labels = labels[row, seq].unsqueeze(0)
    if "output_weights" in mb:
        logp, entropy, kl = _fused_token_stats(logits, labels, mb["output_weights"], model_cfg, batch, temperature,
                                               ref_logits)
    else:
        logp, entropy, kl = vocab_parallel_stats(
            logits, labels, _ps().get_tensor_model_parallel_group(), ref_logits=ref_logits,
            temperature=temperature, vocab_size=model_cfg.vocab_size, chunk_size=batch.logprob_chunk_size,
            donate_ref_logits=ref_logits is not None and logits.requires_grad,
        )
    if "out_positions" in mb:
        place = partial(_place, mb["out_mask"])
    else:
        place = partial(unpack, mb)
    return place(logp), place(entropy), (place(kl) if kl is not None else None)


# ---- the fused output layer (batch.fused_output; grpo_mega/parallel/fused_output.py) -----------------------


def _with_fused_output(mb: dict, batch: BatchConfig, model, ref_gpt=None) -> dict:
    """With batch.fused_output: the micro-batch carries mb["output_weights"], (this stage's output weight, the
    reference's or None; None off the last stage): `_forward` then has the models return the output layer's
    input instead of logits, and `_token_stats` runs the fused op with these weights."""
    if not batch.fused_output:
        return mb
    from grpo_mega.models.builder import output_weight

    ref = output_weight(ref_gpt) if ref_gpt is not None else None
    return {**mb, "output_weights": (output_weight(_unwrap(model)), ref)}


def _fused_token_stats(hidden: torch.Tensor, labels: torch.Tensor, weights: tuple, model_cfg: ModelConfig,
                       batch: BatchConfig, temperature: float, ref_hidden: Optional[torch.Tensor]):
    """`_token_stats`' vocab-parallel op, fused with the output layer: hidden (and ref_hidden) [..., h]."""
    weight, ref_weight = weights
    return fused_output_stats(
        hidden, weight, labels, _ps().get_tensor_model_parallel_group(), ref_hidden=ref_hidden,
        ref_weight=ref_weight if ref_hidden is not None else None, temperature=temperature,
        vocab_size=model_cfg.vocab_size, chunk_size=batch.logprob_chunk_size,
    )


# -----------------------------------------------------------------------------------------------------------


def _place(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-token values [1, K] at the True positions of `mask` [n, L'] (row-major; the first of them if K is
    larger: `_with_positions`' unused position), 0 elsewhere (differentiable)."""
    return torch.zeros(mask.shape, dtype=t.dtype, device=t.device).masked_scatter(mask, t.reshape(-1))


def forward_logprobs(module, model_cfg: ModelConfig, parallel: ParallelConfig, batch: BatchConfig,
                     rollout: RolloutBatch, temperature: float) -> torch.Tensor:
    """Position-aligned logprobs [N, L] (fp32, no grad) of every response token under `module`, on every rank.

    Each DP rank runs its share in micro-batches (packed or padded, see `layout`); the last stage computes
    the vocab-parallel logprobs; every row comes from exactly one DP rank, so one SUM over DP assembles
    them, and the last stage sends the result to every pipeline stage.
    """
    rollout.check_vocab(model_cfg.vocab_size)
    micro, length, _ = layout(rollout, parallel, batch, _chunk_of(rollout.size, batch))

    def loss_func(mb, logits):
        lp = _token_stats(logits, mb, model_cfg, batch, temperature)[0] * mb["mask"]
        return torch.zeros((), device=logits.device), {"logp": lp, "rows": mb["rows"]}

    def forward_step(data_iterator, model):
        mb = _with_fused_output(_with_positions(_on_device(next(data_iterator)), batch), batch, model)
        return _forward(model, mb), partial(loss_func, mb)

    with torch.no_grad():
        out = run_schedule(module, micro, length, forward_step, forward_only=True)
    return assemble_logprobs(out, rollout)


def assemble_logprobs(out: list[dict], rollout: RolloutBatch) -> torch.Tensor:
    """[N, L] on every rank from the last stage's per-micro-batch {"logp", "rows"}: every row comes from exactly
    one DP rank, so one SUM over DP assembles them; the last stage sends the result to every pipeline stage."""
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    full = torch.zeros(rollout.size, rollout.tokens.shape[1], dtype=torch.float32, device=dev)
    if _ps().is_pipeline_last_stage():
        for d in out:
            lp = d["logp"].float()
            width = min(lp.shape[1], full.shape[1])
            full[d["rows"].to(dev), :width] = lp[:, :width]
    return comm.broadcast_from_last_stage(comm.dp_all_reduce(full)).cpu()


class Reference:
    """The frozen reference policy: same placement as the actor; its logprobs, or its logits inside the
    actor's update (`Actor.update(..., reference=)`, full KL in the loss). With `offload`, its weights wait
    in host memory between uses and visit the GPU only for those."""

    def __init__(self, model_cfg: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, batch: BatchConfig,
                 offload: bool = False, replay: bool = True):
        self.model_cfg, self.parallel, self.batch = model_cfg, parallel, batch
        self.built = build_reference(model_cfg, parallel, precision)
        if model_cfg.is_moe:  # `replay`: routes given with the rollout are followed (False: only compared)
            from grpo_mega.models import routing_replay

            routing_replay.install(self.built.gpt, model_cfg.moe_layers())
            routing_replay.set_replay(self.built.gpt, replay)
        self.offload = offload and torch.cuda.is_available()
        if self.offload:
            move_module(self.built.gpt, "cpu")

    @contextlib.contextmanager
    def on_device(self):
        """The weights on this rank's GPU for the duration (with `offload`; nothing to do otherwise)."""
        if self.offload:
            move_module(self.built.gpt, f"cuda:{torch.cuda.current_device()}")
        try:
            yield self.built.gpt
        finally:
            if self.offload:
                move_module(self.built.gpt, "cpu")

    def logprobs(self, rollout: RolloutBatch, temperature: float) -> torch.Tensor:
        with self.on_device():
            return forward_logprobs(self.built.module, self.model_cfg, self.parallel, self.batch, rollout, temperature)

    def load_from(self, actor: "Actor") -> None:
        """Iterative RL: the reference becomes a copy of the current policy."""
        copy_weights(actor.built.gpt, self.built.gpt)


class AdapterOffReference:
    """The reference under LoRA: the actor itself with its adapters off (grpo_mega.models.lora), the same
    placement, forward and lockstep path as `Reference`, no second copy of the weights."""

    def __init__(self, actor: "Actor"):
        self.model_cfg, self.parallel, self.batch = actor.model_cfg, actor.parallel, actor.batch
        gpt = actor.built.gpt
        self.built = Built(module=gpt, gpt=gpt, config=actor.built.config)

    @contextlib.contextmanager
    def on_device(self):
        yield self.built.gpt

    def logprobs(self, rollout: RolloutBatch, temperature: float) -> torch.Tensor:
        from grpo_mega.models.lora import adapters_disabled

        with adapters_disabled(self.built.gpt):
            return forward_logprobs(self.built.module, self.model_cfg, self.parallel, self.batch, rollout, temperature)

    def load_from(self, actor: "Actor") -> None:
        """Nothing to copy: the base weights are the actor's, frozen."""
        if actor.built.gpt is not self.built.gpt:
            raise ValueError("AdapterOffReference.load_from: a different actor; the reference is its own actor's base")


class Actor:
    """The trainable policy: Megatron DDP + optimizer + LR schedule, and the GRPO update."""

    def __init__(self, model_cfg: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                 optim: OptimConfig, algo_cfg: AlgoConfig, batch: BatchConfig, lora: Optional[LoraConfig] = None):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.model_cfg, self.parallel, self.precision = model_cfg, parallel, precision
        self.optim, self.algo, self.batch = optim, algo_cfg, batch
        self.policy_loss = algo.POLICY_LOSSES.get(algo_cfg.policy_loss)
        self.objective = algo_cfg.objective()
        self.lora = lora if lora is not None and lora.enabled else None
        self.built = build_actor(model_cfg, parallel, precision, optim.use_distributed_optimizer, self.lora)
        self.moe = None
        if model_cfg.is_moe:
            from grpo_mega.models.moe_metrics import MoEMetrics

            self.moe = MoEMetrics(self.built.gpt, model_cfg.num_layers, model_cfg.num_experts, parallel.sequence_parallel)
            from grpo_mega.models import routing_replay

            routing_replay.install(self.built.gpt, model_cfg.moe_layers())
            # algo.routing_replay=measure: the engine's routes are compared with the routers' own, not followed
            routing_replay.set_replay(self.built.gpt, algo_cfg.routing_replay != "measure")
        bf16 = precision.params_dtype == "bf16"
        self.params_dtype = torch.bfloat16 if bf16 else torch.float32
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                sgd_momentum=optim.sgd_momentum, clip_grad=optim.clip_grad, bf16=bf16, fp16=False,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=optim.use_distributed_optimizer,
            ),
            [self.built.module],
        )
        fuse_cpu_adam(self.optimizer)
        decay = optim.lr_decay_steps or 1
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.min_lr,
            lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(decay, optim.lr_warmup_steps + 1),
            lr_decay_style=optim.lr_decay_style,
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
            # On resume the schedule's settings come from this run's config (a changed optim.lr takes
            # effect; the loop prints what changed), its position (steps taken) from the checkpoint.
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
        )
        self.skipped_early_stop = 0
        self.skipped_nonfinite = 0

    def logprobs(self, rollout: RolloutBatch, temperature: float) -> torch.Tensor:
        if self.model_cfg.is_moe:  # routing_agreement() after this counts this pass alone
            from grpo_mega.models.routing_replay import take_agreement

            take_agreement(self.built.gpt)
        return forward_logprobs(self.built.module, self.model_cfg, self.parallel, self.batch, rollout, temperature)

    def routing_agreement(self) -> dict:
        """Collective: {"moe/routing_agreement": share} over the actor's forwards since the last call or the last
        `logprobs` (the loop asks after the pass on the weights the engine sampled with: the old-logprob pass, or
        the exactly on-policy update), with the engine's routes: of the (token, MoE layer) pairs the engine
        routed, the share where the trainer's own top-k of its router logits is the engine's set
        (grpo_mega.models.routing_replay; counted whether or not the routes are replayed, algo.routing_replay=
        rollout or measure: under replay a layer's inputs are those the replayed layers before it made). {} for a
        dense model or without routes."""
        if not self.model_cfg.is_moe:
            return {}
        from grpo_mega.models.routing_replay import world_agreement

        share = world_agreement(self.built.gpt)
        return {} if share is None else {"moe/routing_agreement": share}

    def dp_rows(self, seq_lens: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """For a step's batch of these sequence lengths: (each DP rank's rows in the logprob pass, a partition
        of the batch; every row each DP rank runs in any pass of the step: that pass and every mini-batch of
        `update`). From the lengths alone: what rollout routing sends each DP replica (grpo_mega.rollout.
        routing)."""
        return dp_rows(seq_lens, self.parallel, self.batch, _ps().get_data_parallel_world_size())

    @property
    def full_kl_in_loss(self) -> bool:
        """The loss's KL term is the full-vocabulary KL: the update needs the reference's logits."""
        return self.objective.full_kl_in_loss

    # ---- the loss of one micro-batch (last pipeline stage) --------------------------------------------

    def _loss(self, mb: dict, normaliser: torch.Tensor, scale: int, temperature: float,
              ref_logits: Optional[torch.Tensor], logits: torch.Tensor):
        """The micro-batch's scaled policy loss (`algo.policy_loss`, grpo_mega.algo.POLICY_LOSSES) and its
        metric sums. logits, ref_logits: [b, s, V/tp] (the reference's only with the full KL in the loss,
        without grad); with batch.fused_output the output layer's inputs [b, s, h] (`_with_fused_output`)."""
        logp, entropy, full_kl = _token_stats(logits, mb, self.model_cfg, self.batch, temperature, ref_logits)
        on_policy = "old_logp" not in mb
        if on_policy:  # the exactly on-policy step: the old logprobs are this forward's, detached (ratio 1)
            mb["old_logp"] = logp.detach()
        loss, stats = self.policy_loss(
            self.objective, logp=logp, old_logp=mb["old_logp"], advantages=mb["advantages"], mask=mb["mask"],
            normaliser=normaliser, entropy=entropy, ref_logp=mb.get("ref_logp"), full_kl=full_kl,
            engine_logp=mb.get("engine_logp"),
        )
        if on_policy:  # they become rollout.old_logp (engine/trainer mismatch metrics)
            stats.update(logp=logp.detach() * mb["mask"], rows=mb["rows"])
        return loss * scale, stats

    def update(self, rollout: RolloutBatch, temperature: float = 1.0, reference: Optional[Reference] = None) -> list[dict]:
        """`ppo_epochs` passes over the step's mini-batches, one optimizer step each. Needs
        rollout.advantages, rollout.old_logp, and with the KL term in the loss rollout.ref_logp, or for
        `algo.kl_estimator=full` the `reference` itself (it runs in lockstep with the actor; ref_logp is
        not used). Returns one metrics dict per mini-batch, identical on every rank.

        Without rollout.old_logp the update is the exactly on-policy step (one epoch, one mini-batch: the
        weights have not moved since the samples' logprobs would have been computed): each token's old logprob
        is the update forward's own, detached, and rollout.old_logp is filled from them afterwards: the loss,
        gradient and metrics are those of the path with a separate old-logprob pass, without its forward."""
        if rollout.advantages is None:
            raise ValueError("update() needs rollout.advantages")
        rollout.check_vocab(self.model_cfg.vocab_size)
        if self.full_kl_in_loss and reference is None:
            raise ValueError("algo.kl_estimator='full' with algo.kl_coef != 0 needs the reference's logits: "
                             "pass the Reference, Actor.update(rollout, temperature, reference=reference)")
        if self.objective.kl_in_loss and not self.full_kl_in_loss and rollout.ref_logp is None:
            raise ValueError(f"algo.kl_coef != 0 with algo.kl_estimator={self.algo.kl_estimator!r} needs rollout.ref_logp")
        ps = _ps()
        dp = ps.get_data_parallel_world_size()
        per_mini = self.batch.mini_batch_responses(rollout.size)
        self.batch.check_layout(self.parallel, dp, per_mini // self.batch.ppo_mini_batch_size)
        on_policy = rollout.old_logp is None
        if on_policy and (self.algo.ppo_epochs != 1 or per_mini != rollout.size):
            raise ValueError(f"update() without rollout.old_logp is the exactly on-policy step; with algo.ppo_epochs="
                             f"{self.algo.ppo_epochs} and {rollout.size // per_mini} mini-batches it needs the old logprobs")
        ref = reference if self.full_kl_in_loss else None
        metrics = []
        with ref.on_device() if ref is not None else contextlib.nullcontext():
            for _ in range(self.algo.ppo_epochs):
                for start in range(0, rollout.size, per_mini):
                    mini = rollout.rows(start, start + per_mini)
                    metrics.append(self._update_mini_batch(mini, temperature, ref, keep_logp=on_policy))
        if on_policy:
            rollout.old_logp = assemble_logprobs(metrics[0].pop("old_logp"), rollout)
        return metrics

    def _update_mini_batch(self, mini: RolloutBatch, temperature: float, reference: Optional[Reference] = None,
                           keep_logp: bool = False) -> dict:
        ps = _ps()
        dp = ps.get_data_parallel_world_size()
        micro, length, shape = layout(mini, self.parallel, self.batch)
        # The normaliser belongs to the mini-batch: every micro-batch's share, summed over DP ranks.
        normaliser = sum(
            algo.local_normaliser(self.algo.loss_agg_mode, mb["mask"], self.batch.max_response_length) for mb in micro
        ).to(torch.float64)
        comm.dp_all_reduce(normaliser)
        scale = algo.megatron_loss_scale(len(micro), dp)

        def forward_step(data_iterator, model):
            mb = _with_positions(_on_device(next(data_iterator)), self.batch)
            mb = _with_fused_output(mb, self.batch, model, reference.built.gpt if reference is not None else None)
            if reference is None:
                return _forward(model, mb), partial(self._loss, mb, normaliser.float(), scale, temperature, None)
            out, ref_logits = _lockstep_forward(model, reference.built.gpt, mb)
            return out, partial(self._loss, mb, normaliser.float(), scale, temperature, ref_logits)

        module = self.built.module
        module.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe is not None:
            self.moe.start()
        out = run_schedule(module, micro, length, forward_step, forward_only=False,
                           lockstep=1 if reference is None else 2)

        # The policy loss's metric sums (grpo_mega.algo.policy_loss.METRIC_*), over micro-batches, then ranks.
        sums = {k: 0.0 for k in algo.policy_loss.METRIC_SUMS}
        mins = {k: math.inf for k in algo.policy_loss.METRIC_MINS}
        maxs = {k: -math.inf for k in algo.policy_loss.METRIC_MAXS}
        for d in out:
            for k in sums:
                sums[k] += float(d[k])
            for k in mins:
                mins[k] = min(mins[k], float(d[k]))
            for k in maxs:
                maxs[k] = max(maxs[k], float(d[k]))
        sums, mins, maxs = comm.reduce_stage_metrics(sums, mins, maxs)
        m = {
            **algo.policy_loss.mini_batch_metrics(sums, mins, maxs),
            "lr": self.optimizer.param_groups[0]["lr"],
            **shape,
            **(self.moe.metrics(len(micro)) if self.moe is not None else {}),
        }
        if keep_logp:
            m["old_logp"] = [{"logp": d["logp"], "rows": d["rows"]} for d in out]
        if comm.any_rank(sums["extreme"] > 0):
            self.skipped_early_stop += 1
            module.zero_grad_buffer()
            m.update(grad_norm=float("nan"), skipped=1.0, skip_reason="early_stop_imp_ratio")
            return m
        # Megatron checks for inf/nan only under fp16 loss scaling: with bf16 or fp32 a non-finite gradient
        # would be stepped into the weights. Look at the loss and at this rank's grad buffers; all ranks
        # decide together. A buffer's sum is finite iff all its elements are (one read of the buffer:
        # torch.isfinite(buffer).all() writes three temporaries of its size, 0.75 s a step on smollm2-135m on
        # the CPU, bench_results/step_cpu.json); a sum that overflows is counted as non-finite (elements near
        # 1e30, which megatron's grad norm would already report as inf).
        bad = not math.isfinite(sums["loss"]) or not bool(
            torch.isfinite(torch.stack([b.grad_data.sum(dtype=torch.float32) for b in module.buffers])).all())
        if comm.any_rank(bad):
            self.skipped_nonfinite += 1
            module.zero_grad_buffer()
            self.optimizer.zero_grad()
            log.warning("mini-batch skipped: non-finite loss (%s) or gradient; the weights are unchanged", sums["loss"])
            m.update(grad_norm=float("nan"), skipped=1.0, skip_reason="non_finite")
            return m
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        m.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), skipped=0.0 if ok else 1.0,
                 skip_reason="" if ok else "optimizer")
        return m
