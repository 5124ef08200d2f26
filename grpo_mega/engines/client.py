"""The client of dedicated rollout servers (`rollout.placement=dedicated`): the RolloutEngine interface over
SGLang's HTTP API, spoken to `python -m sglang.launch_server` (GPUs that do not train, or SGLang's CPU engine)
or to the embedded engine's server (grpo_mega.engines.standin_server) on CPU; both through the same calls.

Owns the requests, not the servers: health at start-up (an unreachable server is named before training
starts), spreading prompts over servers by outstanding tokens (prompt plus n * max_new_tokens, not by
count), and the weight update: one update group set up once through /init_weights_update_group with this
process at rank 0 and server i at rank 1 + i * tp (gloo on CPU, NCCL on GPUs; the group is built the way
SGLang's init_custom_process_group builds its end, see join_update_group), then for every sync
/begin_weight_update, for each bucket one /update_weights_from_distributed request per server and a single
broadcast of the bucket's bytes to all of them, /end_weight_update and /flush_cache. The weight audit asks
our server's /grpo_mega/weight_checksums, or, where a server has no such route (SGLang), reads each tensor
back with /get_weights_by_name. Every call has a timeout; a server that dies or stops answering raises
ServerError naming its URL. Where the client lives and how samples reach the ranks is grpo_mega.rollout.placement'.

Nothing a server answers is trusted: every sample is checked (grpo_mega.engines.validate: integral token ids in
the vocabulary, one finite logprob <= 0 per token, a known finish reason, routed experts in range and distinct,
k the model's top-k, all before any narrowing) and a violation is a ServerError naming the server and the field.
A transient failure (no connection, a reset, a timeout, an HTTP 5xx) of a call that can be repeated (/generate,
/health, reads) is retried `retries` times, `backoff_s` doubling between tries; a transient failure that remains
is a ServerError with `transient` set, which the trainer ends with exit status 75 (EX_TEMPFAIL) and a REQUEUE
file in its run directory, and slurm/train.sbatch requeues the job (docs/slurm.md). The weight-update calls are
never repeated (each is paired with a broadcast).

Authentication: with GRPO_MEGA_SERVER_API_KEY in the environment (slurm/train.sbatch makes one per job), every
request carries `Authorization: Bearer KEY`, what SGLang's --api-key and the stand-in server check. The key is
read from the environment only: never from a config file or argv, which other users of a node can read.

Long on purpose: every request the trainer makes of a server, each with its timeout, retry rule and answer
checks, in one file: the whole protocol a server must speak is read here.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import resource
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from grpo_mega.processes import free_port
from grpo_mega.engines import validate
from grpo_mega.engines.http_conn import Connection
from grpo_mega.engines.interface import Bucket, Generation, RolloutEngine, sample_seed, tensor_checksum

log = logging.getLogger(__name__)

REPEATABLE = ("/generate", "/health", "/model_info", "/server_info", "/flush_cache", "/get_weights_by_name",
              "/grpo_mega/weight_checksums", "/abort_request")
"""The calls a transient failure repeats: they change nothing a second call would change again."""

POOLED = 32
"""Idle kept-alive connections kept per server."""

API_KEY_ENV = "GRPO_MEGA_SERVER_API_KEY"
"""The environment variable holding the dedicated servers' API key (unset: servers without a key)."""


def auth_headers() -> dict:
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def open_files_for(needed: int) -> int:
    """This process's soft limit on open files (RLIMIT_NOFILE) raised to its hard limit when it is below `needed`
    (a connection is a file: many clusters start jobs at a soft limit of 1024); returns the soft limit now.
    ValueError naming both limits when the hard limit is below `needed`: only the job's or the node's settings
    (ulimit -Hn, Slurm's or the container's limits) can raise it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft == infinite or soft >= needed:
        return soft
    if hard != infinite and hard < needed:
        raise ValueError(f"needs about {needed} open files and this process may open {soft} (soft limit), at most "
                         f"{hard} (hard limit, ulimit -Hn)")
    target = max(needed, 65536) if hard == infinite else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def routable_address(urls: list[str]) -> str:
    """This host's address as the servers reach it: the source address of a route to the first server that
    is not on this machine (a UDP connect sends nothing), or 127.0.0.1 when every server is local. Not
    gethostbyname(gethostname()), which is 127.0.1.1 on many clusters, or an interface the servers cannot reach."""
    from urllib.parse import urlparse

    for url in urls:
        u = urlparse(url)
        if u.hostname in ("127.0.0.1", "localhost", "::1"):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(u.hostname), u.port or 80))
            addr = s.getsockname()[0]
        if addr.startswith("127."):
            raise ValueError(f"rollout server {url} is reached through {addr} (loopback): the servers could not "
                             "connect back for the weight update; give rollout.servers by routable addresses")
        return addr
    return "127.0.0.1"


class ServerError(RuntimeError):
    """A rollout server failed, died, did not answer in time or answered something that breaks the contract (the
    message names its URL, and the field); `status` is the HTTP status of a refusal, None when there was no
    answer; `transient`: no answer, a reset or an HTTP 5xx, which a later try (or a requeued job) may not meet."""

    def __init__(self, message: str, status: Optional[int] = None, transient: bool = False):
        super().__init__(message)
        self.status, self.transient = status, transient


def join_update_group(host: str, port: int, rank: int, world: int, group_name: str, timeout_s: float,
                      backend: str = "gloo"):
    """This process's end of a weight-update group, laid out in the store exactly as SGLang's
    init_custom_process_group (sglang.srt.utils) lays out the servers' ends: a TCP store at host:port hosted
    by rank 0 (the client), its keys under PrefixStore(group_name) (SGLang's), then `group_name/` and the
    device's `cpu/` or `cuda/` (torch's _new_process_group_helper, which SGLang calls), and the backend's
    process group over that. The group is used through its own object and never registered with
    torch.distributed: the trainer's groups are untouched."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), int(world), is_master=rank == 0, timeout=timeout)
    device = "cuda" if backend == "nccl" else "cpu"
    store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, int(rank), int(world))  # untested here: no GPUs on this machine
    if backend != "gloo":
        raise ValueError(f"weight-update group backend {backend!r}: expected 'gloo' (CPU) or 'nccl' (GPU)")
    return dist.ProcessGroupGloo(store, int(rank), int(world), timeout)


def _in_threads(calls: list) -> list:
    """Run (fn, args) pairs at once; the results in order, or the first exception raised again."""
    results: list = [None] * len(calls)

    def run(i, fn, args):
        try:
            results[i] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, fn, args), daemon=True) for i, (fn, args) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class ServerClient(RolloutEngine):
    """Samples from, and weights into, the servers at `urls` (e.g. ["http://10.0.0.5:30000"])."""

    def __init__(self, urls: list[str], timeout_s: float = 60.0, server_tp: int = 1,
                 group_name: str = "grpo_mega_weights", moe_layers: Optional[list[bool]] = None,
                 spec: validate.OutputSpec = validate.OutputSpec(), retries: int = 3, backoff_s: float = 2.0):
        """`moe_layers` (per layer: does it hold experts): ask for the routed experts (routing replay). `spec`: what
        samples are checked against (the model's vocabulary, experts and top-k). `retries`, `backoff_s`: a
        transient failure of a repeatable call is tried again up to `retries` times, after backoff_s, 2 backoff_s,
        ... seconds (rollout.server_retries, rollout.server_retry_backoff_s)."""
        if not urls:
            raise ValueError("rollout.servers is empty: dedicated placement needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.server_tp, self.group_name = timeout_s, server_tp, group_name
        self.spec, self.retries, self.backoff_s = spec, retries, backoff_s
        self.outstanding = {u: 0 for u in self.urls}  # tokens asked of each server and not yet answered
        self._counting = threading.Lock()  # requests are sent from several threads (rollout.mode=async)
        self._pools: dict[str, queue.SimpleQueue] = {}  # url -> idle kept-alive connections
        self._group = None
        self._sent_dtypes: dict[str, torch.dtype] = {}  # HF name -> dtype of what the last sync sent
        self._audit_route: dict[str, str] = {}  # URL -> how its weights are read back (see weight_checksums)
        self.weight_version = 0
        self.moe_layers = moe_layers
        self.interrupt = False  # update_weights pauses the requests in flight (rollout.mode=async, partial rollouts)
        self.pause_mode = "abort"  # how: SGLang's /pause_generation mode (rollout.pause_mode)
        for url in self.urls:  # named before any training starts
            self._call(url, "/health", None, what="the start-up health check")

    # ---- HTTP -------------------------------------------------------------------------------------

    def _call(self, url: str, path: str, body: Optional[dict], what: str = "", timeout: Optional[float] = None):
        """The decoded JSON answer; an answer that is not JSON (SGLang's /flush_cache says "Cache flushed.")
        as its text, an empty one as {}. A transient failure of a REPEATABLE call is tried again (`retries`)."""
        tries = 1 + (self.retries if path in REPEATABLE else 0)
        for attempt in range(tries):
            try:
                return self._call_once(url, path, body, what, timeout)
            except ServerError as e:
                if not e.transient or attempt + 1 == tries:
                    if e.transient and tries > 1:
                        raise ServerError(f"{e} (tried {tries} times; rollout.server_retries={self.retries})",
                                          e.status, transient=True) from None
                    raise
                wait = self.backoff_s * 2 ** attempt
                log.warning("%s; trying again in %.1f s (%d of %d tries)", e, wait, attempt + 2, tries)
                time.sleep(wait)

    def _connection(self, url: str, timeout: float, reuse: bool) -> Connection:
        """With `reuse`, a kept-alive connection to `url` from the pool that the server has not closed (a request per
        response in rollout.mode=async: a new connection each cost the trainer's core more than the request);
        else a new one."""
        pool = self._pools.setdefault(url, queue.SimpleQueue())
        while reuse:
            try:
                conn = pool.get_nowait()
            except queue.Empty:
                break
            if conn.stale():  # closed by the server (or stray bytes)
                conn.close()
                continue
            conn.settimeout(timeout)
            return conn
        parts = urllib.parse.urlsplit(url)
        return Connection(parts.hostname, parts.port, parts.scheme == "https", timeout)

    def _call_once(self, url: str, path: str, body: Optional[dict], what: str, timeout: Optional[float]):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **auth_headers()}
        timeout = timeout or self.timeout_s
        # a kept-alive connection (which the server may close meanwhile) only for a call that may be repeated
        reuse = path in REPEATABLE
        conn = self._connection(url, timeout, reuse)
        try:
            status, raw, closes = conn.request("GET" if body is None else "POST",
                                               urllib.parse.urlsplit(url).path.rstrip("/") + path, data, headers)
        except OSError as e:
            conn.close()
            raise ServerError(f"rollout server {url} did not answer {path}{' (' + what + ')' if what else ''} "
                              f"within {timeout:.0f} s: {type(e).__name__}: {e}; is it running? (rollout.servers)",
                              transient=True) from None
        if closes or not reuse or self._pools[url].qsize() >= POOLED:
            conn.close()  # an idle connection holds one of the stand-in's threads: the pool stays small
        else:
            self._pools[url].put(conn)
        if status >= 400:
            detail = raw.decode(errors="replace")[:300]
            raise ServerError(f"rollout server {url} refused {path} (HTTP {status}): {detail}", status,
                              transient=status >= 500)
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    # ---- generation -------------------------------------------------------------------------------

    def assign(self, prompts: list[list[int]], n: int, max_new_tokens: int) -> list[list[int]]:
        """Prompt indices per server: each prompt, longest first, to the server with the fewest outstanding
        tokens (its prompt plus n * max_new_tokens counted for each sample)."""
        load = dict(self.outstanding)
        out: dict[str, list[int]] = {u: [] for u in self.urls}
        for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
            url = min(self.urls, key=lambda u: load[u])
            out[url].append(i)
            load[url] += n * (len(prompts[i]) + max_new_tokens)
        return [sorted(out[u]) for u in self.urls]

    def _generate_on(self, url: str, prompts, idx: list[int], n, temperature, top_p, max_new, stop, seed, offset,
                     row_seeds=None):
        if not idx:
            return []
        tokens = sum(n * (len(prompts[i]) + max_new) for i in idx)
        input_ids, params = [], []
        for i in idx:
            for j in range(n):
                input_ids.append(list(prompts[i]))
                params.append(dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new,
                                   stop_token_ids=list(stop),
                                   sampling_seed=(row_seeds[i] if row_seeds is not None else
                                                  sample_seed(seed, offset + i, j)) % (2**31),
                                   skip_special_tokens=False, no_stop_trim=True))
        self._count(url, tokens)
        try:
            body = dict(input_ids=input_ids, sampling_params=params, return_logprob=True)
            if self.moe_layers is not None:
                body["return_routed_experts"] = True
            out = self._call(url, "/generate", body)
        finally:
            self._count(url, -tokens)
        if not isinstance(out, list) or len(out) != len(input_ids):
            raise ServerError(f"rollout server {url} answered /generate with {type(out).__name__}, not "
                              f"{len(input_ids)} outputs")
        return out

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 stop_token_ids: Iterable[int], seed: int, prompt_offset: int = 0,
                 row_seeds: Optional[list[int]] = None) -> Generation:
        """As RolloutEngine.generate; with `row_seeds` (n=1, one per prompt; what grpo_mega.rollout.multi_turn
        passes) prompt i's sampling_seed is row_seeds[i] mod 2**31, wherever it is sent."""
        if row_seeds is not None and (n != 1 or len(row_seeds) != len(prompts)):
            raise ValueError(f"row_seeds needs n=1 and one seed per prompt; got n={n}, {len(row_seeds)} seeds for "
                             f"{len(prompts)} prompts")
        stop = list(stop_token_ids)
        shares = self.assign(prompts, n, max_new_tokens)
        answers = _in_threads([(self._generate_on, (u, prompts, idx, n, temperature, top_p, max_new_tokens, stop, seed,
                                                    prompt_offset, row_seeds)) for u, idx in zip(self.urls, shares)])
        rows: dict[int, list] = {}
        for url, idx, out in zip(self.urls, shares, answers):
            for k, i in enumerate(idx):
                rows[i] = [(url, k * n + j, o) for j, o in enumerate(out[k * n:(k + 1) * n])]
        tokens, logps, finish, versions = [], [], [], set()
        routed = None if self.moe_layers is None else []
        for i in range(len(prompts)):
            for url, k, o in rows[i]:
                try:  # checked before anything is narrowed or kept (grpo_mega.engines.validate)
                    ids, lps, reason = validate.sglang_sample(o, self.spec)
                    if routed is not None:
                        routed.append(self._routed_experts(url, o["meta_info"], len(prompts[i]) + len(ids) - 1))
                except validate.BadOutput as e:
                    raise ServerError(f"rollout server {url} answered /generate with a bad output {k}: {e}") from None
                tokens.append(ids)
                logps.append(lps)
                finish.append(reason)
                versions.add(self._sample_version(url, o["meta_info"]))
        if len(versions) > 1:
            raise ServerError(f"the rollout servers {self.urls} answered with different weight versions {sorted(versions)}")
        return Generation(token_ids=tokens, logprobs=logps, finish_reasons=finish,
                          weight_version=versions.pop() if versions else self.weight_version, routed_experts=routed)

    def _count(self, url: str, tokens: int) -> None:
        with self._counting:
            self.outstanding[url] += tokens

    def generate_segment(self, url: str, inputs: list[list[int]], params: list[dict],
                         rids: Optional[list[str]] = None) -> list[tuple]:
        """One /generate of `inputs` (token ids: a prompt and the response so far) on server `url`, each with its own
        sampling params (SGLang's names) and request id (`rids`, for abort_request); per input (token ids, logprobs,
        finish reason, each token's weight version), every field checked, and with `moe_layers` (routing replay) the
        routed experts of its input and output but the last token (int16 [len(input) + len(output) - 1, M, k]) after
        them. The fully asynchronous scheduler's call (grpo_mega.rollout.async_scheduler): a response is continued
        from its token prefix, so the weights may change between two of its segments, and with pause_mode "retract"
        or "in_place" within one (SGLang's weight_versions spans)."""
        tokens = sum(len(x) + int(p.get("max_new_tokens", 0)) for x, p in zip(inputs, params))
        body = dict(input_ids=inputs, sampling_params=params, return_logprob=True)
        if rids is not None:
            body["rid"] = rids
        if self.moe_layers is not None:
            body["return_routed_experts"] = True
        self._count(url, tokens)
        try:
            out = self._call(url, "/generate", body)
        finally:
            self._count(url, -tokens)
        if not isinstance(out, list) or len(out) != len(inputs):
            raise ServerError(f"rollout server {url} answered /generate with {type(out).__name__}, not "
                              f"{len(inputs)} outputs")
        rows = []
        for k, o in enumerate(out):
            try:
                ids, lps, reason = validate.sglang_sample(o, self.spec, aborted_ok=self.interrupt)
            except validate.BadOutput as e:
                raise ServerError(f"rollout server {url} answered /generate with a bad output {k}: {e}") from None
            if len(ids) > int(params[k].get("max_new_tokens", len(ids))):
                raise ServerError(f"rollout server {url} answered {len(ids)} tokens for output {k}, more than its "
                                  f"max_new_tokens={params[k].get('max_new_tokens')}")
            if self.pause_mode != "abort":  # retract, in_place: a request may span updates
                try:
                    versions = validate.token_versions(o["meta_info"], len(ids))
                except validate.BadOutput as e:
                    raise ServerError(f"rollout server {url} answered /generate with a bad output {k}: {e}") from None
            else:  # a request never spans an update: one version a request
                versions = [self._sample_version(url, o["meta_info"])] * len(ids)
            if self.moe_layers is None:
                rows.append((ids, lps, reason, versions))
                continue
            positions = len(inputs[k]) + len(ids) - 1
            try:
                routed = self._routed_experts(url, o["meta_info"], positions) if ids else None
            except validate.BadOutput as e:
                raise ServerError(f"rollout server {url} answered /generate with a bad output {k}: {e}") from None
            rows.append((ids, lps, reason, versions, routed))
        return rows

    def abort_requests(self, url: str, rids: list[str]) -> None:
        """SGLang's /abort_request for each of `rids` on server `url`: those requests end at once with their tokens so
        far (finish reason "abort"); one already ended is no error."""
        for rid in rids:
            self._call(url, "/abort_request", {"rid": rid}, what="ending a request the trainer no longer needs")

    def check_pause_mode(self) -> None:
        """pause_mode "retract" keeps the requests open across a weight update and SGLang prefills them again under
        the new weights, but its radix cache would hand them their prompt's old keys and values (SGLang's /flush_cache
        refuses while requests wait; with "in_place", while they run, so new requests would start from them too):
        each server must run without it; with "in_place" also without the overlap scheduler, whose token in flight at
        the pause SGLang 0.5.23 reports under the new version though the old weights sampled it (one token a request
        an update, measured in the sglang tier). ServerError naming the server and the flags otherwise. A server
        without /server_info (the stand-in: a weight load empties its prefix cache, and its versions are exact)
        passes."""
        for url in self.urls:
            try:
                info = self._call(url, "/server_info", None, what="checking its flags (rollout.pause_mode)")
            except ServerError as e:
                if e.status == 404:
                    continue
                raise
            if not isinstance(info, dict):
                continue
            why = []
            if info.get("disable_radix_cache") is False:
                why.append(("--disable-radix-cache", "its radix cache would give the requests kept open across a "
                                                     "weight update (and new ones) the old weights' keys and values"))
            if self.pause_mode == "in_place" and info.get("disable_overlap_schedule") is False:
                why.append(("--disable-overlap-schedule", "its overlap scheduler reports the token in flight at a "
                                                          "pause under the new version, though the old weights "
                                                          "sampled it"))
            if why:
                raise ServerError(f"rollout server {url} cannot serve rollout.pause_mode={self.pause_mode}: "
                                  + "; ".join(w for _, w in why) + f". Start it with {' '.join(f for f, _ in why)}, "
                                  "or set rollout.pause_mode=abort")

    def _routed_experts(self, url: str, meta: dict, positions: int) -> torch.Tensor:
        """SGLang's meta_info["routed_experts"] (0.5.23, `return_routed_experts`: base64 of int32
        [prompt + completion - 1, num_hidden_layers, top_k]) as Generation.routed_experts' int16 [positions, M, k]
        of the MoE layers."""
        import base64

        raw = meta.get("routed_experts")
        if raw is None:
            raise ServerError(f"rollout server {url} returned no routed_experts (algo.routing_replay=rollout or "
                              "measure): start "
                              "SGLang with --enable-return-routed-experts")
        try:
            data = base64.b64decode(raw, validate=True)
        except (ValueError, TypeError) as e:
            raise validate.BadOutput(f"meta_info.routed_experts is not base64 ({e})") from None
        if len(data) % 4:
            raise validate.BadOutput(f"meta_info.routed_experts has {len(data)} bytes, not whole int32s")
        flat = torch.frombuffer(bytearray(data), dtype=torch.int32)
        layers = len(self.moe_layers)
        if positions <= 0 or flat.numel() % (positions * layers):
            raise validate.BadOutput(f"meta_info.routed_experts has {flat.numel()} expert ids for {positions} "
                                     f"positions and {layers} layers")
        full = flat.view(positions, layers, -1)
        moe = full[:, torch.tensor(self.moe_layers)]  # int32, as sent: checked before it is narrowed to int16
        return validate.routed_experts(moe, positions, self.spec, "meta_info.routed_experts").contiguous()

    @staticmethod
    def _sample_version(url: str, meta: dict) -> int:
        """The weight version a sample was generated with: meta_info's weight_version (a string, set by the
        weight_version of /update_weights_from_distributed, or SGLang's --weight-version at start-up), and,
        where SGLang lists them (weight_versions: the versions over the sample's tokens), every one the same."""
        version = meta.get("weight_version")
        spans = {str(s["version"]) for s in meta.get("weight_versions") or []}
        if spans and spans != {str(version)}:
            raise ServerError(f"rollout server {url} generated a sample across weight versions {sorted(spans)} "
                              f"(its weights changed during the generation)")
        try:
            return int(version)
        except (TypeError, ValueError):
            raise ServerError(f"rollout server {url} answered weight_version {version!r}, not an integer: it has not "
                              f"received weights from this trainer yet (start SGLang with --weight-version 0, or "
                              f"sync before generating)") from None

    # ---- weights ---------------------------------------------------------------------------------

    def _ensure_group(self) -> None:
        """One update group, once: this process at rank 0 (it hosts the store), server i's TP ranks after."""
        if self._group is not None:
            return
        port, world = free_port("0.0.0.0"), 1 + len(self.urls) * self.server_tp
        host = routable_address(self.urls)
        backend = "nccl" if torch.cuda.is_available() else "gloo"

        def host_group():
            return join_update_group(host, port, 0, world, self.group_name, self.timeout_s, backend)

        joins = [(self._call, (u, "/init_weights_update_group", dict(
            master_address=host, master_port=port, rank_offset=1 + i * self.server_tp, world_size=world,
            group_name=self.group_name, backend=backend))) for i, u in enumerate(self.urls)]
        self._group = _in_threads([(host_group, ())] + joins)[0]

    def _on_all(self, path: str, body: dict) -> list:
        return _in_threads([(self._call, (u, path, body)) for u in self.urls])

    def update_weights(self, version: int, buckets: Iterable[Bucket]) -> None:
        """One weight-update session on every server (SGLang accepts /update_weights_from_distributed only
        between /begin_weight_update and /end_weight_update); the KV caches are flushed after it. With `interrupt`
        (rollout.mode=async with partial rollouts), SGLang's /pause_generation first holds new requests until
        /continue_generation and, with `pause_mode` "abort", ends those in flight with their tokens so far (continued
        by the caller from that prefix under the new weights; the flush then finds the server idle), or with "retract"
        takes them out of the running batch, open, to be prefilled again and continued under the new weights by the
        server itself, or with "in_place" keeps them in the running batch with their keys and values, to sample on
        under the new weights from those (no flush in either: SGLang refuses one while requests wait or run, and
        check_pause_mode makes sure no radix cache holds old keys and values). No request sees half-updated weights;
        only in_place's requests see their own prefix's old keys and values, by choice."""
        self._ensure_group()
        if self.interrupt:
            self._on_all("/pause_generation", {"mode": self.pause_mode})
        try:
            self._update(version, buckets, flush=not (self.interrupt and self.pause_mode != "abort"))
        finally:
            if self.interrupt:
                self._on_all("/continue_generation", {})

    def _update(self, version: int, buckets: Iterable[Bucket], flush: bool = True) -> None:
        self._on_all("/begin_weight_update", {})
        sent = {}
        for bucket in buckets:
            body = dict(names=[m.name for m in bucket.metas], dtypes=[str(m.dtype).replace("torch.", "") for m in bucket.metas],
                        shapes=[list(m.shape) for m in bucket.metas], group_name=self.group_name, flush_cache=False,
                        load_format="flattened_bucket", weight_version=str(version))
            flat = bucket.flat.cuda() if torch.cuda.is_available() else bucket.flat

            def send():
                self._group.broadcast(flat, 0).wait()

            _in_threads([(send, ())] + [(self._call, (u, "/update_weights_from_distributed", body)) for u in self.urls])
            sent.update({m.name: m.dtype for m in bucket.metas})
        self._on_all("/end_weight_update", {})
        if flush:  # retracted requests keep SGLang from flushing (and its radix cache is off then: check_pause_mode)
            self._on_all("/flush_cache", {})
        self._sent_dtypes.update(sent)
        self.weight_version = version

    def _server_checksums(self, url: str, shapes: Optional[dict[str, tuple]]) -> dict[str, str]:
        """One server's checksums: our extension /grpo_mega/weight_checksums where the server has it; else
        (SGLang: HTTP 404) each tensor read back with /get_weights_by_name, as SGLangEngine.weight_checksums
        does: SGLang sends float32 values (exact for float32 and bfloat16 weights), cast back to the dtype this
        client sent and cut to the HF shape (SGLang pads the vocabulary rows; it reads Llama-family models)."""
        if self._audit_route.get(url) != "get_weights_by_name":
            try:
                sums = self._call(url, "/grpo_mega/weight_checksums", {"names": sorted(shapes)} if shapes else {})
                self._audit_route[url] = "extension"
                return sums
            except ServerError as e:
                if e.status != 404 or self._audit_route.get(url) == "extension":
                    raise
                self._audit_route[url] = "get_weights_by_name"
        if not shapes:
            raise ServerError(f"rollout server {url} has no /grpo_mega/weight_checksums, and /get_weights_by_name "
                              f"needs the names and shapes of the tensors to read")
        out = {}
        for name, shape in shapes.items():
            if name not in self._sent_dtypes:
                raise ServerError(f"cannot audit {name} on {url}: this client never sent it (sync before auditing)")
            w = self._call(url, "/get_weights_by_name", {"name": name, "truncate_size": int(shape[0]) if shape else 1},
                           what=f"reading back {name}")
            if not isinstance(w, list):
                raise ServerError(f"rollout server {url} cannot read back {name} (/get_weights_by_name answered "
                                  f"{w!r:.200}; SGLang implements it for Llama-family models)")
            t = torch.tensor(w, dtype=torch.float32)
            if t.numel() != torch.Size(shape).numel():
                raise ServerError(f"rollout server {url} holds {name} with {t.numel()} values, not {tuple(shape)}")
            out[name] = tensor_checksum(t.reshape(shape).to(self._sent_dtypes[name]))
        return out

    def weight_checksums(self, shapes: Optional[dict[str, tuple]] = None) -> dict[str, str]:
        """The servers' checksums by HF name; a tensor on which the servers disagree is reported with a
        value naming them, so that the audit names it."""
        answers = _in_threads([(self._server_checksums, (u, shapes)) for u in self.urls])
        out = dict(answers[0])
        for url, sums in zip(self.urls[1:], answers[1:]):
            for name in set(out) | set(sums):
                if sums.get(name) != out.get(name):
                    out[name] = f"differs between {self.urls[0]} and {url}"
        return out

    def health(self) -> dict:
        try:
            versions = [self._call(u, "/model_info", None)["weight_version"] for u in self.urls]
            return {"ok": True, "weight_version": self.weight_version, "servers": dict(zip(self.urls, versions))}
        except ServerError as e:
            return {"ok": False, "error": str(e), "weight_version": self.weight_version}


def wait_healthy(urls: list[str], limit_s: float, step_pid: Optional[int] = None) -> list[str]:
    """Poll every server's /health until all answer or `limit_s` passes (or the process `step_pid`, the
    servers' launcher, ends); returns the URLs still not answering."""
    import os
    import time

    deadline, waiting = time.monotonic() + limit_s, set(urls)
    while waiting and time.monotonic() < deadline:
        if step_pid is not None:
            try:
                os.kill(step_pid, 0)
            except OSError:
                break
        for url in sorted(waiting):
            try:
                with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as resp:
                    resp.read()
                waiting.discard(url)
            except OSError:
                pass
        if waiting:
            time.sleep(1)
    return sorted(waiting)


def main(argv=None) -> int:
    """`python -m grpo_mega.engines.client --wait-healthy SECONDS [--step-pid PID] URL...`: slurm/train.sbatch
    waits with it for the rollout servers before it starts the trainer."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--wait-healthy", type=float, required=True, metavar="SECONDS")
    ap.add_argument("--step-pid", type=int, default=None, help="stop waiting when this process (the servers) ends")
    ap.add_argument("urls", nargs="+")
    a = ap.parse_args(argv)
    missing = wait_healthy(a.urls, a.wait_healthy, a.step_pid)
    if missing:
        print(f"error: rollout servers not answering /health after {a.wait_healthy:.0f} s (or their step "
              f"ended): {', '.join(missing)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
