"""Training checkpoints: actor, reference, optimizer and LR schedule (Megatron distributed checkpoint, any
layout on resume), every rank's RNG states, and the loop's own state (step, weight version, data cursor,
resolved config), sealed by the CheckpointStore so that only complete checkpoints are ever loaded.

Layout of `step_XXXXXXXX/`: `model/` (the distributed checkpoint, with grpo_mega.json so that
grpo-mega-convert-to-hf can export it later), `rng/rank_*.safetensors`, `loop_state.json`, `hf/` when
`checkpoint.export_hf=true` (the actor as an HF directory, loadable by transformers and SGLang; under LoRA the
merged weights W + (alpha / r) B A, and `peft/` the adapters as a PEFT LoRA directory, `export_peft`, unless
an MoE model's dense MLP layers carry adapters: `peft_refusal`),
`rollout_routes.safetensors` when an in-flight batch carries routed experts (algo.routing_replay=rollout or measure;
`save_routes`), and the store's manifest.json over all of them.

The reference is not written while it is the weights of the model path (an HF directory) it was loaded from, before
`algo.ref_update_interval` first resets it: loop_state.json keeps the path and the sha256 of its weight files under
"reference_from", and a resume checks them against its own model's (the reference of a random-init model, and one
that was reset, is written).

Under LoRA (lora.rank) `model/` holds the adapters and their optimizer state alone: the frozen base weights come from
the model path, whose identity loop_state.json keeps under "lora"; a resume on another base model, or with other
adapter shapes, is refused (grpo_mega/trainer/lora_checkpoint.py).

Long on purpose: save and load are one format (what `save` writes, `load` reads back at any layout), and the HF
export rides inside the save's sealed directory.
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from grpo_mega.parallel import comm
from grpo_mega.trainer.checkpoint_store import CheckpointError, CheckpointStore, hash_share, merge_digests
from grpo_mega.trainer.lora_checkpoint import (_lora, check_lora, describe_base, export_peft, lora_state, peft_refusal,
                                               same_base)

# The DistributedOptimizer's default checkpoint format needs TE/Apex on CPU ("ShardedTensor.flattened_range
# is not supported"); fully_reshardable also lets a checkpoint load at another TP/PP/DP.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _patch_distrib_optimizer_load() -> None:
    """megatron-core 0.16.1's fully_reshardable load copies every key of a parameter's live optimizer state
    from the checkpoint's tensors, but it leaves Adam's `step` out of those tensors (the step is restored
    separately): KeyError: 'step' once the state holds a step. Copy the keys the checkpoint provides."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if getattr(DistributedOptimizer, "_grpo_mega_patched", False):
        return
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, value in tensors.items():
                dst[key].copy_(value)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    DistributedOptimizer._grpo_mega_patched = True


_SAID_NO_PEFT: list[str] = []
"""Why a checkpoint has no peft/, once said (this process)."""


def _sharded(actor, reference, loading: bool) -> dict:
    if _lora(actor) is not None:  # the adapters alone; the reference is the base (the actor with adapters off)
        from grpo_mega.models.lora import ADAPTER_KEYS, ADAPTERS_METADATA

        model_sd = actor.built.gpt.sharded_state_dict(metadata={ADAPTERS_METADATA: True})
        model_sd, reference = {k: v for k, v in model_sd.items() if k.endswith(ADAPTER_KEYS)}, None
    else:
        model_sd = actor.built.gpt.sharded_state_dict()
    out = {"actor": model_sd,
           "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIM_METADATA)}
    if reference is not None:
        out["reference"] = reference.built.gpt.sharded_state_dict(prefix="reference.")
    return out


def fit_optimizer_chain(state: dict, optimizer) -> dict:
    """A loaded optimizer state fitted to `optimizer`'s chain. Under EP > 1 megatron chains an optimizer for the
    dense parameters and one for the experts' (`is_expert_parallel` param groups), and a checkpoint's common part
    (the param groups: step, lr, betas) is saved per optimizer of the saving run's chain; an MoE run resumed at
    another expert-parallel size (ep=2 <-> ep=1) reads the other structure and megatron raises KeyError
    'optimizer'. The parameter states themselves are loaded per parameter whatever the layout
    (fully_reshardable): only the param groups move, the experts' taking the dense groups' values."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    saved = sorted(k for k in state if isinstance(k, int) and "optimizer" in state[k])
    if len(chain) == 1 and saved:  # saved as a chain, loaded into one optimizer: the dense groups
        common = [state.pop(k) for k in saved]
        state["optimizer"] = {"param_groups": [g for c in common for g in c["optimizer"]["param_groups"]
                                               if not g.get("is_expert_parallel")]}
        state["param_state_sharding_type"] = common[0]["param_state_sharding_type"]
    elif len(chain) > 1 and "optimizer" in state:  # saved as one optimizer, loaded into a chain
        groups, kind = state.pop("optimizer")["param_groups"], state.pop("param_state_sharding_type")
        for i, opt in enumerate(chain):
            expert = any(g.get("is_expert_parallel") for g in opt.optimizer.param_groups)
            state[i] = {**state.get(i, {}), "param_state_sharding_type": kind,
                        "optimizer": {"param_groups": [{**g, "is_expert_parallel": expert} for g in groups]}}
    return state


def _rng_state() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel import random as mrandom

    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    for name, s in mrandom.get_cuda_rng_tracker().get_states().items():
        states[f"tracker/{name}"] = s
    return states


def _set_rng_state(states: dict[str, torch.Tensor]) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_rng_state(states["torch"])
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["torch_cuda"])
    mrandom.get_cuda_rng_tracker().set_states({k.split("/", 1)[1]: v for k, v in states.items() if k.startswith("tracker/")})


def _torch_optimizers(actor) -> list:
    """The torch optimizers under the actor's megatron optimizer (actor.torch_optimizers)."""
    from grpo_mega.trainer.optimizer import torch_optimizers

    return torch_optimizers(actor.optimizer)


def prime_optimizer(actor) -> None:
    """A freshly built optimizer has no state to load into ("assert len(steps) == 1"): give every
    parameter zero Adam moments and its own step tensor (one step tensor shared by all parameters would
    advance once per parameter). The checkpoint's values overwrite all of them."""
    for inner in _torch_optimizers(actor):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _rng_device() -> str:
    """What the RNG tracker's states are: CUDA generator states on a GPU, the CPU generator's (cpu_compat's
    tracker) without one. They differ in size and cannot be restored across: "RNG state is wrong size"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _unshare_steps(actor) -> None:
    """After megatron-core 0.16.1 loads a DistributedOptimizer, every parameter's Adam `step` is the same
    tensor object: each optimizer step then advances it once per parameter (measured: 2 -> 33 after one
    step of a 31-parameter model), and bias correction is silently wrong from the first resumed step."""
    for inner in _torch_optimizers(actor):
        for state in inner.state.values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = state["step"].clone()


class _HFExport:
    """A rollout-engine stand-in for weight sync that writes the buckets into an HF directory: the same
    gather (TP), routing (PP stages to rank 0) and renaming the engine gets, so the export is what SGLang
    would be serving."""

    def __init__(self, writer):
        self.writer = writer

    def update_weights(self, version: int, buckets) -> None:
        for bucket in buckets:
            for name, t in bucket.tensors():  # to host memory: a shard waits there until it is full (2 GiB)
                self.writer.add(name, t.to("cpu", copy=True))


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def export_hf(out_dir: Path, actor, model_cfg, dtype: torch.dtype, hf_dir: Optional[str] = None) -> None:
    """Collective: write the actor's current weights as an HF directory at `out_dir` (rank 0 writes).
    config.json comes from the model config (over the source HF config when there is one); the tokenizer
    files are copied from `hf_dir`."""
    from grpo_mega.models import bridge
    from grpo_mega.models.hf_io import HFWriter, read_hf_config
    from grpo_mega.engines.weight_sync import sync_weights

    sink = None
    if dist.get_rank() == 0:
        sink = _HFExport(HFWriter(str(out_dir)))
    try:
        sync_weights(actor.built.gpt, cfg=model_cfg, engine=sink, version=-1, bucket_mb=256, dtype=dtype)
        if sink is not None:
            config = dict(read_hf_config(hf_dir)[0]) if hf_dir else {}
            config.update(bridge.FAMILIES.get(model_cfg.family).hf_config(model_cfg, dtype=_DTYPE_NAMES[dtype]))
            sink.writer.close(config, tokenizer_from=hf_dir)
    except BaseException:
        if sink is not None:
            sink.writer.abort()
        raise


def model_dir(path: str) -> str:
    """The Megatron checkpoint to export from `path`: a training checkpoint (step_XXXXXXXX/, verified
    against its manifest first) gives its `model/`; anything else is taken as a converted checkpoint."""
    from grpo_mega.models.convert import META_FILE
    from grpo_mega.trainer.checkpoint_store import MANIFEST

    p = Path(path)
    if not (p / "model").is_dir():
        return path
    if not (p / MANIFEST).is_file():
        raise ValueError(f"{path}: a training checkpoint without {MANIFEST}: it was interrupted while being written "
                         "(use an earlier step_* directory)")
    CheckpointStore(str(p.parent)).verify(p)
    if not (p / "model" / META_FILE).is_file():
        raise ValueError(f"{path}/model has no {META_FILE} (written by an older grpo-mega?); cannot tell its model")
    if json.loads((p / "model" / META_FILE).read_text()).get("lora"):
        raise ValueError(f"{path} is a LoRA checkpoint: its model/ holds the adapters alone, not a model to export; "
                         f"its merged HF model is {path}/hf when it was saved with checkpoint.export_hf=true")
    return str(p / "model")


ROUTES_FILE = "rollout_routes.safetensors"


def save_routes(path: Path, routed: list) -> dict:
    """An in-flight batch's routed experts (per sample an int16 tensor [positions, M, k], or None) into one
    safetensors file: `experts` [sum of positions, M, k] int16, the samples back to back, and `positions` [N]
    int64 (-1: no routes). 2 bytes per expert id, against ~4 as JSON text (a 30B-A3B batch of 512 x 8k tokens
    holds 1.6e9). Returns what loop_state.json keeps in their place."""
    from safetensors.torch import save_file

    held = [r for r in routed if r is not None]
    positions = torch.tensor([-1 if r is None else r.shape[0] for r in routed], dtype=torch.int64)
    experts = torch.cat([r.to(torch.int16) for r in held]) if held else torch.zeros(0, 0, 0, dtype=torch.int16)
    save_file({"experts": experts.contiguous(), "positions": positions}, str(path / ROUTES_FILE))
    return {"file": ROUTES_FILE, "samples": len(routed)}


def load_routes(path: Path, ref: dict) -> list:
    """`save_routes`' file back as the per-sample list."""
    from safetensors.torch import load_file

    t = load_file(str(path / ref["file"]))
    positions, out, start = t["positions"].tolist(), [], 0
    if len(positions) != ref["samples"]:
        raise CheckpointError(f"{path / ref['file']} holds routes of {len(positions)} samples; loop_state.json "
                              f"expects {ref['samples']}")
    for n in positions:
        out.append(None if n < 0 else t["experts"][start:start + n].clone())
        start += max(n, 0)
    return out


def save(store: CheckpointStore, step: int, actor, reference, loop_state: dict,
         export: Optional[dict] = None, task_files: Optional[Callable[[Path], None]] = None,
         reference_from: Optional[dict] = None) -> Optional[Path]:
    """Collective: every rank writes its shards, then every rank hashes its share of them and rank 0 seals
    (`seal`). Returns the path on rank 0.
    `reference_from` (base_model_identity of the model path; None: the reference is written): the reference is
    still that path's weights, so it is not written and loop_state.json names the weights (`load` checks them).
    `export` (model_cfg, dtype, hf_dir) also writes the actor as an HF directory `hf/` into the checkpoint.
    `task_files(dir)` (rank 0) writes the task's non-JSON state (a reward model in training) into `task/`."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from grpo_mega.models.convert import write_meta

    tmp = comm.broadcast_object(str(store.begin(step)) if dist.get_rank() == 0 else None)
    tmp = Path(tmp)
    (tmp / "model").mkdir(exist_ok=True)
    dist.barrier()
    prime_optimizer(actor)  # before the first optimizer step (a run stopped at step 1) there is no state yet
    written = reference if reference_from is None else None
    dist_checkpointing.save(_sharded(actor, written, loading=False), str(tmp / "model"))
    if export is not None:
        if dist.get_rank() == 0:
            from grpo_mega.models.hf_io import read_hf_config

            hf_config = read_hf_config(export["hf_dir"])[0] if export.get("hf_dir") else {}
            extra = {"lora": lora_state(actor, (loop_state.get("lora") or {}).get("base_model"))} if _lora(actor) else {}
            write_meta(str(tmp / "model"), export["model_cfg"], hf_config, export["dtype"], source=export.get("hf_dir"),
                       **extra)
        if export.get("hf"):
            export_hf(tmp / "hf", actor, export["model_cfg"], export["dtype"], export.get("hf_dir"))
            if _lora(actor) is not None:
                why = peft_refusal(_lora(actor), export["model_cfg"])
                if why is None:
                    export_peft(tmp / "peft", actor, export["model_cfg"], export["dtype"], export.get("hf_dir"))
                elif dist.get_rank() == 0 and not _SAID_NO_PEFT:  # hf/ alone; said once per run
                    _SAID_NO_PEFT.append(why)
                    print(f"checkpoint: no peft/ directory: {why}", file=sys.stderr, flush=True)
    (tmp / "rng").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in _rng_state().items()}, str(tmp / "rng" / f"rank_{dist.get_rank():05d}.safetensors"))
    if dist.get_rank() == 0:
        if task_files is not None:
            task_files(tmp / "task")
        rollout = loop_state.get("rollout")
        if rollout is not None and rollout.get("routed_experts") is not None:
            loop_state = {**loop_state, "rollout": {**rollout, "routed_experts": save_routes(tmp, rollout["routed_experts"])}}
        with open(tmp / "loop_state.json", "w") as f:
            json.dump({**loop_state, "scheduler": actor.scheduler.state_dict(), "world_size": dist.get_world_size(),
                       "rng_device": _rng_device(), "has_reference": reference is not None,
                       "reference_from": reference_from if reference is not None else None}, f)
    dist.barrier()
    final = seal(store, step, tmp, meta={"step": step})
    return final if dist.get_rank() == 0 else None


def seal(store: CheckpointStore, step: int, tmp: Path, meta: Optional[dict] = None) -> Path:
    """Collective, once every rank's files are in `tmp`: rank 0 lists them and shares the hashing out
    (CheckpointStore.plan), each rank hashes and fsyncs its share, rank 0 writes the gathered digests into the
    manifest and renames the checkpoint into place. Every rank returns the final path, or raises rank 0's
    CheckpointError. `store.hash_s` / `hash_cpu_s` / `hash_bytes`: this rank's hashing time and bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shares = None
    if rank == 0:
        try:
            shares = store.plan(tmp, world)
        except OSError as e:
            shares = CheckpointError(f"checkpoint {step} not sealed: listing {tmp}: {e}")
    shares = comm.broadcast_object(shares)
    if isinstance(shares, CheckpointError):
        raise shares
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        digests = hash_share(tmp, shares[rank])
    except OSError as e:  # reported by rank 0 to every rank, not left waiting in the gather
        digests = f"rank {rank}: {e}"
    store.hash_s, store.hash_cpu_s = time.perf_counter() - start, time.thread_time() - cpu
    store.hash_bytes = sum(n for _, _, n in shares[rank])
    gathered = comm.gather_objects(digests)
    result = None
    if rank == 0:
        failed = [g for g in gathered if isinstance(g, str)]
        try:
            if failed:
                raise CheckpointError("; ".join(failed))
            result = str(store.seal(step, tmp, meta, digests=merge_digests(gathered)))
        except (CheckpointError, OSError) as e:
            result = CheckpointError(f"checkpoint {step} not sealed: {e}")
    result = comm.broadcast_object(result)
    if isinstance(result, CheckpointError):
        raise result
    return Path(result)


def verify(store: CheckpointStore, path: Path) -> dict:
    """Collective: each rank checks its share of checkpoint `path` (the same sharing out as when it was
    sealed), the problems are gathered on every rank. Returns the manifest, or raises the same
    CheckpointError (naming the first bad file) on every rank."""
    start = time.perf_counter()
    mine = store.check_share(path, dist.get_rank(), dist.get_world_size())
    store.verify_s = time.perf_counter() - start
    problems = [p for part in comm.all_gather_objects(mine) for p in part]
    return store.conclude(path, problems)


NOT_ARCHITECTURE = ("name", "max_position_embeddings", "moe_aux_loss_coeff", "moe_z_loss_coeff")
"""ModelConfig fields a resumed run may change: the YAML's name, the longest sequence (RoPE is computed per
position), the MoE loss coefficients (training settings). Every other field decides shapes or numerics."""


def check_model(path: Path, model_cfg) -> None:
    """A CheckpointError naming every architecture field (ModelConfig, less NOT_ARCHITECTURE) in which this run's
    model differs from the one checkpoint `path` was trained with (model/grpo_mega.json): a model YAML edited in
    place (rope_theta, norm_epsilon) would otherwise resume silently, another model with megatron's shape traceback.
    A checkpoint without the file (an older grpo-mega) is not checked."""
    import dataclasses

    from grpo_mega.models.convert import META_FILE

    meta = path / "model" / META_FILE
    if not meta.is_file():
        return
    saved = json.loads(meta.read_text()).get("model") or {}
    now = dataclasses.asdict(model_cfg)
    diffs = [f"{k} {saved.get(k)!r} (this run: {now.get(k)!r})" for k in sorted(set(saved) | set(now))
             if k not in NOT_ARCHITECTURE and saved.get(k) != now.get(k)]
    if diffs:
        raise CheckpointError(f"{path} was trained with another model ({saved.get('name')!r}): " + ", ".join(diffs)
                              + f"; resume with the model it was trained with (its fields are in {meta}), or start a "
                              "new run in another checkpoint.dir")


def load(path: Path, actor, reference, base_model: Optional[dict] = None) -> dict:
    """Load a verified checkpoint into this layout; returns the loop state, with "path": the checkpoint's
    directory (for the task's own files). Under LoRA only the adapters and their optimizer state are read
    (`base_model`: this run's base_model_identity, checked against the checkpoint's). RNG states are restored when the world size and the device kind
    match the saving run's (at another layout the streams cannot correspond; a GPU's generator states do not
    fit the CPU's): a checkpoint moves between GPU and CPU."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    check_model(path, actor.model_cfg)
    with open(path / "loop_state.json") as f:
        state = json.load(f)
    check_lora(path, state, actor, base_model)
    lora = _lora(actor) is not None
    rollout = state.get("rollout")
    if rollout is not None and rollout.get("routed_experts") is not None:
        rollout["routed_experts"] = load_routes(path, rollout["routed_experts"])
    if reference is not None and not lora and not state.get("has_reference", True):
        kl = (state.get("config") or {}).get("algo", {}).get("kl_coef")
        raise CheckpointError(
            f"{path} was saved without a reference model (algo.kl_coef={kl}), and this run needs one for its KL "
            "term: the reference is the initial policy, which the checkpoint no longer holds. Resume with "
            "algo.kl_coef=0 (and kl_in_reward=false), or start a new run")
    source = state.get("reference_from")  # not written: the model path's weights, which this run has loaded
    if reference is not None and not lora and source is not None and not same_base(source, base_model):
        raise CheckpointError(
            f"{path} holds no reference model: its reference is the initial policy, the weights of "
            f"{describe_base(source)}, and this run's model is {describe_base(base_model)}: resume with the model "
            "the run started from (model=...), or start a new run in another checkpoint.dir")
    _patch_distrib_optimizer_load()
    prime_optimizer(actor)
    read = reference if source is None else None
    loaded = dist_checkpointing.load(_sharded(actor, read, loading=True), str(path / "model"))
    if lora:  # the adapters; the base weights are the model path's, already loaded
        with torch.no_grad():
            for key, t in loaded["actor"].items():
                actor.built.gpt.get_parameter(key).copy_(t)
    else:
        actor.built.gpt.load_state_dict(loaded["actor"])
    actor.optimizer.load_state_dict(fit_optimizer_chain(loaded["optimizer"], actor.optimizer))
    # The param groups come back with the saving run's max_lr/min_lr, which the scheduler reads per group:
    # this run's optim.lr/min_lr must win (the loop reports the change), as for the scheduler itself.
    for group in actor.optimizer.param_groups:
        group["max_lr"], group["min_lr"] = actor.optim.lr, actor.optim.min_lr
    _unshare_steps(actor)
    actor.optimizer.reload_model_params()
    if read is not None and not lora:
        reference.built.gpt.load_state_dict({k[len("reference."):] if k.startswith("reference.") else k: v
                                             for k, v in loaded["reference"].items()})
    actor.scheduler.load_state_dict(state["scheduler"])
    rng = path / "rng" / f"rank_{dist.get_rank():05d}.safetensors"
    same_device = state.get("rng_device", "cpu") == _rng_device()
    if state["world_size"] == dist.get_world_size() and same_device and rng.is_file():
        _set_rng_state(load_file(str(rng)))
    return {**state, "path": str(path)}


def config_changes(saved: Optional[dict], now: Optional[dict], prefix: str = "") -> list[str]:
    """'key: old -> new' for every setting that differs between a checkpoint's config and this run's (a
    resumed run may change settings on purpose; it should never do so unnoticed)."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return [] if saved == now or saved is None or now is None else [f"{prefix.rstrip('.')}: {saved!r} -> {now!r}"]
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def open_for_run(ckpt, actor, reference, resolved_config: Optional[dict] = None,
                 base_model: Optional[dict] = None) -> tuple[CheckpointStore, Optional[dict]]:
    """Collective, at the start of a run with checkpoint.dir: take the directory's lock, pick the checkpoint
    to resume from (checkpoint.resume), clean up interrupted writes, load it. Returns the store and the
    loop state of the checkpoint loaded (None: a fresh start). `base_model`: see `load`."""
    store = CheckpointStore(ckpt.dir, ckpt.keep_last)
    error = None
    if dist.get_rank() == 0:  # one run per checkpoint directory; decided on rank 0, for all
        try:
            store.acquire(stale_after_s=ckpt.lock_stale_s)
            atexit.register(store.release)  # also when the run fails; a SIGKILLed holder is seen as dead
        except CheckpointError as e:
            error = str(e)
        if getattr(store, "taken_over", None):
            print(f"took over the checkpoint directory's lock ({store.taken_over})", flush=True)
    error = comm.broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    found = None
    check = lambda path: verify(store, path)  # noqa: E731  (every rank checks its share)
    if ckpt.resume == "auto":
        found = store.latest(check, candidates=comm.broadcast_object(store.complete() if dist.get_rank() == 0 else None))
        if found is None and store.skipped:  # never silently start over from step 0
            raise CheckpointError(
                f"checkpoint.resume=auto: no checkpoint in {ckpt.dir} verifies:\n  " + "\n  ".join(store.skipped)
                + "\nmove the broken ones aside to resume from an earlier one, or set checkpoint.resume=never "
                "to start over")
    elif ckpt.resume != "never":
        found = store.verified(ckpt.resume, check)
        newer = [s for s, _ in store.complete() if s > found[0]]
        if newer:
            raise CheckpointError(
                f"checkpoint.resume={ckpt.resume}: {ckpt.dir} already holds later checkpoints (steps {newer}) that "
                "this run would overwrite; resume into another checkpoint.dir")
    if dist.get_rank() == 0:
        for reason in getattr(store, "skipped", []):
            print(f"checkpoint skipped: {reason}", flush=True)
        for partial in store.remove_partials():
            print(f"removed an interrupted checkpoint write: {partial}", flush=True)
    dist.barrier()
    if found is None:
        return store, None
    state = load(found[1], actor, reference, base_model)
    if dist.get_rank() == 0:
        print(f"resumed from {found[1]} (step {state['step']}, weight version {state.get('weight_version')})",
              flush=True)
        for line in config_changes(state.get("config"), resolved_config):
            print(f"  changed since the checkpoint: {line}", flush=True)
    return store, state
