"""One GRPO update of a fresh random model made with transformers (dense Qwen3 and Qwen3-MoE, saved with
save_pretrained and loaded from that directory as `model=DIR` loads it) on fixed samples, held against torch
autograd through transformers' own model on the same samples and the same token-mean loss: every parameter's
gradient by HF name, and the reported grad_norm, at one process, TP2 and EP2 (issue 42).

The gradient is read back through the optimizer (SGD: W0 - W1 = lr g, as tests/trainer/layouts.py reads it), W0
being the HF file's own tensors. The reference runs transformers' model in float64.

Issue 42's gap (grad_norm in the thousands where "a plain transformers computation" gave 2.3-3.5) is the pad
token's embedding row. transformers builds `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`: its init
zeroes that row and its backward drops that row's gradient. The issue's model had pad_token_id=2, SmolLM2's
<|im_end|>, which every chat-templated prompt holds; megatron's embedding has no such exception, so the trainer
computes that row's true gradient, which passes RMSNorm at a zero input (derivative w / sqrt(eps) = 1000 w)
and is thousands of times the rest. `test_issue_42_the_gap_is_the_pad_row` pins it on such a model.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from grpo_mega.models.hf_io import zero_pad_row
from grpo_mega.parallel.forked import run_ranks
from tests.models.hf_fixtures import fresh_hf
from tests.trainer import layouts as L

# fp32 trainer against a float64 reference, each relative to the norm of what is compared (the whole gradient,
# one tensor, the reported norm); measured: 1.5e-6 at worst (a tensor), 9e-7 (the whole gradient), 1e-6 (the
# norm): fp32 accumulation over ~100 tokens, far from 1e-5 whatever the CPU's kernels. A tensor also gets the
# readback's own rounding: W1 = fl32(W0 - lr g) is within ulp(|W1|) / 2 per element, lr = 1e4 making that
# ~6e-8 of lr g wherever lr |g| >> |W0|.
REL_TOL = 1e-5
LR = 1e4
PAD = 2  # the EOS and <|im_end|> of SmolLM2's tokenizer
N = 4  # responses per prompt
# 2 prompts shaped like a chat template's (<|im_start|>=1 ... <|im_end|>=2 ... newline=198), 4 responses each:
# full-length ones (10 tokens: cut at max_response_length) and shorter ones that end with the EOS
PROMPTS = [[1, 57, 198, 803, 12, PAD, 198, 1, 412, 198], [1, 9, PAD, 198, 1, 77, 301, 198]]
RESPONSE_LENS = [10, 4, 7, 1, 6, 10, 3, 9]
REWARDS = [0.3, 0.9, 0.1, 0.55, 1.0, 0.0, 0.0, 0.25]
ALGO = dict(kl_coef=0.0, entropy_coef=0.0, dual_clip=None)  # the issue's: token-mean, clip 0.2 / 0.28, no KL
SEEDS = {"qwen3": 0, "qwen3_moe": 2}  # qwen3_moe's: every expert of both layers gets tokens of these samples
LAYOUTS = {  # (family, name): (tp, ep, sequence_parallel); megatron's MoE layer needs SP with TP
    ("qwen3", "1 rank"): (1, 1, False),
    ("qwen3", "TP2"): (2, 1, False),
    ("qwen3_moe", "1 rank"): (1, 1, False),
    ("qwen3_moe", "EP2"): (1, 2, False),
    ("qwen3_moe", "TP2-SP"): (2, 1, True),
}


def samples() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(42)
    prompts = [PROMPTS[i // N] for i in range(len(RESPONSE_LENS))]
    responses = []
    for n in RESPONSE_LENS:
        r = torch.randint(3, 1000, (n,), generator=g).tolist()
        if n < L.MAX_RESPONSE:
            r[-1] = PAD  # stopped at the EOS
        responses.append(r)
    return prompts, responses


def advantages_f64(rewards: list[float]) -> list[float]:
    """GRPO's group advantages, written out here: (r - group mean) / (group sample std + 1e-6)."""
    out = []
    for g in range(0, len(rewards), N):
        r = rewards[g:g + N]
        mean = sum(r) / N
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (N - 1))
        out += [(x - mean) / (std + 1e-6) for x in r]
    return out


# ---- the trainer, on forked gloo ranks -----------------------------------------------------------------------

def _trainer_step(hf_dir: str, tp: int, ep: int, sp: bool, out_dir: str):
    """The loop's update on the fixed samples: advantages from the loop's shaping, the exactly on-policy step
    (no separate old-logprob pass, as cfg.skips_old_logprob_pass runs it), SGD with lr LR. Returns (metrics, W1 at TP1 on one
    rank; None elsewhere: W1 saved with dist_checkpointing into out_dir)."""
    from megatron.core import dist_checkpointing

    from grpo_mega.algo.shaping import StepShaping, shape_step
    from grpo_mega.conf import OptimConfig, ParallelConfig
    from grpo_mega.models.hf_io import load_hf_into_gpt, read_hf_config
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.batch import RolloutBatch

    with cpu_compat.cpu_device_mode():
        layout = init_distributed(tp=tp, pp=1, ep=ep, seed=1234)
        _, _, cfg = read_hf_config(hf_dir)
        kw = L.configs("token-mean", 4, "sgd", algo_kw=ALGO)
        kw["optim"] = OptimConfig(**{**L.OPTIMS["sgd"], "lr": LR})
        actor = Actor(cfg, ParallelConfig(tp=tp, ep=ep, sequence_parallel=sp), **kw)
        load_hf_into_gpt(actor.built.gpt, hf_dir, cfg, layout.tp_rank, tp)
        actor.optimizer.reload_model_params()
        prompts, responses = samples()
        batch = RolloutBatch.from_samples(prompts, responses)
        overlong = torch.tensor([len(r) == L.MAX_RESPONSE for r in responses])
        shaped = shape_step(StepShaping(n=N), torch.tensor(REWARDS), overlong)
        batch.advantages, batch.in_loss = shaped.advantages, shaped.in_loss
        (m,) = actor.update(batch, L.TEMPERATURE)
        w1 = L.full_state(actor.built.gpt) if tp * ep == 1 else None
        if w1 is None:
            os.makedirs(out_dir, exist_ok=True)
            dist_checkpointing.save(actor.built.gpt.sharded_state_dict(), out_dir)
        destroy_distributed()
        return m, w1


def trainer_gradient(hf_dir, tp: int, ep: int, sp: bool, out_dir: str) -> tuple[list[dict], dict, dict, dict]:
    """(each rank's metrics, the gradient (W0 - W1) / LR by HF name, the readback's rounding bound (a norm),
    megatron's padded vocabulary rows of W1)."""
    from safetensors.torch import load_file

    from grpo_mega.models import bridge
    from grpo_mega.models.hf_io import read_hf_config

    _, _, cfg = read_hf_config(str(hf_dir))
    ranks = run_ranks(_trainer_step, tp * ep, str(hf_dir), tp, ep, sp, out_dir, timeout=300)
    state = ranks[0][1]
    if state is None:  # written at the layout: loaded at TP1
        state = run_ranks(L.load_many, 1, [out_dir], cfg=cfg, timeout=300)[0][out_dir]
    w1 = {h: t for name, full in state.items() for h, t in bridge.to_hf(name, full, cfg)}
    w0 = {k: v.double() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    grad = {k: (w0[k] - w1[k]) / LR for k in w1}
    slack = {}
    for k, t in w1.items():
        a = t.abs().float()
        slack[k] = float((torch.nextafter(a, torch.tensor(math.inf)) - a).double().norm()) / 2 / LR
    padding = {k: state[k][cfg.vocab_size:] for k in ("embedding.word_embeddings.weight", "output_layer.weight")}
    return [r[0] for r in ranks], grad, slack, padding


# ---- the reference: transformers, float64 ------------------------------------------------------------------

def reference_gradient(hf_dir, tmp, pad_row_trained: bool = False) -> tuple[dict, float]:
    """(the gradient by HF on-disk name, the smallest router top-k margin over the samples' tokens (inf for a
    dense model)) of the token-mean GRPO loss, -sum_i,t min(r A_i, clip(r, 1 - 0.2, 1 + 0.28) A_i) / (response
    tokens), r = pi / sg(pi) (the on-policy step), through transformers' model in float64 at the trainer's
    temperature. `pad_row_trained` clears the embedding's padding_idx: the loss's gradient in every parameter."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").double()
    if pad_row_trained:
        model.model.embed_tokens.padding_idx = None
    margins = []

    def router_margin(module, args):  # per token, its k-th router logit minus the next one
        top = torch.nn.functional.linear(args[0], module.weight).detach().topk(module.top_k + 1, dim=-1).values
        margins.append(top[..., -2] - top[..., -1])

    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_pre_hook(router_margin)
    prompts, responses = samples()
    seqs = [p + r for p, r in zip(prompts, responses)]
    tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # right-padded: causal, no mask needed
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
    logits = model(tokens).logits / L.TEMPERATURE
    adv = advantages_f64(REWARDS)
    loss = torch.zeros((), dtype=torch.float64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        logp = torch.log_softmax(logits[i, len(p) - 1:len(p) - 1 + len(r)], -1).gather(-1, torch.tensor(r)[:, None])
        ratio = torch.exp(logp - logp.detach())
        loss = loss + torch.maximum(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - 0.2, 1 + 0.28)).sum()
    (loss / sum(map(len, responses))).backward()
    real = torch.arange(tokens.shape[1]) < torch.tensor(list(map(len, seqs)))[:, None]  # not the padding
    margin = min((float(m.reshape(real.shape)[real].min()) for m in margins), default=math.inf)
    # transformers' own save maps its in-memory names (Qwen3-MoE's fused experts) to the files' per-expert ones
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(tmp, safe_serialization=True)
    return load_file(os.path.join(tmp, "model.safetensors")), margin


def _norm(grad: dict) -> float:
    return math.sqrt(sum(float(v.double().norm()) ** 2 for v in grad.values()))


def _rows(grad: dict, pad: bool) -> dict:
    """The embedding gradient as its own tensor per row group: the pad row (`pad`) and every other row."""
    out = {k: v for k, v in grad.items() if k != "model.embed_tokens.weight"}
    emb = grad["model.embed_tokens.weight"]
    keep = torch.arange(emb.shape[0]) != PAD
    out["model.embed_tokens.weight (rows but the pad's)"] = emb[keep]
    if pad:
        out["model.embed_tokens.weight (the pad row)"] = emb[PAD]
    return out


def check(label: str, metrics: list[dict], grad: dict, slack: dict, padding: dict, ref: dict) -> None:
    """The trainer's gradient against the reference: whole, per tensor (the embedding's other rows apart from a
    pad row's, which would hide them), the padded vocabulary untouched, the reported norm that of the gradient."""
    assert sorted(grad) == sorted(ref), "the trainer's parameters are not transformers' (bridge names)"
    ref_norm, diff = _norm(ref), {k: grad[k] - ref[k].double() for k in ref}
    err = _norm(diff) / ref_norm
    emb_slack = slack.pop("model.embed_tokens.weight")
    slack.update({k: emb_slack for k in _rows(ref, True) if k.startswith("model.embed_tokens")})
    rel = {k: float(d.norm()) / float(_rows(ref, True)[k].norm()) for k, d in _rows(diff, True).items()}
    worst = max(rel, key=rel.get)
    print(f"{label}: grad_norm {metrics[0]['grad_norm']:.6f}, autograd through transformers {ref_norm:.6f}; "
          f"whole-gradient error {err:.1e}; worst tensor {worst} {rel[worst]:.1e}")
    assert err <= REL_TOL, f"{label}: gradient relative error {err:.2e}"
    for k, r in _rows(ref, True).items():
        e = float(_rows(diff, True)[k].norm())
        assert e <= REL_TOL * float(r.norm()) + slack[k], f"{label}: {k}: error {e:.2e}, gradient norm {float(r.norm()):.2e}"
    for k, rows in padding.items():  # megatron's padded vocabulary rows: untouched (they would count in grad_norm)
        assert not rows.any(), f"{k}: padded vocabulary rows moved"
    for m in metrics:  # every rank reports the same norm: that of the gradient it applied
        assert m["skipped"] == 0.0
        assert abs(m["grad_norm"] - ref_norm) <= REL_TOL * ref_norm, (m["grad_norm"], ref_norm)
        assert abs(m["grad_norm"] - _norm(grad)) <= REL_TOL * ref_norm, (m["grad_norm"], _norm(grad))


def _model(tmp_path_factory, family: str, pad_token_id=None):
    """(HF directory, reference gradient); the fixture checked to test every parameter (each has a gradient:
    every expert is routed some token) and to route clear of fp32 rounding (router logits agree to ~1e-6)."""
    hf_dir = fresh_hf(tmp_path_factory.mktemp("hf") / family, family, seed=SEEDS[family], pad_token_id=pad_token_id)
    ref, margin = reference_gradient(hf_dir, str(tmp_path_factory.mktemp("ref")), pad_row_trained=True)
    assert all(v.any() for v in _rows(ref, pad_token_id is None).values()), [k for k, v in ref.items() if not v.any()]
    assert margin > 1e-4, f"{family}: a router top-k margin of {margin:.1e}; choose another seed"
    return hf_dir, ref


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per family: a fresh model without a pad token (no zeroed row), its reference gradient."""
    out = {family: _model(tmp_path_factory, family) for family in ("qwen3", "qwen3_moe")}
    assert all(zero_pad_row(str(d)) is None for d, _ in out.values())
    return out


@pytest.mark.parametrize("family,name", list(LAYOUTS), ids=[f"{f}-{n.replace(' ', '')}" for f, n in LAYOUTS])
def test_trainer_gradient_is_autograd_through_transformers(models, tmp_path, family, name):
    tp, ep, sp = LAYOUTS[(family, name)]
    hf_dir, ref = models[family]
    check(f"{family} {name}", *trainer_gradient(hf_dir, tp, ep, sp, str(tmp_path / "w1")), ref)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_issue_42_the_gap_is_the_pad_row(tmp_path_factory, tmp_path, family):
    """Issue 42's model (pad_token_id=2, its row zeroed by transformers' init) and numbers, named: the trainer's
    gradient is the loss's in every parameter (transformers' autograd with padding_idx cleared), its grad_norm
    that gradient's; transformers' own backward differs from it in the pad row alone, which it drops, and which
    is almost all of the trainer's grad_norm."""
    from safetensors.torch import load_file

    hf_dir, ref = _model(tmp_path_factory, family, pad_token_id=PAD)
    emb = load_file(str(hf_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert not emb[PAD].any() and emb[PAD + 1].any()  # transformers' init zeroed the pad row alone
    assert zero_pad_row(str(hf_dir)) == PAD  # what the run's start-up note names
    metrics, grad, slack, padding = trainer_gradient(hf_dir, 1, 1, False, str(tmp_path / "w1"))
    check(f"{family}, pad_token_id={PAD}", metrics, grad, slack, padding, ref)
    hf_own, _ = reference_gradient(hf_dir, str(tmp_path / "own"))
    assert not hf_own["model.embed_tokens.weight"][PAD].any()  # the padding_idx row: no gradient
    ours, theirs = _rows(grad, False), _rows(hf_own, False)
    err = _norm({k: ours[k] - theirs[k].double() for k in ours}) / _norm(theirs)
    pad_row = float(grad["model.embed_tokens.weight"][PAD].norm())
    print(f"{family}, pad_token_id={PAD}: grad_norm {metrics[0]['grad_norm']:.5g}, of it the pad row {pad_row:.5g}; "
          f"transformers' own backward {_norm(hf_own):.5g}, the rest of the trainer's {_norm(ours):.5g} "
          f"(relative difference {err:.1e})")
    assert err <= REL_TOL
    assert pad_row > 100 * _norm(hf_own)
