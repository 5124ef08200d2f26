"""grpo_mega.trainer.sampling._pick: the refilled step's Generation from (round, row) picks of several rounds,
multi-turn masks and per-sample tool stats carried with their rows, tool seconds summed, the oldest version."""

from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.multi_turn import STAT_KEYS
from grpo_mega.trainer.sampling import _pick


def _gen(tag: int, rows: int, version: int, multi_turn: bool) -> Generation:
    extra = {}
    if multi_turn:
        extra["multi_turn"] = {**{k: [tag * 100 + i for i in range(rows)] for k in STAT_KEYS}, "tool_seconds": tag + 0.5}
    return Generation(token_ids=[[tag, i] for i in range(rows)], logprobs=[[-tag, -i / 10] for i in range(rows)],
                      finish_reasons=["stop" if i % 2 else "length" for i in range(rows)], weight_version=version,
                      extra=extra, model_mask=[[1, i % 2] for i in range(rows)] if multi_turn else None)


def test_pick_carries_every_field_with_its_row():
    gens = [_gen(1, 4, 3, True), _gen(2, 4, 4, True), _gen(3, 4, 4, True)]
    rows = [(0, 0), (0, 1), (2, 2), (2, 3), (1, 0), (1, 1)]
    g = _pick(gens, rows)
    assert g.token_ids == [[1, 0], [1, 1], [3, 2], [3, 3], [2, 0], [2, 1]]
    assert g.logprobs == [gens[r].logprobs[i] for r, i in rows]
    assert g.finish_reasons == ["length", "stop", "length", "stop", "length", "stop"]
    assert g.model_mask == [[1, 0], [1, 1], [1, 0], [1, 1], [1, 0], [1, 1]]
    assert g.weight_version == 3  # round 0 (version 3) is used
    stats = g.extra["multi_turn"]
    assert stats["turns"] == [100, 101, 302, 303, 200, 201]
    assert stats["tool_seconds"] == 1.5 + 2.5 + 3.5  # every round's tools ran


def test_pick_without_multi_turn_and_without_round_0():
    gens = [_gen(1, 2, 0, False), _gen(2, 2, 1, False)]
    g = _pick(gens, [(1, 1), (1, 0)])
    assert g.token_ids == [[2, 1], [2, 0]] and g.model_mask is None and g.extra == {} and g.weight_version == 1
