"""Starting real SGLang servers for dedicated placement (`rollout.placement=dedicated`): their command line as the
client expects it (token ids in and out, weight version 0 until the first sync) and `launch_sglang`, which
starts several at once and waits until each answers /health. `grpo_mega.processes.stop` ends them.

`python -m grpo_mega.engines.sglang_launch SGLANG_ARGS...` runs SGLang's server (what `python -m
sglang.launch_server` runs) in this process with its API key taken from GRPO_MEGA_SERVER_API_KEY: SGLang 0.5.23
takes its key only as a command-line option, and a key on a command line is readable by every user of the node
(/proc/PID/cmdline). The key is set on the parsed ServerArgs, never in any argv (SGLang keeps its argv as the
server's `launch_command`), and this process's log records have it replaced by `<redacted>` (SGLang 0.5.23 logs
`server_args={...}`, api_key included, at INFO: the Slurm output would carry it). Its other processes
(scheduler, detokenizer) get the ServerArgs but do not log them.

`python -m grpo_mega.engines.sglang_launch --training-flags HYDRA_OVERRIDES...` prints the SGLang options a training
run composed from those overrides needs of its servers (`training_flags`: token ids only, weight version 0,
`--enable-return-routed-experts` when algo.routing_replay=rollout or measure, `--disable-radix-cache` with
rollout.mode=async and rollout.pause_mode=retract or in_place, and `--disable-overlap-schedule` with in_place);
slurm/train.sbatch builds its default server command with it."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from grpo_mega.processes import free_port, stop, tail
from grpo_mega.engines.client import API_KEY_ENV


def training_flags(routing_replay: bool = False, pause_mode: Optional[str] = None) -> list[str]:
    """The SGLang options the client relies on: token ids in and out (no tokenizer), weight version 0 until the
    first sync, with rollout routing replay the experts each token was routed to (SGLang 0.5.23 returns
    meta_info["routed_experts"] only from a server started with --enable-return-routed-experts), and with
    `pause_mode` retract or in_place (rollout.mode=async with partial rollouts: requests kept open across an update)
    no radix cache, whose old keys and values those requests would be prefilled from (and, unflushed, new ones too);
    with in_place no overlap scheduler either, which leaves each request's token in flight at the pause reported
    under the new version though the old weights sampled it (0.5.23)."""
    return (["--skip-tokenizer-init", "--weight-version", "0"] + (["--enable-return-routed-experts"] if routing_replay
                                                                   else [])
            + (["--disable-radix-cache"] if pause_mode in ("retract", "in_place") else [])
            + (["--disable-overlap-schedule"] if pause_mode == "in_place" else []))


def training_flags_for(overrides: list[str]) -> list[str]:
    """`training_flags` of the run `python -m grpo_mega.train OVERRIDES` composes (Hydra, the real schema: a
    replay switched on by an experiment file counts as well as one on the command line)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from grpo_mega.conf.schema import TrainConfig, register_schema

    register_schema()

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="grpo_mega.conf", version_base=None):
        cfg = compose(config_name="config", overrides=[o for o in overrides if not o.startswith("hydra.")])
    GlobalHydra.instance().clear()
    run = TrainConfig.from_hydra(cfg)
    r = run.rollout
    return training_flags(run.algo.records_routes,
                          pause_mode=r.pause_mode if r.mode == "async" and r.partial_rollouts else None)


def sglang_command(model_path: str, port: int, host: str = "127.0.0.1", tp: int = 1, dtype: str = "float32",
                   python: str = sys.executable, cpu: Optional[bool] = None, max_total_tokens: int = 4096,
                   routing_replay: bool = False, extra: tuple = (), env: Optional[dict] = None) -> list[str]:
    """The command line of one SGLang server as the client expects it (`training_flags`); with an API key in
    `env` (the server's environment; default this process's) it starts through this module, which gives SGLang
    the key without a command line or log ever holding it. `cpu` (default: where
    torch sees no CUDA) adds SGLang's CPU settings: torch_native attention, no CUDA graphs, a KV cache of
    `max_total_tokens`; the environment must then also carry SGLANG_USE_CPU_ENGINE=1 and a stand-in sgl_kernel
    (tests/fixtures) first on PYTHONPATH."""
    import torch

    module = "grpo_mega.engines.sglang_launch" if (os.environ if env is None else env).get(API_KEY_ENV) \
        else "sglang.launch_server"
    cmd = [python, "-m", module, "--model-path", str(model_path), "--host", host, "--port", str(port),
           "--tp-size", str(tp), "--dtype", dtype, *training_flags(routing_replay)]
    if cpu if cpu is not None else not torch.cuda.is_available():
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                "--max-total-tokens", str(max_total_tokens)]
    return cmd + list(extra)


def launch_sglang(model_path: str, count: int = 1, log_dir: Optional[str] = None, env: Optional[dict] = None,
                  timeout_s: float = 300.0, bind_attempts: int = 3, **command_kwargs) -> list:
    """Start `count` SGLang servers at once, each on a free port of 127.0.0.1 (or `host`), and wait until every
    one answers /health; returns [(process, URL)]. Each server's output goes to `log_dir`/sglang-PORT.log (a
    new temporary directory by default). A server that finds its port taken (SGLang 0.5.23 logs uvicorn's
    "address already in use" and keeps running without serving) is stopped and started again on another port,
    up to `bind_attempts` ports. A server that exits, loses its last port, or does not answer within `timeout_s`:
    all of them are stopped and a RuntimeError carries its log's last lines."""
    import subprocess
    import tempfile
    import time
    import urllib.request

    log_dir = log_dir or tempfile.mkdtemp(prefix="grpo_mega_sglang_")
    host = command_kwargs.get("host", "127.0.0.1")
    running, waiting = {}, {}  # url -> (process, log path, attempt); waiting: not answering /health yet

    def start(attempt: int) -> None:
        port = free_port(host)
        log_path = os.path.join(log_dir, f"sglang-{port}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(sglang_command(model_path, port, env=env, **command_kwargs), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        running[f"http://{host}:{port}"] = waiting[f"http://{host}:{port}"] = (proc, log_path, attempt)

    try:
        for _ in range(count):
            start(1)
        deadline = time.monotonic() + timeout_s
        while waiting:
            for url, (proc, log_path, attempt) in list(waiting.items()):
                if _lost_its_port(log_path):
                    if attempt >= bind_attempts:
                        raise RuntimeError(f"the SGLang server for {url} found its port taken, as did the "
                                           f"{bind_attempts - 1} before it; the end of {log_path}:\n{tail(log_path)}")
                    stop(proc)
                    del running[url], waiting[url]
                    start(attempt + 1)
                    continue
                if proc.poll() is not None:
                    raise RuntimeError(f"the SGLang server for {url} exited with {proc.returncode} while starting; "
                                       f"the end of {log_path}:\n{tail(log_path)}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                        resp.read()
                    del waiting[url]
                except OSError:  # not listening yet, or 503 while it starts
                    pass
            if waiting and time.monotonic() > deadline:
                url, (_, log_path, _) = next(iter(waiting.items()))
                raise RuntimeError(f"the SGLang server for {url} did not answer /health within {timeout_s:.0f} s; "
                                   f"the end of {log_path}:\n{tail(log_path)}")
            if waiting:
                time.sleep(1)
    except BaseException:
        for proc, _, _ in running.values():
            stop(proc)
        raise
    return [(proc, url) for url, (proc, _, _) in running.items()]


def _lost_its_port(log_path: str) -> bool:
    """Whether the server logging to `log_path` failed to bind its HTTP port (errno 98, EADDRINUSE)."""
    try:
        with open(log_path, errors="replace") as f:
            return "address already in use" in f.read()
    except OSError:
        return False


REDACTED = "<redacted>"


def redact_logs(secret: str) -> None:
    """From now on, every log record this process creates has `secret` replaced by REDACTED in its message (a
    record factory: whatever logger or handler SGLang configures later)."""
    make = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = make(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format is logging's to report
            return record
        if secret in text:
            record.msg, record.args = text.replace(secret, REDACTED), None
        return record

    logging.setLogRecordFactory(factory)


def serve(argv: list[str], key: str) -> None:
    """SGLang 0.5.23's server, as `python -m sglang.launch_server ARGV` runs it (sglang/launch_server.py), with
    `key` as its API key: set on the parsed ServerArgs (SGLang keeps `argv` as its launch_command, and serves it),
    and redacted from this process's log records."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    redact_logs(key)
    load_plugins()
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        sys.exit(f"error: give the API key in {API_KEY_ENV}, not as --api-key (a command line is readable by every "
                 "user of the node)")
    server_args = prepare_server_args(argv)
    server_args.api_key = key
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def main() -> None:
    """SGLang's server with the API key from the environment, or --training-flags (see the module's docstring)."""
    if sys.argv[1:2] == ["--training-flags"]:
        print(" ".join(training_flags_for(sys.argv[2:])))
        return
    key = os.environ.get(API_KEY_ENV)
    if not key:
        sys.exit(f"error: {API_KEY_ENV} is not set: start sglang.launch_server directly to serve without a key")
    serve(sys.argv[1:], key)


if __name__ == "__main__":
    main()
