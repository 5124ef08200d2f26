"""On the CPU (not marked gpu): a checkpoint's RNG states move only between machines of the same device kind.

A GPU's RNG tracker holds CUDA generator states (16 bytes), cpu_compat's tracker CPU generator states (5056
bytes): restoring one into the other ends the next forward with "RNG state is wrong size" (megatron forks
the tracker in every attention). Here a CPU checkpoint is made to look like a GPU's (rng_device 'cuda' and
CUDA-sized tracker states) and must still load and train; a same-device load still restores the RNG."""

import json

import torch

from grpo_mega.parallel.forked import run_ranks


def _rank(root: str):
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from grpo_mega.conf import ParallelConfig
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer import checkpoint
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.checkpoint_store import CheckpointStore
    from tests.gpu import worker as W
    from tests.trainer import layouts as L

    def batch():
        b = L.rollout()
        mask = b.response_mask()
        b.old_logp = L.perturbed(torch.zeros(mask.shape) - 5.0, mask, 0.3, 1)
        b.ref_logp = L.perturbed(torch.zeros(mask.shape) - 5.0, mask, 0.2, 2)
        return b

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=1234)
        actor = Actor(L.model_cfg(), ParallelConfig(), **W._configs("fp32", W.ADAM_OPTIM))
        actor.update(batch(), L.TEMPERATURE)
        path = checkpoint.save(CheckpointStore(root), 1, actor, None, {"step": 1})
        saved = W._weights(actor.built.gpt)
        rng_file = path / "rng" / "rank_00000.safetensors"
        rng = load_file(str(rng_file))
        state = json.loads((path / "loop_state.json").read_text())
        out = {"rng_device_written": state.get("rng_device")}

        # Same device: the RNG comes back.
        torch.manual_seed(5)
        fresh = Actor(L.model_cfg(), ParallelConfig(), **W._configs("fp32", W.ADAM_OPTIM))
        checkpoint.load(Path(path), fresh, None)
        out["same_device_rng_restored"] = torch.equal(torch.get_rng_state(), rng["torch"])

        # A GPU's checkpoint: CUDA-sized tracker states, rng_device 'cuda'.
        gpu_rng = {k: (torch.zeros(16, dtype=torch.uint8) if k.startswith("tracker/") else v) for k, v in rng.items()}
        save_file(gpu_rng, str(rng_file))
        (path / "loop_state.json").write_text(json.dumps({**state, "rng_device": "cuda"}))
        other = Actor(L.model_cfg(), ParallelConfig(), **W._configs("fp32", W.ADAM_OPTIM))
        checkpoint.load(Path(path), other, None)
        loaded = W._weights(other.built.gpt)
        out["weights_equal"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
        (m,) = other.update(batch(), L.TEMPERATURE)  # forks the RNG tracker in every attention
        out["update_finite"] = bool(torch.isfinite(torch.tensor(m["loss"])))
        destroy_distributed()
    return out


def test_checkpoint_from_another_device_kind_loads_and_trains(tmp_path):
    (res,) = run_ranks(_rank, 1, str(tmp_path / "ckpt"), timeout=240)
    assert res == {"rng_device_written": "cpu", "same_device_rng_restored": True, "weights_equal": True,
                   "update_finite": True}
