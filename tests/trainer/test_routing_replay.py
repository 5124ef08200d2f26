"""Rollout routing replay (algo.routing_replay=rollout) on tiny-qwen3-moe: the embedded engine records the top-k
experts transformers' router chose for every token it fed its model, and the trainer's MoE layers
(megatron-core's TopKRouter) use exactly those in the logprob, reference and update passes, padded or packed.

The engine routes with noise on its router logits (its choices weighted by the router's own probabilities), so
without replay trainer and engine route differently: routing agreement < 1 and a logprob mismatch; with replay
both compute the same function of the same weights, so the mismatch is fp32 rounding (transformers' modelling
code on one side, megatron-core's on the other)."""

import json
from pathlib import Path

import pytest
import torch

from experiments import routing_replay
from grpo_mega.parallel.forked import run_ranks
from tests.fork_server import run_main

ROOT = Path(__file__).resolve().parents[2]
REPLAY_TOL = 1e-5  # mean |engine - trainer| logprob with replay, fp32 (measured ~1.2e-7)


def _check(res: dict) -> None:
    # every (token, MoE layer) pair the engine routed (prompt and response but its last token) reached a router
    assert res["replayed_pairs_logprob_pass"] == res["engine_routed_pairs"] > 0
    # the trainer's routing map is the engine's experts for 100% of the (token, MoE layer) pairs the engine routed
    assert res["replay_followed_logprob_pass"] == 1.0
    assert res["replay_followed_update"] == 1.0 and res["replayed_pairs_update"] == res["replayed_pairs_logprob_pass"]
    assert res["replay_followed_reference"] == 1.0
    assert res["reference_equals_actor_with_replay"] == 0.0
    assert res["routing_agreement_without_replay"] < 0.97  # the noise changed some choices
    assert res["logprob_mismatch_with_replay"] < REPLAY_TOL
    assert res["logprob_mismatch_without_replay"] > 10 * res["logprob_mismatch_with_replay"]
    assert res["update_grad_norm"] > 0


# (name, ranks, kwargs of measure): EP2 (dp=2, each rank half of the rows, micro-batches padded to one length over
# ranks), PP2 (each stage its layers' routers), TP2 with sequence parallelism (each TP rank's routers see s/tp),
# TP2xEP2 on 4 ranks (dp=2, expert TP=2: each rank's routers see its DP half's tokens split s/tp)
@pytest.mark.parametrize("name,ranks,kw", [("EP2", 2, dict(ep=2)), ("PP2", 2, dict(pp=2)),
                                           ("TP2-SP", 2, dict(tp=2)), ("TP2xEP2-SP", 4, dict(tp=2, ep=2))])
def test_replay_packed(name, ranks, kw):
    res = run_ranks(routing_replay.measure, ranks, 0.02, packing=True, timeout=300, **kw)
    assert all(r == res[0] for r in res)
    _check(res[0])
    print(name, "packed:", json.dumps(res[0]))


def test_replay_single_process_padded():
    (res,) = run_ranks(routing_replay.measure, 1, 0.02, packing=False, timeout=300)
    _check(res)
    print("TP1 padded:", json.dumps(res))


def test_engine_records_transformers_router_choices():
    """The engine's recorded experts ([P + R - 1, M, k] per sample: the prompt, then the response but its last
    token) are those transformers' router picks when the whole sequence runs through the model in one
    forward, without the KV cache or the batch's left padding; and recording changes no sample."""
    from grpo_mega.conf import load_model_config
    from grpo_mega.engines.embedded import EmbeddedEngine

    cfg = load_model_config("tiny-qwen3-moe")
    engine = EmbeddedEngine.from_model_config(cfg, seed=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in engine.model.parameters():  # transformers initialises its routers to 0: give them real choices
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    prompts = [[5, 9, 12, 40, 7], [3, 8]]
    plain = engine.generate(prompts, 2, 1.0, 1.0, 8, [], seed=1)
    engine.enable_routing_record()
    gen = engine.generate(prompts, 2, 1.0, 1.0, 8, [], seed=1)
    assert gen.token_ids == plain.token_ids and gen.logprobs == plain.logprobs
    moe = sum(cfg.moe_layers())
    picks = []
    hooks = [r.register_forward_hook(lambda m, i, o: picks.append(o[2])) for r in engine.routers]
    for row, ids in enumerate(gen.token_ids):
        seq = prompts[row // 2] + ids
        routed = gen.routed_experts[row]
        assert routed.dtype == torch.int16 and tuple(routed.shape) == (len(seq) - 1, moe, cfg.moe_router_topk)
        picks.clear()
        engine.record_routing = False
        with torch.no_grad():
            engine.model(input_ids=torch.tensor([seq]))
        engine.record_routing = True
        full = torch.stack(picks, dim=1)[: len(seq) - 1]  # [tokens, M, k]
        assert torch.equal(full.sort(-1).values, routed.long().sort(-1).values), row
    for h in hooks:
        h.remove()


# recompute=true: the agreement is read after the old-logprob pass; false: the exactly on-policy update's forward
@pytest.mark.parametrize("recompute", [True, False])
def test_training_with_replay_at_ep2(tmp_path, recompute):
    """The Hydra entry point at EP2 on 2 forked ranks with algo.routing_replay=rollout, packed: the routes travel
    with the samples to the DP replica that trains them; moe/routing_agreement is reported (fp32 engine and
    trainer on the same weights: 1.0) and the engine/trainer logprob mismatch stays at fp32 rounding."""
    out = tmp_path / "run"
    argv = [f"hydra.run.dir={out}", "model=tiny-qwen3-moe", "parallel.ep=2", "run.steps=2", "eval.interval=0",
            "batch.train_batch_size=4", "batch.ppo_mini_batch_size=4", "rollout.n=4", "algo.routing_replay=rollout",
            f"algo.recompute_old_logprobs={str(recompute).lower()}"]
    proc = run_main(argv, timeout=300, cwd=ROOT, scratch=tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["moe/routing_agreement"] == pytest.approx(1.0, abs=0.02), r["moe/routing_agreement"]
        assert r["logprob_mismatch"] <= REPLAY_TOL, r["logprob_mismatch"]
        assert r["grad_norm"] > 0
    print("EP2 replay:", [(r["moe/routing_agreement"], r["logprob_mismatch"]) for r in rows])


def _measure_against_replay():
    """tiny-qwen3-moe (no load-balancing loss) at one process, one set of weights, a batch whose routes are random
    expert sets (not the routers' own): its logprobs without routes, and with them under each actor mode and
    reference setting; the agreement each actor reports; the update's (exactly on-policy) grad norm and agreement."""
    from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig
    from grpo_mega.models.builder import copy_weights
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference
    from tests.trainer import layouts as L

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=5)
        cfg = L.model_cfg(variant="tiny-qwen3-moe")
        fp32 = PrecisionConfig(params_dtype="fp32")
        batch_cfg = BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=4, max_response_length=10)
        plain = L.rollout(vocab=cfg.vocab_size)
        g = torch.Generator().manual_seed(1)
        moe, k = sum(cfg.moe_layers()), cfg.moe_router_topk

        def random_sets(n):  # [n, M, k]: k distinct experts per token and layer
            return torch.stack([torch.stack([torch.randperm(cfg.num_experts, generator=g)[:k] for _ in range(moe)])
                                for _ in range(n)]).to(torch.int16)

        routed = [random_sets(n - 1) for n in (plain.prompt_lens + plain.response_lens).tolist()]
        with_routes = L.rollout(vocab=cfg.vocab_size)
        with_routes.routed = routed
        first = Actor(cfg, ParallelConfig(), fp32, OptimConfig(lr=1e-3), AlgoConfig(kl_coef=0.0), batch_cfg)
        out = {"no routes": first.logprobs(plain, 1.0)}
        for mode in ("measure", "rollout"):
            actor = Actor(cfg, ParallelConfig(), fp32, OptimConfig(lr=1e-3),
                          AlgoConfig(kl_coef=0.0, routing_replay=mode), batch_cfg)
            copy_weights(first.built.gpt, actor.built.gpt)
            actor.optimizer.reload_model_params()
            out[mode] = actor.logprobs(with_routes, 1.0)
            out[f"{mode} agreement"] = actor.routing_agreement().get("moe/routing_agreement")
            if mode == "measure":
                b = L.rollout(vocab=cfg.vocab_size)
                b.routed = routed
                (m,) = actor.update(b, 1.0)
                out["measure update grad_norm"] = m["grad_norm"]
                out["measure update agreement"] = actor.routing_agreement()
        for replay in (False, True):
            ref = Reference(cfg, ParallelConfig(), fp32, batch_cfg, replay=replay)
            ref.load_from(first)
            out[f"reference replay={replay}"] = ref.logprobs(with_routes, 1.0)
        destroy_distributed()
        return out


def test_measure_compares_routes_without_following_them():
    """algo.routing_replay=measure: the engine's routes reach the routers and are counted (moe/routing_agreement),
    never followed: the logprobs are bit for bit those without routes (the reference's too), where 'rollout'
    changes them. Routes here are random expert sets, so the agreement is near chance (1 / C(8, 2) = 0.036)."""
    (res,) = run_ranks(_measure_against_replay, 1, timeout=300)
    base = res["no routes"]
    assert torch.equal(res["measure"], base) and torch.equal(res["reference replay=False"], base)
    assert not torch.equal(res["rollout"], base) and not torch.equal(res["reference replay=True"], base)
    assert (res["rollout"] - res["no routes"]).abs().max() > 1e-3
    assert 0.0 < res["measure agreement"] < 0.2, res["measure agreement"]
    upd = res["measure update agreement"]["moe/routing_agreement"]  # the update's forward, same weights: same count
    assert upd == res["measure agreement"] and res["measure update grad_norm"] > 0
    print("measure: agreement", res["measure agreement"], "rollout:", res["rollout agreement"])


def test_training_measures_agreement_without_replay(tmp_path):
    """The Hydra entry point with algo.routing_replay=measure (one process, exactly on-policy): the embedded engine
    records its routes and every step logs moe/routing_agreement (fp32 engine and trainer on the same weights:
    1.0; `test_measure_compares_routes_without_following_them` shows the routes are not followed)."""
    out = tmp_path / "run"
    argv = [f"hydra.run.dir={out}", "model=tiny-qwen3-moe", "run.steps=2", "eval.interval=0",
            "batch.train_batch_size=2", "batch.ppo_mini_batch_size=2", "rollout.n=4", "algo.routing_replay=measure"]
    proc = run_main(argv, timeout=300, cwd=ROOT, scratch=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["moe/routing_agreement"] == pytest.approx(1.0, abs=0.02), r["moe/routing_agreement"]
        assert r["grad_norm"] > 0
    print("measure:", [(r["moe/routing_agreement"], r["logprob_mismatch"]) for r in rows])


def test_routes_layout_by_hand():
    """Micro-batch routes [s, b, M, k]: a sequence of n tokens has the engine's experts at its first n - 1
    positions (the last token is never fed to the engine), -1 at its last token and at padding; packed rows put
    the sequences back to back in b = 1."""
    from grpo_mega.models.routing_replay import routes_layout

    r0 = torch.tensor([[[1, 2]], [[3, 4]]], dtype=torch.int16)  # sequence 0: 3 tokens, 1 MoE layer, top-2
    r1 = torch.tensor([[[5, 6]]], dtype=torch.int16)  # sequence 1: 2 tokens
    packed = routes_layout([r0, r1], [0, 1], [3, 2], 6, True, 1, 2)
    assert packed.shape == (6, 1, 1, 2)
    assert packed[:, 0, 0].tolist() == [[1, 2], [3, 4], [-1, -1], [5, 6], [-1, -1], [-1, -1]]
    padded = routes_layout([r0, r1], [1, 0], [3, 2], 3, False, 1, 2)  # rows in the order of `indices`
    assert padded.shape == (3, 2, 1, 2)
    assert padded[:, 0, 0].tolist() == [[5, 6], [-1, -1], [-1, -1]]
    assert padded[:, 1, 0].tolist() == [[1, 2], [3, 4], [-1, -1]]


def test_checkpoint_routes_file_round_trip(tmp_path):
    """An in-flight batch's routes in a checkpoint: one int16 safetensors file, samples without routes kept as
    None, every tensor back equal (the dedicated-server resume test checks the run resumes exactly)."""
    from grpo_mega.trainer.checkpoint import ROUTES_FILE, load_routes, save_routes

    g = torch.Generator().manual_seed(0)
    routed = [torch.randint(0, 8, (n, 3, 2), generator=g, dtype=torch.int16) for n in (5, 1, 7)]
    routed.insert(1, None)
    ref = save_routes(tmp_path, routed)
    assert ref == {"file": ROUTES_FILE, "samples": 4}
    assert (tmp_path / ROUTES_FILE).stat().st_size < 13 * 6 * 2 + 400  # 2 bytes an id, plus the header
    back = load_routes(tmp_path, ref)
    assert back[1] is None and all(torch.equal(a, b) and b.dtype == torch.int16
                                   for a, b in zip(routed, back) if a is not None)
