"""rollout.mode=async against a real SGLang server (`python -m sglang.launch_server`, its CPU engine; the sglang
tier): the scheduler's segments are SGLang /generate requests continued from their token prefix, and the weights go
to the server through SGLang's own update API between two of them while responses are in flight. Every token handed
out lies within the staleness bound and carries the version SGLang reports for the request that sampled it; a
response continued across an update has the tokens after it from the new version, with behaviour logprobs equal to
a float64 recomputation under each token's own version (and not under the next one's)."""

import copy
import os
import time

import pytest
import torch

from grpo_mega.parallel.forked import run_ranks
from grpo_mega.processes import stop
from tests.models.hf_fixtures import tiny_hf
from tests.rollout.test_async import GROUPS, MAX_NEW, N, _ref_logprobs, _steps, _Stream, _weights

pytestmark = pytest.mark.sglang
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures")  # the stand-in sgl_kernel
K, STEPS = 1, 4
LOGP_TOL = 3e-5  # per token, SGLang's fp32 CPU engine vs float64 transformers (measured 2.8e-6)


def _base(hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(hf_dir, url, partial):
    """The loop's calls to the scheduler; each sync sends version v's weights (_weights) through SGLang's update API."""
    from grpo_mega.engines.client import ServerClient
    from grpo_mega.engines.weight_sync import pack_buckets
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    _, base = _base(hf_dir)

    class Engines:
        ranks = [0]

        def __init__(self):
            self.local = ServerClient([url], timeout_s=120, group_name=f"async_partial_{partial}")  # a group a run

        def sync(self, gpt, version):
            self.local.update_weights(version, pack_buckets(iter(_weights(base, version).items()), 1 << 20))

    stream = _Stream()
    s = AsyncRolloutScheduler(Engines(), stream.draw, GROUPS, SamplingArgs(N, 1.0, 1.0, MAX_NEW, [], seed=3), K, STEPS,
                              partial=partial, segment_tokens=4, get_state=stream.get_state, set_state=stream.set_state)
    s.sync_weights(None, version=0)
    try:
        if partial:
            return _steps(s, range(1, STEPS + 1))
        out = []
        for step in range(1, STEPS + 1):  # each sync lands while a whole-response request is on the server
            got = s.result(step)
            out.append((step, [e.index for e in got.examples], got.gen, s.metrics()))
            deadline = time.monotonic() + 20
            while s.requests == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            out[-1][3]["requests_at_sync"] = s.requests
            s.sync_weights(None, version=step)
        return out
    finally:
        s.close()


@pytest.mark.timeout(600)
def test_async_segments_and_updates_on_a_real_sglang_server(tmp_path):
    """Partial rollouts (segments interrupted by each update and continued), then, against the same server, partial
    rollouts off: each response one request, drained before each update, so every response has one version."""
    from grpo_mega.engines.sglang_launch import launch_sglang

    hf_dir = str(tiny_hf(tmp_path / "llama", "llama", dtype=torch.float32))
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (FIXTURES, REPO, os.environ.get("PYTHONPATH")) if p)}
    ((proc, url),) = launch_sglang(hf_dir, count=1, log_dir=str(tmp_path), env=env, timeout_s=240, cpu=True)
    try:
        (batches,) = run_ranks(_run, 1, hf_dir, url, True, timeout=400)
        (whole,) = run_ranks(_run, 1, hf_dir, url, False, timeout=400)
    finally:
        stop(proc)

    engine, base = _base(hf_dir)
    models = {}

    def model_at(v):
        if v not in models:
            m = copy.deepcopy(engine).double()
            m.load_state_dict({k: t.double() for k, t in _weights(base, v).items()}, strict=False)
            models[v] = m
        return models[v]

    prompts = _Stream().draw(64)
    continued, checked, worst = 0, 0, 0.0
    for step, idx, gen, metrics in batches:
        versions = gen.extra["token_versions"]
        assert len(idx) == GROUPS and len(gen.token_ids) == GROUPS * N
        for row, (tokens, lps, vs) in enumerate(zip(gen.token_ids, gen.logprobs, versions)):
            assert len(tokens) == len(lps) == len(vs) >= 1 and vs == sorted(vs)
            assert step - 1 - K <= min(vs) and max(vs) <= step - 1, (step, vs)  # the staleness bound
            continued += len(set(vs)) > 1
            if checked < 4 and len(set(vs)) > 1:  # each token's behaviour logprob is its own version's
                checked += 1
                prompt = prompts[idx[row // N]].prompt_ids
                got = torch.tensor(lps, dtype=torch.float64)
                under = {v: _ref_logprobs(model_at(v), prompt, tokens) for v in set(vs) | {v + 1 for v in vs}}
                want = torch.stack([under[v][t] for t, v in enumerate(vs)])
                worst = max(worst, float((got - want).abs().max()))
                assert torch.allclose(got, want, atol=LOGP_TOL, rtol=0), (got - want).abs().max()
                other = torch.stack([under[v + 1][t] for t, v in enumerate(vs)])
                assert (got - other).abs().max() > 1e-2  # another version's weights would not pass
        assert metrics["async/continued_samples"] == sum(len(set(v)) > 1 for v in versions)
    assert continued >= 1 and checked >= 1
    assert sum(m["requests_at_sync"] > 0 for _, _, _, m in whole) >= 2  # syncs met requests in flight
    for step, idx, gen, _ in whole:  # partial rollouts off: one version per response, its logprobs that version's
        for row, (tokens, lps, vs) in enumerate(zip(gen.token_ids, gen.logprobs, gen.extra["token_versions"])):
            assert len(set(vs)) == 1 and step - 1 - K <= vs[0] <= step - 1, (step, vs)
            if row < 2:
                want = _ref_logprobs(model_at(vs[0]), prompts[idx[row // N]].prompt_ids, tokens)
                assert torch.allclose(torch.tensor(lps, dtype=torch.float64), want, atol=LOGP_TOL, rtol=0)
    print(f"SGLang async: {continued} responses continued across an update; behaviour logprobs vs float64 "
          f"recomputation max {worst:.2e}")
