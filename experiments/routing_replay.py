"""Rollout routing replay (R3), measured: tiny-qwen3-moe's embedded engine routes with noise on its router logits
(a stand-in for the kernel and precision differences that make an inference engine route differently), and the
trainer computes the same samples' logprobs without and with the engine's routes replayed. Writes JSON.

    python -m experiments.routing_replay [--noise 0.02] [--ep 2] [--no-packing] [--out bench_results/routing_replay.json]

Two perturbations, each its own forked run: noise on the engine's router logits (fp32 engine), and a bf16
engine (no noise) against the fp32 trainer.

Reported: moe/routing_agreement (the share of (token, MoE layer) pairs whose top-k set, of the trainer's own
router logits, equals the engine's: measured without replay), the mean |engine - trainer| logprob over response
tokens without and with replay, and with replay the share of engine-routed (token, layer) pairs where the
trainer's MoE layer used exactly the engine's experts (its routing map), in the logprob pass and in the update.
The engine weights its noisy choices with the router's own probabilities (as a replaying trainer does), so with
replay the two compute the same function and the mismatch is fp32 rounding.

`measure()` runs inside each forked gloo rank (grpo_mega.parallel.forked.run_ranks); tests/trainer/
test_routing_replay.py calls it the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TEMPERATURE = 1.0


def _used_experts(gpt):
    """Forward hooks on every TopKRouter counting (pairs whose routing map is exactly the replay target's
    experts, pairs with a target); returns (counts, handles)."""
    from megatron.core.transformer.moe.router import TopKRouter

    counts = {"same": 0, "total": 0}

    def hook(router, inputs, output):
        target = router.router_replay.target
        if target is None or not router.router_replay.replay:
            return
        routing_map = output[1].bool()  # [tokens, E]
        have = (target >= 0).all(-1)
        want = torch.zeros_like(routing_map)
        want[have.nonzero()[:, 0].unsqueeze(1), target[have]] = True
        counts["same"] += int(((routing_map == want).all(-1) & have).sum())
        counts["total"] += int(have.sum())

    import torch

    handles = [m.register_forward_hook(hook) for m in gpt.modules() if isinstance(m, TopKRouter)]
    return counts, handles


def add_router_noise(engine, std: float, seed: int = 0) -> None:
    """Every router of the engine's model picks the top-k of its logits plus Gaussian noise of this std, weighted
    by the router's own probabilities of those experts (renormalised as the router does). The hooks go before the
    engine's recording hook (prepend), which so records the noisy choice."""
    import torch

    gen = torch.Generator(device=engine.device).manual_seed(seed)

    def hook(router, inputs, output):
        logits, weights, _ = output
        noisy = logits.float() + std * torch.randn(logits.shape, generator=gen, device=logits.device)
        index = torch.topk(noisy, router.top_k, dim=-1).indices
        top = torch.softmax(logits.float(), dim=-1).gather(1, index)  # the chosen experts' own weights
        if router.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(weights.dtype), index

    for router in engine.routers:
        router.register_forward_hook(hook, prepend=True)


def measure(noise: float = 0.5, ep: int = 1, packing: bool = True, prompts: int = 2, n: int = 4,
            max_new: int = 12, seed: int = 0, update: bool = True, engine_dtype: str = "float32", pp: int = 1,
            tp: int = 1) -> dict:
    """On every rank of a world of tp * pp * ep ranks (dp = ep; tp > 1 with sequence parallelism): the figures above (the same dict on every rank).
    engine_dtype='bfloat16': the engine computes in bf16 (the fp32 trainer's weights rounded), another cause of
    routing disagreement."""
    import torch

    from grpo_mega import algo
    from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
    from grpo_mega.models import routing_replay
    from grpo_mega.parallel import comm, cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.engines.embedded import EmbeddedEngine
    from grpo_mega.engines.weight_sync import sync_weights
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.reference import Reference
    from grpo_mega.trainer.batch import RolloutBatch
    from grpo_mega.trainer.loop import engine_logprobs

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=1234, ep=ep)
        rank = torch.distributed.get_rank()
        cfg = load_model_config("tiny-qwen3-moe")
        parallel = ParallelConfig(ep=ep, pp=pp, tp=tp, sequence_parallel=tp > 1)
        batch = BatchConfig(train_batch_size=prompts, ppo_mini_batch_size=prompts, micro_batch_size=2,
                            max_prompt_length=8, max_response_length=max_new, packing=packing)
        precision = PrecisionConfig(params_dtype="fp32")
        actor = Actor(cfg, parallel, precision, OptimConfig(lr=1e-3), AlgoConfig(kl_coef=0.0), batch)
        engine = None
        if rank == 0:
            engine = EmbeddedEngine.from_model_config(cfg, seed=seed)
            if engine_dtype != "float32":
                engine = EmbeddedEngine(engine.model, getattr(torch, engine_dtype))
            engine.enable_routing_record()
            if noise:
                add_router_noise(engine, noise)
        sync_weights(actor.built.gpt, cfg, engine, version=1)
        g = torch.Generator().manual_seed(seed)
        prompt_ids = [torch.randint(3, cfg.vocab_size, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
                      for _ in range(prompts)]
        gen = engine.generate(prompt_ids, n, TEMPERATURE, 1.0, max_new, [], seed) if rank == 0 else None
        gen = comm.broadcast_object(gen)
        rows = [p for p in prompt_ids for _ in range(n)]
        rb = RolloutBatch.from_samples(rows, gen.token_ids, routed=gen.routed_experts)
        engine_lp = engine_logprobs(gen, rb)
        mask = rb.response_mask()

        def mismatch(lp):
            return float(((lp - engine_lp).abs() * mask).sum() / mask.sum())

        gpt = actor.built.gpt
        routing_replay.take_agreement(gpt)
        routing_replay.set_replay(gpt, False)
        free = actor.logprobs(rb, TEMPERATURE)
        agreement = routing_replay.world_agreement(gpt)
        routing_replay.set_replay(gpt, True)
        counts, handles = _used_experts(gpt)
        replayed = actor.logprobs(rb, TEMPERATURE)
        ref = Reference(cfg, parallel, precision, batch)
        ref.load_from(actor)
        ref_counts, ref_handles = _used_experts(ref.built.gpt)
        ref_lp = ref.logprobs(rb, TEMPERATURE)
        logprob_pass = dict(counts)
        out = dict(noise=noise, engine_dtype=engine_dtype, ep=ep, pp=pp, tp=tp, packing=packing, samples=len(rows),
                   response_tokens=int(rb.response_lens.sum()), moe_layers=sum(cfg.moe_layers()),
                   topk=cfg.moe_router_topk, routing_agreement_without_replay=agreement,
                   engine_routed_pairs=sum(int(r.shape[0] * r.shape[1]) for r in gen.routed_experts),
                   logprob_mismatch_without_replay=mismatch(free), logprob_mismatch_with_replay=mismatch(replayed),
                   reference_equals_actor_with_replay=float((ref_lp - replayed).abs().max()))
        if update:
            counts["same"] = counts["total"] = 0
            routing_replay.take_agreement(gpt)
            rb.old_logp = replayed
            rb.advantages = algo.group_advantages(torch.rand(len(rows), generator=g), n=n).float()
            (m,) = actor.update(rb, TEMPERATURE)
            out.update(update_grad_norm=m["grad_norm"], update_routing_agreement=routing_replay.world_agreement(gpt))
        for h in handles + ref_handles:
            h.remove()
        sums = torch.tensor([logprob_pass["same"], logprob_pass["total"], counts["same"], counts["total"],
                             ref_counts["same"], ref_counts["total"]], dtype=torch.float64)
        torch.distributed.all_reduce(sums)
        s = sums.tolist()
        out.update(replayed_pairs_logprob_pass=int(s[1]), replay_followed_logprob_pass=s[0] / s[1],
                   replay_followed_reference=s[4] / s[5])
        if update:
            out.update(replayed_pairs_update=int(s[3]), replay_followed_update=s[2] / s[3])
        destroy_distributed()
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--noise", type=float, default=0.02, help="std of the noise on the engine's router logits")
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel ranks (forked gloo ranks; dp = ep)")
    ap.add_argument("--no-packing", dest="packing", action="store_false")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "routing_replay.json"))
    args = ap.parse_args()
    from grpo_mega.parallel.forked import run_ranks

    res = {}
    for name, noise, dtype in (("router_noise", args.noise, "float32"), ("bf16_engine", 0.0, "bfloat16")):
        t0 = time.perf_counter()
        res[name] = run_ranks(measure, args.ep, noise, args.ep, args.packing, engine_dtype=dtype, timeout=600)[0]
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
        r = res[name]
        print(f"{name}: moe/routing_agreement {r['routing_agreement_without_replay']:.4f}; logprob mismatch "
              f"{r['logprob_mismatch_without_replay']:.3e} without replay, {r['logprob_mismatch_with_replay']:.3e} "
              f"with; replay followed in {r['replay_followed_logprob_pass']:.0%} of {r['replayed_pairs_logprob_pass']} "
              "token-layer pairs", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("written", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
