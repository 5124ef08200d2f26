"""grpo_mega/cli/plan.py (grpo-mega-plan) and grpo_mega/planning.py: the parameter arithmetic against megatron's own build on the meta
device (one rank at a time under a fake process group, no weights), the activation formula by hand, refusal
of a layout that cannot fit with suggestions that do, and the launch scripts' overrides composed by Hydra
into the typed configs and checked against 64 GPUs, all without allocating a weight."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_mega import planning
from grpo_mega.conf.batch import BatchConfig
from grpo_mega.conf.parallel import ParallelConfig
from grpo_mega.conf.model import load_model_config


REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {  # launch script -> (model, training GPUs, tp, pp)
    "qwen2.5-7b.sh": ("qwen2.5-7b", 8, 4, 1),
    "llama-3.1-70b.sh": ("llama-3.1-70b", 64, 8, 4),
    "llama-3.1-70b-lora.sh": ("llama-3.1-70b", 8, 8, 1),
    "qwen2.5-72b.sh": ("qwen2.5-72b", 64, 8, 4),
    "qwen3-8b.sh": ("qwen3-8b", 8, 4, 1),
    "qwen3-32b.sh": ("qwen3-32b", 32, 8, 2),
    "qwen3-30b-a3b.sh": ("qwen3-30b-a3b", 32, 4, 1),
    "qwen3-30b-a3b-lora.sh": ("qwen3-30b-a3b", 8, 2, 1),
    "qwen3-235b-a22b.sh": ("qwen3-235b-a22b", 128, 4, 2),
}
EP = {"qwen3-30b-a3b.sh": 8, "qwen3-30b-a3b-lora.sh": 4, "qwen3-235b-a22b.sh": 16}  # expert parallelism of the MoE scripts (1 elsewhere)
ROLLOUT_NODES = {"qwen3-235b-a22b.sh": 4}  # dedicated SGLang server nodes (0 elsewhere: colocated)
LORA_SCRIPTS = {"llama-3.1-70b-lora.sh": 16, "qwen3-30b-a3b-lora.sh": 16}  # lora.rank of the LoRA scripts (null elsewhere); planned with --verify
ENGINES = {"llama-3.1-70b-lora.sh": (8, 1), "qwen3-30b-a3b-lora.sh": (8, 1)}  # (engine tp, engines) where not one engine per node (tp 8) or per GPU
# The scripts read these from the environment; the tests plan their defaults.
_SCRIPT_VARS = {"NODES", "MODEL", "DATA", "VAL_DATA", "STEPS", "TP", "PP", "EP", "RECOMPUTE", "PROMPTS", "N",
                "MINI_BATCH", "MICRO_BATCH", "PROMPT_LEN", "RESPONSE_LEN", "LR", "KL_COEF", "CKPT_INTERVAL", "JOB_NAME",
                "ROLLOUT_NODES", "ENGINE_TP", "ENGINES", "ENGINE_MEM", "LORA_RANK", "LORA_ALPHA"}


def _env():
    return {k: v for k, v in os.environ.items() if k not in _SCRIPT_VARS}


def _plan_cli(*args, check_rc=None):
    res = subprocess.run([sys.executable, "-m", "grpo_mega.cli.plan", *args], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env=_env())
    if check_rc is not None:
        assert res.returncode == check_rc, res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def plan_tool():
    from grpo_mega.cli import plan

    return plan


@pytest.fixture(scope="module")
def launch_plans():
    """plan.py --from-launch-script --json for each launch script (what it would submit, sbatch recorded); the LoRA
    scripts with --verify (the adapters counted on the meta build too)."""
    out = {}
    for name in SCRIPTS:
        verify = ["--verify"] if name in LORA_SCRIPTS else []
        res = _plan_cli("--from-launch-script", str(REPO / "launch_scripts" / name), "--json", *verify, check_rc=0)
        out[name] = json.loads(res.stdout)
    return out


# ---- parameters: planner vs megatron on the meta device ------------------------------------------------


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_launch_script_layout_fits_and_params_match_meta_build(name, launch_plans):
    model_name, gpus, tp, pp = SCRIPTS[name]
    p = launch_plans[name]
    assert (p["model"], p["world_size"], p["tp"], p["pp"]) == (model_name, gpus, tp, pp)
    assert p["fits"] and p["headroom_gib"] > 0 and p["reason"] == ""
    assert p["sequence_parallel"] and p["params_dtype"] == "bf16" and p["distributed_optimizer"]
    assert p["ep"] == EP.get(name, 1)
    # the colocated engine's share is accounted (the run's rollout.gpu_memory_fraction); dedicated servers hold none
    assert (p["engine_gib"] > 0) == (name not in ROLLOUT_NODES)
    assert set(p["per_gpu_gib"]) == set(planning.COMPONENTS)
    model = load_model_config(model_name)
    if name in LORA_SCRIPTS:  # the frozen base and the adapters, no reference; the meta build's rows from --verify
        assert (p["lora_rank"], p["reference"], p["layer_spec"]) == (LORA_SCRIPTS[name], "none", "local")
        assert p["per_gpu_gib"]["reference"] == 0
        rows = p["verify"]
        for r, stage in zip(rows, p["stages"]):
            assert r["planner_adapter_numel"] == r["meta_adapter_numel"] == stage["adapter_numel"] > 0, r
            assert stage["frozen_bytes"] == stage["param_bytes"]
    else:
        par = ParallelConfig(tp=tp, pp=pp, ep=EP.get(name, 1), sequence_parallel=True)
        rows = planning.compare_with_meta(model, par, gpus)
    assert [r["stage"] for r in rows] == list(range(pp))  # first, middle and last stages all checked
    for r, stage in zip(rows, p["stages"]):
        assert r["planner_bytes"] == r["meta_bytes"] == stage["param_bytes"], r  # exact, well within 2%
    worst_params = max(s["param_bytes"] for s in p["stages"])
    assert worst_params == max(r["meta_bytes"] for r in rows)


@pytest.mark.parametrize("model_name,world,par", [
    ("smollm2-135m", 4, dict(tp=1, pp=2)),  # tied embeddings: the last stage keeps its own output weight
    ("qwen2.5-0.5b", 2, dict(tp=2, pp=1)),  # tied, pp=1: one embedding matrix; qkv bias split over TP
    ("qwen3-32b", 16, dict(tp=8, pp=2)),  # q/k norms replicated; head_dim 128 != hidden/heads 80
    ("llama-3.1-70b", 64, dict(tp=8, pp=8)),
    ("llama-3.1-70b", 64, dict(tp=4, pp=4, num_layers_in_first_pipeline_stage=18,
                               num_layers_in_last_pipeline_stage=18)),  # uneven: 18 + 22 + 22 + 18
])
def test_stage_params_equal_meta_build(model_name, world, par):
    model = load_model_config(model_name)
    rows = planning.compare_with_meta(model, ParallelConfig(**par), world)
    assert all(r["planner_numel"] == r["meta_numel"] for r in rows), rows


@pytest.mark.parametrize("name", list(EP))
def test_verify_flag_on_the_moe_launch_scripts(name):
    res = _plan_cli("--from-launch-script", str(REPO / "launch_scripts" / name), "--verify", "--json", check_rc=0)
    rows = json.loads(res.stdout)["verify"]
    assert len(rows) == SCRIPTS[name][3] and all(r["rel_diff"] == 0 for r in rows)


@pytest.mark.parametrize("name", ["llama-3.1-70b.sh", "llama-3.1-70b-lora.sh"])
def test_verify_flag_on_the_70b_launch_scripts(name, launch_plans):
    if name in LORA_SCRIPTS:  # the fixture planned it with --verify (exit status 0: no difference over 2%)
        rows = launch_plans[name]["verify"]
        assert all(r["planner_adapter_numel"] == r["meta_adapter_numel"] for r in rows)
    else:
        res = _plan_cli("--from-launch-script", str(REPO / "launch_scripts" / name), "--verify", "--json", check_rc=0)
        rows = json.loads(res.stdout)["verify"]
    assert len(rows) == SCRIPTS[name][3] and all(r["rel_diff"] == 0 for r in rows)


def test_70b_lora_fits_one_node_where_full_training_fits_none(launch_plans):
    """The LoRA script's layout is the fewest nodes there are (one); the same 8 GPUs refuse every layout of the
    full-parameter run (the frozen base and no reference are what make it fit)."""
    lora = launch_plans["llama-3.1-70b-lora.sh"]
    assert lora["world_size"] == 8 and lora["fits"]
    model = load_model_config("llama-3.1-70b")
    full = planning.PlanInput(model=model, parallel=ParallelConfig(tp=8, sequence_parallel=True), world_size=8,
                              engine_gib=lora["engine_gib"], num_microbatches=lora["num_microbatches"])
    assert not planning.plan(full).fits
    batch = BatchConfig(train_batch_size=64, ppo_mini_batch_size=16, micro_batch_size=1)
    assert planning.suggest(full, batch, n=8) == []


# ---- activations by hand -----------------------------------------------------------------------------


def test_layer_activations_by_hand():
    m = load_model_config("llama-3.1-70b")  # h 8192, q 8192, k 1024, f 28672 = 3.5h, 64 heads
    s, b, h, t = 4096, 1, 8192, 8
    sbh = s * b * h
    # per token: 8h kept whole (norm inputs, QKV and fc1 inputs) + (4q + 4k + 6f) = 25.5h split over TP
    assert planning.layer_activation_bytes(m, s, b, 1, False, "none") == sbh * 33.5
    assert planning.layer_activation_bytes(m, s, b, t, False, "none") == sbh * (8 + 25.5 / t)
    assert planning.layer_activation_bytes(m, s, b, t, True, "none") == sbh * 33.5 / t
    assert planning.layer_activation_bytes(m, s, b, t, True, "selective") == sbh * 33.5 / t
    # unfused attention without selective recompute: the paper's 5as^2b, split over TP
    unfused = planning.layer_activation_bytes(m, s, b, t, True, "none", flash_attention=False)
    assert unfused == sbh * 33.5 / t + 5 * 64 * s * s * b / t
    assert planning.layer_activation_bytes(m, s, b, t, True, "selective", flash_attention=False) == sbh * 33.5 / t
    assert planning.layer_activation_bytes(m, s, b, t, True, "full") == 2 * sbh / t
    assert planning.layer_activation_bytes(m, s, b, t, False, "full") == 2 * sbh
    # FP8 GEMM inputs (QKV, proj, fc1, fc2 inputs) at one byte
    assert planning.layer_activation_bytes(m, s, b, 1, False, "none", fp8=True) == sbh * (33.5 - 1 - 1 - 1 - 3.5)


def test_qwen3_activations_by_hand():
    import dataclasses

    m = load_model_config("qwen3-8b")  # h 4096, q 4096 = h, k 1024 = h/4, f 12288 = 3h
    s, b, h, t = 4096, 1, 4096, 8
    sbh = s * b * h
    # 8h kept whole; split: 2q + 4k + 2q + 6f = 23h, and the q/k norms' inputs 2q + 2k = 2.5h
    assert planning.layer_activation_bytes(m, s, b, 1, False, "none") == sbh * 33.5
    assert planning.layer_activation_bytes(m, s, b, t, False, "none") == sbh * (8 + 25.5 / t)
    no_qk = dataclasses.replace(m, family="llama", qk_layernorm=False)
    assert planning.layer_activation_bytes(no_qk, s, b, t, False, "none") == sbh * (8 + 23 / t)


def test_1f1b_stage_holds_pp_minus_stage_micro_batches():
    m = load_model_config("llama-3.1-70b")
    inp = planning.PlanInput(model=m, parallel=ParallelConfig(tp=8, pp=4, sequence_parallel=True), world_size=64)
    p = planning.plan(inp)
    assert [s.in_flight for s in p.stages] == [4, 3, 2, 1]
    per_stage = [s.gib["activations"] for s in p.stages]
    assert per_stage[0] == pytest.approx(4 * per_stage[3], rel=1e-4)  # + the token and position ids
    assert p.stages[3].gib["logits"] > 0 and p.stages[0].gib["logits"] == 0
    few = planning.plan(planning.PlanInput(model=m, parallel=inp.parallel, world_size=64, num_microbatches=2))
    assert [s.in_flight for s in few.stages] == [2, 2, 2, 1]


def test_model_states_bytes_per_parameter():
    m = load_model_config("qwen2.5-7b")
    par = ParallelConfig(tp=4, pp=1, sequence_parallel=True)
    n = planning.stage_params(m, par)[0].total
    p = planning.plan(planning.PlanInput(model=m, parallel=par, world_size=8)).stages[0].gib  # dp = 2
    G = planning.GIB
    assert p["parameters"] == pytest.approx(n * (2 + 4 / 2) / G)  # bf16 weights + fp32 main shard
    assert p["gradients"] == pytest.approx(n * 4 / G)  # fp32 grad buffer
    assert p["optimizer"] == pytest.approx(n * 8 / 2 / G)  # Adam m, v sharded over dp
    assert p["reference"] == pytest.approx(n * 2 / G)
    rep = planning.plan(planning.PlanInput(model=m, parallel=par, world_size=8, distributed_optimizer=False,
                                           reference="none")).stages[0].gib
    assert (rep["parameters"], rep["optimizer"], rep["reference"]) == pytest.approx((n * 6 / G, n * 8 / G, 0.0))


# ---- refusal and suggestions -------------------------------------------------------------------------


def test_refuses_70b_on_one_gpu_per_replica_and_suggests_layouts_that_fit():
    res = _plan_cli("--model", "llama-3.1-70b", "--nodes", "8", "--tp", "1", "--pp", "1", "--engine-mem", "0.3",
                    "--json", check_rc=1)
    out = json.loads(res.stdout)
    assert not out["fits"]
    assert "parameters" in out["reason"] and "does not fit" in out["reason"]
    assert "refused:" in res.stderr and "parameters" in res.stderr
    assert out["suggestions"]
    model = load_model_config("llama-3.1-70b")
    for s in out["suggestions"]:
        assert s["tp"] * s["pp"] * s["dp"] == 64 and s["tp"] <= 8
        inp = planning.PlanInput(
            model=model, world_size=64, micro_batch_size=s["micro_batch_size"], engine_gib=s["engine_gib"],
            parallel=ParallelConfig(tp=s["tp"], pp=s["pp"], sequence_parallel=s["sequence_parallel"],
                                    recompute=s["recompute"]),
        )
        again = planning.plan(inp)
        assert again.fits and again.total_gib == pytest.approx(s["total_gib"])

    table = _plan_cli("--model", "llama-3.1-70b", "--nodes", "8", "--engine-mem", "0.3", check_rc=1).stdout
    assert "refused:" in table and "layouts of the same GPUs that fit:" in table


def test_reason_names_activations_when_they_overflow():
    m = load_model_config("llama-3.1-70b")
    inp = planning.PlanInput(model=m, parallel=ParallelConfig(tp=8, pp=4, sequence_parallel=True), world_size=64,
                             micro_batch_size=4, engine_gib=0.3 * planning.H100_GIB)
    p = planning.plan(inp)
    assert not p.fits and "activations" in p.reason and "stage 0" in p.reason
    batch = BatchConfig(train_batch_size=64, ppo_mini_batch_size=16, micro_batch_size=4)
    suggestions = planning.suggest(inp, batch, n=8)
    assert suggestions
    for s in suggestions:
        assert s.fits
        BatchConfig(train_batch_size=64, ppo_mini_batch_size=16,
                    micro_batch_size=s.input.micro_batch_size).check_dp(s.input.dp, 8)


def test_invalid_layout_is_an_error_not_a_refusal():
    res = _plan_cli("--model", "qwen2.5-7b", "--gpus", "7", "--tp", "7", check_rc=2)
    assert "parallel.tp=7 must divide num_query_groups=4" in res.stderr  # 7 divides the 28 heads


# ---- launch scripts: Hydra composes their overrides into valid typed configs -----------------------------


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_launch_script_overrides_compose_and_validate(name, plan_tool, monkeypatch):
    """The README's 70B overrides (and the 7B/72B ones) compose with Hydra against the real schema and pass
    every typed config's validation, the layout check at the script's GPU count and the batch split; no
    weights are allocated."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from grpo_mega.conf.schema import TrainConfig, register_schema

    register_schema()

    for var in _SCRIPT_VARS:
        monkeypatch.delenv(var, raising=False)
    model_name, gpus, tp, pp = SCRIPTS[name]
    options, overrides, flags = plan_tool.record_launch_script(str(REPO / "launch_scripts" / name), ["run.steps=3"])
    assert f"--nodes={gpus // 8 + ROLLOUT_NODES.get(name, 0)}" in options and "--gpus-per-node=8" in options
    assert overrides[-1] == "run.steps=3"  # "$@" is appended after the script's own overrides
    assert flags == []  # everything the plan needs is in the run's own config
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="grpo_mega.conf", version_base=None):
        cfg = compose(config_name="config", overrides=plan_tool.sbatch_defaults(options) + overrides)
    c = OmegaConf.to_container(cfg, resolve=True)
    assert c["model"] == model_name and c["task"] == "prompts" and c["reward"]["name"] == "math"
    assert c["run"]["steps"] == 3 and c["data"]["train_files"].endswith("train.parquet")
    typed = TrainConfig.from_hydra(cfg)  # every component validates itself, the root the combinations
    rollout, batch, parallel, precision, optim = typed.rollout, typed.batch, typed.parallel, typed.precision, typed.optim
    assert (parallel.tp, parallel.pp, parallel.ep, parallel.sequence_parallel) == (tp, pp, EP.get(name, 1), True)
    assert precision.params_dtype == "bf16" and optim.use_distributed_optimizer and rollout.engine == "sglang"
    assert typed.lora.rank == LORA_SCRIPTS.get(name)
    if name in ENGINES:
        assert (rollout.engine_tp, rollout.num_engines) == ENGINES[name]
    assert rollout.gpu_memory_fraction == 0.3 and rollout.engine_tp == ENGINES.get(name, (8 if gpus > 8 else 1,))[0]
    if name in ROLLOUT_NODES:  # dedicated servers: train.sbatch starts them and adds placement and servers
        assert f"--export=ALL,GRPO_MEGA_ROLLOUT_NODES={ROLLOUT_NODES[name]},GRPO_MEGA_SERVER_MODEL={model_name}" in options
        assert rollout.num_engines == 1
    elif name not in ENGINES:
        assert rollout.num_engines == (gpus // 8 if gpus > 8 else 8) and gpus % rollout.num_engines == 0  # per node or GPU
    dp = parallel.check(load_model_config(model_name), world_size=gpus)
    assert dp == gpus // (tp * pp)
    batch.check_dp(dp, rollout.n)


def test_recorder_refuses_scripts_that_do_not_submit(plan_tool, tmp_path):
    script = tmp_path / "local.sh"
    script.write_text("#!/bin/bash\npython -m grpo_mega.train parallel.tp=2\n")
    with pytest.raises(ValueError, match="does not submit with sbatch"):
        plan_tool.record_launch_script(str(script), [])


def test_the_readmes_70b_command_composes_validates_and_fits(plan_tool):
    """The sbatch command in README.md's 70B section, parsed as the shell would: its overrides compose with
    Hydra against the real schema, every typed config validates, the layout fits 64 GPUs, the batch splits
    over DP, and the planner says it fits an H100 with the engine's share - no weights allocated."""
    import re
    import shlex

    readme = (REPO / "README.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "--nodes=8" in b and "slurm/train.sbatch" in b]
    assert len(blocks) == 1, "README.md should hold exactly one 8-node sbatch command"
    words = shlex.split(blocks[0].replace("\\\n", " "))
    script = words.index("slurm/train.sbatch")
    options, overrides = words[1:script], words[script + 1:]
    assert words[0] == "sbatch" and plan_tool.sbatch_option(options, "--nodes") == "8"
    gpus = 8 * int(plan_tool.sbatch_option(options, "--gpus-per-node"))
    c = plan_tool.compose(plan_tool.sbatch_defaults(options) + overrides)
    assert c["raw"]["model"] == "/ckpts/Llama-3.1-70B-Instruct"  # a placeholder path: plan the same architecture
    model = load_model_config("llama-3.1-70b")
    dp = c["parallel"].check(model, world_size=gpus)
    c["batch"].check_dp(dp, c["rollout"].n)
    assert (c["parallel"].tp, c["parallel"].pp, dp) == (8, 4, 2)
    inp = planning.PlanInput(
        model=model, parallel=c["parallel"], world_size=gpus, micro_batch_size=c["batch"].micro_batch_size,
        seq_length=c["batch"].max_prompt_length + c["batch"].max_response_length,
        params_dtype=c["precision"].params_dtype, distributed_optimizer=c["optim"].use_distributed_optimizer,
        engine_gib=c["rollout"].gpu_memory_fraction * planning.H100_GIB)
    result = planning.plan(inp)
    assert result.fits, result


# ---- model states against megatron's real allocations ----------------------------------------------------


def _mid_model():
    from grpo_mega.conf.model import ModelConfig

    return ModelConfig(name="mid", family="qwen2", num_layers=4, hidden_size=256, ffn_hidden_size=704,
                       num_attention_heads=8, num_query_groups=4, vocab_size=8000, qkv_bias=True)


def _allocated_state_bytes(tp: int, pp: int, model_name: str | None = None, ep: int = 1, lora=None) -> dict:
    """On one rank: build the bf16 actor (Megatron DDP + DistributedOptimizer; with `lora`, a LoraConfig, the base
    frozen and adapters added), run one real GRPO update so that Adam's state exists, and add up the distinct
    storages megatron allocated for the weights (the frozen ones and the trained ones apart), the gradient
    buffers, and the optimizer's fp32 main weights and Adam moments."""
    import torch
    from megatron.core import parallel_state as ps

    from grpo_mega import algo
    from grpo_mega.conf import AlgoConfig, OptimConfig, PrecisionConfig
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed
    from grpo_mega.trainer.actor import Actor
    from grpo_mega.trainer.batch import RolloutBatch

    def storage_bytes(tensors) -> int:
        seen = {}
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    model = load_model_config(model_name) if model_name else _mid_model()
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=pp, seed=0, ep=ep)
        actor = Actor(model, ParallelConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1 and model.is_moe),
                      PrecisionConfig(params_dtype="bf16"),
                      OptimConfig(lr=1e-4, use_distributed_optimizer=True), AlgoConfig(kl_coef=0.0),
                      BatchConfig(train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size=2, max_response_length=4),
                      lora=lora)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.vocab_size, (5,), generator=g).tolist()] * 2 + \
                  [torch.randint(0, model.vocab_size, (3,), generator=g).tolist()] * 2
        batch = RolloutBatch.from_samples(prompts, [torch.randint(0, model.vocab_size, (4,), generator=g).tolist() for _ in range(4)])
        batch.advantages = algo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), n=2).float()
        batch.old_logp = actor.logprobs(batch, 1.0)
        (metrics,) = actor.update(batch, 1.0)
        ddp = actor.built.module
        # with experts, megatron chains two optimizers (dense and expert parameters), each its own torch one
        inners = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
        states = [v for inner in inners for st in inner.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.dim() > 0]
        main = [p for inner in inners for group in inner.param_groups for p in group["params"]]
        buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
        out = dict(
            stage=ps.get_pipeline_model_parallel_rank(),
            weights=storage_bytes(p for p in ddp.module.parameters()),
            frozen=storage_bytes(p for p in ddp.module.parameters() if not p.requires_grad),
            trained=storage_bytes(p for p in ddp.module.parameters() if p.requires_grad),
            trained_numel=sum(p.numel() for p in ddp.module.parameters() if p.requires_grad),
            gradients=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            main=storage_bytes(main), adam=storage_bytes(states),
            grad_norm=metrics["grad_norm"],
        )
        destroy_distributed()
    return out


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_model_state_bytes_match_megatrons_allocations(tp, pp):
    """Parameters + gradients + optimizer state per GPU, as planned, against what megatron-core really
    allocates on each of 4 CPU ranks (TP2xDP2 and PP2xDP2, bf16, distributed optimizer, after a real update):
    within 2% per component (megatron may pad its buffers to DP- and bucket-multiples; here it is exact)."""
    from grpo_mega.parallel.forked import run_ranks

    ranks = run_ranks(_allocated_state_bytes, 4, tp, pp, timeout=300)
    assert all(r["grad_norm"] > 0 for r in ranks)
    plan = planning.plan(planning.PlanInput(model=_mid_model(), parallel=ParallelConfig(tp=tp, pp=pp), world_size=4,
                                            params_dtype="bf16", distributed_optimizer=True, reference="none"))
    for r in ranks:
        gib = plan.stages[r["stage"]].gib
        got = {"parameters": (r["weights"] + r["main"]) / planning.GIB, "gradients": r["gradients"] / planning.GIB,
               "optimizer": r["adam"] / planning.GIB}
        for key, value in got.items():
            assert value == pytest.approx(gib[key], rel=0.02), (tp, pp, r["stage"], key, value, gib[key])


@pytest.mark.parametrize("tp,pp,world", [(1, 1, 2), (1, 1, 4), (2, 1, 4), (1, 2, 4)])
def test_moe_model_state_bytes_equal_megatrons_allocations(tp, pp, world):
    """tiny-qwen3-moe at EP2 (dp2; dp4 with each expert on 2 expert-DP ranks; TP2xEP2; PP2xEP2), bf16, the
    DistributedOptimizer (megatron chains a dense and an expert optimizer), after a real update, against the
    storages megatron allocated. To the byte on every rank: the weights and gradients (DDP's dense and expert
    buffers, padding included: 320 elements here, from the 32-wide q/k norms and the bucket end). The fp32 main
    weights and Adam moments: the planner gives the mean over a DP group (dense over dp, experts over dp / ep);
    megatron's shards of the padded buffers differ by a few elements from rank to rank (up to 512 bytes here),
    so their sum over each stage's ranks is held to the byte."""
    from grpo_mega.parallel.forked import run_ranks

    ranks = run_ranks(_allocated_state_bytes, world, tp, pp, "tiny-qwen3-moe", 2, timeout=300)
    assert all(r["grad_norm"] > 0 for r in ranks)
    model, par = load_model_config("tiny-qwen3-moe"), ParallelConfig(tp=tp, pp=pp, ep=2, sequence_parallel=tp > 1)
    plan = planning.plan(planning.PlanInput(model=model, parallel=par, world_size=world, params_dtype="bf16",
                                            distributed_optimizer=True, reference="none"))
    buffers = planning.grad_buffer_numel(model, par, world // (tp * pp))
    assert all(s.expert_numel > 0 for s in plan.stages)
    for stage, st in enumerate(plan.stages):
        mine = [r for r in ranks if r["stage"] == stage]
        assert len(mine) == world // pp
        weights = 2 * sum(buffers[stage])
        for r in mine:
            assert r["weights"] == weights, (stage, r["weights"], weights)
            assert r["gradients"] == st.gib["gradients"] * planning.GIB, (stage, r["gradients"])
        main = (st.gib["parameters"] * planning.GIB - weights) * len(mine)
        adam = st.gib["optimizer"] * planning.GIB * len(mine)
        assert sum(r["main"] for r in mine) == pytest.approx(main, abs=1e-6), (stage, [r["main"] for r in mine], main)
        assert sum(r["adam"] for r in mine) == pytest.approx(adam, abs=1e-6), (stage, [r["adam"] for r in mine], adam)
        print(f"tiny-qwen3-moe TP{tp}xPP{pp}xEP2 on {world} ranks, stage {stage}: weights {weights} B, gradients "
              f"{mine[0]['gradients']} B, main {[r['main'] for r in mine]} (planned mean {main / len(mine):.0f}), "
              f"Adam {[r['adam'] for r in mine]} (planned mean {adam / len(mine):.0f})")


@pytest.mark.parametrize("model_name,tp,ep,world,rank", [(None, 2, 1, 4, 3), ("tiny-qwen3-moe", 1, 2, 2, 8),
                                                         ("tiny-qwen3-moe", 2, 1, 2, 8)],
                         ids=["dense-TP2xDP2", "moe-EP2", "moe-TP2-SP"])
def test_lora_model_state_bytes_equal_megatrons_allocations(model_name, tp, ep, world, rank):
    """Under LoRA the planner's model states against what megatron-core allocates
    after a real update, to the byte: the frozen base's weights (their own storages, no grad buffer), the adapters
    (this rank's count; as lora.py shards them over TP), DDP's buffers of them (bf16 weights, fp32 gradients,
    padding included: at rank 3 fc2's A [3, 704 / 2] is no multiple of 64 elements), and the fp32 main weights
    and Adam moments summed over each stage's ranks (the planner gives the mean; megatron's shards of the padded buffer
    differ by a few elements from rank to rank). The mid qwen2 model at TP2xDP2 (qkv, proj, fc1, fc2; qkv bias
    frozen), tiny-qwen3-moe at EP2 with every target (its dense layer 2's fc1 and fc2, each MoE layer's router and
    this rank's 4 experts' fc1 and fc2: the expert adapters in megatron's expert buffer over expert DP, sharded by
    the optimizer over dp / ep = 1 rank), and at TP2+SP (all 8 experts and their adapters split over expert TP, in
    the one dense buffer). No reference model is planned."""
    from grpo_mega.conf.lora import LoraConfig
    from grpo_mega.parallel.forked import run_ranks

    from grpo_mega.conf.lora import LORA_TARGETS

    lora = LoraConfig(rank=rank, alpha=16.0, **({"target_modules": list(LORA_TARGETS)} if model_name else {}))
    ranks = run_ranks(_allocated_state_bytes, world, tp, 1, model_name, ep, lora, timeout=300)
    assert all(r["grad_norm"] > 0 for r in ranks)
    model = load_model_config(model_name) if model_name else _mid_model()
    par = ParallelConfig(tp=tp, ep=ep, sequence_parallel=tp > 1 and model.is_moe)
    plan = planning.plan(planning.PlanInput(model=model, parallel=par, world_size=world, params_dtype="bf16",
                                            distributed_optimizer=True, reference="none", layer_spec="local",
                                            lora_rank=lora.rank, lora_targets=tuple(lora.target_modules)))
    (st,) = plan.stages
    G = planning.GIB
    assert st.gib["reference"] == 0 and 0 < st.adapter_numel < st.param_numel
    assert st.adapter_buffer_numel > st.adapter_numel  # padded (the MoE case: its expert buffer over 1 rank)
    expert = st.adapter_expert_numel
    assert (expert > 0) == (ep > 1)
    adapter_weights = 2 * st.adapter_buffer_numel
    main_mean = st.gib["parameters"] * G - st.frozen_bytes - adapter_weights
    for r in ranks:
        assert r["frozen"] == st.frozen_bytes == 2 * st.param_numel, (r["frozen"], st.frozen_bytes)
        assert r["trained_numel"] == st.adapter_numel, (r["trained_numel"], st.adapter_numel)
        assert r["trained"] == adapter_weights, (r["trained"], adapter_weights)
        assert r["gradients"] == st.gib["gradients"] * G == 4 * st.adapter_buffer_numel, (r["gradients"], st.gib)
    # summed over the ranks: the dense adapters once per TP rank, each EP rank's own experts' once
    once = (st.adapter_numel - expert) * tp + expert * ep
    assert sum(r["main"] for r in ranks) == pytest.approx(main_mean * world, abs=1e-6) == 4 * once
    assert sum(r["adam"] for r in ranks) == pytest.approx(st.gib["optimizer"] * G * world, abs=1e-6)
    assert sum(r["adam"] for r in ranks) == 8 * once
    print(f"LoRA rank {rank}, {model.name} TP{tp}xEP{ep} on {world} ranks: frozen {st.frozen_bytes} B, adapters "
          f"{st.adapter_numel} ({adapter_weights} B in the padded buffer), gradients {4 * st.adapter_buffer_numel} B, "
          f"main {[r['main'] for r in ranks]}, Adam {[r['adam'] for r in ranks]}")


# ---- the local spec's activations, measured ----------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_local_spec_activations_equal_what_autograd_saves(name):
    """The local spec's per-layer formula against the bytes autograd really saves (bench/activations.py:
    distinct storages, parameters excluded, a 2-layer model less a 1-layer one), bf16, to the byte. Qwen2 has GQA
    and no q/k norms; Qwen3 has q/k norms and head_dim != hidden/heads."""
    import dataclasses

    from bench import activations as bench
    from grpo_mega.parallel.forked import run_ranks

    seq, micro = 128, 2
    base = dataclasses.replace(load_model_config(name), vocab_size=512, tie_word_embeddings=False)
    for recompute in ("none", "selective"):
        got = [run_ranks(bench._saved_bytes, 1, dataclasses.replace(base, num_layers=n), seq, micro, recompute,
                         timeout=300)[0] for n in (1, 2)]
        planned = planning.layer_activation_bytes(base, seq, micro, 1, False, recompute, layer_spec="local")
        assert got[1] - got[0] == planned, (name, recompute, got[1] - got[0], planned)
    with pytest.raises(ValueError, match="layer_spec='fused' must be one of"):
        planning.layer_activation_bytes(base, seq, micro, 1, False, "none", layer_spec="fused")


def _lora_saved_bytes_per_layer(model, seq: int, micro: int, tp: int, sp: bool, rank: int) -> int:
    """What LoRA (rank `rank` on all four targets) changes in the bytes autograd saves per layer on one rank, local
    spec, bf16: (LoRA model with 2 layers - with 1) - (the trained model with 2 layers - with 1), so the embedding
    and the output side cancel (bench/activations.py's measure: distinct storages, parameters excluded)."""
    import dataclasses

    import torch

    from grpo_mega.conf.lora import LoraConfig
    from grpo_mega.conf.optim import PrecisionConfig
    from grpo_mega.models.builder import build_gpt
    from grpo_mega.models.lora import apply_lora
    from grpo_mega.parallel import cpu_compat
    from grpo_mega.parallel.state import destroy_distributed, init_distributed

    out = {}
    with cpu_compat.cpu_device_mode():
        init_distributed(tp=tp, pp=1, seed=0)
        for layers in (1, 2):
            for r in (None, rank):
                gpt, _ = build_gpt(dataclasses.replace(model, num_layers=layers),
                                   ParallelConfig(tp=tp, sequence_parallel=sp), PrecisionConfig(params_dtype="bf16"))
                if r:
                    apply_lora(gpt, LoraConfig(rank=r))
                params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
                seen: dict[int, int] = {}

                def pack(t):
                    st = t.untyped_storage()
                    if st.data_ptr() not in params and st.nbytes() > 0:
                        seen[st.data_ptr()] = st.nbytes()
                    return t

                g = torch.Generator().manual_seed(0)
                tokens = torch.randint(0, model.vocab_size, (micro, seq), generator=g)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    gpt(tokens, torch.arange(seq).expand(micro, seq).contiguous(), None)
                out[layers, r] = sum(seen.values())
        destroy_distributed()
    return (out[2, rank] - out[1, rank]) - (out[2, None] - out[1, None])


def test_lora_activations_equal_what_autograd_saves():
    """planning.lora_activation_bytes against the bytes autograd really saves, at TP2 with sequence parallelism
    (every term: the frozen norms' fp32 tensors not kept, /tp; the column adapters' all-gathered inputs kept whole;
    the rank-r inputs of B), to the byte on both ranks; the mid qwen2 model, 64 tokens x 2, rank 8. Measured at
    TP1 and TP2 without SP as well while writing it: -253,952 B per layer each, as planned."""
    from grpo_mega.parallel.forked import run_ranks

    model, seq, micro, rank = _mid_model(), 64, 2, 8
    got = run_ranks(_lora_saved_bytes_per_layer, 2, model, seq, micro, 2, True, rank, timeout=300)
    planned = planning.lora_activation_bytes(model, seq, micro, 2, True, rank, planning.LORA_TARGETS)
    assert got == [planned, planned], (got, planned)  # -59,392 B: the frozen norms keep more than the adapters add


def test_lora_targets_are_the_configs_and_the_table_says_lora(plan_tool):
    from grpo_mega.conf.lora import LORA_TARGETS

    assert planning.LORA_TARGETS == LORA_TARGETS
    inp = planning.PlanInput(model=_mid_model(), parallel=ParallelConfig(tp=2), world_size=2, lora_rank=8,
                             lora_targets=("qkv", "proj"), reference="none", layer_spec="local")
    table = plan_tool.table(planning.plan(inp))
    assert "no reference (the actor with adapters off)" in table and "LoRA rank 8 on qkv,proj" in table
    assert "frozen base (GiB)" in table and "adapters (millions)" in table
    with pytest.raises(ValueError, match="under LoRA the reference is the actor with its adapters off"):
        planning.PlanInput(model=_mid_model(), parallel=ParallelConfig(), world_size=1, lora_rank=8,
                           layer_spec="local")
    with pytest.raises(ValueError, match="needs layer_spec='local'"):
        planning.PlanInput(model=_mid_model(), parallel=ParallelConfig(), world_size=1, lora_rank=8, reference="none")
    with pytest.raises(ValueError, match=r"lora.rank=300 is larger than qkv's smaller dimension 256"):
        planning.lora_layer_sizes(_mid_model(), 1, 300, planning.LORA_TARGETS)


def test_moe_layers_count_router_and_this_ranks_experts():
    """qwen3-30b-a3b at TP2xEP4: per MoE layer the router [128, 2048] and 128/4 experts of 3 x 768/2 x 2048; the
    whole stage equals megatron's meta-device build (one EP rank's shard)."""
    model = load_model_config("qwen3-30b-a3b")
    router, experts = planning.moe_mlp_params(model, etp=2, ep=4)
    assert (router, experts) == (128 * 2048, 32 * 3 * 384 * 2048)
    (stage,) = planning.stage_params(model, ParallelConfig(tp=2, ep=4, sequence_parallel=True))
    assert stage.expert == 48 * experts
    rows = planning.compare_with_meta(model, ParallelConfig(tp=2, ep=4, sequence_parallel=True), 16)
    assert rows[0]["planner_numel"] == rows[0]["meta_numel"] == stage.total


# ---- the fused loss side, measured --------------------------------------------------------------------


def _fused_peak(tokens, vocab, hidden, chunk, full_kl):
    """The fused op's forward + backward in fp32 on the CPU (weight with a main_grad, as under megatron DDP): its
    peak above the inputs from torch.profiler's memory events (bench/fused_output.py's profiled_peak)."""
    import torch

    from grpo_mega.parallel.fused_output import fused_output_stats

    from bench import fused_output as bench
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
    ref_h = torch.randn(tokens, hidden, generator=g)
    w = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.1)
    w.main_grad = torch.zeros(vocab, hidden)
    ref_w = torch.randn(vocab, hidden, generator=g) * 0.1
    target = torch.randint(0, vocab, (tokens,), generator=g)
    up = torch.randn(3, tokens, generator=g)

    def step():
        lp, ent, kl = fused_output_stats(h, w, target, ref_hidden=ref_h if full_kl else None,
                                         ref_weight=ref_w if full_kl else None, vocab_size=vocab, chunk_size=chunk)
        (up[0] * lp + up[1] * ent + (up[2] * kl if full_kl else 0)).sum().backward()
        h.grad = None

    step()
    return bench.profiled_peak(step)


@pytest.mark.parametrize("tokens,chunk,full_kl", [(600, 128, False), (600, 128, True), (1200, 256, False),
                                                   (100, 128, False)], ids=["chunks", "chunks-full-kl",
                                                                            "more-tokens", "one-chunk"])
def test_fused_loss_side_peak_is_what_the_plan_says(tokens, chunk, full_kl):
    """planning.fused_loss_peak_bytes (fp32 weights: the CPU's case) against the fused op's measured peak: the
    plan is never below it and at most 2% above (its per-token allowance, FUSED_TOKEN_BYTES, is rounded up from
    the measured 43-48 bytes). The chunk's terms are exact: 8 bytes per element of [chunk, V] (z scaled in place
    and its exponential, or in the backward log p and the gradient), 12 with the full KL, 4 more for one chunk
    kept whole; the hidden-state gradient 4h per token. The unfused op over the same tokens keeps [T, V] tensors."""
    vocab, hidden = 4096, 64
    measured = _fused_peak(tokens, vocab, hidden, chunk, full_kl)
    planned = planning.fused_loss_peak_bytes(tokens, vocab, hidden, min(chunk, tokens), 4, full_kl)
    print(f"tokens {tokens} chunk {chunk} full_kl {full_kl}: measured {measured} B, planned {planned:.0f} B")
    assert measured <= planned <= 1.02 * measured, (measured, planned)


def test_fused_plan_chunk_and_size():
    import torch  # noqa: F401 (fused_output imports it)

    from grpo_mega.parallel import fused_output

    assert planning.FUSED_CHUNK_BYTES == fused_output.CHUNK_BYTES
    for v in (1, 4096, 49152, 151936 // 4, 10**9):
        assert planning.fused_auto_chunk(v) == fused_output.auto_chunk_size(v)
    # Qwen2.5-1.5B at TP1, 4 x 1024 tokens, bf16: the unfused loss side holds [4096, V] tensors, the fused one chunk
    m = load_model_config("qwen2.5-1.5b")
    unfused = planning.loss_buffer_bytes(m, 1024, 4, 1, False, None)
    fused = planning.loss_buffer_bytes(m, 1024, 4, 1, False, None, fused=True)
    chunk = planning.fused_auto_chunk(m.padded_vocab_size)
    assert chunk == 441  # 256 MiB of fp32 [chunk, 151936]
    hidden = (2 + 2) * m.hidden_size * 4096 + 2 * m.hidden_size * 4096 + 64 * 4096
    wgrad = chunk * m.padded_vocab_size * 2 + m.padded_vocab_size * m.hidden_size * 2
    assert fused == hidden + max(10 * chunk * m.padded_vocab_size, wgrad)
    assert unfused > 10 * fused
    p = planning.PlanInput(model=m, parallel=ParallelConfig(), world_size=1, micro_batch_size=4, seq_length=1024)
    assert planning.plan(p).stages[0].gib["logits"] == pytest.approx(fused / planning.GIB)
    off = planning.plan(planning.PlanInput(model=m, parallel=ParallelConfig(), world_size=1, micro_batch_size=4,
                                           seq_length=1024, fused_output=False))
    assert off.stages[0].gib["logits"] == pytest.approx(unfused / planning.GIB)
