"""megatron-core smoke step: a tiny GPTModel, forward and backward through Megatron's pipeline schedule.

This is what `make demo` runs until the GRPO loop exists. It builds a tiny Qwen2-style GPTModel (RMSNorm,
SwiGLU, GQA, RoPE, qkv bias) with the local layer spec at layout 1x1, saves its weights with
`dist_checkpointing`, loads them at the layout asked for (default TP2xPP2), runs the same micro-batches
through `get_forward_backward_func()` and one Adam step, and compares per-micro-batch losses and the
gradient norm with the 1x1 run.

    python -m grpo_mega.smoke --tp 2 --pp 2 --dp 1   # forks 1 rank, then tp*pp*dp ranks (CPU, gloo)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed

# The smoke model: small enough for CPU ranks, with every Llama/Qwen2 feature the trainer relies on.
TINY = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=32,
)


def build_tiny_gpt(tp: int, pp: int, seed: int = 1234):
    """Build this rank's stage of the smoke GPTModel, wrapped in megatron's DDP with a grad buffer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=TINY["num_layers"],
        hidden_size=TINY["hidden_size"],
        num_attention_heads=TINY["num_attention_heads"],
        num_query_groups=TINY["num_query_groups"],
        ffn_hidden_size=TINY["ffn_hidden_size"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=TINY["vocab_size"],
        max_sequence_length=TINY["seq_length"],
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # The schedule calls these after the last backward: DP all-reduce of the grad buffers (and the
    # embedding/layernorm grad syncs); without them each DP rank would step on its own gradient.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp


def smoke_batches(num_microbatches: int, micro_batch_size: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    seq = TINY["seq_length"]
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, TINY["vocab_size"], (micro_batch_size, seq + 1), generator=g)
        batches.append(
            dict(
                tokens=tokens[:, :-1].contiguous(),
                labels=tokens[:, 1:].contiguous(),
                position_ids=torch.arange(seq).expand(micro_batch_size, seq).contiguous(),
            )
        )
    return batches


def forward_backward(model, batches: list[dict], forward_only: bool = False) -> list[float]:
    """Run `batches` through Megatron's schedule; return per-micro-batch mean token losses (last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # [b, s]

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return per_token, loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=TINY["seq_length"],
        micro_batch_size=batches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )
    return [float(d["loss"]) for d in out]


def _build_optimizer(model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0, bf16=False, fp16=False, use_distributed_optimizer=True
    )
    return get_megatron_optimizer(cfg, [model])


def smoke_step(tp: int, pp: int, ckpt_dir: str, save: bool, num_microbatches: int = 4, micro_batch_size: int = 2):
    """One rank's smoke: build at tp x pp (dp = world / (tp * pp)), save or load the weights, forward and
    backward over this DP rank's share of the micro-batches, one Adam step, then a forward-only pass.

    Returns {micro-batch index: loss} before and after the step, the grad norm, and this rank's place."""
    with cpu_compat.cpu_device_mode():
        from megatron.core import dist_checkpointing

        layout = init_distributed(tp=tp, pp=pp, seed=1234)
        if num_microbatches % layout.dp:
            raise ValueError(f"num_microbatches={num_microbatches} must be divisible by dp={layout.dp}")
        model = build_tiny_gpt(tp, pp)
        if save:
            dist_checkpointing.save(model.module.sharded_state_dict(), ckpt_dir)
        else:
            state = dist_checkpointing.load(model.module.sharded_state_dict(), ckpt_dir)
            model.module.load_state_dict(state)
        optimizer = _build_optimizer(model)
        per_rank = num_microbatches // layout.dp
        first = layout.dp_rank * per_rank
        batches = smoke_batches(num_microbatches, micro_batch_size)[first : first + per_rank]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(model, batches)
        ok, grad_norm, _ = optimizer.step()
        after = forward_backward(model, batches, forward_only=True)
        destroy_distributed()
        return dict(
            losses={first + i: v for i, v in enumerate(losses)},
            losses_after_step={first + i: v for i, v in enumerate(after)},
            grad_norm=float(grad_norm),
            update_ok=bool(ok),
            layout=layout,
        )


def run_layout(tp: int, pp: int, dp: int, ckpt_dir: str, save: bool, timeout: float = 300.0) -> dict:
    """Fork tp*pp*dp gloo ranks running smoke_step; merge the last stages' results across DP ranks."""
    results = run_ranks(smoke_step, tp * pp * dp, tp, pp, ckpt_dir, save, timeout=timeout)
    last = [r for r in results if r["layout"].pp_rank == pp - 1]
    merged = dict(losses={}, losses_after_step={}, grad_norm=last[0]["grad_norm"])
    for r in last:
        merged["losses"].update(r["losses"])
        merged["losses_after_step"].update(r["losses_after_step"])
        if not r["update_ok"]:
            raise RuntimeError(f"optimizer step was skipped on rank layout {r['layout']}")
    for key in ("losses", "losses_after_step"):
        merged[key] = [merged[key][i] for i in sorted(merged[key])]
    return merged


def compare_layouts(tp: int, pp: int, dp: int) -> tuple[dict, dict, float]:
    """Run the smoke at 1x1 and at tp x pp x dp from the same weights; return both and the worst
    relative difference of any per-micro-batch loss (before and after the optimizer step) or grad norm."""
    with tempfile.TemporaryDirectory(prefix="grpo_mega_smoke_") as ckpt:
        ref = run_layout(1, 1, 1, ckpt, save=True)
        got = run_layout(tp, pp, dp, ckpt, save=False)
    pairs = list(zip(ref["losses"] + ref["losses_after_step"], got["losses"] + got["losses_after_step"]))
    pairs.append((ref["grad_norm"], got["grad_norm"]))
    worst = max(abs(a - b) / abs(a) for a, b in pairs)
    return ref, got, worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    args = ap.parse_args(argv)
    cpu_compat.apply()
    t0 = time.time()
    ref, got, worst = compare_layouts(args.tp, args.pp, args.dp)
    name = f"TP{args.tp}xPP{args.pp}xDP{args.dp}"
    print(f"megatron-core smoke: tiny GPTModel {TINY}, local layer spec, gloo on CPU")
    print(f"  TP1xPP1 (1 rank) -> dist_checkpointing -> {name} ({args.tp * args.pp * args.dp} ranks)")
    print(f"  forward+backward of 4 micro-batches of 2x{TINY['seq_length']} tokens via get_forward_backward_func, one Adam step")
    print(f"  {'micro-batch':>11}  {'loss TP1xPP1':>14}  {'loss ' + name:>16}")
    for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        print(f"  {i:>11}  {a:>14.8f}  {b:>16.8f}")
    print(f"  {'grad norm':>11}  {ref['grad_norm']:>14.8f}  {got['grad_norm']:>16.8f}")
    for i, (a, b) in enumerate(zip(ref["losses_after_step"], got["losses_after_step"])):
        print(f"  {'after step ' + str(i):>11}  {a:>14.8f}  {b:>16.8f}")
    verdict = "OK" if worst < 1e-6 else "MISMATCH"
    print(f"  worst relative difference {worst:.2e} (tolerance 1e-6): {verdict}; {time.time() - t0:.1f} s")
    return 0 if worst < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
