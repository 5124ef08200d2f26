"""Dedicated rollout servers (the embedded engine behind SGLang's HTTP API) and the client: after each sync
every server holds the trainer's weights (audit, logprobs to 1e-5), prompts are spread by outstanding tokens,
an unreachable server is named at start-up, and a server killed mid-run stops every trainer rank with one
line naming its URL."""

import os
import socket
import select
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from grpo_mega import algo
from grpo_mega.processes import stop
from grpo_mega.engines import standin_server
from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from grpo_mega.engines.client import ServerClient, ServerError
from grpo_mega.rollout.placement import Engines, RolloutError
from grpo_mega.trainer.batch import RolloutBatch
from grpo_mega.trainer.loop import engine_logprobs
from tests.trainer import layouts as L

LOGP_TOL = 1e-5  # mean absolute difference, fp32
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start_server(timeout=120) -> tuple[subprocess.Popen, str]:
    return standin_server.launch(["--model", "tiny", "--port", "0", "--seed", str(os.getpid() % 1000), "--timeout-s", "60"],
                         env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO, timeout_s=timeout)


def _stop(proc: subprocess.Popen) -> None:
    stop(proc)


@pytest.fixture
def servers(request):
    started = []
    try:
        for _ in range(request.param):
            started.append(_start_server())
        yield started
    finally:
        for proc, _ in started:
            _stop(proc)


def _trainer(urls, kill_pid, dp):
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=5)
        cfg = load_model_config("tiny")
        from grpo_mega.trainer.actor import Actor

        actor = Actor(cfg, ParallelConfig(), PrecisionConfig(params_dtype="fp32"), OptimConfig(lr=1e-2),
                      AlgoConfig(kl_coef=0.0),
                      BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=2,
                                  max_response_length=10))
        engines = Engines(lambda: ServerClient(urls, timeout_s=20), count=1)
        prompts = [[5, 17, 33, 2, 9], [100, 7], [250, 251, 252], [9, 9, 9, 9, 9, 9, 9]]
        out = {"mismatch": [], "versions": []}
        for version in (1, 2):
            batch = L.rollout(seed=version)
            batch.old_logp = actor.logprobs(batch, 1.0)
            actor.update(batch, 1.0)  # the servers must receive each step's trained weights
            stats = engines.sync(actor.built.gpt, version=version, cfg=cfg, bucket_mb=0.01, audit=True)
            if stats is not None:
                out["stats"] = stats
            gen = engines.generate(prompts, 2, 1.0, 1.0, 8, [3], 11 + version)
            rb = RolloutBatch.from_samples([prompts[i // 2] for i in range(8)], gen.token_ids)
            trainer = actor.logprobs(rb, 1.0)
            engine_lp = engine_logprobs(gen, rb)
            out["mismatch"].append(algo.logprob_mismatch(engine_lp, trainer, rb.response_mask()))
            out["versions"].append(gen.weight_version)
        if engines.local is not None:
            out["assign"] = engines.local.assign(prompts, 2, 8)
        # a server killed mid-run: every rank stops within the client's timeout, naming its URL
        if dist.get_rank() == 0:
            os.kill(kill_pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            engines.generate(prompts, 2, 1.0, 1.0, 8, [3], 99)
        except RolloutError as e:
            out["dead"] = (str(e), time.monotonic() - t0)
        destroy_distributed()
        return out


@pytest.mark.parametrize("servers,dp", [(2, 2), (1, 1)], indirect=["servers"])
def test_dedicated_servers_hold_the_trainers_weights(servers, dp):
    urls = [u for _, u in servers]
    res = run_ranks(_trainer, dp, urls, servers[-1][0].pid, dp, timeout=300)
    stats = res[0]["stats"]
    assert stats.audited and stats.buckets > 3 and stats.version == 2
    for r in res:
        assert r["versions"] == [1, 2]
        for m in r["mismatch"]:
            assert m <= LOGP_TOL, f"server vs trainer logprobs {m:.2e}"
        message, seconds = r["dead"]
        assert urls[-1] in message and "\n" not in message and seconds < 60
    if len(urls) == 2:  # tokens per prompt 2 * (len + 8): 30, 26, 22, 20 for prompts 3, 0, 2, 1, longest first:
        assert res[0]["assign"] == [[1, 3], [0, 2]]  # 30 + 20 = 50 on the first server, 26 + 22 = 48 on the other


def test_an_unreachable_server_is_named_at_start_up():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens here
    with pytest.raises(ServerError, match=url.replace(".", r"\.") + ".*health"):
        ServerClient([url], timeout_s=5)


def test_outstanding_tokens_not_counts_decide():
    client = ServerClient.__new__(ServerClient)
    client.urls = ["http://a", "http://b"]
    client.outstanding = {"http://a": 100, "http://b": 0}  # a is busy
    shares = client.assign([[1] * 10, [1] * 10, [1] * 10], n=2, max_new_tokens=20)
    # each prompt costs 2 * (10 + 20) = 60 tokens: b takes the first two (0 -> 60 -> 120), a the third
    assert shares == [[2], [0, 1]]


@pytest.mark.parametrize("servers", [1], indirect=True)
def test_kept_alive_connections_stay_few_and_are_replaced_when_closed(servers):
    """Calls that may be repeated reuse kept-alive connections (at most client.POOLED idle), the others close
    theirs: each idle connection holds one of the stand-in's threads, and a client that kept every connection (one
    per weight-update call) had all of them held after ~50 steps, its next call waiting 120 s for a thread. A pooled
    connection the server has closed is not used."""
    from grpo_mega.engines import client as client_mod

    (proc, url), = servers
    client = ServerClient([url], timeout_s=30, retries=0)  # a failed call is not tried again
    for _ in range(standin_server.THREADS + 50):  # more than the stand-in's threads, each answered at once
        client._call(url, "/update_weight_version", {"new_version": 0}, timeout=10)
        client._call(url, "/flush_cache", {}, timeout=10)
    assert 1 <= client._pools[url].qsize() <= client_mod.POOLED
    stale = client._pools[url].get_nowait()
    stale.sock.shutdown(socket.SHUT_RDWR)  # as if dropped: the next call must not send on it
    client._pools[url].put(stale)
    assert client._call(url, "/health", None, timeout=10) == {}


def test_a_dedicated_run_trains_against_a_server(tmp_path):
    """`python -m grpo_mega.train rollout.placement=dedicated rollout.servers=[URL]` on 2 ranks: the run
    samples from the server, and the server generates with the trainer's weights after every sync."""
    import json

    from grpo_mega.data.toy import make_tokenizer
    from tests.fork_server import run_main

    proc = subprocess.Popen([sys.executable, "-m", "grpo_mega.engines.standin_server", "--model", "tiny", "--port", "0",
                             "--vocab-size", str(len(make_tokenizer()))], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "ready on " not in line and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        assert "ready on " in line, "the rollout server did not start"
        url = line.split("ready on ")[1].strip()
        argv = [f"hydra.run.dir={tmp_path / 'run'}", "run.steps=2", "eval.interval=2", "rollout.placement=dedicated",
                f"rollout.servers=[{url}]", "rollout.audit_weights=true"]
        done = run_main(argv, timeout=300, cwd=REPO, scratch=tmp_path, nproc=2,  # 2 ranks forked, as torchrun's
                        env={**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled"})
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(r) for r in open(tmp_path / "run" / "metrics.jsonl")]
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["logprob_mismatch"] < LOGP_TOL for r in rows)
    finally:
        _stop(proc)
