"""rollout.mode=async against a real SGLang server (`python -m sglang.launch_server`, its CPU engine; the sglang
tier): the scheduler's segments are SGLang /generate requests continued from their token prefix, and the weights go
to the server through SGLang's own update API between two of them while responses are in flight. Every token handed
out lies within the staleness bound and carries the version SGLang reports for the request that sampled it; a
response continued across an update has the tokens after it from the new version, with behaviour logprobs equal to
a float64 recomputation under each token's own version (and not under the next one's). With
rollout.pause_mode=retract (SGLang's /pause_generation mode "retract", on a server started with
--disable-radix-cache; refused on one with its radix cache) a response is one request kept open across the updates,
and its tokens' versions come from SGLang's weight_versions spans, the logprobs after an update again the new
version's. With rollout.pause_mode=in_place (SGLang's mode "in_place", on the same server, started also with
--disable-overlap-schedule; refused on one with its overlap scheduler, whose token in flight at a pause SGLang
reports under the new version) a response is again one request, but it samples on after an update from the keys and
values its prefix left under the old weights: its logprobs are a float64 decode that feeds each position under the
version that sampled the token after it (and not a recomputation under one version)."""

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from grpo_mega.parallel.forked import RankFailed, run_ranks
from grpo_mega.processes import stop
from tests.models.hf_fixtures import tiny_hf
from tests.rollout.test_async import (GROUPS, MAX_NEW, N, _counting_client, _kept_cache_logprobs, _models_at,
                                      _own_version_logprobs, _ref_logprobs, _steps, _Stream, _weights)

pytestmark = pytest.mark.sglang
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures")  # the stand-in sgl_kernel
K, STEPS = 1, 4
LOGP_TOL = 3e-5  # per token, SGLang's fp32 CPU engine vs float64 transformers (measured 2.8e-6)


def _base(hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(hf_dir, url, partial, pause_mode="abort"):
    """The loop's calls to the scheduler; each sync sends version v's weights (_weights) through SGLang's update API.
    With pause_mode "retract" rank 0 also returns the request ids sent."""
    from grpo_mega.engines.weight_sync import pack_buckets
    from grpo_mega.rollout.async_scheduler import AsyncRolloutScheduler
    from grpo_mega.rollout.scheduler import SamplingArgs

    _, base = _base(hf_dir)
    sent = []

    class Engines:
        ranks = [0]

        def __init__(self):  # an update group a run
            self.local = _counting_client(url, sent, timeout_s=120, group_name=f"async_{partial}_{pause_mode}")

        def sync(self, gpt, version):
            self.local.update_weights(version, pack_buckets(iter(_weights(base, version).items()), 1 << 20))

    stream = _Stream()
    max_new = MAX_NEW if pause_mode == "abort" else 4 * MAX_NEW  # retract, in_place: decoding at a sync
    s = AsyncRolloutScheduler(Engines(), stream.draw, GROUPS, SamplingArgs(N, 1.0, 1.0, max_new, [], seed=3), K, STEPS,
                              partial=partial, segment_tokens=4 if pause_mode == "abort" else 0,
                              get_state=stream.get_state, set_state=stream.set_state, pause_mode=pause_mode)
    s.sync_weights(None, version=0)
    try:
        if partial and pause_mode != "abort":  # each sync lands while responses decode (their requests open)
            out = []
            for step in range(1, STEPS + 1):
                got = s.result(step)
                out.append((step, [e.index for e in got.examples], got.gen, s.metrics()))
                if step == STEPS:  # no request comes after the last step's batch
                    break
                deadline = time.monotonic() + 20
                while s.requests == 0 and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(0.05)
                s.sync_weights(None, version=step)
            return out, sent
        if partial:
            return _steps(s, range(1, STEPS + 1))
        out = []
        for step in range(1, STEPS + 1):  # each sync lands while a whole-response request is on the server
            got = s.result(step)
            out.append((step, [e.index for e in got.examples], got.gen, s.metrics()))
            if step == STEPS:  # no request comes after the last step's batch
                break
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
    # pause_mode=retract and in_place run on a server without a radix cache (in_place: nor the overlap scheduler),
    # started beside the first (the tier runs one test at a time: the other core is free)
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(launch_sglang, hf_dir, count=1, log_dir=str(tmp_path), env=env, timeout_s=240, cpu=True,
                             extra=("--disable-radix-cache", "--disable-overlap-schedule"))
        try:
            ((proc, url),) = launch_sglang(hf_dir, count=1, log_dir=str(tmp_path), env=env, timeout_s=240, cpu=True)
            try:
                (batches,) = run_ranks(_run, 1, hf_dir, url, True, timeout=400)
                (whole,) = run_ranks(_run, 1, hf_dir, url, False, timeout=400)
                with pytest.raises(RankFailed, match="--disable-radix-cache"):  # this server runs its radix cache
                    run_ranks(_run, 1, hf_dir, url, True, "retract", timeout=400)
                with pytest.raises(RankFailed, match="--disable-radix-cache --disable-overlap-schedule"):
                    run_ranks(_run, 1, hf_dir, url, True, "in_place", timeout=400)
            finally:
                stop(proc)
        except BaseException:
            for proc, _ in second.result():
                stop(proc)
            raise
        ((proc, url),) = second.result()
    try:
        with urllib.request.urlopen(url + "/server_info", timeout=30) as resp:  # the fields check_pause_mode reads
            info = json.loads(resp.read())
        assert info["disable_radix_cache"] is True and info["disable_overlap_schedule"] is True
        ((retracted, sent),) = run_ranks(_run, 1, hf_dir, url, True, "retract", timeout=400)
        ((in_place, sent_in_place),) = run_ranks(_run, 1, hf_dir, url, True, "in_place", timeout=400)
    finally:
        stop(proc)

    model_at = _models_at(*_base(hf_dir))

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
                worst = max(worst, _own_version_logprobs(model_at, prompts[idx[row // N]].prompt_ids, tokens, lps, vs,
                                                         LOGP_TOL))
        assert metrics["async/continued_samples"] == sum(len(set(v)) > 1 for v in versions)
    assert continued >= 1 and checked >= 1
    assert sum(m.get("requests_at_sync", 0) > 0 for _, _, _, m in whole) >= 2  # syncs met requests in flight
    for step, idx, gen, _ in whole:  # partial rollouts off: one version per response, its logprobs that version's
        for row, (tokens, lps, vs) in enumerate(zip(gen.token_ids, gen.logprobs, gen.extra["token_versions"])):
            assert len(set(vs)) == 1 and step - 1 - K <= vs[0] <= step - 1, (step, vs)
            if row < 2:
                want = _ref_logprobs(model_at(vs[0]), prompts[idx[row // N]].prompt_ids, tokens)
                assert torch.allclose(torch.tensor(lps, dtype=torch.float64), want, atol=LOGP_TOL, rtol=0)
    assert len(sent) == len(set(sent))  # retract: no request sent twice
    spanned = 0
    for step, idx, gen, _ in retracted:  # each response one request; its tokens after an update the new version's
        for row, (tokens, lps, vs) in enumerate(zip(gen.token_ids, gen.logprobs, gen.extra["token_versions"])):
            assert len(tokens) == len(lps) == len(vs) >= 1 and vs == sorted(vs)
            assert step - 1 - K <= vs[0] and vs[-1] <= step - 1, (step, vs)
            if len(set(vs)) > 1 and spanned < 4:
                spanned += 1
                worst = max(worst, _own_version_logprobs(model_at, prompts[idx[row // N]].prompt_ids, tokens, lps, vs,
                                                         LOGP_TOL))
    assert spanned >= 1
    assert len(sent_in_place) == len(set(sent_in_place))  # in_place: no request sent twice either
    kept, worst_kept = 0, 0.0
    for step, idx, gen, _ in in_place:  # each response one request, its old keys and values kept across an update
        for row, (tokens, lps, vs) in enumerate(zip(gen.token_ids, gen.logprobs, gen.extra["token_versions"])):
            assert len(tokens) == len(lps) == len(vs) >= 1 and vs == sorted(vs)
            assert step - 1 - K <= vs[0] and vs[-1] <= step - 1, (step, vs)
            if len(set(vs)) > 1 and kept < 4:
                kept += 1
                prompt = prompts[idx[row // N]].prompt_ids
                got, want = torch.tensor(lps, dtype=torch.float64), _kept_cache_logprobs(model_at, prompt, tokens, vs)
                assert torch.allclose(got, want, atol=LOGP_TOL, rtol=0), (got - want).abs().max()
                worst_kept = max(worst_kept, float((got - want).abs().max()))
                first_new = vs.index(vs[-1])  # a prefill again under the last version would not pass
                again = _ref_logprobs(model_at(vs[-1]), prompt, tokens)[first_new:]
                assert (got[first_new:] - again).abs().max() > 1e-2
    assert kept >= 1
    print(f"SGLang async: {continued} responses continued across an update ({spanned} in one retracted request, "
          f"{kept} in one in_place request); behaviour logprobs vs float64 recomputation max {worst:.2e}, vs a "
          f"float64 decode on the kept keys and values {worst_kept:.2e}")

