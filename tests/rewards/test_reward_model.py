"""The batched reward model against transformers' own one-sample forward (fp32, 1e-5), and its refusals."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


def tiny_rm(path, seed: int = 0, vocab: int = 16):
    """A 2-layer random LlamaForSequenceClassification over the toy tokenizer, saved with its tokenizer."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    from grpo_mega.data.toy import make_tokenizer

    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(seed)
    rm = AutoModelForSequenceClassification.from_config(cfg)
    with torch.no_grad():
        rm.score.weight.normal_(0, 1.0)  # scores of order 1, so that 1e-5 is a tight check
    rm.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_batched_scores_equal_one_at_a_time_transformers_forward(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from grpo_mega.rewards.reward_model import RewardModel

    torch.set_num_threads(1)  # tiny matmuls: more threads only contend with the other tests for the cores
    tiny_rm(tmp_path)
    g = torch.Generator().manual_seed(1)
    texts = ["".join(str(int(d)) for d in torch.randint(0, 10, (int(n),), generator=g)) + ">"
             for n in torch.randint(1, 40, (37,), generator=g)]
    rm = RewardModel(str(tmp_path), "cpu", batch_size=16)  # 3 forwards, each padded
    got = rm.score_texts(texts)
    # the reference, written without our code: transformers' model on each unpadded text
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        want = [float(hf(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    assert torch.tensor(want).std() > 0.1  # the scores differ by text: a wrong token read would show
    assert rm.score_one_by_one(texts[:3]) == pytest.approx(want[:3], abs=1e-6)


@dataclass
class _Ex:
    prompt_ids: list[int]


def test_step_scorer_scores_on_rank_0_and_matches_per_sample(tmp_path):
    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.rewards.reward_model import RewardModelReward
    from grpo_mega.rewards.scoring import score_step

    tiny_rm(tmp_path)
    tok = make_tokenizer()
    r = RewardModelReward(tok, str(tmp_path), "cpu", batch_size=4)
    ex = [_Ex(tok.convert_tokens_to_ids(["<bos>", str(d), ">"])) for d in range(5)]
    resp = [tok.convert_tokens_to_ids([str((d * 3) % 10), "<eos>"]) for d in range(5)]
    rewards, metrics = score_step(r, ex, resp, 1)
    want = [r(e, x) for e, x in zip(ex, resp)]
    assert rewards.tolist() == pytest.approx(want, abs=1e-5) and "reward/score_seconds" in metrics


def test_a_directory_without_a_classification_head_is_refused(tmp_path):
    from tests.models.hf_fixtures import tiny_hf

    from grpo_mega.rewards.reward_model import RewardModel

    tiny_hf(tmp_path, "llama")
    with pytest.raises(ValueError, match=r"architectures \['LlamaForCausalLM'\] has no sequence-classification head"):
        RewardModel(str(tmp_path))


def test_non_finite_reward_model_scores_are_counted_as_errors_and_scored_0(tmp_path):
    """A reward model that overflows (bf16, a broken checkpoint) must not put inf or NaN into the advantages: such a
    sample scores 0 and counts in reward/errors, so that reward.max_error_fraction stops a run whose model is broken."""
    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.rewards.reward_model import RewardModelReward
    from grpo_mega.rewards.scoring import score_step

    tiny_rm(tmp_path)
    tok = make_tokenizer()
    r = RewardModelReward(tok, str(tmp_path), "cpu", batch_size=4)
    ex = [_Ex(tok.convert_tokens_to_ids(["<bos>", str(d), ">"])) for d in range(4)]
    resp = [tok.convert_tokens_to_ids([str(d), "<eos>"]) for d in range(4)]
    finite, _ = score_step(r, ex, resp, 1)
    with torch.no_grad():  # the head's weight for one hidden unit: inf, so every score is +-inf or NaN
        r.rm.head.weight[0, 0] = float("inf")
    rewards, metrics = score_step(r, ex, resp, 1)
    assert rewards.tolist() == [0.0] * 4 and metrics["reward/errors"] == 4 and metrics["reward/samples"] == 4
    assert torch.isfinite(finite).all() and (finite != 0).all()
    assert r(ex[0], resp[0]) == 0.0  # per sample (validation) as well
