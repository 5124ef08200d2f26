"""Vocab-parallel logprob / entropy / full KL against torch.log_softmax on the gathered logits."""

import pytest
import torch
import torch.distributed as dist

from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprob,
    vocab_parallel_stats,
)

T, V = 13, 32  # padded vocabulary of 32 columns; at tp=4 a shard holds 8
FWD_TOL = 1e-5  # absolute, on fp32 outputs
GRAD_RTOL = 1e-5  # ||g - g_ref|| / ||g_ref||

# (name, input dtype, temperature, real vocabulary (< V: padded), chunk_size, reference needs grad)
CASES = [
    ("plain", torch.float32, 1.0, V, None, False),
    ("temperature", torch.float32, 0.7, V, None, True),
    ("padded", torch.float32, 1.3, V - 5, None, True),
    ("padded_empty_last_shard", torch.float32, 0.8, V - 11, None, False),  # tp=4: shard 3 is all padding
    ("chunked", torch.float32, 0.7, V - 5, 4, True),
    ("chunk_of_one", torch.float32, 1.0, V, 1, False),
    ("bf16", torch.bfloat16, 0.7, V - 5, None, False),
    ("bf16_chunked", torch.bfloat16, 0.6, V - 5, 3, True),
]


def _inputs(dtype, vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * 4).to(dtype)
    ref = (torch.randn(T, V, generator=g) * 4).to(dtype)
    target = torch.randint(0, vocab_size, (T,), generator=g)
    upstream = torch.randn(3, T, generator=g)
    return logits, ref, target, upstream


def _reference(logits, ref, target, upstream, temperature, vocab_size):
    """torch.log_softmax on the gathered, unpadded logits, in fp32 on the same input values."""
    z = logits.float().clone().requires_grad_(True)
    r = ref.float().clone().requires_grad_(True)
    lp_all = torch.log_softmax(z[:, :vocab_size] / temperature, dim=-1)
    lq_all = torch.log_softmax(r[:, :vocab_size] / temperature, dim=-1)
    logprob = lp_all.gather(1, target[:, None])[:, 0]
    entropy = -(lp_all.exp() * lp_all).sum(-1)
    kl = (lp_all.exp() * (lp_all - lq_all)).sum(-1)
    (upstream[0] * logprob + upstream[1] * entropy + upstream[2] * kl).sum().backward()
    return logprob.detach(), entropy.detach(), kl.detach(), z.grad, r.grad


def _run_cases(as_fp32=False):
    """On each rank: its shard of every case, forward and backward. as_fp32 feeds the same values as fp32."""
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    w = V // tp
    out = {}
    for name, dtype, temperature, vocab_size, chunk, ref_grad in CASES:
        logits, ref, target, up = _inputs(dtype, vocab_size)
        if as_fp32:
            logits, ref = logits.float(), ref.float()
        z = logits[:, rank * w : (rank + 1) * w].clone().requires_grad_(True)
        r = ref[:, rank * w : (rank + 1) * w].clone().requires_grad_(ref_grad)
        lp, ent, kl = vocab_parallel_stats(
            z, target, group, ref_logits=r, temperature=temperature, vocab_size=vocab_size, chunk_size=chunk
        )
        (up[0] * lp + up[1] * ent + up[2] * kl).sum().backward()
        out[name] = dict(lp=lp.detach(), ent=ent.detach(), kl=kl.detach(), gz=z.grad, gr=r.grad)
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_log_softmax_on_gathered_logits(tp):
    ranks = run_ranks(_run_cases, tp, timeout=120)
    fp32_ranks = run_ranks(_run_cases, tp, True, timeout=120)
    for name, dtype, temperature, vocab_size, chunk, ref_grad in CASES:
        logits, ref, target, up = _inputs(dtype, vocab_size)
        lp, ent, kl, gz_ref, gr_ref = _reference(logits, ref, target, up, temperature, vocab_size)
        for r in ranks:  # every TP rank holds the same per-token results
            for key, want in (("lp", lp), ("ent", ent), ("kl", kl)):
                assert r[name][key].dtype == torch.float32
                err = (r[name][key] - want).abs().max().item()
                assert err <= FWD_TOL, f"{name} {key} tp={tp}: max abs error {err:.2e}"
        gz = torch.cat([r[name]["gz"] for r in ranks], dim=1)
        assert gz.dtype == dtype and gz.shape == (T, V)
        assert torch.all(gz[:, vocab_size:] == 0), f"{name}: padded columns got a gradient"
        if dtype == torch.float32:
            assert _rel(gz, gz_ref) <= GRAD_RTOL, f"{name} tp={tp}: grad rel error {_rel(gz, gz_ref):.2e}"
        else:
            # bf16 input: the op's fp32 gradient (the same values fed as fp32) is within tolerance, and the
            # bf16 gradient it returns is exactly that gradient rounded to bf16.
            gz32 = torch.cat([r[name]["gz"] for r in fp32_ranks], dim=1)
            assert _rel(gz32, gz_ref) <= GRAD_RTOL, f"{name} tp={tp}: fp32 grad rel error {_rel(gz32, gz_ref):.2e}"
            assert torch.equal(gz, gz32.to(torch.bfloat16))
        if ref_grad:
            gr = torch.cat([r[name]["gr"] for r in ranks], dim=1)
            ref32 = torch.cat([r[name]["gr"] for r in fp32_ranks], dim=1)
            assert _rel(ref32, gr_ref) <= GRAD_RTOL, f"{name} tp={tp}: ref grad rel error {_rel(ref32, gr_ref):.2e}"
            assert torch.equal(gr, ref32.to(dtype))
        else:
            assert all(r[name]["gr"] is None for r in ranks)


def _donated():
    """On each rank, every case without a reference gradient twice: keeping the reference logits, and
    donating them (the gradient written into their memory)."""
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    w = V // tp
    out = {}
    for name, dtype, temperature, vocab_size, chunk, ref_grad in CASES:
        if ref_grad:
            continue
        logits, ref, target, up = _inputs(dtype, vocab_size)
        grads = []
        for donate in (False, True):
            z = logits[:, rank * w : (rank + 1) * w].clone().requires_grad_(True)
            r = ref[:, rank * w : (rank + 1) * w].clone()
            lp, ent, kl = vocab_parallel_stats(z, target, group, ref_logits=r, temperature=temperature,
                                               vocab_size=vocab_size, chunk_size=chunk, donate_ref_logits=donate)
            (up[0] * lp + up[1] * ent + up[2] * kl).sum().backward()
            grads.append((z.grad, z.grad.data_ptr() == r.data_ptr()))
        out[name] = grads
    return out


def test_donated_reference_logits_hold_the_same_gradient():
    for r in run_ranks(_donated, 2, timeout=120):
        assert r  # the cases without a reference gradient: plain, padded_empty_last_shard, chunk_of_one, bf16
        for name, ((kept, kept_shared), (donated, donated_shared)) in r.items():
            assert torch.equal(kept, donated), name  # bit for bit: the same math, in place
            assert not kept_shared and donated_shared, name  # no new [T, V/tp] tensor: the reference's memory
    z = torch.zeros(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="donate_ref_logits=True needs ref_logits without grad and of the logits' dtype"):
        vocab_parallel_kl(z, torch.zeros(4, 8, dtype=torch.bfloat16), donate_ref_logits=True)


def test_wrappers_and_leading_dims_single_process():
    logits, ref, target, _ = _inputs(torch.float32, V - 3)
    z = logits.view(T, 1, V)  # Megatron's [s, b, V/tp] layout
    lp = vocab_parallel_logprob(z, target.view(T, 1), vocab_size=V - 3, temperature=0.9)
    ent = vocab_parallel_entropy(z, vocab_size=V - 3, temperature=0.9)
    kl = vocab_parallel_kl(z, ref.view(T, 1, V), vocab_size=V - 3, temperature=0.9)
    want_lp, want_ent, want_kl, _, _ = _reference(logits, ref, target, torch.ones(3, T), 0.9, V - 3)
    assert lp.shape == ent.shape == kl.shape == (T, 1)
    torch.testing.assert_close(lp[:, 0], want_lp, rtol=0, atol=FWD_TOL)
    torch.testing.assert_close(ent[:, 0], want_ent, rtol=0, atol=FWD_TOL)
    torch.testing.assert_close(kl[:, 0], want_kl, rtol=0, atol=FWD_TOL)


def test_extreme_logits_stay_finite():
    z = torch.tensor([[1e4, -1e4, 0.0, 50.0], [-1e4, -1e4, -1e4, -1e4]], requires_grad=True)
    lp, ent, kl = vocab_parallel_stats(z, torch.tensor([1, 2]), ref_logits=z.detach() * 0.5)
    (lp.sum() + ent.sum() + kl.sum()).backward()
    for t in (lp, ent, kl, z.grad):
        assert torch.isfinite(t).all()
    ref = torch.log_softmax(z.detach(), -1)
    torch.testing.assert_close(lp, ref[[0, 1], [1, 2]], rtol=0, atol=FWD_TOL)


def test_bad_inputs_are_named():
    z = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"target ids must be in \[0, 6\) \(the real vocabulary\), got \[0, 7\]"):
        vocab_parallel_logprob(z, torch.tensor([0, 1, 2, 7]), vocab_size=6)
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        vocab_parallel_entropy(z, temperature=0.0)
    with pytest.raises(ValueError, match=r"ref_logits shape \(4, 7\) != logits shape \(4, 8\)"):
        vocab_parallel_kl(z, torch.zeros(4, 7))
