"""The actor/reference pair: the reference stays frozen while the actor learns, and impossible layouts stop
at start-up with the numbers and the rule."""

import pytest
import torch

from grpo_mega.conf import (AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, RolloutConfig,
                            load_model_config)
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import RankFailed, run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from tests.trainer import layouts as L


def _three_steps(tp, pp):
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=7)
        cfg = load_model_config("tiny")
        parallel = ParallelConfig(tp=tp, pp=pp)
        batch_cfg = BatchConfig(train_batch_size=2, ppo_mini_batch_size=1, micro_batch_size=2, max_response_length=10)
        actor = Actor(cfg, parallel, PrecisionConfig(params_dtype="fp32"), OptimConfig(lr=1e-3),
                      AlgoConfig(kl_coef=0.1, entropy_coef=0.01), batch_cfg)
        ref = Reference(cfg, parallel, PrecisionConfig(params_dtype="fp32"), batch_cfg)
        ref.load_from(actor)
        assert not any(p.requires_grad for p in ref.built.gpt.parameters())
        in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
        assert not in_optimizer & {id(p) for p in ref.built.gpt.parameters()}
        ref0 = {k: v.clone() for k, v in ref.built.gpt.state_dict().items() if torch.is_tensor(v)}
        act0 = {k: v.clone() for k, v in actor.built.gpt.state_dict().items() if torch.is_tensor(v)}
        batch = L.rollout(seed=3)
        # The same weights: the same logprobs, to fp32 rounding (bit-identical padded; with packed rows at TP2
        # the actor and the reference differ by up to 4.8e-7, the same inputs through separately allocated
        # weights)
        same_at_start = float((actor.logprobs(batch, 1.0) - ref.logprobs(batch, 1.0)).abs().max()) <= 1e-6
        metrics = []
        for _ in range(3):
            batch.old_logp = actor.logprobs(batch, 1.0)
            batch.ref_logp = ref.logprobs(batch, 1.0)
            metrics += actor.update(batch, 1.0)
        ref_same = all(torch.equal(v, ref.built.gpt.state_dict()[k]) for k, v in ref0.items())
        act_moved = sum(float((v - actor.built.gpt.state_dict()[k]).abs().sum()) for k, v in act0.items() if v.is_floating_point())
        kl_after = float((actor.logprobs(batch, 1.0) - ref.logprobs(batch, 1.0)).abs().max())
        destroy_distributed()
        return same_at_start, ref_same, act_moved, kl_after, metrics


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_reference_frozen_actor_learns(tp, pp):
    res = run_ranks(_three_steps, tp * pp, tp, pp, timeout=300)
    for same_at_start, ref_same, act_moved, kl_after, metrics in res:
        assert same_at_start and ref_same
        assert act_moved > 1e-3 and kl_after > 1e-5
        assert len(metrics) == 6  # 3 steps x 2 mini-batches
        assert all(m["skipped"] == 0 and m["grad_norm"] > 0 for m in metrics)
        assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-9) and metrics[-1]["kl"] > 0
    assert all(r[4] == res[0][4] for r in res)  # metrics identical on every rank


def test_impossible_layouts_stop_with_the_rule():
    tiny = load_model_config("tiny")  # 8 heads, 4 query groups, 4 layers
    with pytest.raises(ValueError, match=r"parallel.tp=3 must divide num_attention_heads=8"):
        ParallelConfig(tp=3).check(tiny)
    with pytest.raises(ValueError, match=r"parallel.tp=8 must divide num_query_groups=4"):
        ParallelConfig(tp=8).check(tiny)
    with pytest.raises(ValueError, match=r"model.num_layers=4 does not split over parallel.pp=3 stages"):
        ParallelConfig(pp=3).check(tiny)
    with pytest.raises(ValueError, match=r"hold 1 \+ 2 layers but the model has 4"):
        ParallelConfig(pp=2, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=2).check(tiny)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by parallel.tp \* parallel.pp = 2 \* 2"):
        ParallelConfig(tp=2, pp=2).check(tiny, world_size=6)
    assert ParallelConfig(tp=2, pp=2).check(tiny, world_size=8) == 2
    with pytest.raises(ValueError, match="sequence_parallel=true needs parallel.tp > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"24 responses does not split into dp=5 ranks x micro_batch_size=2"):
        BatchConfig(train_batch_size=6, ppo_mini_batch_size=6, micro_batch_size=2).check_dp(5, 4)
    with pytest.raises(ValueError, match="rollout.n=1 must be >= 2"):
        RolloutConfig(n=1)


def _build_at(tp, pp):
    from grpo_mega.trainer.actor import Actor

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp)
        Actor(load_model_config("tiny"), ParallelConfig(tp=tp, pp=pp), PrecisionConfig(), OptimConfig(), AlgoConfig(),
              BatchConfig())


def test_impossible_layout_fails_at_startup_on_ranks():
    with pytest.raises(RankFailed, match=r"world size 3 is not divisible by parallel.tp \* parallel.pp = 2 \* 1"):
        run_ranks(_build_at, 3, 2, 1, timeout=60)
    with pytest.raises(RankFailed, match=r"model.num_layers=4 does not split over parallel.pp=3 stages"):
        run_ranks(_build_at, 3, 1, 3, timeout=60)


def test_fp8_where_it_cannot_run_says_so():
    from grpo_mega.models.builder import check_fp8

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"precision.fp8='hybrid' needs a CUDA GPU with Transformer Engine.*fp8=null"):
        check_fp8(PrecisionConfig(fp8="hybrid"))


def _full_kl_without_reference():
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=7)
        # builds: no refusal any more
        actor = L.tiny_actor(optim=OptimConfig(), algo_cfg=AlgoConfig(kl_estimator="full", kl_coef=0.1))
        batch = L.rollout(seed=3)
        batch.old_logp = actor.logprobs(batch, 1.0)
        try:
            actor.update(batch, 1.0)
        finally:
            destroy_distributed()


def test_full_kl_in_the_loss_asks_for_the_reference():
    with pytest.raises(RankFailed, match=r"kl_estimator='full' with algo.kl_coef != 0 needs the reference's logits: "
                                         r"pass the Reference"):
        run_ranks(_full_kl_without_reference, 1, timeout=120)
    with pytest.raises(ValueError, match=r"algo.kl_estimator='full' with algo.kl_in_reward=true"):
        AlgoConfig(kl_estimator="full", kl_coef=0.1, kl_in_reward=True)


def _lr_schedule():
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=7)
        actor = L.tiny_actor(train=4, mini=1, optim=OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                                                  lr_decay_steps=4, lr_decay_style="linear"))
        batch = L.rollout(seed=3)
        batch.old_logp = actor.logprobs(batch, 1.0)
        lrs = [m["lr"] for m in actor.update(batch, 1.0)]  # 4 mini-batches = 4 optimizer steps
        destroy_distributed()
        return lrs


def test_lr_warmup_then_linear_decay():
    (lrs,) = run_ranks(_lr_schedule, 1, timeout=120)
    # the lr in force at each step: warm-up 0 -> 1e-3 over 2 steps, then linear decay to 1e-4 at step 4
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 5.5e-4], rel=1e-6)


def _nan_step(tp, pp, dtype):
    from grpo_mega.trainer.actor import Actor

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=7)
        batch_cfg = BatchConfig(train_batch_size=2, ppo_mini_batch_size=1, micro_batch_size=2, max_response_length=10)
        actor = Actor(load_model_config("tiny"), ParallelConfig(tp=tp, pp=pp), PrecisionConfig(params_dtype=dtype),
                      OptimConfig(lr=1e-3), AlgoConfig(kl_coef=0.0), batch_cfg)
        batch = L.rollout(seed=3)
        batch.old_logp = actor.logprobs(batch, 1.0)
        mask = batch.response_mask()
        row, col = 1, int(torch.nonzero(mask[1])[0])
        batch.old_logp[row, col] = float("nan")  # a NaN in the first mini-batch's loss
        before = {k: v.clone() for k, v in actor.built.gpt.state_dict().items() if torch.is_tensor(v)}
        first = actor._update_mini_batch(batch.rows(0, 4), 1.0)
        same = all(torch.equal(v, actor.built.gpt.state_dict()[k]) for k, v in before.items())
        second = actor._update_mini_batch(batch.rows(4, 8), 1.0)
        moved = any(not torch.equal(v, actor.built.gpt.state_dict()[k]) for k, v in before.items() if v.is_floating_point())
        finite = all(torch.isfinite(v).all() for v in actor.built.gpt.state_dict().values() if torch.is_tensor(v) and v.is_floating_point())
        destroy_distributed()
        return first, same, second, moved, finite, actor.skipped_nonfinite


@pytest.mark.parametrize("tp,pp,dtype", [(1, 1, "fp32"), (2, 2, "bf16")])
def test_a_nan_in_the_loss_is_skipped_and_leaves_the_weights(tp, pp, dtype):
    for first, same, second, moved, finite, skipped in run_ranks(_nan_step, tp * pp, tp, pp, dtype, timeout=120):
        assert first["skipped"] == 1.0 and first["skip_reason"] == "non_finite" and skipped == 1
        assert same  # the NaN step changed nothing
        assert second["skipped"] == 0.0 and moved and finite  # and training goes on


def _bad_gradient_step(value):
    """One mini-batch whose loss is finite but one gradient element is `value` (a tensor hook on one weight,
    run before megatron's grad-buffer accumulation), then a clean one."""
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=7)
        actor = L.tiny_actor(mini=1)
        batch = L.rollout(seed=3)
        batch.old_logp = actor.logprobs(batch, 1.0)
        weight = next(p for n, p in actor.built.gpt.named_parameters() if n.endswith("linear_fc1.weight"))

        def poison(grad):
            grad = grad.clone()
            grad.view(-1)[0] = value
            return grad

        hook = weight.register_hook(poison)
        before = {k: v.clone() for k, v in actor.built.gpt.state_dict().items() if torch.is_tensor(v)}
        first = actor._update_mini_batch(batch.rows(0, 4), 1.0)
        same = all(torch.equal(v, actor.built.gpt.state_dict()[k]) for k, v in before.items())
        hook.remove()
        second = actor._update_mini_batch(batch.rows(4, 8), 1.0)
        destroy_distributed()
        return first, same, second


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_gradient_with_a_finite_loss_is_skipped(value):
    """The grad-buffer check (a sum per buffer) sees one bad element among the buffer's ~200k."""
    [(first, same, second)] = run_ranks(_bad_gradient_step, 1, value, timeout=120)
    assert torch.isfinite(torch.tensor(first["loss"])) and first["skip_reason"] == "non_finite" and same
    assert second["skipped"] == 0.0


def _out_of_vocabulary(tp, token, where):
    """The logprob pass and the update at TP `tp` on a batch with `token` as a prompt's first token (never a label:
    only the embedding sees it) or as a response token; what each raised."""
    from grpo_mega.trainer.actor import Actor

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=1, seed=7)
        batch_cfg = BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=2, max_response_length=10,
                                response_only_logits=True)
        actor = Actor(load_model_config("tiny"), ParallelConfig(tp=tp), PrecisionConfig(params_dtype="fp32"),
                      OptimConfig(lr=1e-3), AlgoConfig(kl_coef=0.0), batch_cfg)
        batch = L.rollout(seed=3)
        pos = 0 if where == "prompt" else int(batch.prompt_lens[2]) + 1
        batch.tokens[2, pos] = token
        out = []
        for call in (lambda: actor.logprobs(batch, 1.0), lambda: actor.update(batch, 1.0)):
            batch.old_logp = torch.zeros(batch.tokens.shape)
            try:
                call()
                out.append(None)
            except ValueError as e:
                out.append(str(e))
        destroy_distributed()
        return out


@pytest.mark.parametrize("tp,token,where", [(2, 10_000, "prompt"), (2, 330, "prompt"), (1, 330, "response"),
                                            (2, -3, "response")])
def test_an_out_of_vocabulary_token_is_refused_not_masked(tp, token, where):
    """At TP2 megatron's VocabParallelEmbedding made an input id no shard holds (10,000) a zero embedding, and an id
    in the padded rows (330 of the tiny model's 320 + padding to 384) a row of padding; the label check sees no
    prompt's first token. Every pass refuses them, at every TP, naming the sample, the position and the id."""
    for rank_out in run_ranks(_out_of_vocabulary, tp, tp, token, where, timeout=180):
        for msg in rank_out:
            assert msg is not None and msg.startswith(f"sample 2: token id {token} at position ") and \
                f"(its {where}) is outside the model's vocabulary [0, 320)" in msg, msg


@pytest.mark.parametrize("omp,world,expected", [(None, "1", None), ("1", "1", 1), ("64", "1", None), ("1", "2", 1),
                                                ("x", "1", None)])
def test_threads_per_rank_is_the_cores_share_capped_by_omp_num_threads(omp, world, expected, monkeypatch):
    """A rank's torch threads: the affinity's cores divided among the node's ranks, at most OMP_NUM_THREADS (torchrun
    sets 1 for several ranks, the test workers their share); an unparsable value is ignored."""
    import os

    from grpo_mega.trainer.setup import threads_per_rank

    share = max(1, len(os.sched_getaffinity(0)) // int(world))
    monkeypatch.setenv("WORLD_SIZE", world)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert threads_per_rank() == (share if expected is None else min(share, expected))
