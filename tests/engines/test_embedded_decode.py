"""The embedded engine's decode modes (rollout.embedded_decode): the static KV cache samples what the dynamic one
samples, and both report transformers' own no-cache logprobs at the sampled tokens; bad settings are named."""

import pytest
import torch

from grpo_mega.conf import RolloutConfig, load_model_config
from grpo_mega.engines.embedded import EmbeddedEngine

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 7], [250, 251, 252]]  # left padding of 0, 5 and 4 tokens


def _no_cache_logprobs(engine, prompt, tokens, temperature):
    """log softmax(logits / T) at each sampled token, from one forward of transformers' model over the whole
    unpadded sequence without a cache (not the engine's code)."""
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    logp = torch.log_softmax(logits / temperature, -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])
def test_static_cache_decodes_as_the_dynamic_one(model):
    engine = EmbeddedEngine.from_model_config(load_model_config(model), seed=3)
    assert engine.decode_mode() == "dynamic"  # auto on the CPU
    out = {}
    for mode in ("dynamic", "static"):
        engine.decode = mode
        assert engine.decode_mode() == mode
        out[mode] = {
            "greedy": engine.generate(PROMPTS, n=1, temperature=0.0, top_p=1.0, max_new_tokens=10, stop_token_ids=[],
                                      seed=0),
            "sampled": engine.generate(PROMPTS, n=3, temperature=0.8, top_p=0.9, max_new_tokens=10,
                                       stop_token_ids=[3], seed=11),
        }
    for kind in ("greedy", "sampled"):
        d, s = out["dynamic"][kind], out["static"][kind]
        # the two caches differ in rounding only (attention over more, masked, keys): the same tokens on this
        # tiny model, and logprobs to fp32 rounding
        assert d.token_ids == s.token_ids and d.finish_reasons == s.finish_reasons
        assert max(abs(x - y) for a, b in zip(d.logprobs, s.logprobs) for x, y in zip(a, b)) < 1e-5
    # every reported logprob is transformers' own, recomputed without a cache over the unpadded sequence
    sampled = out["static"]["sampled"]
    worst = 0.0
    for r, (tokens, lps) in enumerate(zip(sampled.token_ids, sampled.logprobs)):
        ref = _no_cache_logprobs(engine, PROMPTS[r // 3], tokens, 0.8)
        worst = max(worst, max(abs(a - b) for a, b in zip(lps, ref)))
    assert worst < 1e-4, worst
    assert len({tuple(t) for t in sampled.token_ids}) > 3  # sampled, not all alike


def test_static_cache_keeps_per_row_seeds():
    """A sample depends on its seed, not on its batch or the cache's size: alone, in a batch with a longer
    prompt (more left padding, a longer cache) and with row_seeds, the static engine draws the same tokens."""
    engine = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3, decode="static")
    batch = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, stop_token_ids=[], seed=7)
    alone = engine.generate([PROMPTS[1]], n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, stop_token_ids=[], seed=7,
                            prompt_offset=1)
    assert alone.token_ids == batch.token_ids[2:4]
    assert max(abs(x - y) for a, b in zip(alone.logprobs, batch.logprobs[2:4]) for x, y in zip(a, b)) < 1e-5
    shorter = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_new_tokens=5, stop_token_ids=[], seed=7)
    assert shorter.token_ids == [t[:5] for t in batch.token_ids]
    from grpo_mega.engines.interface import sample_seed

    seeded = engine.generate(PROMPTS, n=1, temperature=1.0, top_p=1.0, max_new_tokens=8, stop_token_ids=[], seed=0,
                             row_seeds=[sample_seed(7, p, 1) for p in range(3)])
    assert seeded.token_ids == batch.token_ids[1::2]


def test_rows_are_reported_as_they_end_with_their_own_budgets():
    """on_row_done gets each row once, the moment it ends (a row that stops early is reported before the batch's
    last step), with the tokens the Generation returns; row_max_new_tokens ends a row at its budget with
    "length", and its tokens are the full-budget sample's first ones (a budget does not change what is drawn)."""
    engine = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3)
    full = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_new_tokens=12, stop_token_ids=[], seed=7)
    stop = full.token_ids[0][2]  # row 0 stops at its third token
    budgets = [12, 3, 12, 7, 1, 12]
    reported, steps = [], []
    hook = engine._decode_step

    def counting(mode):  # counts decode forwards: a report's position among them is when it came
        step = hook(mode)
        return lambda *a: steps.append(1) or step(*a)

    engine._decode_step = counting
    gen = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_new_tokens=12, stop_token_ids=[stop], seed=7,
                          row_max_new_tokens=budgets,
                          on_row_done=lambda r, ids, lps, fin: reported.append((r, list(ids), list(lps), fin, len(steps))))
    assert sorted(r for r, *_ in reported) == list(range(6))
    for r, ids, lps, fin, at in reported:
        assert (ids, lps, fin) == (gen.token_ids[r], gen.logprobs[r], gen.finish_reasons[r])
        first_stop = full.token_ids[r].index(stop) + 1 if stop in full.token_ids[r] else 99
        n = min(budgets[r], first_stop)
        assert ids == full.token_ids[r][:n] and fin == ("stop" if first_stop <= budgets[r] else "length"), r
        assert at == len(ids) - 1  # reported right after the step that drew its last token
    assert min(at for *_, at in reported) < len(steps)  # some rows were reported while others decoded on
    with pytest.raises(ValueError, match="row_max_new_tokens needs one budget"):
        engine.generate(PROMPTS, n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, stop_token_ids=[], seed=7,
                        row_max_new_tokens=[4, 5, 1])


def test_bad_decode_settings_are_named():
    cfg = load_model_config("tiny")
    with pytest.raises(ValueError, match="rollout.embedded_decode='fast'"):
        EmbeddedEngine.from_model_config(cfg, decode="fast")
    with pytest.raises(ValueError, match="compiled needs a CUDA device"):
        EmbeddedEngine.from_model_config(cfg, decode="compiled")
    with pytest.raises(ValueError, match="rollout.embedded_decode='fast' must be"):
        RolloutConfig(embedded_decode="fast")


def test_an_abort_ends_the_rows_in_flight_with_their_tokens_so_far():
    """engine.aborting (the stand-in's /pause_generation, mode abort) ends the batch after the step it is in: the
    rows not yet done finish "abort" with the uninterrupted sample's first tokens; a row done before keeps its own."""
    engine = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3)
    kw = dict(n=1, temperature=1.0, top_p=1.0, max_new_tokens=10, stop_token_ids=[], seed=7)
    full = engine.generate(PROMPTS, row_max_new_tokens=[10, 2, 10], **kw)

    def abort_when_row_1_ends(r, ids, lps, finish):
        if r == 1:
            engine.aborting.set()

    try:
        gen = engine.generate(PROMPTS, row_max_new_tokens=[10, 2, 10], on_row_done=abort_when_row_1_ends, **kw)
    finally:
        engine.aborting.clear()
    assert gen.finish_reasons == ["abort", "length", "abort"]
    assert gen.token_ids == [full.token_ids[0][:2], full.token_ids[1], full.token_ids[2][:2]]
    assert gen.logprobs == [full.logprobs[0][:2], full.logprobs[1], full.logprobs[2][:2]]
