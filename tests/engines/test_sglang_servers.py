"""Dedicated rollout servers that are real SGLang (`python -m sglang.launch_server`, its CPU engine, started
here on free ports; the `sglang` tier): a TP2 trainer feeds two of them through grpo_mega.engines.client, and
after every step both hold the trainer's weights (the audit reads every tensor back from each server; engine
and trainer logprobs agree to 1e-5), both report the step's weight version, and each tensor is gathered
once per step whatever the number of servers. A server that drifts from the other is named by the audit. The
servers run with an API key: refused without it, never on a command line or in their logs."""

import os

import psutil
import pytest
import torch

from grpo_mega import algo
from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from grpo_mega.processes import stop
from grpo_mega.engines.sglang_launch import launch_sglang
from tests.models.hf_fixtures import tiny_hf
from tests.engines.test_sync_every_engine import _count_gathers, check_gathered_once
from tests.trainer import layouts as L

pytestmark = pytest.mark.sglang
LOGP_TOL = 1e-5  # mean absolute difference, fp32
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures")  # the stand-in sgl_kernel


def _trainer(hf_dir, urls):
    from grpo_mega.models.hf_io import read_hf_config
    from grpo_mega.engines.client import ServerClient
    from grpo_mega.rollout.placement import Engines
    from grpo_mega.engines.weight_sync import WeightSyncError, check_audit
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.batch import RolloutBatch
    from grpo_mega.trainer.loop import engine_logprobs

    with cpu_compat.cpu_device_mode():
        layout = init_distributed(tp=2, pp=1, seed=5)
        _, _, cfg = read_hf_config(hf_dir)
        actor = Actor(cfg, ParallelConfig(tp=2), PrecisionConfig(params_dtype="fp32"), OptimConfig(lr=1e-2),
                      AlgoConfig(kl_coef=0.0), BatchConfig(train_batch_size=2, ppo_mini_batch_size=2,
                                                          micro_batch_size=2, max_response_length=10))
        engines = Engines(lambda: ServerClient(urls, timeout_s=60), count=1)
        prompts = [[5, 17, 33, 2, 9], [100, 7], [250, 251, 252], [9, 9, 9, 9, 9, 9, 9]]
        out = dict(rank=torch.distributed.get_rank(), counts_sender=layout.tp_rank == 0 and layout.dp_rank == 0,
                   mismatch=[], versions=[], servers=[])

        def mismatch(gen):
            rb = RolloutBatch.from_samples([prompts[i // 2] for i in range(len(gen.token_ids))], gen.token_ids)
            return algo.logprob_mismatch(engine_logprobs(gen, rb), actor.logprobs(rb, 1.0), rb.response_mask())

        # before any sync the servers hold the checkpoint they started from (version 0), not the trainer's
        gen = engines.generate(prompts, 2, 1.0, 1.0, 8, [], 10)
        out["unsynced"] = (mismatch(gen), gen.weight_version)

        step = [0]
        seen = _count_gathers(step)  # every full tensor this rank's gathers produce, by step
        for version in (1, 2):
            step[0] = version
            batch = L.rollout(seed=version, vocab=cfg.vocab_size)
            batch.old_logp = actor.logprobs(batch, 1.0)
            actor.update(batch, 1.0)  # the servers must receive each step's trained weights
            stats = engines.sync(actor.built.gpt, version=version, cfg=cfg, bucket_mb=0.05, audit=True)
            if stats is not None:
                out.setdefault("stats", []).append(stats)
            if engines.local is not None:  # what each server itself says it holds
                health = engines.local.health()
                assert health["ok"], health
                out["servers"].append(health["servers"])
            step[0] = 0  # nothing below this sync may gather
            gen = engines.generate(prompts, 2, 1.0, 1.0, 8, [], 11 + version)
            out["mismatch"].append(mismatch(gen))
            out["versions"].append(gen.weight_version)
        if engines.local is not None:
            client = engines.local
            out["assign"] = client.assign(prompts, 2, 8)
            # the second server alone goes back to the checkpoint it started from: the audit, reading each
            # tensor back from each server, names the disagreement
            client._call(urls[1], "/update_weights_from_disk", {"model_path": hf_dir})
            sums = client.weight_checksums(out["stats"][-1].shapes)
            out["disagreement"] = sorted(set(sums.values()))
            try:
                check_audit(out["stats"][-1].checksums, sums)
            except WeightSyncError as e:
                out["audit_error"] = str(e)
        out["gathered"] = list(seen)
        destroy_distributed()
    return out


def _model_bytes(hf_dir) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # float32 on both sides


def _alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.timeout(600)
def test_two_sglang_servers_hold_the_trainers_weights_after_every_tp2_step(tmp_path, monkeypatch):
    """Two SGLang servers started with an API key feed a TP2 trainer. The key: SGLang 0.5.23 logs
    `server_args={...}` at INFO, api_key included; started through grpo_mega.engines.sglang_launch (what
    launch_sglang and slurm/train.sbatch do when the environment holds a key) the key is in no command line and
    the log has `<redacted>` in its place, while the server still requires it (the trainer's client sends it from
    the environment)."""
    import json
    import secrets
    import urllib.error
    import urllib.request

    key = secrets.token_hex(24)
    monkeypatch.setenv("GRPO_MEGA_SERVER_API_KEY", key)  # the forked ranks' client reads it
    hf_dir = str(tiny_hf(tmp_path / "llama", "llama", dtype=torch.float32))
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (FIXTURES, REPO, os.environ.get("PYTHONPATH")) if p)}
    started = launch_sglang(hf_dir, count=2, log_dir=str(tmp_path), env=env, timeout_s=240, cpu=True,
                            extra=("--log-level", "info"))
    urls = [u for _, u in started]
    tree = [p.pid for proc, _ in started for p in [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(True)]
    body = json.dumps({"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 2}}).encode()
    try:
        assert all(key not in a for pid in tree for a in psutil.Process(pid).cmdline())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(urls[0] + "/generate", data=body), timeout=60)
        res = run_ranks(_trainer, 2, hf_dir, urls, timeout=300)
    finally:
        for proc, _ in started:
            stop(proc)
    assert _alive(tree) == [], "SGLang processes left after stop"
    assert refused.value.code == 401
    for log in tmp_path.glob("sglang-*.log"):
        text = log.read_text()
        assert "'api_key': '<redacted>'" in text and key not in text, log

    r0 = res[0]
    model_bytes = _model_bytes(hf_dir)
    # each tensor gathered once per step, on every rank; what the sender packed is the whole model
    assert check_gathered_once(res, "gathered", model_bytes) == [1, 2]
    assert r0["assign"][0] and r0["assign"][1], "both servers must generate"
    for stats in r0["stats"]:
        assert stats.audited and stats.buckets > 3 and stats.bytes == model_bytes
    assert [s.version for s in r0["stats"]] == [1, 2]
    # every server received both versions, and says so itself
    assert r0["servers"] == [{u: "1" for u in urls}, {u: "2" for u in urls}]
    # a server that no longer holds the trainer's weights: every tensor reported, naming both servers
    assert r0["disagreement"] == [f"differs between {urls[0]} and {urls[1]}"]
    assert f"{len(r0['stats'][-1].shapes)} tensors differ from the trainer's" in r0["audit_error"]
    for r in res:
        unsynced, version = r["unsynced"]
        assert version == 0 and unsynced > 100 * LOGP_TOL  # the comparison can see a server that is not synced
        assert r["versions"] == [1, 2]
        for m in r["mismatch"]:
            assert m <= LOGP_TOL, f"SGLang server vs trainer logprobs {m:.2e}"
    print(f"mismatch after steps 1, 2: {', '.join(f'{m:.2e}' for m in r0['mismatch'])} "
          f"(unsynced {r0['unsynced'][0]:.2e}); sync {r0['stats'][-1].bytes} bytes in {r0['stats'][-1].buckets} "
          f"buckets to {len(urls)} servers, {r0['stats'][-1].seconds:.2f} s with the audit")
