"""Kill campaign: a dedicated, one-step off-policy run (`rollout.off_policy_steps=1`, one embedded rollout
server, a checkpoint every step) is SIGKILLed at random moments and resumed with `checkpoint.resume=auto`;
every resumed run must reproduce the uninterrupted run's per-step metrics to 1e-6. Writes JSON.

    python -m experiments.kill_campaign [--moments 5] [--steps 6] [--seed 0] \
        [--out bench_results/kill_campaign.json] [OVERRIDE ...]

With `--async` the runs are fully asynchronous (rollout.mode=async, k = 2, partial rollouts in segments of 2
tokens, every trained sample dumped): which samples complete when is the servers' timing there, so the run to
compare with is not a fresh uninterrupted one but a replay (rollout.replay_dir) of what the killed run trained up to
its checkpoint and the resumed run after it; every step's metrics must equal the replay's to 1e-6
(bench_results/kill_campaign_async.json).

Overrides go to every run (the uninterrupted one, the killed ones and their resumes), e.g.
`algo.dynamic_sampling=refill algo.max_gen_rounds=3` (bench_results/kill_campaign_refill.json): then the
dynamic-sampling metrics (extra rounds, groups generated and trained) are compared too, so a resume that
lost the data cursor or redid a round differently fails.

The server sits behind a forwarding proxy in this process (experiments.proxies.WatchingProxy), which sees
which requests are in flight, so that the moments include the ones that matter: the first kill lands while a
/generate is in flight (the background generation of the next step, or the validation), the second during a
weight sync (/update_weights_from_distributed), the rest at a random time into the run. Each moment picks a random step
>= 2 to strike in. The whole process tree is SIGKILLed by PID, as a preemption or the OOM killer would. Exit
status 1 when a resume differs or a moment could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.proxies import WatchingProxy

REPO = Path(__file__).resolve().parents[1]
KEYS = ("reward", "val_reward", "loss", "pg_loss", "grad_norm", "entropy", "kl", "is_weight_mean", "logprob_mismatch",
        "weight_version")
REFILL_KEYS = ("dynamic_sampling/extra_rounds", "dynamic_sampling/generated_groups",
               "dynamic_sampling/informative_groups", "dynamic_sampling/groups_dropped")
TOL = 1e-6
WATCHED = {"generate": "/generate", "sync": "/update_weights_from_distributed"}


def _start_server() -> tuple[subprocess.Popen, str]:
    from grpo_mega.data.toy import make_tokenizer
    from grpo_mega.engines import standin_server

    try:
        return standin_server.launch(["--model", "tiny", "--port", "0", "--vocab-size", str(len(make_tokenizer())),
                              "--timeout-s", "60"], env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def _stop(proc: subprocess.Popen) -> None:
    from grpo_mega.processes import stop

    stop(proc)


ASYNC = ("rollout.mode=async", "rollout.off_policy_steps=2", "rollout.segment_tokens=2")


def _cmd(out: Path, ckpt: Path | None, url: str, steps: int, extra: tuple = ()) -> list[str]:
    mode = ASYNC if "--async" in extra else ("rollout.off_policy_steps=1",)
    if "--async" in extra:  # every trained sample dumped: the replay's trace
        mode += (f"rollout.dump_dir={out / 'dump'}",)
    return [sys.executable, "-m", "grpo_mega.train", f"hydra.run.dir={out}", f"run.steps={steps}", "eval.interval=2",
            *((f"checkpoint.dir={ckpt}", "checkpoint.interval=1") if ckpt else ()), "rollout.placement=dedicated",
            f"rollout.servers=[{url}]", *mode, "rollout.server_timeout_s=120",
            "rollout.sync_bucket_mb=0.05",  # many small buckets: a sync lasts long enough to be struck in
            *(x for x in extra if x != "--async")]


ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}


def _run(out: Path, ckpt: Path | None, url: str, steps: int, extra: tuple = ()) -> dict[int, dict]:
    done = subprocess.run(_cmd(out, ckpt, url, steps, extra), capture_output=True, text=True, cwd=REPO, env=ENV, timeout=900)
    if done.returncode:
        raise SystemExit(f"a run failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return {r["step"]: r for r in (json.loads(line) for line in open(out / "metrics.jsonl"))}


def _rows_done(out: Path) -> int:
    try:
        return sum(1 for _ in open(out / "metrics.jsonl"))
    except OSError:
        return 0


def _strike(proxy: WatchingProxy, out: Path, ckpt: Path, steps: int, kind: str, step: int, rng: random.Random,
            extra: tuple = (), timeout: float = 600.0) -> dict:
    """Start the run; SIGKILL it while step `step` is under way (rows < step) and, for 'generate'/'sync', while
    such a request is in flight. Returns what was hit."""
    out.mkdir(parents=True)
    proc = subprocess.Popen(_cmd(out, ckpt, proxy.url, steps, extra), stdout=subprocess.DEVNULL,
                            stderr=open(out / "stderr.txt", "w"), cwd=REPO, env=ENV, start_new_session=True)
    t0, delay = time.monotonic(), rng.uniform(0.0, 0.5)
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                return dict(kind=kind, hit=False, reason=f"the run ended (rc {proc.returncode}) before the moment")
            rows = _rows_done(out)
            if rows >= step:  # step `step` went by without the moment: strike in the next one
                step += 1
                if step > steps:
                    return dict(kind=kind, hit=False, reason=f"no {kind} moment was caught before the run ended")
                continue
            if rows == step - 1:  # step `step` is under way
                if kind == "random":
                    time.sleep(delay)
                if kind == "random" or proxy.busy(WATCHED[kind]):
                    busy = {k: proxy.busy(p) for k, p in WATCHED.items()}
                    _stop(proc)
                    return dict(kind=kind, hit=True, step=step, seconds_into_run=time.monotonic() - t0,
                                rows_logged=_rows_done(out), in_flight_at_kill=busy)
            time.sleep(0.001)
        return dict(kind=kind, hit=False, reason="timed out")
    finally:
        _stop(proc)


def _replay(base: Path, from_step: int, url: str, steps: int, extra: tuple) -> dict[int, dict]:
    """--async: a run replaying what the killed run trained on up to its checkpoint `from_step` and the resumed run
    after it (rollout.replay_dir), no checkpoint; its rows."""
    import shutil

    trace = base.with_name(base.name + "_trace")
    trace.mkdir()
    for step in range(1, steps + 1):
        name = f"train_step_{step:08d}.jsonl"
        shutil.copy(base.with_name(base.name + ("_killed" if step <= from_step else "_resumed")) / "dump" / name,
                    trace / name)
    return _run(base.with_name(base.name + "_replay"), None, url, steps, (*extra, f"rollout.replay_dir={trace}"))


def campaign(moments: int, steps: int, seed: int, work: Path, extra: tuple = ()) -> dict:
    rng = random.Random(seed)
    server, target = _start_server()
    proxy = WatchingProxy(target)
    results = []
    is_async = "--async" in extra
    try:
        full = None if is_async else _run(work / "full", work / "full_ckpt", proxy.url, steps, extra)
        keys = KEYS + tuple(k for k in REFILL_KEYS if full and k in full[1])
        kinds = (["generate", "sync"] + ["random"] * moments)[:moments]
        for i, kind in enumerate(kinds):
            ckpt, step = work / f"m{i}_ckpt", rng.randint(2, steps - 1)
            hit = _strike(proxy, work / f"m{i}_killed", ckpt, steps, kind, step, rng, extra)
            if not hit["hit"]:
                results.append(dict(**hit, ok=False))
                continue
            from_step = max((int(p.name.split("_")[1]) for p in ckpt.glob("step_*") if (p / "manifest.json").is_file()),
                            default=0)
            resumed = _run(work / f"m{i}_resumed", ckpt, proxy.url, steps, extra)
            if is_async:  # the uninterrupted run on the same samples: the killed run's to its checkpoint, then the resumed's
                killed = {r["step"]: r for r in (json.loads(line) for line in open(work / f"m{i}_killed" / "metrics.jsonl"))
                          if r["step"] <= from_step}
                full = _replay(work / f"m{i}", from_step, proxy.url, steps, extra)
                resumed = {**killed, **resumed}
            compared = sorted(resumed)
            worst = max((abs(float(resumed[k][key]) - float(full[k][key])) for k in compared for key in keys), default=0.0)
            ok = compared[-(steps - from_step):] == list(range(from_step + 1, steps + 1)) and worst <= TOL
            results.append(dict(**hit, resumed_from_step=from_step, steps_compared=compared, max_abs_diff=worst, ok=ok))
    finally:
        proxy.close()
        _stop(server)
    return dict(steps=steps, seed=seed, overrides=list(extra), tolerance=TOL, keys=list(keys), moments=results,
                ok=bool(results) and all(r["ok"] for r in results))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moments", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: bench_results/kill_campaign.json (kill_campaign_async.json "
                    "with --async)")
    ap.add_argument("--async", dest="is_async", action="store_true",
                    help="fully asynchronous runs, compared with a replay of the samples they trained on")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. algo.dynamic_sampling=refill")
    args = ap.parse_args(argv)
    if args.moments < 2 or args.steps < 3:
        raise SystemExit(f"--moments={args.moments} --steps={args.steps}: at least 2 moments (one mid-generation, one "
                         "mid-sync) and 3 steps (a kill strikes in a step >= 2, before the last)")
    load = os.getloadavg()
    args.out = args.out or str(REPO / "bench_results" / f"kill_campaign{'_async' if args.is_async else ''}.json")
    extra = (*args.overrides, *(("--async",) if args.is_async else ()))
    with tempfile.TemporaryDirectory(prefix="kill_campaign_") as tmp:
        result = campaign(args.moments, args.steps, args.seed, Path(tmp), extra)
    result["loadavg"] = [load, os.getloadavg()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for m in result["moments"]:
        print(f"{m['kind']:>8}: " + (f"killed in step {m['step']} (in flight: {m['in_flight_at_kill']}), resumed from "
                                      f"step {m['resumed_from_step']}, steps {m['steps_compared']} differ by at most "
                                      f"{m['max_abs_diff']:.1e}" if m["hit"] else m["reason"])
              + ("" if m["ok"] else "  FAILED"))
    print(f"{'all resumes exact' if result['ok'] else 'FAILED'} -> {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
