"""Multi-turn rollouts through a dedicated server (grpo_mega.engines.client speaking HTTP to the stand-in
server): the same trajectories, token for token, as the embedded engine holding the same weights, tool turns
included; and end to end with rollout.off_policy_steps=1, where a run SIGKILLed while a multi-turn batch is
being generated (a tool call in flight) resumes from its checkpoint to the uninterrupted run's metrics (1e-6)."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from grpo_mega.conf import load_model_config
from grpo_mega.data.toy_tools import TENS_TEMPLATE, TensDigitTask, make_tool_tokenizer
from grpo_mega.processes import stop
from grpo_mega.engines import standin_server
from grpo_mega.engines.client import ServerClient
from grpo_mega.engines.embedded import EmbeddedEngine
from grpo_mega.rollout.multi_turn import MultiTurnEngine
from grpo_mega.toolcalls import Calculator
from grpo_mega.toolcalls.pool import ToolPool
from tests.fork_server import run_main, start_main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
TOL = 1e-6
TOOL_LOG = "GRPO_MEGA_TEST_TOOL_LOG"


class LoggedCalculator(Calculator):
    """The calculator, appending a line to $GRPO_MEGA_TEST_TOOL_LOG per call and taking 0.2 s: the test sees
    when a multi-turn generation has a tool call in flight."""

    def call(self, args: dict, **kwargs) -> str:
        with open(os.environ[TOOL_LOG], "a") as f:
            f.write(f"{time.time()}\n")
        time.sleep(0.2)
        return super().call(args, **kwargs)


@pytest.fixture(scope="module")
def server():
    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size",
                                       str(len(make_tool_tokenizer(TENS_TEMPLATE))), "--seed", "3"],
                                      env=ENV, cwd=str(ROOT), timeout_s=120)
    try:
        yield url
    finally:
        stop(proc)


def test_a_dedicated_server_gives_the_embedded_engines_trajectories(server):
    """task=tens_tool's prompts, the random tiny model (seed 3 on both sides), 3 turns, the bare parser: the
    client's trajectories (model and tool ids, masks, logprobs, finish reasons, per-sample tool counts) equal
    the embedded engine's; some samples call the tool twice (3 model turns)."""
    tok = make_tool_tokenizer(TENS_TEMPLATE)
    task = TensDigitTask(tok, seed=5)
    prompts = [e.prompt_ids for e in task.train_batch(24)]
    cfg = load_model_config("tiny")
    cfg.vocab_size = len(tok)
    call = [tok.convert_tokens_to_ids("<tool_call>")]
    gens = {}
    for name, inner in (("embedded", EmbeddedEngine.from_model_config(cfg, seed=3)),
                        ("server", ServerClient([server], timeout_s=60))):
        mt = MultiTurnEngine(inner, tok, ToolPool(["calculator"], start_method="fork"), "bare", max_turns=3,
                             call_stop_ids=call, row_tools_kwargs=task.tools_kwargs)
        try:
            gens[name] = mt.generate(prompts, 4, 1.0, 1.0, 16, [tok.eos_token_id], seed=11)
        finally:
            mt.pool.close()
    a, b = gens["embedded"], gens["server"]
    assert a.token_ids == b.token_ids and a.model_mask == b.model_mask and a.finish_reasons == b.finish_reasons
    for la, lb in zip(a.logprobs, b.logprobs):
        assert lb == pytest.approx(la, abs=1e-5)
    sa, sb = a.extra["multi_turn"], b.extra["multi_turn"]
    counts = lambda s: {k: v for k, v in s.items() if k not in ("tool_seconds", "per_tool")}  # noqa: E731 (not times)
    assert counts(sa) == counts(sb) and sa["per_tool"]["calculator"]["calls"] == sb["per_tool"]["calculator"]["calls"]
    assert max(sa["tool_calls"]) >= 2 and max(sa["turns"]) == 3 and sum(sa["tool_errors"]) == 0
    assert any(0 in m for m in a.model_mask)  # tool tokens, masked out


def _args(out, url, *extra):
    return [f"hydra.run.dir={out}", "task=tens_tool", "run.steps=4", "eval.interval=0", "rollout.placement=dedicated",
            f"rollout.servers=[{url}]", "rollout.off_policy_steps=1", "rollout.server_timeout_s=60",
            "rollout.multi_turn.enable=true", "rollout.multi_turn.parser=bare",
            "rollout.multi_turn.call_stop=['<tool_call>']", "rollout.multi_turn.max_turns=3",
            "rollout.multi_turn.tools=['tests.rollout.test_multi_turn_server:LoggedCalculator']",
            f"rollout.multi_turn.tool_env=[{TOOL_LOG}]",  # tool workers start with a scrubbed environment
            "batch.max_response_length=12", "batch.train_batch_size=8", "batch.ppo_mini_batch_size=8", *extra]


def _rows(out):
    return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


@pytest.mark.slow  # three 4-step runs without evaluation (the in-flight batch is what a resume must restore)
def test_off_policy_multi_turn_killed_mid_generation_resumes_exactly(server, tmp_path):
    log = tmp_path / "tool_calls.txt"
    env = {**ENV, TOOL_LOG: str(log)}
    full = tmp_path / "full"
    done = run_main(_args(full / "run", server, f"checkpoint.dir={full / 'ckpt'}", "checkpoint.interval=2"),
                    timeout=300, cwd=ROOT, scratch=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(full / "run")
    assert [rows[k]["weight_version"] for k in (1, 2, 3, 4)] == [0, 0, 1, 2]  # one version behind
    assert all(rows[k]["multi_turn/tool_calls"] > 0 and rows[k]["multi_turn/tool_tokens"] > 0 for k in rows)

    killed, ckpt = tmp_path / "killed", tmp_path / "killed" / "ckpt"
    killed.mkdir()
    proc = start_main(_args(killed / "run", server, f"checkpoint.dir={ckpt}", "checkpoint.interval=2"), cwd=ROOT,
                      scratch=killed, env=env, out=killed / "stdout.txt", err=killed / "stderr.txt")
    deadline, sealed_at = time.monotonic() + 240, None
    while time.monotonic() < deadline and proc.poll() is None:
        if sealed_at is None and (ckpt / "step_00000002" / "manifest.json").is_file():
            sealed_at = time.time()
        if sealed_at is not None and log.is_file() and any(float(t) > sealed_at for t in log.read_text().split()):
            break  # a tool call of a generation that began after the step-2 checkpoint: mid multi-turn rollout
        time.sleep(0.005)
    assert proc.poll() is None, (killed / "stderr.txt").read_text()[-3000:]
    proc.kill()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (ckpt / "step_00000004").exists()

    resumed = tmp_path / "resumed"
    shutil.copytree(ckpt, resumed / "ckpt")
    done = run_main(_args(resumed / "run", server, f"checkpoint.dir={resumed / 'ckpt'}", "checkpoint.interval=2"),
                    timeout=300, cwd=ROOT, scratch=resumed, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    again = _rows(resumed / "run")
    assert sorted(again) == [3, 4]
    for k in (3, 4):
        for key in ("reward", "loss", "grad_norm", "entropy", "pg_loss", "is_weight_mean",
                    "logprob_mismatch", "weight_version", "multi_turn/tool_calls", "multi_turn/turns",
                    "multi_turn/model_tokens", "multi_turn/tool_tokens"):
            assert again[k][key] == pytest.approx(rows[k][key], rel=TOL, abs=TOL), (k, key)
