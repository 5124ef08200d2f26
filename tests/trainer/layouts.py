"""Shared by the trainer tests: a tiny fp32 actor on forked gloo ranks, one GRPO update per (mode, micro-batch
size) from the same initial weights, its result saved with dist_checkpointing; and the single-process
reference. Functions here run inside forked ranks (grpo_mega.parallel.forked)."""

from __future__ import annotations

import os

import torch

from grpo_mega import algo
from grpo_mega.conf import AlgoConfig, BatchConfig, OptimConfig, ParallelConfig, PrecisionConfig, load_model_config
from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from grpo_mega.trainer.actor import Actor
from grpo_mega.trainer.batch import RolloutBatch

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
MICRO = [1, 2, 4]
TEMPERATURE = 0.8
MAX_RESPONSE = 10


MAX_PROMPT = 12  # with MAX_RESPONSE: packed token budgets of micro_batch_size * 22 (22, 44, 88)


def model_cfg(tied: bool = False, variant: str = "tiny"):
    """The tiny model (Qwen2 family: q/k/v biases); variant 'llama3-rope': the Llama family (no biases) with
    Llama-3.1's RoPE frequency scaling; 'tiny-qwen3-moe': that model without its load-balancing loss."""
    from grpo_mega.conf.model import RopeScaling

    cfg = load_model_config("tiny")
    cfg.tie_word_embeddings = tied
    if variant == "llama3-rope":
        cfg.family, cfg.qkv_bias, cfg.rope_scaling = "llama", False, RopeScaling(factor=8.0)
    elif variant == "tiny-qwen3-moe":
        # without the load-balancing loss: it is computed over each rank's tokens (padding included), so
        # it is not invariant to the DP split, while the policy loss's gradient must be
        cfg = load_model_config(variant)
        cfg.moe_aux_loss_coeff = 0.0
    elif variant == "tiny-qwen3-moe-aux":  # with it, ten times the model's coefficient (1e-2: measurable at 1e-5)
        cfg = load_model_config("tiny-qwen3-moe")
        cfg.moe_aux_loss_coeff = 0.01
    elif variant != "tiny":
        raise ValueError(variant)
    return cfg


# The optimizer step is used to read the gradient back after resharding: W0 - W1 = g.
#  - "adam": Megatron's DistributedOptimizer (reduce-scattered grads), Adam with lr = eps = 1e8. Its first
#    step is lr * m_hat / (sqrt(v_hat) + eps) = g * 1e8 / (|g| + 1e8): g itself to a relative 1e-8, linear in
#    g (an ordinary Adam step would be blind to a constant factor on g, and prove nothing about scaling).
#  - "sgd": the non-distributed optimizer (all-reduced grads), SGD with lr = 1.
OPTIMS = {
    "adam": dict(optimizer="adam", lr=1e8, adam_eps=1e8, weight_decay=0.0, clip_grad=1e9, use_distributed_optimizer=True),
    "sgd": dict(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=1e9, use_distributed_optimizer=False),
}


def configs(mode: str, mbs: int, optim: str = "adam", batch_kw: dict | None = None, algo_kw: dict | None = None):
    """With packing (the default), micro-batches are packed rows of mbs * (MAX_PROMPT + MAX_RESPONSE) tokens;
    `batch_kw` overrides BatchConfig fields (e.g. packing=False), `algo_kw` AlgoConfig fields (e.g. policy_loss)."""
    algo = dict(loss_agg_mode=mode, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01, clip_ratio_low=0.2,
                clip_ratio_high=0.28, dual_clip=3.0)
    return dict(
        precision=PrecisionConfig(params_dtype="fp32"),
        optim=OptimConfig(**OPTIMS[optim]),
        algo_cfg=AlgoConfig(**{**algo, **(algo_kw or {})}),
        batch=BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=mbs,
                          max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE, **(batch_kw or {})),
    )


# Response lengths of `rollout(lengths="packing")`: with prompts of MAX_PROMPT and 4 tokens, sequence lengths
# 22 (fills a 22-token budget alone), 14, 15, 13 | 6, 9, 5, 7; a 44-token budget packs 4 of them into one row.
PACKING_LENGTHS = ((MAX_PROMPT, [MAX_RESPONSE, 2, 3, 1]), (4, [2, 5, 1, 3]))


def tiny_actor(train: int = 2, mini: int = 2, micro: int = 2, optim: OptimConfig | None = None,
               algo_cfg: AlgoConfig | None = None) -> Actor:
    """The tiny model's Actor in fp32 on one process (init_distributed(tp=1, pp=1) first), responses of up to 10
    tokens, `train` rows per step in mini-batches of `mini`, micro-batches of `micro` (the one-process tests);
    OptimConfig(lr=1e-3) and AlgoConfig(kl_coef=0.0) unless given."""
    batch_cfg = BatchConfig(train_batch_size=train, ppo_mini_batch_size=mini, micro_batch_size=micro,
                            max_response_length=10)
    return Actor(load_model_config("tiny"), ParallelConfig(), PrecisionConfig(params_dtype="fp32"),
                 optim or OptimConfig(lr=1e-3), algo_cfg or AlgoConfig(kl_coef=0.0), batch_cfg)


def rollout(seed: int = 0, vocab: int | None = None, lengths: str = "random") -> RolloutBatch:
    """8 responses (2 prompts x 4) with random tokens and rewards; random lengths, PACKING_LENGTHS, or all full."""
    g = torch.Generator().manual_seed(seed)
    vocab = vocab or model_cfg().vocab_size
    prompts, responses = [], []
    for i in range(8):
        if lengths == "packing":
            p, r = PACKING_LENGTHS[i // 4][0], PACKING_LENGTHS[i // 4][1][i % 4]
        elif lengths == "full":  # every sequence MAX_PROMPT + MAX_RESPONSE long: no row is ever padded
            p, r = MAX_PROMPT, MAX_RESPONSE
        else:
            p = int(torch.randint(3, 9, (1,), generator=g)) if i % 4 == 0 else len(prompts[-1])
            r = int(torch.randint(1, MAX_RESPONSE + 1, (1,), generator=g))
        prompt = prompts[-1] if i % 4 else torch.randint(0, vocab, (p,), generator=g).tolist()
        prompts.append(prompt)
        responses.append(torch.randint(0, vocab, (r,), generator=g).tolist())
    batch = RolloutBatch.from_samples(prompts, responses)
    rewards = torch.randint(0, 3, (8,), generator=g).float()
    batch.advantages = algo.group_advantages(rewards, n=4).float()
    return batch


def perturbed(logp: torch.Tensor, mask: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed)) * scale
    return (logp + noise) * mask


def _load(actor: Actor, ckpt: str | dict) -> dict:
    """Load W0 into the actor: from the checkpoint `ckpt` (dist_checkpointing, at the actor's layout), or from the
    local state that an earlier load at the same layout returned. Returns that local state."""
    from megatron.core import dist_checkpointing

    gpt = actor.built.gpt
    if isinstance(ckpt, str):  # loaded copies, not the parameters themselves: the update must not change them
        ckpt = {k: v.detach().clone() if torch.is_tensor(v) else v
                for k, v in dist_checkpointing.load(gpt.sharded_state_dict(), ckpt).items()}
    gpt.load_state_dict(ckpt)
    actor.optimizer.reload_model_params()
    return ckpt


def combo_key(combo) -> str:
    """The prefix of a (mode, micro-batch size) update's weights in a layout's checkpoint."""
    return f"{combo[0]}_{combo[1]}."


def full_state(gpt) -> dict:
    return {k: v.detach().double().clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v) and "_extra_state" not in k}


def run_layout(tp, pp, sp, w0_dir, out_dir, inputs, tied=False, combos=None, optim="adam", parallel_kw=None,
               spec=None):
    """On every rank of a tp x pp x dp layout: for each (mode, mbs), a new Actor, W0, one update; then every
    update's W1 saved with dist_checkpointing in one checkpoint at `out_dir`, under combo_key(combo) (read back
    with `load_combos`). W0 is read from `w0_dir` at the layout once; the later Actors take that local state.
    Returns (logprobs of W0, {combo: metrics}); with spec["ref"], also the logprobs of W0 loaded into a
    Reference: (logprobs, metrics, reference logprobs). `spec`: batch_kw, algo_kw, variant, lengths (see
    `rollout`). `inputs`: (old_logp, ref_logp) or (old_logp, ref_logp, engine_logp)."""
    spec = spec or {}
    from megatron.core import dist_checkpointing

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=1234, ep=(parallel_kw or {}).get("ep", 1))
        combos = combos or [(m, b) for m in MODES for b in MICRO]
        parallel = ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp, **(parallel_kw or {}))
        results, first_logp, w0, updated = {}, None, w0_dir, {}
        cfg = model_cfg(tied, spec.get("variant", "tiny"))
        for mode, mbs in combos:
            kw = configs(mode, mbs, optim, spec.get("batch_kw"), spec.get("algo_kw"))
            actor = Actor(cfg, parallel, **kw)
            w0 = _load(actor, w0)
            batch = rollout(lengths=spec.get("lengths", "random"))
            if first_logp is None:
                first_logp = actor.logprobs(batch, TEMPERATURE)
                if spec.get("ref"):
                    ref_logp = _reference_logprobs(cfg, parallel, kw, w0_dir, batch)
            batch.old_logp, batch.ref_logp = inputs[:2]
            batch.engine_logp = inputs[2] if len(inputs) > 2 else None
            (m,) = actor.update(batch, TEMPERATURE)
            updated.update(actor.built.gpt.sharded_state_dict(prefix=combo_key((mode, mbs))))
            results[(mode, mbs)] = m
        os.makedirs(out_dir, exist_ok=True)
        dist_checkpointing.save(updated, out_dir)
        destroy_distributed()
        return (first_logp, results, ref_logp) if spec.get("ref") else (first_logp, results)


def _reference_logprobs(cfg, parallel, kw, w0_dir, batch):
    from megatron.core import dist_checkpointing

    from grpo_mega.trainer.reference import Reference

    ref = Reference(cfg, parallel, kw["precision"], kw["batch"])
    ref.built.gpt.load_state_dict(dist_checkpointing.load(ref.built.gpt.sharded_state_dict(), w0_dir))
    return ref.logprobs(batch, TEMPERATURE)


def make_reference(w0_dir, tied=False, combos=None, optim="adam", spec=None):
    """Single process: initial weights W0 (saved), logprobs, inputs, and per combo the metrics and the
    gradient W0 - W1. `spec` as for `run_layout` (e.g. batch_kw=dict(packing=False): the padded path; with
    spec["engine"], the inputs carry engine logprobs too)."""
    from megatron.core import dist_checkpointing

    spec = spec or {}
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=1234)
        combos = combos or [(m, b) for m in MODES for b in MICRO]
        cfg = model_cfg(tied, spec.get("variant", "tiny"))
        lengths = spec.get("lengths", "random")
        kw = configs(combos[0][0], 1, optim, spec.get("batch_kw"), spec.get("algo_kw"))
        actor = Actor(cfg, ParallelConfig(), **kw)
        os.makedirs(w0_dir, exist_ok=True)
        dist_checkpointing.save(actor.built.gpt.sharded_state_dict(), w0_dir)
        w0 = full_state(actor.built.gpt)
        batch = rollout(lengths=lengths)
        logp = actor.logprobs(batch, TEMPERATURE)
        mask = batch.response_mask()
        inputs = (perturbed(logp, mask, 0.3, 1), perturbed(logp, mask, 0.2, 2))
        if spec.get("engine"):
            inputs = inputs + (perturbed(inputs[0], mask, 0.25, 3),)
        out, w0_local = {}, w0_dir
        for mode, mbs in combos:
            actor = Actor(cfg, ParallelConfig(), **configs(mode, mbs, optim, spec.get("batch_kw"), spec.get("algo_kw")))
            w0_local = _load(actor, w0_local)
            b = rollout(lengths=lengths)
            b.old_logp, b.ref_logp = inputs[:2]
            b.engine_logp = inputs[2] if len(inputs) > 2 else None
            (m,) = actor.update(b, TEMPERATURE)
            w1 = full_state(actor.built.gpt)
            out[(mode, mbs)] = (m, {k: w0[k] - w1[k] for k in w0})
        destroy_distributed()
        return w0, logp, inputs, out


def load_many(dirs, tied=False, variant="tiny", cfg=None):
    """Load checkpoints written at any layout into one single-process TP1PP1 model; return their states.
    The model is `model_cfg(tied, variant)`, or `cfg` (a ModelConfig, e.g. an HF directory's) when given."""
    from megatron.core import dist_checkpointing

    from grpo_mega.models.builder import build_gpt

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=1234)
        gpt, _ = build_gpt(cfg or model_cfg(tied, variant), ParallelConfig(), PrecisionConfig(params_dtype="fp32"))
        out = {}
        for d in dirs:
            gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), d))
            out[d] = full_state(gpt)
        destroy_distributed()
        return out


def load_combos(out_dir, combos, tied=False, variant="tiny"):
    """The W1 of each combo in `run_layout`'s checkpoint at `out_dir`, loaded into one single-process TP1PP1 model
    (dist_checkpointing reshards from the layout): {combo: state}."""
    from megatron.core import dist_checkpointing

    from grpo_mega.models.builder import build_gpt

    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=1234)
        gpt, _ = build_gpt(model_cfg(tied, variant), ParallelConfig(), PrecisionConfig(params_dtype="fp32"))
        out = {}
        for combo in combos:
            key = combo_key(combo)
            loaded = dist_checkpointing.load(gpt.sharded_state_dict(prefix=key), out_dir)
            gpt.load_state_dict({k[len(key):]: v for k, v in loaded.items()})
            out[combo] = full_state(gpt)
        destroy_distributed()
        return out
