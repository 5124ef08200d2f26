"""The GPU tooling, checked on the CPU: bench/gpu_check.sh's plan, bench/step.py's JSON (the CPU comparison
and the --gpu code path run on the CPU), and bench/gpu_wheels.sh's pins against this environment."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

from tests.bench import run_bench
from tests.fork_server import run_module
from tests.proc import run_tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


STEP_NAMES = ["install wheels", "cuda", "gpu tests", "bench.step --gpu", "bench.decode --gpu", "grpo steps on cuda"]


def _plan() -> str:
    proc = subprocess.run([os.path.join(REPO, "bench", "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, OUT="/tmp/gpu_check_plan"))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_gpu_check_dry_run_prints_each_step():
    plan = _plan()
    steps = [line.strip() for line in plan.splitlines() if re.match(r"\s+\d+\. ", line)]
    names = [re.match(r"\d+\. (.+?) \(at most (\d+) s\)", s).group(1) for s in steps]
    assert names == STEP_NAMES
    limits = [int(re.search(r"at most (\d+) s", s).group(1)) for s in steps]
    assert sum(limits) <= 540  # within 9 minutes: a device call runs at most 600 s, the machine's start aside
    assert "pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl" in plan
    assert f"PYTHONPATH={REPO}:/tmp/site" in plan
    assert "pytest -q -rs -p no:cacheprovider -m gpu tests" in plan
    assert "-m bench.step --gpu --models qwen2.5-0.5b,qwen2.5-1.5b,largest" in plan
    assert "-m bench.decode --gpu --modes compiled,static --hf-caches static" in plan
    assert "-m grpo_mega.train run.steps=20" in plan and "cp /tmp/gpu_check_runs/demo/metrics.jsonl " \
        "/tmp/gpu_check_plan/demo_metrics.jsonl" in plan
    for model in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        assert os.path.isfile(os.path.join(REPO, "model_configs", f"{model}.yaml"))
    bad = subprocess.run([os.path.join(REPO, "bench", "gpu_check.sh"), "--nonsense"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_gpu_check_python_steps_accept_their_arguments(tmp_path):
    """Every python step of the plan, run here with its own arguments and a flag that stops after parsing them:
    the bench modules' --dry-run, Hydra's --cfg job for the trainer (its overrides composed and validated),
    pytest's --collect-only for the gpu tests. A flag the script passes that a parser refuses fails here."""
    plan = _plan()
    checked = []
    for line in plan.splitlines():
        m = re.match(r"\s+\d+\. (.+?) \(at most \d+ s\): (.*)$", line)
        if not m:
            continue
        for mod in re.finditer(r"python3 -m (\S+)((?: (?!&&)\S+)*)", m.group(2)):
            module, args = mod.group(1), mod.group(2).split()
            if module == "pip":
                continue
            stop = {"bench.step": ["--dry-run"], "bench.decode": ["--dry-run"], "grpo_mega.train": ["--cfg", "job"],
                    "pytest": ["--collect-only"]}[module]
            if module == "grpo_mega.train":
                args = [a for a in args if not a.startswith("hydra.run.dir=")]
            # forked from the warm server (tests/fork_server.py), as `python -m MODULE`; pytest, which cannot
            # run inside a forked pytest worker's server, in a new interpreter
            if module == "pytest":
                proc = run_tree([sys.executable, "-W", "ignore", "-m", module, *args, *stop], capture_output=True,
                                text=True, timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
            else:
                proc = run_module(module, [*args, *stop], 300, REPO, tmp_path, env=dict(os.environ, PYTHONPATH=REPO))
            assert proc.returncode == 0, f"{module} {args}: {proc.stderr[-2000:]}"
            if module.startswith("bench."):
                assert "'dry_run': True" in proc.stdout
            if module == "pytest":
                assert "test_gpu" in proc.stdout
            checked.append(module)
    assert checked == ["pytest", "bench.step", "bench.decode", "grpo_mega.train"]


def _bench(tmp_path, *args) -> dict:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-W", "ignore", "-m", "bench.step", *args, "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    return json.loads(out.read_text())


def test_bench_step_cpu_writes_the_ratio(tmp_path):
    """The tiny model, one timed step: the ratio, both timings, and the two paths' first losses, which must
    agree (same weights, batch and loss: they do the same work)."""
    data = _bench(tmp_path, "--cpu", "--models", "tiny", "--steps", "1", "--warmup", "0", "--threads", "1",
                  "--profile-steps", "1")
    assert data["mode"] == "cpu" and data["threads"] == 1 and len(data["loadavg_start"]) == 3
    assert data["machine"]["megatron_core"] == "0.16.1"
    (r,) = data["results"]
    assert r["model"] == "tiny" and r["tokens_per_step"] == 8 * 64
    assert len(r["megatron_seconds"]) == len(r["plain_seconds"]) == 1
    assert r["ratio_megatron_over_plain"] == r["megatron_median_s"] / r["plain_median_s"] > 0
    assert r["first_step_loss_abs_diff"] <= 1e-5 * max(1.0, abs(r["first_step_loss"]["plain"]))
    # megatron-core's pieces, each found in the profile (the wrapped methods ran: seconds > 0), the attention's
    # forward and backward on megatron's side, SDPA's subtracted
    b = r["megatron_core_breakdown"]
    assert b["profiled_steps"] == 1 and b["gap_s"] == r["megatron_median_s"] - r["plain_median_s"]
    pieces = b["pieces"]
    assert all(pieces[k]["seconds_per_step"] > 0 for k in ("ddp_grad_reduce_scatter", "distopt_param_all_gather",
               "distopt_main_to_model_params", "ddp_zero_grad_buffer", "megatron_attention_forward",
               "megatron_attention_backward"))
    assert pieces["plain_sdpa_forward_backward"]["seconds_per_step"] < 0
    assert b["explained_s"] == pytest.approx(sum(v["seconds_per_step"] for v in pieces.values()))
    # the ops whose self time differs most, largest first, each with both sides' seconds and calls
    gaps = [abs(g["difference_s"]) for g in b["op_gap"]]
    assert len(gaps) == 12 and gaps == sorted(gaps, reverse=True)
    assert all(g["op"].startswith("aten::") and g["difference_s"] == pytest.approx(g["megatron_s"] - g["plain_s"])
               for g in b["op_gap"])


def test_bench_step_gpu_path_runs_on_cpu(tmp_path):
    """The --gpu report's code on the CPU: throughput, engine, sync and the plan's figures (memory measured
    only on CUDA: null here)."""
    data = _bench(tmp_path, "--gpu-path-on-cpu", "--models", "tiny", "--steps", "1", "--warmup", "0",
                  "--groups", "2", "--prompt-len", "8", "--response-len", "8", "--micro-batch", "4",
                  "--gen-tokens", "4")
    (r,) = data["results"]
    assert r["tokens_per_update"] == 8 * 16 and r["update_tokens_per_s"] > 0 and r["mfu"] is None
    assert r["engine_generated_tokens"] == 8 * 4 and r["engine_tokens_per_s"] > 0
    # bf16-free here: the sync carries every fp32 weight once (tiny's vocabulary unpadded, untied)
    assert r["weight_sync_bytes"] > 0 and 0 < r["weight_sync_over_copy"]
    # the plain transformers step on the same batch in the same micro-batches (fp32 here: no autocast)
    p = r["plain_transformers_step"]
    assert p["tokens_per_s"] > 0 and len(p["seconds"]) == 1 and p["attention"] == "sdpa" and p["mfu"] is None
    assert p["megatron_over_plain"] == pytest.approx(r["update_median_s"] / p["median_s"])
    assert r["engine_decode"] == "static" and r["memory_sites_at_first_update_peak"] is None  # CUDA only
    mem = r["memory_gib"]
    assert all(v is None for v in mem["measured"].values())
    assert all(mem["planned"][k] > 0 for k in ("parameters_and_gradients", "reference", "optimizer",
                                               "activations_and_logits", "update_peak_total"))


def test_gpu_wheels_pins_are_what_this_environment_runs():
    """The GPU machine gets the versions the CPU tiers test."""
    text = open(os.path.join(REPO, "bench", "gpu_wheels.sh")).read()
    pins = re.findall(r"([A-Za-z][A-Za-z0-9_.-]*)==([0-9][0-9A-Za-z.]*)", text)
    assert {name.lower() for name, _ in pins} >= {"megatron-core", "hydra-core", "omegaconf", "math-verify",
                                                  "latex2sympy2-extended", "antlr4-python3-runtime", "pytest-timeout"}
    for name, version in pins:
        assert importlib.metadata.version(name) == version, name
