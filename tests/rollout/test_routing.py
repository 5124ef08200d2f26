"""Rollout routing (grpo_mega.rollout.routing): rank 0's samples reach each DP replica only as the rows it runs,
and training on what a rank received is bit for bit training on the whole batch."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from grpo_mega.conf import ParallelConfig
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.routing import Routing
from grpo_mega.trainer.actor import Actor
from grpo_mega.trainer.batch import RolloutBatch
from grpo_mega.trainer.loop import engine_logprobs
from tests.trainer import layouts as L


def _full_generation():
    """16 samples (4 prompts x 4) of mixed lengths, with engine logprobs, as rank 0's engine would return."""
    g = torch.Generator().manual_seed(3)
    vocab = L.model_cfg().vocab_size
    prompts, tokens, logps = [], [], []
    for i in range(16):
        if i % 4 == 0:
            prompt = torch.randint(0, vocab, (int(torch.randint(3, L.MAX_PROMPT + 1, (1,), generator=g)),), generator=g).tolist()
        prompts.append(prompt)
        r = int(torch.randint(1, L.MAX_RESPONSE + 1, (1,), generator=g))
        tokens.append(torch.randint(0, vocab, (r,), generator=g).tolist())
        logps.append((-torch.rand(r, generator=g)).tolist())
    finish = ["length" if len(t) == L.MAX_RESPONSE else "stop" for t in tokens]
    return prompts, Generation(token_ids=tokens, logprobs=logps, finish_reasons=finish, weight_version=7)


def _snapshot(gpt):
    return [p.detach().clone() for p in gpt.parameters()]


def _restore(actor, snap):
    with torch.no_grad():
        for p, s in zip(actor.built.gpt.parameters(), snap):
            p.copy_(s)
    actor.optimizer.reload_model_params()


def _route(tp, pp, packing):
    with cpu_compat.cpu_device_mode():
        layout = init_distributed(tp=tp, pp=pp, seed=5)
        kw = L.configs("token-mean", 2, optim="sgd")
        kw["batch"] = dataclasses.replace(kw["batch"], train_batch_size=4, ppo_mini_batch_size=2, packing=packing)
        actor = Actor(L.model_cfg(), ParallelConfig(tp=tp, pp=pp), **kw)
        routing = Routing(actor.dp_rows)
        rank = dist.get_rank()
        prompts, full = _full_generation()
        got = routing.share(full if rank == 0 else None, [len(p) for p in prompts])
        seq_lens = [len(p) + len(t) for p, t in zip(prompts, full.token_ids)]
        first, needs = actor.dp_rows(seq_lens)
        held = list(range(16)) if rank == 0 else got.extra["held"]
        out = dict(rank=rank, dp=layout.dp_rank, held=held, first=first, needs=needs, owned=routing.owned(seq_lens),
                   sent=routing.sent_rows, meta_ok=(got.finish_reasons == full.finish_reasons
                                                     and got.weight_version == 7
                                                     and [len(t) for t in got.token_ids] == [len(t) for t in full.token_ids]),
                   rows_ok=all(got.token_ids[i] == full.token_ids[i] and got.logprobs[i] == full.logprobs[i] for i in held))

        # training on the routed samples is training on the whole batch: the same logprobs, the same update
        results = {}
        snap = _snapshot(actor.built.gpt)
        for label, gen in (("full", full), ("routed", got)):
            _restore(actor, snap)
            rb = RolloutBatch.from_samples(prompts, gen.token_ids)
            rb.old_logp = actor.logprobs(rb, 1.0)
            rb.ref_logp = rb.old_logp
            rb.engine_logp = engine_logprobs(gen, rb)
            rb.advantages = torch.linspace(-1, 1, 16)
            updates = actor.update(rb, 1.0)
            results[label] = (rb.old_logp, updates, [p.detach().clone() for p in actor.built.gpt.parameters()])
        out["same_logp"] = torch.equal(results["full"][0], results["routed"][0])
        out["same_metrics"] = results["full"][1] == results["routed"][1]
        out["same_params"] = all(torch.equal(a, b) for a, b in zip(results["full"][2], results["routed"][2]))
        out["updates"] = len(results["full"][1])
        destroy_distributed()
        return out


@pytest.mark.parametrize("tp,pp,packing", [(2, 1, True), (1, 2, True), (2, 1, False)])
def test_each_replica_gets_only_its_rows_and_trains_as_on_the_whole_batch(tp, pp, packing):
    """4 ranks (TP2 x DP2, or PP2 x DP2), 16 samples, 2 mini-batches, packed or padded: each rank receives exactly the
    rows its DP replica runs (its share of each mini-batch, which the logprob pass runs too, so the replicas'
    rows partition the batch); rank 0 sends nothing more; each sample
    is owned by one rank that holds it; and the logprobs, update metrics and updated weights from the routed
    samples equal those from the whole batch, bit for bit (the placeholders are never read)."""
    res = run_ranks(_route, 4, tp, pp, packing, timeout=300)
    needs = res[0]["needs"]
    assert all(r["needs"] == needs and r["first"] == res[0]["first"] for r in res)  # one plan, from the lengths
    for r in res:
        assert r["meta_ok"] and r["rows_ok"]
        if r["rank"]:
            assert r["held"] == needs[r["dp"]]
        assert r["same_logp"] and r["same_metrics"] and r["same_params"], r["rank"]
        assert r["updates"] == 2
    assert res[0]["sent"] == sum(len(needs[r["dp"]]) for r in res if r["rank"])
    # each replica needs exactly its share: the logprob pass runs each mini-batch's DP shares, as the update does
    assert needs == res[0]["first"] and sorted(i for n in needs for i in n) == list(range(16))
    owned = [i for r in res for i in r["owned"]]
    assert sorted(owned) == list(range(16))  # each sample owned once in the world
    assert all(set(r["owned"]) <= set(r["held"]) for r in res)
