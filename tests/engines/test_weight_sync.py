"""Weight sync into the embedded engine: exact weights after a TP2xPP2 update step (audited), corruption
caught and named, engine logprobs equal the trainer's, bounded buckets, seeded distinct samples."""

import pytest
import torch
import torch.distributed as dist

from grpo_mega import algo
from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from grpo_mega.engines.embedded import EmbeddedEngine
from grpo_mega.engines.weight_sync import Staging, WeightSyncError, check_audit, pack_buckets, sync_weights
from grpo_mega.trainer.batch import RolloutBatch
from tests.trainer import layouts as L

LOGP_TOL = 1e-5  # mean absolute difference, fp32


def test_buckets_respect_the_limit_and_keep_order():
    g = torch.Generator().manual_seed(0)
    sizes = [10, 300, 50, 5000, 20, 20, 999, 1]  # elements (fp32: x4 bytes); limit 1200 bytes
    tensors = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate(sizes)]
    buckets = list(pack_buckets(iter(tensors), bucket_bytes=1200, audit=True))
    names = [m.name for b in buckets for m in b.metas]
    assert names == [n for n, _ in tensors]
    for b in buckets:
        assert b.nbytes <= 1200 or len(b.metas) == 1  # only a single oversized tensor may exceed it
    assert any(b.nbytes > 1200 for b in buckets)  # the 5000-element tensor travelled alone
    got = {n: t for b in buckets for n, t in b.tensors()}
    assert all(torch.equal(got[n], t) for n, t in tensors)
    assert all(b.checksums and set(b.checksums) == {m.name for m in b.metas} for b in buckets)


def test_staged_and_unflattened_buckets_hold_the_same_tensors():
    """Buckets packed into reused staging buffers (consumed one at a time, as the sync does) and buckets left
    unflattened carry exactly the tensors of freshly packed ones; the staging reuses its two buffers, and a
    strided view (a slice of a fused QKV) stays a view when unflattened."""
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(12, 8, generator=g)
    tensors = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate([100, 250, 60, 900, 30, 200])]
    tensors.append(("q", fused[:, :4]))  # not contiguous
    want = [(n, t.clone()) for n, t in tensors]
    staging = Staging(1200, torch.device("cpu"))
    seen, buffers = [], []
    for b in pack_buckets(iter(tensors), 1200, staging=staging):
        assert b.flat is not None
        if b.nbytes <= 1200:  # the oversized tensor (900 floats) gets a fresh buffer of its own
            buffers.append(b.flat.untyped_storage().data_ptr())
        seen += [(n, t.clone()) for n, t in b.tensors()]  # consumed before the next bucket is packed
    assert len(buffers) >= 4 and len(set(buffers)) == 2 and buffers[0] == buffers[2]  # two buffers, alternating
    unflat = [(n, t) for b in pack_buckets(iter(tensors), 1200, flatten=False) for n, t in b.tensors()]
    for got in (seen, unflat):
        assert [n for n, _ in got] == [n for n, _ in want]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    assert unflat[-1][1].data_ptr() == fused.data_ptr()  # the engine copies it; nobody else does
    assert all(b.nbytes == sum(m.nbytes for m in b.metas) for b in pack_buckets(iter(tensors), 1200, flatten=False))


def _corrupted(cfg) -> str:
    """The tensor the test corrupts inside the engine: Qwen3's last k_norm (replicated over TP, its gradient
    all-reduced by name), otherwise a down projection."""
    return "model.layers.1.self_attn.k_norm.weight" if cfg.qk_layernorm else "model.layers.2.mlp.down_proj.weight"


def _sync_and_sample(tp, pp, tied, bucket_mb, model="tiny", sp=False, ep=1):
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=5, ep=ep)
        cfg = load_model_config(model)
        cfg.tie_word_embeddings = tied
        from grpo_mega.trainer.actor import Actor

        actor = Actor(cfg, ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp, ep=ep),
                      PrecisionConfig(params_dtype="fp32"),
                      OptimConfig(lr=1e-2),
                      AlgoConfig(kl_coef=0.0),
                      BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=2, max_response_length=10))
        # one update step, so the engine must receive trained (not initial) weights
        batch = L.rollout(seed=1)
        batch.old_logp = actor.logprobs(batch, 1.0)
        actor.update(batch, 1.0)
        out = {"norm_spread": 0.0}
        if ep > 1:  # each EP rank's own experts, by global index, to compare with what the engine received
            from grpo_mega.models import bridge

            from megatron.core import parallel_state as ps

            off, out["experts"] = bridge.expert_offset(actor.built.gpt, cfg), {}
            for n, p in actor.built.gpt.named_parameters():
                if bridge.expert_of(n) is None:
                    continue
                name = bridge.global_name(n, bridge.layer_offset(actor.built.gpt), off)
                shards = [p.detach().clone()]
                if tp > 1:  # TP x EP: each expert's matrices are split over the expert-tensor-parallel group too
                    shards = [torch.empty_like(p) for _ in range(tp)]
                    dist.all_gather(shards, p.detach().contiguous(), group=ps.get_expert_tensor_parallel_group())
                out["experts"][name] = bridge.merge_tp(name, shards, cfg)
        if cfg.qk_layernorm:  # each TP rank's q/k norm gradient covers only its heads: summed over TP, equal copies
            from megatron.core import parallel_state as ps

            for n, p in actor.built.gpt.named_parameters():
                if "q_layernorm" in n or "k_layernorm" in n:
                    copies = [torch.empty_like(p) for _ in range(tp)]
                    dist.all_gather(copies, p.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
                    out["norm_spread"] = max(out["norm_spread"], max((c - copies[0]).abs().max().item() for c in copies))

        engine = EmbeddedEngine.from_model_config(cfg, seed=123) if dist.get_rank() == 0 else None
        before = engine.weight_checksums() if engine else None
        stats = sync_weights(actor.built.gpt, cfg, engine, version=1, bucket_mb=bucket_mb, audit=True)
        if engine is not None:
            out["changed"] = sum(before[k] != v for k, v in engine.weight_checksums().items())
            if ep > 1:
                out["engine"] = {k: v.clone() for k, v in engine.params.items() if ".mlp.experts." in k}
            out["stats"] = stats
            # a tensor corrupted inside the engine after the sync is caught and named
            name = _corrupted(cfg)
            with torch.no_grad():
                engine.params[name].view(-1)[0] += 1e-3
            try:
                check_audit(stats.checksums, engine.weight_checksums())
            except WeightSyncError as e:
                out["audit_error"] = str(e)
            with torch.no_grad():
                engine.params[name].view(-1)[0] -= 1e-3
            check_audit(stats.checksums, engine.weight_checksums())  # restored exactly
        prompts = [[5, 17, 33, 2, 9], [100, 7], [250, 251, 252]]
        # the dynamic KV cache (auto on the CPU) and the static one (rollout.embedded_decode=static)
        for decode, temperature in (("dynamic", 0.7), ("dynamic", 1.0), ("static", 0.7), ("static", 1.0)):
            gen = [None]
            if engine is not None:
                engine.decode = decode
                gen[0] = engine.generate(prompts, n=2, temperature=temperature, top_p=1.0, max_new_tokens=8,
                                         stop_token_ids=[3], seed=11)
            dist.broadcast_object_list(gen, src=0)
            g = gen[0]
            rb = RolloutBatch.from_samples([prompts[i // 2] for i in range(6)], g.token_ids)
            trainer = actor.logprobs(rb, temperature)
            mask = rb.response_mask()
            engine_lp = torch.zeros_like(trainer)
            for i, lps in enumerate(g.logprobs):
                start = len(prompts[i // 2]) - 1
                engine_lp[i, start : start + len(lps)] = torch.tensor(lps)
            out[temperature if decode == "dynamic" else (decode, temperature)] = (
                algo.logprob_mismatch(engine_lp, trainer, mask), g)
        destroy_distributed()
        return out


# tiny-qwen3 at TP2xPP2: q/k norm weights are replicated over TP, their gradients partial over each rank's
# heads; after the update step every TP rank must hold the same norm, and the engine must get it. Megatron
# sums them over TP by name (config.qk_layernorm) or, under sequence parallelism, by their sequence_parallel tag.
@pytest.mark.parametrize("model,tp,pp,tied,sp", [
    ("tiny", 2, 2, False, False), ("tiny", 2, 2, True, False), ("tiny", 1, 1, False, False),
    ("tiny-qwen3", 2, 2, False, False), ("tiny-qwen3", 2, 2, False, True), ("tiny-qwen3-moe", 2, 1, False, True)])
def test_sync_after_update_is_exact_and_audited(model, tp, pp, tied, sp):
    res = run_ranks(_sync_and_sample, tp * pp, tp, pp, tied, 0.01, model, sp, timeout=300)
    r0 = res[0]
    stats = r0["stats"]
    assert r0["changed"] > 0 and stats.audited and stats.version == 1
    assert all(r["norm_spread"] == 0.0 for r in res), [r["norm_spread"] for r in res]
    assert _corrupted(load_model_config(model)) in r0["audit_error"] and "1 tensors differ" in r0["audit_error"]
    limit = 0.01 * 2**20
    counts = _hf_param_counts(tied, model)
    assert stats.buckets > 3 and stats.bytes == sum(4 * p for p in counts)
    assert stats.largest_bucket <= max(limit, 4 * max(counts))
    for key in (0.7, 1.0, ("static", 0.7), ("static", 1.0)):
        for r in res:  # every rank recomputed the same logprobs
            mismatch, gen = r[key]
            assert mismatch <= LOGP_TOL, f"engine vs trainer logprobs at {key}: {mismatch:.2e}"
            print(f"{model} TP{tp}xPP{pp} tied={tied} sp={sp} {key}: engine/trainer logprob mismatch {mismatch:.2e}")
        assert sum(len(t) for t in gen.token_ids) > 12


# tiny-qwen3-moe at EP2 (dp=2): rank 0 holds experts 0..E/2-1, rank 1 the rest; the engine on rank 0 must get
# every expert, trained, from the rank that holds it (a sync from rank 0 alone misses half: the audit names them).
# At PP2xEP2 (4 ranks) each stage's experts come from that stage's EP pair; at TP2xEP2 (4 ranks: tp2 x dp2, EP
# over DP) every expert is also split over the TP pair (megatron's expert tensor parallelism, the size of tp).
@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 1)])
def test_sync_at_ep2_gathers_every_expert_from_its_rank(tp, pp):
    res = run_ranks(_sync_and_sample, 2 * tp * pp, tp, pp, False, 0.01, "tiny-qwen3-moe", tp > 1, 2, timeout=300)
    r0, cfg = res[0], load_model_config("tiny-qwen3-moe")
    stats = r0["stats"]
    assert r0["changed"] > 0 and stats.audited and stats.version == 1
    assert "1 tensors differ" in r0["audit_error"]
    assert stats.bytes == sum(4 * p for p in _hf_param_counts(False, "tiny-qwen3-moe"))
    from grpo_mega.models import bridge

    held = {}
    for r in res:
        held.update(r["experts"])
    experts = {bridge.expert_of(n) for n in held}
    assert experts == set(range(cfg.num_experts)) and len(held) == 3 * cfg.num_experts * 2  # 3 MoE layers, fc1+fc2

    for name, t in held.items():  # the engine holds each expert bit for bit as the rank that trained it
        for hf_name, want in bridge.to_hf(name, t, cfg):
            assert torch.equal(r0["engine"][hf_name], want), hf_name
    for temperature in (0.7, 1.0):
        for r in res:
            mismatch, gen = r[temperature]
            assert mismatch <= LOGP_TOL, f"engine vs trainer logprobs at T={temperature}: {mismatch:.2e}"
            print(f"tiny-qwen3-moe TP{tp}xPP{pp}xEP2 T={temperature}: engine/trainer logprob mismatch {mismatch:.2e}")


def _hf_param_counts(tied, model="tiny"):
    cfg = load_model_config(model)
    cfg.tie_word_embeddings = tied
    engine = EmbeddedEngine.from_model_config(cfg)
    return [p.numel() for p in engine.params.values()]


def test_samples_are_distinct_and_reproducible():
    cfg = load_model_config("tiny")
    engine = EmbeddedEngine.from_model_config(cfg, seed=3)
    prompts = [[1, 2, 3], [4, 5]]
    a = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, stop_token_ids=[], seed=7)
    b = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, stop_token_ids=[], seed=7)
    c = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, stop_token_ids=[], seed=8)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids
    for g in range(2):
        group = [tuple(t) for t in a.token_ids[g * 4 : (g + 1) * 4]]
        assert len(set(group)) == 4  # n distinct samples
    assert a.finish_reasons == ["length"] * 8 and all(len(t) == 12 for t in a.token_ids)
    # a sample depends on (seed, prompt index, sample index), not on the rest of the batch
    alone = engine.generate([prompts[0]], n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, stop_token_ids=[], seed=7)
    assert alone.token_ids == a.token_ids[:4]
    assert max(abs(x - y) for la, lb in zip(alone.logprobs, a.logprobs[:4]) for x, y in zip(la, lb)) < 1e-5
    again = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=5, stop_token_ids=[], seed=7)
    assert [t[:5] for t in a.token_ids] == again.token_ids


def test_stop_tokens_end_samples_and_are_kept():
    cfg = load_model_config("tiny")
    engine = EmbeddedEngine.from_model_config(cfg, seed=3)
    greedy = engine.generate([[1, 2, 3]], n=1, temperature=0.0, top_p=1.0, max_new_tokens=6, stop_token_ids=[], seed=0)
    first = greedy.token_ids[0][0]
    stopped = engine.generate([[1, 2, 3]], n=1, temperature=0.0, top_p=1.0, max_new_tokens=6, stop_token_ids=[first], seed=0)
    assert stopped.token_ids == [[first]] and stopped.finish_reasons == ["stop"]
    assert greedy.finish_reasons == ["length"]


def test_bad_sync_input_is_named():
    cfg = load_model_config("tiny")
    engine = EmbeddedEngine.from_model_config(cfg)
    bad = list(pack_buckets(iter([("model.layers.0.nonexistent.weight", torch.zeros(2))]), 1024))
    with pytest.raises(KeyError, match="model.layers.0.nonexistent.weight"):
        engine.update_weights(2, bad)
    partial = list(pack_buckets(iter([("model.norm.weight", torch.ones(64))]), 1024))
    with pytest.raises(ValueError, match=r"did not update \d+ tensors"):
        engine.update_weights(2, partial)
    assert engine.weight_version == 0


def test_sampled_tokens_follow_the_softmax_and_the_nucleus():
    """The engine's inverse-CDF sampling against torch's own softmax of the same logits: 6,000 draws of one
    token from one prompt, chi-square over the 320 tokens within 6 standard deviations of its mean (an
    off-by-one in the CDF lookup or a wrong temperature puts it far outside); with top_p=0.5 no token outside
    the nucleus is ever drawn; each reported logprob is log_softmax at the drawn token."""
    cfg = load_model_config("tiny")
    engine = EmbeddedEngine.from_model_config(cfg, seed=3)
    prompt, n, temperature = [5, 9, 2], 6000, 0.1  # sharp enough (entropy 4.6 nats) that a 1.3x temperature fails
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    logp = torch.log_softmax(logits / temperature, -1)
    p = logp.exp()
    gen = engine.generate([prompt], n=n, temperature=temperature, top_p=1.0, max_new_tokens=1, stop_token_ids=[], seed=1)
    toks = torch.tensor([t[0] for t in gen.token_ids])
    counts = torch.bincount(toks, minlength=p.numel()).double()
    k = p.numel()
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert abs(chi2 - (k - 1)) < 6 * (2 * (k - 1)) ** 0.5, chi2
    assert max(abs(lp[0] - float(logp[t[0]])) for lp, t in zip(gen.logprobs, gen.token_ids)) < 1e-5

    nucleus = engine.generate([prompt], n=2000, temperature=temperature, top_p=0.5, max_new_tokens=1,
                              stop_token_ids=[], seed=2)
    order = p.argsort(descending=True)
    inside = set(order[: int((p[order].cumsum(0) - p[order] < 0.5).sum())].tolist())
    drawn = {t[0] for t in nucleus.token_ids}
    assert drawn <= inside and len(drawn) > 1, (len(drawn), len(inside))
