"""docs/agents.md's examples run: its files are written out as they stand, its data script runs, and its two
training commands (the tool with the default loop, then the agent loop with a scripted user) train with their
overrides as written, on a tiny random model with SmolLM2's tokenizer and toy sizes. The agent-loop run's
rollout dumps read back into exactly the ids and masks the trainer built (its RolloutBatch, captured at the
update), and the metrics rows carry the multi-turn, per-tool and validation metrics. The tool, its
per-trajectory lifecycle and the reward over turns are also driven directly, with a scripted model."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.parallel.forked import run_ranks
from tests.models.hf_fixtures import smollm2_dir

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "agents.md"
SIZES = ["batch.train_batch_size=2", "rollout.n=2", "batch.ppo_mini_batch_size=2", "batch.micro_batch_size=4",
         "batch.max_response_length=40", "run.steps=2", "eval.interval=2", "eval.max_prompts=2", "eval.pass_k=2",
         "reward.num_workers=1", "reward.start_method=fork", "rollout.temperature=1.5", "optim.lr=1e-3"]
"""Toy sizes; reward workers forked from the rank, which holds the example's modules."""


def blocks():
    """(files: {name: text}, commands: [the overrides of each `python -m grpo_mega.train` command])."""
    text = DOC.read_text()
    files, commands = {}, []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, re.S):
        first = body.splitlines()[0]
        if lang == "python" and re.fullmatch(r"# \w+\.py", first):
            files[first[2:]] = body
        elif lang == "bash":
            for cmd in body.replace("\\\n", " ").splitlines():
                argv = shlex.split(cmd)
                if argv[:3] == ["python", "-m", "grpo_mega.train"]:
                    commands.append(argv[3:])
    return files, commands


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The doc's files and data in a folder, and a tiny random Llama with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("agents")
    files, commands = blocks()
    assert sorted(files) == ["make_vault_data.py", "vault_loop.py", "vault_task.py"] and len(commands) == 2
    for name, body in files.items():
        (d / name).write_text(body)
    subprocess.run([sys.executable, "make_vault_data.py"], cwd=d, check=True, timeout=60)
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    import torch

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a random model that ends its turn (<|im_end|>) about half the time: short model turns
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_token_id, 0] = 12.0
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    return d, commands


def _train(folder: str, overrides: list[str]):
    """In the forked rank: the doc's modules loaded (as a user's working directory would give them), the config
    composed by Hydra from the overrides, the run built and trained; the trainer's batches captured."""
    import importlib.util
    import os
    import sys as _sys

    from hydra import compose, initialize_config_module

    from grpo_mega.conf.schema import TrainConfig, register_schema
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.loop import train
    from grpo_mega.trainer.setup import build_run, resolve_model

    os.chdir(folder)  # tool workers import the example's modules from the working directory
    for name in ("vault_task", "vault_loop"):
        spec = importlib.util.spec_from_file_location(name, Path(folder) / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        _sys.modules[name] = module
        spec.loader.exec_module(module)
    register_schema()
    with initialize_config_module("grpo_mega.conf", version_base=None):
        config = TrainConfig.from_hydra(compose("config", overrides=overrides))
    model, tok, hf_dir = resolve_model(config)
    batches, rows = [], []
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=1, pp=1, seed=config.run.seed)
        run = build_run(config, model, tok, hf_dir, Path(folder))
        update = run.actor.update

        def capture(rb, *a, **k):
            batches.append({"tokens": rb.tokens.tolist(), "loss_mask": rb.response_mask().tolist(),
                            "prompt_lens": rb.prompt_lens.tolist(), "response_lens": rb.response_lens.tolist()})
            return update(rb, *a, **k)

        run.actor.update = capture
        try:
            train(run, rows.append)
        finally:
            run.close()
            run.task.reward.close()
        destroy_distributed()
    return batches, rows


def test_the_docs_examples_train_and_the_dump_is_what_the_trainer_used(example):
    from grpo_mega.rollout.dump import read_dump
    from grpo_mega.trainer.batch import RolloutBatch

    d, commands = example
    results = {}
    for k, argv in enumerate(commands):
        overrides = [a for a in argv if not a.startswith("model=")] + [
            f"model={d / 'model'}", f"rollout.dump_dir={d / f'dumps{k}'}", *SIZES]
        [(batches, rows)] = run_ranks(_train, 1, str(d), overrides, timeout=900)
        results[k] = (batches, rows)
        assert len(rows) == 2 and all(r["multi_turn/turns"] >= 1 for r in rows)
        assert "val/multi_turn/turns" in rows[0] and "val/timing/tools" in rows[1]
    batches, rows = results[1]  # the agent loop: the scripted user's replies are segments of mask 0
    for step, rb in enumerate(batches, 1):
        dump = read_dump(d / "dumps1" / f"train_step_{step:08d}.jsonl")
        back = RolloutBatch.from_samples([r["prompt_ids"] for r in dump], [r["response_ids"] for r in dump],
                                         [r["model_mask"] for r in dump])
        assert back.tokens.tolist() == rb["tokens"] and back.response_mask().tolist() == rb["loss_mask"]
        assert back.prompt_lens.tolist() == rb["prompt_lens"] and back.response_lens.tolist() == rb["response_lens"]
        users = [t for r in dump for t in r["turns"] if t["role"] == "user"]
        assert users and all(t["text"].startswith("That is not the value in the vault") for t in users)
        for r in dump:
            for t in r["turns"]:
                assert set(r["model_mask"][t["start"]:t["end"]]) <= {1 if t["role"] == "assistant" else 0}
            assert r["reward"] is not None and "advantage" in r and r["response"]
    val = read_dump(d / "dumps1" / "val_step_00000000.jsonl")
    assert len(val) == 2 and all("turns" in r for r in val)


class ScriptedVault:
    """A model that reads the vault under the key in its prompt, then answers what the vault said."""

    weight_version = 0

    def __init__(self, tok):
        self.tok, self.end = tok, tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, stop_token_ids, seed, prompt_offset=0,
                 row_seeds=None):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            if text.endswith("<|im_start|>assistant\n") and "<|im_start|>tool" in text:
                answer = text.split("<|im_start|>tool\n")[-1].split("<|im_end|>")[0]
            else:
                key = re.findall(r"What is under (k\d+)\?", text)[0]
                answer = '<tool_call>{"name": "vault", "arguments": {"key": "%s"}}</tool_call>' % key
            out.append(self.tok.encode(answer, add_special_tokens=False) + [self.end])
        from grpo_mega.engines.interface import Generation

        return Generation(out, [[-0.1] * len(o) for o in out], ["stop"] * len(out), 0)

    def shutdown(self):
        pass


def _direct(folder: str):
    """In a fresh process with the example's folder as working directory: the tool through the engine, scored."""
    import importlib.util
    import os
    import sys as _sys

    from transformers import AutoTokenizer

    from grpo_mega.data.dataset import load_prompts
    from grpo_mega.rollout.multi_turn import MultiTurnEngine
    from grpo_mega.rollout.scheduler import example_row
    from grpo_mega.toolcalls.pool import ToolPool

    os.chdir(folder)
    spec = importlib.util.spec_from_file_location("vault_task", Path(folder) / "vault_task.py")
    vt = importlib.util.module_from_spec(spec)
    _sys.modules["vault_task"] = vt
    spec.loader.exec_module(vt)
    tok = AutoTokenizer.from_pretrained(str(Path(folder) / "model"))
    examples = load_prompts("vault.jsonl", tok, 512, {"vault": vt.Vault().schema()})[0][:3]
    engine = ScriptedVault(tok)
    mt = MultiTurnEngine(engine, tok, ToolPool(["vault_task:Vault"]), max_turns=3, stop_token_ids=[engine.end])
    try:
        gen = mt.generate([e.prompt_ids for e in examples], 2, 1.0, 1.0, 200, [engine.end], 0,
                          rows=[example_row(e) for e in examples])
    finally:
        mt.shutdown()
    scores = []
    for i, traj in enumerate(gen.trajectories):
        e = examples[i // 2]
        turns = [{k: t.get(k) for k in ("role", "text", "name", "error")} for t in traj["turns"]]
        final = [t["text"] for t in turns if t["role"] == "assistant"][-1]
        scores.append(vt.score(final, e.ground_truth, {"turns": turns, "tool_rewards": traj["tool_rewards"]}))
        assert str(e.ground_truth) == turns[1]["text"]  # the value, in the tool's turn only: no pay for the call
        assert vt.score("I do not know", e.ground_truth, {"turns": turns, "tool_rewards": {}}) == 0.0
    no_read = vt.score(str(examples[0].ground_truth), examples[0].ground_truth, {"turns": [], "tool_rewards": {}})
    return scores, [t["tool_rewards"] for t in gen.trajectories], no_read


def test_the_vault_through_the_engine(example):
    """Each sample's vault holds its own row's secret (6 trajectories, one worker); the right answer after a read
    scores 1.0, the vault's reward is 0 for one read; an answer without a read scores 0."""
    d, _ = example
    [(scores, tool_rewards, no_read)] = run_ranks(_direct, 1, str(d), timeout=300)
    assert scores == [1.0] * 6 and tool_rewards == [{"vault": 0.0}] * 6 and no_read == 0.0
