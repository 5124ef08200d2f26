import pytest

from grpo_mega.rewards import RewardError, RewardStats, build_reward, score_samples


def test_math_reward_uses_math_verify():
    f = build_reward("math")
    assert f("The answer is $\\frac{1}{2}$.", "0.5") == 1.0
    assert f("so we get \\boxed{42}", "42") == 1.0
    assert f("so we get \\boxed{41}", "42") == 0.0
    assert f("no answer at all", "42") == 0.0


def test_format_and_mix():
    fmt = build_reward("format")
    assert fmt("work... \\boxed{3}", None) == 1.0 and fmt("3", None) == 0.0
    mix = build_reward("mix", weights={"math": 1.0, "format": 0.1})
    assert mix("\\boxed{3}", "3") == pytest.approx(1.1)
    assert mix("3 is it", "3") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="reward=mix needs reward.weights"):
        build_reward("mix")


def my_reward(response, ground_truth, sample):
    return float(len(response) == ground_truth)


def test_dotted_path_and_unknown_names():
    assert build_reward("tests.rewards.test_rewards:my_reward")("abc", 3, {}) == 1.0
    assert build_reward("tests.rewards.test_rewards.my_reward")("ab", 3, {}) == 0.0
    with pytest.raises(ValueError, match="cannot import 'nope'"):
        build_reward("tests.rewards.test_rewards:nope")
    with pytest.raises(ValueError, match="unknown reward function 'maths'; valid: format, math, mix"):
        build_reward("maths")


def test_a_raising_or_non_numeric_reward_is_reported_with_its_sample():
    def flaky(response, gt, sample):
        if response == "boom":
            raise ZeroDivisionError("division by zero")
        if response == "text":
            return "1.0"
        return 1.0

    rows = [{"data_source": "gsm8k"}, {"data_source": "math"}, {"data_source": "aime"}]
    stats = RewardStats()
    got = score_samples(flaky, ["ok", "boom", "text"], [1, 2, 3], rows, on_error="zero", stats=stats)
    assert got == [1.0, 0.0, 0.0] and stats.errors == 2
    assert "sample 1 (data_source='math', response='boom')" in stats.examples[0] and "ZeroDivisionError" in stats.examples[0]
    assert "returned '1.0'; a reward must be a finite number" in stats.examples[1]
    with pytest.raises(RewardError, match=r"sample 1 \(data_source='math'"):
        score_samples(flaky, ["ok", "boom"], [1, 2], rows[:2], on_error="raise")
    with pytest.raises(ValueError, match="reward.on_error='skip' must be 'zero' or 'raise'"):
        score_samples(flaky, [], [], [], on_error="skip")


def test_learned_reward_model_scores_with_its_own_tokenizer(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    from grpo_mega.data.toy import make_tokenizer

    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(cfg)
    rm.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    f = build_reward("reward_model", path=str(tmp_path))
    a, b = f("4", None, {"prompt_text": "3>"}), f("7", None, {"prompt_text": "3>"})
    ids = tok("3>4", return_tensors="pt")
    with torch.no_grad():
        want = float(rm(**ids).logits[0, 0])
    assert a == pytest.approx(want, abs=1e-6) and a != b  # transformers' own score, and it depends on the text
    with pytest.raises(ValueError, match="reward=reward_model needs reward.path"):
        build_reward("reward_model")
