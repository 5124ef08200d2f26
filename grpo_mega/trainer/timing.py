"""Where a step's time goes: seconds per phase (waiting for samples, reward, old/ref logprobs, update, weight
sync, eval, checkpoint; WALL_PHASES add up to the step) and the whole step, each the maximum over ranks (a step
is as slow as its slowest rank), reduced once per step in one all-reduce; and the step's throughput. The loop
opens a phase with `with timer("update"):`. `generate` is the engines' own seconds for the batch the step
waited for (`timer.add`): in turn with training it equals `generate_wait`; generated one step ahead
(rollout.off_policy_steps=1) it ran while the step trained, and perf/overlap is the share of it hidden.
On GPUs each phase ends with a device synchronisation, so that queued kernels count in the phase that launched
them. perf/mfu (CUDA only) is the update's model FLOPs (`model_flops`, PaLM's count) per second over the dense
bf16 peak of every rank's GPU, as verl's perf/mfu.
"""

from __future__ import annotations

import contextlib
import time

import torch

from grpo_mega.parallel import comm

WALL_PHASES = ("generate_wait", "reward", "old_logprobs", "ref_logprobs", "update", "weight_sync", "eval", "checkpoint")
PHASES = ("generate",) + WALL_PHASES
# Dense bf16 tensor-core peaks (NVIDIA datasheets), matched against torch.cuda.get_device_name in this order.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("A100", 312e12))


class StepTimer:
    """Seconds per phase of one step on this rank; `metrics()` reduces them over ranks (collective)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if phase not in self.seconds:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        """Seconds of a phase measured elsewhere (the engines' generation, on rank 0's rollout thread)."""
        if phase not in self.seconds:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        self.seconds[phase] += seconds

    def metrics(self) -> dict[str, float]:
        """`timing/<phase>` and `timing/step` (since construction), each the maximum over ranks."""
        step = time.perf_counter() - self.start
        values = comm.world_max([self.seconds[p] for p in PHASES] + [step])
        return {f"timing/{p}": v for p, v in zip(PHASES + ("step",), values)}


def throughput(timing: dict[str, float], update_tokens: float, generated_tokens: float, update_flops: float = 0.0,
               peak_flops: float | None = None) -> dict[str, float]:
    """perf/update_tokens_per_s (prompt + response tokens of the rows that train, every epoch, per second of
    the update), perf/generated_tokens_per_s (response tokens of the step's batch per second of generation)
    and perf/overlap (1 - generate_wait / generate: the share of generation hidden behind training; 0 in turn);
    with `peak_flops` (`world_peak_flops`), perf/mfu: `update_flops` per second of the update over it."""
    def rate(tokens, seconds):
        return tokens / seconds if seconds > 0 else 0.0

    gen = timing["timing/generate"]
    out = {"perf/update_tokens_per_s": rate(update_tokens, timing["timing/update"]),
           "perf/generated_tokens_per_s": rate(generated_tokens, gen),
           "perf/overlap": min(1.0, max(0.0, 1.0 - timing["timing/generate_wait"] / gen)) if gen > 0 else 0.0}
    if peak_flops:
        out["perf/mfu"] = rate(update_flops, timing["timing/update"]) / peak_flops
    return out


def model_flops(model, seq_lens: list[int]) -> float:
    """Model FLOPs of one forward + backward of `model` (a ModelConfig) over sequences of `seq_lens` tokens (PaLM,
    Chowdhery et al. 2022, appendix B): 6 x the parameters one token uses (an MoE layer's top-k experts; the input
    embedding, a lookup, left out unless tied to the output layer) x tokens, plus attention's QK^T and AV, 2 x 2 x
    s^2 x heads x kv_channels forward per layer and sequence of s tokens, x3 with the backward (the causal mask's
    skipped half counted, as PaLM does). With LoRA the frozen weights' gradients are not computed: the count is
    full fine-tuning's."""
    params = model.num_active_parameters() - (0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size)
    attention = 12.0 * model.num_layers * model.num_attention_heads * model.kv_channels
    return sum(6.0 * params * s + attention * s * s for s in seq_lens)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU `device_name` (PEAK_BF16_FLOPS); None for one not listed."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def world_peak_flops() -> float | None:
    """The dense bf16 peak of every rank's GPU together; None off CUDA or on a GPU PEAK_BF16_FLOPS does not list."""
    peak = peak_bf16_flops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    return peak * torch.distributed.get_world_size() if peak else None
