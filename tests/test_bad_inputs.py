"""The corpus of bad inputs: each one, given to `python -m grpo_mega.train` (or the export tool) as a user would,
ends in a one-line error that names the input and what was expected - exit status 2, no traceback, no
hang - and nothing already saved is lost. A case is (overrides, files it needs, the message expected).

Cases that need a real run's state (a checkpoint, an HF model, a dying engine) build it once per module."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fork_server import run_main
from tests.proc import run_tree

ROOT = Path(__file__).resolve().parents[1]


def raising_reward(response, ground_truth, sample):
    raise KeyError("no 'answer' field")


def text_reward(response, ground_truth, sample):
    return "correct"


def _cli(out: Path, *overrides: str, timeout: int = 300, fork: bool = True) -> subprocess.CompletedProcess:
    """`python -m grpo_mega.train hydra.run.dir=OUT OVERRIDES`, forked from a warm server (tests/fork_server:
    the same entry point, exit handlers included, without an interpreter's start-up and imports each time);
    `fork=False`: in a new interpreter, as a user's shell would start it (kept for the refusals that Hydra
    and the model YAML loader make, so the real entry path's exit codes stay tested here too)."""
    argv = [f"hydra.run.dir={out}", *overrides]
    if fork:
        return run_main(argv, timeout=timeout, cwd=ROOT, scratch=out.parent)
    return run_tree([sys.executable, "-m", "grpo_mega.train", *argv], capture_output=True, text=True, timeout=timeout,
                    cwd=ROOT)


def _refused(proc: subprocess.CompletedProcess, pattern: str, rc: int = 2) -> None:
    assert proc.returncode == rc, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    assert re.search(pattern, proc.stderr), f"{pattern!r} not in:\n{proc.stderr[-3000:]}"
    if rc == 2:
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


# ---- data files (task=prompts on SmolLM2's tokenizer and chat template) ------------------------------------

def _row(content="What is 2+2?", truth="4", **extra):
    return {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": truth}, **extra}


def _write_rows(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _parquet_garbage(path: Path) -> Path:
    path.write_bytes(b"PAR1" + os.urandom(64))
    return path


DATA_CASES = {
    "data_file_missing": (lambda d: d / "nope.jsonl", r"nope\.jsonl: no such data file"),
    "data_not_json": (lambda d: _write_rows(d / "bad.jsonl", [_row(), "{'prompt': oops", _row()]),
                      r"bad\.jsonl:2: not valid JSON .*expected one JSON object per line"),
    "data_empty_file": (lambda d: _write_rows(d / "empty.jsonl", []), r"empty\.jsonl: no rows; expected prompts in verl's schema"),
    "data_missing_prompt_column": (lambda d: _write_rows(d / "np.jsonl", [{"question": "2+2", "reward_model": {"ground_truth": "4"}}]),
                                   r"np\.jsonl:1: missing column 'prompt'"),
    "data_missing_ground_truth": (lambda d: _write_rows(d / "ng.jsonl", [{"prompt": [{"role": "user", "content": "2+2"}]}]),
                                  r"ng\.jsonl:1: missing column 'reward_model.ground_truth'"),
    "data_prompt_not_messages": (lambda d: _write_rows(d / "pm.jsonl", [{"prompt": "2+2", "reward_model": {"ground_truth": "4"}}]),
                                 r"pm\.jsonl:1: 'prompt' must be a non-empty list of .*messages"),
    "data_row_not_an_object": (lambda d: _write_rows(d / "list.jsonl", ["[1, 2, 3]"]),
                               r"list\.jsonl:1: expected an object with 'prompt' and 'reward_model', got list"),
    "data_corrupt_parquet": (lambda d: _parquet_garbage(d / "bad.parquet"), r"bad\.parquet: not a readable parquet file"),
    "data_unknown_format": (lambda d: _write_rows(d / "data.csv", ["prompt,answer"]),
                            r"data\.csv: unknown data format '\.csv'; expected \.jsonl or \.parquet"),
    "data_every_prompt_too_long": (lambda d: _write_rows(d / "long.jsonl", [_row("word " * 300)] * 3),
                                   r"long\.jsonl: all 3 prompts are longer than batch\.max_prompt_length=128 tokens"),
    "data_not_utf8": (lambda d: (p := d / "latin1.jsonl").write_bytes(json.dumps(_row("caf\u00e9?")).encode().replace(b"\\u00e9", b"\xe9")) and p,
                      r"latin1\.jsonl:1: not UTF-8 \(byte 0xe9 at byte \d+ of the line\); save the file as UTF-8"),
    "data_extra_info_not_an_object": (lambda d: _write_rows(d / "ei.jsonl", [_row(), _row(extra_info="split=train")]),
                                      r"ei\.jsonl:2: 'extra_info' must be an object .* or absent, got str 'split=train'"),
    "data_null_ground_truth": (lambda d: _write_rows(d / "nt.jsonl", [_row(truth=None)]),
                               r"nt\.jsonl:1: 'reward_model\.ground_truth' is null; give the answer the reward checks"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data_file(case, tmp_path):
    from tests.models.hf_fixtures import demo_settings, smollm2_dir

    make, pattern = DATA_CASES[case]
    proc = _cli(tmp_path / "run", "task=prompts", *demo_settings(), f"model={smollm2_dir()}",
                f"data.train_files={make(tmp_path)}", "batch.max_prompt_length=128", fork=True)
    _refused(proc, pattern)


def test_a_row_naming_an_unregistered_tool_is_refused_at_start_up(tmp_path):
    """rollout.multi_turn on: a row's extra_info.tools_kwargs naming a tool the run does not have stops the run
    before any model is built, naming the file, the line and the tool."""
    from tests.models.hf_fixtures import demo_settings, smollm2_dir

    data = _write_rows(tmp_path / "tk.jsonl", [_row(), _row(extra_info={"tools_kwargs": {"web_search": {}}})])
    proc = _cli(tmp_path / "run", "task=prompts", *demo_settings(), f"model={smollm2_dir()}", f"data.train_files={data}",
                "batch.max_prompt_length=128", "rollout.multi_turn.enable=true", fork=True)
    _refused(proc, r"tk\.jsonl:2: extra_info\.tools_kwargs names tool 'web_search', which is not in "
                   r"rollout\.multi_turn\.tools \(calculator\)")


def test_a_malformed_row_beyond_the_checked_head_stops_the_run_when_drawn(tmp_path):
    """A training file is checked at start-up only in its first HEAD_ROWS rows; a bad row further on stops the
    run in the step that draws it, with the same one-line error naming the file and the line (exit 2)."""
    import numpy as np

    from grpo_mega.data.dataset import HEAD_ROWS
    from tests.models.hf_fixtures import smollm2_dir

    n = HEAD_ROWS + 100
    while not (np.random.default_rng([1234, 0]).permutation(n)[:8] >= HEAD_ROWS).any():
        n += 1  # a row past the head among step 1's first 8 prompts (run.seed=1234, epoch 0)
    bad = int(next(i for i in np.random.default_rng([1234, 0]).permutation(n)[:8] if i >= HEAD_ROWS))
    rows = [_row(f"What is {i}+2?", str(i + 2)) for i in range(n)]
    rows[bad] = "{'prompt': oops"
    data = _write_rows(tmp_path / "far.jsonl", rows)
    val = _write_rows(tmp_path / "val.jsonl", [_row()])
    proc = _cli(tmp_path / "run", "task=prompts", f"model={smollm2_dir()}", f"data.train_files={data}",
                f"data.val_files={val}", "batch.max_prompt_length=128", "run.seed=1234", "eval.interval=0",
                "run.steps=1", fork=True)
    assert f"far.jsonl: {n} rows, the first {HEAD_ROWS} checked now, the others when drawn" in proc.stdout
    _refused(proc, rf"error: \S*far\.jsonl:{bad + 1}: not valid JSON .*expected one JSON object per line\n")


# ---- configuration: batch sizes, layouts, models, options -----------------------------------------------------

CONFIG_CASES = {
    "batch_mini_does_not_divide_train": (["batch.train_batch_size=16", "batch.ppo_mini_batch_size=5"],
                                         r"data\.train_batch_size=16 must be a multiple of ppo_mini_batch_size=5"),
    "batch_micro_does_not_split_mini": (["batch.packing=false", "batch.micro_batch_size=3"],
                                        r"64 responses does not split into dp=1 ranks x micro_batch_size=3; make it a multiple of 3"),
    "batch_group_of_one": (["rollout.n=1"], r"rollout\.n=1 must be >= 2 for GRPO"),
    "old_name_batch_n": (["batch.n=8"], r"(?m)^error: batch\.n is now rollout\.n: write rollout\.n=8$"),
    "old_name_seed": (["seed=3"], r"(?m)^error: seed is now run\.seed: write run\.seed=3$"),
    "eval_negative_interval": (["eval.interval=-1"], r"eval\.interval=-1 must be >= 0 \(0: no evaluation\)"),
    "task_prompts_without_data": (["task=prompts"], r"task=prompts needs data\.train_files=PATH"),
    "option_bad_overlong_mode": (["reward.overlong=drop"], r"reward\.overlong='drop' must be 'keep', 'zero' or 'mask'"),
    "batch_token_budget_below_longest": (["batch.max_tokens_per_micro_batch=100"],
                                         r"batch\.max_tokens_per_micro_batch=100 is smaller than max_prompt_length \+ "
                                         r"max_response_length = 256 \+ 3 = 259"),
    "batch_token_budget_not_divisible_by_tp_under_sp": (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "batch.max_tokens_per_micro_batch=259"],
        r"batch\.max_tokens_per_micro_batch=259 is not divisible by parallel\.tp=2"),
    "batch_zero_size": (["batch.max_response_length=0"], r"batch\.max_response_length"),
    "layout_tp_does_not_divide_heads": (["parallel.tp=3"], r"parallel\.tp=3 must divide num_attention_heads=8 \(model tiny\)"),
    "layout_more_ranks_than_launched": (["parallel.tp=2"], r"world size 1 is not divisible by parallel\.tp \* parallel\.pp = 2 \* 1"),
    "layout_more_stages_than_layers": (["parallel.pp=8"], r"model\.num_layers=4 does not split over parallel\.pp=8 stages"),
    "model_unknown_yaml": (["model=gpt-9"], r"unknown model 'gpt-9': .*known models: .*llama-3\.1-70b"),
    "model_hf_dir_missing": (["model=/nonexistent/Llama-3-8B"], r"unknown model '/nonexistent/Llama-3-8B'"),
    "option_unknown_kl_estimator": (["algo.kl_estimator=k9"], r"unknown KL estimator 'k9'; valid:"),
    "option_unknown_policy_loss": (["algo.policy_loss=ppo9"], r"unknown policy loss 'ppo9'; valid: bypass_ppo_clip, "
                                                              r"bypass_reinforce, cispo, clip_cov, dppo_kl, dppo_tv, "
                                                              r"dro, geo_mean, gpg, gspo, gspo_token, kl_cov, "
                                                              r"ppo_clip, sapo"),
    "option_gspo_token_level_agg_mode": (["algo.policy_loss=gspo"],
                                         r"algo\.policy_loss='gspo' needs algo\.loss_agg_mode=seq-mean-token-mean "
                                         r"\(got 'token-mean'\)"),
    "option_rollout_correction_bounds": (["algo.rollout_correction=sequence", "algo.rollout_correction_low=3",
                                          "algo.rollout_correction_high=2"],
                                         r"algo\.rollout_correction_low=3\.0 and algo\.rollout_correction_high=2\.0 "
                                         r"must satisfy 0 <= low < high"),
    "option_refill_max_gen_rounds_zero": (["algo.dynamic_sampling=refill", "algo.max_gen_rounds=0"],
                                          r"algo\.max_gen_rounds=0 must be >= 1"),
    "option_unknown_dynamic_sampling": (["algo.dynamic_sampling=refil"],
                                        r"algo\.dynamic_sampling='refil' must be 'filter', 'refill' or null"),
    "option_unknown_engine": (["rollout.engine=vllm"], r"rollout\.engine='vllm' must be 'embedded' or 'sglang'"),
    "option_off_policy_colocated": (["rollout.off_policy_steps=1"],
                                    r"rollout\.off_policy_steps=1 needs rollout\.placement=dedicated \(got 'colocated'\)"),
    "option_bad_lr": (["optim.lr=-1"], r"optim\.lr=-1\.0 and optim\.min_lr=0\.0 must satisfy 0 <= min_lr <= lr"),
    "checkpoint_keep_last_zero": (["checkpoint.dir=CKPT", "checkpoint.keep_last=0"], r"checkpoint\.keep_last=0 must be >= 1"),
    "checkpoint_interval_without_dir": (["checkpoint.interval=5"], r"checkpoint\.interval / checkpoint\.export_hf need checkpoint\.dir=PATH"),
    "audit_qwen3_on_sglang": (["model=tiny-qwen3", "rollout.engine=sglang", "rollout.audit_weights=true"],
                              r"rollout\.audit_weights=true reads every tensor back .* not model\.family='qwen3'"),
    "tool_memory_negative": (["rollout.multi_turn.tool_max_memory_mb=-1"],
                             r"rollout\.multi_turn\.tool_max_memory_mb=-1 must be >= 0"),
    "tool_response_chars_zero": (["rollout.multi_turn.max_tool_response_chars=0"],
                                 r"rollout\.multi_turn\.max_tool_response_chars=0 must be >= 1"),
    "tool_parser_unknown": (["rollout.multi_turn.parser=xml"],
                            r"rollout\.multi_turn\.parser: unknown tool-call parser 'xml'; valid: bare, expression, hermes"),
    "tool_unknown": (["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[serach]"],
                     r"unknown tool 'serach'; valid: calculator"),
    "tool_agent_loop_not_async": (["rollout.multi_turn.enable=true",
                                   "rollout.multi_turn.agent_loop=tests.test_bad_inputs:text_reward"],
                                  r"rollout\.multi_turn\.agent_loop='tests\.test_bad_inputs:text_reward' must be an "
                                  r"`async def` function"),
    "tool_calls_per_turn_zero": (["rollout.multi_turn.max_tool_calls_per_turn=0"],
                                 r"rollout\.multi_turn\.max_tool_calls_per_turn=0 must be >= 1"),
    "tool_call_stop_not_a_token": (["rollout.multi_turn.enable=true", "rollout.multi_turn.call_stop=['</call>']"],
                                   r"rollout\.multi_turn\.call_stop: '</call>' is not one token of the tokenizer"),
    "checkpoint_lock_stale_zero": (["checkpoint.lock_stale_s=0"], r"checkpoint\.lock_stale_s=0\.0 must be > 0"),
    "checkpoint_resume_nonsense": (["checkpoint.resume=sometimes"], r"checkpoint\.resume='sometimes' must be 'auto', 'never' or"),
    "lr_decay_without_steps": (["optim.lr_decay_style=cosine"],
                               r"optim\.lr_decay_style='cosine' needs optim\.lr_decay_steps"),
    "layout_ep_on_a_dense_model": (["parallel.ep=2"], r"parallel\.ep=2 needs an MoE model; model tiny is dense"),
    "layout_ep_does_not_divide_experts": (["model=tiny-qwen3-moe", "parallel.ep=3"],
                                          r"parallel\.ep=3 must divide num_experts=8 \(model tiny-qwen3-moe\)"),
    "layout_moe_tp_without_sp": (["model=tiny-qwen3-moe", "parallel.tp=2"],
                                 r"parallel\.tp=2 with an MoE model needs parallel\.sequence_parallel=true"),
    "layout_ep_does_not_divide_dp": (["model=tiny-qwen3-moe", "parallel.ep=2"],
                                     r"parallel\.ep=2 must divide the data-parallel size dp=1"),
    "lora_rank_zero": (["lora.rank=0"], r"lora\.rank=0 must be > 0 \(or null: no LoRA\)"),
    "lora_unknown_target": (["lora.rank=4", "lora.target_modules=[qkv,gate]"],
                            r"lora\.target_modules=\['qkv', 'gate'\]: unknown \['gate'\]; choose from qkv, proj, fc1, fc2, "
                            r"expert_fc1, expert_fc2, router"),
    "lora_moe_target_on_a_dense_model": (["lora.rank=4", "lora.target_modules=[qkv,router]"],
                                         r"lora\.target_modules \['router'\] need an MoE model; model tiny is dense"),
    "lora_rank_larger_than_a_layer": (["lora.rank=100000"],
                                      r"lora\.rank=100000 is larger than decoder\.layers\.0\.self_attention\.linear_\w+'s "
                                      r"smaller dimension 64 \(64 x 64\); choose lora\.rank <= 64"),
    "lora_with_reference_updates": (["lora.rank=4", "algo.kl_coef=0.01", "algo.ref_update_interval=5"],
                                    r"lora\.rank=4 with algo\.ref_update_interval=5: under LoRA the reference is the frozen base"),
    "lora_with_fp8": (["lora.rank=4", "precision.fp8=hybrid"],
                      r"lora\.rank=4 with precision\.fp8='hybrid': LoRA runs on megatron-core's local layers \(chosen even "
                      r"where Transformer Engine is installed\), FP8 only on Transformer Engine's; set precision\.fp8=null"),
    "routing_replay_unknown": (["algo.routing_replay=always"],
                               r"algo\.routing_replay='always' must be 'none', 'measure' or 'rollout'"),
    "routing_measure_on_a_dense_model": (["algo.routing_replay=measure"],
                                         r"algo\.routing_replay=measure needs an MoE model; model tiny is dense"),
    "routing_replay_on_a_dense_model": (["algo.routing_replay=rollout"],
                                        r"algo\.routing_replay=rollout needs an MoE model; model tiny is dense"),
    "routing_replay_on_sglang": (["model=tiny-qwen3-moe", "algo.routing_replay=rollout", "rollout.engine=sglang"],
                                 r"algo\.routing_replay=rollout with the colocated rollout\.engine=sglang: its routed "
                                 r"experts are not read yet"),
    "routing_replay_with_multi_turn": (["model=tiny-qwen3-moe", "algo.routing_replay=rollout",
                                        "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"],
                                       r"algo\.routing_replay=rollout with rollout\.multi_turn\.enable=true"),
    "routing_replay_with_full_recompute": (["model=tiny-qwen3-moe", "algo.routing_replay=rollout", "parallel.recompute=full"],
                                           r"algo\.routing_replay=rollout with parallel\.recompute=full"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_configuration(case, tmp_path):
    overrides, pattern = CONFIG_CASES[case]
    overrides = [o.replace("CKPT", str(tmp_path / "ckpt")) for o in overrides]
    _refused(_cli(tmp_path / "run", "run.steps=1", *overrides, fork=True), pattern)


@pytest.mark.parametrize("override,pattern", [
    ("algo.kl_coeff=0.1", r"Could not override 'algo\.kl_coeff'; Key 'kl_coeff' not in 'AlgoConfig'"),
    ("task=sucessor", r"In 'config': Could not find 'task/sucessor'; choose one of 'task': lookup_call, lookup_tool, product_tool, "
                      r"prompts, successor, tens_tool"),
    ("rollout.n=1.5", r"Error merging override rollout\.n=1\.5; Value '1\.5' of type 'float' could not be converted "
                      r"to Integer"),
])
def test_an_override_hydra_cannot_apply_is_one_line(override, pattern, tmp_path):
    """Hydra's own checks, run by the entry point before Hydra starts the run (in a new interpreter, the real entry
    path): a misspelt key named with its config group, an unknown task with the tasks there are, a value of the
    wrong type; one line, exit 2."""
    proc = _cli(tmp_path / "run", override, fork=False)
    _refused(proc, "^error: " + pattern + "\n$")
    assert proc.stdout == "", proc.stdout


LAYOUT_ERROR = ("error: model.num_layers=4 does not split over parallel.pp=3 stages: 4 layers remain for 3 stages "
                "and must divide evenly")


@pytest.mark.parametrize("launcher", ["grpo_mega.cli.torchrun", "torch.distributed.run"])
@pytest.mark.parametrize("override,line", [("parallel.pp=3", LAYOUT_ERROR),
                                           ("algo.kl_coeff=0.1", "error: Could not override 'algo.kl_coeff'; Key "
                                                                 "'kl_coeff' not in 'AlgoConfig'")])
def test_a_bad_override_under_torchrun_is_said_once(launcher, override, line, tmp_path):
    """`--nproc-per-node 2`, each rank a new interpreter: an override every rank refuses before torch.distributed
    starts (a layout that cannot be; a key Hydra does not know) is said by rank 0 alone, in one line.
    grpo_mega.cli.torchrun (slurm/train.sbatch's and launch_scripts/' launcher) exits 2 and adds nothing; plain
    torchrun adds its report of the failed ranks and exits 1 (it never passes a worker's status on)."""
    proc = run_tree([sys.executable, "-m", launcher, "--nproc-per-node", "2", "--master-port", str(_free_port()),
                     "-m", "grpo_mega.train", f"hydra.run.dir={tmp_path / 'run'}", override],
                    capture_output=True, text=True, timeout=300, cwd=ROOT)
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert said == [line], proc.stderr[-3000:]
    if launcher == "grpo_mega.cli.torchrun":
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", line + "\n")
    else:
        assert proc.returncode == 1 and "ChildFailedError" in proc.stderr, proc.stderr[-3000:]


def _free_port() -> int:
    from grpo_mega.processes import free_port

    return free_port()


def test_model_yaml_with_an_unknown_field(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text((ROOT / "model_configs" / "tiny.yaml").read_text() + "\nnum_experts_total: 8\n")
    _refused(_cli(tmp_path / "run", f"model={bad}", fork=False), r"mine\.yaml: unknown fields \['num_experts_total'\]; allowed:")


def test_moe_setting_in_a_dense_model_yaml(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text((ROOT / "model_configs" / "tiny.yaml").read_text() + "\nmoe_router_topk: 2\n")
    _refused(_cli(tmp_path / "run", f"model={bad}", fork=False),
             r"model\.moe_router_topk=2 is an MoE setting; model mine is dense \(family 'qwen2', no num_experts\)")


def test_model_yaml_with_a_number_yaml_reads_as_text(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text((ROOT / "model_configs" / "tiny.yaml").read_text().replace("rope_theta: 10000.0", "rope_theta: 5.0e5"))
    _refused(_cli(tmp_path / "run", f"model={bad}", fork=False),
             r"model\.rope_theta='5\.0e5' must be a positive number \(YAML reads 5\.0e5 as text: write 5\.0e\+5")


def test_hf_model_with_pickle_weights_is_refused(tmp_path):
    from tests.models.hf_fixtures import demo_settings, smollm2_dir

    d = tmp_path / "pickled"
    d.mkdir()
    for f in smollm2_dir().iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):  # the config and tokenizer, but pickled weights
            shutil.copy(f, d / f.name)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    data = _write_rows(tmp_path / "d.jsonl", [_row()])
    _refused(_cli(tmp_path / "run", "task=prompts", *demo_settings(), f"model={d}", f"data.train_files={data}", fork=True),
             r"pytorch_model\.bin: pickle files are never loaded; re-save with safe_serialization")


# ---- checkpoints -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint root with step 1 and step 2 of the tiny run."""
    d = tmp_path_factory.mktemp("saved")
    proc = _cli(d / "run", "run.steps=2", "eval.interval=2", f"checkpoint.dir={d / 'ckpt'}", "checkpoint.interval=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d / "ckpt"


def _copy(saved: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    return ckpt


def _model_file(step_dir: Path) -> Path:
    return next(p for p in sorted((step_dir / "model").iterdir()) if p.suffix == ".distcp")


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-7])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


CHECKPOINT_CASES = {
    "checkpoint_named_but_missing": (lambda c: c / "step_00000007", None, r"step_00000007: no such checkpoint"),
    "checkpoint_truncated": (lambda c: c / "step_00000002", lambda c: _truncate(_model_file(c / "step_00000002")),
                             r"step_00000002: model/.*\.distcp has \d+ bytes, the manifest says \d+ \(truncated\?\)"),
    "checkpoint_fails_checksum": (lambda c: c / "step_00000002", lambda c: _flip(_model_file(c / "step_00000002")),
                                  r"step_00000002: model/.*\.distcp fails its checksum \(corrupt\)"),
    "checkpoint_file_missing": (lambda c: c / "step_00000002", lambda c: (c / "step_00000002" / "loop_state.json").unlink(),
                                r"step_00000002: loop_state\.json is missing"),
    "checkpoint_without_manifest": (lambda c: c / "step_00000002", lambda c: (c / "step_00000002" / "manifest.json").unlink(),
                                    r"step_00000002: no manifest\.json; an interrupted or foreign checkpoint"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_bad_checkpoint_to_resume_from(case, saved, tmp_path):
    """checkpoint.resume=PATH names the one checkpoint to continue from: a broken one is an error, and no
    checkpoint in the directory is touched."""
    where, damage, pattern = CHECKPOINT_CASES[case]
    ckpt = _copy(saved, tmp_path)
    if damage:
        damage(ckpt)
    before = sorted(p.name for p in ckpt.iterdir())
    _refused(_cli(tmp_path / "run", "run.steps=3", f"checkpoint.resume={where(ckpt)}"), pattern)
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_resume_auto_when_no_checkpoint_verifies_is_an_error_not_a_restart(saved, tmp_path):
    """resume=auto with checkpoints present but none loadable must not quietly start again at step 0."""
    ckpt = _copy(saved, tmp_path)
    _flip(_model_file(ckpt / "step_00000001"))
    _truncate(_model_file(ckpt / "step_00000002"))
    proc = _cli(tmp_path / "run", "run.steps=3", f"checkpoint.dir={ckpt}")
    _refused(proc, r"checkpoint\.resume=auto: no checkpoint in .* verifies:[\s\S]*step_00000002[\s\S]*step_00000001"
                   r"[\s\S]*checkpoint\.resume=never to start over")
    assert (ckpt / "step_00000001").is_dir() and (ckpt / "step_00000002").is_dir()


def test_resume_from_an_older_checkpoint_into_a_dir_with_newer_ones_is_refused(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    proc = _cli(tmp_path / "run", "run.steps=3", f"checkpoint.dir={ckpt}", f"checkpoint.resume={ckpt / 'step_00000001'}")
    _refused(proc, r"already holds later checkpoints \(steps \[2\]\) that this run would overwrite")


def test_resume_with_a_kl_term_from_a_checkpoint_without_a_reference_is_refused(saved, tmp_path):
    """The fixture's run had kl_coef=0 (no reference model saved); a KL term needs the initial policy."""
    ckpt = _copy(saved, tmp_path)
    proc = _cli(tmp_path / "run", "run.steps=3", f"checkpoint.dir={ckpt}", "algo.kl_coef=0.01")
    _refused(proc, r"step_00000002 was saved without a reference model \(algo\.kl_coef=0\.0\).*Resume with algo\.kl_coef=0")


def test_resume_with_a_model_yaml_edited_in_place_is_refused(saved, tmp_path):
    """The checkpoint records the model it was trained with (model/grpo_mega.json): a YAML whose RoPE base and norm
    epsilon were edited since (same shapes: megatron would load it silently) is refused, naming both fields."""
    ckpt = _copy(saved, tmp_path)
    edited = tmp_path / "tiny.yaml"
    edited.write_text((ROOT / "model_configs" / "tiny.yaml").read_text().replace("rope_theta: 10000.0", "rope_theta: 500000.0")
                      .replace("norm_epsilon: 1.0e-6", "norm_epsilon: 1.0e-5"))
    proc = _cli(tmp_path / "run", "run.steps=3", f"checkpoint.dir={ckpt}", f"model={edited}")
    _refused(proc, r"step_00000002 was trained with another model \('tiny'\): norm_epsilon 1e-06 \(this run: 1e-05\), "
                   r"rope_theta 10000\.0 \(this run: 500000\.0\); resume with the model it was trained with")


def test_resume_with_another_model_is_refused_in_one_line(saved, tmp_path):
    """Another model's shapes: named field by field, before megatron's loader would fail with a shape traceback."""
    ckpt = _copy(saved, tmp_path)
    proc = _cli(tmp_path / "run", "run.steps=3", f"checkpoint.dir={ckpt}", "model=tiny-qwen3")
    _refused(proc, r"step_00000002 was trained with another model \('tiny'\): family 'qwen2' \(this run: 'qwen3'\), .*"
                   r"qk_layernorm False \(this run: True\)")


def test_a_checkpoint_directory_in_use_by_a_live_run_is_refused(saved, tmp_path):
    """The same job submitted twice: the second run must not write into the first one's checkpoints."""
    import socket

    ckpt = _copy(saved, tmp_path)
    (ckpt / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": "4242",
                                            "since": "2026-11-22 10:00:00"}))  # this pytest process: alive
    proc = _cli(tmp_path / "run", "run.steps=3", f"checkpoint.dir={ckpt}")
    _refused(proc, r"is in use by another run \(pid \d+ on .*, Slurm job 4242, since 2026-11-22 10:00:00\).*"
                   r"Use another checkpoint\.dir \(or --job-name\), or, if that run is over, delete .*\.lock")
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "step_00000001", "step_00000002"]


def test_export_tool_refuses_a_corrupt_checkpoint(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    _flip(_model_file(ckpt / "step_00000002"))
    proc = run_tree([sys.executable, "-m", "grpo_mega.cli.convert_to_hf", "--ckpt", str(ckpt / "step_00000002"),
                     "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    _refused(proc, r"error: .*step_00000002: model/.*fails its checksum")
    assert not (tmp_path / "hf").exists()


# ---- rewards ----------------------------------------------------------------------------------------------------

REWARD_CASES = {
    "reward_raises": ("tests.test_bad_inputs.raising_reward",
                      r"reward function 'raising_reward' failed on sample 0 \(data_source='toy_arith', response=.*\): KeyError"),
    "reward_returns_a_non_number": ("tests.test_bad_inputs.text_reward",
                                    r"reward function 'text_reward' failed on sample 0 .*returned 'correct'; a reward must be a finite number"),
    "reward_unknown_name": ("mathh", r"unknown reward function 'mathh'; valid: format, math, mix, reward_model"),
}


@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory):
    from tests.rewards.test_reward_model import tiny_rm

    return tiny_rm(tmp_path_factory.mktemp("rm"))


RM_ARGS = ["reward.name=reward_model", "reward.rm_train.interval=1", "batch.train_batch_size=4", "rollout.n=2",
           "batch.ppo_mini_batch_size=4", "batch.micro_batch_size=8", "eval.pass_k=1", "run.steps=1"]
REWARD_MODEL_CASES = {
    "rm_dir_without_a_classification_head": (
        lambda rm: ["reward.rm_train.interval=0", f"reward.path={smollm2_dir_str()}"],
        r"reward\.path=.*SmolLM2-135M-Instruct: architectures \['LlamaForCausalLM'\] has no sequence-classification head"),
    "rm_replay_fraction_one": (lambda rm: [f"reward.path={rm}", "reward.rm_train.labels=task", "reward.rm_train.replay_fraction=1"],
                               r"reward\.rm_train\.replay_fraction=1\.0 must be in \[0, 1\)"),
    "rm_label_source_raises": (lambda rm: [f"reward.path={rm}", "reward.rm_train.labels=tests.test_bad_inputs.raising_reward"],
                               r"label source 'raising_reward' failed on sample \d+ \(data_source='', response=.*\): KeyError"),
    "rm_label_source_returns_a_non_number": (
        lambda rm: [f"reward.path={rm}", "reward.rm_train.labels=tests.test_bad_inputs.text_reward"],
        r"label source 'text_reward' failed on sample \d+ .*returned 'correct'; a reward must be a finite number"),
}


def smollm2_dir_str() -> str:
    from tests.models.hf_fixtures import smollm2_dir

    return str(smollm2_dir())


@pytest.mark.parametrize("case", sorted(REWARD_MODEL_CASES))
def test_bad_reward_model_input(case, tiny_rm_dir, tmp_path):
    """A learned reward model on the toy task: its directory, its training settings, its label source."""
    overrides, pattern = REWARD_MODEL_CASES[case]
    _refused(_cli(tmp_path / "run", *RM_ARGS, *overrides(tiny_rm_dir)), pattern)


@pytest.mark.parametrize("case", sorted(REWARD_CASES))
def test_bad_reward_function(case, tmp_path):
    """With reward.on_error=raise (the default 'zero' scores the sample 0 and reports it)."""
    from tests.models.hf_fixtures import demo_settings, smollm2_dir

    name, pattern = REWARD_CASES[case]
    data = _write_rows(tmp_path / "d.jsonl", [_row(data_source="toy_arith"), _row("What is 3+4?", "7", data_source="toy_arith")])
    proc = _cli(tmp_path / "run", "task=prompts", *demo_settings(), f"model={smollm2_dir()}", f"data.train_files={data}",
                f"reward.name={name}",
                "reward.on_error=raise", "batch.train_batch_size=2", "rollout.n=2", "batch.ppo_mini_batch_size=2",
                "batch.micro_batch_size=4", "batch.max_response_length=2", "eval.pass_k=1", "run.steps=1")
    _refused(proc, pattern)


# ---- the rollout engine dies ------------------------------------------------------------------------------------

class _DyingEngine:
    """The embedded engine, until its process 'dies' on the second generate (as SGLangEngine reports it)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls > 2:  # after validation's two calls at step 0
            raise RuntimeError("the SGLang scheduler process exited (signal 9); see its log")
        return self.inner.generate(*args, **kwargs)


def _train_with_a_dying_engine():
    import torch

    from grpo_mega.conf import TrainConfig, load_model_config
    from grpo_mega.data.toy import SuccessorTask, make_tokenizer
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import init_distributed
    from grpo_mega.engines.embedded import EmbeddedEngine
    from grpo_mega.trainer.loop import train
    from grpo_mega.trainer.setup import Run
    from grpo_mega.data.tasks import Task

    tok = make_tokenizer()
    model = load_model_config("tiny")
    model.vocab_size = len(tok)
    t = SuccessorTask(tok, seed=0)
    task = Task(train_batch=t.train_batch, validation=t.validation, reward=t.reward, stop_token_ids=[tok.eos_token_id])
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=2, pp=1, seed=0)
        t0 = time.monotonic()
        try:
            cfg = TrainConfig(parallel=dict(tp=2), precision=dict(params_dtype="fp32"), optim=dict(lr=1e-3),
                              algo=dict(kl_coef=0.0), rollout=dict(n=2), run=dict(steps=3), eval=dict(interval=5, pass_k=2),
                              batch=dict(train_batch_size=4, ppo_mini_batch_size=4, micro_batch_size=8,
                                         max_response_length=3))
            train(Run(cfg, model, task, lambda: _DyingEngine(EmbeddedEngine.from_model_config(model, seed=0))))
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            return type(e).__name__, str(e), time.monotonic() - t0, torch.distributed.get_rank()
    return None


def test_a_dying_rollout_engine_is_an_error_on_every_rank():
    """The engine lives on rank 0; the other ranks wait for its samples in a broadcast. Its death must end
    every rank at once with the engine's own message, not leave rank 1 in the collective until its timeout."""
    from grpo_mega.parallel.forked import run_ranks

    results = run_ranks(_train_with_a_dying_engine, 2, timeout=180)
    assert [r[3] for r in results] == [0, 1]
    for name, msg, seconds, rank in results:
        assert name == "RolloutError", (rank, name, msg)
        assert "the rollout engine (_DyingEngine, on rank 0) failed: RuntimeError: the SGLang scheduler process exited" in msg
        assert seconds < 60


def test_the_corpus_has_at_least_25_cases():
    cases = (len(DATA_CASES) + len(CONFIG_CASES) + len(CHECKPOINT_CASES) + len(REWARD_CASES) + len(REWARD_MODEL_CASES)
             + sum(1 for name in globals() if name.startswith("test_") and name not in (
                 "test_bad_data_file", "test_bad_configuration", "test_bad_checkpoint_to_resume_from",
                 "test_bad_reward_function", "test_bad_reward_model_input", "test_the_corpus_has_at_least_25_cases")))
    assert cases >= 25, cases
