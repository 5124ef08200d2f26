"""Benchmark: tool calls in multi-turn rollouts. Two measurements, one JSON.

1. Tool workers' start (`workers`): from a process that has imported the trainer's entry point (torch, Hydra,
   megatron-core), the time until a tool worker answers and its resident memory, for a worker started as the
   tool pool starts them (a new interpreter running grpo_mega.toolcalls.worker) and as it started them before
   (multiprocessing's forkserver, which preloads the trainer's main module, grpo_mega.train, then forks each
   worker); each the first start and a restart after a worker is killed (what a timed-out call costs).
2. Async vs lockstep tool calls (`steps`): the same training run (task=tens_tool, the tiny model, a random start
   that calls the tool in many samples) with a calculator whose every call sleeps a fixed, seeded latency
   (exponential, mean --latency-mean s, cut at 4x the mean: latency-bound tools such as a search API), twice:
   rollout.multi_turn.async_tools=false (each turn of the batch waits for every call) and =true. Per mode the
   median step time and `timing/tools` (the seconds generation waited on tools) over the steps after the first;
   the headline is the tool share of the step, async over lockstep (target <= 0.5).

    python -m bench.tools [--steps 6] [--latency-mean 0.5] [--out bench_results/tools.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench import common
from grpo_mega.toolcalls import Calculator  # light: no torch (the tool workers import this module)

class SlowCalculator(Calculator):
    """The calculator, each call first sleeping a latency drawn from the expression (the row's): exponential with
    mean $GRPO_MEGA_BENCH_LATENCY s (0.5 by default), cut at 4x the mean."""

    def call(self, args, **kwargs):
        mean = float(os.environ.get("GRPO_MEGA_BENCH_LATENCY", "0.5"))
        seed = sum(map(ord, str(self.expression or args)))
        time.sleep(min(4 * mean, random.Random(seed).expovariate(1 / mean)))
        return super().call(args, **kwargs)


# ---- 1. worker start ----------------------------------------------------------------------------------------

def _private_mib(pid="self") -> float:
    """A process's private memory (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup), MiB: what it costs
    beyond the pages it shares (a forked worker shares its parent's until it writes them)."""
    return sum(common.rss_mib("Private_Clean", "Private_Dirty", path=f"/proc/{pid}/smaps_rollup").values())


def _probe(conn) -> None:
    """An old-style worker: answer once with this process's RSS and private memory."""
    conn.send((common.rss_mib()["VmRSS"], _private_mib()))


def measure_workers(repeats: int) -> dict:
    """In this process (which imports grpo_mega.train first, as the trainer's main module is): both ways."""
    import multiprocessing as mp

    import grpo_mega.train  # noqa: F401 - what the trainer's process holds
    from grpo_mega.processes import kill_tree
    from grpo_mega.toolcalls.parsers import ToolCall
    from grpo_mega.toolcalls.pool import ToolPool

    out = {"parent_rss_mib": common.rss_mib()["VmRSS"]}
    # before: forkserver preloading the trainer's main module (grpo_mega.train), each worker forked from it
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["grpo_mega.train"])
    old = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_probe, args=(send,), daemon=True)
        p.start()
        rss, private = recv.recv()
        old.append({"start_s": time.perf_counter() - t0, "rss_mib": rss, "private_mib": private})
        kill_tree(p.pid)
        p.join()
    out["forkserver"] = {"first": old[0], "restarts": old[1:]}
    # now: a new interpreter per worker (grpo_mega.toolcalls.worker); a restart is a timed-out call's replacement
    pool = ToolPool(["calculator"], num_workers=1, timeout_s=1.0)
    private = []
    try:
        for k in range(repeats):
            pool.run([ToolCall("calculator", {"expression": "1+1"})])
            victim = pool._workers[0].proc.pid
            private.append(_private_mib(victim))
            if k + 1 < repeats:
                kill_tree(victim)
                while len(pool.worker_stats) < k + 2:
                    pool.run([ToolCall("calculator", {"expression": "2+2"})])
    finally:
        pool.close()
    new = [{"start_s": s["start_s"], "rss_mib": s["rss_mib"], "private_mib": m, "import_s": s["import_s"]}
           for s, m in zip(pool.worker_stats, private)]
    out["new_interpreter"] = {"first": new[0], "restarts": new[1:]}
    for k in ("forkserver", "new_interpreter"):
        runs = [out[k]["first"], *out[k]["restarts"]]
        out[k]["median_restart_s"] = statistics.median(r["start_s"] for r in runs[1:]) if len(runs) > 1 else None
        out[k]["median_rss_mib"] = statistics.median(r["rss_mib"] for r in runs)
        out[k]["median_private_mib"] = statistics.median(r["private_mib"] for r in runs)
    return out


# ---- 2. async vs lockstep ------------------------------------------------------------------------------------

def run_mode(async_tools: bool, a, work: Path) -> dict:
    run = work / ("async" if async_tools else "lockstep")
    argv = ["task=tens_tool", f"run.steps={a.steps}", "eval.interval=0", "run.seed=3",
            "rollout.multi_turn.enable=true", "rollout.multi_turn.parser=bare",
            "rollout.multi_turn.call_stop=['<tool_call>']", "rollout.multi_turn.max_turns=3",
            "rollout.multi_turn.tools=['bench.tools:SlowCalculator']", f"rollout.multi_turn.tool_workers={a.workers}",
            f"rollout.multi_turn.async_tools={str(async_tools).lower()}", "rollout.multi_turn.tool_timeout_s=30",
            "batch.max_response_length=16", f"batch.train_batch_size={a.prompts}", f"rollout.n={a.n}",
            f"batch.ppo_mini_batch_size={a.prompts}", "rollout.temperature=1.5", *a.set]
    t0 = time.time()
    rows = common.train(run, argv, f"the {run.name} run", env={"GRPO_MEGA_BENCH_LATENCY": str(a.latency_mean)},
                        timeout=7200)[1:]  # the first step warms up
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
    step, tools = med("timing/step"), med("timing/tools")
    return {"command": f"python -m grpo_mega.train hydra.run.dir={run} " + " ".join(argv), "seconds": round(time.time() - t0, 1),
            "median_step_s": step, "median_tools_s": tools, "median_generate_s": med("timing/generate"),
            "tool_share": tools / step, "tool_calls_per_sample": med("multi_turn/tool_calls"),
            "turns_per_sample": med("multi_turn/turns"), "tool_latency_s": med("tool/calculator/latency_s"),
            "steps": [{k: r.get(k) for k in ("step", "timing/step", "timing/tools", "timing/generate",
                                             "multi_turn/tool_calls", "reward")} for r in rows]}


def main() -> None:
    p = common.parser(__doc__, "tools")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--workers", type=int, default=16, help="rollout.multi_turn.tool_workers")
    p.add_argument("--latency-mean", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=4, help="worker starts measured per way (the first, then restarts)")
    p.add_argument("--set", action="append", default=[], help="another override for both runs")
    p.add_argument("--workers-only", action="store_true")
    p.add_argument("--worker-probe", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker_probe:
        print(json.dumps(measure_workers(a.repeats)))
        return
    load = os.getloadavg()
    result = {"machine": common.machine(loadavg_before=load), "workers": common.run_worker(
        common.worker_cmd("bench.tools", "--worker-probe", "--repeats", str(a.repeats)), "the worker probe")}
    if not a.workers_only:
        with tempfile.TemporaryDirectory(prefix="grpo_mega_bench_tools_") as work:
            modes = {m: run_mode(m == "async", a, Path(work)) for m in ("lockstep", "async")}
        result["steps"] = {"latency": f"exponential, mean {a.latency_mean} s, cut at {4 * a.latency_mean} s",
                           "tool_workers": a.workers, **modes,
                           "tool_share_ratio": modes["async"]["tool_share"] / modes["lockstep"]["tool_share"],
                           "step_ratio": modes["async"]["median_step_s"] / modes["lockstep"]["median_step_s"]}
    result["machine"]["loadavg_after"] = os.getloadavg()
    common.write_json(a.out, result)
    w = result["workers"]
    ways = ("forkserver", "new_interpreter")
    print(json.dumps({"worker_first_start_s": {k: w[k]["first"]["start_s"] for k in ways},
                      "worker_restart_s": {k: w[k]["median_restart_s"] for k in ways},
                      "worker_rss_mib": {k: w[k]["median_rss_mib"] for k in ways},
                      "worker_private_mib": {k: w[k]["median_private_mib"] for k in ways},
                      **({k: result["steps"][k] for k in ("tool_share_ratio", "step_ratio")} if "steps" in result else {})},
                     indent=1))


if __name__ == "__main__":
    main()
