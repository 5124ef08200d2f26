"""The one config tree: every config class lives in grpo_mega/conf, Hydra composes one TrainConfig, the generated
reference (docs/config.md) matches the code, old names are refused, and cross-field rules fail at construction."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega.conf import schema
from grpo_mega.conf.model import load_model_config
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.conf.rollout import MultiTurnConfig, RolloutConfig
from grpo_mega.conf.reference import field_docs, main as reference_main

ROOT = Path(__file__).resolve().parents[2]


def _config_classes(tree_root: type) -> list[type]:
    seen, todo = [], [tree_root]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        hints = __import__("typing").get_type_hints(cls)
        todo += [h for h in hints.values() if dataclasses.is_dataclass(h)]
    return seen


def test_docs_config_md_is_current():
    """Fails when a field, default or help line changed without `python -m grpo_mega.conf.reference --write`."""
    assert reference_main(["--check"]) == 0, "docs/config.md is stale: python -m grpo_mega.conf.reference --write"


def test_every_field_has_a_help_line():
    for cls in _config_classes(schema.TrainConfig) + [schema.ModelConfig]:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs
                   and not dataclasses.is_dataclass(__import__("typing").get_type_hints(cls)[f.name])]
        assert not missing, f"{cls.__name__}: no docstring under {missing}"


def test_every_config_class_lives_in_conf():
    """The tree is closed: each component of TrainConfig is defined in grpo_mega/conf, and no module outside it
    defines a class named *Config."""
    classes = _config_classes(schema.TrainConfig)
    assert len(classes) == 16  # TrainConfig and its 15 components (reward.rm_train, rollout.multi_turn included)
    assert all(c.__module__.startswith("grpo_mega.conf") for c in classes)
    outside = []
    for path in (ROOT / "grpo_mega").rglob("*.py"):
        if "conf" in path.relative_to(ROOT / "grpo_mega").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                outside.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not outside, outside


def test_cfg_job_prints_one_tree():
    out = subprocess.run([sys.executable, "-m", "grpo_mega.train", "--cfg", "job"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    top = [line.split(":")[0] for line in out.stdout.splitlines() if line and not line.startswith((" ", "#"))]
    assert top == [f.name for f in dataclasses.fields(schema.TrainConfig)], top
    rollout = out.stdout.split("\nrollout:")[1].split("\nrun:")[0]
    assert "\n  'n': 8\n" in rollout  # the demo's group size, under rollout (YAML quotes the key n)


@pytest.mark.parametrize("override,new", [("batch.n=8", "rollout.n=8"), ("seed=3", "run.seed=3"),
                                          ("+batch.n=2", "rollout.n=2")])
def test_old_names_are_refused_naming_the_new(override, new):
    with pytest.raises(ValueError, match=f"is now {new.split('=')[0]}: write {new}$"):
        schema.check_renamed(["run.steps=1", override])
    schema.check_renamed(["rollout.n=8", "run.seed=3"])  # the new names pass


def test_cross_field_rules_fail_at_construction():
    with pytest.raises(ValueError, match="task=prompts needs data.train_files"):
        schema.TrainConfig(task="prompts")
    with pytest.raises(ValueError, match="not divisible by parallel.tp=2"):
        schema.TrainConfig(parallel=dict(tp=2, sequence_parallel=True), batch=dict(max_tokens_per_micro_batch=259,
                                                                                   max_response_length=3))
    with pytest.raises(ValueError, match="needs rollout.placement=dedicated"):
        schema.TrainConfig(rollout=dict(off_policy_steps=1))
    with pytest.raises(ValueError, match="reward.overlong='drop'"):
        schema.TrainConfig(reward=dict(overlong="drop"))
    with pytest.raises(ValueError, match="eval.interval=-1"):
        schema.TrainConfig(eval=dict(interval=-1))


def test_derived_settings():
    """Iterative RL: the reference follows the reward model's updates unless set; one step off-policy turns on
    truncated importance correction unless set."""
    c = schema.TrainConfig(reward=dict(name="reward_model", rm_train=dict(interval=3, labels="task")))
    assert c.algo.ref_update_interval == 3
    c = schema.TrainConfig(reward=dict(name="reward_model", rm_train=dict(interval=3, labels="task")),
                           algo=dict(ref_update_interval=5))
    assert c.algo.ref_update_interval == 5
    c = schema.TrainConfig(rollout=dict(placement="dedicated", servers=["http://h:1"], off_policy_steps=1))
    assert c.algo.engine_is_cap == schema.OFF_POLICY_IS_CAP
    c = schema.TrainConfig(rollout=dict(placement="dedicated", servers=["http://h:1"], off_policy_steps=1),
                           algo=dict(engine_is_cap=3.0))
    assert c.algo.engine_is_cap == 3.0


def test_layout_against_the_model_and_world():
    model = load_model_config("tiny")
    cfg = schema.TrainConfig(parallel=dict(tp=2), batch=dict(packing=False, micro_batch_size=3), rollout=dict(n=4))
    with pytest.raises(ValueError, match="ppo_mini_batch_size \\* rollout.n = 4 \\* 4 = 16 responses does not split"):
        cfg.check_layout(model, 4)
    assert schema.TrainConfig(parallel=dict(tp=2)).check_layout(model, 4) == 2
    with pytest.raises(ValueError, match="rollout.num_engines=3 must divide the number of ranks \\(4\\)"):
        schema.TrainConfig(rollout=dict(num_engines=3)).check_layout(model, 4)


def test_multi_turn_config():
    cfg = schema.TrainConfig()
    assert cfg.rollout.multi_turn.enable is False  # off by default: the single-turn path is untouched
    with pytest.raises(ValueError, match="rollout.multi_turn.max_turns=0 must be >= 1"):
        MultiTurnConfig(max_turns=0)
    # in-process SGLang continues samples from their ids too (tests/rollout/test_sglang_multi_turn.py)
    assert RolloutConfig(engine="sglang", multi_turn=MultiTurnConfig(enable=True)).multi_turn.enable
    assert RolloutConfig(placement="dedicated", servers=["http://h:1"], off_policy_steps=1,
                                multi_turn=MultiTurnConfig(enable=True)).multi_turn.enable
    restored = schema.TrainConfig(**{**cfg.to_dict(), "rollout": {**cfg.to_dict()["rollout"],
                                                                "multi_turn": {"enable": True, "max_turns": 3}}})
    assert restored.rollout.multi_turn.max_turns == 3


def test_moe_layout_rules():
    moe = load_model_config("tiny-qwen3-moe")
    assert schema.TrainConfig(parallel=dict(tp=2, sequence_parallel=True)).check_layout(moe, 2) == 1
    assert schema.TrainConfig(parallel=dict(ep=2)).check_layout(moe, 2) == 2  # experts split over the 2 DP ranks
    # TP x EP trains: tp2 x dp2, the experts split over the 2 DP ranks and each over the TP pair
    assert schema.TrainConfig(parallel=dict(ep=2, tp=2, sequence_parallel=True)).check_layout(moe, 4) == 2
    with pytest.raises(ValueError, match=r"parallel.ep=2 must divide the data-parallel size dp=1"):
        schema.TrainConfig(parallel=dict(ep=2)).check_layout(moe, 1)
    assert ParallelConfig(tp=2, ep=2).check(moe, 4) == 2  # conversion and inference layouts


def _compose(overrides: list[str]) -> schema.TrainConfig:
    """The TrainConfig `python -m grpo_mega.train OVERRIDES` runs with (Hydra, the real config files)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    schema.register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="grpo_mega.conf", version_base=None):
            return schema.TrainConfig.from_hydra(compose(config_name="config", overrides=overrides))
    finally:
        GlobalHydra.instance().clear()


def _docs_defaults() -> dict[str, str]:
    """{dotted field: the default docs/config.md lists} for every TrainConfig field (not the model YAML's)."""
    text = (ROOT / "docs" / "config.md").read_text().split("## Model YAML fields")[0]
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| `")]
    return {r[1].strip().strip("`"): r[3].strip().strip("`") for r in rows}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _as_docs(value) -> str:
    """A value as docs/config.md's default column writes it (grpo_mega/conf/reference.py: repr, null, true)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


PROMPTS_RUN = ["task=prompts", "model=/models/Qwen2.5-7B-Instruct", "data.train_files=/data/train.jsonl"]


def test_task_prompts_runs_on_the_documented_defaults():
    """`task=prompts model=DIR data.train_files=F` (the README's "train your own") gets exactly the defaults
    docs/config.md lists, field by field: none of the demo's settings (lr 1e-3, 3-token responses, no KL, fp32)
    leak in."""
    got = _flat(_compose(PROMPTS_RUN).to_dict())
    docs = _docs_defaults()
    assert set(docs) == set(got), set(docs) ^ set(got)
    differ = {k: (docs[k], _as_docs(v)) for k, v in got.items() if docs[k] != _as_docs(v)}
    assert differ == {"task": ("'successor'", "'prompts'"), "model": ("'tiny'", "'/models/Qwen2.5-7B-Instruct'"),
                      "data.train_files": ("''", "'/data/train.jsonl'")}, differ
    assert (got["optim.lr"], got["batch.max_response_length"], got["algo.kl_coef"], got["precision.params_dtype"]) \
        == (1e-6, 256, 0.001, "bf16")


def test_cfg_job_of_task_prompts_shows_the_documented_defaults():
    """What the issue's user types: `--cfg job` prints the composed tree, and it is the one composed above."""
    import yaml

    out = subprocess.run([sys.executable, "-m", "grpo_mega.train", *PROMPTS_RUN, "--cfg", "job"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    tree = yaml.safe_load(out.stdout)
    assert (tree["optim"]["lr"], tree["batch"]["max_response_length"], tree["algo"]["kl_coef"],
            tree["precision"]["params_dtype"]) == (1e-6, 256, 0.001, "bf16")
    assert _flat(tree) == _flat(_compose(PROMPTS_RUN).to_dict())


def test_the_default_task_is_the_demo_and_its_settings_come_with_the_task():
    """No task given: the demo (task=successor) with grpo_mega/conf/task/successor.yaml over the defaults; the
    command line still wins, and the toy tool tasks start from the demo's settings too."""
    demo = _compose([])
    assert (demo.task, demo.model, demo.optim.lr, demo.batch.max_response_length, demo.algo.kl_coef,
            demo.precision.params_dtype, demo.rollout.n) == ("successor", "tiny", 1e-3, 3, 0.0, "fp32", 8)
    assert _compose(["optim.lr=0.5"]).optim.lr == 0.5
    assert _compose(["task=successor", "precision.params_dtype=bf16"]).precision.params_dtype == "bf16"
    for tool in ("product_tool", "tens_tool", "lookup_tool", "lookup_call"):
        c = _compose([f"task={tool}"])
        assert c.task == tool and c.to_dict() == {**demo.to_dict(), "task": tool}
    tasks = sorted(p.stem for p in (ROOT / "grpo_mega" / "conf" / "task").glob("*.yaml"))
    assert tasks == ["lookup_call", "lookup_tool", "product_tool", "prompts", "successor", "tens_tool"]
