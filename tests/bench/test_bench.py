"""The benchmarks run end to end at toy sizes and write the JSON they promise (numbers are not judged here:
speed and memory targets are met in the benchmark's own output, recorded on the issue)."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.bench import run_bench

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_vocab_parallel_writes_json(tmp_path):
    out = tmp_path / "vp.json"
    cmd = [sys.executable, "-m", "bench.vocab_parallel",
           "--T", "16", "--V", "256", "--vocab-size", "250", "--iters", "1", "--tp-sizes", "4", "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    data = json.loads(out.read_text())
    rows = {(r["impl"], r["tp"], r["chunk"]) for r in data["results"]}
    assert {("gathered", 4, None), ("vocab_parallel", 4, None), ("vocab_parallel", 4, 64)} <= rows
    for r in data["results"]:
        assert r["peak_above_inputs_mib"] >= 0 and r["seconds"] > 0 and "memory_vs_gathered" in r


def test_bench_activations_writes_json(tmp_path):
    """Measured per-layer saved activations vs the planner's formula. Under full recompute a layer keeps
    only its input, and the measurement must equal the formula exactly; with the local spec (no TE) every
    mode must (planning.local_layer_activation_bytes); the TE spec's other ratios are recorded."""
    out = tmp_path / "act.json"
    cmd = [sys.executable, "-m", "bench.activations", "--model", "tiny", "--layers", "1",
           "--seq", "32", "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    data = json.loads(out.read_text())
    rows = {r["recompute"]: r for r in data["rows"]}
    assert set(rows) == {"none", "selective", "full"} and data["layer_spec"] in ("local", "transformer_engine")
    assert rows["full"]["measured_over_planned"] == 1.0
    if data["layer_spec"] == "local":
        assert rows["none"]["measured_over_planned"] == rows["selective"]["measured_over_planned"] == 1.0
    assert rows["none"]["measured_bytes_per_layer"] > rows["selective"]["measured_bytes_per_layer"] > 0


def test_bench_full_kl_writes_json(tmp_path):
    """The full-KL update against the k3 update at tp=2, toy sizes: both rows, the ratios and the load."""
    out = tmp_path / "full_kl.json"
    cmd = [sys.executable, "-m", "bench.full_kl", "--hidden", "64", "--layers", "2",
           "--vocab", "500", "--prompts", "2", "--prompt-len", "8", "--response-len", "8", "--budget", "32",
           "--iters", "1", "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    data = json.loads(out.read_text())
    assert [r["estimator"] for r in data["results"]] == ["k3", "full"]
    k3, full = data["results"]
    assert k3["ref_logprobs_s"] > 0 and full["ref_logprobs_s"] == 0  # full needs no separate reference pass
    assert all(r["update_s"] > 0 and r["peak_update_mib"] >= 0 for r in data["results"])
    assert len(data["loadavg"]["before"]) == 3 and "full_vs_k3_peak" in data


def test_bench_async_rl_both_workloads(tmp_path):
    """bench.async_rl on its two workloads against one server each. Natural lengths, in turn and one step ahead
    (overlap.json's command, toy sizes): step k >= 2 one step ahead trains on version k-2, in turn hides no
    generation, the serial phase sum is the phases' and the pair's ratios are there. Lognormal lengths, one step
    ahead, async k=2 and k=2 training stale groups at a decode cost (bench.async_sweep): the point's summary of its
    run, and the async metrics. The ratios themselves are recorded, not asserted (a shared machine)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    out = tmp_path / "overlap.json"
    run_bench([sys.executable, "-m", "bench.async_rl", "--steps", "5", "--modes",
               "in_turn,one_step_ahead,in_turn_busy_neighbour", "--natural-lengths", "--response-length", "2",
               "--out", str(out)], tmp_path, timeout=400, env=env)
    data = json.loads(out.read_text())
    busy = data["modes"]["in_turn_busy_neighbour"]  # in turn beside a decoding neighbour: its own phases over in turn's
    own = lambda r: sum(v for p, v in r["phases_s"].items() if p not in ("generate", "generate_wait"))  # noqa: E731
    assert data["trainer_busy_neighbour_over_idle"] == pytest.approx(own(busy) / own(data["modes"]["in_turn"]))
    assert data["trainer_bound_busy_neighbour_over_one_step_ahead"] == pytest.approx(
        data["trainer_bound_over_one_step_ahead"] / data["trainer_busy_neighbour_over_idle"])
    assert busy["weight_versions"] == [0, 1, 2, 3, 4]
    in_turn, ahead = data["modes"]["in_turn"], data["modes"]["one_step_ahead"]
    assert in_turn["weight_versions"] == [0, 1, 2, 3, 4] and ahead["weight_versions"] == [0, 0, 1, 2, 3]
    assert in_turn["overlap"] == 0 and 0 <= ahead["overlap"] <= 1 and in_turn["response_length"] <= 2
    assert data["config"]["max_response_length"] == 2 and data["config"]["median"] is None
    # two steady steps a run: each median is a mean, so the serial sum's is the sum of the phases' (bar rounding)
    serial = sum(v for p, v in in_turn["phases_s"].items() if p != "generate_wait")
    assert in_turn["serial_phase_sum_s"] == pytest.approx(serial, rel=1e-9) and in_turn["phases_s"]["update"] > 0
    assert data["step_ratio"] == pytest.approx(ahead["step_s"] / in_turn["step_s"])
    assert 0.5 <= data["step_ratio_bound"] < 1 and data["step_over_phase_sum"] == ahead["step_over_phase_sum"] > 0
    assert data["k2_over_one_step_ahead"] is None and len(data["machine"]["loadavg_before"]) == 3

    out = tmp_path / "async_sweep.json"  # bench.async_sweep: bench.async_rl's one step ahead and k2 at each point
    run_bench([sys.executable, "-m", "bench.async_sweep", "--steps", "5", "--median", "2", "--decode-ms", "1",
               "--modes", "one_step_ahead,async_k2,async_k2_keep_stale", "--repeats", "1", "--out", str(out)],
              tmp_path, timeout=600, env=env)
    sweep = json.loads(out.read_text())
    assert [p["decode_ms"] for p in sweep["points"]] == [1] and set(sweep["runs"]) == {"1.0"}
    for p, data in zip(sweep["points"], sweep["runs"].values()):
        one, k2 = data["modes"]["one_step_ahead"], data["modes"]["async_k2"]
        assert p["k2_over_one_step_ahead"] == data["k2_over_one_step_ahead"]
        assert p["meets_target"] == (p["k2_over_one_step_ahead"] >= sweep["target"] == 1.5)
        assert p["generation_share"] == pytest.approx(one["phases_s"]["generate"] / one["serial_phase_sum_s"])
        assert 0 < p["generation_share"] < 1 and p["one_step_ahead_trainer_idle"] == one["trainer_idle_fraction"]
        rate = data["decode_rate"]  # a step at the batch's 32 rows over a step at one row, from tokens/s at each
        assert p["decode_step_rows_over_one"] == pytest.approx(32 / rate["32"] * rate["1"])
        assert p["k2_dropped_share"] == pytest.approx(k2["dropped_stale_samples"]
                                                      / (k2["dropped_stale_samples"] + 32 * k2["steps_measured"]))
        keep = data["modes"]["async_k2_keep_stale"]  # rollout.drop_stale=false: nothing dropped, lags past k counted
        assert keep["dropped_stale_samples"] == 0 and sum(keep["token_lag"].values()) == pytest.approx(1.0)
        assert p["k2_keep_stale_over_one_step_ahead"] == data["speedup_over_one_step_ahead"]["async_k2_keep_stale"]
        assert p["k2_keep_stale_token_lag_over_k"] == keep["token_lag"]["over_k"] and k2["token_lag"]["over_k"] == 0
    data = sweep["runs"]["1.0"]
    k2 = data["modes"]["async_k2"]
    assert data["k2_over_one_step_ahead"] > 0 and 0 <= k2["trainer_idle_fraction"] <= 1
    assert 0 <= k2["server_idle_fraction"] <= 1 and sum(k2["token_lag"].values()) == pytest.approx(1.0)
    assert 0 <= k2["room_held_by_staleness"] + k2["room_held_by_fresh"] <= 1
    # k2's ceiling at the rows it kept decoding: its trained per generated tokens x the loop's rate alone there
    assert k2["decode_rate_at_rows"] > 0 and data["k2_rows_bound_over_one_step_ahead"] == pytest.approx(
        k2["trained_tokens_per_s"] / k2["generated_tokens_per_s"] * k2["decode_rate_at_rows"]
        / data["modes"]["one_step_ahead"]["trained_tokens_per_s"])
    assert data["config"]["max_response_length"] == 16 and data["config"]["decode_ms"] == 1
    assert data["trainer_bound_over_one_step_ahead"] >= 1 and data["step_ratio"] is None
    one = data["modes"]["one_step_ahead"]  # the server's full rate: the best async mode's tokens per busy second
    rate = max(m["generated_tokens_per_s"] / (1 - m["server_idle_fraction"])
               for name, m in data["modes"].items() if name.startswith("async"))
    bound = one["step_s"] * rate / one["generated_tokens_per_step"]
    assert data["server_bound_over_one_step_ahead"] == pytest.approx(bound)
    # the server's decode loop, read around each run: with --decode-ms 1 each of its steps takes over 1 ms
    for mode in (one, k2):
        assert mode["server_decode_fraction"] > 0 and mode["server_rows_per_decode_step"] >= 1
        assert mode["server_ms_per_decode_step"] > 1
    assert data["server_idle_bound_over_one_step_ahead"] == pytest.approx(1 / one["server_decode_fraction"])


def test_bench_async_client_writes_json(tmp_path):
    """bench.async_client, one round: the three sides, each slowdown over elsewhere's, the client's CPU a request
    measured where it runs in this process (not for elsewhere's child), and the answered requests counted."""
    out = tmp_path / "async_client.json"
    run_bench([sys.executable, "-m", "bench.async_client", "--rounds", "1", "--in-flight", "4", "--out", str(out)],
              tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    data = json.loads(out.read_text())
    sides = data["sides"]
    assert set(sides) == {"threads", "event_loop", "elsewhere"} and data["config"] == dict(in_flight=4, rounds=1)
    for name, side in sides.items():
        (r,) = data["rounds"][name]
        assert side["main_slowdown"] == pytest.approx(statistics.median(r["busy_s"]) / r["alone_s"])
        assert side["main_slowdown_over_elsewhere"] == pytest.approx(side["main_slowdown"]
                                                                     / sides["elsewhere"]["main_slowdown"])
        assert side["requests_per_s"] > 0 and len(r["busy_s"]) == 20
        assert (side["cpu_ms_per_request"] is None) == (name == "elsewhere")
    assert sides["threads"]["cpu_ms_per_request"] > 0 and sides["event_loop"]["cpu_ms_per_request"] > 0
    assert [s["threads_in_trainer"] for s in sides.values()] == [4, 1, 0]


def test_bench_device_mode_writes_json(tmp_path):
    """bench.device_mode, one repeat of 3 steps: both sides train the same numbers, one steady step each."""
    out = tmp_path / "device_mode.json"
    run_bench([sys.executable, "-m", "bench.device_mode", "--steps", "3", "--repeats", "1", "--out", str(out)],
              tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    data = json.loads(out.read_text())
    assert data["same_training"] is True and set(data["sides"]) == {"lifted", "under_mode"}
    for side in data["sides"].values():
        assert side["steps_measured"] == 1 and side["trained_tokens_per_s"] > 0 and side["phases_s"]["generate"] > 0
    assert data["lifted_over_under_mode"] == pytest.approx(data["sides"]["lifted"]["trained_tokens_per_s"]
                                                           / data["sides"]["under_mode"]["trained_tokens_per_s"])


def test_bench_routing_writes_json(tmp_path):
    """4 ranks at DP4, 2 mini-batches: each other rank holds exactly a quarter of the samples when routed,
    all of them when broadcast."""
    out = tmp_path / "routing.json"
    cmd = [sys.executable, "-m", "bench.routing", "--prompts", "8", "--n", "4",
           "--max-response", "32", "--mini-prompts", "4", "--repeats", "1", "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    data = json.loads(out.read_text())
    assert data["samples"] == 32 and data["routed"]["rows_per_other_rank"] == [8, 8, 8]
    assert 0 < data["routed"]["bytes_to_other_ranks"] < data["broadcast"]["bytes_to_other_ranks"]
    assert data["routed"]["seconds"] > 0 and data["broadcast"]["seconds"] > 0


def test_bench_decode_writes_json(tmp_path):
    """The embedded engine (dynamic and static KV cache) and transformers' generate on the same batch: each
    generates every token asked for (the bench refuses unequal work), wall and CPU seconds for each."""
    out = tmp_path / "decode.json"
    cmd = [sys.executable, "-m", "bench.decode", "--model", "tiny", "--prompts", "2", "--n", "2",
           "--prompt-len", "8", "--new-tokens", "4", "--rounds", "1", "--threads", "1", "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    data = json.loads(out.read_text())
    assert data["rows"] == 4 and data["generated_tokens"] == 16 and data["device"] == "cpu"
    sides = {"embedded_dynamic", "embedded_static", "transformers_dynamic"}
    assert set(data["median_seconds"]) == set(data["median_cpu_seconds"]) == sides
    assert data["over_first_mode"]["embedded_dynamic"] == 1.0 and all(v > 0 for v in data["over_first_mode"].values())
    assert all(len(data["seconds"][k]) == len(data["cpu_seconds"][k]) == 1 for k in sides)
    assert data["engine_compile_error"] is None


def test_bench_response_only_writes_json(tmp_path):
    """The response-only output layer's bench: the logits bytes are exact (tokens x padded vocab x 4, fp32) and
    with lr 0 both settings' losses agree."""
    out = tmp_path / "ro.json"
    cmd = [sys.executable, "-m", "bench.response_only", "--model", "tiny", "--groups", "1",
           "--n", "2", "--prompt-len", "8", "--response-len", "8", "--micro-batch", "2", "--steps", "1", "--warmup",
           "0", "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    r = json.loads(out.read_text())["result"]
    row = 384 * 4  # tiny's vocabulary 320, padded to 384, fp32
    assert r["all_positions"]["logits_bytes_per_update"] == r["tokens_per_step"] * row == 32 * row
    assert r["response_only"]["logits_bytes_per_update"] == r["loss_positions"] * row == 16 * row
    assert r["all_positions"]["update_loss"] == r["response_only"]["update_loss"]


def test_bench_vs_trl_grpo_mega_side_writes_json(tmp_path):
    """bench/vs_trl.py with the grpo-mega side alone (TRL lives in .venv-trl, made by `make bench-trl`, not
    here), SmolLM2 at toy sizes: per-step phases from the trainer's own timing, summing to the step, steps 2..
    in the medians, no ratio without the other side; the settings and versions recorded."""
    from tests.models.hf_fixtures import smollm2_dir

    out = tmp_path / "vs_trl.json"
    cmd = [sys.executable, "-m", "bench.vs_trl", "--systems", "grpo_mega", "--steps", "2",
           "--rounds", "1", "--prompts", "1", "--n", "2", "--max-new-tokens", "2", "--model", str(smollm2_dir()),
           "--workdir", str(tmp_path / "runs"), "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["system"] == "grpo_mega" and [s["step"] for s in run["steps"]] == [1, 2]
    for s in run["steps"]:
        assert set(s["phases"]) == {"generate", "reward", "old_logprobs", "update", "weight_sync", "other"}
        assert s["phases"]["old_logprobs"] == 0.0  # exactly on-policy: no old-logprob pass
        assert s["phases"]["update"] > 0 and s["phases"]["generate"] > 0 and abs(s["phases"]["other"]) < 0.5
        assert 1 <= s["response_length_mean"] <= 2
    assert data["grpo_mega"]["steps_counted"] == 1 and data["grpo_mega"]["step_s"] == run["steps"][1]["step_s"]
    assert data["trl"] is None and data["step_ratio_grpo_mega_over_trl"] is None
    assert data["settings"]["max_new_tokens"] == 2 and data["settings"]["kl_coef"] == 0.0
    assert data["versions"]["grpo_mega"]["megatron-core"] == "0.16.1" and len(data["loadavg_start"]) == 3


def test_bench_vs_trl_without_the_trl_environment_says_how_to_make_it(tmp_path):
    cmd = [sys.executable, "-m", "bench.vs_trl", "--trl-python", str(tmp_path / "none"),
           "--out", str(tmp_path / "x.json")]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "make bench-trl" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_bench_fused_output_writes_json(tmp_path):
    """The fused output layer's bench at the tiny model's shapes: every configuration's peak and times, the
    fused chunks' peak a few fp32 [chunk, V] (tests/test_plan.py holds it to the plan), and the update's
    logprobs equal with the switch off and on."""
    out = tmp_path / "fo.json"
    cmd = [sys.executable, "-m", "bench.fused_output", "--model", "tiny", "--tokens", "512",
           "--steps", "1", "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    data = json.loads(out.read_text())
    rows = {(r["impl"], r["full_kl"], r["chunk"]) for r in data["loss_side"]}
    auto = data["shapes"]["auto_chunk"]
    assert rows == {(i, kl, c) for kl in (False, True) for i, c in (("unfused", None), ("fused", auto), ("fused", 256))}
    for r in data["loss_side"]:
        assert r["peak_mib"] > 0 and r["seconds"] > 0 and r["cpu_seconds"] > 0
    u = data["update"]
    assert u["logprob_max_abs_diff"] <= 1e-6 and len(u["fused_seconds"]) == len(u["unfused_seconds"]) == 1


def test_bench_data_writes_json(tmp_path):
    """The data path at toy sizes: per format and row count, start-up, memory and the batch times; a parquet's
    Arrow copy written by the first process and found by the second."""
    out = tmp_path / "data.json"
    cmd = [sys.executable, "-m", "bench.data", "--rows", "2000", "--batch", "64", "--batches", "2",
           "--val", "16", "--tokenizer", "toy", "--dir", str(tmp_path), "--out", str(out)]
    run_bench(cmd, tmp_path, timeout=300)
    data = json.loads(out.read_text())
    got = {(r["format"], r["rows"], r["run"]): r for r in data["results"]}
    assert set(got) == {(f, n, run) for n in (2000,) for f, run in
                        (("jsonl", "first"), ("parquet", "first"), ("parquet", "cached"))}
    for (fmt, n, run), r in got.items():
        assert r["startup_s"] > 0 and r["first_batch_s"] > 0 and r["batch_s"] > 0 and r["tokenizer"] == "toy"
        assert r["permutation_bytes"] == 4 * n and r["head_rows_checked"] == min(n, 1024)
        assert r["wrote_cache"] == (fmt == "parquet" and run == "first")
    assert got[("jsonl", 2000, "first")]["index_bytes"] == 8 * 2001
    assert data["settings"]["batch"] == 64 and "cpu_model" in data["machine"]
    assert list(tmp_path.iterdir()) == [out]  # the data files and the cache are removed
