"""The SGLang server command lines grpo-mega builds: with algo.routing_replay=rollout or measure they carry
--enable-return-routed-experts (SGLang 0.5.23 returns meta_info["routed_experts"] only from a server started with
it), from `sglang_command` (launch_sglang) and from slurm/train.sbatch's default server command, which composes the
training's own config. The sbatch runs unchanged under bash with stand-in `scontrol` and `srun` that record the
server step's command and end it; the trainer never starts (the servers never answer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.processes import stop
from grpo_mega.engines.sglang_launch import sglang_command, training_flags

REPO = Path(__file__).resolve().parents[2]
FLAG = "--enable-return-routed-experts"

SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show job") echo "JobId=$SLURM_JOB_ID Command=$FAKE_SBATCH" ;;
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "show node") echo "NodeName=$4 NodeAddr=127.0.0.1" ;;
esac
"""
# the server step: record its command (the last argument, run by `bash -c` on each rollout node) and fail
SRUN = """#!/bin/bash
printf '%s\\n' "${@: -1}" >> "$FAKE_RECORD"
exit 1
"""


def test_sglang_command_asks_for_routed_experts_with_replay():
    plain = sglang_command("/m", 30000, cpu=True)
    replay = sglang_command("/m", 30000, cpu=True, routing_replay=True)
    assert FLAG not in plain and replay.count(FLAG) == 1
    assert [a for a in replay if a != FLAG] == plain
    assert training_flags() == ["--skip-tokenizer-init", "--weight-version", "0"]


def test_servers_of_an_async_run_that_retracts_run_without_a_radix_cache():
    """rollout.pause_mode=retract keeps requests open across an update and has SGLang prefill them again: its radix
    cache would serve the old weights' keys and values, so the flags a run needs turn it off (and only then); in_place
    also turns off the overlap scheduler (its token in flight at a pause is reported under the new version)."""
    from grpo_mega.engines.sglang_launch import training_flags_for

    run = ["rollout.placement=dedicated", "rollout.servers=[http://h:1]", "rollout.mode=async",
           "rollout.off_policy_steps=2"]
    assert "--disable-radix-cache" in training_flags_for(run + ["rollout.pause_mode=retract"])
    assert "--disable-radix-cache" not in training_flags_for(run)
    assert "--disable-overlap-schedule" not in training_flags_for(run + ["rollout.pause_mode=retract"])
    in_place = training_flags_for(run + ["rollout.pause_mode=in_place"])
    assert "--disable-radix-cache" in in_place and "--disable-overlap-schedule" in in_place
    assert "--disable-radix-cache" not in training_flags_for(run + ["rollout.pause_mode=retract",
                                                                    "rollout.partial_rollouts=false"])


def _sbatch_server_command(tmp_path: Path, overrides: list[str]) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "server_cmd.txt"
    record.unlink(missing_ok=True)
    sbatch = REPO / "slurm" / "train.sbatch"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SBATCH": str(sbatch),
           "FAKE_RECORD": str(record), "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "replay", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_SUBMIT_DIR": str(tmp_path), "GRPO_MEGA_NPROC_PER_NODE": "2",
           "GRPO_MEGA_ROLLOUT_NODES": "1", "GRPO_MEGA_SERVER_MODEL": "/models/qwen3-30b-a3b",
           "GRPO_MEGA_SERVER_WAIT": "1", "GRPO_MEGA_PYTHON": sys.executable, "GRPO_MEGA_LOG_ROOT": str(tmp_path / "logs"),
           "MASTER_PORT": "29999", "PYTHONPATH": str(REPO)}
    env.pop("GRPO_MEGA_SERVER_CMD", None)
    proc = subprocess.run(["bash", str(sbatch), *overrides], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "rollout servers did not come up" in proc.stdout, proc.stdout + proc.stderr
    (cmd,) = record.read_text().splitlines()
    return cmd


@pytest.mark.parametrize("mode", ["rollout", "measure", "none"])
def test_train_sbatch_server_command_follows_routing_replay(tmp_path, mode):
    """The servers return their routes when the run replays them or measures agreement with them."""
    replay = mode != "none"
    overrides = ["model=tiny-qwen3-moe", "parallel.ep=2"] + ([f"algo.routing_replay={mode}"] if replay else [])
    cmd = _sbatch_server_command(tmp_path, overrides)
    assert cmd.startswith(f"{sys.executable} -m grpo_mega.engines.sglang_launch --model-path /models/qwen3-30b-a3b "
                          "--tp 2 --skip-tokenizer-init --weight-version 0"), cmd
    assert (FLAG in cmd.split()) == replay, cmd
    assert cmd.endswith("--host 0.0.0.0 --port $GRPO_MEGA_SERVER_PORT"), cmd


def test_a_key_in_the_servers_environment_starts_them_through_sglang_launch_and_never_on_a_command_line():
    """The module is chosen from the environment the server gets (launch_sglang's `env`), not the caller's own: a
    key given only there used to start `sglang.launch_server` without any key, every route open."""
    from grpo_mega.engines.client import API_KEY_ENV

    keyed = sglang_command("/m", 30000, cpu=True, env={API_KEY_ENV: "s3cret"})
    assert keyed[1:3] == ["-m", "grpo_mega.engines.sglang_launch"] and not any("s3cret" in a for a in keyed)
    assert "--api-key" not in keyed
    assert sglang_command("/m", 30000, cpu=True, env={})[1:3] == ["-m", "sglang.launch_server"]


def test_log_records_have_the_key_redacted():
    """What sglang_launch installs before SGLang configures its logging: any logger, any handler, the key as a
    format argument or in the message itself."""
    import io
    import logging

    from grpo_mega.engines.sglang_launch import REDACTED, redact_logs

    before = logging.getLogRecordFactory()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("sglang.srt.entrypoints.engine.test")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        redact_logs("s3cret-key")
        log.info("server_args=%s", {"api_key": "s3cret-key", "port": 1})
        log.info("key s3cret-key in the message, %d args", 0)
        log.info("nothing to hide: %s", "x")
    finally:
        logging.setLogRecordFactory(before)
        log.removeHandler(handler)
    assert stream.getvalue().splitlines() == [f"server_args={{'api_key': '{REDACTED}', 'port': 1}}",
                                              f"key {REDACTED} in the message, 0 args", "nothing to hide: x"]


FAKE_SERVER = """import http.server, socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), type("H", (http.server.BaseHTTPRequestHandler,), {
        "do_GET": lambda self: (self.send_response(200), self.end_headers()), "log_message": lambda *a: None}))
except OSError as e:  # as SGLang 0.5.23 does: uvicorn logs the bind failure and the server process stays up
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): {e.strerror.lower()}",
          flush=True)
    time.sleep(600)
server.serve_forever()
"""


def test_a_server_whose_port_was_taken_restarts_on_another(tmp_path, monkeypatch):
    """The CI failure of 2026-11-27: a second SGLang server's port was taken between drawing it and binding it,
    and SGLang logged 'address already in use' and hung until the 240 s deadline. launch_sglang now restarts such
    a server on another port (here the first port it draws is held by this test; the stand-in server behaves as
    SGLang 0.5.23 does on a bind failure)."""
    import socket

    from grpo_mega.processes import free_port
    from grpo_mega.engines import sglang_launch

    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    held = socket.socket()
    held.bind(("127.0.0.1", free_port()))
    held.listen()
    taken = held.getsockname()[1]
    ports = iter([taken])
    monkeypatch.setattr(sglang_launch, "free_port", lambda host: next(ports, None) or free_port(host))
    monkeypatch.setattr(sglang_launch, "sglang_command",
                        lambda model_path, port, env=None, **kw: [sys.executable, str(script), "--port", str(port)])
    try:
        started = sglang_launch.launch_sglang("/m", count=2, log_dir=str(tmp_path), timeout_s=60)
    finally:
        held.close()
    try:
        urls = sorted(url for _, url in started)
        assert len(set(urls)) == 2 and f"http://127.0.0.1:{taken}" not in urls
        assert all(proc.poll() is None for proc, _ in started)
        assert "address already in use" in (tmp_path / f"sglang-{taken}.log").read_text()
    finally:
        for proc, _ in started:
            stop(proc)


def test_a_server_that_loses_its_last_port_is_an_error_at_once(tmp_path, monkeypatch):
    """With no attempt left, a taken port is a RuntimeError naming the server, not a wait for the deadline."""
    import socket
    import time

    from grpo_mega.processes import free_port
    from grpo_mega.engines import sglang_launch

    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(sglang_launch, "free_port", lambda host: taken)
        monkeypatch.setattr(sglang_launch, "sglang_command",
                            lambda model_path, port, env=None, **kw: [sys.executable, str(script), "--port", str(port)])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{taken} found its port taken"):
            sglang_launch.launch_sglang("/m", count=1, log_dir=str(tmp_path), timeout_s=120, bind_attempts=1)
        assert time.monotonic() - t0 < 60
