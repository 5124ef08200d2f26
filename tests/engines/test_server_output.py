"""Nothing a rollout server answers is trusted (grpo_mega.engines.validate): token ids integral and in the vocabulary,
one finite logprob <= 0 per token, a known finish reason, routed experts in range, distinct and k = top-k, checked
before anything is narrowed; a violation is a ServerError naming the server and the field. A transient failure is
retried with backoff, and a run that still meets it exits 75 with a REQUEUE file, what slurm/train.sbatch requeues.

The server is the stand-in (the embedded engine behind SGLang's API); a proxy in front of it (experiments/proxies.py)
corrupts one field of its answers, as a broken or hostile server would."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import pytest
import torch

from experiments.proxies import ForwardingProxy
from grpo_mega.processes import stop
from grpo_mega.engines import standin_server
from grpo_mega.engines.client import ServerClient, ServerError
from grpo_mega.engines.validate import LOGPROB_TOLERANCE, BadOutput, OutputSpec, check_generation, finish_reason, \
    logprobs, routed_experts, sglang_sample, token_ids
from tests.fork_server import run_main

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64
SPEC = OutputSpec(vocab_size=VOCAB, num_experts=8, top_k=2)


# ---- the checks, one field at a time --------------------------------------------------------------------------

@pytest.mark.parametrize("ids,match", [
    ([1, 6.7], r"output_ids\[1\] = 6\.7 is not an integer token id"),  # int() would have made it 6
    ([1, 6.0], r"output_ids\[1\] = 6\.0 is not an integer"),
    ([True, 2], r"output_ids\[0\] = True is not an integer"),
    ([3, -1], r"output_ids\[1\] = -1 is outside the vocabulary \[0, 64\)"),
    ([VOCAB], r"output_ids\[0\] = 64 is outside the vocabulary"),
    ("12", r"output_ids is str, not a list"),
])
def test_token_ids(ids, match):
    with pytest.raises(BadOutput, match=match):
        token_ids(ids, SPEC)
    assert token_ids([0, 5, VOCAB - 1], SPEC) == [0, 5, VOCAB - 1]


@pytest.mark.parametrize("values,count,match", [
    ([-0.5], 2, r"has 1 logprobs for 2 tokens"),  # the old client filled the gap with 0
    ([-0.5, float("nan")], 2, r"\[1\] = nan is not a finite logprob"),
    ([-float("inf")], 1, r"\[0\] = -inf is not a finite logprob"),
    ([0.5], 1, r"\[0\] = 0\.5 is not a finite logprob <= 0\.001"),
    ([None], 1, r"\[0\] = None is not a number"),  # SGLang's orjson writes NaN as null
    ([-1, -10**400], 2, r"\[1\] = -1000.* is not a finite logprob"),  # JSON's integers have no bound
])
def test_logprobs(values, count, match):
    with pytest.raises(BadOutput, match=match):
        logprobs(values, count)
    assert logprobs([-1.0, 0, LOGPROB_TOLERANCE / 2], 3) == [-1.0, 0.0, LOGPROB_TOLERANCE / 2]


def test_finish_reasons():
    assert finish_reason("stop") == "stop" and finish_reason("length") == "length"
    for bad in ("abort", None, "eos"):
        with pytest.raises(BadOutput, match=r"not one of \('stop', 'length'\)"):
            finish_reason(bad)


def test_routed_experts_are_checked_before_narrowing():
    ok = torch.tensor([[[0, 7], [-1, -1]], [[3, 1], [2, 5]]], dtype=torch.int32)  # [positions 2, layers 2, k 2]
    got = routed_experts(ok, 2, SPEC)
    assert got.dtype == torch.int16 and torch.equal(got, ok.to(torch.int16))
    cases = [
        (65539, r"\[0, 0, 0\] = 65539 is not an expert id in \[0, 8\) or -1"),  # int16 would make it 3
        (40000, r"= 40000 is not an expert id"),  # int16 would make it -25536, below "no route"
        (8, r"= 8 is not an expert id in \[0, 8\)"),  # past the router's gather
        (-2, r"= -2 is not an expert id"),
        (7, r"\[0, 0\] = \[7, 7\]: the k experts of a token must be distinct"),
        (-1, r"\[0, 0\] = \[-1, 7\]: the k experts of a token must be distinct \(or all -1\)"),
    ]
    for value, match in cases:
        bad = ok.clone()
        bad[0, 0, 0] = value
        with pytest.raises(BadOutput, match=match):
            routed_experts(bad, 2, SPEC)
    with pytest.raises(BadOutput, match=r"has 3 experts per token, not the model's top-k 2"):
        routed_experts(torch.zeros(2, 2, 3, dtype=torch.int32), 2, SPEC)
    with pytest.raises(BadOutput, match=r"covers 2 positions, not the 3 fed to the model"):
        routed_experts(ok, 3, SPEC)


def _output(ids=(5, 9), lps=(-0.5, -1.0), reason="stop", entry_ids=None):
    entry_ids = ids if entry_ids is None else entry_ids
    return {"output_ids": list(ids), "meta_info": {"finish_reason": {"type": reason, "message": "too long"},
                                                   "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, entry_ids)]}}


def test_an_sglang_output():
    assert sglang_sample(_output(), SPEC) == ([5, 9], [-0.5, -1.0], "stop")
    with pytest.raises(BadOutput, match=r"meta_info\.finish_reason\.type is 'abort: too long'"):
        sglang_sample(_output(reason="abort"), SPEC)
    # ended by /pause_generation (rollout.mode=async's weight sync): its tokens so far, continued by the scheduler
    assert sglang_sample(_output(reason="abort"), SPEC, aborted_ok=True) == ([5, 9], [-0.5, -1.0], "abort")
    with pytest.raises(BadOutput, match=r"output_token_logprobs\[1\] is for token 8, output_ids\[1\] = 9"):
        sglang_sample(_output(entry_ids=(5, 8)), SPEC)
    with pytest.raises(BadOutput, match=r"has 1 logprobs for 2 tokens"):
        sglang_sample(_output(lps=(-0.5,)), SPEC)


def test_a_generation_from_an_engine_in_this_process():
    from grpo_mega.engines.interface import Generation

    gen = Generation(token_ids=[[1, 2], [3]], logprobs=[[-0.1, -0.2], [-0.3]], finish_reasons=["stop", "length"],
                     weight_version=0)
    check_generation(gen, SPEC)
    gen.logprobs[1] = [float("nan")]
    with pytest.raises(BadOutput, match=r"sample 1: logprobs\[0\] = nan is not a finite logprob"):
        check_generation(gen, SPEC)


# ---- through the client, from a server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(VOCAB)],
                                      env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO), timeout_s=120)
    yield url
    stop(proc)


class _Corrupting(ForwardingProxy):
    """Forwards to the server; `corrupt(outputs, request)` edits each /generate answer (a list of SGLang outputs)."""

    def __init__(self, target, corrupt):
        self.corrupt = corrupt
        super().__init__(target, timeout_s=60.0, serial=True)

    def upstream(self, method, path, body):
        self.request = json.loads(body) if body else None
        return super().upstream(method, path, body)

    def after(self, path, code, data):
        if path != "/generate" or code != 200:
            return data
        outs = json.loads(data)
        self.corrupt(outs, self.request)
        return json.dumps(outs).encode()


def _first(field, value):
    def corrupt(outs, request):
        o = outs[0]
        if field == "id":
            o["output_ids"][0] = value
        elif field == "logprob":
            o["meta_info"]["output_token_logprobs"][0][0] = value
        elif field == "fewer_logprobs":
            o["meta_info"]["output_token_logprobs"].pop()
        elif field == "finish":
            o["meta_info"]["finish_reason"] = {"type": value, "message": "aborted by the scheduler"}
    return corrupt


def _routes(value, k=2):
    """Adds SGLang's routed_experts (base64 int32 [positions, layers 4, k]) to every output, one id set to `value`."""
    def corrupt(outs, request):
        for o, prompt in zip(outs, request["input_ids"]):
            positions = len(prompt) + len(o["output_ids"]) - 1
            r = torch.arange(k, dtype=torch.int32).repeat(positions, 4, 1)
            r[0, 1, 0] = value
            o["meta_info"]["routed_experts"] = base64.b64encode(r.numpy().tobytes()).decode()
    return corrupt


CASES = {
    "fractional_id": (_first("id", 6.7), r"output 0: output_ids\[0\] = 6\.7 is not an integer token id"),
    "id_past_the_vocabulary": (_first("id", VOCAB + 3), r"output_ids\[0\] = 67 is outside the vocabulary \[0, 64\)"),
    "negative_id": (_first("id", -4), r"output_ids\[0\] = -4 is outside the vocabulary"),
    "nan_logprob_as_null": (_first("logprob", None), r"output_token_logprobs\[0\] = None is not a number"),
    "positive_logprob": (_first("logprob", 3.0), r"output_token_logprobs\[0\] = 3\.0 is not a finite logprob"),
    "fewer_logprobs_than_tokens": (_first("fewer_logprobs", None), r"output_token_logprobs has \d+ logprobs for \d+ tokens"),
    "aborted": (_first("finish", "abort"), r"finish_reason\.type is 'abort: aborted by the scheduler', not one of"),
    "expert_id_wrapping_int16": (_routes(65539), r"routed_experts\[0, 1, 0\] = 65539 is not an expert id in \[0, 8\)"),
    "duplicate_experts": (_routes(1), r"routed_experts\[0, 1\] = \[1, 1\]: the k experts of a token must be distinct"),
    "k_not_top_k": (_routes(0, k=3), r"routed_experts has 3 experts per token, not the model's top-k 2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_answer_is_a_server_error_naming_the_server_and_the_field(server, case):
    corrupt, pattern = CASES[case]
    proxy = _Corrupting(server, corrupt)
    try:
        moe = [True] * 4 if "expert" in case or "top_k" in case else None
        client = ServerClient([proxy.url], timeout_s=30, spec=SPEC, moe_layers=moe, retries=0)
        with pytest.raises(ServerError) as e:
            client.generate([[1, 2, 3], [4, 5]], 2, 1.0, 1.0, 4, [], 0)
    finally:
        proxy.close()
    assert str(e.value).startswith(f"rollout server {proxy.url} answered /generate with a bad output ")
    assert re.search(pattern, str(e.value)), str(e.value)
    assert not e.value.transient


class _Failing(ForwardingProxy):
    """The first `failures` /generate calls fail: answered 503, or (`drop`) the connection closed unanswered."""

    def __init__(self, target, failures, drop=False):
        self.failures, self.drop, self.calls = failures, drop, 0
        super().__init__(target, timeout_s=60.0, serial=True)

    def before(self, handler, path):
        if path == "/generate":
            self.calls += 1
            if self.calls <= self.failures and self.drop:
                return False
        return True

    def upstream(self, method, path, body):
        if path == "/generate" and self.calls <= self.failures and not self.drop:
            return 503, b'{"error": "overloaded"}'
        return super().upstream(method, path, body)


@pytest.mark.parametrize("drop", [False, True])
def test_a_transient_failure_is_retried_with_backoff(server, drop):
    proxy = _Failing(server, failures=2, drop=drop)
    try:
        client = ServerClient([proxy.url], timeout_s=30, spec=SPEC, retries=3, backoff_s=0.05)
        gen = client.generate([[1, 2, 3]], 2, 1.0, 1.0, 4, [], 0)
        assert len(gen.token_ids) == 2 and proxy.calls == 3
        proxy.failures, proxy.calls = 10, 0
        with pytest.raises(ServerError) as e:
            client.generate([[1, 2, 3]], 2, 1.0, 1.0, 4, [], 0)
    finally:
        proxy.close()
    assert e.value.transient and proxy.calls == 4 and "(tried 4 times; rollout.server_retries=3)" in str(e.value)


def test_a_run_that_gives_up_on_its_server_exits_75_with_a_requeue_file(tmp_path):
    """Every /generate fails (503): the client retries, then the run ends with one line, exit status 75
    (EX_TEMPFAIL) and REQUEUE in its run directory, what slurm/train.sbatch requeues."""
    from grpo_mega.data.toy import make_tokenizer

    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(len(make_tokenizer()))],
                                      env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO), timeout_s=120)
    proxy = _Failing(url, failures=10 ** 6)
    out = tmp_path / "run"
    out.mkdir()
    try:
        done = run_main([f"hydra.run.dir={out}", "run.steps=2", "eval.interval=0", "rollout.placement=dedicated",
                         f"rollout.servers=[{proxy.url}]", "rollout.server_timeout_s=30", "rollout.server_retries=2",
                         "rollout.server_retry_backoff_s=0.05"], timeout=300, cwd=REPO, scratch=tmp_path,
                        env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"})
    finally:
        proxy.close()
        stop(proc)
    assert done.returncode == 75, done.stderr[-3000:]
    errors = re.findall(r"(?m)^error: .*", done.stderr)
    assert len(errors) == 1 and f"rollout server {proxy.url} refused /generate (HTTP 503)" in errors[0] \
        and "(tried 3 times; rollout.server_retries=2)" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert proxy.url in (out / "REQUEUE").read_text()
