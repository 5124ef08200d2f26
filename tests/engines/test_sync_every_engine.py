"""Weight sync into several engines at once: each bucket gathered once per sync (counted, and the count is shown
to catch a per-engine re-gather), every engine audited and generating with the trainer's weights, and a
failure on one engine raised on every rank."""

import pytest
import torch
import torch.distributed as dist

from grpo_mega import algo
from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from grpo_mega.engines import weight_sync as ws
from grpo_mega.engines.embedded import EmbeddedEngine
from grpo_mega.rollout.placement import Engines, RolloutError
from grpo_mega.trainer.batch import RolloutBatch
from grpo_mega.trainer.loop import engine_logprobs
from tests.trainer import layouts as L

LOGP_TOL = 1e-5  # mean absolute difference, fp32


def _count_gathers(step: list) -> list:
    """Patch this rank's stage_hf_tensors (where the TP all-gathers happen) to record every full tensor it
    produces: (step[0] at the time, HF name, bytes)."""
    seen, real = [], ws.stage_hf_tensors

    def counting(*args, **kwargs):
        for name, t in real(*args, **kwargs):
            seen.append((step[0], name, t.numel() * t.element_size()))
            yield name, t

    ws.stage_hf_tensors = counting
    return seen


def _two_engines(tp, pp):
    with cpu_compat.cpu_device_mode():
        layout = init_distributed(tp=tp, pp=pp, seed=5)
        from megatron.core import parallel_state as ps

        cfg = load_model_config("tiny")
        from grpo_mega.trainer.actor import Actor

        actor = Actor(cfg, ParallelConfig(tp=tp, pp=pp), PrecisionConfig(params_dtype="fp32"), OptimConfig(lr=1e-2),
                      AlgoConfig(kl_coef=0.0),
                      BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=2, max_response_length=10))
        batch = L.rollout(seed=1)
        batch.old_logp = actor.logprobs(batch, 1.0)
        actor.update(batch, 1.0)  # the engines must receive trained weights
        step = [0]
        seen = _count_gathers(step)
        engines = Engines(lambda: EmbeddedEngine.from_model_config(cfg, seed=100 + dist.get_rank()), count=2)
        gpt, rank = actor.built.gpt, dist.get_rank()
        kwargs = dict(cfg=cfg, bucket_mb=0.01, audit=True)
        out = dict(rank=rank, counts_sender=ps.get_tensor_model_parallel_rank() == 0 and layout.dp_rank == 0)
        for v in (1, 2):
            step[0] = v
            stats = engines.sync(gpt, version=v, **kwargs)
        out["stats"] = stats
        out["local"], out["receivers"] = engines._route.local, engines._route.receivers
        if engines.local is not None:
            out["engine_version"] = engines.local.weight_version
            out["model_bytes"] = sum(p.numel() * p.element_size() for p in engines.local.params.values())
        prompts = [[5, 17, 33, 2, 9], [100, 7], [250, 251, 252], [9, 9]]
        gen = engines.generate(prompts, 2, 1.0, 1.0, 8, [3], 11)  # two prompts on each engine
        rb = RolloutBatch.from_samples([prompts[i // 2] for i in range(8)], gen.token_ids)
        trainer = actor.logprobs(rb, 1.0)
        engine_lp = engine_logprobs(gen, rb)
        out["mismatch"], out["gen_version"] = algo.logprob_mismatch(engine_lp, trainer, rb.response_mask()), gen.weight_version
        out["gathered"] = list(seen)
        if tp == 1:  # the same sync sent over the wire instead of read from the second replica's own copy
            wire = ws.SyncRoute(engines.ranks, local_replicas=False)
            out["wire_receivers"] = wire.receivers
            out["wire_stats"] = ws.sync_weights(gpt, cfg, engines.local, version=2, bucket_mb=0.01, audit=True,
                                                route=wire)

        # mutation check: the old way (one full sync per engine) is caught by the same count
        seen.clear()
        step[0] = 3
        for r in engines.ranks:
            ws.sync_weights(gpt, cfg, engines.local if rank == r else None, version=3, bucket_mb=0.01,
                            engine_ranks=(r,))
        out["gathered_per_engine"] = list(seen)

        # an audit mismatch on the second engine only is raised on every rank, naming that rank
        if rank == engines.ranks[1]:
            real = engines.local.weight_checksums

            def wrong(shapes=None):
                sums = real(shapes)
                sums["model.norm.weight"] = "0" * 32
                return sums

            engines.local.weight_checksums = wrong
        try:
            engines.sync(gpt, version=4, **kwargs)
        except RolloutError as e:
            out["audit_error"] = str(e)
        destroy_distributed()
        return out


def check_gathered_once(res: list[dict], key: str, model_bytes: int) -> list[int]:
    """Every step gathered each HF tensor exactly once on the senders (TP rank 0 of the first replica, one per
    stage), and no rank produced any tensor twice in a step; returns the steps seen."""
    steps = sorted({c for r in res for c, _, _ in r[key]})
    for step in steps:
        for r in res:
            names = [n for c, n, _ in r[key] if c == step]
            assert len(names) == len(set(names)), f"rank {r['rank']} gathered a tensor twice in step {step}"
        sent = [(n, b) for r in res if r["counts_sender"] for c, n, b in r[key] if c == step]
        nbytes = sum(b for _, b in sent)
        assert nbytes == model_bytes, f"step {step} gathered {nbytes} bytes; the model has {model_bytes}"
    return steps


@pytest.mark.parametrize("tp,pp,world", [(2, 2, 4), (2, 1, 2), (1, 1, 2)])
def test_every_engine_gets_each_bucket_gathered_once(tp, pp, world):
    """Engines on ranks [0, world/2]: at TP2xPP2 the second engine is stage 1's sender and receives stage 0;
    at TP2 it is rank 0's TP peer and packs from the same gather; at DP2 (TP1) it packs its own replica's
    copy (nothing to gather, nothing sent), and the same sync sent over the wire is audited too."""
    res = run_ranks(_two_engines, world, tp, pp, timeout=300)
    engine_ranks = [0, world // 2]
    model_bytes = res[0]["model_bytes"]
    assert check_gathered_once(res, "gathered", model_bytes) == [1, 2]
    # the same check catches the per-engine way (a full sync for each engine: the model gathered twice)
    with pytest.raises(AssertionError, match="gathered a tensor twice in step 3"):
        check_gathered_once(res, "gathered_per_engine", model_bytes)
    for r in res:
        assert r["mismatch"] <= LOGP_TOL and r["gen_version"] == 2
        if r["rank"] in engine_ranks:
            assert r["engine_version"] == 2 and r["model_bytes"] == model_bytes
        assert f"on rank {engine_ranks[1]} failed" in r["audit_error"] and "model.norm.weight" in r["audit_error"]
    stats = res[0]["stats"]
    assert stats.audited and stats.bytes == model_bytes and stats.buckets > 3
    if tp == 1:
        assert res[0]["local"] == [[1]] and res[0]["receivers"] == [[]]
        assert res[0]["wire_receivers"] == [[1]]
        for r in res:  # the audit ran on both engines (it raises on a mismatch)
            assert r["wire_stats"].audited and r["wire_stats"].bytes == model_bytes
    else:
        assert res[0]["local"] == [[]] * pp
