"""Multi-turn rollouts through in-process SGLang (the `sglang` tier): MultiTurnEngine around SGLangEngine with
the calculator, token in and token out. The ids trained on are, token for token, the ids SGLang sampled in each
turn followed by the tool turns' ids as the tokenizer's chat template renders them; each turn's request to SGLang
is exactly the prompt plus the trajectory so far; the model mask is 1 exactly on SGLang's tokens; SGLang's
logprobs sit on them and agree with transformers' own forward pass over the whole trajectory.

How the tool gets called by a random model, honestly: task=tens_tool's setting (grpo_mega.data.toy_tools). The
tokenizer has 28 tokens, one of them `<tool_call>`, which is a call stop token, and the bare parser makes a turn
ending in it a call of the run's only tool (the calculator, on the row's tools_kwargs expression). A random
near-uniform model samples `<tool_call>` about once in 28 tokens, so over 16 prompts x 4 samples x 24 tokens
many trajectories call the tool, some twice (3 model turns). Nothing in the test writes a model token.
The samples themselves are not reproducible run to run: SGLang honours per-request sampling seeds only with
enable_deterministic_inference, which it refuses with the CPU's torch_native attention backend; so the test
checks the trajectories against what SGLang answered in this run, not against a fixed expectation."""

import os
import sys

import pytest
import torch

from grpo_mega.data.toy_tools import TENS_TEMPLATE, TensDigitTask, make_tool_tokenizer

pytestmark = pytest.mark.sglang
LOGP_TOL = 1e-4  # fp32 SGLang (torch_native attention) against fp32 transformers, log-probabilities


class Recording:
    """The inner engine, recording each turn's requests and SGLang's answers."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        gen = self.engine.generate(prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed,
                                   prompt_offset, row_seeds=row_seeds)
        self.calls.append(([list(p) for p in prompts], gen))
        return gen


def _tiny_model(path, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.02, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def test_sglang_multi_turn_tokens_in_tokens_out(tmp_path):
    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        sys.modules.setdefault("flash_mla", None)
    from grpo_mega.rollout.multi_turn import MultiTurnEngine
    from grpo_mega.engines.sglang_engine import SGLangEngine
    from grpo_mega.toolcalls.pool import ToolPool

    tok = make_tool_tokenizer(TENS_TEMPLATE)
    hf = _tiny_model(tmp_path / "m", len(tok))
    task = TensDigitTask(tok, seed=5)
    prompts = [e.prompt_ids for e in task.train_batch(16)]
    call, eos = tok.convert_tokens_to_ids("<tool_call>"), tok.eos_token_id
    inner = Recording(SGLangEngine(str(tmp_path / "m"), dtype="float32", timeout_s=120))
    mt = MultiTurnEngine(inner, tok, ToolPool(["calculator"]), "bare", max_turns=3, stop_token_ids=[eos],
                         call_stop_ids=[call], row_tools_kwargs=task.tools_kwargs, async_tools=False)  # lockstep
    n, budget = 4, 24  # room for two calls and a third turn (with 16 a run had none about 1 time in 8, estimated)
    try:
        gen = mt.generate(prompts, n, 1.0, 1.0, budget, [eos], seed=11)
    finally:
        mt.shutdown()

    # Replay the generate from its recorded SGLang calls. Each call holds the unfinished samples in
    # order; each row's request must be the prompt plus that sample's trajectory so far, and the trajectory
    # must continue with SGLang's ids and then, after a call, the tool turn as the chat template renders it.
    calls = inner.calls
    stats = gen.extra["multi_turn"]
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    head = tok.apply_chat_template(base, tokenize=False)

    def tool_turn(i):  # the chat template's text after the assistant's content "x" (its turn end, then the tool
        # message: the calculator's answer), as ids: the call-stop token is the content's last token
        a, b = (int(x) for x in tok.decode(prompts[i // n], skip_special_tokens=True).rstrip("=").split("*"))
        full = tok.apply_chat_template(base + [{"role": "tool", "content": str(a * b // 10 % 10)}], tokenize=False)
        assert full.startswith(head)
        return tok.encode(full[head.rindex("x") + 1:], add_special_tokens=False)

    m = len(gen.token_ids)
    traj, mask, lps, turns, done = [[] for _ in range(m)], [[] for _ in range(m)], [[] for _ in range(m)], [0] * m, [False] * m
    for reqs, g in calls:
        active = [i for i in range(m) if not done[i]]
        assert len(reqs) == len(active)
        for r, i in enumerate(active):
            assert reqs[r] == prompts[i // n] + traj[i], f"sample {i}: SGLang was not continued from its ids"
            out, room = g.token_ids[r], budget - len(traj[i])
            assert out and all(0 <= t < len(tok) for t in out)
            traj[i] += out[:room]
            mask[i] += [1] * len(out[:room])
            lps[i] += g.logprobs[r][:room]
            turns[i] += 1
            if len(out) >= room or out[-1] != call or turns[i] == 3:
                done[i] = True
                continue
            seg = tool_turn(i)
            assert tok.convert_ids_to_tokens(seg)[:2] == ["<eos>", "<tool>"] and len(seg) == 3
            done[i] = len(seg) >= budget - len(traj[i])
            seg = seg[: budget - len(traj[i])]
            traj[i] += seg
            mask[i] += [0] * len(seg)
            lps[i] += [0.0] * len(seg)
    assert all(done)
    assert gen.token_ids == traj, "the trajectories are not SGLang's ids plus the rendered tool turns"
    assert gen.model_mask == mask and gen.logprobs == lps and stats["turns"] == turns
    assert all(lp < 0 for ls, ms in zip(gen.logprobs, gen.model_mask) for lp, k in zip(ls, ms) if k)
    two_calls = sum(c >= 2 for c in stats["tool_calls"])
    assert sum(stats["tool_calls"]) >= 8 and two_calls >= 1 and max(stats["turns"]) == 3
    assert sum(stats["tool_errors"]) == 0 and any(0 in m for m in gen.model_mask)

    # SGLang's logprobs against transformers' forward pass over prompt + whole trajectory (tool tokens included
    # in the context): they agree only if SGLang was continued from exactly these ids.
    worst = 0.0
    with torch.no_grad():
        for i, (ids, lps, mask) in enumerate(zip(gen.token_ids, gen.logprobs, gen.model_mask)):
            prompt = prompts[i // n]
            seq = torch.tensor([prompt + ids])
            logp = torch.log_softmax(hf(seq).logits[0].float(), dim=-1)
            ref = logp[len(prompt) - 1: len(prompt) - 1 + len(ids)].gather(1, torch.tensor(ids)[:, None])[:, 0]
            for k, m in enumerate(mask):
                if m:
                    worst = max(worst, abs(ref[k].item() - lps[k]))
    print(f"tool calls {sum(stats['tool_calls'])} over {len(gen.token_ids)} samples, max |logp diff| {worst:.2e}")
    assert worst < LOGP_TOL
