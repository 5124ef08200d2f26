"""verl's multi-turn dataset fields (grpo_mega.data.dataset with rollout.multi_turn's tools): the tools a row
offers reach the chat template's `tools=`, extra_info.tools_kwargs is read and checked (an unregistered tool,
need_tools_kwargs without kwargs: one-line errors naming the file and line), and a plain row gets every tool."""

import json

import pytest

from grpo_mega.data.dataset import DataError, load_prompts, tools_kwargs_lookup
from grpo_mega.toolcalls import build_tools

# Qwen2.5's way of showing tools: the schemas as JSON lines in the system turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tests.models.hf_fixtures import smollm2_dir

    t = AutoTokenizer.from_pretrained(smollm2_dir())
    t.chat_template = TOOLS_TEMPLATE
    return t


def row(q="What is 6*7?", **extra_info):
    r = {"prompt": [{"role": "user", "content": q}], "reward_model": {"ground_truth": "42"}}
    if extra_info:
        r["extra_info"] = extra_info
    return r


def write(tmp_path, rows):
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


TOOLS = {n: t.schema() for n, t in build_tools(["calculator", "tests.toolcalls.test_toolcalls:Sleeper"]).items()}


def test_plain_rows_get_every_tool_and_verl_rows_their_own(tmp_path, tok):
    kw = {"calculator": {"create_kwargs": {"expression": "6*7"}, "execute_kwargs": {}}}
    path = write(tmp_path, [row(), row("Sleep?", tools_kwargs=kw, need_tools_kwargs=True)])
    (plain, verl), dropped = load_prompts(str(path), tok, 512, TOOLS)
    text = tok.decode(plain.prompt_ids)
    assert dropped == 0 and '"name": "calculator"' in text and '"name": "sleeper"' in text
    text = tok.decode(verl.prompt_ids)
    assert '"name": "calculator"' in text and "sleeper" not in text
    direct = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Sleep?"}], tools=[TOOLS["calculator"]],
                                                add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert verl.prompt_ids == direct  # the ids of the template given the row's tools directly
    lookup = tools_kwargs_lookup([plain, verl], str(path))
    assert lookup(verl.prompt_ids) == kw and lookup(plain.prompt_ids) is None
    (single, _), _ = load_prompts(str(path), tok, 512)  # multi-turn off: no tools shown, kwargs ignored
    assert "calculator" not in tok.decode(single.prompt_ids)


@pytest.mark.parametrize("extra, pattern", [
    ({"tools_kwargs": {"search": {}}}, r"rows\.jsonl:2: extra_info\.tools_kwargs names tool 'search', which is not "
                                       r"in rollout\.multi_turn\.tools \(calculator, sleeper\)"),
    ({"need_tools_kwargs": True}, r"rows\.jsonl:2: extra_info\.need_tools_kwargs is true but extra_info\.tools_kwargs is empty"),
    ({"tools_kwargs": ["calculator"]}, r"rows\.jsonl:2: 'extra_info\.tools_kwargs' must map tool names to objects"),
    ({"tools_kwargs": {"calculator": {"create_kwargs": "6*7"}}},
     r"rows\.jsonl:2: extra_info\.tools_kwargs\.calculator\.create_kwargs must be an object, got str"),
])
def test_bad_tool_rows_are_refused_naming_the_line(tmp_path, tok, extra, pattern):
    path = write(tmp_path, [row(), row(**extra)])
    with pytest.raises(DataError, match=pattern):
        load_prompts(str(path), tok, 512, TOOLS)


def test_same_prompt_with_different_kwargs_is_refused(tmp_path, tok):
    a = {"calculator": {"create_kwargs": {"expression": "1"}}}
    b = {"calculator": {"create_kwargs": {"expression": "2"}}}
    path = write(tmp_path, [row(tools_kwargs=a), row(tools_kwargs=b)])
    examples, _ = load_prompts(str(path), tok, 512, TOOLS)
    with pytest.raises(DataError, match="two rows render to the same prompt with different extra_info.tools_kwargs"):
        tools_kwargs_lookup(examples, str(path))
