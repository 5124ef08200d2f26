"""rollout.mode=async against a real stand-in server (segments of 4 tokens) on 2 gloo ranks,
weights synced after every stand-in update while responses are in flight: the staleness bound holds for every
token handed out, groups are whole, every token's version and behaviour logprob are the ones that version's
weights give (float64 recomputation with transformers), responses continued across versions exist, stale groups
are dropped and counted; and a step's loss with the rollout correction equals a float64 recomputation against
those per-token behaviour logprobs, the old-logprob pass as the proximal policy. A checkpoint's groups (complete and
in flight) resume: the prompt stream and the responses' token prefixes carry on. Plus the demo task learning in
async mode (k = 2, partial rollouts) and resuming from its checkpoint, routing replay's routes joined over a
response's requests, and the refusals."""

import copy
import os
import time

import pytest
import torch

from grpo_mega.parallel.forked import run_ranks
from grpo_mega.processes import stop
from grpo_mega.engines import standin_server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
VOCAB, N, GROUPS, MAX_NEW, K, STEPS = 16, 2, 2, 16, 1, 5
SEGMENT_S = 0.05


@pytest.fixture(scope="module")
def server():
    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(VOCAB)], env=ENV, cwd=REPO,
                                      timeout_s=120)
    try:
        yield url
    finally:
        stop(proc)


def _engine(model="tiny"):
    from grpo_mega.conf import load_model_config
    from grpo_mega.engines.embedded import EmbeddedEngine

    cfg = load_model_config(model)
    cfg.vocab_size = VOCAB
    return EmbeddedEngine.from_model_config(cfg, seed=5)


def _weights(base: dict, version: int) -> dict:
    """Version v's weights: the base plus v seeded perturbations (big enough that versions' logprobs differ)."""
    g = torch.Generator().manual_seed(1000 + version)
    return {name: t + 0.3 * version * torch.randn(t.shape, generator=g) / max(1.0, t.shape[-1] ** 0.5)
            for name, t in sorted(base.items())}


class _Example:
    def __init__(self, prompt_ids):
        self.prompt_ids = prompt_ids


class _SlowClient:
    """The real client, each segment SEGMENT_S slower: a response stays in flight for several syncs' worth of time
    on any CPU (on a fast one the stand-in finished each group between two polls, and nothing was ever continued)."""

    def __init__(self, client):
        self.client, self.urls = client, client.urls

    def generate_segment(self, url, inputs, params, **kw):
        time.sleep(SEGMENT_S)
        return self.client.generate_segment(url, inputs, params, **kw)

    def update_weights(self, *args, **kwargs):
        return self.client.update_weights(*args, **kwargs)


class _Engines:
    """Engines' interface: the real client on rank 0 (slowed); sync sends _weights(version)."""

    def __init__(self, url, base, moe_layers=None):
        import torch.distributed as dist

        from grpo_mega.engines.client import ServerClient

        self.ranks, self.base = [0], base
        self.local = (_SlowClient(ServerClient([url], timeout_s=60, moe_layers=moe_layers)) if dist.get_rank() == 0
                      else None)
        if self.local is not None:
            self.local.moe_layers = moe_layers

    def sync(self, gpt, version):
        from grpo_mega.engines.weight_sync import pack_buckets

        if self.local is not None:
            self.local.update_weights(version, pack_buckets(iter(_weights(self.base, version).items()), 1 << 20))


def _run(url, model="tiny", steps=STEPS):
    """The loop's calls to the scheduler with a stand-in update (sleep); rank 0 returns the batches. An MoE `model`:
    with routing replay (the client asks for the routed experts)."""
    import random

    import torch.distributed as dist

    from grpo_mega.conf import load_model_config
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    base = {n: p.detach().clone() for n, p in _engine(model).params.items()}
    cfg = load_model_config(model)
    rng = random.Random(0)
    draw = lambda size: [_Example([rng.randrange(1, VOCAB) for _ in range(3)]) for _ in range(size)]  # noqa: E731
    s = AsyncRolloutScheduler(_Engines(url, base, cfg.moe_layers() if cfg.is_moe else None), draw, GROUPS,
                              SamplingArgs(N, 1.0, 1.0, MAX_NEW, [], seed=3), K, steps, partial=True, segment_tokens=4)
    s.sync_weights(None, version=0)
    out = []
    for step in range(1, steps + 1):
        got = s.result(step)
        out.append((step, [e.prompt_ids for e in got.examples], got.gen, s.metrics()))
        deadline = time.monotonic() + 20  # training: lasts until a response is half generated, then the sync lands
        while dist.get_rank() == 0 and time.monotonic() < deadline:
            partial, groups = s.in_flight_counts()
            if partial or not groups:
                break
            time.sleep(0.002)
        s.wait()
        if step == steps - 1 and dist.get_rank() == 0:  # what a checkpoint would carry (routing replay: the routes)
            saved = copy.deepcopy(s.state())
        s.sync_weights(None, version=step)
    s.close()
    if model != "tiny":
        return out, saved
    return out if dist.get_rank() == 0 else [(st, p, g.token_ids, m) for st, p, g, m in out]


@pytest.fixture(scope="module")
def batches(server):
    ranks = run_ranks(_run, 2, server, timeout=300)
    return ranks


def _ref_logprobs(model, prompt, tokens):
    """float64: each response token's logprob under `model` given the prompt and the tokens before it."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    p = len(prompt)
    return torch.stack([lp[p - 1 + t, tok] for t, tok in enumerate(tokens)])


def _models_at(model, base: dict):
    """v -> a float64 copy of `model` holding version v's weights (_weights of `base`), made once a version."""
    models = {}

    def model_at(v):
        if v not in models:
            m = copy.deepcopy(model).double()
            m.load_state_dict({k: t.double() for k, t in _weights(base, v).items()}, strict=False)
            models[v] = m
        return models[v]
    return model_at


def _own_version_logprobs(model_at, prompt, tokens, lps, vs, tol) -> float:
    """Each token's behaviour logprob is a float64 recomputation's under its own version (within `tol`), and the
    next version's weights would not pass; returns the largest difference."""
    got = torch.tensor(lps, dtype=torch.float64)
    under = {v: _ref_logprobs(model_at(v), prompt, tokens) for v in set(vs) | {v + 1 for v in vs}}
    want = torch.stack([under[v][t] for t, v in enumerate(vs)])
    assert torch.allclose(got, want, atol=tol, rtol=0), (got - want).abs().max()
    assert (got - torch.stack([under[v + 1][t] for t, v in enumerate(vs)])).abs().max() > 1e-2
    return float((got - want).abs().max())


def _kept_cache_logprobs(model_at, prompt, tokens, vs) -> torch.Tensor:
    """float64, transformers' model on one DynamicCache: the prompt fed under the version of the first token, each
    token after it under the version of the token it samples (what a server that keeps its keys and values across a
    weight update computes); the logprob of each token."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.no_grad():
        for t, tok in enumerate(tokens):
            feed = list(prompt) if t == 0 else [tokens[t - 1]]
            logits = model_at(vs[t])(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True).logits
            out.append(torch.log_softmax(logits[0, -1].double(), -1)[tok])
    return torch.stack(out)


def _counting_client(url, sent: list, **kw):
    """The real client, recording the request id of every /generate it sends in `sent`."""
    from grpo_mega.engines.client import ServerClient

    class Counting(ServerClient):
        def generate_segment(self, url, inputs, params, rids=None):
            sent.append(rids[0])
            return super().generate_segment(url, inputs, params, rids=rids)

    return Counting([url], **kw)


def test_bound_groups_versions_and_behaviour_logprobs(batches):
    rank0, rank1 = batches
    engine = _engine()
    model_at = _models_at(engine.model, {n: p.detach().clone() for n, p in engine.params.items()})

    continued, checked = 0, 0
    for (step, prompts, gen, metrics), (step1, prompts1, tokens1, metrics1) in zip(rank0, rank1):
        assert (step, prompts, gen.token_ids, metrics) == (step1, prompts1, tokens1, metrics1)  # every rank alike
        versions = gen.extra["token_versions"]
        assert len(prompts) == GROUPS and len(gen.token_ids) == GROUPS * N  # whole groups, group-contiguous
        for i, (tokens, lps, vs) in enumerate(zip(gen.token_ids, gen.logprobs, versions)):
            assert len(tokens) == len(lps) == len(vs) >= 1
            assert step - 1 - K <= min(vs) and max(vs) <= step - 1, (step, vs)  # the staleness bound
            assert vs == sorted(vs)
            continued += len(set(vs)) > 1
            if checked < 6 and len(set(vs)) > 1:  # behaviour logprobs are those of each token's own version
                checked += 1
                _own_version_logprobs(model_at, prompts[i // N], tokens, lps, vs, 2e-4)
        assert sum(metrics[f"async/token_lag_{j}"] for j in range(K + 1)) == pytest.approx(1.0)
        assert 0 <= metrics["async/trainer_idle_fraction"] <= 1 and 0 <= metrics["async/server_idle_fraction"] <= 1
        assert metrics["async/continued_samples"] == sum(len(set(v)) > 1 for v in versions)
    assert continued >= 2 and checked >= 1
    assert sum(m["async/token_lag_1"] > 0 for _, _, _, m in rank0) >= 1  # tokens from more than one version


def _restore_routes(saved, model):
    """A scheduler (no servers) restored from `saved`: every response's routes, in the groups' order."""
    import random
    from types import SimpleNamespace

    from grpo_mega.conf import load_model_config
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    rng = random.Random(0)  # _run's prompt stream
    draw = lambda size: [_Example([rng.randrange(1, VOCAB) for _ in range(3)]) for _ in range(size)]  # noqa: E731
    local = SimpleNamespace(urls=["http://unused"], moe_layers=load_model_config(model).moe_layers())
    s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=local), draw, GROUPS,
                              SamplingArgs(N, 1.0, 1.0, MAX_NEW, [], seed=3), K)
    draw(saved["first"])  # no task state here to set: the stream is wound on to the earliest group's prompt
    s.restore(saved)
    return [r.routes for g in s.done + s.carried for r in g.responses]


def test_routing_replay_joins_each_responses_routes_over_its_requests(tmp_path):
    """Routing replay in async mode (tiny-qwen3-moe on the stand-in, segments of 4 tokens, a sync while responses are
    half generated): each sample's routed experts cover its prompt and tokens but the last, and each position's are
    the top-k transformers' routers pick (a full forward) under the version of the request that fed it: the first
    token's for the prompt, else the version of the token it was fed to sample; responses continued across versions are
    among them, and the newest version's routes would not match. A checkpoint's groups carry the routes (through the
    checkpoint's safetensors file and back into a restored scheduler)."""
    from grpo_mega.conf import load_model_config
    from grpo_mega.engines.weight_sync import pack_buckets
    from grpo_mega.trainer.checkpoint import load_routes, save_routes

    model = "tiny-qwen3-moe"
    proc, url = standin_server.launch(["--model", model, "--port", "0", "--vocab-size", str(VOCAB)], env=ENV, cwd=REPO,
                                      timeout_s=120)
    try:
        (out, saved), = run_ranks(_run, 1, url, model, 4, timeout=300)
    finally:
        stop(proc)
    cfg = load_model_config(model)
    k, m = cfg.moe_router_topk, sum(cfg.moe_layers())
    engine = _engine(model)
    base, models = {n: p.detach().clone() for n, p in engine.params.items()}, {}

    def router_topk(v, ids):
        if v not in models:  # version v's weights loaded as the server loads them (HF names, fused experts);
            # float32, as transformers' grouped expert matmul takes no float64
            models[v] = _engine(model)
            models[v].update_weights(v, pack_buckets(iter(_weights(base, v).items()), 1 << 20))
        with torch.no_grad():
            logits = models[v].model(torch.tensor([ids]), output_router_logits=True).router_logits
        return torch.stack([lg.reshape(len(ids), -1) for lg in logits], 1)  # [positions, M, experts]

    continued = newest_differs = checked = 0
    for step, prompts, gen, _ in out:
        assert gen.routed_experts is not None and len(gen.routed_experts) == len(gen.token_ids)
        for i, (tokens, vs, got) in enumerate(zip(gen.token_ids, gen.extra["token_versions"], gen.routed_experts)):
            prompt = list(prompts[i // N])
            ids, fed = prompt + tokens[:-1], len(prompt) + len(tokens) - 1
            assert got.dtype == torch.int16 and tuple(got.shape) == (fed, m, k)
            want = torch.empty(fed, m, k, dtype=torch.long)
            near = torch.zeros(fed, m, dtype=torch.bool)  # a near-tie: the server's cached decode may pick either
            under = {v: router_topk(v, ids) for v in set(vs)}
            for q in range(fed):
                logits = under[vs[max(0, q - len(prompt) + 1)]][q]
                top = logits.topk(k + 1, -1)
                want[q], near[q] = top.indices[:, :k], (top.values[:, k - 1] - top.values[:, k]) < 1e-4
            same = (got.long().sort(-1).values == want.sort(-1).values).all(-1)
            assert (same | near).all(), (step, i, (~same).nonzero().tolist())
            checked += 1
            if len(set(vs)) > 1:
                continued += 1
                newest = router_topk(vs[-1], ids).topk(k, -1).indices.sort(-1).values
                newest_differs += not torch.equal(got.long().sort(-1).values, newest)
    assert checked == len(out) * GROUPS * N and continued >= 1 and newest_differs >= 1

    routes = saved["routed_experts"]
    responses = [r for g in saved["groups"] for r in g["responses"]]
    assert routes is not None and len(routes) == len(responses) >= 1
    for x, r, prompt in zip(routes, responses, [g["prompt"] for g in saved["groups"] for _ in g["responses"]]):
        assert (x is None) == (not r["tokens"]) and (x is None or x.shape[0] == len(prompt) + len(r["tokens"]) - 1)
    assert any(x is not None for x in routes)
    back = load_routes(tmp_path, save_routes(tmp_path, routes))
    (restored,) = run_ranks(_restore_routes, 1, {**saved, "routed_experts": back}, model, timeout=120)
    # restored: the complete groups then those in flight by index, the order state() lists them in
    assert len(restored) == len(routes)
    for a, b in zip(routes, restored):
        assert (a is None and b is None) or torch.equal(a, b)


def test_loss_uses_per_token_behaviour_logprobs(batches):
    """The loop's alignment (engine_logprobs) and the loss (ppo_clip with algo.engine_is_cap=2, the async default)
    on a batch whose tokens came from two versions, vs a float64 decoupled-PPO loss written out here."""
    from grpo_mega.algo.loss import local_normaliser
    from grpo_mega.algo.policy_loss import Objective, ppo_clip
    from grpo_mega.trainer.batch import RolloutBatch
    from grpo_mega.trainer.loop import engine_logprobs

    rank0, _ = batches
    step, prompts, gen, _ = max(rank0, key=lambda b: b[3]["async/continued_samples"])
    engine = _engine()
    base = {n: p.detach().clone() for n, p in engine.params.items()}
    prox, new = copy.deepcopy(engine.model).double(), copy.deepcopy(engine.model).double()
    prox.load_state_dict({k: t.double() for k, t in _weights(base, step - 1).items()}, strict=False)  # the trainer's
    new.load_state_dict({k: t.double() + 0.01 for k, t in _weights(base, step - 1).items()}, strict=False)  # updated
    sample_prompts = [prompts[i // N] for i in range(len(gen.token_ids))]
    rb = RolloutBatch.from_samples(sample_prompts, gen.token_ids)
    mask = rb.response_mask()
    old64, new64 = torch.zeros(rb.tokens.shape, dtype=torch.float64), torch.zeros(rb.tokens.shape, dtype=torch.float64)
    for i, (p, t) in enumerate(zip(sample_prompts, gen.token_ids)):
        start = len(p) - 1
        old64[i, start:start + len(t)] = _ref_logprobs(prox, p, t)
        new64[i, start:start + len(t)] = _ref_logprobs(new, p, t)
    behaviour = engine_logprobs(gen, rb)
    adv = torch.linspace(-1.0, 1.0, len(gen.token_ids))
    obj = Objective(engine_is_cap=2.0)
    loss, stats = ppo_clip(obj, logp=new64.float(), old_logp=old64.float(), advantages=adv, mask=mask,
                           normaliser=local_normaliser("token-mean", mask, MAX_NEW), entropy=torch.zeros(rb.tokens.shape),
                           engine_logp=behaviour)
    beh64 = torch.zeros(rb.tokens.shape, dtype=torch.float64)
    for i, (p, lps) in enumerate(zip(sample_prompts, gen.logprobs)):
        beh64[i, len(p) - 1:len(p) - 1 + len(lps)] = torch.tensor(lps, dtype=torch.float64)
    w = torch.exp(old64 - beh64).clamp(max=2.0)  # pi_prox / pi_behaviour, truncated (TIS)
    r = torch.exp(new64 - old64)  # clipped against the proximal policy
    a = adv.double()[:, None]
    pg = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2)) * w
    want = (pg * mask).sum() / mask.sum()
    assert abs(float(loss) - float(want)) <= 1e-5 * max(1.0, abs(float(want))), (float(loss), float(want))
    assert (w[mask] - 1).abs().max() > 1e-2  # the correction acts: the tokens are not all the trainer's own


class _Stream:
    """A task's prompt stream with its state (get_state / set_state, JSON as a checkpoint holds it): the examples
    carry their index in the stream."""

    def __init__(self):
        import random

        self.rng, self.count = random.Random(0), 0

    def draw(self, size):
        out = []
        for _ in range(size):
            ex = _Example([self.rng.randrange(1, VOCAB) for _ in range(3)])
            ex.index, self.count = self.count, self.count + 1
            out.append(ex)
        return out

    def get_state(self):
        version, internal, gauss = self.rng.getstate()
        return [version, list(internal), gauss, self.count]

    def set_state(self, state):
        self.rng.setstate((state[0], tuple(state[1]), state[2]))
        self.count = state[3]


SAVE = 2  # the step the checkpoint is of


def _steps(s, steps, sync_after=True):
    """The loop's calls for `steps` (as _run): rank 0's (step, example indices, generation, metrics) per step."""
    out = []
    for step in steps:
        got = s.result(step)
        out.append((step, [e.index for e in got.examples], got.gen, s.metrics()))
        _until_partial(s)
        s.sync_weights(None, version=step)
    return out


def _until_partial(s, seconds=20):
    """Training lasts until a response is half generated (the sync, or the checkpoint, lands then)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        partial, groups = s.in_flight_counts()
        if partial or not groups:
            return
        time.sleep(0.002)


def _run_resumed(url, fresh):
    """Steps 1..SAVE, a checkpoint (the scheduler's state through JSON, as loop_state.json holds it) with responses
    half generated, the process gone; a new scheduler on a new stream restored from it trains SAVE+1..STEPS; then the
    last step is rewound and checkpointed again. Without rollout.fresh_groups the checkpoint waits for a batch of
    complete groups too (with it, none starts while a batch waits, so a batch waiting leaves nothing in flight)."""
    import json

    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    base = {n: p.detach().clone() for n, p in _engine().params.items()}

    def scheduler(stream):
        return AsyncRolloutScheduler(_Engines(url, base), stream.draw, GROUPS, SamplingArgs(N, 1.0, 1.0, MAX_NEW, [], seed=3),
                                     K, STEPS, partial=True, segment_tokens=4, get_state=stream.get_state,
                                     set_state=stream.set_state, fresh=fresh)

    first = scheduler(_Stream())
    first.sync_weights(None, version=0)
    before = _steps(first, range(1, SAVE + 1))
    deadline = time.monotonic() + 20  # two complete groups waiting (their order is kept) and a response half done
    while not fresh and len(first.done) < GROUPS and time.monotonic() < deadline:
        time.sleep(0.002)
    _until_partial(first)
    saved = json.loads(json.dumps({"task": first.task_state(), "rollout": first.state()}))
    first.close()

    stream = _Stream()
    stream.set_state(saved["task"])  # what the trainer's setup does before the scheduler exists
    second = scheduler(stream)
    second.restore(saved["rollout"])
    again = json.loads(json.dumps({"task": second.task_state(), "rollout": second.state()}))  # a checkpoint right away
    second.sync_weights(None, version=SAVE)
    after = _steps(second, range(SAVE + 1, STEPS))
    got = second.result(STEPS)
    second.rewind()
    rewound = second.state()
    second.close()
    return before, saved, again, after, [e.index for e in got.examples], rewound


@pytest.mark.parametrize("fresh", [False, True], ids=["run_to_the_cap", "fresh_groups"])
def test_resume_carries_the_groups_in_flight_and_the_prompt_stream(server, fresh):
    """A checkpoint holds the groups complete and in flight with each response's tokens, logprobs and versions so far:
    the resumed run trains the complete ones first, continues the others from their token prefix (later tokens carry
    the resumed versions), draws no prompt twice and skips none, and holds the staleness bound; a rewound step's
    groups are back at the front of the next checkpoint. With rollout.fresh_groups (the default) and without."""
    before, saved, again, after, last, rewound = run_ranks(_run_resumed, 1, server, fresh, timeout=300)[0]
    state = saved["rollout"]
    assert again == saved  # restored, then checkpointed again: the same state (a resumed run resumes again)
    groups = {g["index"]: g for g in state["groups"]}
    partial = [(g["index"], j) for g in state["groups"] for j, r in enumerate(g["responses"])
               if r["finish"] is None and r["tokens"]]
    assert partial, "no response was half generated at the checkpoint"
    trained_before = [i for _, idx, _, _ in before for i in idx]
    assert not set(trained_before) & set(groups)  # a checkpoint holds what is not trained yet
    stream = _Stream().draw(state["started"] + 4 * GROUPS)
    trained_after = [i for _, idx, _, _ in after for i in idx] + last
    assert len(set(trained_before + trained_after)) == len(trained_before + trained_after)  # nothing trained twice
    assert min(trained_after) >= state["first"]  # the stream went on from the checkpoint's earliest group
    dropped = sum(m["async/dropped_stale_samples"] for _, _, _, m in after)
    missing = [i for i in groups if i not in trained_after]
    assert dropped >= N * len(missing)  # a saved group is trained, or dropped as too old and counted
    done = [g["index"] for g in state["groups"] if g["done"] and g["index"] in trained_after]
    assert len(done) >= (0 if fresh else 2) and trained_after[:len(done)] == done  # the complete ones first, in order
    continued = 0
    for step, idx, gen, _ in after:
        for gi, index in enumerate(idx):
            for j in range(N):
                row, tokens = gi * N + j, gen.token_ids[gi * N + j]
                versions = gen.extra["token_versions"][row]
                assert step - 1 - K <= min(versions) <= max(versions) <= step - 1  # the bound
                if index in groups:
                    r = groups[index]["responses"][j]
                    n = len(r["tokens"])
                    assert (tokens[:n], gen.logprobs[row][:n], versions[:n]) == (r["tokens"], r["logprobs"], r["versions"])
                    assert all(v >= SAVE for v in versions[n:])  # generated after the resume
                    continued += r["finish"] is None and n > 0
    assert continued >= 1
    assert [g["index"] for g in rewound["groups"][:GROUPS]] == last  # the rewound step's groups come first
    for index, g in groups.items():  # the same prompts as the stream drew before the kill
        assert g["prompt"] == stream[index].prompt_ids


def test_pause_with_abort_ends_the_request_in_flight(server):
    """The stand-in's /pause_generation (mode abort, as SGLang's) answers while a long /generate runs and ends it
    after its current token: the response so far with finish "abort", the first tokens of the same request left
    alone; a /generate sent while paused waits for /continue_generation."""
    import threading

    from grpo_mega.engines.client import ServerClient

    client = ServerClient([server], timeout_s=60)
    body = dict(input_ids=[[3, 4, 5]], return_logprob=True,
                sampling_params=[dict(max_new_tokens=4000, sampling_seed=11, temperature=1.0)])
    got, t = {}, {}

    def long_request():
        got["out"] = client._call(server, "/generate", body)[0]
        t["done"] = time.monotonic()

    runner = threading.Thread(target=long_request)
    runner.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    client._call(server, "/pause_generation", {"mode": "abort"})
    answered = time.monotonic() - t0
    runner.join(timeout=60)
    waiting = threading.Thread(target=lambda: got.update(later=client._call(server, "/generate", {
        **body, "sampling_params": [dict(max_new_tokens=3, sampling_seed=11, temperature=1.0)]})))
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive()  # held while paused
    client._call(server, "/continue_generation", {})
    waiting.join(timeout=60)
    out = got["out"]
    ids = out["output_ids"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(ids) < 4000
    assert answered < 2.0 and t["done"] - t0 < 5.0, (answered, t["done"] - t0)
    again = client._call(server, "/generate", {**body, "sampling_params": [
        dict(max_new_tokens=len(ids), sampling_seed=11, temperature=1.0)]})[0]
    assert again["output_ids"] == ids and got["later"][0]["output_ids"] == ids[:3]


def test_a_group_waiting_on_its_long_tail_leaves_its_finished_responses_room_to_new_groups():
    """One request per response, all in flight at once, and room on a server counts unfinished responses, not groups:
    while one response of group 0 runs on, new groups' requests run beside it (as many responses as the batch's
    share: 2 groups x 2), so the server decodes that many rows per step instead of the tail alone; the staleness
    cap still bounds the starts."""
    import threading
    from types import SimpleNamespace

    from grpo_mega.engines.interface import sample_seed
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    long_seed, lock, flying, seen = sample_seed(3 * 1_000_003, 0, 0) % (2**31), threading.Lock(), [], []
    budgets = set()

    class Client:
        urls = ["u"]

        def generate_segment(self, url, inputs, params, rids=None):  # group 0's first response: 6 segments, others 1
            seeds = [p["custom_params"]["sample_seed"] for p in params]
            with lock:
                budgets.update((p["custom_params"]["generated"], p["max_new_tokens"]) for p in params)
                flying.extend(seeds)
                seen.append(list(flying))
            time.sleep(0.05)
            with lock:
                for x in seeds:
                    flying.remove(x)
            return [([5], [-0.1], "length" if p["custom_params"]["sample_seed"] == long_seed and
                     p["custom_params"]["generated"] < 5 else "stop", [0]) for p in params]

    draw = lambda size: [_Example([1, 2]) for _ in range(size)]  # noqa: E731
    s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=Client()), draw, 2, SamplingArgs(2, 1.0, 1.0, 40, [], seed=3),
                              staleness=2, fresh=False)  # nothing trains: the workers run on to the cap
    s._start_workers()
    try:
        with s.cond:
            assert s.cond.wait_for(lambda: len(s.done) == 6 or s.error, timeout=30), (seen, s.error)
    finally:
        s.close()
    assert s.error is None and s.started == 6  # (version 0 + k 2 + 1) x 2 groups: the cap
    assert max(len(f) for f in seen) == 5, seen  # the tail (1) + two new groups (4); by groups alone it would be 1 + 2
    assert any(len(f) == 5 and long_seed in f for f in seen), seen  # beside the tail, not after it
    assert [g.index for g in s.done][-1] == 0 and len(s.done[-1].responses[0].tokens) == 6
    # rollout.segment_tokens=0 (the default): each request asks for the rest of the response's budget of 40
    assert budgets == {(g, 40 - g) for g in range(6)}, budgets


def test_a_group_in_flight_that_falls_behind_the_bound_is_dropped_at_once():
    """k = 1: group 0's first response never ends (each request a cut segment), so it started on version 0 and can
    never be trained once the trainer takes step 3 (versions >= 1). It is dropped then, in flight: counted, out of
    the checkpoint's groups, its response not sent again (a server's time goes to groups that can train)."""
    import threading
    from types import SimpleNamespace

    from grpo_mega.engines.interface import sample_seed
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    long_seed, lock, version, sent = sample_seed(3 * 1_000_003, 0, 0) % (2**31), threading.Lock(), [0], []

    class Client:
        urls = ["u"]

        def generate_segment(self, url, inputs, params, rids=None):
            time.sleep(0.01)
            with lock:
                sent.extend(p["custom_params"]["sample_seed"] for p in params)
                return [([5], [-0.1], "length" if p["custom_params"]["sample_seed"] == long_seed else "stop",
                         [version[0]]) for p in params]

    draw = lambda size: [_Example([1, 2]) for _ in range(size)]  # noqa: E731
    s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=Client()), draw, 1, SamplingArgs(2, 1.0, 1.0, 10_000, [],
                              seed=3), staleness=1, fresh=False)
    s._start_workers()
    try:
        deadline = time.monotonic() + 30
        while sent.count(long_seed) < 3 and time.monotonic() < deadline:  # resent while it may still train
            time.sleep(0.01)
        for step in (1, 2, 3):
            out, _ = s._take(step)
            assert "error" not in out and out["groups"][0].index != 0, out
            with s.cond:  # the sync after the step
                s.version = version[0] = step
                s.cond.notify_all()
        time.sleep(0.5)  # a request in flight at the drop comes back
        with lock:
            long_requests = sent.count(long_seed)
        time.sleep(0.3)
        with lock:
            assert sent.count(long_seed) == long_requests >= 3, "sent again before the drop, never after"
        with s.cond:
            assert s.dropped_groups == 1 and 0 not in [g.index for g in s._saved()[0]]  # what a checkpoint holds
    finally:
        s.close()


def test_with_drop_stale_off_a_group_past_the_bound_is_trained_when_it_completes():
    """rollout.drop_stale=false, k = 1: group 0's first response is cut 6 times (a request a version) before it stops,
    so its oldest token (version 0) falls behind the bound at step 3; it is not dropped but sent on, trained when it
    completes, its tokens' lags beyond k counted (async/token_lag_over_k, async/sample_lag_over_k); k still bounds
    the starts ((v + k + 1) x train_batch_size groups), and no sample is dropped."""
    import threading
    from types import SimpleNamespace

    from grpo_mega.engines.interface import sample_seed
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    long_seed, lock, version = sample_seed(3 * 1_000_003, 0, 0) % (2**31), threading.Lock(), [0]
    segments = {}  # version -> the long response's segments sampled under it

    class Client:
        urls = ["u"]

        def generate_segment(self, url, inputs, params, rids=None):
            time.sleep(0.01)
            with lock:
                out = []
                for p in params:
                    long = p["custom_params"]["sample_seed"] == long_seed
                    if long:  # one segment a version, the sixth its last
                        while segments.get(version[0], 0) and len(segments) < 6:
                            lock.release()
                            time.sleep(0.01)
                            lock.acquire()
                        segments[version[0]] = segments.get(version[0], 0) + 1
                    out.append(([5], [-0.1], "length" if long and len(segments) < 6 else "stop", [version[0]]))
                return out

    draw = lambda size: [_Example([1, 2]) for _ in range(size)]  # noqa: E731
    s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=Client()), draw, 1, SamplingArgs(2, 1.0, 1.0, 10_000, [],
                              seed=3), staleness=1, fresh=False, drop_stale=False)
    s._start_workers()
    taken, metrics = [], []
    try:
        for step in range(1, 8):
            out, _ = s._take(step)
            assert "error" not in out, out
            taken += [g.index for g in out["groups"]]
            metrics.append(out["metrics"])
            if 0 in taken:
                break
            with s.cond:  # the sync after the step
                s.version = version[0] = step
                s.cond.notify_all()
        with s.cond:
            started = s.started
    finally:
        s.close()
    at = taken.index(0) + 1  # group 0 trained at step `at`, its first token of version 0: lag at - 1 > k = 1
    assert at >= 6 and sorted(segments) == list(range(6)), (taken, segments)
    assert sum(m["async/dropped_stale_samples"] for m in metrics) == 0
    last = metrics[at - 1]
    assert last["async/sample_lag_over_k"] == 1.0  # both its responses began at version 0, at least k + 4 behind
    tokens = {lag: 0 for lag in range(at)}  # the long response: a token a version 0..5, the other one token of 0
    for v in list(range(6)) + [0]:
        tokens[at - 1 - v] += 1
    over = sum(n for lag, n in tokens.items() if lag > 1) / sum(tokens.values())
    assert last["async/token_lag_over_k"] == pytest.approx(over)
    assert last["async/token_lag_0"] + last["async/token_lag_1"] + over == pytest.approx(1.0)
    assert started <= (version[0] + 1 + 1) * 1  # the starts stay bounded: (v + k + 1) x train_batch_size


def test_with_pause_mode_retract_a_group_that_falls_behind_has_its_open_requests_aborted():
    """rollout.pause_mode=retract: a request stays open across updates, its tokens unknown until it ends, so a group
    is as old as the version its requests were sent at; once the trainer's bound passes that, its open request is
    ended on the server by its request id (SGLang's /abort_request) and the group is dropped."""
    import threading
    from types import SimpleNamespace

    from grpo_mega.engines.interface import sample_seed
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    long_seed, open_, aborted, version = sample_seed(3 * 1_000_003, 0, 0) % (2**31), {}, [], [0]

    class Client:
        urls = ["u"]
        interrupt, pause_mode = False, "abort"

        def check_pause_mode(self):
            pass

        def generate_segment(self, url, inputs, params, rids=None):
            if params[0]["custom_params"]["sample_seed"] != long_seed:
                time.sleep(0.01)
                return [([5], [-0.1], "stop", [version[0]])]
            open_[rids[0]] = threading.Event()  # runs until aborted
            assert open_[rids[0]].wait(30)
            return [([5, 6], [-0.1, -0.2], "abort", [0, 1])]

        def abort_requests(self, url, rids):
            aborted.extend(rids)
            for rid in rids:
                if rid in open_:
                    open_[rid].set()

    draw = lambda size: [_Example([1, 2]) for _ in range(size)]  # noqa: E731
    client = Client()
    s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=client), draw, 1, SamplingArgs(2, 1.0, 1.0, 100, [],
                              seed=3), staleness=1, fresh=False, pause_mode="retract")
    assert client.interrupt and client.pause_mode == "retract"
    s._start_workers()
    try:
        for step in (1, 2):  # version 0's groups are trainable through step 2
            out, _ = s._take(step)
            assert "error" not in out and out["groups"][0].index != 0, out
            with s.cond:
                s.version = version[0] = step
                s.cond.notify_all()
            time.sleep(0.3)  # the quick responses sent at the version before have come back
        assert not aborted
        out, _ = s._take(3)  # needs versions >= 1: group 0, sent at version 0, can never train
        with s.cond:
            assert s.cond.wait_for(lambda: aborted, timeout=10)
        assert aborted == list(open_) and aborted[0].split("-")[2] == "0"  # group 0's request, the one open
        with s.cond:
            assert s.dropped_groups == 1 and 0 not in [g.index for g in s._saved()[0]]
    finally:
        for e in open_.values():
            e.set()
        s.close()


def _run_retract(url, pause_mode):
    """pause_mode=retract or in_place against the stand-in (each decode step slowed): one request per response, every
    sync landing while responses decode; rank 0 returns the batches and the /generate requests sent."""
    from grpo_mega.engines.weight_sync import pack_buckets
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    base = {n: p.detach().clone() for n, p in _engine().params.items()}
    sent = []

    class Engines:
        ranks, local = [0], _counting_client(url, sent, timeout_s=60)

        def sync(self, gpt, version):
            self.local.update_weights(version, pack_buckets(iter(_weights(base, version).items()), 1 << 20))

    stream = _Stream()
    s = AsyncRolloutScheduler(Engines(), stream.draw, GROUPS, SamplingArgs(N, 1.0, 1.0, MAX_NEW, [], seed=3), K, STEPS,
                              partial=True, pause_mode=pause_mode)
    s.sync_weights(None, version=0)
    out = []
    try:
        for step in range(1, STEPS + 1):
            got = s.result(step)
            out.append((step, [e.prompt_ids for e in got.examples], got.gen, s.metrics()))
            if step == STEPS:  # no request comes after the last step's batch
                break
            deadline = time.monotonic() + 20  # training: until a response is in flight, then the sync lands
            while s.requests == 0 and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(0.05)
            s.sync_weights(None, version=step)
    finally:
        s.close()
    return out, sent


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pause_mode", ["retract", "in_place"])
def test_pause_mode_retract_or_in_place_continues_a_response_across_updates_in_one_request(pause_mode):
    """rollout.pause_mode=retract against the stand-in: every sync retracts the responses decoding (their requests
    stay open), the server prefills them again under the new weights and samples on; each response is one request
    (none resent), its tokens carry the version that sampled them (SGLang's weight_versions spans), within the
    staleness bound, with behaviour logprobs equal to a float64 recomputation under each token's own version. With
    in_place the responses stay in the batch and sample on from the keys and values computed so far: their logprobs
    are a float64 decode feeding each position under the version that sampled the token after it."""
    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(VOCAB),
                                       "--simulate-decode-ms", "10"], env=ENV, cwd=REPO, timeout_s=120)
    try:
        ((batches, sent),) = run_ranks(_run_retract, 1, url, pause_mode, timeout=240)
    finally:
        stop(proc)
    engine = _engine()
    model_at = _models_at(engine.model, {n: p.detach().clone() for n, p in engine.params.items()})
    assert len(sent) == len(set(sent))  # no request sent twice: a retracted one stays open
    continued = checked = 0
    for step, prompts, gen, metrics in batches:
        for i, (tokens, lps, vs) in enumerate(zip(gen.token_ids, gen.logprobs, gen.extra["token_versions"])):
            assert len(tokens) == len(lps) == len(vs) >= 1 and vs == sorted(vs)
            assert step - 1 - K <= min(vs) and max(vs) <= step - 1, (step, vs)
            continued += len(set(vs)) > 1
            if checked < 4 and len(set(vs)) > 1:
                checked += 1
                if pause_mode == "retract":
                    _own_version_logprobs(model_at, prompts[i // N], tokens, lps, vs, 2e-4)
                    continue
                got, want = torch.tensor(lps, dtype=torch.float64), _kept_cache_logprobs(model_at, prompts[i // N],
                                                                                        tokens, vs)
                assert torch.allclose(got, want, atol=2e-4, rtol=0), (got - want).abs().max()
                first_new = vs.index(vs[-1])  # retract's prefill again under the new weights would not pass
                again = _ref_logprobs(model_at(vs[-1]), prompts[i // N], tokens)[first_new:]
                assert (got[first_new:] - again).abs().max() > 1e-2
    assert continued >= 1 and checked >= 1


def test_fresh_groups_start_none_while_a_batch_waits():
    """rollout.fresh_groups: with generation far faster than training, no group starts while a batch of complete
    groups waits; taking the batch lets the workers start again (without it they run to the staleness cap). A
    trainer that had to wait for its batch lets them run ahead, to the cap. async/room_held_by_* say which rule
    held the workers' room, for how much of the time."""
    from types import SimpleNamespace

    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    class Client:
        urls = ["u"]

        def generate_segment(self, url, inputs, params, rids=None):
            return [([5], [-0.1], "stop", [0]) for _ in params]

    draw = lambda size: [_Example([1, 2]) for _ in range(size)]  # noqa: E731
    for fresh, started in ((False, 6), (True, 2)):
        s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=Client()), draw, 2,
                                  SamplingArgs(2, 1.0, 1.0, 8, [], seed=3), staleness=2, fresh=fresh)
        s._start_workers()
        try:
            with s.cond:
                assert s.cond.wait_for(lambda: len(s.done) == started, timeout=30)
            time.sleep(0.3)  # the worker would have started more by now
            assert s.started == started, (fresh, s.started)
            out, _ = s._take(1)
            assert len(out["groups"]) == 2
            # since the scheduler began: held (from the first fraction of the 0.3 s on) by the rule that held it
            held = {k: out["metrics"][f"async/room_held_by_{k}"] for k in ("staleness", "fresh")}
            assert held["fresh" if fresh else "staleness"] > 0.5 and held["staleness" if fresh else "fresh"] == 0, held
            if fresh:
                with s.cond:
                    assert s.cond.wait_for(lambda: s.started == 4, timeout=5)  # woken by the take, not a 1 s poll
                time.sleep(0.3)
                assert s.started == 4 and not s.trainer_waited
        finally:
            s.close()
    class SlowClient(Client):
        def generate_segment(self, url, inputs, params, rids=None):
            time.sleep(0.05)
            return super().generate_segment(url, inputs, params)

    s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=SlowClient()), draw, 2,
                              SamplingArgs(2, 1.0, 1.0, 8, [], seed=3), staleness=2)  # rollout.fresh_groups, the default
    s._start_workers()
    try:
        out, _ = s._take(1)  # at once: the trainer waits for its batch, so the servers are behind
        assert len(out["groups"]) == 2 and s.trainer_waited
        with s.cond:
            assert s.cond.wait_for(lambda: s.started == 6, timeout=5), s.started  # (0 + k 2 + 1) x 2: the cap
        time.sleep(0.3)
        out, _ = s._take(2)  # since the last take: the cap held the worker once the servers had caught up (the
        # fresh rule only until the worker woke to the first take: it had held the batch that take waited for)
        held = {k: out["metrics"][f"async/room_held_by_{k}"] for k in ("staleness", "fresh")}
        assert 0.3 < held["staleness"] < 1 and held["fresh"] < 0.05, held
    finally:
        s.close()


def test_a_run_that_drops_many_samples_as_stale_is_told_once(caplog):
    """Over the last 10 steps more than 10% of the completed samples dropped for staleness: one warning naming the
    share and the bound, not one a step; a run that drops fewer is not warned."""
    from types import SimpleNamespace

    from grpo_mega.rollout.async_scheduler import DROP_WINDOW, AsyncRolloutScheduler, Group, Response
    from grpo_mega.rollout.scheduler import SamplingArgs

    def group(version):
        return Group(0, _Example([1, 2]), [Response(0, [5], [-0.1], [version], "stop") for _ in range(2)])

    for stale_every, warned in ((1, True), (5, False)):  # a stale group in every step's 3 (1/3) or every 5th (1/16)
        s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=SimpleNamespace(urls=["u"])),
                                  lambda size: [], 2, SamplingArgs(2, 1.0, 1.0, 8, [], seed=3), staleness=1)
        caplog.clear()
        for step in range(1, 2 * DROP_WINDOW + 1):
            s.done = ([group(step - 3)] if step % stale_every == 0 else []) + [group(step - 1), group(step - 2)]
            out, _ = s._take(step)
            assert [g.oldest for g in out["groups"]] == [step - 1, step - 2]
        said = [r.getMessage() for r in caplog.records if "dropped as older" in r.getMessage()]
        if warned:
            assert len(said) == 1 and said[0].startswith(
                "rollout.mode=async: 20 of the 60 samples completed in the last 10 steps (33%) were dropped as older "
                "than rollout.off_policy_steps=1 allows"), said
        else:
            assert said == [], said


OPEN_FILES = """
import resource, sys
from types import SimpleNamespace
from grpo_mega.engines.client import open_files_for
from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
from grpo_mega.rollout.scheduler import SamplingArgs

resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))
assert open_files_for(100) == 256 and open_files_for(1000) == 4096  # raised to the hard limit when short
assert resource.getrlimit(resource.RLIMIT_NOFILE) == (4096, 4096)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2000))
s = AsyncRolloutScheduler(SimpleNamespace(ranks=[0], local=SimpleNamespace(urls=["u1", "u2"])), lambda size: [], 64,
                          SamplingArgs(16, 1.0, 1.0, 8, [], seed=3), staleness=2)
s._start_workers()  # 2 servers x (32 x 16 + 16 in flight + 32 idle) + 1024 > 2000: no worker, the error for every rank
print(s._take(1)[0]["error"][0], len(s.workers))
"""


def test_rank_0_makes_room_for_a_connection_per_response_or_names_the_limit():
    """Async mode holds a connection per unfinished response: the soft limit on open files (1024 on many clusters) is
    raised to the hard limit when short, and a hard limit too low for the batch is named, with the way out, for every
    rank (as a worker's error) before any request is sent. Run in a process of its own (it lowers its limits)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", OPEN_FILES], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == (
        "rollout.mode=async keeps one request per unfinished response in flight, each on a connection of its own (2 "
        "servers x 528 from batch.train_batch_size=64 x rollout.n=16), so rank 0 needs about 2144 open files and this "
        "process may open 256 (soft limit), at most 2000 (hard limit, ulimit -Hn): raise the job's limit on open "
        "files, or lower batch.train_batch_size x rollout.n per server (more servers) 0"), done.stdout


def test_refusals():
    from grpo_mega.conf.rollout import RolloutConfig
    from grpo_mega.conf.schema import TrainConfig

    with pytest.raises(ValueError, match="rollout.mode=async needs rollout.off_policy_steps=k >= 1"):
        RolloutConfig(mode="async", placement="dedicated", servers=["http://x:1"])
    with pytest.raises(ValueError, match="must be 0 or 1 with rollout.mode=sync"):
        RolloutConfig(off_policy_steps=2, placement="dedicated", servers=["http://x:1"])
    r = dict(mode="async", off_policy_steps=2, placement="dedicated", servers=["http://x:1"])
    with pytest.raises(ValueError, match="rollout.mode=async with algo.dynamic_sampling=refill"):
        TrainConfig(rollout=r, algo=dict(dynamic_sampling="refill"))
    TrainConfig(rollout=r, checkpoint=dict(dir="/tmp/x"))  # checkpoints resume (the test above)
    with pytest.raises(ValueError, match="rollout.pause_mode='keep' must be 'abort', 'retract' or 'in_place'"):
        RolloutConfig(**r, pause_mode="keep")
    with pytest.raises(ValueError, match="rollout.drop_stale=false is for rollout.mode=async"):
        RolloutConfig(off_policy_steps=1, placement="dedicated", servers=["http://x:1"], drop_stale=False)
    from types import SimpleNamespace

    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import RolloutScheduler, SamplingArgs

    engines, sampling = SimpleNamespace(ranks=[0], local=None), SamplingArgs(N, 1.0, 1.0, MAX_NEW, [], seed=3)
    sync_state = dict(step=3, prompts=[[1, 2]], token_ids=[[3]], logprobs=[[-0.1]], finish_reasons=["stop"],
                      weight_version=1)
    with pytest.raises(ValueError, match="written with rollout.mode=sync .* resume it with rollout.mode=sync"):
        AsyncRolloutScheduler(engines, None, GROUPS, sampling, 2).restore(sync_state)
    with pytest.raises(ValueError, match="written with rollout.mode=async .* resume it with rollout.mode=async"):
        RolloutScheduler(engines, None, GROUPS, sampling, 1).restore(dict(mode="async", started=4, groups=[]))
    TrainConfig(rollout=r, algo=dict(dynamic_sampling="filter"))  # filter works: it only masks groups
    with pytest.raises(ValueError, match="rollout.replay_dir with checkpoint.dir: a replay does not resume"):
        TrainConfig(rollout={**r, "replay_dir": "/tmp/d"}, checkpoint=dict(dir="/tmp/x"))
    with pytest.raises(ValueError, match="rollout.replay_dir with algo.dynamic_sampling=refill"):
        TrainConfig(rollout={**r, "mode": "sync", "off_policy_steps": 1, "replay_dir": "/tmp/d"},
                    algo=dict(dynamic_sampling="refill"))


def test_replay_reads_a_dump_and_names_what_does_not_match(tmp_path):
    """rollout.replay_dir's reader: an async dump's groups come back with the prompts the task draws again at their
    start order (drawn ahead and kept for later steps), tokens, logprobs and versions as dumped; a prompt the task no
    longer draws there, a missing step and a partial group are each named."""
    import json

    from grpo_mega.engines.interface import Generation
    from grpo_mega.rollout.dump import write_dump
    from grpo_mega.rollout.replay import ReplayScheduler

    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]  # the task's stream
    stream = iter(prompts)
    gen = Generation(token_ids=[[9], [10, 11], [12], [13]], logprobs=[[-0.5], [-0.25, -1.0], [-2.0], [-0.125]],
                     finish_reasons=["stop", "length", "stop", "stop"], weight_version=3,
                     extra={"token_versions": [[3], [3, 4], [4], [4]], "prompt_index": [2, 2, 0, 0]})
    write_dump(tmp_path / "train_step_00000001.jsonl", 1, [_Example(prompts[2]), _Example(prompts[0])], gen, [0.0] * 4)
    replay = ReplayScheduler(None, lambda size: [_Example(next(stream)) for _ in range(size)], str(tmp_path), 2)
    examples, got = replay._read(1)
    assert [e.prompt_ids for e in examples] == [prompts[2], prompts[0]] and sorted(replay.drawn) == [1]
    assert (got.token_ids, got.logprobs, got.finish_reasons) == (gen.token_ids, gen.logprobs, gen.finish_reasons)
    assert got.weight_version == 3 and got.extra["token_versions"] == gen.extra["token_versions"]
    with pytest.raises(ValueError, match="no train_step_00000002.jsonl; the dumping run stopped before step 2"):
        replay._read(2)
    lines = (tmp_path / "train_step_00000001.jsonl").read_text().splitlines()
    bad = [json.loads(x) for x in lines]
    bad[0]["prompt_index"] = bad[1]["prompt_index"] = 1  # the task draws [3, 4] there, not [5, 6]
    (tmp_path / "train_step_00000002.jsonl").write_text("\n".join(json.dumps(x) for x in bad) + "\n")
    with pytest.raises(ValueError, match="prompt 1 is not the one the task draws now"):
        replay._read(2)
    (tmp_path / "train_step_00000003.jsonl").write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(ValueError, match="3 samples, not whole groups of rollout.n=2"):
        replay._read(3)


def test_demo_task_learns_in_async_mode(server, tmp_path):
    """20 steps of the demo in async mode, k = 2, partial rollouts in segments of 2 tokens: the validation reward
    rises (the whole demo's 200 steps are too long for this tier; bench_results/async.json and the issue's report
    compare the curves with the in-turn run), and the trained tokens come from more than one version. Its checkpoint
    of step 10 (groups complete and in flight) resumes for two more steps, and trains as the uninterrupted run on
    the same samples: a run replaying what both dumped (rollout.replay_dir) gives every step's metrics to 1e-6."""
    import json
    import shutil

    from tests.fork_server import run_main

    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = ["eval.interval=20", "rollout.placement=dedicated", f"rollout.servers=[{server}]", "rollout.mode=async",
            "rollout.off_policy_steps=2", "rollout.segment_tokens=2"]
    done = run_main([f"hydra.run.dir={out}", "run.steps=20", *argv, f"checkpoint.dir={ckpt}", "checkpoint.interval=10",
                     f"rollout.dump_dir={tmp_path / 'dump'}"], timeout=900, cwd=REPO, scratch=tmp_path, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    loop_state = json.loads((ckpt / "step_00000010" / "loop_state.json").read_text())
    saved, groups_per_step = loop_state["rollout"], loop_state["config"]["batch"]["train_batch_size"]
    assert saved["mode"] == "async" and saved["groups"] and saved["started"] > 10 * groups_per_step
    shutil.copytree(ckpt / "step_00000010", tmp_path / "ckpt10" / "step_00000010")
    more = run_main([f"hydra.run.dir={tmp_path / 'resumed'}", "run.steps=12", *argv, f"checkpoint.dir={tmp_path / 'ckpt10'}",
                     f"rollout.dump_dir={tmp_path / 'dump_resumed'}"], timeout=300, cwd=REPO, scratch=tmp_path, env=ENV)
    assert more.returncode == 0, more.stderr[-3000:]
    resumed = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert [r["step"] for r in resumed] == [11, 12]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    trace = tmp_path / "trace"  # what steps 1-10 of the first run and 11-12 of the resumed one trained on
    trace.mkdir()
    for step in range(1, 13):
        name = f"train_step_{step:08d}.jsonl"
        shutil.copy((tmp_path / "dump" if step <= 10 else tmp_path / "dump_resumed") / name, trace / name)
    replay = run_main([f"hydra.run.dir={tmp_path / 'replay'}", "run.steps=12", *argv, f"rollout.replay_dir={trace}"],
                      timeout=300, cwd=REPO, scratch=tmp_path, env=ENV)
    assert replay.returncode == 0, replay.stderr[-3000:]
    replayed = [json.loads(line) for line in open(tmp_path / "replay" / "metrics.jsonl")]
    assert [r["step"] for r in replayed] == list(range(1, 13))
    for want, got in zip(rows[:10] + resumed, replayed):
        for key in ("reward", "loss", "pg_loss", "grad_norm", "entropy", "is_weight_mean", "logprob_mismatch",
                    "weight_version", "rows_in_loss"):
            assert abs(float(got[key]) - float(want[key])) <= 1e-6, (want["step"], key, got[key], want[key])
    assert abs(replayed[-1]["val_reward"] - resumed[-1]["val_reward"]) <= 1e-6
    import re

    m = re.search(r"validation reward \(greedy\): ([\d.]+) at step 0 -> ([\d.]+) after 20 steps", done.stdout)
    assert m and float(m.group(2)) >= float(m.group(1)) + 0.15, done.stdout[-500:]
    assert len({v for r in rows for v in (r["weight_version"], r["step"] - 1)}) > 1
    assert sum(r["async/token_lag_1"] + r["async/token_lag_2"] > 0 for r in rows) >= len(rows) // 2
    assert all(r["async/dropped_stale_samples"] >= 0 and r["async/generated_tokens_per_s"] >= 0 for r in rows)
