"""Benchmark: one GRPO step of grpo-mega against TRL's GRPOTrainer on the same work, side by side. Writes JSON.

    make bench-trl                      # installs TRL into .venv-trl, then runs this with the defaults below
    python -m bench.vs_trl [--steps 4] [--rounds 2] [--threads 2] [--max-new-tokens 128] [--out ...]

The work (the same on both sides): SmolLM2-135M-Instruct (`make smollm2`) in fp32 on the CPU, `--prompts` 4
arithmetic prompts (grpo_mega.data.arithmetic, one user message, chat template applied by each system) x `--n`
4 samples, up to `--max-new-tokens` 128 new tokens at temperature 1.0 (top-p 1, no top-k), the format reward
(1 when the response contains \\boxed{...}: the same regex on both sides), KL 0 (grpo-mega algo.kl_coef=0, TRL
beta=0: no reference model), the token-mean ("dapo") loss with clip ratios 0.2 / 0.28, one optimizer step per
training step (AdamW, lr 1e-6, no weight decay, grad clip 1.0, constant LR), no evaluation, no checkpoints,
gradient checkpointing off, `--threads` CPU threads (each system's process pinned to that many cores).

Each system runs in its own process and environment: grpo-mega in this interpreter's (`python -m
grpo_mega.train`, exactly on-policy, so no old-logprob pass), TRL 1.x (`GRPOTrainer`, `use_vllm=False`,
`loss_type="dapo"`) in .venv-trl (`make bench-trl` makes it: TRL is not a dependency of grpo-mega). `--rounds`
rounds each run both systems for `--steps` steps, in alternating order (grpo-mega first in even rounds), so
load from other processes falls on both alike. Step 1 of every run is warm-up; the JSON holds every step and,
per system, the median over steps 2..steps of all rounds of the step and of each phase:
  grpo-mega: its own timing/* metrics (grpo_mega.trainer.timing): generate, reward, old_logprobs (0 here),
             update (forward + backward + optimizer), weight_sync; other = step - their sum.
  TRL:       wall clock around GRPOTrainer's methods: generation (`_generate`), scoring (the rest of
             `_generate_and_score_completions`: rewards, advantages), loss_forward (`_compute_loss`), backward
             (the rest of `training_step`), optimizer (between the on_pre_optimizer_step and on_optimizer_step
             callbacks); other = step (on_step_begin -> on_step_end) - their sum.
Both sample: response lengths differ from run to run and between the systems, so each step's mean response
length is recorded next to its seconds. The load average before and after is recorded: on a shared machine the
seconds are only comparable within one run.

`--systems grpo_mega` runs one side only (the tests do, at toy sizes); the step ratio is then null.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from bench import common

REPO = common.REPO
TRL_VENV = REPO / ".venv-trl"
FORMAT_PATTERN = r"(?s).*\\boxed\{.+\}.*"  # grpo_mega.rewards' "format" reward, the same on both sides
SYSTEMS = ("grpo_mega", "trl")
MEGA_PHASES = ("generate", "reward", "old_logprobs", "update", "weight_sync")
TRL_PHASES = ("generation", "scoring", "loss_forward", "backward", "optimizer")


def settings(args) -> dict:
    return dict(prompts=args.prompts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0,
                top_k=None, kl_coef=0.0, loss="token-mean (TRL loss_type='dapo')", clip_ratio_low=0.2,
                clip_ratio_high=0.28, lr=1e-6, weight_decay=0.0, clip_grad=1.0, lr_schedule="constant",
                optimizer_steps_per_step=1, dtype="float32", threads=args.threads, reward="format: " + FORMAT_PATTERN,
                gradient_checkpointing=False, trl_use_vllm=False, evaluation=False, seed=args.seed)


def _pinned(threads: int):
    """A preexec_fn pinning the child to the first `threads` cores this process may use (both systems alike)."""
    cores = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else None

    def pin():
        if cores:
            os.sched_setaffinity(0, cores)

    return pin


def _child_env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


# ---- grpo-mega: python -m grpo_mega.train, phases from its metrics.jsonl -------------------------------------


def run_grpo_mega(args, data: Path, out: Path) -> dict:
    k = args.prompts
    overrides = ["task=prompts", f"model={args.model}", "reward.name=format", f"data.train_files={data}",
                 "precision.params_dtype=fp32", f"batch.train_batch_size={k}", f"rollout.n={args.n}",
                 f"batch.ppo_mini_batch_size={k}", f"batch.micro_batch_size={k * args.n}",
                 f"batch.max_response_length={args.max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
                 "algo.kl_coef=0.0", "algo.loss_agg_mode=token-mean", "algo.clip_ratio_low=0.2",
                 "algo.clip_ratio_high=0.28", "optim.lr=1e-6", "optim.weight_decay=0.0", "optim.clip_grad=1.0",
                 f"run.steps={args.steps}", f"run.seed={args.seed}", "eval.interval=0", "checkpoint.interval=0"]
    t0 = time.perf_counter()
    rows = common.train(out, overrides, "grpo-mega run", env=_child_env(args.threads), timeout=args.timeout,
                        preexec_fn=_pinned(args.threads))
    steps = []
    for r in rows:
        phases = {p: r[f"timing/{p}"] for p in MEGA_PHASES}
        wall = {p: r[f"timing/{p}"] for p in ("generate_wait", "reward", "old_logprobs", "update", "weight_sync")}
        phases["other"] = r["timing/step"] - sum(wall.values())
        steps.append(dict(step=r["step"], step_s=r["timing/step"], phases=phases,
                          response_length_mean=r["response_length"], reward_mean=r["reward"]))
    return dict(system="grpo_mega", process_s=time.perf_counter() - t0, steps=steps,
                versions=dict(grpo_mega_commit=common.git_commit(),
                              **{d: common._version(d) for d in ("torch", "megatron-core", "transformers")}))


# ---- TRL: GRPOTrainer in .venv-trl, this file's --trl-worker mode --------------------------------------------


def run_trl(args, data: Path, out: Path) -> dict:
    cfg = dict(model=args.model, data=str(data), out=str(out), steps=args.steps, prompts=args.prompts, n=args.n,
               max_new_tokens=args.max_new_tokens, threads=args.threads, seed=args.seed)
    t0 = time.perf_counter()
    result = common.run_worker([args.trl_python, "-m", "bench.vs_trl", "--trl-worker", json.dumps(cfg)], "TRL run",
                               args.timeout, env=_child_env(args.threads), preexec_fn=_pinned(args.threads))
    result["process_s"] = time.perf_counter() - t0
    return result


def trl_worker(cfg: dict) -> None:
    """Runs in .venv-trl: GRPOTrainer on the prompts, per-step phase seconds printed as the last line (JSON)."""
    import warnings

    warnings.simplefilter("ignore")
    import importlib.metadata as md

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(cfg["threads"])
    rows = [json.loads(line) for line in Path(cfg["data"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([dict(prompt=r["prompt"], ground_truth=r["reward_model"]["ground_truth"]) for r in rows])
    regex = re.compile(FORMAT_PATTERN)
    rewards: list[float] = []  # each step's mean

    def format_reward(completions, **_):
        r = [1.0 if regex.fullmatch(c[0]["content"] if isinstance(c, list) else c) else 0.0 for c in completions]
        rewards.append(sum(r) / len(r))
        return r

    k, n = cfg["prompts"], cfg["n"]
    args = GRPOConfig(
        output_dir=cfg["out"], per_device_train_batch_size=k * n, num_generations=n, gradient_accumulation_steps=1,
        max_steps=cfg["steps"], learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, num_iterations=1,
        temperature=1.0, top_p=1.0, top_k=0, max_completion_length=cfg["max_new_tokens"], use_vllm=False,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, model_init_kwargs={"dtype": torch.float32},
        logging_steps=1, report_to="none", save_strategy="no", seed=cfg["seed"], disable_tqdm=True,
        dataloader_num_workers=0,
    )
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    lengths: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = timed("generate_and_score", super()._generate_and_score_completions)(inputs)
            lengths.append(float(out["completion_mask"].sum(1).float().mean()))
            return out

    steps, marks = [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            spent.clear()
            marks["step"] = time.perf_counter()

        def on_pre_optimizer_step(self, *_, **__):
            marks["opt"] = time.perf_counter()

        def on_optimizer_step(self, *_, **__):
            spent["optimizer"] = time.perf_counter() - marks["opt"]

        def on_step_end(self, args, state, *_, **__):
            step_s = time.perf_counter() - marks["step"]
            gen = spent.get("generation", 0.0)
            phases = dict(generation=gen, scoring=spent.get("generate_and_score", 0.0) - gen,
                          loss_forward=spent.get("loss_forward", 0.0),
                          backward=spent.get("training_step", 0.0) - spent.get("generate_and_score", 0.0)
                          - spent.get("loss_forward", 0.0), optimizer=spent.get("optimizer", 0.0))
            phases["other"] = step_s - sum(phases.values())
            steps.append(dict(step=state.global_step, step_s=step_s, phases=phases, torch_threads=torch.get_num_threads(),
                              response_length_mean=lengths[-1] if lengths else None,
                              reward_mean=rewards[-1] if rewards else None))

    trainer = Timed(model=cfg["model"], reward_funcs=[format_reward], args=args, train_dataset=dataset,
                    callbacks=[Clock()])
    trainer._generate = timed("generation", trainer._generate)
    trainer._compute_loss = timed("loss_forward", trainer._compute_loss)
    trainer.training_step = timed("training_step", trainer.training_step)
    trainer.train()
    print(json.dumps(dict(system="trl", steps=steps, attention=trainer.model.config._attn_implementation,
                          versions={d: md.version(d) for d in ("trl", "transformers", "torch", "accelerate")})))


# ---- the comparison ------------------------------------------------------------------------------------------


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(runs: list[dict], system: str, phases: tuple[str, ...]) -> dict | None:
    """Medians over steps 2.. of every run of `system`."""
    later = [s for r in runs if r["system"] == system for s in r["steps"] if s["step"] >= 2]
    if not later:
        return None
    return dict(steps_counted=len(later), step_s=_median([s["step_s"] for s in later]),
                phases_s={p: _median([s["phases"][p] for s in later]) for p in phases + ("other",)},
                response_length_mean=_median([s["response_length_mean"] for s in later]))


def main() -> int:
    ap = common.parser(__doc__, None)
    ap.add_argument("--model", default=None, help="HF model directory (default: make smollm2's)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run (step 1 is warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each system, alternating")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: grpo_mega, trl")
    ap.add_argument("--trl-python", default=str(TRL_VENV / "bin" / "python"))
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--workdir", default=None, help="runs' folders (default: outputs/bench_vs_trl)")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return 0
    systems = common.names(args.systems, SYSTEMS, "--systems")
    if args.steps < 2 or args.rounds < 1 or args.threads < 1:
        ap.error(f"--steps={args.steps} must be >= 2 (step 1 is warm-up), --rounds={args.rounds} and "
                 f"--threads={args.threads} >= 1")
    from grpo_mega.cli.prepare_model import default_out
    from grpo_mega.data import arithmetic  # the prompts both systems read (verl's schema, .jsonl)

    args.model = args.model or str(default_out())
    if not (Path(args.model) / "config.json").exists():
        print(f"error: no HF model at {args.model} (run 'make smollm2', or pass --model DIR)", file=sys.stderr)
        return 2
    if "trl" in systems and not Path(args.trl_python).exists():
        print(f"error: no TRL environment at {args.trl_python} (run 'make bench-trl', which creates .venv-trl; "
              "or --systems grpo_mega)", file=sys.stderr)
        return 2
    work = Path(args.workdir or REPO / "outputs" / "bench_vs_trl")
    data = arithmetic.write(arithmetic.make_rows(args.prompts * args.steps, seed=args.seed), work / "prompts.jsonl")
    load_start, runs = os.getloadavg(), []
    for r in range(args.rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for system in order:
            out = work / f"{system}_round{r}"
            res = (run_grpo_mega if system == "grpo_mega" else run_trl)(args, data, out)
            res["round"] = r
            runs.append(res)
            print(f"round {r} {system}: steps " + ", ".join(f"{s['step_s']:.1f}" for s in res["steps"]) + " s",
                  flush=True)
    mega = summarise(runs, "grpo_mega", MEGA_PHASES)
    trl = summarise(runs, "trl", TRL_PHASES)
    ratio = mega["step_s"] / trl["step_s"] if mega and trl else None
    out = dict(
        what="one GRPO step, grpo-mega vs TRL GRPOTrainer, same work (settings), each system in its own process "
             "and environment, alternated; medians over steps 2..steps of all rounds",
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), model=args.model, steps=args.steps, rounds=args.rounds,
        settings=settings(args), machine=common.machine(), loadavg_start=list(load_start),
        loadavg_end=list(os.getloadavg()),
        note="a shared machine: the load average is recorded; compare seconds only within one run",
        versions={r["system"]: r["versions"] for r in runs}, grpo_mega=mega, trl=trl,
        step_ratio_grpo_mega_over_trl=ratio, runs=runs,
    )
    path = common.write_json(args.out or common.out_path("vs_trl"), out)
    if ratio is not None:
        print(f"grpo-mega {mega['step_s']:.1f} s/step, TRL {trl['step_s']:.1f} s/step: ratio {ratio:.2f}")
    print(f"wrote {path} (load average {load_start[0]:.2f} -> {out['loadavg_end'][0]:.2f} on {os.cpu_count()} cpus)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
