"""Continuous batching for the stand-in server: one decode loop over every response in flight, whatever request it
came in, as SGLang's scheduler runs it.

A request's rows join the batch at a coming step and leave as soon as they end (a stop token, their budget, or an
abort): a row never idles while another request's longest row runs on, and a new request never waits for the one
before it. A joining row whose input less its last token the prefix cache holds feeds that last token beside the
active rows' last sampled ones; any other feeds its whole input in the same forward (a mixed prefill and decode
step, as SGLang's --enable-mixed-chunk: one forward, not a prefill forward of its own), right-aligned, the shorter
rows' padding masked and then dropped from the batch's key/value cache (`_compact`), which stays left-padded to the
widest row. Where that would pad many decoding rows to a long input (SGLang packs a mixed step unpadded), the cold
inputs are prefilled apart first, in up to PREFILL_BUCKETS forwards of similar lengths (`_prefill`, chosen by
`_apart` at `call_tokens` a forward), and join as held ones do. Rows that arrive one request at a time
(rollout.mode=async) still join together, as a join copies the batch's cache: at once when no row is active, else
once the waiting rows are JOIN_SHARE of the active ones or the first has waited JOIN_WAIT_STEPS steps. Sampling is
EmbeddedEngine.generate's, row by row: the row's own seeded uniforms drawn up front, inverse-CDF sampling of
softmax(logits / temperature) after the row's top-p filter, the logprob at the sampled token; a row's tokens do not
depend on the others in the batch (up to float rounding of a wider padded batch).

`hold(reason)` keeps new rows out (the active ones run on) until every reason is released; `idle()` waits until no
row is active, so that weights are loaded between two steps and never under a row (but parked ones, below). A pending
request held longer than `timeout_s` fails with the reason. A row that ends by its budget or an abort leaves its keys
and values in the prefix cache for the request that continues it (rollout.mode=async's next segment). `retract()`
(SGLang's /pause_generation mode "retract") takes the active rows out after the current step, their keys and values
dropped, and puts them first in line: when the holds are released they join again, prefilled with their input and
tokens so far under the weights then loaded, and go on sampling where they stopped (their request stays open).
`park()` (SGLang's mode "in_place") stops the loop between two steps with the active rows and their cache in it, so
weights load under them (`quiet()` waits for that); after `unpark()` they sample on from the keys and values computed
so far under the old weights. Each token records the weight version that sampled it (`Row.versions`). `abort(rids)`
ends the rows of those requests (SGLang's /abort_request).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from grpo_mega.engines.embedded import EmbeddedEngine, sample_rows
from grpo_mega.models.buckets import length_buckets


JOIN_SHARE = 1 / 8
JOIN_WAIT_STEPS = 4
PREFILL_CALL_TOKENS = 100
"""What one more forward costs, in tokens fed (the tiny model on one CPU core: ~2 ms a forward, TOKEN_S a token)."""
TOKEN_S = 19e-6
"""What a token fed costs (the same measurement): a forward made longer by a fixed time costs that over TOKEN_S more
tokens (`call_tokens`: the stand-in's --simulate-decode-ms)."""
PREFILL_BUCKETS = 4
"""The most forwards a join's inputs are prefilled apart in."""


def call_tokens(extra_step_s: float = 0.0) -> int:
    """What a forward costs in tokens fed when each forward takes `extra_step_s` more (--simulate-decode-ms)."""
    return PREFILL_CALL_TOKENS + round(extra_step_s / TOKEN_S)


@dataclass
class Row:
    ids: list[int]
    """The input: prompt and response so far (token ids, at least one)."""
    budget: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: frozenset = frozenset()
    rid: Optional[str] = None
    """The request's id for /abort_request (None: only an abort of every request ends it)."""
    ends: bool = False
    """The budget is where the response ends (the stand-in's --simulate-lengths): there the row finishes "stop", as at
    a stop token, and its keys and values are not kept for a continuation (there is none)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per token: the engine's weight version when it was sampled."""
    finish: Optional[str] = None
    aborted: bool = False
    weight_version: int = 0
    job: Optional["Job"] = None
    uniforms: Optional[list[float]] = None
    fed: int = 0
    """Tokens in the cache for this row (its next position)."""


@dataclass
class Job:
    rows: list[Row]
    submitted: float
    left: int = 0
    step: int = 0
    """The decode loop's step count when it arrived."""
    error: Optional[str] = None
    event: threading.Event = field(default_factory=threading.Event)


class ContinuousBatcher:
    """Runs `engine`'s decode on a thread of its own; `run(rows)` blocks until all of a request's rows have ended."""

    def __init__(self, engine: EmbeddedEngine, timeout_s: float = 120.0, call_tokens: int = PREFILL_CALL_TOKENS):
        if engine.decode_mode() != "dynamic":
            raise ValueError(f"continuous batching needs the dynamic decode; the engine runs {engine.decode_mode()}")
        self.engine, self.timeout_s, self.call_tokens = engine, timeout_s, call_tokens
        self.cond = threading.Condition()
        self.pending: list[Job] = []
        self.active: list[Row] = []
        self.retracted: list[Row] = []  # taken out by retract(), first to join again
        self.retracted_at = 0.0
        self.retracting = False
        self.holds: set[str] = set()
        self.parked = False  # park(): no step runs, the active rows and their cache stay
        self.stepping = False
        self.closing = False
        self.cache = None  # DynamicCache of the active rows, right-aligned: row r's last `fed` columns are its
        self.mask: Optional[torch.Tensor] = None  # [rows, width] 1 where a row has a token
        self.steps = 0
        self.row_steps = 0  # rows over all steps (each decodes one token, or prefills and decodes one)
        self.busy_s = 0.0  # wall seconds in steps: what the loop's core spent decoding (GET /grpo_mega/decode_stats)
        self.thread = threading.Thread(target=self._loop, name="continuous-batcher", daemon=True)
        self.thread.start()

    # ---- the request side ---------------------------------------------------------------------

    def run(self, rows: list[Row]) -> list[Row]:
        for r in rows:
            if not r.ids or r.budget < 1 or r.temperature < 0 or not 0 < r.top_p <= 1:
                raise ValueError(f"a row needs >= 1 input token, max_new_tokens >= 1, temperature >= 0 and top_p in "
                                 f"(0, 1]; got {len(r.ids)} tokens, {r.budget}, {r.temperature}, {r.top_p}")
        job = Job(rows, time.monotonic(), len(rows), self.steps)
        for r in rows:
            r.job = job
            r.uniforms = torch.rand(r.budget, generator=torch.Generator().manual_seed(r.seed),
                                    dtype=torch.float64).tolist()
        with self.cond:
            if self.closing:
                raise RuntimeError("the server is shutting down")
            self.pending.append(job)
            self.cond.notify_all()
        job.event.wait()
        if job.error is not None:
            raise RuntimeError(job.error)
        return rows

    def retract(self) -> None:
        """The active rows out of the batch after the current step (their caches dropped), first in line to join
        again; with a hold on, `idle()` then holds."""
        with self.cond:
            self.retracting = True
            self.cond.notify_all()

    def abort(self, rids: Optional[set] = None) -> int:
        """End the rows of the requests `rids` (every request's: None) at the next step, those waiting at once, with
        their tokens so far and finish reason "abort"; returns how many rows were asked to end."""
        with self.cond:
            hit = [r for r in self.active + self.retracted + [r for j in self.pending for r in j.rows]
                   if rids is None or r.rid in rids]
            for r in hit:
                r.aborted = True
            decoding = {id(r) for r in self.active}
            waiting = [r for r in hit if id(r) not in decoding]
            self.retracted = [r for r in self.retracted if not r.aborted]
            for j in self.pending:
                j.rows = [r for r in j.rows if not r.aborted]
            self.pending = [j for j in self.pending if j.rows]
            for r in waiting:
                r.finish = "abort"
                self._done(r)
            self.cond.notify_all()
            return len(hit)

    def hold(self, reason: str) -> None:
        with self.cond:
            self.holds.add(reason)

    def release(self, reason: str) -> None:
        with self.cond:
            self.holds.discard(reason)
            self.cond.notify_all()

    def park(self) -> None:
        """No step runs after the current one until `unpark()`: the active rows stay in the batch with their keys and
        values (SGLang's /pause_generation mode "in_place"), so weights may load under them."""
        with self.cond:
            self.parked = True

    def unpark(self) -> None:
        with self.cond:
            self.parked = False
            self.cond.notify_all()

    def quiet(self, timeout: float) -> bool:
        """Wait until no step runs and none will (no row active, or parked)."""
        with self.cond:
            return self.cond.wait_for(lambda: (self.parked or not self.active) and not self.stepping, timeout=timeout)

    def idle(self, timeout: float) -> bool:
        """Wait until no row is active and no step runs (hold first, or new rows may join meanwhile)."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.active and not self.stepping, timeout=timeout)

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join(timeout=30)

    # ---- the loop -----------------------------------------------------------------------------

    def _may_join(self) -> bool:
        """Under cond: the waiting rows join at this step (module docstring)."""
        if self.holds or not (self.pending or self.retracted):
            return False
        waiting = len(self.retracted) + sum(len(j.rows) for j in self.pending)
        return (not self.active or waiting >= JOIN_SHARE * len(self.active) or self.retracted
                or self.steps - self.pending[0].step >= JOIN_WAIT_STEPS)

    def _fail(self, jobs, message: str) -> None:
        for job in jobs:
            if not job.event.is_set():
                job.error = message
                job.event.set()

    def _loop(self) -> None:
        while True:
            with self.cond:
                if self.retracting:  # between two steps: out of the batch, first in line
                    self.retracted, self.active, self.cache, self.mask = self.active + self.retracted, [], None, None
                    self.retracted_at, self.retracting = time.monotonic(), False
                    self.cond.notify_all()
                while (not self.closing and not self.retracting
                       and (self.parked or (not self.active and (self.holds or not (self.pending or self.retracted))))):
                    now = time.monotonic()
                    late = [j for j in self.pending if now - j.submitted > self.timeout_s]
                    if self.retracted and now - self.retracted_at > self.timeout_s:
                        late += [r.job for r in self.retracted]
                        self.retracted = []
                    if late:
                        self.pending = [j for j in self.pending if j not in late]
                        self._fail(late, f"held by {', '.join(sorted(self.holds))} for over {self.timeout_s:.0f} s "
                                         "(a weight update or a pause began and did not end)")
                    self.cond.wait(timeout=0.5)
                if self.retracting:
                    continue
                if self.closing:
                    self._fail(self.pending + [r.job for r in self.active + self.retracted],
                               "the server is shutting down")
                    return
                joining = self.retracted + [r for j in self.pending for r in j.rows] if self._may_join() else []
                if joining:
                    self.pending, self.retracted = [], []
                self.stepping = True
            try:
                start, rows = time.perf_counter(), len(self.active) + len(joining)
                self._step(joining)
                self.busy_s += time.perf_counter() - start
                self.row_steps += rows
            except Exception as e:  # noqa: BLE001 - every request in the step gets the error
                with self.cond:
                    self._fail({id(r.job): r.job for r in self.active + joining}.values(),
                               f"generation failed: {type(e).__name__}: {e}")
                self.active, self.cache, self.mask = [], None, None
            finally:
                with self.cond:
                    self.stepping = False
                    self.cond.notify_all()

    def _join(self, rows: list[Row]) -> list[list[int]]:
        """The joining rows into the batch's cache (all left-padded to the widest); returns the tokens each feeds at
        this step: its last one where the prefix cache holds the rest, else its whole input (and tokens so far),
        prefilled in the step's own forward beside the other rows' next tokens."""
        from transformers import DynamicCache

        held = self.engine.prefix_cache
        seqs = [r.ids + r.tokens for r in rows]  # a retracted row's tokens so far are input again
        kvs = [held.take(x[:-1]) if held is not None and len(x) > 1 else None for x in seqs]
        cold = [i for i, x in enumerate(seqs) if kvs[i] is None and len(x) > 1]
        buckets = (self._apart([len(seqs[i]) for i in cold], len(self.active) + len(rows), self.call_tokens)
                   if cold else None)
        if buckets:
            for i, kv in zip(cold, self._prefill([seqs[i][:-1] for i in cold], buckets)):
                kvs[i] = kv
        feeds = []
        for r, x, kv in zip(rows, seqs, kvs):
            r.fed = 0 if kv is None else len(x) - 1
            feeds.append(x if kv is None else x[-1:])
        old = len(self.active)
        width = max([r.fed for r in self.active + rows] + [0])
        if width == 0:  # nothing held yet: the step's forward fills the cache
            self.cache, self.mask = DynamicCache(), torch.zeros(old + len(rows), 0, dtype=torch.long)
            return feeds
        found = [kv for kv in kvs if kv is not None]
        proto = found[0] if found else [(layer.keys[0], layer.values[0]) for layer in self.cache.layers]
        dev = self.engine.device
        cache = DynamicCache()
        for li, (k0, v0) in enumerate(proto):
            keys = torch.zeros(old + len(rows), k0.shape[0], width, k0.shape[-1], dtype=k0.dtype, device=dev)
            values = torch.zeros_like(keys)
            if old:
                w = self.cache.layers[li].keys.shape[2]
                keys[:old, :, width - w:] = self.cache.layers[li].keys
                values[:old, :, width - w:] = self.cache.layers[li].values
            for i, r in enumerate(rows):
                if r.fed:
                    keys[old + i, :, width - r.fed:], values[old + i, :, width - r.fed:] = kvs[i][li]
            cache.update(keys, values, li)
        fed = torch.tensor([r.fed for r in self.active + rows])
        self.cache, self.mask = cache, (torch.arange(width)[None, :] >= width - fed[:, None]).long()
        return feeds

    @staticmethod
    def _apart(lens: list[int], rows: int, call_tokens: int = PREFILL_CALL_TOKENS) -> Optional[list[list[int]]]:
        """Inputs of `lens` tokens joining a step of `rows` rows in all: the length buckets to prefill all but their
        last tokens in, forwards of their own (`_prefill`), where that costs less than the step's forward with every
        row as wide as the longest input; else None."""
        fed = [n - 1 for n in lens]  # apart: all but the last token, which the step feeds
        buckets = length_buckets(fed, call_tokens, PREFILL_BUCKETS)
        apart = sum(len(b) * max(fed[j] for j in b) + call_tokens for b in buckets)
        return buckets if apart + rows < rows * max(lens) else None

    def _prefill(self, seqs: list[list[int]], buckets: list[list[int]]) -> list[list[tuple]]:
        """Each sequence's keys and values ([heads, tokens, head_dim] per layer, as the prefix cache holds them), fed
        in one forward a bucket (indices into `seqs`), right-aligned, its padding masked."""
        from transformers import DynamicCache

        out: list = [None] * len(seqs)
        dev, step = self.engine.device, self.engine._decode_step("dynamic")
        for bucket in buckets:
            width = max(len(seqs[j]) for j in bucket)
            ids = [[0] * (width - len(seqs[j])) + seqs[j] for j in bucket]
            pos = [[0] * (width - len(seqs[j])) + list(range(len(seqs[j]))) for j in bucket]
            mask = [[0] * (width - len(seqs[j])) + [1] * len(seqs[j]) for j in bucket]
            cache = DynamicCache()
            step(torch.tensor(ids, device=dev), torch.tensor(mask, device=dev), torch.tensor(pos, device=dev), cache)
            for i, j in enumerate(bucket):
                n = len(seqs[j])
                out[j] = [(layer.keys[i, :, width - n:], layer.values[i, :, width - n:]) for layer in cache.layers]
        return out

    def _compact(self, rows: list[Row], feeds: list[list[int]]) -> None:
        """After a forward that fed `feeds` (up to W tokens a row, right-aligned) onto the batch's cache: each
        row's keys and values right-aligned again (its padding among the new columns dropped), in one gather a layer:
        a stable sort of the mask puts each row's columns in use last, in their order."""
        counts = torch.tensor([r.fed + len(f) for r, f in zip(rows, feeds)])
        new_width = int(counts.max())
        index = self.mask.sort(dim=1, stable=True).indices[:, -new_width:].to(self.engine.device)
        for layer in self.cache.layers:
            at = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, at), layer.values.gather(2, at)
        self.mask = (torch.arange(new_width)[None, :] >= new_width - counts[:, None]).long()

    @torch.no_grad()
    def _step(self, joining: list[Row]) -> None:
        engine = self.engine
        feeds = self._join(joining) if joining else []
        rows = self.active + joining
        if not rows:
            return
        feeds = [[r.tokens[-1] if r.tokens else r.ids[-1]] for r in self.active] + feeds
        wide = max(len(f) for f in feeds)
        ids = torch.tensor([[0] * (wide - len(f)) + f for f in feeds], dtype=torch.long)
        new = torch.tensor([[0] * (wide - len(f)) + [1] * len(f) for f in feeds], dtype=torch.long)
        pos = torch.tensor([[0] * (wide - len(f)) + list(range(r.fed, r.fed + len(f))) for r, f in zip(rows, feeds)],
                           dtype=torch.long)
        self.mask = torch.cat([self.mask, new], dim=1)
        dev = engine.device
        logits = engine._decode_step("dynamic")(ids.to(dev), self.mask.to(dev), pos.to(dev), self.cache)
        if wide > 1:  # a prefill in this step: the rows fed fewer tokens have padding among the new columns
            self._compact(rows, feeds)
        for r, f in zip(rows, feeds):
            r.fed += len(f) - 1  # and the one below, as every row
        self.steps += 1
        temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], dtype=logits.dtype,
                             device=dev)
        logp_all = torch.log_softmax(logits / temps[:, None], dim=-1)
        tok = logits.argmax(-1)
        sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
        if sampled:
            every = len(sampled) == len(rows)
            u = torch.tensor([rows[i].uniforms[len(rows[i].tokens)] for i in sampled], dtype=torch.float64, device=dev)
            pick = sample_rows(logp_all if every else logp_all[sampled], [rows[i].top_p for i in sampled], u)
            if every:
                tok = pick
            else:
                tok[sampled] = pick
        lp = logp_all.gather(1, tok[:, None])[:, 0]
        aborting, version = engine.aborting.is_set(), engine.weight_version
        keep = []
        for i, (r, t, l) in enumerate(zip(rows, tok.tolist(), lp.tolist())):
            r.fed += 1
            r.tokens.append(t)
            r.logprobs.append(l)
            r.versions.append(version)
            if t in r.stop:
                r.finish = "stop"
            elif len(r.tokens) >= r.budget:
                r.finish = "stop" if r.ends else "length"
            elif aborting or r.aborted:
                r.finish = "abort"
            else:
                keep.append(i)
        ended = [i for i in range(len(rows)) if rows[i].finish is not None]
        kept = self._kept(rows, ended)
        with self.cond:  # a request's last row told under cond: abort() finishes waiting rows under it too
            for i in ended:
                if i in kept:
                    engine.prefix_cache.put(rows[i].ids + rows[i].tokens[:-1], kept[i])
                self._done(rows[i])
        self.active = [rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = None
            return
        if len(keep) < len(rows):  # the rows that ended leave (a copy a layer); else the cache stays as it is
            index = torch.tensor(keep, device=dev)
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
            self.mask = self.mask[keep]
        width = max(r.fed for r in self.active)
        if width < self.mask.shape[1]:  # columns no row uses any more go (views)
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, -width:], layer.values[:, :, -width:]
            self.mask = self.mask[:, -width:]

    def _kept(self, rows: list[Row], ended: list[int]) -> dict[int, list[tuple]]:
        """Of the rows that ended (batch indices), those cut by their budget or an abort: their keys and values (of
        their input and tokens but the last, never fed) for the request that continues them (the prefix cache), taken
        out of the batch's cache in one gather a layer (views of it: a shorter row's share of the gather's padding is
        held until the last of them is taken or dropped)."""
        cut = [i for i in ended if rows[i].finish in ("length", "abort")]
        if self.engine.prefix_cache is None or not cut:
            return {}
        index = torch.tensor(cut, device=self.engine.device)
        width = max(rows[i].fed for i in cut)
        taken = [(layer.keys.index_select(0, index)[:, :, -width:], layer.values.index_select(0, index)[:, :, -width:])
                 for layer in self.cache.layers]
        return {i: [(k[n, :, -rows[i].fed:], v[n, :, -rows[i].fed:]) for k, v in taken] for n, i in enumerate(cut)}

    def _done(self, r: Row) -> None:
        """Under cond: row `r` has ended; its request is told when its last row has."""
        r.weight_version = self.engine.weight_version
        r.uniforms = None
        job = r.job
        job.left -= 1
        if job.left == 0:
            job.event.set()
