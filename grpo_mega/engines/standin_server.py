"""Rollout servers as processes of their own: our CPU stand-in for SGLang's server, and starting either.

The stand-in (the embedded engine behind SGLang's HTTP API, in place of `python -m sglang.launch_server`) owns only
the translation between SGLang's HTTP API (the subset grpo_mega.engines.client speaks, with SGLang's names and
payload fields) and an EmbeddedEngine: GET /health, /model_info (also as /get_model_info); POST /generate (input_ids,
sampling_params with sampling_seed, return_logprob -> output_ids and meta_info's output_token_logprobs,
finish_reason, weight_version), /init_weights_update_group, /begin_weight_update and /end_weight_update (SGLang
requires them around the updates; here new rows wait between them and a bucket loads only between two decode steps
with no row in flight, so that no token comes from half-loaded weights), /update_weights_from_distributed
(load_format "flattened_bucket": one broadcast of the bucket's bytes from rank 0 of the update group),
/update_weight_version, /flush_cache, /pause_generation (mode abort ends the rows in flight after their current
token, as SGLang's does; mode retract takes them out of the decode loop, their requests left open, to be prefilled
again under the weights loaded before /continue_generation, as SGLang's retract does; mode in_place stops the loop
between two steps with them in it, to sample on from their keys and values under the weights loaded meanwhile, as
SGLang's in_place does) and /continue_generation (new rows wait between them), /abort_request (by the request's
`rid`, or abort_all). Every output's meta_info carries SGLang's `weight_versions` spans (the version that sampled
each token: more than one where a request was retracted or paused in place across an update). As SGLang's scheduler
does, every request's rows decode in one loop (grpo_mega.engines.continuous: continuous batching; a request with
return_routed_experts runs alone), and as its radix cache does, a request that continues a response cut by its budget
starts from that response's keys and values (EmbeddedEngine.enable_prefix_cache; --disable-radix-cache). Two
extensions of ours: POST /grpo_mega/weight_checksums serves the weight audit (SGLang has none: the client reads
SGLang's tensors back with /get_weights_by_name instead), and GET /grpo_mega/decode_stats the decode loop's counters
(steps, rows over its steps, seconds in them) for benchmarks. Sampling, logprobs and loading are the embedded engine's.

    python -m grpo_mega.engines.standin_server --model tiny --port 30000     (or --hf-dir DIR)

For benchmarks, `--simulate-lengths MEDIAN,SIGMA` ends each response after a lognormal number of tokens drawn
from its seed (sampling_params.custom_params.sample_seed, else sampling_seed), less custom_params.generated (the
tokens a continued response already has); stop tokens are then ignored. `--simulate-decode-ms MS` makes every
decode step MS milliseconds longer (a larger model's memory-bound step, whatever the batch), and a prefill forward
of its own as much (the decode loop's cost of a forward counts it).

Hardened as a server on a shared network: with an API key in the environment (`--api-key-env`, default
GRPO_MEGA_SERVER_API_KEY) every route but GET /health needs `Authorization: Bearer KEY` (401, nothing read or
changed, without it), and without a key it binds only to a loopback address (`--host 0.0.0.0` without a key is
refused at start-up); connections are served by a bounded pool of threads (`--threads`, with at most
`--max-pending` connections waiting for one; more are closed at once), so that many half-sent requests cannot
make as many threads; request bodies are capped (MAX_BODY_BYTES; 413) and must state a valid Content-Length;
a body that is not JSON, or holds a number too long to convert, is answered 400; sockets time out (a half-sent
request frees its thread); /generate's batch, prompt lengths, token ids and max_new_tokens are checked before
anything is allocated; a weight bucket's names, shapes and dtypes are checked whole against the model before
any byte is received or any weight changes.

`launch` starts the stand-in as a process of its own; `grpo_mega.processes.stop` ends it
(`grpo_mega.engines.sglang_launch` starts real SGLang servers).

Long on purpose: each HTTP route beside the hardening that guards it (sizes, types, auth) and the launcher
that starts either server: what a request may do is read in one file.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Optional

import torch
import torch.distributed as dist

from grpo_mega import processes
from grpo_mega.engines.client import join_update_group
from grpo_mega.engines.continuous import PREFILL_CALL_TOKENS, ContinuousBatcher, Row, call_tokens
from grpo_mega.engines.embedded import EmbeddedEngine
from grpo_mega.engines.interface import Bucket, TensorMeta


MAX_BODY_BYTES = 64 << 20
"""The largest request body read (a /generate of many prompts; weights travel over the update group)."""
MAX_BATCH = 4096
"""Inputs per /generate."""
MAX_TOKENS = 65536
"""Tokens per input, and max_new_tokens."""
SOCKET_TIMEOUT_S = 60.0
"""A connection idle this long mid-request is dropped."""
DTYPES = ("float32", "bfloat16", "float16")
THREADS = 256
"""Threads serving connections: every /generate in flight holds one while its rows decode (rollout.mode=async sends a
request per group), and the weight update's calls need theirs while those wait."""
MAX_PENDING = 64
"""Connections waiting for a thread; one more is closed at once."""


class PooledHTTPServer(HTTPServer):
    """An HTTPServer whose connections are served by `threads` pooled threads, at most `max_pending` of them
    waiting for one (http.server's ThreadingHTTPServer starts a thread per connection before reading a byte:
    200 half-sent requests made 202 threads)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 made a burst of connects wait 1 s SYN retries)

    def __init__(self, address, handler, threads: int = THREADS, max_pending: int = MAX_PENDING):
        super().__init__(address, handler)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="standin-http")
        self.slots = threading.BoundedSemaphore(threads + max_pending)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):  # over the limit: closed unanswered, the server stays free
            self.shutdown_request(request)
            return
        self.pool.submit(self._serve, request, client_address)

    def _serve(self, request, client_address):
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - one connection's failure (a reset) ends only it
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request, client_address):  # quiet: a dropped client is not the server's error
        pass

    def server_close(self):
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def check_bind(host: str, api_key: str) -> None:
    """A ValueError for serving without a key anywhere but on a loopback address (every route, weight updates
    included, would be open to the network)."""
    if api_key:
        return
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e})") from None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"--host {host} without an API key would open every route (weight updates included) to "
                         f"the network: set the key in the environment (--api-key-env, default "
                         f"GRPO_MEGA_SERVER_API_KEY), or bind to 127.0.0.1")


class EngineServer:
    """What the HTTP handlers call: /generate's rows go to the decode loop (ContinuousBatcher), every other POST runs
    under the lock, one at a time."""

    def __init__(self, engine: EmbeddedEngine, model_path: str, timeout_s: float = 120.0, api_key: str = "",
                 api_key_env: str = "GRPO_MEGA_SERVER_API_KEY", socket_timeout_s: float = SOCKET_TIMEOUT_S,
                 lengths: Optional[tuple[float, float]] = None, call_tokens: int = PREFILL_CALL_TOKENS):
        self.engine, self.model_path, self.timeout_s = engine, model_path, timeout_s
        self.api_key, self.api_key_env, self.socket_timeout_s = api_key, api_key_env, socket_timeout_s
        self.lock = threading.Lock()
        self.updating = False  # between /begin_weight_update and /end_weight_update: /generate waits (no mixed weights)
        self.paused = False  # between /pause_generation and /continue_generation: /generate waits
        self.cond = threading.Condition(self.lock)
        self.lengths = lengths  # --simulate-lengths (median, sigma): each response's length drawn, stop tokens ignored
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.batcher = (ContinuousBatcher(engine, timeout_s, call_tokens) if engine.decode_mode() == "dynamic"
                        else None)

    def authorized(self, header: Optional[str]) -> bool:
        """No key configured, or the request's `Authorization: Bearer KEY` (compared in constant time)."""
        if not self.api_key:
            return True
        return hmac.compare_digest((header or "").encode(), f"Bearer {self.api_key}".encode())

    def generate(self, req: dict):
        """SGLang's /generate for token ids: one output per input; each input's sampling_params carry its
        own sampling_seed."""
        ids = req.get("input_ids")
        if not ids or not isinstance(ids, list):
            raise ValueError("/generate needs input_ids (a list of token-id lists; text is not supported)")
        single = isinstance(ids[0], int)
        ids = [ids] if single else ids
        vocab = self.engine.model.config.vocab_size
        if len(ids) > MAX_BATCH:
            raise ValueError(f"/generate got {len(ids)} inputs; at most {MAX_BATCH}")
        for row in ids:
            if (not isinstance(row, list) or not 0 < len(row) <= MAX_TOKENS
                    or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in row)):
                raise ValueError(f"/generate: every input must be 1..{MAX_TOKENS} token ids in [0, {vocab})")
        params = req.get("sampling_params") or {}
        params = [params] * len(ids) if isinstance(params, dict) else params
        if not isinstance(params, list) or len(params) != len(ids) or not all(isinstance(p, dict) for p in params):
            raise ValueError(f"/generate got {len(ids)} input_ids and sampling_params that are not one dict each")
        for p in params:
            if not 0 < int(p.get("max_new_tokens", 128)) <= MAX_TOKENS:
                raise ValueError(f"/generate: max_new_tokens must be in 1..{MAX_TOKENS}")
            if not float(p.get("temperature", 1.0)) >= 0 or not 0 < float(p.get("top_p", 1.0)) <= 1:
                raise ValueError("/generate: temperature must be >= 0 and top_p in (0, 1]")
        caps = [int(p.get("max_new_tokens", 128)) for p in params]
        ends = [self.simulated_length(p) if self.lengths is not None else None for p in params]
        rids = req.get("rid")
        rids = [rids] * len(ids) if isinstance(rids, str) or rids is None else rids
        if (not isinstance(rids, list) or len(rids) != len(ids)
                or not all(r is None or isinstance(r, str) for r in rids)):
            raise ValueError(f"/generate got {len(ids)} input_ids and a rid that is not one string (or one each)")
        routed = bool(req.get("return_routed_experts")) and bool(self.engine.routers)
        if routed or self.batcher is None:
            gens = [(t, lp, f, [v] * len(t), v, e) for t, lp, f, v, e in self._generate_alone(ids, params, caps, ends,
                                                                                              routed)]
        else:  # every row joins the decode loop beside the other requests' (continuous batching)
            rows = self.batcher.run([self._row(ids[i], params[i], caps[i], ends[i], rids[i]) for i in range(len(ids))])
            gens = [(r.tokens, r.logprobs, r.finish, r.versions, r.weight_version, None) for r in rows]
        outs = []
        for i, (tokens, logprobs, finish, versions, version, experts) in enumerate(gens):
            if self.lengths is not None and finish != "abort":
                finish = "stop" if ends[i] <= caps[i] else "length"
            spans = _spans(versions, version)
            meta = dict(finish_reason={"type": finish}, weight_version=spans[-1]["version"], weight_versions=spans,
                        prompt_tokens=len(ids[i]), completion_tokens=len(tokens))
            if req.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, tokens)]
            if experts is not None:
                meta["routed_experts"] = self._routed_experts_b64(experts)
            outs.append(dict(output_ids=tokens, meta_info=meta))
        return outs[0] if single else outs

    def _row(self, ids: list[int], p: dict, cap: int, end: Optional[int], rid: Optional[str] = None) -> Row:
        """One input as a row of the decode loop: with --simulate-lengths it ends at its drawn length (a stop: its keys
        and values are not kept) or its cap and ignores stop tokens."""
        stop = frozenset() if end is not None else frozenset(int(t) for t in p.get("stop_token_ids") or ())
        return Row(list(ids), min(cap, end) if end is not None else cap, int(p.get("sampling_seed", 0)),
                   float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0)), stop, rid,
                   ends=end is not None and end <= cap)

    def _generate_alone(self, ids, params, caps, ends, routed: bool) -> list[tuple]:
        """The request on the engine by itself, the decode loop held and idle (routing replay records every
        forward's routes, which another request's rows would mix into): inputs with the same settings sampled
        together. Per input (tokens, logprobs, finish, weight version, routed experts)."""
        with self.cond:  # never on half-loaded weights
            self.cond.wait_for(lambda: not (self.updating or self.paused), timeout=self.timeout_s)
            if self.updating or self.paused:
                raise RuntimeError(f"a weight update (or a pause) began and did not end within {self.timeout_s:.0f} s")
            if self.batcher is not None:
                self.batcher.hold("alone")
            try:
                if self.batcher is not None and not self.batcher.idle(self.timeout_s):
                    raise RuntimeError(f"the decode loop did not empty within {self.timeout_s:.0f} s")
                return self._grouped(ids, params, caps, ends, routed)
            finally:
                if self.batcher is not None:
                    self.batcher.release("alone")

    def _grouped(self, ids, params, caps, ends, routed: bool) -> list[tuple]:
        outs: list[Optional[tuple]] = [None] * len(ids)
        groups: dict[tuple, list[int]] = {}  # inputs with the same settings are sampled together
        for i, p in enumerate(params):
            key = (float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0)),
                   None if self.lengths is not None else caps[i], tuple(p.get("stop_token_ids") or ()))
            groups.setdefault(key, []).append(i)
        for (temperature, top_p, max_new, stop), rows in groups.items():
            seeds = [int(params[i].get("sampling_seed", 0)) for i in rows]
            self.engine.record_routing = routed
            budgets = None
            if self.lengths is not None:  # each row ends at its drawn length or its cap
                budgets = [min(caps[i], ends[i]) for i in rows]
                stop, max_new = (), max(budgets)
            gen = self.engine.generate([ids[i] for i in rows], 1, temperature, top_p, max_new, stop, 0, row_seeds=seeds,
                                       row_max_new_tokens=budgets)
            self.engine.record_routing = False
            for k, i in enumerate(rows):
                outs[i] = (gen.token_ids[k], gen.logprobs[k], gen.finish_reasons[k], gen.weight_version,
                           None if gen.routed_experts is None else gen.routed_experts[k])
        return outs

    def simulated_length(self, p: dict) -> int:
        """--simulate-lengths: the tokens left of this response's drawn length, lognormal(log median, sigma) from
        the response's seed (custom_params.sample_seed, else sampling_seed), less custom_params.generated (the
        tokens a continued response already has); at least 1."""
        import math
        import random

        custom = p.get("custom_params") or {}
        seed = int(custom.get("sample_seed", p.get("sampling_seed", 0)))
        median, sigma = self.lengths
        total = max(1, round(random.Random(seed).lognormvariate(math.log(median), sigma)))
        return max(1, total - int(custom.get("generated", 0)))

    def _gate(self) -> None:
        """New rows wait while a weight update or a pause is on (the rows in flight run on, unless aborted)."""
        if self.batcher is not None:
            (self.batcher.hold if self.updating or self.paused else self.batcher.release)("gate")

    def begin_weight_update(self, req: dict) -> dict:
        self.updating = True
        self._gate()
        return {"success": True, "message": "generation paused until /end_weight_update"}

    def end_weight_update(self, req: dict) -> dict:
        self.updating = False
        self._gate()
        self.cond.notify_all()
        return {"success": True, "message": "ok"}

    def pause_generation(self, req: dict) -> dict:
        """SGLang's /pause_generation (answered without waiting for the request in flight): /generate waits until
        /continue_generation; with mode "abort" (SGLang's default) the request in flight ends after its current
        decode step, each unfinished response with its tokens so far and finish_reason "abort"; with mode "retract"
        its rows leave the decode loop after the current step and wait, their requests open, to be prefilled again
        (input and tokens so far) under the weights loaded before /continue_generation; with mode "in_place" the loop
        stops between two steps with its rows in it (their keys and values kept), a bucket loads under them, and they
        sample on from those keys and values under the new weights."""
        mode = req.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"/pause_generation mode={mode!r}: this server pauses with 'abort', 'retract' or "
                             "'in_place'")
        self.paused = True
        self._gate()
        if mode == "abort":
            self.engine.aborting.set()
        elif self.batcher is not None and mode == "retract":
            self.batcher.retract()
        elif self.batcher is not None:
            self.batcher.park()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def abort_request(self, req: dict) -> dict:
        """SGLang's /abort_request: the rows of request `rid` (every request's with abort_all) end at the next decode
        step, those waiting at once, with their tokens so far and finish_reason "abort"."""
        rid, every = req.get("rid"), bool(req.get("abort_all"))
        if not every and not isinstance(rid, str):
            raise ValueError("/abort_request needs a rid (the request's id) or abort_all: true")
        if self.batcher is not None:
            self.batcher.abort(None if every else {rid})
        return {"success": True}

    def continue_generation(self, req: dict) -> dict:
        self.paused = False
        self.engine.aborting.clear()
        if self.batcher is not None:
            self.batcher.unpark()
        self._gate()
        self.cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _routed_experts_b64(self, routed) -> str:
        """SGLang 0.5.23's meta_info["routed_experts"]: base64 of int32 [positions, num_hidden_layers, top_k]
        (-1 at the dense layers) from the engine's [positions, M, k] of the MoE layers."""
        import base64

        import torch

        layers = self.engine.model.config.num_hidden_layers
        moe = [i for i, m in enumerate(self.engine.model.model.layers) if hasattr(m.mlp, "experts")]
        full = torch.full((routed.shape[0], layers, routed.shape[2]), -1, dtype=torch.int32)
        full[:, moe] = routed.to(torch.int32)
        return base64.b64encode(full.numpy().tobytes()).decode()

    def init_weights_update_group(self, req: dict) -> dict:
        name = req.get("group_name", "weight_update_group")
        if req.get("backend", "gloo") != "gloo":
            return dict(success=False, message=f"backend={req.get('backend')!r}: this CPU server speaks gloo only")
        self.groups[name] = join_update_group(req["master_address"], req["master_port"], req.get("rank_offset", 1),
                                              req["world_size"], name, self.timeout_s)
        return dict(success=True, message=f"joined {name} as rank {req.get('rank_offset', 1)}")

    def update_weights_from_distributed(self, req: dict) -> dict:
        if req.get("load_format") != "flattened_bucket":
            return dict(success=False, message=f"load_format={req.get('load_format')!r}: only 'flattened_bucket'")
        names, dtypes, shapes = req.get("names"), req.get("dtypes"), req.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            return dict(success=False, message="names, dtypes and shapes must be lists of one entry per tensor")
        metas, offset = [], 0
        for name, dtype, shape in zip(names, dtypes, shapes):  # the whole bucket, before any byte or weight moves
            param = self.engine.params.get(name) if isinstance(name, str) else None
            if param is None:
                return dict(success=False, message=f"unknown tensor {name!r}: nothing loaded")
            if dtype not in DTYPES:
                return dict(success=False, message=f"{name}: dtype {dtype!r} is not one of {DTYPES}: nothing loaded")
            if not isinstance(shape, list) or tuple(shape) != tuple(param.shape):
                return dict(success=False, message=f"{name}: shape {shape!r} is not the model's "
                                                   f"{tuple(param.shape)}: nothing loaded")
            dt = getattr(torch, dtype)
            nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
            metas.append(TensorMeta(name, dt, tuple(shape), offset, nbytes))
            offset += nbytes
        group = self.groups.get(req.get("group_name", "weight_update_group"))
        if group is None:
            return dict(success=False, message="no weight update group: call /init_weights_update_group first")
        flat = torch.empty(offset, dtype=torch.uint8)
        group.broadcast(flat, 0).wait()
        if self.batcher is not None:  # loaded between two decode steps, under no row but those paused in place
            self.batcher.hold("load")
        try:
            if self.batcher is not None and not self.batcher.quiet(self.timeout_s):
                return dict(success=False, message=f"requests in flight did not end within {self.timeout_s:.0f} s: "
                                                   "nothing loaded (pause or abort them first)")
            self.engine.load_bucket(Bucket(metas, flat))
        finally:
            if self.batcher is not None:
                self.batcher.release("load")
        if req.get("weight_version") is not None:
            self.engine.weight_version = int(req["weight_version"])
        return dict(success=True, message=f"loaded {len(metas)} tensors")

    def flush_cache(self, req: dict) -> dict:
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.clear()
        return {"success": True}

    def update_weight_version(self, req: dict) -> dict:
        version = req.get("new_version")
        if isinstance(version, bool) or not isinstance(version, (int, str)) or not str(version).isdigit():
            return dict(success=False, message=f"new_version={version!r} is not a non-negative integer")
        self.engine.weight_version = int(version)
        return dict(success=True, message="ok")

    def weight_checksums(self, req: dict) -> dict:
        sums = self.engine.weight_checksums()
        names = req.get("names")
        return {n: sums[n] for n in names if n in sums} if names else sums


def _spans(versions: list[int], current: int) -> list[dict]:
    """Per-token weight versions as SGLang 0.5.23's meta_info["weight_versions"]: [{version (str), start, end}] over
    runs of one version ([{current, 0, 0}] for no token)."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans or [{"version": str(current), "start": 0, "end": 0}]


def slow_decode(engine: EmbeddedEngine, seconds: float) -> None:
    """--simulate-decode-ms: every decode step of `engine` takes `seconds` more."""
    import time

    steps = engine._decode_step

    def slowed(mode):
        step = steps(mode)
        return lambda *args: (time.sleep(seconds), step(*args))[1]

    engine._decode_step = slowed


def make_handler(server: EngineServer):
    posts = {"/generate": server.generate, "/abort_request": server.abort_request,
             "/init_weights_update_group": server.init_weights_update_group,
             "/update_weights_from_distributed": server.update_weights_from_distributed,
             "/update_weight_version": server.update_weight_version, "/flush_cache": server.flush_cache,
             "/begin_weight_update": server.begin_weight_update, "/end_weight_update": server.end_weight_update,
             "/pause_generation": server.pause_generation, "/continue_generation": server.continue_generation,
             "/grpo_mega/weight_checksums": server.weight_checksums}

    def model_info():
        return {"model_path": server.model_path, "is_generation": True,
                "weight_version": str(server.engine.weight_version)}

    def decode_stats():  # the decode loop's counters so far (benchmarks read two and subtract)
        b = server.batcher
        return {"steps": b.steps, "row_steps": b.row_steps, "busy_s": b.busy_s} if b is not None else {}

    gets = {"/health": lambda: {}, "/model_info": model_info, "/get_model_info": model_info,
            "/grpo_mega/decode_stats": decode_stats}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # TCP_NODELAY: a reply is written as headers then body, and on a kept-alive connection Nagle's algorithm held
        # the body for the client's delayed ACK (40 ms a call; SGLang's asyncio server sets it too)
        disable_nagle_algorithm = True
        timeout = server.socket_timeout_s  # a client that stops mid-request frees its thread

        def _reply(self, code: int, body) -> None:
            data = json.dumps(body).encode()
            # one write: status line, headers and body (send_response's way wrote twice, a syscall and a TCP segment
            # more on the server's core for every request)
            head = [f"{self.protocol_version} {code} {self.responses.get(code, ('',))[0]}",
                    "Content-Type: application/json", f"Content-Length: {len(data)}"]
            if self.close_connection:
                head.append("Connection: close")
            self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)

        def _run(self, fn, *args) -> None:
            try:
                if fn in (server.pause_generation, server.generate, server.abort_request):  # never wait for the loop
                    out = fn(*args)
                else:
                    with server.lock:
                        out = fn(*args)
            except Exception as e:  # noqa: BLE001 - every failure is the client's to report
                return self._reply(400, {"error": {"message": f"{type(e).__name__}: {e}"}})
            ok = not (isinstance(out, dict) and out.get("success") is False)
            self._reply(200 if ok else 400, out)

        def _refused(self) -> bool:
            """401 for a request without the server's key (GET /health stays open for liveness probes)."""
            if self.path.split("?")[0] == "/health" and self.command == "GET" or server.authorized(
                    self.headers.get("Authorization")):
                return False
            self.close_connection = True  # its body, if any, is never read
            self._reply(401, {"error": {"message": "missing or wrong API key: send Authorization: Bearer KEY, with the "
                                                   f"key the server was started with (${server.api_key_env})"}})
            return True

        def do_GET(self):
            if self._refused():
                return
            fn = gets.get(self.path.split("?")[0])
            if fn is None:
                return self._reply(404, {"error": {"message": f"no GET {self.path}"}})
            self._run(fn)

        def do_POST(self):
            if self._refused():
                return
            fn = posts.get(self.path)
            raw_length = self.headers.get("Content-Length") or "0"
            if not raw_length.isdigit():
                self.close_connection = True
                return self._reply(400, {"error": {"message": f"Content-Length {raw_length!r} is not a length"}})
            length = int(raw_length)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                return self._reply(413, {"error": {"message": f"a body of {length} bytes; at most {MAX_BODY_BYTES}"}})
            try:
                body = self.rfile.read(length)
                if len(body) != length:
                    self.close_connection = True
                    return self._reply(400, {"error": {"message": f"the body ended after {len(body)} of {length} bytes"}})
                req = json.loads(body or b"{}")
            except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep, an over-long number
                return self._reply(400, {"error": {"message": f"the body of POST {self.path} is not JSON we read: "
                                                              f"{type(e).__name__}: {str(e)[:200]}"}})
            except OSError as e:  # the socket timed out mid-body
                self.close_connection = True
                return self._reply(408, {"error": {"message": f"the body did not arrive: {e}"}})
            if not isinstance(req, dict):
                return self._reply(400, {"error": {"message": f"the body of POST {self.path} must be a JSON object"}})
            if fn is None:
                return self._reply(404, {"error": {"message": f"no POST {self.path}"}})
            self._run(fn, req)

        def log_message(self, fmt, *args):  # quiet: the trainer's logs are the ones to read
            pass

    return Handler


def launch(args: list[str], prefix: tuple = (), env: Optional[dict] = None, cwd: Optional[str] = None,
           timeout_s: float = 180.0):
    """Start `python -m grpo_mega.engines.standin_server ARGS` as a process of its own (`prefix`, e.g. taskset, before
    it) and wait until it prints its URL; returns (the process, the URL). A server that does not come up in
    `timeout_s` is killed by its PID and reported in a RuntimeError with its last line."""
    import select
    import subprocess
    import time

    proc = subprocess.Popen([*prefix, sys.executable, "-m", "grpo_mega.engines.standin_server", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
    line, deadline = "", time.monotonic() + timeout_s
    while "ready on " not in line and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline() or line
    if "ready on " not in line:
        processes.stop(proc)
        raise RuntimeError(f"the rollout server did not start within {timeout_s:.0f} s: {line.strip()!r}")
    return proc, line.split("ready on ")[1].strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model config name (model_configs/NAME.yaml); weights arrive by sync")
    src.add_argument("--hf-dir", help="an HF checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--vocab-size", type=int, default=None, help="with --model: override its vocabulary "
                    "(the toy task's run uses its tokenizer's: python -c 'from grpo_mega.data.toy import "
                    "make_tokenizer; print(len(make_tokenizer()))')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="for joining and using the update group")
    ap.add_argument("--socket-timeout-s", type=float, default=SOCKET_TIMEOUT_S,
                    help="each socket read or write; a client that stalls longer mid-request loses its connection")
    ap.add_argument("--api-key-env", default="GRPO_MEGA_SERVER_API_KEY",
                    help="the environment variable holding the API key requests must carry (unset or empty: none, "
                         "and then only a loopback --host); a key is never taken on the command line, which every "
                         "user of the node can read")
    ap.add_argument("--simulate-lengths", default=None, metavar="MEDIAN,SIGMA",
                    help="benchmarks: each response ends after a lognormal number of tokens (its median and sigma), "
                         "drawn from its seed; stop tokens are ignored")
    ap.add_argument("--simulate-decode-ms", type=float, default=0.0, metavar="MS",
                    help="benchmarks: each decode step of the engine takes MS milliseconds more (a larger model's "
                         "step on this server, whatever the batch: a memory-bound decode), so that generation, not "
                         "training, dominates a step")
    ap.add_argument("--disable-radix-cache", action="store_true",
                    help="as SGLang's: do not keep a response's keys and values for the request that continues it "
                         "(rollout.mode=async's next segment); each request then prefills its whole input")
    ap.add_argument("--threads", type=int, default=THREADS, help="threads serving connections")
    ap.add_argument("--max-pending", type=int, default=MAX_PENDING,
                    help="connections waiting for a thread; more are closed at once")
    args = ap.parse_args(argv)
    api_key = os.environ.get(args.api_key_env, "")
    try:
        check_bind(args.host, api_key)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(1)
    if args.hf_dir:
        engine = EmbeddedEngine.from_hf_dir(args.hf_dir)
    else:
        from grpo_mega.conf import load_model_config

        cfg = load_model_config(args.model)
        if args.vocab_size:
            cfg.vocab_size = args.vocab_size
        engine = EmbeddedEngine.from_model_config(cfg, seed=args.seed)
    if not args.disable_radix_cache:
        engine.enable_prefix_cache()
    if args.simulate_decode_ms > 0:
        slow_decode(engine, args.simulate_decode_ms / 1000)
    lengths = None
    if args.simulate_lengths:
        try:
            median, sigma = (float(x) for x in args.simulate_lengths.split(","))
            assert median >= 1 and sigma >= 0
        except (ValueError, AssertionError):
            print(f"error: --simulate-lengths {args.simulate_lengths!r}: give MEDIAN,SIGMA (median >= 1, sigma >= 0), "
                  "e.g. 16,0.9", file=sys.stderr, flush=True)
            return 2
        lengths = (median, sigma)
    server = EngineServer(engine, args.hf_dir or args.model, args.timeout_s, api_key=api_key,
                          api_key_env=args.api_key_env, socket_timeout_s=args.socket_timeout_s, lengths=lengths,
                          call_tokens=call_tokens(args.simulate_decode_ms / 1000))
    httpd = PooledHTTPServer((args.host, args.port), make_handler(server), args.threads, args.max_pending)
    print(f"grpo_mega rollout server ready on http://{args.host}:{httpd.server_address[1]}", flush=True)
    httpd.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
