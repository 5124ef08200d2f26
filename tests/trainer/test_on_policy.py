"""A batch's one optimizer step (one epoch, one mini-batch) skips the old-logprob pass: the update's own logprobs,
detached, are the old ones, on-policy or not (the engine's logprobs here differ from the trainer's, as a step
behind: tests/rollout/test_off_policy.py runs one step ahead both ways). Loss, grad norm, every parameter's gradient and the metrics equal the path with the
separate pass, at TP1, TP2+SP, PP2 and DP2, packed, with the full-vocabulary KL in the loss; the old logprobs
it fills in equal the pass's."""

from __future__ import annotations

import pytest
import torch

from tests.trainer import layouts as L

TOL = 1e-6


def _both_paths(tp, pp, sp):
    from grpo_mega.conf import AlgoConfig, ParallelConfig
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=1234)
        cfg, parallel = L.model_cfg(), ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp)
        kw = L.configs("seq-mean-token-mean", 2)
        kw["algo_cfg"] = AlgoConfig(loss_agg_mode="seq-mean-token-mean", kl_coef=0.05, kl_estimator="full",
                                    entropy_coef=0.01, clip_ratio_low=0.2, clip_ratio_high=0.28, engine_is_cap=2.0)
        torch.manual_seed(0)
        w0 = None
        out = {}
        for path in ("pass", "skip"):
            actor = Actor(cfg, parallel, **kw)
            if w0 is None:  # the same initial weights for both paths
                w0 = {k: v.detach().clone() for k, v in actor.built.gpt.state_dict().items() if torch.is_tensor(v)}
            else:
                actor.built.gpt.load_state_dict({**actor.built.gpt.state_dict(), **w0})
                actor.optimizer.reload_model_params()
            ref = Reference(cfg, parallel, kw["precision"], kw["batch"])
            ref.load_from(actor)
            batch = L.rollout(lengths="packing")
            batch.engine_logp = L.perturbed(torch.zeros(batch.tokens.shape), batch.response_mask(), 0.1, 3)
            if path == "pass":
                batch.old_logp = actor.logprobs(batch, L.TEMPERATURE)
            (m,) = actor.update(batch, L.TEMPERATURE, ref)
            grads = {k: (w0[k].double() - v.detach().double()) for k, v in actor.built.gpt.state_dict().items()
                     if k in w0 and "_extra_state" not in k}
            out[path] = (m, grads, batch.old_logp.clone())
        destroy_distributed()
        return out


@pytest.mark.parametrize("tp,pp,sp,world", [(1, 1, False, 1), (2, 1, True, 2), (1, 2, False, 2), (1, 1, False, 2)],
                         ids=["tp1", "tp2_sp", "pp2", "dp2"])
def test_skipping_the_old_logprob_pass_changes_nothing(tp, pp, sp, world):
    from grpo_mega.parallel.forked import run_ranks

    for rank_out in run_ranks(_both_paths, world, tp, pp, sp, timeout=300):
        (m_pass, g_pass, lp_pass), (m_skip, g_skip, lp_skip) = rank_out["pass"], rank_out["skip"]
        for key in ("loss", "grad_norm", "pg_loss", "kl", "entropy", "clip_fraction", "is_weight_mean", "ratio_mean"):
            assert m_skip[key] == pytest.approx(m_pass[key], rel=TOL, abs=TOL), key
        assert m_skip["ratio_mean"] == pytest.approx(1.0, abs=1e-7)
        assert torch.allclose(lp_skip, lp_pass, rtol=0, atol=TOL), (lp_skip - lp_pass).abs().max()
        assert g_pass.keys() == g_skip.keys() and g_pass
        for k in g_pass:
            assert torch.allclose(g_skip[k], g_pass[k], rtol=TOL, atol=TOL * 1e-2), (k, (g_skip[k] - g_pass[k]).abs().max())
        assert max(float(g.abs().max()) for g in g_pass.values()) > 1e-5  # the update moved the weights


def test_the_loop_skips_the_pass_only_with_one_optimizer_step_and_nothing_reading_old_logprobs_first():
    from grpo_mega.conf import TrainConfig

    assert TrainConfig(batch=dict(train_batch_size=4, ppo_mini_batch_size=4)).skips_old_logprob_pass
    assert not TrainConfig(batch=dict(train_batch_size=8, ppo_mini_batch_size=4)).skips_old_logprob_pass  # 2 minis
    one = dict(train_batch_size=4, ppo_mini_batch_size=4)
    assert not TrainConfig(batch=one, algo=dict(ppo_epochs=2)).skips_old_logprob_pass
    assert not TrainConfig(batch=one, algo=dict(kl_in_reward=True)).skips_old_logprob_pass
    assert not TrainConfig(batch=one, algo=dict(recompute_old_logprobs=True)).skips_old_logprob_pass
    assert not TrainConfig(batch=one, algo=dict(rollout_correction="token", rollout_is_batch_norm=True)
                           ).skips_old_logprob_pass  # the batch mean is taken before the update
    servers = dict(placement="dedicated", servers=["http://h:1"])
    assert TrainConfig(batch=one, rollout=dict(servers, off_policy_steps=1)).skips_old_logprob_pass
    assert TrainConfig(batch=one, rollout=dict(servers, mode="async", off_policy_steps=2)).skips_old_logprob_pass
