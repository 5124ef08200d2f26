"""The stand-in's decode loop (grpo_mega.engines.continuous): requests arriving while others decode join the same
batch and leave as they end; every row samples what the embedded engine samples for it alone (the same seed,
greedy, temperature, top-p, stop tokens, budgets) and reports transformers' own no-cache logprobs at its tokens; a
row cut by its budget is continued from its keys and values; holds keep new rows out, time out by name, and let a
weight load wait for an idle loop; an abort ends the rows in flight. (Moved here from test_embedded_decode.py with
the prefix cache: test_a_continued_row_starts_from_its_held_keys_and_values.)"""

import threading
import time

import pytest
import torch

from grpo_mega.conf import load_model_config
from grpo_mega.engines.continuous import ContinuousBatcher, Row
from grpo_mega.engines.embedded import EmbeddedEngine

# (input, budget, seed, temperature, top_p): left padding, greedy, a nucleus, one-token input
SPECS = [([5, 17, 33, 2, 9, 41, 7], 12, 11, 1.0, 1.0), ([100, 7], 6, 12, 0.7, 0.9), ([250], 9, 13, 0.0, 1.0),
         ([250, 251, 252], 10, 14, 1.3, 1.0), ([9, 9, 9, 9], 4, 15, 1.0, 0.5)]
STOP = frozenset({3, 8})


@pytest.fixture(scope="module")
def engine():
    engine = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3)
    engine.enable_prefix_cache()
    return engine


def _no_cache_logprobs(engine, prompt, tokens, temperature):
    """log softmax(logits / T) at each token from one forward of transformers' model over the whole unpadded
    sequence without a cache (not our code)."""
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def _rows(specs):
    return [Row(list(ids), budget, seed, t, p, STOP) for ids, budget, seed, t, p in specs]


def test_requests_join_and_leave_one_batch_and_sample_as_alone(engine):
    batcher = ContinuousBatcher(engine)
    out, order = {}, []
    try:
        def request(k):  # one request of two rows, three of one, each sent while the ones before decode
            specs = SPECS[:2] if k == 0 else [SPECS[k + 1]]
            out[k] = batcher.run(_rows(specs))
            order.append(k)

        threads = [threading.Thread(target=request, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
            deadline = time.monotonic() + 10
            while batcher.steps == 0 and time.monotonic() < deadline:  # the first request is decoding
                time.sleep(0.001)
        for t in threads:
            t.join(timeout=60)
        steps = batcher.steps
    finally:
        batcher.close()
    row_steps, busy = batcher.row_steps, batcher.busy_s  # the loop has ended: its last step counted
    rows = out[0] + out[1] + out[2] + out[3]
    assert sum(len(r.tokens) for r in rows) > steps, steps  # rows shared decode steps (test 2: across requests)
    assert row_steps == sum(len(r.tokens) for r in rows) and busy > 0  # a row a step is one token (decode_stats)
    for r, (ids, budget, seed, temperature, top_p) in zip(rows, SPECS):
        alone = engine.generate([ids], 1, temperature, top_p, budget, STOP, 0, row_seeds=[seed])
        assert (r.tokens, r.finish) == (alone.token_ids[0], alone.finish_reasons[0]), (ids, r.tokens, alone.token_ids)
        assert max(abs(a - b) for a, b in zip(r.logprobs, alone.logprobs[0])) < 1e-5
        ref = _no_cache_logprobs(engine, ids, r.tokens, temperature) if temperature > 0 else None
        if ref is not None and top_p == 1.0:  # a nucleus renormalises, the logprob is of the unfiltered softmax
            assert max(abs(a - b) for a, b in zip(r.logprobs, ref)) < 1e-4
    assert len({tuple(r.tokens) for r in rows}) == len(rows)


def test_long_inputs_joining_many_rows_are_prefilled_apart_and_sample_as_alone(engine):
    """Inputs much longer than the rows decoding are prefilled in forwards of their own (every row of the step's
    forward would be as wide as the longest), in buckets of similar lengths, then decode beside the others: each row
    still samples what it samples alone."""
    assert ContinuousBatcher._apart([40, 25], 10) and ContinuousBatcher._apart([3, 2], 4) is None
    assert ContinuousBatcher._apart([40, 25], 10, call_tokens=400) is None  # a forward made 6 ms longer
    batcher = ContinuousBatcher(engine)
    prefilled = []
    prefill = batcher._prefill
    batcher._prefill = lambda seqs, buckets: prefilled.append([len(x) for x in seqs]) or prefill(seqs, buckets)
    short = [([11 + j, 12], 48, 40 + j, 1.0, 1.0) for j in range(8)]  # no stop token: all 8 decode 48 steps
    long = [(list(range(60, 100)), 8, 50, 1.0, 1.0), (list(range(30, 55)), 8, 51, 0.0, 1.0),
            (list(range(120, 124)), 8, 52, 1.0, 0.9)]
    out = {}
    try:
        rows = [Row(list(ids), budget, seed, t, p) for ids, budget, seed, t, p in short]
        first = threading.Thread(target=lambda: out.update(short=batcher.run(rows)))
        first.start()
        deadline = time.monotonic() + 10
        while batcher.steps < 2 and time.monotonic() < deadline:  # the short rows are decoding
            time.sleep(0.001)
        out["long"] = batcher.run(_rows(long))
        first.join(timeout=60)
    finally:
        batcher.close()
    assert prefilled == [[39, 24, 3]], prefilled  # all but the last token of each, apart from the step
    for r, (ids, budget, seed, temperature, top_p), stop in zip(out["short"] + out["long"], short + long,
                                                                [frozenset()] * 8 + [STOP] * 3):
        alone = engine.generate([ids], 1, temperature, top_p, budget, stop, 0, row_seeds=[seed])
        assert (r.tokens, r.finish) == (alone.token_ids[0], alone.finish_reasons[0]), (ids, r.tokens, alone.token_ids)
        assert max(abs(a - b) for a, b in zip(r.logprobs, alone.logprobs[0])) < 1e-5


def test_a_short_request_leaves_before_a_long_one_and_a_cut_row_continues_from_its_cache(engine):
    batcher = ContinuousBatcher(engine)
    done = []
    try:
        long = threading.Thread(target=lambda: done.append(("long", batcher.run([Row([4, 5, 6], 40, 1)]))))
        long.start()
        while batcher.steps == 0:
            time.sleep(0.001)
        short = batcher.run([Row([7, 8], 5, 2)])
        done.append(("short", short))
        long.join(timeout=60)
        steps = batcher.steps
        hits = engine.prefix_cache.hits
        cut = done[1][1][0]
        more = batcher.run([Row([4, 5, 6] + cut.tokens, 6, 3)])[0]  # continues the long row, cut by its budget
    finally:
        batcher.close()
    assert [d[0] for d in done] == ["short", "long"] and steps == 40  # the short one decoded beside the long one
    assert cut.finish == "length" and len(cut.tokens) == 40 and engine.prefix_cache.hits == hits + 1
    ref = _no_cache_logprobs(engine, [4, 5, 6] + cut.tokens, more.tokens, 1.0)
    assert max(abs(a - b) for a, b in zip(more.logprobs, ref)) < 1e-4


def test_holds_idle_timeouts_and_abort(engine):
    batcher = ContinuousBatcher(engine, timeout_s=0.5)
    try:
        batcher.hold("a weight update")
        with pytest.raises(RuntimeError, match="held by a weight update for over 0 s"):
            batcher.run([Row([1, 2], 3, 1)])
        got = []
        waiting = threading.Thread(target=lambda: got.append(batcher.run([Row([1, 2], 3, 1)])))
        waiting.start()
        time.sleep(0.2)
        assert not got and batcher.steps == 0  # held
        batcher.release("a weight update")
        waiting.join(timeout=30)
        assert len(got[0][0].tokens) == 3
        runner = threading.Thread(target=lambda: got.append(batcher.run([Row([1, 2], 5000, 2)])))
        runner.start()
        while not batcher.active:
            time.sleep(0.001)
        batcher.hold("load")
        assert not batcher.idle(0.05)  # a row is in flight
        engine.aborting.set()
        assert batcher.idle(10)
        runner.join(timeout=30)
        aborted = got[1][0]
        assert aborted.finish == "abort" and 0 < len(aborted.tokens) < 5000
    finally:
        engine.aborting.clear()
        batcher.close()
    with pytest.raises(ValueError, match="temperature >= 0 and top_p"):
        batcher.run([Row([1], 2, 0, 1.0, 0.0)])


def test_a_continued_row_starts_from_its_held_keys_and_values():
    """With a prefix cache (the stand-in's radix cache) a request continuing rows that ended by their budget feeds
    only each continued row's last token (the new rows their whole prompt, in the same forward), and samples what an
    engine without the cache samples from the whole input, with transformers' no-cache logprobs; loading weights
    drops what is held (the next continuation is prefilled under the new weights)."""
    from grpo_mega.engines.weight_sync import pack_buckets

    prompts = [[5, 17, 33, 2, 9, 41, 7], [100, 7], [250, 251, 252]]
    cached = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3)
    plain = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3)
    cached.enable_prefix_cache()
    fed = []  # tokens fed to the model per forward (transformers' model, a hook)
    cached.model.register_forward_pre_hook(lambda m, args, kw: fed.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    batcher = ContinuousBatcher(cached)
    kw = dict(n=1, temperature=1.0, top_p=1.0, stop_token_ids=[], seed=0)
    try:
        first = batcher.run([Row(p, b, s) for p, b, s in zip(prompts, [4, 6, 2], [1, 2, 3])])
        want = plain.generate(prompts, max_new_tokens=6, row_seeds=[1, 2, 3], row_max_new_tokens=[4, 6, 2], **kw)
        assert [r.tokens for r in first] == want.token_ids
        inputs = [p + r.tokens for p, r in zip(prompts, first)] + [[77, 78, 79, 80]]
        for round in range(2):
            fed.clear()
            got = batcher.run([Row(list(i), 5, s) for i, s in zip(inputs, [9, 8, 7, 6])])
            want = plain.generate(inputs, max_new_tokens=5, row_seeds=[9, 8, 7, 6], **kw)
            # round 0: the new row's prompt (4 tokens) beside the continued rows' last tokens, then one token per row
            # per step; round 1: every row continues (the continued inputs are 9 to 13 tokens: not fed again)
            assert fed == [(4, 4 if round == 0 else 1)] + [(4, 1)] * 4, (round, fed)
            assert [r.tokens for r in got] == want.token_ids and [r.finish for r in got] == want.finish_reasons
            worst = max(abs(a - b) for i, r in zip(inputs, got)
                        for a, b in zip(r.logprobs, _no_cache_logprobs(cached, i, r.tokens, 1.0)))
            assert worst < 1e-4, worst
            inputs = [i + r.tokens for i, r in zip(inputs, got)]
        assert cached.prefix_cache.hits == 3 + 4 and cached.prefix_cache.bytes > 0
        for bucket in pack_buckets(iter({name: p + 0.1 for name, p in cached.params.items()}.items()), 1 << 30):
            cached.load_bucket(bucket)
        assert cached.prefix_cache.bytes == 0 and not cached.prefix_cache.entries
        fed.clear()
        got = batcher.run([Row(inputs[0], 2, 5)])[0]
        assert fed[0] == (1, len(inputs[0]))  # prefilled again, under the new weights
        ref = _no_cache_logprobs(cached, inputs[0], got.tokens, 1.0)
        assert max(abs(a - b) for a, b in zip(got.logprobs, ref)) < 1e-4
    finally:
        batcher.close()


@pytest.mark.parametrize("pause", ["retract", "park"])
def test_a_row_paused_across_a_weight_load_samples_on_under_the_new_weights(pause):
    """retract() (SGLang's pause mode "retract") takes a decoding row out of the batch with its request open; after a
    weight load it is prefilled again (input and tokens so far) and samples on. park() (mode "in_place") stops the
    loop between two steps with the row in the batch; the weights load under it and it samples on from the keys and
    values its prefix left under the old weights, one token a step (nothing prefilled again). Either way its tokens
    before the load carry version 0 and transformers' no-cache logprobs under the old weights, those after carry
    version 1 and, retracted, the new weights' no-cache logprobs, parked, what transformers' model gives going on
    under the new weights from the DynamicCache it filled under the old ones (each within 1e-4, float32 against
    float64 over a 4-layer model); the other mode's reference would be off by far more."""
    from transformers import DynamicCache

    from grpo_mega.engines.weight_sync import pack_buckets

    live = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3)
    old = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3)
    batcher = ContinuousBatcher(live)
    got, fed = [], []
    prompt = [5, 17, 33, 2]
    try:
        runner = threading.Thread(target=lambda: got.append(batcher.run([Row(prompt, 40, 1)])[0]))
        runner.start()
        while batcher.steps < 10:
            time.sleep(0.001)
        batcher.hold("load")
        if pause == "retract":
            batcher.retract()
            assert batcher.idle(10) and not got  # out of the batch, its request still open
        else:
            batcher.park()
            assert batcher.quiet(10) and not got and len(batcher.active) == 1  # between two steps, still in the batch
            steps = batcher.steps
            time.sleep(0.05)
            assert batcher.steps == steps  # parked: no step runs
        live.model.register_forward_pre_hook(lambda m, args, kw: fed.append(tuple(kw["input_ids"].shape)),
                                             with_kwargs=True)
        for bucket in pack_buckets(iter({n: p * 1.5 for n, p in live.params.items()}.items()), 1 << 30):
            live.load_bucket(bucket)
        live.weight_version = 1
        batcher.unpark()
        batcher.release("load")
        runner.join(timeout=60)
    finally:
        batcher.close()
    (row,) = got
    m = row.versions.index(1)
    assert row.finish == "length" and len(row.tokens) == 40 and row.versions == [0] * m + [1] * (40 - m) and 0 < m < 40
    before = _no_cache_logprobs(old, prompt, row.tokens[:m], 1.0)
    again = [_no_cache_logprobs(live, prompt + row.tokens[:t], [row.tokens[t]], 1.0)[0] for t in range(m, 40)]
    with torch.no_grad():  # transformers' model: the prefix's cache under the old weights, the rest under the new
        ids, cache = prompt + row.tokens, DynamicCache()
        old.model(input_ids=torch.tensor([ids[:len(prompt) + m - 1]]), past_key_values=cache, use_cache=True)
        logits = live.model(input_ids=torch.tensor([ids[len(prompt) + m - 1:-1]]), past_key_values=cache,
                            use_cache=True).logits[0].double()
    kept = [float(x) for x in torch.log_softmax(logits, -1).gather(1, torch.tensor(row.tokens[m:])[:, None])[:, 0]]
    after, other = (again, kept) if pause == "retract" else (kept, again)
    assert fed[0] == ((1, len(prompt) + m) if pause == "retract" else (1, 1))  # prefilled again, or one token
    assert max(abs(a - b) for a, b in zip(row.logprobs, before + after)) < 1e-4
    assert max(abs(a - b) for a, b in zip(row.logprobs[m:], other)) > 1e-2
    wrong = _no_cache_logprobs(old, prompt, row.tokens, 1.0)[m:]
    assert max(abs(a - b) for a, b in zip(row.logprobs[m:], wrong)) > 1e-2


def test_abort_by_request_id_ends_those_rows_wherever_they_are(engine):
    batcher = ContinuousBatcher(engine)
    got = {}
    try:
        running = threading.Thread(target=lambda: got.update(x=batcher.run([Row([1, 2], 5000, 1, rid="x")])))
        other = threading.Thread(target=lambda: got.update(z=batcher.run([Row([3, 4], 30, 2, rid="z")])))
        running.start()
        while not batcher.active:
            time.sleep(0.001)
        batcher.hold("pause")
        waiting = threading.Thread(target=lambda: got.update(y=batcher.run([Row([1, 2], 50, 3, rid="y")])))
        waiting.start()
        while not batcher.pending:
            time.sleep(0.001)
        other.start()
        assert batcher.abort({"x", "y"}) == 2
        running.join(timeout=30)
        waiting.join(timeout=30)
        batcher.release("pause")
        other.join(timeout=60)
    finally:
        batcher.close()
    assert got["x"][0].finish == "abort" and 0 < len(got["x"][0].tokens) < 5000
    assert got["y"][0].finish == "abort" and got["y"][0].tokens == []  # never joined
    assert got["z"][0].finish is not None and got["z"][0].finish != "abort"


def test_the_stand_in_server_starts_without_megatron():
    """The stand-in (and its decode loop) imports no megatron: its start-up stays seconds, not the ~7 s megatron's
    import costs, and its stderr holds only its own words (test_server_security reads it line by line)."""
    import subprocess
    import sys

    code = ("import sys, grpo_mega.engines.standin_server; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


def test_a_simulated_length_ends_a_response_and_only_a_cut_one_is_kept():
    """--simulate-lengths: a response that reaches its drawn length has ended (finish "stop", as at a stop token:
    nothing continues it, so its keys and values are not kept), one cut by its segment's cap ends "length" and is
    kept for the request that continues it, which feeds only its last token."""
    from grpo_mega.engines.standin_server import EngineServer

    engine = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=3)
    engine.enable_prefix_cache()
    server = EngineServer(engine, "tiny", lengths=(8.0, 0.9))
    try:
        def params(seed, cap, generated=0):
            return dict(max_new_tokens=cap, sampling_seed=seed, custom_params={"sample_seed": seed,
                                                                             "generated": generated})

        drawn = {s: server.simulated_length(params(s, 64)) for s in range(40)}
        short, long = next(s for s, n in drawn.items() if 2 <= n <= 6), next(s for s, n in drawn.items() if n >= 10)
        outs = server.generate(dict(input_ids=[[5, 6, 7], [8, 9]], sampling_params=[params(short, 64), params(long, 4)]))
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["stop", "length"]
        assert [len(o["output_ids"]) for o in outs] == [drawn[short], 4]
        assert len(engine.prefix_cache.entries) == 1  # the cut response's, not the ended one's
        hits = engine.prefix_cache.hits
        more = server.generate(dict(input_ids=[8, 9] + outs[1]["output_ids"], sampling_params=params(long, 64, 4)))
        assert len(more["output_ids"]) == drawn[long] - 4 and more["meta_info"]["finish_reason"]["type"] == "stop"
        assert engine.prefix_cache.hits == hits + 1 and not engine.prefix_cache.entries
    finally:
        server.batcher.close()
