"""The rollout-correction metrics of the step row with a deliberately perturbed engine: the same dedicated run
(one rank, the stand-in server) with the server's logprobs as they are, and through experiments.proxies.NoisyProxy
(Gaussian noise, sigma 0.5, on every engine logprob). With IcePop (token-level mask outside [0.5, 5]) the
masked shares rise from 0 to about P(|N(0, 0.5^2)| > log 2) = 17% of tokens, and the ratio's quantiles spread
from 1 to exp(+-2.33 * 0.5) at q01/q99. (The perturbed demo still learns: experiments/correction_perturbed.py.)"""

import json
import math
import os
from pathlib import Path

import pytest

from experiments.proxies import NoisyProxy
from grpo_mega.processes import stop
from grpo_mega.engines import standin_server
from tests.fork_server import run_main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
SIGMA = 0.5


@pytest.fixture(scope="module")
def server():
    from grpo_mega.data.toy import make_tokenizer

    proc, url = standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(len(make_tokenizer()))],
                                      env=ENV, cwd=str(ROOT), timeout_s=120)
    try:
        yield url
    finally:
        stop(proc)


def _train(out: Path, url: str, *extra):
    argv = [f"hydra.run.dir={out}", "run.steps=2", "eval.interval=2", "rollout.placement=dedicated",
            f"rollout.servers=[{url}]", "rollout.server_timeout_s=60", "algo.rollout_correction=icepop", *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = run_main(argv, timeout=300, cwd=ROOT, scratch=out.parent, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_a_perturbed_engine_raises_the_masked_share_and_spreads_the_ratio(server, tmp_path):
    clean = _train(tmp_path / "clean", server)
    proxy = NoisyProxy(server, SIGMA, seed=0)
    try:
        noisy = _train(tmp_path / "noisy", proxy.url)
    finally:
        proxy.close()
    assert proxy.perturbed > 0
    # log rho = -noise: masked when noise > log 2 (rho < 0.5) or noise < -log 5 (rho > 5)
    expected = 0.5 * math.erfc(math.log(2) / (SIGMA * math.sqrt(2))) + 0.5 * math.erfc(math.log(5) / (SIGMA * math.sqrt(2)))
    for c, n in zip(clean, noisy):
        assert c["is_capped_fraction"] == 0 and c["is_seq_capped_fraction"] == 0
        assert c["rollout_ratio/q01"] == pytest.approx(1, abs=1e-4) and c["rollout_ratio/q99"] == pytest.approx(1, abs=1e-4)
        assert c["logprob_mismatch"] < 1e-5
        assert 0.5 * expected < n["is_capped_fraction"] < 2 * expected, (n["is_capped_fraction"], expected)
        assert n["is_seq_capped_fraction"] > n["is_capped_fraction"]  # a response is hit when any token is
        assert c["is_weight_mean"] == pytest.approx(1, abs=1e-4) and abs(n["is_weight_mean"] - 1) > 0.01
        assert n["rollout_ratio/q01"] < math.exp(-1.5 * SIGMA) and n["rollout_ratio/q99"] > math.exp(1.5 * SIGMA)
        assert n["rollout_ratio/q50"] == pytest.approx(1, abs=0.1)
        # verl's rollout_is_std: the std of clamp(rho, 1/5, 5) over tokens, about a lognormal's of sigma 0.5 (0.60)
        assert c["rollout_corr/rollout_is_std"] < 1e-3 and 0.3 < n["rollout_corr/rollout_is_std"] < 1.0
        for row in (c, n):  # the per-response log_ppl_diff's extremes bracket its mean
            lo, mean, hi = (row[f"rollout_corr/log_ppl_diff{k}"] for k in ("_min", "", "_max"))
            assert lo <= mean <= hi
        assert n["rollout_corr/log_ppl_diff_max"] - n["rollout_corr/log_ppl_diff_min"] > 10 * (
            c["rollout_corr/log_ppl_diff_max"] - c["rollout_corr/log_ppl_diff_min"])
