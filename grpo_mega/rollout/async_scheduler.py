"""Fully asynchronous rollouts (`rollout.mode=async`, dedicated servers): the servers generate whole groups
continuously from the prompt stream while the trainer trains, and the trainer takes a batch as soon as enough
groups are complete and fresh enough (docs/design.md, "Versions and off-policy").

Rank 0 runs one worker thread per server. A worker keeps its server's share of the batch's responses
(train_batch_size / servers groups x rollout.n) unfinished in flight, one request per response, all at once (the
server decodes them in one loop: SGLang's continuous batching, the stand-in's too): a request carries the prompt and
the response's tokens so far (token in), for the rest of its budget (at most `rollout.segment_tokens` more tokens
where that is set); an interrupted or cut response is sent again at once, a finished group leaves, and new groups
join while fewer responses than that are unfinished (a group waiting on one long response leaves the room of its
finished ones to new groups). A weight sync never waits for a response to finish: the client pauses the requests in
flight (SGLang's /pause_generation, which the stand-in implements too) and a response continues under the new
weights from its token prefix: with rollout.pause_mode=abort its request ends and is sent again from that prefix
(between two syncs a server starts a segment from the keys and values of its response so far: SGLang's radix cache,
the stand-in's prefix cache); with retract its request stays open and the server prefills it again itself; with
in_place its request stays open and the server samples on from the keys and values computed so far. Each of
its tokens records the version that produced it and its behaviour logprob; with routing replay each of its positions
the routed experts of the request that fed it (`join_routes`). With `rollout.partial_rollouts=false` a
response is generated in one request and keeps its version: rank 0 sends no new request and waits for those in
flight before the sync. Each request in flight holds a connection, so the workers start only once rank 0's soft
limit on open files covers them (raised to the hard limit when short; a hard limit too low is every rank's error,
naming the limits and the way out).

Staleness bound k = `rollout.off_policy_steps`: step s (the trainer holds version s-1) takes the first
train_batch_size completed groups, in completion order, whose oldest token has version >= s-1-k; older ones are
dropped and counted, and so is a group still in flight as soon as its oldest token falls behind the bound (its
responses are not sent again: with pause_mode=abort the next sync ends them, with retract or in_place their open
requests are ended by id; a request open across updates counts as old as the version it was sent at). Groups are
started only while fewer than (v + k + 1) * train_batch_size plus the groups dropped so far were started in all, v
the servers' version (AReaL's rule): a group started on version v can still be trained at step v+k+1, so only the
long tail of a group that waits past that is dropped; a run that drops more than a tenth of what the servers complete
over 10 steps is told so once. With `rollout.drop_stale=false` no group is dropped: one past the bound is trained
when it completes, its old tokens weighed by the rollout correction, and k bounds only the starts (AReaL's
max_head_offpolicyness); `async/token_lag_over_k` is the share of a step's tokens older than k. A group's
advantages are computed after all its samples are done (the batch only holds complete groups); a group may span
versions.

Interface: RolloutScheduler's (grpo_mega.rollout.scheduler), as the loop calls it; `metrics()` is the last
step's async/* metrics (staleness histograms, idle fractions, tokens/s, drops), the same on every rank.
Prompts are drawn on rank 0 only, by the workers, in start order; the batch's prompts reach the other ranks
with its samples.

Checkpoints carry the groups (`state()`): those complete and not yet taken, in completion order, and those in flight
with the tokens, logprobs and versions each response had at that moment (a segment being generated then is
generated again on resume: the same sampling seed, the resumed servers' weights). Each group keeps the task's
state from before its prompt was drawn; `restore` sets the earliest one's, draws the prompts again up to the
checkpoint's start count (checking the saved ones; those already trained or dropped are skipped), takes the
complete groups first and continues the others from their token prefixes, so no prompt is lost or drawn twice.

Long on purpose: the workers, the take and the checkpoint read and change one set of groups under one lock.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from grpo_mega.parallel import comm
from grpo_mega.engines.client import POOLED, ServerError, open_files_for
from grpo_mega.engines.interface import Generation, sample_seed
from grpo_mega.rollout.placement import Engines, RolloutError
from grpo_mega.rollout.scheduler import SamplingArgs, StepSamples

log = logging.getLogger(__name__)

FILES_BESIDE = 1024
"""Open files counted for the rest of rank 0's process (libraries, gloo's sockets, checkpoint files, reward workers)."""

DROP_WINDOW, DROP_WARN = 10, 0.1
"""Said once a run: over the last DROP_WINDOW steps more than DROP_WARN of the completed samples were dropped."""


@dataclass
class Response:
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per token: the weight version that sampled it."""
    finish: Optional[str] = None
    segments: int = 0
    sent_version: Optional[int] = None
    """The servers' version when its request in flight was sent: no token of it is older (rollout.pause_mode=retract
    keeps a request open across updates, its tokens unknown until it ends)."""
    routes: Optional[torch.Tensor] = None
    """Routing replay: the routed experts of its prompt and tokens but the last (int16 [P + len(tokens) - 1, M, k]),
    each position's from the request that fed it (the one that sampled the token after it): a continuation's
    prefill of the positions before its prefix's last token is not taken (`join_routes`)."""


def join_routes(have: Optional[torch.Tensor], got: torch.Tensor, fed: int) -> torch.Tensor:
    """A response's routed experts after a request answered `got` ([its input and output but the last token, M, k]):
    the `fed` positions before the request's last input token keep the routes of the requests that fed them (a
    continuation prefills them again, maybe under newer weights, but the tokens after them were sampled from the
    first pass), the rest are the request's."""
    if have is None:
        return got
    if have.shape[0] != fed or got.shape[0] < fed:
        raise ValueError(f"routed experts of {have.shape[0]} and {got.shape[0]} positions do not join at {fed}")
    return torch.cat([have, got[fed:]])


@dataclass
class Group:
    index: int
    """Start order over the run (the seed's prompt index)."""
    example: object
    responses: list[Response]
    task_before: object = None
    """The task's state before this group's prompt was drawn (what a checkpoint holding it resumes from)."""

    @property
    def done(self) -> bool:
        return all(r.finish is not None for r in self.responses)

    stale: bool = False
    """Dropped while in flight: it fell behind the staleness bound (its requests' answers are thrown away)."""

    @property
    def oldest(self) -> Optional[int]:
        """The oldest version among its tokens so far (None before its first token): a response's versions only grow,
        so its first token's."""
        return min((r.versions[0] for r in self.responses if r.versions), default=None)

    @property
    def oldest_bound(self) -> Optional[int]:
        """No token of it, known or still on a server, is older than this (None: none sampled or asked for yet)."""
        firsts = [r.versions[0] if r.versions else r.sent_version for r in self.responses]
        return min((v for v in firsts if v is not None), default=None)


class AsyncRolloutScheduler:
    """The loop's source of samples in rollout.mode=async. Collective where RolloutScheduler's is."""

    def __init__(self, engines: Engines, draw: Callable[[int], list], batch_size: int, sampling: SamplingArgs,
                 staleness: int, last_step: Optional[int] = None, partial: bool = True, segment_tokens: int = 0,
                 share: Optional[Callable[[Optional[Generation], list[int]], Generation]] = None,
                 get_state: Optional[Callable[[], object]] = None, set_state: Optional[Callable[[object], None]] = None,
                 fresh: bool = True, pause_mode: str = "abort", drop_stale: bool = True):
        if staleness < 1:
            raise ValueError(f"rollout.off_policy_steps={staleness}: the staleness bound must be >= 1")
        if len(engines.ranks) != 1 or engines.ranks[0] != 0:
            raise ValueError("rollout.mode=async needs one client on rank 0 (rollout.placement=dedicated)")
        self.engines, self.draw, self.batch_size, self.sampling = engines, draw, batch_size, sampling
        self.k, self.last_step, self.partial, self.segment = staleness, last_step, partial, segment_tokens
        self.share, self.get_state, self.set_state = share, get_state, set_state
        self.drop_stale = drop_stale  # rollout.drop_stale: a group past the bound is dropped (else trained late)
        self.fresh = fresh  # rollout.fresh_groups: no new group while a batch of complete ones waits...
        self.trainer_waited = False  # ...unless the trainer had to wait for its last batch (the servers are behind)
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"rollout.pause_mode={pause_mode!r} must be 'abort', 'retract' or 'in_place'")
        self.keep_open = partial and pause_mode != "abort"  # retract, in_place: a request stays open across syncs
        if partial and hasattr(engines.local, "interrupt"):  # a sync pauses the requests in flight (SGLang's pause)
            engines.local.interrupt, engines.local.pause_mode = True, pause_mode
        self.rid_prefix = uuid.uuid4().hex[:12]  # request ids of this process (a killed run's may still be on a server)
        self.ahead = staleness
        self.version = 0  # the servers' weights (the last sync)
        self.cond = threading.Condition()
        self.done: list[Group] = []  # complete, in completion order, not yet taken
        self.carried: list[Group] = []  # in flight at a checkpoint, continued by the first worker with room
        self.requests = 0  # /generate requests on the servers now
        self.holding = False  # no new request: a sync waits for those in flight (partial rollouts off)
        self.last_groups: list[Group] = []  # the last step's (rewind puts them back)
        self.started = 0
        self.floor = -self.k  # the oldest version the trainer's next batch may hold (set by each take)
        self.error: Optional[tuple[str, bool]] = None
        self.closing = False
        self.workers: list[threading.Thread] = []
        self.in_flight: dict[str, list[Group]] = {}  # url -> its worker's groups in flight (read under cond)
        self.busy = Counter()  # url -> seconds with a /generate in flight since the last step
        self.sending_to = Counter()  # url -> its /generate requests in flight
        self.busy_since: dict[str, float] = {}
        self.held = Counter()  # reason -> seconds a worker had room for a group and did not start one (_room)
        self.held_since: dict[str, tuple] = {}  # url -> (its worker's reason now, since when)
        self.generated_tokens = 0
        self.dropped = 0  # samples dropped for staleness since the last step
        self.dropped_groups = 0  # groups dropped for staleness, over the run
        self.drops: deque = deque(maxlen=DROP_WINDOW)  # (samples trained, samples dropped) of the last steps
        self.drops_said = False
        self.mark = time.perf_counter()
        self._metrics: dict = {}
        self.waited = self.generated = 0.0

    # ---- rank 0's workers -------------------------------------------------------------------------

    def _may_start(self) -> bool:
        return self._held_by() is None and not self.closing

    def _held_by(self) -> Optional[str]:
        """Under cond: what keeps a new group from starting now: "fresh" (rollout.fresh_groups: a batch of complete
        groups waits), "staleness" (a group started now could only be trained after the bound has passed it), "end"
        (the run's last step has its groups), or None."""
        if self.fresh and not self.trainer_waited and len(self.done) >= self.batch_size:
            return "fresh"  # newer weights will come first: fresher samples, and the trainer does not wait for them
        # groups dropped for staleness are made up for: else the trainer could wait for groups that never start
        if self.last_step is not None and self.started >= self.last_step * self.batch_size + self.dropped_groups:
            return "end"
        if self.started >= (self.version + self.k + 1) * self.batch_size + self.dropped_groups:
            return "staleness"
        return None

    def _room(self, url: str, held: Optional[str]) -> None:
        """Under cond: worker `url` has room for a new group and `held` keeps it from starting one (None: no room, or
        nothing holds it); the seconds of each reason since the last step count (async/room_held_by_*)."""
        now = time.perf_counter()
        was, since = self.held_since.get(url, (None, now))
        if was is not None:
            self.held[was] += now - since
        self.held_since[url] = (held, now)

    def _new_group(self) -> Group:
        before = copy.deepcopy(self.get_state()) if self.get_state is not None else None
        example = self.draw(1)[0]
        index, self.started = self.started, self.started + 1
        base = self.sampling.seed * 1_000_003
        return Group(index, example, [Response(sample_seed(base, index, j) % (2**31)) for j in range(self.sampling.n)],
                     before)

    def _params(self, r: Response) -> dict:
        s, m = self.sampling, len(r.tokens)
        left = s.max_new_tokens - m
        seed = r.seed if m == 0 else sample_seed(r.seed, m, 0) % (2**31)  # a continuation's own stream
        return dict(temperature=s.temperature, top_p=s.top_p,
                    max_new_tokens=min(left, self.segment) if self.partial and self.segment else left,
                    stop_token_ids=list(s.stop_token_ids), sampling_seed=seed, skip_special_tokens=False,
                    no_stop_trim=True, custom_params={"sample_seed": r.seed, "generated": m})

    def _work(self, url: str, slots: int) -> None:
        """Server `url`'s worker: one request per response in flight, sent by a pool of daemon threads (module
        docstring)."""
        client = self.engines.local
        active: list[Group] = []
        self.in_flight[url] = active
        sending: set[int] = set()  # id() of the responses with a request in flight
        answers: list[tuple] = []
        todo: queue.SimpleQueue = queue.SimpleQueue()

        def sender() -> None:
            while (item := todo.get()) is not None:
                send(*item)

        senders = slots + self.sampling.n  # the most responses in flight at once
        for i in range(senders):
            threading.Thread(target=sender, daemon=True, name=f"rollout-async-{url}-{i}").start()

        def send(g: Group, r: Response) -> None:
            try:
                rows = client.generate_segment(url, [list(g.example.prompt_ids) + r.tokens], [self._params(r)],
                                               rids=[self._rid(g, r)])
            except Exception as e:  # noqa: BLE001 - raised by the worker
                rows = e
            with self.cond:
                answers.append((g, r, rows))
                self.requests -= 1
                self._sending(url, -1)
                self.cond.notify_all()

        try:
            while True:
                with self.cond:
                    for g, r, rows in answers:
                        if isinstance(rows, Exception):
                            raise rows
                        ids, lps, reason, versions, *routed = rows[0]
                        self.generated_tokens += len(ids)
                        sending.discard(id(r))
                        r.sent_version = None
                        if g.stale:  # dropped while this request ran
                            continue
                        if routed and routed[0] is not None:
                            r.routes = join_routes(r.routes, routed[0], len(g.example.prompt_ids) + len(r.tokens) - 1)
                        r.tokens += ids
                        r.logprobs += lps
                        r.versions += versions
                        r.segments += 1
                        # "length": the segment's budget (or the response's); "abort": a weight update interrupted it
                        if reason == "stop" or len(r.tokens) >= self.sampling.max_new_tokens:
                            r.finish = "length" if reason == "abort" else reason
                        if g.done:
                            self.done.append(g)
                            active.remove(g)
                    # a group older than the trainer's bound can never be trained: its responses are not sent again
                    # (pause_mode=abort: every sync ends them; else their open requests are aborted), and its room goes
                    # to new groups
                    ending = []
                    for g in [g for g in active if self.drop_stale and g.oldest_bound is not None
                              and g.oldest_bound < self.floor]:
                        g.stale = True
                        active.remove(g)
                        self.dropped += len(g.responses)
                        self.dropped_groups += 1
                        if self.keep_open:
                            ending += [self._rid(g, r) for r in g.responses if id(r) in sending]
                    if answers:
                        answers.clear()
                        self.cond.notify_all()
                    if self.closing:
                        return
                    ready = []
                    if not self.holding:  # a sync drains the requests (partial rollouts off)
                        # room counts unfinished responses: a group waiting on its long tail leaves its finished
                        # responses' room to new groups, so the server decodes `slots` rows per step, not the tails
                        while self._unfinished(active) < slots and self.carried:
                            active.append(self.carried.pop(0))
                        while self._unfinished(active) < slots and self._may_start():
                            active.append(self._new_group())
                        ready = [(g, r) for g in active for r in g.responses
                                 if r.finish is None and id(r) not in sending]
                    room = not self.holding and self._unfinished(active) < slots and not self.carried
                    self._room(url, self._held_by() if room else None)
                    if not ready and not ending:
                        self.cond.wait(timeout=1.0)
                        continue
                    for g, r in ready:
                        sending.add(id(r))
                        r.sent_version = self.version
                        self.requests += 1
                        self._sending(url, +1)
                if ending:
                    client.abort_requests(url, ending)
                for item in ready:
                    todo.put(item)
        except Exception as e:  # noqa: BLE001 - handed to every rank by result()
            with self.cond:
                self.error = (f"the rollout engine ({type(client).__name__}, on rank 0) failed generating on {url}: "
                              f"{type(e).__name__}: {e}", bool(getattr(e, "transient", False)))
                self.cond.notify_all()
        finally:
            for _ in range(senders):
                todo.put(None)

    def _routes(self) -> bool:
        """Routing replay (algo.routing_replay): the client asks for every request's routed experts."""
        return getattr(self.engines.local, "moe_layers", None) is not None

    def _rid(self, g: Group, r: Response) -> str:
        """The request id of response `r`'s request now (its group, its place in it, its tokens so far)."""
        j = next(j for j, x in enumerate(g.responses) if x is r)
        return f"grpo-{self.rid_prefix}-{g.index}-{j}-{len(r.tokens)}"

    def _sending(self, url: str, change: int) -> None:
        """Under cond: `change` more requests in flight on `url`; time with any counts as busy (0: count up to now)."""
        now = time.perf_counter()
        if self.sending_to[url] > 0:
            self.busy[url] += now - self.busy_since[url]
        self.busy_since[url] = now
        self.sending_to[url] += change

    @staticmethod
    def _unfinished(groups: list[Group]) -> int:
        return sum(r.finish is None for g in groups for r in g.responses)

    def _start_workers(self) -> None:
        urls = self.engines.local.urls
        slots = -(-self.batch_size // len(urls)) * self.sampling.n  # responses each server decodes at once
        # a connection per request in flight (and the client's idle ones) on top of what the process holds already
        needed = len(urls) * (slots + self.sampling.n + POOLED) + FILES_BESIDE
        try:
            if self.keep_open:
                self.engines.local.check_pause_mode()
            open_files_for(needed)
        except ServerError as e:
            with self.cond:
                self.error = (str(e), False)
                self.cond.notify_all()
            return
        except ValueError as e:
            with self.cond:
                self.error = (f"rollout.mode=async keeps one request per unfinished response in flight, each on a "
                              f"connection of its own ({len(urls)} servers x {slots + self.sampling.n} from "
                              f"batch.train_batch_size={self.batch_size} x rollout.n={self.sampling.n}), so rank 0 "
                              f"{e}: raise the job's limit on open files, or lower batch.train_batch_size x "
                              "rollout.n per server (more servers)", False)
                self.cond.notify_all()
            return
        self.mark = time.perf_counter()
        for url in urls:
            t = threading.Thread(target=self._work, args=(url, slots), name=f"rollout-async-{url}", daemon=True)
            t.start()
            self.workers.append(t)

    # ---- the step's samples -----------------------------------------------------------------------

    def _take(self, step: int) -> tuple[Optional[dict], float]:
        """Rank 0: the batch of step `step` (its groups, the async metrics), or {"error": ...}."""
        t0 = time.perf_counter()
        floor = (step - 1) - self.k
        short = False  # the trainer waited for samples (rollout.fresh_groups then lets the servers run ahead)
        with self.cond:
            self.floor = floor
            self.cond.notify_all()  # the workers drop the groups in flight this leaves behind
            while True:
                if self.error is not None:
                    return {"error": self.error}, time.perf_counter() - t0
                stale = [g for g in self.done if self.drop_stale and g.oldest is not None
                         and g.oldest < floor]  # (None: refused below)
                if stale:
                    self.dropped += sum(len(g.responses) for g in stale)
                    self.dropped_groups += len(stale)
                    self.done = [g for g in self.done if g.oldest is None or g.oldest >= floor]
                    self.cond.notify_all()
                if len(self.done) >= self.batch_size:
                    break
                short = True
                self.cond.wait(timeout=1.0)
            self.trainer_waited = short
            groups, self.done = self.done[:self.batch_size], self.done[self.batch_size:]
            self.cond.notify_all()  # room for new groups (rollout.fresh_groups)
            self.last_groups = groups
            for url in self.engines.local.urls:
                self._sending(url, 0)
                self._room(url, self.held_since.get(url, (None,))[0])
            now = time.perf_counter()
            wall, busy, tokens, dropped = now - self.mark, sum(self.busy.values()), self.generated_tokens, self.dropped
            held, servers = self.held, len(self.engines.local.urls)
            self.busy, self.held, self.generated_tokens, self.dropped, self.mark = Counter(), Counter(), 0, 0, now
        waited = now - t0
        lowest = floor if self.drop_stale else 0  # rollout.drop_stale=false trains a group past the bound
        for g in groups:  # the bound, checked on what is handed out (a server updated by someone else breaks it)
            for r in g.responses:
                if not r.versions or not lowest <= min(r.versions) <= max(r.versions) <= step - 1:
                    return {"error": (f"step {step} got a sample of weight versions {sorted(set(r.versions))}; the trainer "
                                      f"holds version {step - 1} and rollout.off_policy_steps={self.k}"
                                      f"{'' if self.drop_stale else ' with rollout.drop_stale=false'} allows versions "
                                      f"{lowest}..{step - 1}: a server was updated by someone else, or restarted "
                                      "without its weights", False)}, waited
            if self._routes():
                for r in g.responses:
                    if r.routes is None or r.routes.shape[0] != len(g.example.prompt_ids) + len(r.tokens) - 1:
                        return {"error": (f"step {step} got a sample of {len(r.tokens)} tokens with routed experts for "
                                          f"{None if r.routes is None else r.routes.shape[0]} positions, not its "
                                          "prompt's and tokens' but the last (algo.routing_replay): a server "
                                          "returned none, or too few, for a continued request", False)}, waited
        responses = [r for g in groups for r in g.responses]
        self._say_drops(len(responses), dropped)
        token_lags = Counter(step - 1 - v for r in responses for v in r.versions)
        sample_lags = Counter(step - 1 - min(r.versions) for r in responses)
        ntok = sum(token_lags.values())
        metrics = {"async/trainer_idle_fraction": min(1.0, waited / wall) if wall > 0 else 0.0,
                   "async/server_idle_fraction": max(0.0, 1.0 - busy / (servers * wall)) if wall > 0 else 0.0,
                   "async/generated_tokens_per_s": tokens / wall if wall > 0 else 0.0,
                   "async/dropped_stale_samples": dropped,
                   "async/continued_samples": sum(len(set(r.versions)) > 1 for r in responses),
                   "async/versions_per_sample": sum(len(set(r.versions)) for r in responses) / len(responses),
                   "async/wait_s": waited, "async/generate_s": busy / servers}
        for reason in ("staleness", "fresh"):  # of the servers' time: room for a group, none started, and why
            metrics[f"async/room_held_by_{reason}"] = min(1.0, held[reason] / (servers * wall)) if wall > 0 else 0.0
        for lag in range(self.k + 1):
            metrics[f"async/token_lag_{lag}"] = token_lags.get(lag, 0) / ntok if ntok else 0.0
            metrics[f"async/sample_lag_{lag}"] = sample_lags.get(lag, 0) / len(responses)
        # past the bound: none where stale groups are dropped (rollout.drop_stale), else what was trained late
        past = sum(n for lag, n in token_lags.items() if lag > self.k)
        metrics["async/token_lag_over_k"] = past / ntok if ntok else 0.0
        metrics["async/sample_lag_over_k"] = sum(n for lag, n in sample_lags.items() if lag > self.k) / len(responses)
        return {"groups": groups, "metrics": metrics}, waited

    def _say_drops(self, trained: int, dropped: int) -> None:
        """Once a run: a warning when the staleness bound drops more than DROP_WARN of what the servers complete."""
        self.drops.append((trained, dropped))
        lost, total = sum(d for _, d in self.drops), sum(t + d for t, d in self.drops)
        if self.drops_said or len(self.drops) < DROP_WINDOW or lost <= DROP_WARN * total:
            return
        self.drops_said = True
        log.warning("rollout.mode=async: %d of the %d samples completed in the last %d steps (%.0f%%) were dropped as "
                    "older than rollout.off_policy_steps=%d allows (a group is as old as its first token, and a long "
                    "response finishing after later groups ages it): their generation was wasted, and the long "
                    "responses are the ones lost. A larger rollout.off_policy_steps keeps more of them (staler "
                    "samples, for algo.rollout_correction to weigh), as does a shorter batch.max_response_length; "
                    "rollout.drop_stale=false trains them all (k then bounds only the starts)", lost, total,
                    DROP_WINDOW, 100 * lost / total, self.k)

    def result(self, step: int, submit_next: bool = True) -> StepSamples:
        """Collective: the batch step `step` trains on: train_batch_size complete groups, none older than the bound."""
        out, waited = (self._take(step) if dist.get_rank() == 0 else (None, 0.0))
        status = None if out is None else ({"error": out["error"]} if "error" in out else
                                           {"examples": [g.example for g in out["groups"]], "metrics": out["metrics"]})
        status = comm.broadcast_object(status, src=0)
        if "error" in status:
            raise RolloutError(status["error"][0], transient=status["error"][1])
        examples, self._metrics = status["examples"], status["metrics"]
        gen = None
        if dist.get_rank() == 0:
            rs = [r for g in out["groups"] for r in g.responses]
            routed = [r.routes for r in rs] if self._routes() else None  # checked by _take
            gen = Generation(token_ids=[r.tokens for r in rs], logprobs=[r.logprobs for r in rs],
                             finish_reasons=[r.finish for r in rs], weight_version=min(min(r.versions) for r in rs),
                             extra={"token_versions": [r.versions for r in rs],
                                    "prompt_index": [g.index for g in out["groups"] for _ in g.responses]},
                             routed_experts=routed)
        if self.share is None:
            gen = comm.broadcast_object(gen, src=0)
        else:
            gen = self.share(gen, [len(e.prompt_ids) for e in examples for _ in range(self.sampling.n)])
        self.waited += waited
        self.generated += self._metrics["async/generate_s"]
        return StepSamples(step, examples, gen, waited)

    def in_flight_counts(self) -> tuple[int, int]:
        """Rank 0: (responses begun and not finished, groups) on the servers now."""
        with self.cond:
            groups = [g for gs in self.in_flight.values() for g in gs]
            return sum(0 < len(r.tokens) and r.finish is None for g in groups for r in g.responses), len(groups)

    def metrics(self) -> dict:
        return dict(self._metrics)

    def submit_next(self, step: int) -> None:
        pass

    def wait(self) -> None:
        """Nothing to wait for: weights go to the servers with generations in flight."""

    def extra(self, step: int, round: int) -> StepSamples:
        raise RuntimeError("rollout.mode=async has no extra rounds (algo.dynamic_sampling=refill is refused)")

    def reshare(self, gen: Optional[Generation], examples: list) -> Generation:
        if self.share is None:
            return gen
        return self.share(gen if dist.get_rank() == 0 else None,
                          [len(e.prompt_ids) for e in examples for _ in range(self.sampling.n)])

    def sync_weights(self, gpt, version: int, **kwargs):
        """Collective: the trainer's weights into the servers as `version`; the workers start after the first sync.
        With partial rollouts the requests in flight are interrupted (/pause_generation, mode abort); without, rank 0
        sends no new request and waits for those in flight (a response keeps the version it started on; SGLang locks
        per bucket, so a new request could otherwise start mid-update or before the flush)."""
        drain = dist.get_rank() == 0 and not self.partial
        if drain:
            with self.cond:
                self.holding = True
                self.cond.wait_for(lambda: self.requests == 0 or self.error is not None)
        try:
            stats = self.engines.sync(gpt, version=version, **kwargs)
        finally:
            if drain:
                with self.cond:
                    self.holding = False
                    self.cond.notify_all()
        if dist.get_rank() == 0:
            with self.cond:
                self.version = version
                self.cond.notify_all()
            if not self.workers:
                self._start_workers()
        return stats

    def take_timing(self) -> tuple[float, float]:
        out = (self.generated, self.waited)
        self.generated = self.waited = 0.0
        return out

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        for t in self.workers:
            t.join(timeout=30)

    # ---- checkpoints ------------------------------------------------------------------------------

    def rewind(self) -> None:
        """Rank 0: the last step's groups back in front of the complete ones, so that a checkpoint now (of the step
        before) trains them again on resume."""
        with self.cond:
            self.done, self.last_groups = self.last_groups + self.done, []

    def _saved(self) -> tuple[list[Group], int, object]:
        """Under cond: what a checkpoint now holds: the complete groups in completion order then those in flight in
        start order, the earliest one's index and the task's state before it was drawn (with no group: the start count
        and the task's own state)."""
        flying = [g for gs in self.in_flight.values() for g in gs if not g.done] + self.carried
        groups = list(self.done) + sorted(flying, key=lambda g: g.index)
        if groups:
            first = min(groups, key=lambda g: g.index)
            return groups, first.index, first.task_before
        return groups, self.started, self.get_state() if self.get_state is not None else None

    def task_state(self):
        """Rank 0: the task's state before the earliest group a checkpoint now holds was drawn (else the task's own)."""
        if dist.get_rank() != 0:
            return None
        with self.cond:
            return self._saved()[2]

    def state(self) -> Optional[dict]:
        """Rank 0: the groups complete and in flight (JSON), the start count, the groups dropped so far and the task's
        state before the earliest of them; None elsewhere."""
        if dist.get_rank() != 0:
            return None
        with self.cond:
            groups, first, task_before = self._saved()
            routed = [r.routes for g in groups for r in g.responses] if self._routes() else None
            return dict(mode="async", started=self.started, dropped_groups=self.dropped_groups, first=first,
                        task_before=task_before, routed_experts=routed,  # int16 (the checkpoint's safetensors)
                        groups=[dict(index=g.index, prompt=list(g.example.prompt_ids), done=g.done,
                                     responses=[dict(seed=r.seed, tokens=list(r.tokens), logprobs=list(r.logprobs),
                                                     versions=list(r.versions), finish=r.finish, segments=r.segments)
                                                for r in g.responses])
                                for g in groups])

    def restore(self, state: Optional[dict]) -> None:
        """A checkpoint's state(): the task set to before its earliest group, the prompts drawn again up to its start
        count, the complete groups first in line and the rest continued from their token prefixes by the workers."""
        if state is None:
            return
        if state.get("mode") != "async":
            raise ValueError("the checkpoint was written with rollout.mode=sync (its batch in flight is one step's); "
                             "resume it with rollout.mode=sync, or start a new run for rollout.mode=async")
        self.started, self.dropped_groups = int(state["started"]), int(state["dropped_groups"])
        if dist.get_rank() != 0:
            return
        if self.set_state is not None:
            self.set_state(copy.deepcopy(state["task_before"]))
        saved = {g["index"]: g for g in state["groups"]}
        groups = {}
        for index in range(int(state["first"]), self.started):
            before = copy.deepcopy(self.get_state()) if self.get_state is not None else None  # for the next checkpoint
            example = self.draw(1)[0]
            g = saved.get(index)
            if g is None:  # trained or dropped before the checkpoint
                continue
            if list(example.prompt_ids) != g["prompt"]:
                raise ValueError(f"the checkpoint's group {index} (in flight or not yet trained) was drawn from another "
                                 "prompt than the task now gives: was the data (data.train_files, seed) changed? Resume "
                                 "with the same data, or start a new run")
            groups[index] = Group(index, example, [Response(r["seed"], list(r["tokens"]), list(r["logprobs"]),
                                                            list(r["versions"]), r["finish"], int(r["segments"]))
                                                   for r in g["responses"]], before)
        routed = iter(state.get("routed_experts") or [])
        for g in state["groups"]:  # routing replay: every response's routes, in the groups' order (None: none yet)
            for r in groups[g["index"]].responses:
                r.routes = next(routed, None)
        order = [g["index"] for g in state["groups"]]
        self.done = [groups[i] for i in order if groups[i].done]
        self.carried = sorted((groups[i] for i in order if not groups[i].done), key=lambda g: g.index)
