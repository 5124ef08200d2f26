"""Routing replay with a dedicated server (the embedded engine's stand-in server speaking SGLang 0.5.23's
`return_routed_experts` / meta_info["routed_experts"]) one step ahead (rollout.off_policy_steps=1) on 2 trainer
ranks: the routes come back over HTTP, travel to the DP replica that trains each sample, and through a checkpoint
taken with a batch in flight: the resumed step equals the uninterrupted one."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from grpo_mega.processes import stop
from grpo_mega.engines import standin_server
from tests.fork_server import run_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled"}
TOL = 1e-6


def test_dedicated_off_policy_replay_and_resume(tmp_path):
    from grpo_mega.data.toy import make_tokenizer

    proc, url = standin_server.launch(["--model", "tiny-qwen3-moe", "--port", "0", "--vocab-size",
                                       str(len(make_tokenizer()))], env=ENV, cwd=REPO, timeout_s=120)
    try:
        def train(out, ckpt):
            argv = [f"hydra.run.dir={out}", "model=tiny-qwen3-moe", "run.steps=3", "eval.interval=0",
                    "rollout.placement=dedicated", f"rollout.servers=[{url}]", "rollout.off_policy_steps=1",
                    "rollout.server_timeout_s=60", "algo.routing_replay=rollout", "batch.train_batch_size=4",
                    "batch.ppo_mini_batch_size=4", "rollout.n=4", f"checkpoint.dir={ckpt}", "checkpoint.interval=2"]
            done = run_main(argv, timeout=300, cwd=REPO, scratch=out.parent, nproc=2, env=ENV)
            assert done.returncode == 0, done.stderr[-3000:]
            return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}

        full = train(tmp_path / "full", tmp_path / "ckpt")
        assert [full[k]["weight_version"] for k in (1, 2, 3)] == [0, 0, 1]
        assert full[1]["moe/routing_agreement"] == 1.0 and full[1]["logprob_mismatch"] < 1e-5
        saved = tmp_path / "ckpt" / "step_00000002"
        state = json.loads((saved / "loop_state.json").read_text())
        # the routes are not JSON: int16, the 16 samples back to back in one safetensors file
        assert state["rollout"]["step"] == 3
        assert state["rollout"]["routed_experts"] == {"file": "rollout_routes.safetensors", "samples": 16}
        routes = load_file(str(saved / "rollout_routes.safetensors"))
        rows = [p for p in state["rollout"]["prompts"] for _ in range(4)]  # rollout.n=4 samples per prompt
        lens = [len(p) + len(t) - 1 for p, t in zip(rows, state["rollout"]["token_ids"])]
        assert routes["positions"].tolist() == lens
        assert routes["experts"].dtype == torch.int16 and tuple(routes["experts"].shape) == (sum(lens), 3, 2)
        assert int(routes["experts"].min()) >= 0 and int(routes["experts"].max()) < 8
        (tmp_path / "ckpt2").mkdir()
        shutil.copytree(tmp_path / "ckpt" / "step_00000002", tmp_path / "ckpt2" / "step_00000002")
        resumed = train(tmp_path / "resumed", tmp_path / "ckpt2")
        assert sorted(resumed) == [3]
        for key in ("loss", "grad_norm", "reward", "logprob_mismatch", "moe/routing_agreement"):
            assert resumed[3][key] == pytest.approx(full[3][key], rel=TOL, abs=TOL), key
        print("dedicated off-policy replay:", [(k, full[k]["moe/routing_agreement"], full[k]["logprob_mismatch"])
                                              for k in (1, 2, 3)])
    finally:
        stop(proc)
