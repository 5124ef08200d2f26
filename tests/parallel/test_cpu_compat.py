import pytest
import torch

from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.state import check_layout

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer patches CPU-only machines")


def test_cuda_literals_map_to_cpu_only_inside_the_mode():
    with cpu_compat.cpu_device_mode():
        a = torch.zeros(2, device="cuda")
        b = torch.ones(2).cuda()
        c = torch.ones(2).to("cuda:0")
        d = torch.empty(3, device=torch.cuda.current_device())
        assert {a.device.type, b.device.type, c.device.type, d.device.type} == {"cpu"}
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(1).type(torch.float64).dtype == torch.float64  # a conversion stays one
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_without_device_mode_lifts_the_mode_and_puts_it_back():
    from torch.overrides import _get_current_function_mode_stack

    class Tally(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    with cpu_compat.cpu_device_mode() as mode:
        with cpu_compat.without_device_mode():
            assert mode not in _get_current_function_mode_stack()
            with pytest.raises((RuntimeError, AssertionError)):
                torch.zeros(1, device="cuda")
        assert _get_current_function_mode_stack()[-1] is mode
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        with Tally() as tally:  # another mode above the shim's: left alone, and so is the shim's
            with cpu_compat.without_device_mode():
                torch.ones(1) + 1
            assert tally.calls == 2 and mode in _get_current_function_mode_stack()
    with cpu_compat.without_device_mode():  # outside the mode: nothing to lift
        assert torch.ones(1).type() == "torch.FloatTensor"


def test_the_embedded_engine_decodes_outside_the_device_mode():
    """Its transformers model's torch calls skip the shim's dispatch (a decode step makes hundreds); the same
    tokens as under the mode."""
    from torch.overrides import _get_current_function_mode_stack

    from grpo_mega.conf import load_model_config
    from grpo_mega.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_model_config(load_model_config("tiny"), seed=0)
    seen = []
    layer = engine.model.model.layers[0]
    hook = layer.register_forward_pre_hook(lambda m, a: seen.append(list(_get_current_function_mode_stack())))
    args = dict(prompts=[[3, 4, 5]], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, stop_token_ids=[], seed=1)
    try:
        plain = engine.generate(**args)
        with cpu_compat.cpu_device_mode():
            under = engine.generate(**args)
    finally:
        hook.remove()
    assert seen and not any(isinstance(m, cpu_compat.CudaToCpuMode) for stack in seen for m in stack)
    assert under.token_ids == plain.token_ids and under.logprobs == plain.logprobs


def test_cpu_rng_tracker_forks_named_streams():
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(force_reset=True)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("a", 11)
    tracker.add("b", 12)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        a1 = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    with tracker.fork("a"):
        a2 = torch.rand(3)  # the named stream advanced
    with tracker.fork("b"):
        b1 = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(a1, torch.rand(3)) and not torch.equal(a1, a2) and not torch.equal(a1, b1)
    with pytest.raises(Exception, match="seed 11 already exists"):
        tracker.add("c", 11)


def test_impossible_layouts_are_named():
    assert check_layout(8, 2, 2) == 2
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by parallel.tp \* parallel.pp = 2 \* 2 = 4"):
        check_layout(6, 2, 2)
    with pytest.raises(ValueError, match="parallel.tp=0 must be a positive integer"):
        check_layout(4, 0, 1)


def test_torch_compile_is_deferred_to_the_first_call():
    """megatron's jit_fuser kernels: compiled at their first call with the decorator's arguments, once."""
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append((fn.__name__, kwargs))
        return lambda x: fn(x) + 100

    lazy = cpu_compat._lazy_compile(fake_compile)

    @lazy
    def bare(x):
        return x + 1

    @lazy(dynamic=False)
    def with_args(x):
        return x + 2

    assert calls == [] and bare.__name__ == "bare"
    assert (bare(1), bare(2), with_args(1)) == (102, 103, 103)
    assert calls == [("bare", {}), ("with_args", {"dynamic": False})]


def test_megatron_loads_without_torch_dynamo():
    """After apply(), importing megatron's model, MoE and optimizer modules leaves torch._dynamo unloaded (its import
    is torch.compile's start-up: ~3 s of CPU per process) and megatron.core.jit.jit_fuser deferred."""
    import subprocess
    import sys

    code = ("import sys; from grpo_mega.parallel import cpu_compat; cpu_compat.apply(); "
            "import megatron.core.models.gpt, megatron.core.transformer.moe.moe_layer, megatron.core.optimizer; "
            "from megatron.core import jit; import torch; "
            "print('torch._dynamo' in sys.modules, jit.jit_fuser is torch.compile)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]
