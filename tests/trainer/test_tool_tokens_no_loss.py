"""Tool-result positions carry no loss: with RolloutBatch.model_mask, perturbing the old logprobs at tool
positions leaves the update's loss and gradient norm unchanged; perturbing them at a model position does not."""

import pytest

from grpo_mega.parallel import cpu_compat
from grpo_mega.parallel.forked import run_ranks
from grpo_mega.parallel.state import destroy_distributed, init_distributed
from tests.trainer import layouts as L


def _update(perturb: str):
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=7)
        actor = L.tiny_actor(micro=8)
        batch = L.rollout(seed=3)
        mask = batch.response_mask()
        batch.model_mask = mask.clone().fill_(True)
        tool = []
        for i in range(batch.size):  # the middle of each response longer than 3 tokens: "tool" tokens
            pos = mask[i].nonzero().flatten().tolist()
            if len(pos) > 3:
                tool += [(i, p) for p in pos[1:-1]]
                for p in pos[1:-1]:
                    batch.model_mask[i, p] = False
        batch.old_logp = actor.logprobs(batch, 1.0)
        if perturb == "tool":
            for i, p in tool:
                batch.old_logp[i, p] -= 3.0
        elif perturb == "model":
            i = tool[0][0]
            batch.old_logp[i, mask[i].nonzero().flatten()[0]] -= 3.0
        m = actor.update(batch, 1.0)[0]
        destroy_distributed()
        return len(tool), m["loss"], m["grad_norm"]


def test_tool_positions_carry_no_loss():
    (n_tool, loss, gn), = run_ranks(_update, 1, "none", timeout=300)
    (_, loss_t, gn_t), = run_ranks(_update, 1, "tool", timeout=300)
    (_, loss_m, gn_m), = run_ranks(_update, 1, "model", timeout=300)
    assert n_tool > 0
    assert (loss_t, gn_t) == (loss, gn)
    assert loss_m != pytest.approx(loss, rel=1e-6) or gn_m != pytest.approx(gn, rel=1e-6)
