"""megatron-core runs on CPU ranks: a tiny GPTModel (model_configs/tiny.yaml through the trainer's builder, local
spec) through get_forward_backward_func and the DistributedOptimizer, at several layouts, against TP1xPP1 from the
same weights (moved by dist_checkpointing): per-micro-batch losses before and after one Adam step, and the grad
norm. Megatron alone, no GRPO: the harness below is this test's own."""

import pytest
import torch

from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed

# fp32 on CPU: layouts differ only in the order of the reductions; measured worst 1.8e-7.
REL_TOL = 1e-6
SEQ_LENGTH = 32


def build_tiny_gpt(tp: int, pp: int):
    """This rank's stage of model_configs/tiny.yaml (fp32) in megatron's DDP, through the trainer's builder."""
    from grpo_mega.conf import ParallelConfig, PrecisionConfig, load_model_config
    from grpo_mega.models.builder import build_actor

    return build_actor(load_model_config("tiny"), ParallelConfig(tp=tp, pp=pp), PrecisionConfig(params_dtype="fp32")).module


def smoke_batches(num_microbatches: int, micro_batch_size: int, seed: int = 0) -> list[dict]:
    from grpo_mega.conf import load_model_config

    g = torch.Generator().manual_seed(seed)
    seq, vocab = SEQ_LENGTH, load_model_config("tiny").vocab_size
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, vocab, (micro_batch_size, seq + 1), generator=g)
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
    from grpo_mega.trainer.forward import run_schedule

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # [b, s]

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return per_token, loss_func

    out = run_schedule(model, batches, SEQ_LENGTH, forward_step, forward_only)
    return [float(d["loss"]) for d in out]


def _build_optimizer(model):
    # Adam's first step moves every weight by about lr * sign(g): a weight whose gradient is rounding noise
    # can move either way depending on the layout, so the losses after the step agree only to about lr
    # times that weight's influence. lr=1e-3 keeps that below the 1e-6 tolerance; 1e-2 does not.
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0, bf16=False, fp16=False, use_distributed_optimizer=True
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("smoke_ckpt"))
    return ckpt, run_layout(1, 1, 1, ckpt, save=True)


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 1), (2, 1, 2), (1, 4, 1), (4, 1, 1), (1, 2, 2)])
def test_layout_matches_tp1pp1(reference, tp, pp, dp):
    ckpt, ref = reference
    got = run_layout(tp, pp, dp, ckpt, save=False)
    assert len(got["losses"]) == len(ref["losses"]) == 4
    pairs = list(zip(ref["losses"] + ref["losses_after_step"], got["losses"] + got["losses_after_step"]))
    pairs.append((ref["grad_norm"], got["grad_norm"]))
    for a, b in pairs:
        assert abs(a - b) <= REL_TOL * abs(a), (a, b)
    # the optimizer step did something: the loss moved by far more than the tolerance
    assert abs(ref["losses_after_step"][0] - ref["losses"][0]) > 1e-2
