"""The builder: uninitialised (load-ready) and meta models carry the same tensor-parallel tags as initialised ones."""

from grpo_mega.conf import ParallelConfig, PrecisionConfig, load_model_config
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed


def _tags(init, meta):
    from grpo_mega.models.builder import build_gpt

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=2, pp=1)
        gpt, _ = build_gpt(load_model_config("tiny"), ParallelConfig(tp=2), PrecisionConfig(params_dtype="fp32"),
                           init=init, meta=meta)
        tags = {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1), p.device.type)
                for n, p in gpt.named_parameters()}
        destroy_distributed()
        return tags


def test_uninitialised_and_meta_models_are_tagged_like_initialised_ones():
    ref = run_ranks(_tags, 2, True, False, timeout=60)[0]
    assert sum(t[0] for t in ref.values()) >= 10  # qkv, proj, fc1, fc2 per layer, embedding, output
    for init, meta in ((False, False), (False, True)):
        got = run_ranks(_tags, 2, init, meta, timeout=60)[0]
        assert {n: t[:2] for n, t in got.items()} == {n: t[:2] for n, t in ref.items()}
        assert {t[2] for t in got.values()} == {"meta" if meta else "cpu"}
