"""DAPO dynamic sampling's pure part (grpo_mega.algo.dynamic_sampling): the setting's values, informative
groups, the slot rule that fills a refilled step, and its counts, against hand-worked cases."""

import pytest
import torch

from grpo_mega.algo import dynamic_sampling as ds


def B(*bits):
    return torch.tensor([bool(b) for b in bits])


@pytest.mark.parametrize("value,mode", [(False, None), (None, None), ("false", None), ("False", None),
                                        (True, "filter"), ("true", "filter"), ("True", "filter"),
                                        ("filter", "filter"), ("refill", "refill"), ("Refill", "refill")])
def test_the_setting_keeps_its_boolean_form(value, mode):
    assert ds.resolve_mode(value) == mode


def test_an_unknown_mode_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"algo\.dynamic_sampling='refil' must be 'filter', 'refill' or null"):
        ds.resolve_mode("refil")


def test_informative_groups():
    r = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.5, 0.5, 1.0, 1.0])  # n=2: groups (0,0) (1,0) (.5,.5) (1,1)
    assert ds.informative(r, 2).tolist() == [False, True, False, False]


def test_slots_keep_round_0_and_replace_its_uninformative_groups_in_order():
    r0, r1, r2 = B(1, 0, 1, 0), B(0, 1, 0), B(1, 1)
    # slot 1 <- round 1 group 1; slot 3 <- round 2 group 0; round 2 group 1 is surplus
    assert ds.refill_slots([r0, r1, r2], 4) == [(0, 0), (1, 1), (0, 2), (2, 0)]
    c = ds.refill_counts([r0, r1, r2], ds.refill_slots([r0, r1, r2], 4))
    assert c == {"dynamic_sampling/extra_rounds": 2.0, "dynamic_sampling/generated_groups": 9.0,
                 "dynamic_sampling/informative_groups": 4.0, "dynamic_sampling/groups_dropped": 4.0,
                 "dynamic_sampling/surplus_groups": 1.0, "dynamic_sampling/masked_groups": 0.0}


def test_slots_that_no_round_fills_keep_their_uninformative_group():
    r0, r1 = B(0, 0, 1), B(0, 1, 0)
    picks = ds.refill_slots([r0, r1], 3)
    assert picks == [(1, 1), (0, 1), (0, 2)]
    c = ds.refill_counts([r0, r1], picks)
    assert c["dynamic_sampling/informative_groups"] == 2 and c["dynamic_sampling/masked_groups"] == 1
    assert c["dynamic_sampling/groups_dropped"] == 4 and c["dynamic_sampling/surplus_groups"] == 0


def test_one_round_is_the_filter():
    r0 = B(0, 1, 0, 1)
    assert ds.refill_slots([r0], 4) == [(0, g) for g in range(4)]
    assert not ds.enough([r0], 4) and ds.enough([r0, B(1, 1, 0, 0)], 4)


def test_round_0_must_be_the_step():
    with pytest.raises(ValueError, match="round 0 has 3 groups; the step wants 4"):
        ds.refill_slots([B(1, 1, 1)], 4)


def test_the_config_field():
    from grpo_mega.conf.algo import AlgoConfig
    from grpo_mega.conf.schema import TrainConfig

    assert AlgoConfig(dynamic_sampling=True).dynamic_sampling == "filter"
    assert AlgoConfig().dynamic_sampling is None and AlgoConfig(dynamic_sampling=False).dynamic_sampling is None and AlgoConfig().max_gen_rounds == 10
    assert TrainConfig(algo=AlgoConfig(dynamic_sampling="refill")).shaping().dynamic_sampling is True
    with pytest.raises(ValueError, match=r"algo\.max_gen_rounds=0 must be >= 1"):
        AlgoConfig(dynamic_sampling="refill", max_gen_rounds=0)
    with pytest.raises(ValueError, match=r"algo\.dynamic_sampling=refill with reward\.rm_train\.interval=2"):
        TrainConfig(algo=AlgoConfig(dynamic_sampling="refill"),
                    reward=dict(name="reward_model", path="x", rm_train=dict(interval=2, labels="task")))
