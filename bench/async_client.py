"""Benchmark: what rollout.mode=async's client costs the trainer's core, as it sends requests today (a sender thread
per request in flight, `ServerClient.generate_segment` over kept-alive connections) against one event loop on one
thread (asyncio streams, the same request body and the same checks of each answer: `validate.sglang_sample`), and
against the same threads in a process of their own on the server's core (`elsewhere`: the client off the trainer's
core, the server as busy).

    python -m bench.async_client [--in-flight 20] [--rounds 4] [--out bench_results/async_client.json]

One stand-in server (the tiny model, lognormal lengths of median 8 as bench.async_rl's default) pinned to the last
core, this process to the first, one torch thread each. A client keeps `--in-flight` one-response requests open at
all times, sending the next as each answer arrives, while the main thread runs the trainer's kind of work: a small
MLP's forward, backward and Adam step (4 layers of 64, a batch of 4: ops of microseconds, as the tiny model's
update is), ~0.06 s a timing. Per side, alternating rounds: the client's CPU per request with the main thread idle
(`cpu_ms_per_request`, in this process; not measured for `elsewhere`), and the main thread's work with the client
running over without it (`main_slowdown`, the median of 20 timings over the best of 5 alone) at the request rate the
server kept up (`requests_per_s`). A server answering requests keeps its core busy, and the two cores of a small VM
are not independent (bench_results/async_busy_neighbour.json): `elsewhere`'s slowdown is that neighbour's alone,
and a side's `main_slowdown_over_elsewhere` what its client adds on the trainer's core.
`main_ms_lost_per_request`: the main thread's time lost per answered request, over `elsewhere`'s.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import statistics
import threading
import time

from bench import common

PROMPT = [1, 2, 3, 4, 5, 6, 7]


def _params(i: int) -> dict:
    return dict(temperature=1.0, top_p=1.0, max_new_tokens=64, stop_token_ids=[], sampling_seed=i,
                skip_special_tokens=False, no_stop_trim=True, custom_params={"sample_seed": i, "generated": 0})


class _Threads:
    """Today's client: a sender thread per request in flight, each calling generate_segment (kept-alive connections
    from the client's pool)."""

    def __init__(self, url: str, in_flight: int):
        from grpo_mega.engines.client import ServerClient

        self.url, self.n = url, in_flight
        self.client = ServerClient([url])
        self.client.interrupt = True  # as the async scheduler sets it
        self.stop, self.answered, self.threads = threading.Event(), 0, []
        self.lock = threading.Lock()

    def start(self) -> None:
        self.stop.clear()

        def sender(j: int) -> None:
            i = j
            while not self.stop.is_set():
                self.client.generate_segment(self.url, [PROMPT], [_params(i)], rids=[f"bench-t-{i}"])
                with self.lock:
                    self.answered += 1
                i += self.n

        self.threads = [threading.Thread(target=sender, args=(j,), daemon=True) for j in range(self.n)]
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


class _EventLoop:
    """One asyncio loop on one thread: a connection per request in flight, the same body and checks."""

    def __init__(self, url: str, in_flight: int):
        import urllib.parse

        from grpo_mega.engines import validate

        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.n, self.validate = parts.hostname, parts.port, in_flight, validate
        self.stop, self.answered, self.thread = threading.Event(), 0, None

    async def _one(self, j: int) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        i = j
        try:
            while not self.stop.is_set():
                body = json.dumps(dict(input_ids=[PROMPT], sampling_params=[_params(i)], return_logprob=True,
                                       rid=[f"bench-e-{i}"])).encode()
                writer.write(b"POST /generate HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % (self.host.encode(), self.port, len(body)) + body)
                status = await reader.readline()
                if not status.startswith(b"HTTP/1.") or status[9:12] != b"200":
                    raise RuntimeError(f"the stand-in answered {status[:80]!r}")
                fields = {}
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.partition(b":")
                    fields[name.strip().lower()] = value.strip()
                out = json.loads(await reader.readexactly(int(fields[b"content-length"])))
                self.validate.sglang_sample(out[0], self.validate.OutputSpec(), aborted_ok=True)
                self.answered += 1
                i += self.n
        finally:
            writer.close()

    def start(self) -> None:
        self.stop.clear()

        async def main():
            await asyncio.gather(*(self._one(j) for j in range(self.n)))

        self.thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


class _Elsewhere:
    """_Threads in a child process pinned to `core` (the server's): `python -m bench.async_client --load URL N`."""

    def __init__(self, url: str, in_flight: int, core):
        self.cmd = [*common.pin(core), *common.worker_cmd("bench.async_client", "--load", url, str(in_flight))]
        self.proc, self.answered, self.t0 = None, 0, 0.0

    def start(self) -> None:
        import select
        import subprocess

        self.proc = subprocess.Popen(self.cmd, cwd=common.REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": str(common.REPO),
                                                     "OMP_NUM_THREADS": "1"})
        if not select.select([self.proc.stdout], [], [], 120)[0] or self.proc.stdout.readline().strip() != "sending":
            from grpo_mega.processes import stop

            stop(self.proc)
            raise SystemExit("the elsewhere client (bench.async_client --load) did not start within 120 s")

    def finish(self) -> None:
        out, _ = self.proc.communicate(input="", timeout=60)
        self.answered = json.loads(out.strip().splitlines()[-1])["answered"]


def _load(url: str, in_flight: int) -> None:
    """--load: _Threads until stdin closes, then {"answered": N} on stdout."""
    import sys

    client = _Threads(url, in_flight)
    client.start()
    print("sending", flush=True)
    sys.stdin.read()
    client.finish()
    print(json.dumps(dict(answered=client.answered)), flush=True)


def _trainer_work():
    """A small MLP's forward, backward and Adam step, 200 times: a function timing one call."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.SiLU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(4, 64)

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(200):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return time.perf_counter() - t0

    return work


def _side(client, work, settle: float = 0.5) -> dict:
    """The client's CPU per request with the main thread idle (a client in this process), then the main thread's
    work beside it."""
    client.answered = 0
    client.start()
    here = not isinstance(client, _Elsewhere)
    try:
        time.sleep(settle)
        cpu = None
        if here:
            a0, c0 = client.answered, time.process_time()
            time.sleep(2.0)
            cpu = 1e3 * (time.process_time() - c0) / (client.answered - a0)
        a0, w0 = client.answered, time.perf_counter()
        busy = [work() for _ in range(20)]
        wall = time.perf_counter() - w0
    finally:
        client.finish()
    # elsewhere's count is over its whole run (its settling too): the rate is over that
    rate = (client.answered - a0) / wall if here else client.answered / (wall + settle)
    return dict(cpu_ms_per_request=cpu, busy_s=busy, requests_per_s=rate)


def main(argv=None) -> int:
    ap = common.parser(__doc__, "async_client")
    ap.add_argument("--in-flight", type=int, default=20, help="requests open at once (an async k2 server's ~20 rows)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of the sides")
    ap.add_argument("--load", nargs=2, metavar=("URL", "IN_FLIGHT"), help="internal: the elsewhere side's child process")
    args = ap.parse_args(argv)
    if args.load:
        _load(args.load[0], int(args.load[1]))
        return 0
    from grpo_mega.processes import stop

    import torch

    torch.set_num_threads(1)
    trainer_core, server_core = common.trainer_and_server_cores()
    if trainer_core is not None:
        os.sched_setaffinity(0, {trainer_core})
    load_before = os.getloadavg()
    server, url = common.standin_server(server_core, "--simulate-lengths", "8,0.9")
    work = _trainer_work()
    sides = {"threads": _Threads(url, args.in_flight), "event_loop": _EventLoop(url, args.in_flight),
             "elsewhere": _Elsewhere(url, args.in_flight, server_core)}
    rounds: dict[str, list] = {k: [] for k in sides}
    try:
        for _ in range(3):
            work()
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                alone = min(work() for _ in range(5))
                got = _side(sides[name], work)
                got["alone_s"] = alone
                got["main_slowdown"] = statistics.median(got["busy_s"]) / alone
                rounds[name].append(got)
    finally:
        stop(server)
    med = statistics.median
    summary = {}
    base = med(r["main_slowdown"] for r in rounds["elsewhere"])
    for name, rs in rounds.items():
        slow = med(r["main_slowdown"] for r in rs)
        rate = med(r["requests_per_s"] for r in rs)
        cpu = [r["cpu_ms_per_request"] for r in rs if r["cpu_ms_per_request"] is not None]
        summary[name] = dict(cpu_ms_per_request=med(cpu) if cpu else None, main_slowdown=slow,
                             main_slowdown_over_elsewhere=slow / base, requests_per_s=rate,
                             main_ms_lost_per_request=1e3 * (slow - base) / slow / rate,
                             threads_in_trainer=dict(threads=args.in_flight, event_loop=1, elsewhere=0)[name])
    result = dict(benchmark="async client on the trainer's core: a sender thread per request in flight vs one event "
                            "loop (one stand-in server, tiny model, lognormal lengths median 8)",
                  machine=common.machine(trainer_core=trainer_core, server_core=server_core, loadavg_before=load_before,
                                         loadavg_after=os.getloadavg()),
                  config=dict(in_flight=args.in_flight, rounds=args.rounds), sides=summary, rounds=rounds)
    common.write_json(args.out, result)
    print("; ".join(f"{k}: main thread {v['main_slowdown']:.3f}x ({v['main_slowdown_over_elsewhere']:.3f}x elsewhere's) "
                    f"at {v['requests_per_s']:.0f} requests/s" for k, v in summary.items()) + f" -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
