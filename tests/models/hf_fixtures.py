"""Tiny random HF checkpoints made with transformers itself (nothing downloaded), and the prepared SmolLM2
(`smollm2_dir`, grpo_mega.cli.prepare_model's `prepared_dir`)."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_mega.cli.prepare_model import prepared_dir as smollm2_dir  # noqa: F401 - the prepared SmolLM2 directory

DEMO_TASK = Path(__file__).resolve().parents[2] / "grpo_mega" / "conf" / "task" / "successor.yaml"


def demo_settings() -> list[str]:
    """The demo's settings (grpo_mega/conf/task/successor.yaml: fp32, lr 1e-3, no KL, 3-token responses, ...) as
    overrides, task and model left out: a test that runs task=prompts on a small model with the numerics and
    sizes it had when every run started from the demo (task=prompts itself starts from the documented
    defaults). Read from the file, so the two never differ; a test's own overrides come after them and win."""
    import yaml

    def flat(d: dict, prefix: str = "") -> list[str]:
        return [x for k, v in d.items() for x in (flat(v, f"{prefix}{k}.") if isinstance(v, dict)
                                                    else [f"{prefix}{k}={v}"])]

    return [o for o in flat(yaml.safe_load(DEMO_TASK.read_text())) if o.split("=")[0] not in ("task", "model")]


def tiny_hf(path: Path, family: str, dtype=torch.bfloat16, tied: bool = False, seed: int = 0,
            mlp_only_layers: tuple = (2,)) -> Path:
    """A 4-layer, 8-head, 4-KV-group random model saved with save_pretrained (safetensors). Qwen3's has a
    head_dim of 32, not hidden_size / heads (8), and random q/k norms. Qwen3-MoE's `mlp_only_layers` are dense
    (SGLang 0.5.23's Qwen3MoeForCausalLM ignores them and makes every layer sparse: () for SGLang)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tied,
              rope_theta=10000.0, initializer_range=0.15)
    cfg, cls = {
        "llama": lambda: (LlamaConfig(**kw), LlamaForCausalLM),
        "qwen2": lambda: (Qwen2Config(**kw), Qwen2ForCausalLM),
        "qwen3": lambda: (Qwen3Config(head_dim=32, **kw), Qwen3ForCausalLM),
        # 8 experts, top-2, renormalised top-k (as Qwen3-30B-A3B), layer 2 dense: both MLP kinds
        "qwen3_moe": lambda: (Qwen3MoeConfig(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, mlp_only_layers=list(mlp_only_layers), **kw), Qwen3MoeForCausalLM),
    }[family]()
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():  # make the norms and biases non-trivial so a swapped tensor would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p.float()).to(dtype) if "norm" in name else 0.1 * torch.randn_like(p.float()).to(dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path


def fresh_hf(path: Path, family: str, seed: int = 0, pad_token_id: int | None = None) -> Path:
    """A random model as a new user makes one with transformers and saves it, untouched after its init (fp32):
    the shape of issue 42's (hidden 96, 6 heads, 2 KV heads, head_dim 24 != 96 / 6, untied, initializer_range
    0.08), 2 layers and a 1000-token vocabulary (padded to 1024 in megatron); Qwen3-MoE with 4 experts, top-2,
    every layer sparse, no load-balancing loss. With `pad_token_id` (issue 42's model: 2, SmolLM2's <|im_end|>,
    also the EOS) transformers' init zeroes that embedding row (nn.Embedding padding_idx)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(vocab_size=1000, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.08, bos_token_id=1, eos_token_id=2,
              pad_token_id=pad_token_id)
    if family == "qwen3":
        cfg, cls = Qwen3Config(**kw), Qwen3ForCausalLM
    elif family == "qwen3_moe":
        cfg, cls = Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  router_aux_loss_coef=0.0, **kw), Qwen3MoeForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    cls(cfg).float().save_pretrained(path, safe_serialization=True)
    return path


def tiny_chat_hf(path: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama (hidden 32) with SmolLM2's tokenizer and chat template: task=prompts end to end
    (chat rendering, rewards on decoded text, checkpoints) at a fraction of SmolLM2's cost per step."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(src)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, Path(path) / f.name)
    return Path(path)


# A Qwen2.5-style chat format (ChatML turns; tools as JSON lines in the system turn; consecutive tool results
# in one user turn, each in <tool_response> tags), written for the tests: no Qwen tokenizer can be downloaded.
QWEN_STYLE_TEMPLATE = (  # (HF renders with trim_blocks: a newline right after a tag is written as an expression)
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\n\n# Tools\n\n<tools>' }}{% for t in tools %}{{ '\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\n</tools>\n\nCall a function as <tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\n' }}"
    "{% else %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>{{ '\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n<tool_response>\n' }}{{ m.content }}{{ '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% elif not (m.role == 'system' and loop.first) %}<|im_start|>{{ m.role }}{{ '\n' }}{{ m.content }}"
    "<|im_end|>{{ '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}")

QWEN_STYLE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_STYLE_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Qwen2.5's control tokens: special (the first three) and added but not special (the tool and think tags)."""


def qwen_style_tokenizer():
    """A byte-level BPE tokenizer in Qwen2.5's shape, trained here on a small corpus (vocabulary ~600): the
    special tokens <|endoftext|>, <|im_start|>, <|im_end|> (EOS), the non-special added tokens <tool_call>,
    </tool_call>, <tool_response>, </tool_response>, <think>, </think>, and QWEN_STYLE_TEMPLATE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    corpus = ["You are a helpful assistant.", "What is 6*7? The answer is 42.", '{"name": "calculator", '
              '"arguments": {"expression": "12*(3+4)"}}', "system user assistant tool response function",
              "Error: the tool call is not valid JSON", "0123456789 + - * / = ( ) [ ] { } < > | _ : , . ; ' \" \n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=QWEN_STYLE_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(corpus, trainer)
    core.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN_STYLE_SPECIAL])
    core.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN_STYLE_ADDED])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok
