"""verl's multi-turn dataset fields (grpo_mega.data.dataset with rollout.multi_turn's tools): the tools a row
offers reach the chat template's `tools=`, extra_info.tools_kwargs is read and checked (an unregistered tool,
need_tools_kwargs without kwargs: one-line errors naming the file and line), a plain row gets every tool, and
two rows with the same prompt and different kwargs each reach their own calls."""

import json

import pytest

from grpo_mega.data.dataset import DataError, load_prompts
from grpo_mega.engines.interface import Generation
from grpo_mega.rollout.multi_turn import MultiTurnEngine
from grpo_mega.rollout.scheduler import example_row
from grpo_mega.toolcalls import build_tools
from grpo_mega.toolcalls.pool import ToolPool

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
    assert verl.extra_info["tools_kwargs"] == kw and "tools_kwargs" not in plain.extra_info
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


class CallOnce:
    """Calls the calculator without arguments, then (after a tool turn) answers "ok"."""

    weight_version = 0

    def __init__(self, tok):
        self.tok, self.end = tok, tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        call = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
        out = [self.tok.encode("ok" if "<|im_start|>tool" in self.tok.decode(p) else call, add_special_tokens=False)
               + [self.end] for p in prompts]
        return Generation(out, [[-1.0] * len(o) for o in out], ["stop"] * len(out), 0)

    def shutdown(self):
        pass


def test_same_prompt_with_different_kwargs_reach_their_own_calls(tmp_path, tok):
    """verl datasets repeat a prompt with other tools_kwargs: each row's kwargs go to its own samples' tool
    instances (rows travel with their prompts to the engine; nothing is looked up by prompt ids)."""
    a = {"calculator": {"create_kwargs": {"expression": "6*7"}}}
    b = {"calculator": {"create_kwargs": {"expression": "2+3"}}}
    path = write(tmp_path, [row(tools_kwargs=a), row(tools_kwargs=b)])
    examples, _ = load_prompts(str(path), tok, 512, TOOLS)
    assert examples[0].prompt_ids == examples[1].prompt_ids
    engine = CallOnce(tok)
    mt = MultiTurnEngine(engine, tok, ToolPool(["calculator"]), max_turns=2, stop_token_ids=[engine.end])
    try:
        gen = mt.generate([e.prompt_ids for e in examples], 2, 1.0, 1.0, 200, [engine.end], seed=0,
                          rows=[example_row(e) for e in examples])
    finally:
        mt.shutdown()
    results = [[t["text"] for t in traj["turns"] if t["role"] == "tool"] for traj in gen.trajectories]
    assert results == [["42"], ["42"], ["5"], ["5"]]
